//! End-to-end through the HTTP API of a real `tuttid` process, a real SQLite file and real ACP
//! agent processes (the bundled demo agent with subagents, and the plain root-only agent).

use serde_json::{json, Value};
use std::time::Duration;
use tutti_tests::daemon::{children, turn_of, TestDaemon};

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const WS: &str = "w1";

fn daemon() -> TestDaemon {
    TestDaemon::start(EXE, None, &[("TUTTI_DEMO_SPEED", "8")])
}

fn phase(d: &Value, session: &str) -> String {
    turn_of(d, session)
        .map(|t| t["phase"].as_str().unwrap_or("").to_string())
        .unwrap_or_default()
}

fn outcome(d: &Value, session: &str) -> Option<String> {
    turn_of(d, session).and_then(|t| t["outcome"].as_str().map(String::from))
}

fn settled(d: &Value, session: &str) -> bool {
    outcome(d, session).is_some()
}

#[test]
fn root_turn_waits_for_a_background_child_then_settles() {
    let d = daemon();
    let id = d.create(WS, "demo");
    let (reply, turn) = d.submit(WS, &id, "children=2 late=2 permission=0 fail=0");
    assert_eq!(reply, "started");
    // The root provider turn completes while the background child still runs: root waits.
    let seen = d.wait_for(WS, &id, 30, "root waiting on its child", |v| {
        let t = turn_of(v, &id);
        t.is_some_and(|t| t["rootProviderTurn"]["phase"] == "completed" && t["phase"] == "waiting")
    });
    assert!(children(&seen)
        .iter()
        .any(|c| !settled(&seen, c["id"].as_str().unwrap())));
    let end = d.wait_for(WS, &id, 30, "root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
    assert_eq!(turn_of(&end, &id).unwrap()["id"], turn.as_str());
    for c in children(&end) {
        assert!(
            settled(&end, c["id"].as_str().unwrap()),
            "every child settled"
        );
        assert_eq!(c["rootTurnId"], turn.as_str());
    }
    assert_eq!(children(&end).len(), 2);
}

#[test]
fn a_failed_child_does_not_fail_the_root() {
    let d = daemon();
    let id = d.create(WS, "demo");
    d.submit(WS, &id, "children=2 fail=1 permission=0 late=0");
    let end = d.wait_for(WS, &id, 30, "root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
    let outcomes: Vec<String> = children(&end)
        .iter()
        .filter_map(|c| outcome(&end, c["id"].as_str().unwrap()))
        .collect();
    assert!(outcomes.contains(&"failed".to_string()), "{outcomes:?}");
}

#[test]
fn nested_children_keep_the_root_relation() {
    let d = daemon();
    let id = d.create(WS, "demo");
    d.submit(WS, &id, "children=1 nested=1 permission=0 fail=0 late=0");
    let end = d.wait_for(WS, &id, 30, "root settled", |v| settled(v, &id));
    let kids = children(&end);
    assert_eq!(kids.len(), 2, "a child and a grandchild: {kids:?}");
    let grandchild = kids
        .iter()
        .find(|k| k["parentAgentSessionId"] != id.as_str())
        .expect("grandchild");
    assert_eq!(grandchild["rootAgentSessionId"], id.as_str());
}

#[test]
fn cancel_of_a_root_with_running_children_settles_everything_and_nothing_resurrects() {
    let d = daemon();
    let id = d.create(WS, "demo");
    let (_, turn) = d.submit(WS, &id, "children=2 hang=1,2 permission=0 fail=0 late=0");
    d.wait_for(WS, &id, 30, "two running children", |v| {
        children(v).len() == 2
            && children(v)
                .iter()
                .all(|c| phase(v, c["id"].as_str().unwrap()) == "running")
    });
    let (st, v) = d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/{turn}/cancel"),
        Some(json!({})),
    );
    assert_eq!(st, 202, "{v}");
    assert!(v["operationId"].is_string());
    let end = d.wait_for(WS, &id, 30, "root canceled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("canceled"));
    assert!(turn_of(&end, &id).unwrap().get("error").is_none());
    for c in children(&end) {
        let o = outcome(&end, c["id"].as_str().unwrap());
        assert!(
            matches!(o.as_deref(), Some("canceled") | Some("interrupted")),
            "{o:?}"
        );
    }
    // Nothing resurrects: read the event stream from the start for a while (late provider
    // events have time to arrive), then recheck the root, every child and every row.
    let events = d.events(Some(0), None, usize::MAX, 1);
    let later = d.detail(WS, &id);
    assert_eq!(outcome(&later, &id).as_deref(), Some("canceled"));
    assert!(
        later["session"].get("activeTurnId").is_none(),
        "nothing resurrects"
    );
    let kids = children(&later);
    assert_eq!(kids.len(), 2, "no child appeared after the cancel");
    for c in &kids {
        let cid = c["id"].as_str().unwrap();
        assert!(c.get("activeTurnId").is_none(), "{c:#}");
        assert_eq!(outcome(&later, cid), outcome(&end, cid), "{cid} changed");
    }
    let seqs: Vec<u64> = events.iter().filter_map(|e| e["seq"].as_u64()).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "every row once, gap-free"
    );
    let root_settled = events
        .iter()
        .position(|e| {
            e["kind"] == "turn"
                && e["payload"]["id"] == turn.as_str()
                && e["payload"]["phase"] == "settled"
        })
        .expect("the root's settled row was published");
    let reopened: Vec<&Value> = events[root_settled..]
        .iter()
        .filter(|e| e["kind"] == "turn" && e["payload"]["phase"] != "settled")
        .collect();
    assert!(
        reopened.is_empty(),
        "turns reopened after the cancel: {reopened:#?}"
    );
}

#[test]
fn child_only_cancel_leaves_the_root_running_and_it_settles_completed() {
    let d = daemon();
    let id = d.create(WS, "demo");
    d.submit(WS, &id, "children=2 hang=1 permission=0 fail=0 late=0");
    let v = d.wait_for(WS, &id, 30, "the hanging child", |v| {
        children(v)
            .iter()
            .any(|c| phase(v, c["id"].as_str().unwrap()) == "running")
    });
    let hanging = children(&v)
        .into_iter()
        .find(|c| c["title"].as_str().unwrap_or("").contains("explorer"))
        .unwrap_or_else(|| children(&v)[0].clone());
    let cid = hanging["id"].as_str().unwrap().to_string();
    let ct = turn_of(&v, &cid).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (st, _) = d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{cid}/turns/{ct}/cancel"),
        Some(json!({})),
    );
    assert_eq!(st, 202);
    let end = d.wait_for(WS, &id, 30, "root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &cid).as_deref(), Some("canceled"));
    assert_eq!(
        outcome(&end, &id).as_deref(),
        Some("completed"),
        "not relabeled canceled"
    );
}

#[test]
fn guidance_while_only_children_run_is_appended_to_the_same_root_turn() {
    let d = daemon();
    let id = d.create(WS, "demo");
    let (_, turn) = d.submit(WS, &id, "children=1 late=1 permission=0 fail=0");
    d.wait_for(WS, &id, 30, "only the child runs", |v| {
        turn_of(v, &id).is_some_and(|t| {
            t["rootProviderTurn"]["phase"] == "completed" && t["phase"] == "waiting"
        })
    });
    let (reply, t2) = d.submit(WS, &id, "children=0 also check the docs");
    assert_eq!(reply, "appended");
    assert_eq!(t2, turn, "no second root turn");
    let end = d.wait_for(WS, &id, 30, "root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
    let (_, msgs) = d.call(
        "GET",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/messages"),
        None,
    );
    let users = msgs["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "user")
        .count();
    assert_eq!(users, 2, "both user messages on the one root turn");
}

#[test]
fn a_child_permission_is_answered_through_the_api() {
    let d = daemon();
    let id = d.create(WS, "demo");
    d.submit(WS, &id, "children=1 permission=1 fail=0 late=0");
    let v = d.wait_for(WS, &id, 30, "a pending child interaction", |v| {
        v["interactions"]
            .as_array()
            .is_some_and(|a| a.iter().any(|i| i["status"] == "pending"))
    });
    let i = v["interactions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["status"] == "pending")
        .unwrap()
        .clone();
    let owner = i["agentSessionId"].as_str().unwrap();
    assert_ne!(owner, id, "owned by the child session, not the root");
    // The wrong tuple (the root turn) is refused.
    let root_turn = turn_of(&v, &id).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let req = i["requestId"].as_str().unwrap();
    let (st, e) = d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/{root_turn}/interactions/{req}"),
        Some(json!({"response": "allow"})),
    );
    assert_eq!(st, 404, "{e}");
    assert_eq!(e["error"]["code"], "not_found");
    let (st, _) = d.call(
        "POST",
        &format!(
            "/v1/workspaces/{WS}/agent-sessions/{owner}/turns/{}/interactions/{req}",
            i["turnId"].as_str().unwrap()
        ),
        Some(json!({"response": "allow"})),
    );
    assert_eq!(st, 200);
    let end = d.wait_for(WS, &id, 30, "root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, owner).as_deref(), Some("completed"));
}

/// "Late updates after the prompt answered are dropped": the plain agent sends one more
/// `agent_message_chunk` after answering the prompt. The agent reports (a file, written after a
/// round trip through the daemon's adapter that follows the late update on the same pipe) that
/// the daemon has read the late update; a second prompt is then submitted, which enters the
/// daemon's input queue after the late update's event. Once that second turn settled, the late
/// text must be absent from the messages of every session of the tree.
#[test]
fn plain_agent_is_root_only_and_late_updates_after_the_prompt_are_dropped() {
    let marker_dir = tempfile::tempdir().expect("temp dir");
    let marker = marker_dir.path().join("late-sent");
    let marker_env = marker.to_string_lossy().to_string();
    let d = TestDaemon::start(
        EXE,
        None,
        &[
            ("TUTTI_DEMO_SPEED", "8"),
            ("TUTTI_PLAIN_LATE_SENT", marker_env.as_str()),
        ],
    );
    let id = d.create(WS, "plain");
    d.submit(WS, &id, "late=1 hello");
    let end = d.wait_for(WS, &id, 30, "root settled", |v| settled(v, &id));
    assert!(
        children(&end).is_empty(),
        "a tool call titled Task is not a child"
    );
    // Wait (not a timed assertion: the wait ends when the agent reports) for the late update.
    let waited = std::time::Instant::now();
    while !marker.exists() {
        assert!(
            waited.elapsed() < Duration::from_secs(30),
            "the plain agent never reported its late update"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (reply, second) = d.submit(WS, &id, "hello again");
    assert_eq!(reply, "started", "the first root turn had settled");
    let end = d.wait_for(WS, &id, 30, "second root turn settled", |v| {
        turn_of(v, &id).is_some_and(|t| t["id"] == second.as_str() && t["outcome"].is_string())
    });
    let mut sessions = vec![id.clone()];
    sessions.extend(
        children(&end)
            .iter()
            .filter_map(|c| c["id"].as_str().map(String::from)),
    );
    let mut assistant = 0;
    for s in &sessions {
        let (st, m) = d.call(
            "GET",
            &format!("/v1/workspaces/{WS}/agent-sessions/{s}/messages"),
            None,
        );
        assert_eq!(st, 200, "{m}");
        for msg in m["messages"].as_array().expect("a message list") {
            let text = msg["text"].as_str().unwrap_or_default();
            assert!(
                !text.contains("(late)"),
                "the late update was stored on {s}: {msg}"
            );
            if msg["role"] == "assistant" {
                assistant += 1;
            }
        }
    }
    assert!(
        assistant >= 2,
        "both prompts' own output was stored ({assistant} assistant messages)"
    );
}

#[test]
fn garbage_lines_from_a_provider_are_dropped_without_harm() {
    let d = TestDaemon::start(
        EXE,
        None,
        &[("TUTTI_DEMO_SPEED", "8"), ("TUTTI_DEMO_GARBAGE", "1")],
    );
    let id = d.create(WS, "demo");
    d.submit(WS, &id, "children=1 permission=0 fail=0 late=0");
    let end = d.wait_for(WS, &id, 30, "root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
}

/// Issue 23, items 2 and 3, through the real daemon and the real plain agent (`hang=1`): the
/// agent streams text, opens a `Task` tool call it never finishes, streams "Still looking
/// around." and works until cancelled. The agent reports (a file written after a round trip
/// behind that chunk) that the daemon's adapter has read the chunk, which the adapter still
/// buffers; the user cancels then. "Flush buffered text before the cancel settles the turn":
/// the chunk is a message of the canceled turn. "When a turn settles, its still-open tool calls
/// get a terminal status": the `Task` call's last row says `interrupted`.
#[test]
fn cancel_keeps_text_streamed_before_it_and_closes_the_open_tool_call() {
    let marker_dir = tempfile::tempdir().expect("temp dir");
    let marker = marker_dir.path().join("hang-sent");
    let marker_env = marker.to_string_lossy().to_string();
    let d = TestDaemon::start(
        EXE,
        None,
        &[
            ("TUTTI_DEMO_SPEED", "8"),
            ("TUTTI_PLAIN_HANG_SENT", marker_env.as_str()),
        ],
    );
    let id = d.create(WS, "plain");
    let (_, turn) = d.submit(WS, &id, "hang=1 look around");
    // Wait (not a timed assertion: the wait ends when the agent reports) for the last chunk.
    let waited = std::time::Instant::now();
    while !marker.exists() {
        assert!(
            waited.elapsed() < Duration::from_secs(30),
            "the plain agent never reported its last chunk"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (st, v) = d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/{turn}/cancel"),
        Some(json!({})),
    );
    assert_eq!(st, 202, "{v}");
    let end = d.wait_for(WS, &id, 30, "root canceled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("canceled"));
    let (st, m) = d.call(
        "GET",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/messages"),
        None,
    );
    assert_eq!(st, 200, "{m}");
    let kept: Vec<&Value> = m["messages"]
        .as_array()
        .expect("a message list")
        .iter()
        .filter(|msg| msg["role"] == "assistant" && msg["turnId"] == turn.as_str())
        .collect();
    assert!(
        kept.iter()
            .any(|msg| msg["text"] == "Still looking around."),
        "the text streamed before the cancel is kept: {m}"
    );
    let events = d.events(Some(0), None, usize::MAX, 1);
    let task: Vec<&Value> = events
        .iter()
        .filter(|e| e["kind"] == "toolCall" && e["payload"]["name"] == "Task")
        .map(|e| &e["payload"])
        .collect();
    let last = task.last().expect("the Task tool call was published");
    assert_eq!(last["status"], "interrupted", "{task:#?}");
    assert_eq!(last["turnId"], turn.as_str());
}

/// Issue 23 (found with claude-code-acp, whose `session/new` fails with an internal error when
/// its Claude CLI refuses to start): a failed `session/new` must not leave the submitted turn
/// waiting forever. The plain agent refuses the first `session/new`
/// (`TUTTI_PLAIN_FAIL_NEW_SESSIONS=1`): the turn settles `failed` with the agent's reason, and
/// the next submit tries `session/new` again and completes.
#[test]
fn a_refused_session_new_fails_the_turn_and_the_next_submit_tries_again() {
    let d = TestDaemon::start(
        EXE,
        None,
        &[
            ("TUTTI_DEMO_SPEED", "8"),
            ("TUTTI_PLAIN_FAIL_NEW_SESSIONS", "1"),
        ],
    );
    let id = d.create(WS, "plain");
    let (reply, first) = d.submit(WS, &id, "hello");
    assert_eq!(reply, "started");
    let end = d.wait_for(WS, &id, 30, "the first turn settled", |v| settled(v, &id));
    let turn = turn_of(&end, &id).expect("the turn");
    assert_eq!(turn["id"], first.as_str());
    assert_eq!(turn["outcome"], "failed", "{end:#}");
    let error = turn["error"].to_string();
    assert!(
        error.contains("could not start a session"),
        "the reason is recorded: {error}"
    );
    let (reply, second) = d.submit(WS, &id, "hello again");
    assert_eq!(reply, "started");
    let end = d.wait_for(WS, &id, 30, "the second turn settled", |v| {
        turn_of(v, &id).is_some_and(|t| t["id"] == second.as_str() && t["outcome"].is_string())
    });
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
}
