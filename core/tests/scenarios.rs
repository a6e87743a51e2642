//! The scenario files (`tests/scenarios/*.jsonl`, the engine's executable contract) replayed from
//! inside `tutti-core`, so that the engine's own test run — and `cargo mutants -p tutti-core` —
//! fails when an engine change breaks any of them. (`cargo test -p tutti-tests --test scenarios`
//! replays the same files and any other folder named by `TUTTI_SCENARIOS_DIR`.)

use std::path::PathBuf;
use tutti_core::scenario;

/// The workspace's scenario folder, next to this crate.
fn scenario_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("tests")
        .join("scenarios")
}

/// Every scenario file passes through the engine and the reference store, and checks something.
#[test]
fn every_scenario_file_passes_in_tutti_core() {
    let dir = scenario_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read scenario folder {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 50,
        "expected the checked-in scenario files, found {} in {}",
        files.len(),
        dir.display()
    );
    let texts: Vec<(String, String)> = files
        .iter()
        .map(|f| {
            let name = f.file_stem().unwrap_or_default().to_string_lossy();
            let text = std::fs::read_to_string(f).expect("readable scenario file");
            (name.to_string(), text)
        })
        .collect();
    let failures: Vec<String> = scenario::run_all(texts.iter().map(|(n, t)| (&**n, &**t)))
        .into_iter()
        .filter_map(|o| o.result.err().map(|e| format!("{}: {e}", o.name)))
        .collect();
    assert!(
        failures.is_empty(),
        "scenario failures:\n{}",
        failures.join("\n")
    );
}
