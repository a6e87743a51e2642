//! The claude adapter (in progress).
