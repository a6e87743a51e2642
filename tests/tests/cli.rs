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

/// Submits `text` to `id` and waits until that turn settled.
fn run_turn(d: &TestDaemon, id: &str, text: &str) {
    let (_, turn) = d.submit("w1", id, text);
    d.wait_for("w1", id, 60, "the turn settled", |v| {
        v["session"]["lastTurnId"] == turn.as_str() && v["session"].get("activeTurnId").is_none()
    });
}

/// Polls `buf` (bounded, 60 s) until `pred` holds; returns its text then.
fn wait_text(
    buf: &std::sync::Arc<std::sync::Mutex<String>>,
    what: &str,
    pred: impl Fn(&str) -> bool,
) -> String {
    for _ in 0..1200 {
        let text = buf.lock().expect("buffer").clone();
        if pred(&text) {
            return text;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("never happened: {what}: {:?}", buf.lock().expect("buffer"));
}

/// Copies everything `r` yields into a shared buffer, on a thread of its own.
fn collect(mut r: impl std::io::Read + Send + 'static) -> std::sync::Arc<std::sync::Mutex<String>> {
    let buf = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let out = buf.clone();
    std::thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        while let Ok(n) = r.read(&mut chunk) {
            if n == 0 {
                break;
            }
            out.lock()
                .expect("buffer")
                .push_str(&String::from_utf8_lossy(&chunk[..n]));
        }
    });
    buf
}

/// Issue 36 item 7: "`tutti watch ID` follows the stream from sequence 0 and redraws on every
/// row of every session." It follows from the position of its first read (`eventSeq`, not 0)
/// and redraws only for rows of the watched tree: another tree busy before and during the
/// watch causes no redraw, the watched tree's own turn does.
#[test]
fn cli_watch_starts_at_the_read_position_and_redraws_only_for_its_tree() {
    let d = TestDaemon::start(TUTTID, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let watched = d.create("w1", "demo");
    let busy = d.create("w1", "demo");
    let script = "children=2 permission=0 fail=0 late=0";
    run_turn(&d, &busy, script);
    let before = d.detail("w1", &watched)["eventSeq"]
        .as_u64()
        .expect("eventSeq");
    assert!(before > 0, "the other tree wrote rows");
    let mut child = Command::new(TUTTI)
        .args(["--addr", &d.addr, "--token-file"])
        .arg(d.dir.path().join("token"))
        .args(["--workspace", "w1", "watch", &watched])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run tutti watch");
    let stdout = collect(child.stdout.take().expect("stdout"));
    let stderr = collect(child.stderr.take().expect("stderr"));
    let said = wait_text(&stderr, "the position followed", |t| t.contains('\n'));
    let after: u64 = said
        .trim()
        .rsplit(' ')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("watching ... after event N: {said:?}"));
    assert!(
        after >= before,
        "follows after the read's eventSeq ({after}), not from 0 (seq {before} was current)"
    );
    // The other tree works while the watch follows; then the watched tree does.
    run_turn(&d, &busy, script);
    run_turn(&d, &watched, script);
    let text = wait_text(&stdout, "the watched turn drawn", |t| t.contains("settled"));
    let _ = child.kill();
    let _ = child.wait();
    let redraws = text.lines().filter(|l| *l == "----").count();
    // Every row since the watch's position, by tree.
    let last = d.detail("w1", &watched)["eventSeq"]
        .as_u64()
        .expect("eventSeq");
    let rows = d.events(Some(after), None, (last - after) as usize, 10);
    assert_eq!(rows.len() as u64, last - after, "every row read back");
    let own = rows
        .iter()
        .filter(|r| r["rootAgentSessionId"] == watched.as_str())
        .count();
    let other = rows.len() - own;
    assert!(other > 0, "the other tree wrote rows during the watch");
    assert!(redraws >= 1, "its own turn redraws it: {text}");
    assert!(
        redraws <= own,
        "{redraws} redraws for {own} rows of the watched tree ({other} of the other): {text}"
    );
}
