//! The daemon itself: API errors, the event stream, and crash recovery, with a real `tuttid`
//! process, a real SQLite file and the real demo ACP agent.

use serde_json::json;
use std::collections::BTreeSet;
use tutti_tests::daemon::{turn_of, TestDaemon};

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const WS: &str = "w1";

#[test]
fn malformed_and_unauthorized_requests_get_typed_errors_and_change_nothing() {
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let base = format!("/v1/workspaces/{WS}/agent-sessions");
    let (st, v) = d.raw("POST", &base, "{not json", true);
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["code"], "invalid");
    let (st, v) = d.raw("POST", &base, r#"{"provider": 7}"#, true);
    assert_eq!(st, 400, "{v}");
    let (st, v) = d.raw("POST", &base, r#"{"provider": "nope"}"#, true);
    assert_eq!(st, 400, "{v}");
    let (st, v) = d.raw("POST", &base, r#"{"provider": "demo"}"#, false);
    assert_eq!(st, 401, "{v}");
    let big = format!(r#"{{"text": "{}"}}"#, "x".repeat(300 * 1024));
    let id = d.create(WS, "demo");
    let (st, _) = d.raw("POST", &format!("{base}/{id}/submit"), &big, true);
    assert!(st == 413 || st == 400, "oversized body refused: {st}");
    let (st, v) = d.call("GET", &format!("{base}/nope"), None);
    assert_eq!(st, 404, "{v}");
    let (st, v) = d.call(
        "GET",
        &format!("/v1/workspaces/other/agent-sessions/{id}"),
        None,
    );
    assert_eq!(st, 404, "another workspace does not see it: {v}");
    let (st, v) = d.call(
        "POST",
        &format!("{base}/{id}/turns/t_nope/cancel"),
        Some(json!({})),
    );
    assert_eq!(st, 404, "{v}");
    let (_, list) = d.call("GET", &base, None);
    assert_eq!(
        list["sessions"].as_array().unwrap().len(),
        1,
        "nothing else was created"
    );
}

#[test]
fn lists_are_roots_only_and_delete_removes_the_tree() {
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let id = d.create(WS, "demo");
    d.submit(WS, &id, "children=2 permission=0 fail=0 late=0");
    let (st, _) = d.call(
        "DELETE",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}"),
        None,
    );
    assert_eq!(st, 409, "deleting an active tree is refused");
    let end = d.wait_for(WS, &id, 30, "root settled", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"].is_string())
    });
    assert_eq!(end["childSessions"].as_array().unwrap().len(), 2);
    let (_, list) = d.call("GET", &format!("/v1/workspaces/{WS}/agent-sessions"), None);
    assert_eq!(
        list["sessions"].as_array().unwrap().len(),
        1,
        "children are not listed"
    );
    let child = end["childSessions"][0]["id"].as_str().unwrap().to_string();
    let (st, _) = d.call(
        "DELETE",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}"),
        None,
    );
    assert_eq!(st, 200);
    let (st, _) = d.call(
        "GET",
        &format!("/v1/workspaces/{WS}/agent-sessions/{child}"),
        None,
    );
    assert_eq!(st, 404, "no orphan remains");
}

#[test]
fn sse_resume_after_disconnect_loses_nothing() {
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let id = d.create(WS, "demo");
    d.submit(WS, &id, "children=2 permission=0 fail=0 late=0");
    d.wait_for(WS, &id, 30, "root settled", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"].is_string())
    });
    let all = d.events(Some(0), None, usize::MAX, 2);
    assert!(all.len() > 10, "a run publishes many rows: {}", all.len());
    let seqs: Vec<u64> = all.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "gap-free from 1"
    );
    // Read a few, disconnect, resume with Last-Event-ID: the union is everything, once.
    let first = d.events(None, Some(0), 5, 5);
    let last = first.last().unwrap()["seq"].as_u64().unwrap();
    let rest = d.events(None, Some(last), all.len() - 5, 5);
    let got: Vec<u64> = first
        .iter()
        .chain(rest.iter())
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    // Not deduplicated: a row delivered twice across the resume is a failure.
    assert_eq!(got, seqs, "every row exactly once, in order");
}

#[test]
fn kill_9_mid_turn_then_restart_leaves_no_turn_active_and_no_event_lost() {
    let mut d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "2")]);
    let id = d.create(WS, "demo");
    d.submit(WS, &id, "children=3 hang=1,2,3 permission=0 fail=0 late=0");
    d.wait_for(WS, &id, 30, "children running", |v| {
        v["childSessions"].as_array().is_some_and(|a| a.len() == 3)
    });
    let before = d.events(Some(0), None, usize::MAX, 1);
    d.restart();
    let end = d.detail(WS, &id);
    assert!(
        end["session"].get("activeTurnId").is_none(),
        "no turn stays active"
    );
    let t = turn_of(&end, &id).unwrap();
    assert_eq!(t["outcome"], "interrupted");
    for c in end["childSessions"].as_array().unwrap() {
        let ct = turn_of(&end, c["id"].as_str().unwrap()).unwrap();
        assert_eq!(ct["outcome"], "interrupted", "{ct}");
        assert!(ct["error"].as_str().unwrap().contains("restarted"));
    }
    let after = d.events(Some(0), None, usize::MAX, 1);
    let seqs: BTreeSet<u64> = after.iter().map(|e| e["seq"].as_u64().unwrap()).collect();
    assert_eq!(seqs.len(), after.len(), "a row was delivered twice");
    for e in &before {
        assert!(seqs.contains(&e["seq"].as_u64().unwrap()), "event lost");
    }
    assert_eq!(seqs.len() as u64, *seqs.iter().last().unwrap(), "gap-free");
    // The daemon works after the restart: a new turn on the same session.
    let (reply, _) = d.submit(WS, &id, "children=1 permission=0 fail=0 late=0");
    assert_eq!(reply, "started");
    let end = d.wait_for(WS, &id, 30, "new turn settled", |v| {
        turn_of(v, &id).is_some_and(|t| t["outcome"] == "completed")
    });
    assert!(end["session"].get("activeTurnId").is_none());
}

/// Issue 19: "An internal inconsistency is not `Rejected::Invalid` answered to an API caller as
/// 400: it is a distinct internal error, logged, and answered as 500." A stored root whose
/// `activeTurnId` names a turn the file does not hold (the row lost outside the daemon) is
/// loaded after a restart; a submit to it is the daemon's inconsistency, not the caller's
/// fault: 500 `internal`, and nothing is recorded.
#[test]
fn an_engine_inconsistency_in_a_stored_tree_is_answered_500_internal() {
    let mut d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let id = d.create(WS, "demo");
    d.kill9();
    let changed = rusqlite::Connection::open(d.db())
        .and_then(|c| {
            c.execute(
                "UPDATE sessions SET active_turn_id = 'ghost', \
                 json = json_set(json, '$.activeTurnId', 'ghost') WHERE id = ?1",
                [&id],
            )
        })
        .expect("edit the stored session");
    assert_eq!(changed, 1);
    d.restart();
    let submit = format!("/v1/workspaces/{WS}/agent-sessions/{id}/submit");
    let (st, v) = d.call("POST", &submit, Some(json!({"text": "hello"})));
    assert_eq!(st, 500, "{v}");
    assert_eq!(v["error"]["code"], "internal", "{v}");
    let detail = d.detail(WS, &id);
    assert_eq!(
        detail["session"]["activeTurnId"], "ghost",
        "nothing changed: {detail}"
    );
    assert!(
        turn_of(&detail, &id).is_none(),
        "no turn was made: {detail}"
    );
    // A caller's own mistake on the same tree is still a 4xx.
    let (st, v) = d.call("POST", &submit, Some(json!({"text": 7})));
    assert_eq!(st, 400, "{v}");
}

/// Issue 36 item 6: "after `DELETE` the API answers 404, but `GET /v1/events?after=0` still
/// streams the deleted session's prompt text until retention removes it, and the deleted
/// session's row with its title stays forever." A marker in the title and the prompt, and the
/// demo agent's own message and tool call texts, are readable before the deletion and through
/// no route after it: the root list, the detail and messages of every session of the tree,
/// the event stream from 0 (still gap-free), the same reads with the web view's cookie, nor the
/// bytes of the SQLite file and its WAL after a checkpoint.
#[test]
fn a_deleted_tree_leaves_no_text_in_any_route_the_event_stream_or_the_file() {
    const MARK: &str = "zq7-deleted-marker";
    // The demo agent's own texts: a message of the root and a tool call title.
    const AGENT_TEXT: [&str; 2] = ["Splitting the work across", "Delegate to"];
    let d = TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "8")]);
    let base = format!("/v1/workspaces/{WS}/agent-sessions");
    let (st, v) = d.call(
        "POST",
        &base,
        Some(json!({"provider": "demo", "title": format!("title {MARK}")})),
    );
    assert_eq!(st, 201, "{v}");
    let id = v["session"]["id"].as_str().expect("id").to_string();
    let (_, turn) = d.submit(
        WS,
        &id,
        &format!("children=2 permission=0 fail=0 late=0 {MARK}"),
    );
    let end = d.wait_for(WS, &id, 30, "the turn settled", |v| {
        v["session"]["lastTurnId"] == turn.as_str() && v["session"].get("activeTurnId").is_none()
    });
    let mut tree = vec![id.clone()];
    for c in end["childSessions"].as_array().expect("children") {
        tree.push(c["id"].as_str().expect("child id").to_string());
    }
    assert_eq!(tree.len(), 3);
    let last = end["eventSeq"].as_u64().expect("eventSeq");
    let all_text = |rows: &[serde_json::Value]| serde_json::to_string(rows).unwrap_or_default();
    let before = all_text(&d.events(Some(0), None, last as usize, 10));
    for text in [MARK].iter().chain(&AGENT_TEXT) {
        assert!(before.contains(text), "{text:?} readable before: {before}");
    }
    let (st, v) = d.call("DELETE", &format!("{base}/{id}"), None);
    assert_eq!(st, 200, "{v}");
    let mut read = Vec::new();
    let (st, list) = d.call("GET", &base, None);
    assert_eq!(st, 200);
    read.push(list.clone());
    for s in &tree {
        for path in [format!("{base}/{s}"), format!("{base}/{s}/messages")] {
            let (st, v) = d.call("GET", &path, None);
            assert_eq!(st, 404, "{path}: {v}");
            read.push(v);
        }
    }
    // The web view reads the same routes with its login cookie (no bearer header).
    let port = d.addr.rsplit(':').next().unwrap_or_default();
    let web = |path: &str| -> (u16, serde_json::Value) {
        let r = ureq::get(&format!("http://{}{path}", d.addr))
            .set("cookie", &format!("tutti_token_{port}={}", d.token))
            .timeout(std::time::Duration::from_secs(10))
            .call();
        match r {
            Ok(r) => (r.status(), r.into_json().unwrap_or_default()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap_or_default()),
            Err(e) => panic!("{path}: {e}"),
        }
    };
    let (st, v) = web(&base);
    assert_eq!(st, 200, "the cookie is accepted: {v}");
    read.push(v);
    for s in &tree {
        let (st, v) = web(&format!("{base}/{s}"));
        assert_eq!(st, 404, "{v}");
        read.push(v);
    }
    let now = list["eventSeq"].as_u64().expect("eventSeq");
    assert!(now > last, "the deletion is published");
    let rows = d.events(Some(0), None, now as usize, 10);
    let seqs: Vec<u64> = rows.iter().filter_map(|r| r["seq"].as_u64()).collect();
    assert_eq!(
        seqs,
        (1..=now).collect::<Vec<_>>(),
        "the stream stays gap-free"
    );
    assert!(rows
        .iter()
        .any(|r| r["kind"] == "redacted" && r["payload"]["agentSessionId"] == id.as_str()));
    read.extend(rows);
    let after = all_text(&read);
    for text in [MARK].iter().chain(&AGENT_TEXT) {
        assert!(!after.contains(text), "{text:?} still readable: {after}");
    }
    // The file: once the WAL is checkpointed (an outside connection may do that), neither the
    // database nor its WAL holds any of the texts.
    let db = d.db();
    let conn = rusqlite::Connection::open(&db).expect("open the file");
    let mut truncated = false;
    for _ in 0..200 {
        let busy: i64 = conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))
            .expect("checkpoint");
        if busy == 0 {
            truncated = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(truncated, "the WAL was checkpointed");
    let mut wal = db.clone().into_os_string();
    wal.push("-wal");
    for path in [db.clone(), wal.into()] {
        let bytes = std::fs::read(&path).unwrap_or_default();
        for text in [MARK].iter().chain(&AGENT_TEXT) {
            assert!(
                !bytes.windows(text.len()).any(|w| w == text.as_bytes()),
                "{text:?} still in the bytes of {}",
                path.display()
            );
        }
    }
}
