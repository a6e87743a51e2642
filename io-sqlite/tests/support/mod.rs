//! Shared test support: the workload generator and the store comparisons.
#![allow(dead_code)]

pub mod compare;
pub mod workload;

use std::path::PathBuf;

/// A fresh database file in a new temporary directory (kept alive by the returned guard).
pub fn temp_db() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("tutti.db");
    (dir, path)
}
