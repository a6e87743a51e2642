//! The ACP adapter's cancel, on the adapter alone: "The adapter returns the exact subset of
//! supplied targets whose native cancel operation was acknowledged." For ACP the
//! acknowledgement is a fact from the agent, never the `session/cancel` notification itself:
//! the root's running prompt answering `stopReason: "cancelled"`, and a child's
//! `subagent_update` reaching `idle` with `stopReason: "cancelled"`. The cancel answer
//! (`CancelResult`) is given once every target is acknowledged, and not before.
//!
//! The adapter is driven through its real `Adapter` interface with the JSON-RPC messages an ACP
//! agent sends (initialize, `session/new`, prompt answers, `session/update` notifications).

use serde_json::{json, Value};
use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
use tutti_core::adapters::{child_ids, Adapter, AdapterOutput};
use tutti_core::model::{Outcome, Target};
use tutti_core::step::ProviderRequest;
use tutti_core::{NormalizedEvent, RuntimeAnswer};

const ROOT: &str = "R";
const SESSION: &str = "S";

/// An initialized adapter with session `S`.
fn opened() -> AcpAdapter {
    let mut a = AcpAdapter::new(ROOT.into(), AcpConfig::default());
    let out = a.open(0);
    assert_eq!(
        out.native[0]["params"]["clientCapabilities"]["subagents"],
        json!({}),
        "the client opts in to ACP v1 subagent sessions"
    );
    let init = out.native[0]["id"].clone();
    let out = a
        .on_native(
            1,
            &json!({"jsonrpc": "2.0", "id": init, "result": {"protocolVersion": 1, "agentCapabilities": {}}}),
        )
        .expect("initialize answer");
    let new = request_id(&out, "session/new");
    a.on_native(
        2,
        &json!({"jsonrpc": "2.0", "id": new, "result": {"sessionId": SESSION}}),
    )
    .expect("session/new answer");
    a
}

/// The id of the request with this method in `out`.
fn request_id(out: &AdapterOutput, method: &str) -> Value {
    out.native
        .iter()
        .find(|m| m["method"] == method && m.get("id").is_some())
        .unwrap_or_else(|| panic!("no {method} request in {out:?}"))["id"]
        .clone()
}

/// Starts root turn `T`; returns the adapter and the running prompt's rpc id.
fn running() -> (AcpAdapter, Value) {
    let mut a = opened();
    let out = a.on_request(
        3,
        &ProviderRequest::Start {
            root_agent_session_id: ROOT.into(),
            agent_session_id: ROOT.into(),
            turn_id: "T".into(),
            text: "go".into(),
        },
    );
    let prompt = request_id(&out, "session/prompt");
    (a, prompt)
}

fn target(session: &str, turn: &str) -> Target {
    Target {
        agent_session_id: session.into(),
        turn_id: turn.into(),
    }
}

fn cancel(a: &mut AcpAdapter, now: i64, targets: Vec<Target>) -> AdapterOutput {
    a.on_request(
        now,
        &ProviderRequest::Cancel {
            operation_id: "op1".into(),
            root_agent_session_id: ROOT.into(),
            targets,
        },
    )
}

fn cancel_results(out: &AdapterOutput) -> Vec<(String, Vec<Target>)> {
    out.answers
        .iter()
        .filter_map(|a| match a {
            RuntimeAnswer::CancelResult {
                operation_id,
                acked,
            } => Some((operation_id.to_string(), acked.clone())),
            _ => None,
        })
        .collect()
}

fn notifications(out: &AdapterOutput, method: &str) -> Vec<Value> {
    out.native
        .iter()
        .filter(|m| m["method"] == method && m.get("id").is_none())
        .cloned()
        .collect()
}

fn subagent_update(child: &str, state: Value) -> Value {
    json!({"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": SESSION,
        "update": {"sessionUpdate": "subagent_update", "sessionId": child,
            "title": "helper", "capabilities": {"cancel": {}}, "state": state}}})
}

/// Announces `child` (running) and delivers the delegating `session_message` that links it, as
/// claude-agent-acp does; returns both outputs' events.
fn announce(a: &mut AcpAdapter, now: i64, child: &str) -> AdapterOutput {
    let mut out = a
        .on_native(now, &subagent_update(child, json!({"state": "running"})))
        .expect("child announced");
    out.extend(
        a.on_native(
            now,
            &json!({"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": SESSION,
                "update": {"sessionUpdate": "session_message", "messageId": "toolu_1",
                    "senderSessionId": SESSION, "recipientSessionId": child,
                    "content": [{"type": "text", "text": "do it"}]}}}),
        )
        .expect("delegation message"),
    );
    out
}

/// The root's acknowledgement is the running prompt answering `cancelled`: the
/// `session/cancel` notification alone acknowledges nothing, so no cancel answer is given until
/// the prompt answers; then the answer names exactly the root target, and the prompt's
/// provider turn is reported interrupted.
#[test]
fn acp_root_cancel_is_acknowledged_by_the_prompt_answering_cancelled_and_not_before() {
    let (mut a, prompt) = running();
    let out = cancel(&mut a, 4, vec![target(ROOT, "T")]);
    assert_eq!(
        notifications(&out, "session/cancel")
            .iter()
            .map(|n| n["params"]["sessionId"].clone())
            .collect::<Vec<_>>(),
        [json!(SESSION)]
    );
    assert_eq!(
        cancel_results(&out),
        [],
        "the session/cancel notification is not an acknowledgement"
    );
    assert_eq!(out.timers.len(), 1, "the cancel is bounded by a timer");
    let timer = out.timers[0].id.clone();

    let out = a
        .on_native(
            5,
            &json!({"jsonrpc": "2.0", "id": prompt, "result": {"stopReason": "cancelled"}}),
        )
        .expect("prompt answer");
    assert_eq!(
        cancel_results(&out),
        [("op1".to_string(), vec![target(ROOT, "T")])]
    );
    let completed: Vec<_> = out
        .events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::RootProviderTurnCompleted {
                turn_id,
                outcome,
                error,
                ..
            } => Some((turn_id.clone(), *outcome, error.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        completed,
        [(
            Some("T".into()),
            Outcome::Interrupted,
            Some("prompt cancelled".to_string())
        )]
    );

    // The operation was answered once: its timer firing later answers nothing.
    assert!(a.on_timer(10_000, &timer).answers.is_empty());
}

/// A root target with no prompt running has nothing left to stop: it is acknowledged at once.
#[test]
fn acp_root_cancel_without_a_running_prompt_is_acknowledged_at_once() {
    let (mut a, prompt) = running();
    a.on_native(
        4,
        &json!({"jsonrpc": "2.0", "id": prompt, "result": {"stopReason": "end_turn"}}),
    )
    .expect("prompt answer");
    let out = cancel(&mut a, 5, vec![target(ROOT, "T")]);
    assert_eq!(
        cancel_results(&out),
        [("op1".to_string(), vec![target(ROOT, "T")])]
    );
}

/// A child target (child-only target set) is acknowledged by its `subagent_update` reaching
/// `idle` with `stopReason: "cancelled"`, which also makes its turn terminal `canceled`; until
/// then the cancel is not answered and the root prompt is left running.
#[test]
fn acp_child_cancel_is_acknowledged_by_the_child_idling_cancelled() {
    let (mut a, _prompt) = running();
    let out = announce(&mut a, 4, "child-1");
    let (session, turn) = child_ids(&ROOT.into(), "acp", "child-1", 1);
    assert!(
        out.events.iter().any(|e| matches!(
            e,
            NormalizedEvent::ChildSessionCreated { agent_session_id, .. } if *agent_session_id == session
        )),
        "{out:?}"
    );
    let child = Target {
        agent_session_id: session.clone(),
        turn_id: turn.clone(),
    };

    let out = cancel(&mut a, 5, vec![child.clone()]);
    assert_eq!(
        notifications(&out, "session/cancel")
            .iter()
            .map(|n| n["params"]["sessionId"].clone())
            .collect::<Vec<_>>(),
        [json!("child-1")],
        "only the child is canceled"
    );
    assert_eq!(cancel_results(&out), []);

    let out = a
        .on_native(
            6,
            &subagent_update(
                "child-1",
                json!({"state": "idle", "stopReason": "cancelled"}),
            ),
        )
        .expect("child idle");
    assert_eq!(cancel_results(&out), [("op1".to_string(), vec![child])]);
    assert_eq!(
        out.events
            .iter()
            .filter_map(|e| match e {
                NormalizedEvent::TurnTerminal {
                    agent_session_id,
                    turn_id,
                    outcome,
                    ..
                } => Some((agent_session_id.clone(), turn_id.clone(), *outcome)),
                _ => None,
            })
            .collect::<Vec<_>>(),
        [(session, turn, Outcome::Canceled)]
    );
}

/// A child that ends normally after the cancel was sent did not acknowledge it: its turn
/// completes and the cancel stays unanswered until its bound, which answers the empty subset.
#[test]
fn acp_child_ending_normally_does_not_acknowledge_the_cancel() {
    let (mut a, _prompt) = running();
    announce(&mut a, 4, "child-1");
    let (session, turn) = child_ids(&ROOT.into(), "acp", "child-1", 1);
    let out = cancel(&mut a, 5, vec![target(&session, &turn)]);
    let timer = out.timers.first().expect("cancel timer").id.clone();
    let out = a
        .on_native(
            6,
            &subagent_update(
                "child-1",
                json!({"state": "idle", "stopReason": "end_turn"}),
            ),
        )
        .expect("child idle");
    assert_eq!(cancel_results(&out), []);
    let out = a.on_timer(10_000, &timer);
    assert_eq!(cancel_results(&out), [("op1".to_string(), vec![])]);
}

/// Issue 23 (claude-code-acp answers `session/new` with an internal error when its Claude CLI
/// refuses to start): every request waiting for the session is answered instead of waiting
/// forever. The queued start becomes a failed root provider turn carrying the agent's reason,
/// queued guidance is `guideFailed`, a queued cancel is acknowledged (nothing runs natively);
/// the next request sends `session/new` again, and once that succeeds the prompt goes out.
#[test]
fn acp_failed_session_new_answers_every_waiting_request_and_the_next_request_retries() {
    let mut a = AcpAdapter::new(ROOT.into(), AcpConfig::default());
    let out = a.open(0);
    let init = out.native[0]["id"].clone();
    let out = a
        .on_native(
            1,
            &json!({"jsonrpc": "2.0", "id": init, "result": {"protocolVersion": 1, "agentCapabilities": {}}}),
        )
        .expect("initialize answer");
    let new = request_id(&out, "session/new");
    let start = |turn: &str| ProviderRequest::Start {
        root_agent_session_id: ROOT.into(),
        agent_session_id: ROOT.into(),
        turn_id: turn.into(),
        text: "go".into(),
    };
    assert!(a.on_request(2, &start("T")).native.is_empty(), "queued");
    a.on_request(
        2,
        &ProviderRequest::Guide {
            root_agent_session_id: ROOT.into(),
            agent_session_id: ROOT.into(),
            turn_id: "T".into(),
            mode: tutti_core::step::GuideMode::Steer,
            provider_turn_id: None,
            text: "more".into(),
        },
    );
    cancel(&mut a, 2, vec![target(ROOT, "T")]);
    let out = a
        .on_native(
            3,
            &json!({"jsonrpc": "2.0", "id": new, "error": {"code": -32603, "message": "Internal error"}}),
        )
        .expect("the error answer");
    let failed: Vec<_> = out
        .events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::RootProviderTurnCompleted {
                turn_id,
                outcome,
                error,
                ..
            } => Some((turn_id.clone(), *outcome, error.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 1, "{out:?}");
    assert_eq!(failed[0].0.as_deref(), Some("T"));
    assert_eq!(failed[0].1, Outcome::Failed);
    assert!(failed[0]
        .2
        .as_deref()
        .is_some_and(|e| e.contains("could not start a session") && e.contains("Internal error")));
    assert!(
        out.answers
            .iter()
            .any(|x| matches!(x, RuntimeAnswer::GuideFailed { turn_id, .. } if *turn_id == tutti_core::model::Id::from("T"))),
        "{out:?}"
    );
    assert_eq!(
        cancel_results(&out),
        vec![("op1".to_string(), vec![target(ROOT, "T")])]
    );
    assert!(out.native.is_empty(), "nothing sent without a session");

    // The next start tries session/new again.
    let out = a.on_request(4, &start("T2"));
    let retry = request_id(&out, "session/new");
    let out = a
        .on_native(
            5,
            &json!({"jsonrpc": "2.0", "id": retry, "result": {"sessionId": SESSION}}),
        )
        .expect("session/new answer");
    let prompt = out
        .native
        .iter()
        .find(|m| m["method"] == "session/prompt")
        .expect("the queued start's prompt goes out");
    assert_eq!(prompt["params"]["sessionId"], SESSION);
}

fn tool_updates(out: &AdapterOutput) -> Vec<(String, String)> {
    out.events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::ToolCallUpdated {
                tool_call_id,
                status,
                ..
            } => Some((tool_call_id.to_string(), status.to_string())),
            _ => None,
        })
        .collect()
}

/// Issue 23 (codex-acp announces a command needing approval only inside
/// `session/request_permission`): a tool call not reported before is recorded from the
/// permission request's `toolCall`, as `pending`; one the agent already reported keeps the
/// status the agent gave it.
#[test]
fn acp_permission_for_an_unreported_tool_call_records_the_call_once() {
    let (mut a, _prompt) = running();
    let permission = |id: &str, call: &str| {
        json!({"jsonrpc": "2.0", "id": id, "method": "session/request_permission", "params": {
            "sessionId": SESSION,
            "toolCall": {"toolCallId": call, "title": "echo later", "kind": "execute"},
            "options": [{"optionId": "approved", "name": "Yes", "kind": "allow_once"}]}})
    };
    let out = a.on_native(4, &permission("p1", "c1")).expect("permission");
    assert_eq!(tool_updates(&out), vec![("c1".into(), "pending".into())]);
    assert!(out
        .events
        .iter()
        .any(|e| matches!(e, NormalizedEvent::InteractionRequested { .. })));

    let out = a
        .on_native(
            5,
            &json!({"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": SESSION,
                "update": {"sessionUpdate": "tool_call", "toolCallId": "c2", "title": "Edit",
                           "status": "in_progress"}}}),
        )
        .expect("tool call");
    assert_eq!(
        tool_updates(&out),
        vec![("c2".into(), "in_progress".into())]
    );
    let out = a.on_native(6, &permission("p2", "c2")).expect("permission");
    assert!(
        tool_updates(&out).is_empty(),
        "a reported call keeps its status: {out:?}"
    );
    let out = a.on_native(7, &permission("p3", "c1")).expect("permission");
    assert!(tool_updates(&out).is_empty(), "recorded once: {out:?}");
}

/// Issue 32 ("tool calls that open to show their input and output/diff when the provider sent
/// them"): what the agent sends of a tool call (`rawInput`, `rawOutput`, `content`,
/// `locations`) becomes its payload, merged over the updates (each carries only what changed);
/// an update with none of them leaves the payload as recorded.
#[test]
fn acp_tool_call_input_and_output_are_its_payload_merged_over_updates() {
    let (mut a, _prompt) = running();
    let upd = |u: Value| {
        json!({"jsonrpc": "2.0", "method": "session/update",
            "params": {"sessionId": SESSION, "update": u}})
    };
    let payloads = |out: &AdapterOutput| -> Vec<Option<Value>> {
        out.events
            .iter()
            .filter_map(|e| match e {
                NormalizedEvent::ToolCallUpdated { payload, .. } => {
                    Some(payload.as_deref().cloned())
                }
                _ => None,
            })
            .collect()
    };
    let out = a
        .on_native(
            4,
            &upd(
                json!({"sessionUpdate": "tool_call", "toolCallId": "c1", "title": "Edit",
                "status": "in_progress", "rawInput": {"path": "a.txt"}}),
            ),
        )
        .expect("tool call");
    assert_eq!(
        payloads(&out),
        [Some(json!({"rawInput": {"path": "a.txt"}}))]
    );
    let out = a
        .on_native(
            5,
            &upd(json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "in_progress"})),
        )
        .expect("status only");
    assert_eq!(payloads(&out), [None], "nothing new: the payload stays");
    let out = a
        .on_native(
            6,
            &upd(json!({"sessionUpdate": "tool_call_update", "toolCallId": "c1", "status": "completed",
                "content": [{"type": "diff", "path": "a.txt", "oldText": "x", "newText": "y"}]})),
        )
        .expect("completed");
    assert_eq!(
        payloads(&out),
        [Some(json!({"rawInput": {"path": "a.txt"},
            "content": [{"type": "diff", "path": "a.txt", "oldText": "x", "newText": "y"}]}))]
    );
}

/// The ACP transport forwards `session/update`s as the agent wrote them (no schema round trip):
/// an update without its `sessionUpdate` tag is refused with a typed error and changes nothing.
/// Here a message is being streamed: a malformed update neither ends it nor adds to it, and the
/// next chunk continues it.
#[test]
fn acp_an_update_without_its_tag_is_refused_and_changes_nothing() {
    let (mut a, prompt) = running();
    let upd = |u: Value| {
        json!({"jsonrpc": "2.0", "method": "session/update",
            "params": {"sessionId": SESSION, "update": u}})
    };
    let chunk = |t: &str| {
        upd(json!({"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": t}}))
    };
    let out = a.on_native(4, &chunk("one ")).expect("a chunk");
    assert!(out.events.is_empty(), "the message is still streaming");
    for bad in [
        json!(5),
        json!({"content": {"type": "text", "text": "x"}}),
        json!({"sessionUpdate": 7}),
    ] {
        let err = a
            .on_native(5, &upd(bad.clone()))
            .expect_err("an update without its tag is refused");
        assert!(
            err.to_string().contains("sessionUpdate"),
            "{bad}: a typed error naming the tag, got {err}"
        );
    }
    a.on_native(6, &chunk("two")).expect("a chunk");
    let out = a
        .on_native(
            7,
            &json!({"jsonrpc": "2.0", "id": prompt, "result": {"stopReason": "end_turn"}}),
        )
        .expect("the prompt's answer");
    let texts: Vec<&str> = out
        .events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::MessageAppended { text, .. } => Some(&**text),
            _ => None,
        })
        .collect();
    assert_eq!(
        texts,
        ["one two"],
        "one message, the refused updates left out"
    );
}
