//! tutti-tokio (work in progress).
#![warn(missing_docs)]
