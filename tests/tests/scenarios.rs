//! Replays every scenario file through a `Driver` and the in-memory reference store
//! ([`tutti_core::scenario::run_all`], the loop `tutti-core`'s own scenario test shares).
//!
//! `cargo test -p tutti-tests --test scenarios` runs `tests/scenarios/*.jsonl`; with
//! `TUTTI_SCENARIOS_DIR` set it runs every `*.jsonl` in that folder instead. One `PASS name` /
//! `FAIL name: reason` line per file; the test fails if any failed.

use std::path::PathBuf;
use tutti_core::scenario;

fn scenario_files() -> Vec<PathBuf> {
    let dir = std::env::var_os("TUTTI_SCENARIOS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read scenario folder {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    files
}

fn main() {
    let files = scenario_files();
    assert!(!files.is_empty(), "no scenario files found");
    let texts: Vec<(String, String)> = files
        .iter()
        .map(|f| {
            let name = f.file_stem().unwrap_or_default().to_string_lossy();
            let text = std::fs::read_to_string(f).expect("readable scenario file");
            (name.to_string(), text)
        })
        .collect();
    let mut failed = 0;
    for o in scenario::run_all(texts.iter().map(|(n, t)| (&**n, &**t))) {
        match o.result {
            Ok(_) => println!("PASS {}", o.name),
            Err(e) => {
                failed += 1;
                println!("FAIL {}: {e}", o.name);
            }
        }
    }
    println!("{} passed, {} failed", files.len() - failed, failed);
    if failed > 0 {
        std::process::exit(1);
    }
}
