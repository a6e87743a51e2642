//! The codex adapter (in progress).
