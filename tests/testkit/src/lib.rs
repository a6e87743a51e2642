//! Test tooling of tutti, kept out of the library (`publish = false`). Used by the cross-crate
//! tests (`tutti-tests`), by `tutti-sqlite`'s tests and benchmark (as a dev-dependency), and by
//! the cargo-fuzz targets (`fuzz/`, which are thin wrappers around the functions here).
//!
//! Every fuzz target takes raw bytes and either returns `Ok` or describes the broken rule; the
//! `fuzz_target!` wrappers panic on `Err`, so libFuzzer records the input as a crash. A panic
//! inside the engine or an adapter is a crash too. The same functions run on stable as
//! `tests/tests/fuzz_corpus.rs` over the checked-in seed corpus (`fuzz/seeds/<target>/*`), and the
//! seeded simulation (`tutti_tests::sim`) reuses [`History`] and [`check_all`].
//!
//! - [`engine_orderings`]: a tree decoded from the bytes
//!   ([`Bytes`], a tiny byte-driven decoder; an exhausted input reads as zeros, which always means
//!   "the simplest choice"), its provider facts in two causal interleavings that must reach the
//!   same final state, then the facts interleaved with commands ([`orderings`]).
//! - [`acp_native`], [`codex_native`],
//!   [`claude_native`]: native lines through the real adapter and the
//!   engine ([`LineDriver`]).
//! - [`store_roundtrip`]: an engine workload committed to the
//!   reference store and to a real SQLite file, which must agree ([`roundtrip`]).
//! - [`workload`] and [`compare`]: the SQLite equivalence/crash/benchmark workload generator and
//!   the store comparisons; the crash loop binary `tutti-sqlite-crashloop` and its test
//!   (`tests/crash.rs`) live in this crate too.
#![warn(missing_docs)]

pub mod bytes;
pub mod checks;
#[allow(missing_docs)]
pub mod compare;
pub mod harness;
pub mod native;
pub mod orderings;
pub mod roundtrip;
#[allow(missing_docs)]
pub mod workload;

pub use bytes::Bytes;
pub use checks::{check_all, check_one, unsettled, History};
pub use harness::{Harness, MAX_INPUTS};
pub use native::{
    acp_native, claude_native, codex_native, try_acp_native, try_claude_native, try_codex_native,
    LineDriver, MAX_LINES,
};
pub use orderings::{engine_orderings, engine_workload, meaning, try_engine_orderings};
pub use roundtrip::store_roundtrip;

/// A fresh database file path in a new temporary directory (kept alive by the returned guard).
///
/// # Panics
/// When no temporary directory can be created (test tooling only).
pub fn temp_db() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("tutti.db");
    (dir, path)
}
