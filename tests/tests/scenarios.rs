//! Replays every scenario file through the engine and the in-memory reference store.
//!
//! `cargo test -p tutti-tests --test scenarios` runs `tests/scenarios/*.jsonl`; with
//! `TUTTI_SCENARIOS_DIR` set it runs every `*.jsonl` in that folder instead. One `PASS name` /
//! `FAIL name: reason` line per file; the test fails if any failed.

use std::path::PathBuf;
use tutti_core::store::MemoryStore;
use tutti_core::{scenario, Engine};

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
    let mut failed = 0;
    for f in &files {
        let name = f
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let text = std::fs::read_to_string(f).expect("readable scenario file");
        let mut engine = Engine::new();
        let mut store = MemoryStore::new();
        match scenario::run(&text, &mut engine, &mut store) {
            Ok(0) => {
                failed += 1;
                println!("FAIL {name}: the scenario checks nothing");
            }
            Ok(_) => println!("PASS {name}"),
            Err(e) => {
                failed += 1;
                println!("FAIL {name}: {e}");
            }
        }
    }
    println!("{} passed, {} failed", files.len() - failed, failed);
    if failed > 0 {
        std::process::exit(1);
    }
}
