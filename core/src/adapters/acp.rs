//! The acp adapter (in progress).
