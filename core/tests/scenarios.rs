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

/// Every scenario file passes through a `Driver` and the reference store, and checks something.
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

/// The driver's first guarantee ("nothing caused by a batch leaves the driver before that batch
/// is acknowledged"), seen through the scenario runner: an input whose batch the store does not
/// commit gets the driver's refusal, never its `expectLast` reply, and the driver reloads the
/// tree from the store (which the runner, feeding the engine directly, never did).
#[test]
fn a_reply_is_released_only_after_its_batch_commits() {
    use tutti_core::store::{MemoryStore, Store};
    use tutti_core::Driver;
    let first = r#"{"input":{"type":"createSession","agentSessionId":"R","workspaceId":"W","provider":"test"}}
{"at":1,"input":{"type":"submit","agentSessionId":"R","turnId":"T","text":"hi"}}
{"expectLast":{"reply":"started"}}
"#;
    let mut store = MemoryStore::new();
    assert_eq!(scenario::run(first, &mut Driver::new(), &mut store), Ok(1));

    // Another writer (the first run) already stored R: a new driver's createSession is decided
    // on a state that no longer holds, and the store's guard refuses its batch.
    let second = r#"{"at":5,"input":{"type":"createSession","agentSessionId":"R","workspaceId":"W","provider":"test"}}
{"expectLast":{"reply":"created"}}
"#;
    let mut driver = Driver::new();
    let err = scenario::run(second, &mut driver, &mut store).expect_err("the commit is refused");
    assert!(
        err.starts_with("line 1: store refused the step: the store refused the batch"),
        "{err}"
    );
    // The driver dropped its lost state and reloaded the tree: it holds the stored turn T.
    let stored = store.load_tree("R").expect("load").expect("stored tree");
    assert_eq!(driver.engine().snapshot("R"), Some(stored));
    assert!(driver.engine().turn("R", "T").is_some());
}
