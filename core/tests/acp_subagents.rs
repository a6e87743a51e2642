//! Issue 35: ACP v1 subagent sessions become tutti child sessions.
//!
//! Two halves:
//! - the real `@agentclientprotocol/claude-agent-acp` 0.101.0's captured transcripts
//!   (`tests/data/acp/claude-agent-acp-*.wire.jsonl`, re-captured by the `acp_claude_wire`
//!   test) replayed through the adapter and the engine (`replay_transcript`, the code behind
//!   `tutti replay-native --provider acp`), each checked for the tree it must give;
//! - each mapping rule on the adapter alone, with the standard shapes written out, including
//!   the agent output that breaks them (a diagnostic that changes nothing).

use serde_json::{json, Value};
use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
use tutti_core::adapters::{child_ids, Adapter, AdapterOutput};
use tutti_core::driver::{DriverInput, Testkit};
use tutti_core::model::{Outcome, Target};
use tutti_core::replay::acp::replay_transcript;
use tutti_core::replay::codex::ReplayOutput;
use tutti_core::step::ProviderRequest;
use tutti_core::{NormalizedEvent, RuntimeAnswer};

// ---- the real agent's captures ------------------------------------------------------------------

fn capture(name: &str) -> String {
    let path = format!(
        "{}/../tests/data/acp/claude-agent-acp-{name}.wire.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn replay(name: &str) -> ReplayOutput {
    let out = replay_transcript(&capture(name)).expect("a transcript");
    assert!(out.violations.is_empty(), "{name}: {:?}", out.violations);
    out
}

/// (turn id, session id, outcome) of every settled turn, children first as the snapshot sorts.
fn outcomes(out: &ReplayOutput) -> Vec<(String, String, Option<Outcome>)> {
    out.snapshot
        .turns
        .iter()
        .map(|t| {
            (
                t.id.to_string(),
                t.agent_session_id.to_string(),
                t.outcome(),
            )
        })
        .collect()
}

fn children(out: &ReplayOutput) -> Vec<&tutti_core::model::Session> {
    out.snapshot
        .sessions
        .iter()
        .filter(|s| s.is_child())
        .collect()
}

fn root_outcome(out: &ReplayOutput) -> Option<Outcome> {
    out.snapshot
        .turns
        .iter()
        .find(|t| &*t.id == "turn-1")
        .and_then(|t| t.outcome())
}

/// The child ids inside the transcript's `subagent_update`s, in first-seen order.
fn native_children(name: &str) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for line in capture(name).lines() {
        let Some(rest) = line.strip_prefix("<< ") else {
            continue;
        };
        let v: Value = serde_json::from_str(rest).expect("json");
        if v.pointer("/params/update/sessionUpdate") == Some(&json!("subagent_update")) {
            let id = v["params"]["update"]["sessionId"]
                .as_str()
                .expect("id")
                .to_string();
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}

/// "The first `subagent_update` for an unknown child `sessionId` on a parent session =
/// `childSessionCreated` under the parent's active turn"; "the parent link: ... the
/// `session_message` from parent to child carries the delegation (its `messageId` is the
/// model's tool-use id)"; "a delegation card must exist for the web view even when the agent
/// announced no tool call". A foreground child completes before the root, which completes.
#[test]
fn a_claude_agent_acp_foreground_subagent_is_a_child_session_linked_to_its_delegation() {
    let out = replay("foreground");
    let kids = children(&out);
    assert_eq!(kids.len(), 1, "{:?}", out.snapshot.sessions);
    let child = kids[0];
    let native = &native_children("foreground")[0];
    assert_eq!(
        child.id,
        child_ids(&"root".into(), "acp", native, 1).0,
        "keyed by the sessionId inside the subagent_update"
    );
    assert_eq!(child.provider_session_id.as_deref(), Some(native.as_str()));
    assert_eq!(child.title.as_deref(), Some("look around"));
    assert_eq!(child.parent_turn_id().map(|t| &**t), Some("turn-1"));
    let call = child
        .parent_tool_call_id()
        .cloned()
        .expect("a delegation link");
    assert!(
        call.starts_with("toolu_"),
        "the model's tool-use id: {call}"
    );
    assert_eq!(
        child.provider_aliases.parent_tool_use_id.as_deref(),
        Some(&*call)
    );
    let card = out
        .snapshot
        .tool_calls
        .iter()
        .find(|t| t.tool_call_id == call)
        .expect("a delegation card on the parent turn");
    assert_eq!(&*card.agent_session_id, "root");
    assert_eq!(&*card.turn_id, "turn-1");
    assert_eq!(
        outcomes(&out)
            .into_iter()
            .map(|(_, _, o)| o)
            .collect::<Vec<_>>(),
        [Some(Outcome::Completed), Some(Outcome::Completed)]
    );
    // The delegation and the reply are messages of the sessions they arrive on.
    let ids: Vec<(String, String)> = out
        .snapshot
        .message_ids
        .iter()
        .map(|(s, m)| (s.to_string(), m.to_string()))
        .collect();
    assert!(ids.contains(&(child.id.to_string(), format!("acp-sm-{call}"))));
    assert!(ids.contains(&("root".into(), format!("acp-sm-{call}:reply"))));
}

/// Two parallel children finishing apart: two child sessions, each with its own link, both
/// completed, and the root completes after both.
#[test]
fn claude_agent_acp_parallel_subagents_are_two_children_finishing_apart() {
    let out = replay("parallel");
    let kids = children(&out);
    assert_eq!(kids.len(), 2);
    let calls: Vec<_> = kids
        .iter()
        .map(|c| c.parent_tool_call_id().cloned().expect("linked"))
        .collect();
    assert_ne!(calls[0], calls[1]);
    assert!(outcomes(&out)
        .iter()
        .all(|(_, _, o)| *o == Some(Outcome::Completed)));
    // The fast child settled before the slow one (its turn's last update is earlier).
    let updated: Vec<_> = out
        .snapshot
        .turns
        .iter()
        .filter(|t| &*t.id != "turn-1")
        .map(|t| t.updated_at)
        .collect();
    assert_ne!(updated[0], updated[1], "they finished apart");
}

/// A nested subagent ("a child announcing its own child"): the grandchild's parent is the
/// child session and its turn, its root is the root.
#[test]
fn a_claude_agent_acp_nested_subagent_is_a_grandchild_of_the_root() {
    let out = replay("nested");
    let kids = children(&out);
    assert_eq!(kids.len(), 2);
    let natives = native_children("nested");
    let child = child_ids(&"root".into(), "acp", &natives[0], 1);
    let grand = kids
        .iter()
        .find(|s| s.id == child_ids(&"root".into(), "acp", &natives[1], 1).0)
        .expect("the grandchild");
    assert_eq!(grand.parent_agent_session_id(), Some(&child.0));
    assert_eq!(grand.parent_turn_id(), Some(&child.1));
    assert_eq!(grand.root_agent_session_id().map(|r| &**r), Some("root"));
    assert!(grand.parent_tool_call_id().is_some());
    assert_eq!(root_outcome(&out), Some(Outcome::Completed));
}

/// A permission inside a child is an interaction on that child's turn, answered on the exact
/// child tuple; the child goes on and completes.
#[test]
fn a_permission_inside_a_claude_agent_acp_subagent_belongs_to_the_child_turn() {
    let out = replay("child-permission");
    let kids = children(&out);
    assert_eq!(kids.len(), 1);
    let child = child_ids(
        &"root".into(),
        "acp",
        &native_children("child-permission")[0],
        1,
    );
    let interactions = &out.snapshot.interactions;
    assert_eq!(interactions.len(), 1, "{interactions:?}");
    assert_eq!(interactions[0].agent_session_id, child.0);
    assert_eq!(interactions[0].turn_id, child.1);
    assert_eq!(
        &*interactions[0].request_id, "0",
        "the agent's ids start at 0"
    );
    assert!(out
        .events
        .iter()
        .any(|e| matches!(e, NormalizedEvent::TurnWaiting { turn_id, .. } if *turn_id == child.1)));
    assert!(out
        .native
        .iter()
        .any(|m| m["id"] == json!(0) && m["result"]["outcome"]["optionId"] == "allow-once"));
    assert!(outcomes(&out)
        .iter()
        .all(|(_, _, o)| *o == Some(Outcome::Completed)));
}

/// Child-only cancel: `session/cancel` on that child only; the agent's `idle`/`cancelled`
/// confirms it (canceled); the parent carries on and completes.
#[test]
fn a_child_only_cancel_of_a_claude_agent_acp_subagent_cancels_the_child_and_the_root_goes_on() {
    let out = replay("child-cancel");
    let native = &native_children("child-cancel")[0];
    let cancels: Vec<_> = out
        .native
        .iter()
        .filter(|m| m["method"] == "session/cancel")
        .map(|m| m["params"]["sessionId"].clone())
        .collect();
    assert_eq!(cancels, [json!(native)]);
    let child = child_ids(&"root".into(), "acp", native, 1);
    let got = outcomes(&out);
    assert!(got.contains(&(
        child.1.to_string(),
        child.0.to_string(),
        Some(Outcome::Canceled)
    )));
    assert_eq!(root_outcome(&out), Some(Outcome::Completed));
}

/// Whole-tree cancel with a background child: `session/cancel` on the root and on the running
/// child (the agent keeps background subagents running after a parent cancel); the root is
/// canceled, the child ends canceled on its own `idle`/`cancelled`, and the continuation the
/// agent starts afterwards with no prompt open is not recorded on the canceled root.
#[test]
fn a_whole_tree_cancel_ends_the_background_claude_agent_acp_subagent_too() {
    let out = replay("tree-cancel");
    let native = &native_children("tree-cancel")[0];
    let cancels: Vec<_> = out
        .native
        .iter()
        .filter(|m| m["method"] == "session/cancel")
        .map(|m| {
            m["params"]["sessionId"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert!(
        cancels.contains(native),
        "the child is cancelled: {cancels:?}"
    );
    assert_eq!(cancels.len(), 2, "the root and the child: {cancels:?}");
    assert_eq!(root_outcome(&out), Some(Outcome::Canceled));
    let child = child_ids(&"root".into(), "acp", native, 1);
    assert!(outcomes(&out).contains(&(
        child.1.to_string(),
        child.0.to_string(),
        Some(Outcome::Canceled)
    )));
    // The agent's own continuation after the cancel (origin task-notification; the scripted
    // model repeats the text it streamed before the cancel) is never a message of the
    // canceled root turn: the root keeps exactly the one message streamed before the cancel.
    let root_messages: Vec<_> = out
        .events
        .iter()
        .filter(|e| {
            matches!(e, NormalizedEvent::MessageAppended { agent_session_id, role, .. }
            if &**agent_session_id == "root" && &**role == "assistant")
        })
        .collect();
    assert_eq!(
        root_messages.len(),
        1,
        "nothing resurrects the canceled root: {root_messages:?}"
    );
}

/// A background child: the prompt stays open until the child is idle and the agent's own
/// follow-up has streamed; the root settles after the child.
#[test]
fn a_claude_agent_acp_background_subagent_settles_before_the_root() {
    let out = replay("background");
    assert_eq!(children(&out).len(), 1);
    assert!(outcomes(&out)
        .iter()
        .all(|(_, _, o)| *o == Some(Outcome::Completed)));
    let child_turn = out
        .snapshot
        .turns
        .iter()
        .find(|t| &*t.id != "turn-1")
        .expect("child turn");
    let root_turn = out
        .snapshot
        .turns
        .iter()
        .find(|t| &*t.id == "turn-1")
        .expect("root turn");
    assert!(child_turn.updated_at <= root_turn.updated_at);
}

/// Without the capability claude-agent-acp flattens its subagent onto the root as a plain
/// `Task` tool call: tutti stays root-only ("does not infer child sessions from ordinary
/// tool/progress updates").
#[test]
fn without_subagent_updates_claude_agent_acp_stays_root_only() {
    let out = replay("no-capability");
    assert!(children(&out).is_empty());
    assert!(
        !out.snapshot.tool_calls.is_empty(),
        "the Task tool call is kept"
    );
    assert_eq!(root_outcome(&out), Some(Outcome::Completed));
}

/// Relaunch: `session/load` replays the child (same id) before it answers, and sends one more
/// `idle` for it after the next prompt: neither creates a child nor settles anything.
#[test]
fn a_claude_agent_acp_reload_binds_the_replayed_child_and_records_no_duplicate() {
    let out = replay("relaunch-load");
    assert!(
        out.native.iter().any(|m| m["method"] == "session/load"),
        "the replay loads the captured session"
    );
    assert!(children(&out).is_empty(), "{:?}", out.snapshot.sessions);
    assert!(!out.events.iter().any(|e| matches!(
        e,
        NormalizedEvent::ChildSessionCreated { .. } | NormalizedEvent::TurnTerminal { .. }
    )));
    assert_eq!(root_outcome(&out), Some(Outcome::Completed));
}

// ---- each rule on the adapter alone -------------------------------------------------------------

const ROOT: &str = "R";
const SESSION: &str = "S";

fn opened(resume: Option<&str>) -> AcpAdapter {
    let mut a = AcpAdapter::new(
        ROOT.into(),
        AcpConfig {
            resume_session_id: resume.map(String::from),
            ..AcpConfig::default()
        },
    );
    let out = a.open(0);
    let init = out.native[0]["id"].clone();
    let out = a
        .on_native(
            1,
            &json!({"jsonrpc": "2.0", "id": init, "result": {"protocolVersion": 1,
                "agentCapabilities": {"loadSession": true}}}),
        )
        .expect("initialize answer");
    if resume.is_none() {
        let new = out.native[0]["id"].clone();
        a.on_native(
            2,
            &json!({"jsonrpc": "2.0", "id": new, "result": {"sessionId": SESSION}}),
        )
        .expect("session/new answer");
    }
    a
}

fn start(a: &mut AcpAdapter, turn: &str) -> Value {
    let out = a.on_request(
        3,
        &ProviderRequest::Start {
            root_agent_session_id: ROOT.into(),
            agent_session_id: ROOT.into(),
            turn_id: turn.into(),
            text: "go".into(),
        },
    );
    out.native
        .iter()
        .find(|m| m["method"] == "session/prompt")
        .expect("prompt")["id"]
        .clone()
}

fn update(outer: &str, update: Value) -> Value {
    json!({"jsonrpc": "2.0", "method": "session/update",
        "params": {"sessionId": outer, "update": update}})
}

fn sub(outer: &str, child: &str, extra: Value) -> Value {
    let mut u = json!({"sessionUpdate": "subagent_update", "sessionId": child});
    if let (Some(u), Some(e)) = (u.as_object_mut(), extra.as_object()) {
        u.extend(e.clone());
    }
    update(outer, u)
}

fn message(outer: &str, id: &str, from: &str, to: &str) -> Value {
    update(
        outer,
        json!({"sessionUpdate": "session_message", "messageId": id,
            "senderSessionId": from, "recipientSessionId": to,
            "content": [{"type": "text", "text": "work"}]}),
    )
}

fn feed(a: &mut AcpAdapter, msgs: &[Value]) -> AdapterOutput {
    let mut out = AdapterOutput::default();
    for (n, m) in msgs.iter().enumerate() {
        out.extend(a.on_native(10 + n as i64, m).expect("accepted"));
    }
    out
}

fn created(out: &AdapterOutput) -> Vec<(String, String, Option<String>)> {
    out.events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::ChildSessionCreated {
                agent_session_id,
                parent_agent_session_id,
                parent_tool_call_id,
                ..
            } => Some((
                agent_session_id.to_string(),
                parent_agent_session_id.to_string(),
                parent_tool_call_id.as_ref().map(|c| c.to_string()),
            )),
            _ => None,
        })
        .collect()
}

fn terminals(out: &AdapterOutput) -> Vec<(String, Outcome)> {
    out.events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::TurnTerminal {
                turn_id, outcome, ..
            } => Some((turn_id.to_string(), *outcome)),
            _ => None,
        })
        .collect()
}

fn running() -> Value {
    json!({"state": {"state": "running"}, "capabilities": {"cancel": {}}, "title": "helper"})
}

fn idle(stop: &str) -> Value {
    json!({"state": {"state": "idle", "stopReason": stop}})
}

/// The demo agent's (and the RFD's) link: a `session` tool-call content on a parent tool call
/// makes that tool call the child's `parentToolCallId`, and no card is invented beside it.
#[test]
fn a_session_content_on_a_parent_tool_call_links_the_child_to_that_call() {
    let mut a = opened(None);
    start(&mut a, "T");
    let out = feed(
        &mut a,
        &[
            update(
                SESSION,
                json!({"sessionUpdate": "tool_call", "toolCallId": "d1",
                "title": "Delegate", "status": "in_progress"}),
            ),
            sub(SESSION, "c1", running()),
            update(
                SESSION,
                json!({"sessionUpdate": "tool_call_update", "toolCallId": "d1",
                "content": [{"type": "session", "sessionId": "c1"}]}),
            ),
        ],
    );
    let child = child_ids(&ROOT.into(), "acp", "c1", 1).0;
    assert_eq!(
        created(&out),
        [(child.to_string(), ROOT.to_string(), Some("d1".to_string()))]
    );
    let calls = out
        .events
        .iter()
        .filter(|e| matches!(e, NormalizedEvent::ToolCallUpdated { .. }))
        .count();
    assert_eq!(
        calls, 2,
        "the agent's own tool call, twice; no synthesized card"
    );
}

/// An announcement followed by anything but its link is created unlinked before that message
/// is handled (the child exists before the prompt's answer reaches the engine).
#[test]
fn an_unlinked_announcement_is_created_before_the_next_message() {
    let mut a = opened(None);
    let prompt = start(&mut a, "T");
    let out = feed(
        &mut a,
        &[
            sub(SESSION, "c1", running()),
            json!({"jsonrpc": "2.0", "id": prompt, "result": {"stopReason": "end_turn"}}),
        ],
    );
    let kinds: Vec<&str> = out
        .events
        .iter()
        .map(|e| match e {
            NormalizedEvent::ChildSessionCreated { .. } => "created",
            NormalizedEvent::TurnStarted { .. } => "started",
            NormalizedEvent::RootProviderTurnCompleted { .. } => "root-completed",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["created", "started", "root-completed"]);
    assert_eq!(created(&out)[0].2, None);
}

/// `state` mapping: `requires_action` waits, `running` resumes the same turn, `idle` settles it
/// by its stop reason; a later `running` is the child's next turn in the same session; an
/// `idle` for an idle child changes nothing; `cancelled` that tutti did not ask for is
/// interrupted.
#[test]
fn subagent_states_map_to_the_child_turn_lifecycle() {
    let mut a = opened(None);
    start(&mut a, "T");
    let (session, first) = child_ids(&ROOT.into(), "acp", "c1", 1);
    let out = feed(
        &mut a,
        &[
            sub(SESSION, "c1", running()),
            message(SESSION, "m1", SESSION, "c1"),
            sub(
                SESSION,
                "c1",
                json!({"state": {"state": "requires_action"}}),
            ),
            sub(SESSION, "c1", json!({"state": {"state": "running"}})),
            sub(SESSION, "c1", idle("end_turn")),
            sub(SESSION, "c1", idle("end_turn")),
            sub(SESSION, "c1", json!({"state": {"state": "running"}})),
            sub(SESSION, "c1", idle("cancelled")),
        ],
    );
    let waits = out
        .events
        .iter()
        .filter(|e| matches!(e, NormalizedEvent::TurnWaiting { turn_id, .. } if *turn_id == first))
        .count();
    assert_eq!(waits, 1);
    let t = terminals(&out);
    assert_eq!(t.len(), 2, "{t:?}");
    assert_eq!(t[0], (first.to_string(), Outcome::Completed));
    assert_ne!(t[1].0, first.to_string(), "the next turn has its own id");
    assert!(t[1].0.starts_with(&format!("{session}~turn-")));
    assert_eq!(t[1].1, Outcome::Interrupted, "nobody asked for that cancel");
    assert_eq!(created(&out).len(), 1, "one child session for both turns");
}

/// Stop reasons: `refusal` and `error` fail the child turn (with the agent's message).
#[test]
fn a_refusing_or_erring_subagent_fails_its_turn() {
    let mut a = opened(None);
    start(&mut a, "T");
    let out = feed(
        &mut a,
        &[
            sub(SESSION, "c1", running()),
            sub(SESSION, "c2", running()),
            message(SESSION, "m2", SESSION, "c2"),
            sub(SESSION, "c1", idle("refusal")),
            sub(
                SESSION,
                "c2",
                json!({"state": {"state": "idle", "stopReason": "error",
                    "error": {"code": -32603, "message": "boom"}}}),
            ),
        ],
    );
    let failed: Vec<_> = out
        .events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::TurnTerminal {
                outcome: Outcome::Failed,
                error,
                ..
            } => error.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(failed, ["the agent refused", "boom"]);
}

/// Patches: a later `title` renames the child, `null` clears it; omitted fields change nothing.
#[test]
fn later_subagent_updates_patch_the_child() {
    let mut a = opened(None);
    start(&mut a, "T");
    let out = feed(
        &mut a,
        &[
            sub(SESSION, "c1", running()),
            message(SESSION, "m1", SESSION, "c1"),
            sub(SESSION, "c1", json!({"title": "renamed"})),
            sub(SESSION, "c1", json!({"description": "only a description"})),
            sub(SESSION, "c1", json!({"title": null})),
        ],
    );
    let titles: Vec<_> = out
        .events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::ChildSessionUpdated { title, .. } => title.clone(),
            _ => None,
        })
        .collect();
    assert_eq!(titles, ["renamed", ""]);
}

/// "Agent output that breaks the shapes ... is a diagnostic and changes nothing else": an
/// update for an unknown child session, a `subagent_update` for the root itself, a known child
/// re-announced on a stream that is not its parent's, garbage `state`, a session message naming
/// an unknown session.
#[test]
fn subagent_output_that_breaks_the_shapes_is_a_diagnostic_and_changes_nothing() {
    let mut a = opened(None);
    start(&mut a, "T");
    feed(
        &mut a,
        &[
            sub(SESSION, "c1", running()),
            message(SESSION, "m1", SESSION, "c1"),
            sub(SESSION, "c2", running()),
            message(SESSION, "m2", SESSION, "c2"),
        ],
    );
    let bad = [
        update(
            "nobody",
            json!({"sessionUpdate": "agent_message_chunk",
            "content": {"type": "text", "text": "x"}}),
        ),
        sub(SESSION, SESSION, running()),
        sub("c2", "c1", idle("end_turn")),
        sub(SESSION, "c1", json!({"state": "running"})),
        sub(SESSION, "c1", json!({"state": {"state": "sleeping"}})),
        sub(SESSION, "c3", json!({"state": 7})),
        message(SESSION, "m9", SESSION, "stranger"),
        update(SESSION, json!({"sessionUpdate": "subagent_update"})),
    ];
    for (n, m) in bad.iter().enumerate() {
        let out = a.on_native(30 + n as i64, m).expect("not an error");
        // A later message must not find anything held either.
        let after = a
            .on_native(
                40,
                &update(
                    SESSION,
                    json!({"sessionUpdate": "available_commands_update", "availableCommands": []}),
                ),
            )
            .expect("usage");
        assert!(
            out.events.is_empty() && after.events.is_empty(),
            "case {n} changed something: {:?} {:?}",
            out.events,
            after.events
        );
        assert!(!out.diagnostics.is_empty(), "case {n} is a diagnostic");
    }
}

/// "Child creation closes when the cancel is prepared; a late `subagent_update` announcing a new
/// child after that is not recorded as live work" (it is sent `session/cancel`); a child held
/// for its link when the cancel comes is not recorded either.
#[test]
fn a_child_announced_after_a_root_cancel_is_cancelled_and_not_recorded() {
    let mut a = opened(None);
    start(&mut a, "T");
    a.on_native(10, &sub(SESSION, "held", running()))
        .expect("held");
    let out = a.on_request(
        11,
        &ProviderRequest::Cancel {
            operation_id: "op".into(),
            root_agent_session_id: ROOT.into(),
            targets: vec![Target {
                agent_session_id: ROOT.into(),
                turn_id: "T".into(),
            }],
        },
    );
    let late = a
        .on_native(12, &sub(SESSION, "late", running()))
        .expect("late");
    let all: Vec<_> = out.events.iter().chain(&late.events).collect();
    assert!(
        !all.iter()
            .any(|e| matches!(e, NormalizedEvent::ChildSessionCreated { .. })),
        "{all:?}"
    );
    let mut cancelled: Vec<String> = out
        .native
        .iter()
        .chain(&late.native)
        .filter(|m| m["method"] == "session/cancel")
        .filter_map(|m| m["params"]["sessionId"].as_str().map(String::from))
        .collect();
    cancelled.sort();
    assert_eq!(cancelled, ["S", "held", "late"]);
}

/// Whole-tree cancel: `session/cancel` on the root and on every running child that advertises
/// `cancel`, not on one that does not, nor on an idle one; the children's `idle`/`cancelled`
/// (arriving with no prompt open) acknowledge them.
#[test]
fn a_whole_tree_cancel_cancels_the_root_and_every_running_child_that_can_be_cancelled() {
    let mut a = opened(None);
    let prompt = start(&mut a, "T");
    feed(
        &mut a,
        &[
            sub(SESSION, "bg", running()),
            message(SESSION, "m1", SESSION, "bg"),
            sub(SESSION, "nocancel", json!({"state": {"state": "running"}})),
            message(SESSION, "m2", SESSION, "nocancel"),
            sub(SESSION, "done", running()),
            message(SESSION, "m3", SESSION, "done"),
            sub(SESSION, "done", idle("end_turn")),
        ],
    );
    let bg = child_ids(&ROOT.into(), "acp", "bg", 1);
    let targets = vec![
        Target {
            agent_session_id: ROOT.into(),
            turn_id: "T".into(),
        },
        Target {
            agent_session_id: bg.0.clone(),
            turn_id: bg.1.clone(),
        },
    ];
    let out = a.on_request(
        20,
        &ProviderRequest::Cancel {
            operation_id: "op".into(),
            root_agent_session_id: ROOT.into(),
            targets: targets.clone(),
        },
    );
    let cancelled: Vec<_> = out
        .native
        .iter()
        .filter(|m| m["method"] == "session/cancel")
        .map(|m| m["params"]["sessionId"].clone())
        .collect();
    assert_eq!(cancelled, [json!(SESSION), json!("bg")]);
    a.on_native(
        21,
        &json!({"jsonrpc": "2.0", "id": prompt, "result": {"stopReason": "cancelled"}}),
    )
    .expect("prompt answer");
    let out = a
        .on_native(22, &sub(SESSION, "bg", idle("cancelled")))
        .expect("idle");
    assert_eq!(terminals(&out), [(bg.1.to_string(), Outcome::Canceled)]);
    assert!(out.answers.iter().any(|x| matches!(x,
        RuntimeAnswer::CancelResult { acked, .. } if *acked == targets)));
}

/// "Children outlive the parent prompt": root traffic with no prompt open belongs to the root
/// turn while a child still works (the agent's own continuation), and is dropped once nothing
/// works any more, so it never resurrects a settled root turn.
#[test]
fn root_traffic_with_no_prompt_open_belongs_to_the_root_only_while_a_child_works() {
    let mut a = opened(None);
    let prompt = start(&mut a, "T");
    feed(
        &mut a,
        &[
            sub(SESSION, "bg", running()),
            message(SESSION, "m1", SESSION, "bg"),
            json!({"jsonrpc": "2.0", "id": prompt, "result": {"stopReason": "end_turn"}}),
        ],
    );
    let chunk = |text: &str| {
        update(
            SESSION,
            json!({"sessionUpdate": "agent_message_chunk",
            "content": {"type": "text", "text": text}}),
        )
    };
    let usage = update(SESSION, json!({"sessionUpdate": "usage_update", "used": 1}));
    let during = feed(&mut a, &[chunk("while the child works"), usage.clone()]);
    assert!(during.events.iter().any(|e| matches!(e,
        NormalizedEvent::MessageAppended { agent_session_id, turn_id, .. }
        if &**agent_session_id == ROOT && &**turn_id == "T")));
    let after = feed(
        &mut a,
        &[
            sub(SESSION, "bg", idle("end_turn")),
            chunk("continuation"),
            usage,
        ],
    );
    assert!(
        !after
            .events
            .iter()
            .any(|e| matches!(e, NormalizedEvent::MessageAppended { agent_session_id, .. } if &**agent_session_id == ROOT)),
        "{:?}",
        after.events
    );
}

/// Relaunch: children replayed by `session/load` bind to their recorded child sessions: a
/// later `running` opens the next turn of that same session (no `childSessionCreated`), with a
/// turn id the first process never used, and the post-load `idle` changes nothing.
#[test]
fn a_child_replayed_by_session_load_binds_to_its_recorded_session() {
    let mut a = opened(Some(SESSION));
    let load = feed(
        &mut a,
        &[
            sub(
                SESSION,
                "c1",
                json!({"title": "helper", "state": {"state": "running"}}),
            ),
            message(SESSION, "m1", SESSION, "c1"),
            sub(SESSION, "c1", idle("end_turn")),
        ],
    );
    assert!(
        load.events.is_empty(),
        "replayed history is not re-recorded"
    );
    let out = a
        .on_native(20, &json!({"jsonrpc": "2.0", "id": 1, "result": {}}))
        .expect("load answer");
    assert!(out.native.is_empty() || out.native.iter().all(|m| m["method"] != "session/new"));
    start(&mut a, "T2");
    let out = feed(
        &mut a,
        &[
            sub(SESSION, "c1", idle("end_turn")),
            sub(SESSION, "c1", json!({"state": {"state": "running"}})),
        ],
    );
    assert!(created(&out).is_empty(), "{:?}", out.events);
    let (session, first) = child_ids(&ROOT.into(), "acp", "c1", 1);
    let started: Vec<_> = out
        .events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::TurnStarted {
                agent_session_id,
                turn_id,
                ..
            } => Some((agent_session_id.clone(), turn_id.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(started.len(), 1);
    assert_eq!(started[0].0, session);
    assert_ne!(started[0].1, first);
    assert!(
        started[0].1.contains("T2"),
        "unique across processes: {}",
        started[0].1
    );
}

/// "State for a deleted child" is a diagnostic and changes nothing: after the user deleted a
/// settled child session, the agent reusing it (`running`, then `idle`) opens no turn, does
/// not bring the child back, and the root's next turn settles as usual.
#[test]
fn state_for_a_deleted_child_changes_nothing() {
    use tutti_core::driver::Driver;
    use tutti_core::input::{Command, Input};
    use tutti_core::store::MemoryStore;

    let mut store = MemoryStore::new();
    let mut d = Driver::new();
    let mut now = 0;
    let mut tick = || {
        now += 1;
        now
    };
    let root: tutti_core::model::Id = "root".into();
    let input = |d: &mut Driver, store: &mut MemoryStore, now: i64, c: Command| {
        let _ = d.handle(
            DriverInput::Host {
                now,
                input: Input::Command(c),
                reply: None,
            },
            store,
        );
        d.commit_pending(store);
    };
    let native = |d: &mut Driver, store: &mut MemoryStore, now: i64, m: Value| {
        d.handle(
            DriverInput::Native {
                now,
                root: "root",
                message: &m,
            },
            store,
        )
        .expect("accepted");
        d.commit_pending(store);
    };
    input(
        &mut d,
        &mut store,
        tick(),
        Command::CreateSession {
            agent_session_id: root.clone(),
            workspace_id: "w".into(),
            provider: "acp".into(),
            title: None,
            capabilities: None,
        },
    );
    let _ = d.handle(
        DriverInput::Attach {
            now: tick(),
            root: root.clone(),
            adapter: Box::new(AcpAdapter::new(root.clone(), AcpConfig::default())),
        },
        &store,
    );
    d.commit_pending(&mut store);
    let submit = |turn: &str| Command::Submit {
        agent_session_id: "root".into(),
        turn_id: turn.into(),
        text: "go".into(),
    };
    input(&mut d, &mut store, tick(), submit("T1"));
    for m in [
        json!({"jsonrpc": "2.0", "id": 0, "result": {"protocolVersion": 1, "agentCapabilities": {}}}),
        json!({"jsonrpc": "2.0", "id": 1, "result": {"sessionId": SESSION}}),
        sub(SESSION, "c1", running()),
        message(SESSION, "m1", SESSION, "c1"),
        sub(SESSION, "c1", idle("end_turn")),
        json!({"jsonrpc": "2.0", "id": 2, "result": {"stopReason": "end_turn"}}),
    ] {
        native(&mut d, &mut store, tick(), m);
    }
    let (child, first) = child_ids(&root, "acp", "c1", 1);
    assert_eq!(
        d.engine().turn("root", "T1").and_then(|t| t.outcome()),
        Some(Outcome::Completed)
    );
    input(
        &mut d,
        &mut store,
        tick(),
        Command::DeleteSession {
            agent_session_id: child.clone(),
        },
    );
    assert!(d
        .engine()
        .session(&child)
        .is_some_and(|s| s.deleted_at.is_some()));
    input(&mut d, &mut store, tick(), submit("T2"));
    let before = d.engine().snapshot("root").expect("tree");
    for m in [
        sub(SESSION, "c1", json!({"state": {"state": "running"}})),
        sub(SESSION, "c1", idle("end_turn")),
    ] {
        native(&mut d, &mut store, tick(), m);
    }
    let after = d.engine().snapshot("root").expect("tree");
    assert_eq!(before.turns, after.turns, "no turn opened or settled");
    assert_eq!(before.sessions, after.sessions, "the child stays deleted");
    assert!(d.engine().turn(&child, &first).is_none());
    native(
        &mut d,
        &mut store,
        tick(),
        json!({"jsonrpc": "2.0", "id": 3, "result": {"stopReason": "end_turn"}}),
    );
    assert_eq!(
        d.engine().turn("root", "T2").and_then(|t| t.outcome()),
        Some(Outcome::Completed)
    );
    assert!(d.engine().check_invariants().is_empty());
}

/// Issue 32, "token usage where the provider reports it (ACP `usage_update`)": the real agent's
/// last `usage_update` of the root is the root session's usage (context tokens and window), and
/// the cost it sent on an earlier update stays when a later one carries none.
#[test]
fn claude_agent_acp_usage_updates_become_the_root_sessions_usage() {
    let text = capture("foreground");
    let (mut used, mut size, mut cost) = (None, None, None);
    for line in text.lines() {
        let Some(msg) = line
            .strip_prefix("<< ")
            .and_then(|j| serde_json::from_str::<Value>(j).ok())
        else {
            continue;
        };
        let u = &msg["params"]["update"];
        if u["sessionUpdate"] == "usage_update" {
            used = u["used"].as_u64();
            size = u["size"].as_u64();
            if u["cost"].is_object() {
                cost = Some((u["cost"]["amount"].as_f64(), u["cost"]["currency"].clone()));
            }
        }
    }
    assert!(
        used.is_some() && cost.is_some(),
        "the capture reports usage and cost"
    );
    let out = replay("foreground");
    let root = out
        .snapshot
        .sessions
        .iter()
        .find(|s| !s.is_child())
        .expect("root");
    let got = root.usage.as_ref().expect("usage recorded");
    assert_eq!((got.context_tokens, got.context_window), (used, size));
    let c = got.cost.as_ref().expect("cost kept");
    let (amount, currency) = cost.unwrap();
    assert_eq!((Some(c.amount), json!(c.currency)), (amount, currency));
    assert_eq!(got.total_tokens, None);
}

/// A child's own `usage_update` (its own `sessionId`) is that child's usage, also after its
/// prompt's answer (not turn content); bad counts and a currency that is not a short code are
/// left out, and an update with nothing usable records nothing.
#[test]
fn a_childs_usage_update_is_the_childs_usage_and_bad_fields_are_left_out() {
    let mut a = opened(None);
    start(&mut a, "T");
    let out = feed(
        &mut a,
        &[
            sub(SESSION, "c1", running()),
            message(SESSION, "m1", SESSION, "c1"),
            update(
                "c1",
                json!({"sessionUpdate": "usage_update", "used": 5, "size": 50,
                "cost": {"amount": 0.5, "currency": "USD"}}),
            ),
            update(
                "c1",
                json!({"sessionUpdate": "usage_update", "used": -1, "size": "x",
                "cost": {"amount": 1, "currency": "not a currency code"}}),
            ),
            update(SESSION, json!({"sessionUpdate": "usage_update", "used": 7})),
        ],
    );
    let kid = created(&out)[0].0.clone();
    let usage: Vec<(String, tutti_core::model::TokenUsage)> = out
        .events
        .iter()
        .filter_map(|e| match e {
            NormalizedEvent::SessionMetadataUpdated {
                agent_session_id,
                usage: Some(u),
                ..
            } => Some((agent_session_id.to_string(), u.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(usage.len(), 2, "{usage:?}");
    assert_eq!(usage[0].0, kid);
    assert_eq!(
        (usage[0].1.context_tokens, usage[0].1.context_window),
        (Some(5), Some(50))
    );
    assert_eq!(usage[0].1.cost.as_ref().map(|c| c.amount), Some(0.5));
    assert_eq!(
        (usage[1].0.as_str(), usage[1].1.context_tokens),
        (ROOT, Some(7))
    );
}
