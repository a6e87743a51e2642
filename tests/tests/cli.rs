//! The `tutti` CLI against a real daemon and on scenario files / database files.

use std::process::Command;
use tutti_tests::daemon::{turn_of, TestDaemon};

const TUTTID: &str = env!("CARGO_BIN_EXE_tuttid-test");
const TUTTI: &str = env!("CARGO_BIN_EXE_tutti-test");

fn tutti(d: &TestDaemon, args: &[&str]) -> (bool, String) {
    let out = Command::new(TUTTI)
        .args(["--addr", &d.addr, "--token-file"])
        .arg(d.dir.path().join("token"))
        .args(["--workspace", "w1"])
        .args(args)
        .output()
        .expect("run tutti");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn cli_sessions_show_submit_cancel_and_snapshot() {
    let d = TestDaemon::start(TUTTID, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let id = d.create("w1", "demo");
    let (ok, out) = tutti(
        &d,
        &[
            "submit",
            &id,
            "children=2 hang=1 permission=0 fail=0 late=0",
        ],
    );
    assert!(ok, "{out}");
    assert!(out.contains("\"started\""), "{out}");
    d.wait_for("w1", &id, 30, "two children", |v| {
        v["childSessions"].as_array().is_some_and(|a| a.len() == 2)
    });
    let (ok, out) = tutti(&d, &["sessions"]);
    assert!(ok && out.contains(&id), "{out}");
    let (ok, out) = tutti(&d, &["show", &id]);
    assert!(ok, "{out}");
    assert_eq!(
        out.lines()
            .filter(|l| l.trim_start().starts_with("child "))
            .count(),
        2,
        "{out}"
    );
    assert!(
        out.contains("<- tool call"),
        "each lane under its spawning tool call: {out}"
    );
    let (ok, out) = tutti(&d, &["cancel", &id]);
    assert!(ok, "{out}");
    assert!(out.contains("operationId"), "{out}");
    let end = d.wait_for("w1", &id, 30, "root canceled", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"] == "canceled")
    });
    assert!(end["session"].get("activeTurnId").is_none(), "{end:#}");
    // The snapshot of the database file names the canceled root turn.
    let out = Command::new(TUTTI)
        .args(["snapshot", "--db"])
        .arg(d.db())
        .output()
        .expect("snapshot");
    assert!(out.status.success());
    let snap: serde_json::Value = serde_json::from_slice(&out.stdout).expect("snapshot JSON");
    let turns = snap[0]["turns"].as_array().expect("turns");
    assert!(turns.iter().any(|t| t["outcome"] == "canceled"));
}

#[test]
fn cli_replay_runs_a_scenario_in_memory_and_through_sqlite() {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scenarios/root_gate_provider_terminal_before_child_terminal.jsonl"
    );
    let out = Command::new(TUTTI)
        .args(["replay", file])
        .output()
        .expect("replay");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mem: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let dir = tempfile::tempdir().expect("dir");
    let db = dir.path().join("r.db");
    let out = Command::new(TUTTI)
        .args(["replay", "--db"])
        .arg(&db)
        .arg(file)
        .output()
        .expect("replay --db");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sql: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(mem, sql, "same final snapshot in memory and through SQLite");
    let out = Command::new(TUTTI)
        .args(["snapshot", "--db"])
        .arg(&db)
        .output()
        .expect("snapshot");
    let stored: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(stored, mem, "the file holds exactly the replayed state");
}

#[test]
fn cli_sessions_escapes_a_hostile_title() {
    let d = TestDaemon::start(TUTTID, None, &[]);
    let title = "evil\u{1b}]0;x\u{7}\u{1b}[2J\r\nfake line";
    let (ok, out) = tutti(&d, &["new", "demo", "--title", title]);
    assert!(ok, "{out}");
    let (ok, out) = tutti(&d, &["sessions"]);
    assert!(ok, "{out}");
    assert!(
        !out.chars().any(|c| c.is_control() && c != '\n'),
        "no control character reaches the terminal: {out:?}"
    );
    assert!(
        out.contains("\"evil\\u{1b}]0;x\\u{7}\\u{1b}[2J\\r\\nfake line\""),
        "{out}"
    );
    assert_eq!(out.lines().count(), 1, "{out:?}");
}
