//! The scenarios of "root provider facts belong to the provider turn they name" (issue 18) run
//! through the `tutti replay` CLI in memory and through a real SQLite file (`--db`), with the
//! same final snapshot, and the file's own snapshot agrees after the run.

use std::path::PathBuf;
use std::process::Command;

const TUTTI: &str = env!("CARGO_BIN_EXE_tutti-test");

const SCENARIOS: &[&str] = &[
    "late_provider_terminal_after_cancel_never_settles_next_root_turn",
    "late_provider_terminal_after_cancel_never_settles_next_root_turn_with_nested_children",
    "repeated_provider_completion_never_settles_next_root_turn",
    "repeated_provider_completion_never_settles_next_root_turn_with_nested_children",
    "late_provider_terminal_while_next_provider_turn_runs_is_recorded_on_its_own_turn",
    "late_provider_terminal_while_next_provider_turn_runs_is_recorded_on_its_own_turn_with_nested_children",
    "repeated_provider_start_is_not_adopted_by_next_root_turn",
    "repeated_provider_start_is_not_adopted_by_next_root_turn_with_nested_children",
    "earlier_provider_turn_of_a_guided_root_turn_never_settles_next_root_turn",
    "provider_turn_named_with_another_root_turn_is_rejected",
];

fn replay(args: &[&std::ffi::OsStr]) -> serde_json::Value {
    let out = Command::new(TUTTI)
        .arg("replay")
        .args(args)
        .output()
        .expect("run tutti replay");
    assert!(
        out.status.success(),
        "tutti replay {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("replay prints JSON")
}

#[test]
fn root_provider_turn_scenarios_replay_identically_in_memory_and_through_sqlite() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let tmp = tempfile::tempdir().expect("temp dir");
    for name in SCENARIOS {
        let file = dir.join(format!("{name}.jsonl"));
        assert!(file.exists(), "missing scenario {name}");
        let mem = replay(&[file.as_os_str()]);
        let db = tmp.path().join(format!("{name}.db"));
        let sql = replay(&["--db".as_ref(), db.as_os_str(), file.as_os_str()]);
        assert_eq!(mem, sql, "{name}: same result in memory and through SQLite");
        let out = Command::new(TUTTI)
            .args(["snapshot", "--db"])
            .arg(&db)
            .output()
            .expect("snapshot");
        assert!(out.status.success(), "{name}: snapshot --db");
        let stored: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(
            stored, mem,
            "{name}: the file holds exactly the replayed state"
        );
        let turns = stored[0]["turns"].as_array().expect("stored turns");
        assert!(
            turns
                .iter()
                .any(|t| t["rootProviderTurn"]["phase"] == "completed"),
            "{name}: the stored tree keeps the root provider lifecycle"
        );
    }
}
