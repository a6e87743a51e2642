//! The cargo-fuzz targets on stable: every file of the checked-in seed corpus
//! (`fuzz/seeds/<target>/*`) goes through the same function the `fuzz_target!` wraps, plus a
//! few hundred deterministic pseudo-random inputs per target. Adding a crash that libFuzzer
//! found (`fuzz/artifacts/<target>/crash-*`) to `fuzz/seeds/<target>/` makes it a regression
//! test here.
//!
//! The targets live in the `tutti-testkit` crate (test tooling, not part of the library), which
//! the `fuzz/` crate wraps too.

use std::path::{Path, PathBuf};

/// The checked-in seeds of `target`. A missing or empty seed folder is an error, not zero seeds
/// (a renamed target or folder would otherwise pass on random inputs alone).
fn seeds(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/seeds")
        .join(target);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{target}: cannot read seed folder {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    assert!(
        !v.is_empty(),
        "{target}: seed folder {} holds no seeds",
        dir.display()
    );
    v.sort();
    v
}

/// splitmix64.
fn random_inputs(seed: u64, n: usize, max_len: usize) -> Vec<Vec<u8>> {
    let mut s = seed;
    let mut next = move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|_| {
            let len = (next() as usize) % max_len;
            (0..len).map(|_| next() as u8).collect()
        })
        .collect()
}

fn replay(target: &str, f: fn(&[u8]) -> Result<(), String>, randoms: usize) {
    let mut failures = Vec::new();
    let files = seeds(target);
    for p in &files {
        let data = std::fs::read(p).expect("seed file is readable");
        if let Err(e) = f(&data) {
            failures.push(format!("{}: {e}", p.display()));
        }
    }
    for (i, data) in random_inputs(target.len() as u64, randoms, 512)
        .iter()
        .enumerate()
    {
        if let Err(e) = f(data) {
            failures.push(format!("random input {i} ({:02x?}): {e}", data));
        }
    }
    assert!(
        failures.is_empty(),
        "{target}: {} failing inputs:\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!(
        "{target}: {} seeds and {randoms} random inputs passed",
        files.len()
    );
}

#[test]
fn engine_orderings_corpus() {
    replay("engine_orderings", tutti_testkit::try_engine_orderings, 400);
}

#[test]
fn acp_native_corpus() {
    replay("acp_native", tutti_testkit::try_acp_native, 100);
}

#[test]
fn codex_native_corpus() {
    replay("codex_native", tutti_testkit::try_codex_native, 100);
}

#[test]
fn claude_native_corpus() {
    replay("claude_native", tutti_testkit::try_claude_native, 100);
}

#[test]
fn store_roundtrip_corpus() {
    replay("store_roundtrip", tutti_testkit::store_roundtrip, 60);
}
