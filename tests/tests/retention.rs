//! Issue 17, item 3 with the real `tuttid` process: settled trees leave memory and a later
//! submit still works, the session `cwd` given at creation is in the file after a SIGKILL and
//! restart, and an SSE client resuming below the outbox retention horizon gets the documented
//! `event: reset` before the kept rows.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};
use tutti_tests::daemon::{turn_of, TestDaemon};

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const WS: &str = "w1";

/// Every tree evicted as soon as it settles; the outbox keeps 5 rows, pruned every second.
const CONFIG: &str = r#"
[retention]
resident_trees = 0
outbox_keep_rows = 5
outbox_keep_secs = 0
prune_interval_secs = 1
"#;

/// One SSE event: (event name, id, data).
type Sse = (String, u64, Value);

/// Reads up to `n` SSE events (`after` as `Last-Event-ID`), for at most `secs`.
fn sse(d: &TestDaemon, last_event_id: Option<u64>, n: usize, secs: u64) -> Vec<Sse> {
    let mut req = ureq::get(&format!("http://{}/v1/events", d.addr))
        .set("authorization", &format!("Bearer {}", d.token))
        .timeout(Duration::from_secs(secs));
    if let Some(l) = last_event_id {
        req = req.set("last-event-id", &l.to_string());
    }
    let mut out = Vec::new();
    let Ok(resp) = req.call() else {
        return out;
    };
    let (mut event, mut id) = (String::from("message"), 0u64);
    for line in BufReader::new(resp.into_reader()).lines() {
        let Ok(line) = line else { break };
        if let Some(v) = line.strip_prefix("event:") {
            event = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("id:") {
            id = v.trim().parse().expect("numeric id");
        } else if let Some(v) = line.strip_prefix("data:") {
            let data = serde_json::from_str(v.trim()).expect("JSON data");
            out.push((std::mem::take(&mut event), id, data));
            event = "message".into();
            if out.len() >= n {
                break;
            }
        }
    }
    out
}

fn settle(d: &TestDaemon, id: &str, turn: &str) -> Value {
    d.wait_for(WS, id, 60, "root settled", |v| {
        turn_of(v, id).is_some_and(|t| t["id"] == turn && t["outcome"].is_string())
            && v["childSessions"]
                .as_array()
                .is_some_and(|cs| cs.iter().all(|c| c["activeTurnId"].is_null()))
    })
}

#[test]
fn evicted_trees_take_later_submits_and_resuming_below_the_horizon_gets_a_reset_event() {
    let d = TestDaemon::start(EXE, Some(CONFIG), &[("TUTTI_DEMO_SPEED", "8")]);
    let id = d.create(WS, "demo");
    let (_, t1) = d.submit(WS, &id, "children=2 permission=0 fail=0 late=0");
    let first = settle(&d, &id, &t1);
    // The tree left memory when it settled; the next submit reloads it and runs normally.
    let (reply, t2) = d.submit(WS, &id, "children=1 permission=0 fail=0 late=0");
    assert_eq!(reply, "started");
    let second = settle(&d, &id, &t2);
    assert_eq!(second["session"]["lastTurnId"], t2.as_str());
    assert_eq!(
        second["childSessions"].as_array().map(Vec::len),
        Some(3),
        "the second turn's child joins the same tree: {second}"
    );
    for c in first["childSessions"].as_array().expect("children") {
        assert!(
            second["childSessions"]
                .as_array()
                .is_some_and(|cs| cs.iter().any(|x| x["id"] == c["id"])),
            "earlier children are still there"
        );
    }
    // Wait for retention to prune (the stream from the start no longer begins at 1).
    let start = Instant::now();
    let kept = loop {
        let all = sse(&d, None, 1000, 2);
        if all.first().is_some_and(|e| e.1 > 1) {
            break all;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "retention never pruned"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let oldest = kept[0].1;
    assert!(kept.iter().all(|e| e.0 != "reset"), "position 0: no reset");
    // A client resuming at 1 (rows 2.. are gone) gets the reset event first, then the kept rows.
    let resumed = sse(&d, Some(1), kept.len() + 1, 2);
    let (event, rid, data) = &resumed[0];
    assert_eq!(event, "reset", "{resumed:?}");
    let pruned = data["prunedThrough"].as_u64().expect("prunedThrough");
    assert_eq!(
        data,
        &json!({"requestedAfter": 1, "prunedThrough": pruned, "oldestSeq": pruned + 1})
    );
    assert_eq!(*rid, pruned, "a reconnect after the reset resumes after it");
    assert!(pruned + 1 >= oldest);
    let ids: Vec<u64> = resumed[1..].iter().map(|e| e.1).collect();
    assert_eq!(ids.first(), Some(&(pruned + 1)), "then the oldest kept row");
    assert!(
        ids.windows(2).all(|w| w[1] == w[0] + 1),
        "gap-free after the reset: {ids:?}"
    );
    assert!(resumed[1..].iter().all(|e| e.0 != "reset"), "one reset");
}

#[test]
fn the_cwd_given_at_creation_is_in_the_file_after_a_sigkill_and_restart() {
    let mut d = TestDaemon::start(EXE, Some(CONFIG), &[("TUTTI_DEMO_SPEED", "8")]);
    let cwd = d.dir.path().to_string_lossy().into_owned();
    let (st, v) = d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions"),
        Some(json!({"provider": "demo", "cwd": cwd})),
    );
    assert_eq!(st, 201, "{v}");
    let id = v["session"]["id"].as_str().expect("id").to_string();
    d.kill9();
    {
        let db = tutti_sqlite::SqliteStore::open(d.db()).expect("open");
        assert_eq!(
            db.session_cwd(&id).expect("read").as_deref(),
            Some(cwd.as_str())
        );
    }
    d.restart();
    let (_, t) = d.submit(WS, &id, "children=0 permission=0 fail=0 late=0");
    settle(&d, &id, &t);
}
