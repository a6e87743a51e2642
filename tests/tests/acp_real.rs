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
    std::thread::sleep(Duration::from_millis(600));
    let later = d.detail(WS, &id);
    assert_eq!(outcome(&later, &id).as_deref(), Some("canceled"));
    assert!(
        later["session"].get("activeTurnId").is_none(),
        "nothing resurrects"
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

#[test]
fn plain_agent_is_root_only_and_late_updates_after_the_prompt_are_dropped() {
    let d = daemon();
    let id = d.create(WS, "plain");
    d.submit(WS, &id, "late=1 hello");
    let end = d.wait_for(WS, &id, 30, "root settled", |v| settled(v, &id));
    assert!(
        children(&end).is_empty(),
        "a tool call titled Task is not a child"
    );
    let (_, m1) = d.call(
        "GET",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/messages"),
        None,
    );
    std::thread::sleep(Duration::from_millis(700));
    let (_, m2) = d.call(
        "GET",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/messages"),
        None,
    );
    assert_eq!(m1, m2, "the late update was dropped");
    assert!(m1["messages"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["role"] == "assistant"));
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
