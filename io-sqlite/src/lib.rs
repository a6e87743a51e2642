//! tutti-sqlite (work in progress).
#![warn(missing_docs)]
