//! One test per engine rule of the spec (issue: "each with a test that names it").

mod common;
use common::*;
use serde_json::{json, Value};
use tutti_core::store::Store;
use tutti_core::Rejected;

#[test]
fn rule_1_child_relation_is_immutable_and_creation_is_atomic_and_idempotent() {
    let mut h = H::new();
    h.root("R");
    h.submit("R", "T");
    h.started("R", "p1");
    // Atomic: the child session, its first turn and the root turn's child count are written by
    // one step (one batch, one transaction), never one without the others.
    let step = h.child("C1", "CT1", "R", "T", "R", "T");
    let rows = &step.persist.rows;
    let session_row = rows.iter().any(|r| {
        matches!(r, tutti_core::step::Row::Session(s) if &*s.id == "C1" && s.parent_agent_session_id().map(|x| &**x) == Some("R"))
    });
    let child_turn_row = rows
        .iter()
        .any(|r| matches!(r, tutti_core::step::Row::Turn(t) if &*t.id == "CT1"));
    let root_turn_row = rows.iter().any(|r| {
        matches!(r, tutti_core::step::Row::Turn(t) if &*t.id == "T" && t.child_session_count() == 1)
    });
    assert!(
        session_row && child_turn_row && root_turn_row,
        "one batch holds the child session, its turn and the root's count: {rows:?}"
    );
    let s = h.session("C1").unwrap();
    assert_eq!(s["kind"], "child");
    assert_eq!(s["parentAgentSessionId"], "R");
    assert_eq!(s["rootTurnId"], "T");
    assert_eq!(h.phase("CT1"), "submitted");
    // Identical repeat: accepted, nothing persisted.
    let step = h.child("C1", "CT1", "R", "T", "R", "T");
    assert!(step.persist.is_empty(), "identical repeat is a no-op");
    // Conflicting repeat (another parent): rejected.
    h.child("C2", "CT2", "R", "T", "R", "T");
    let e = h.reject(json!({"type":"childSessionCreated","agentSessionId":"C1","turnId":"CT1",
        "parentAgentSessionId":"C2","parentTurnId":"CT2","rootAgentSessionId":"R","rootTurnId":"T"}));
    assert!(matches!(e, Rejected::ConflictingChild(_)));
    assert_eq!(h.session("C1").unwrap()["parentAgentSessionId"], "R");
    h.check();
}

#[test]
fn rule_2_child_turn_lifecycle_and_guidance_turns() {
    let mut h = tree_with_children(1);
    h.feed(json!({"type":"turnStarted","agentSessionId":"C1","turnId":"CT1"}));
    assert_eq!(h.phase("CT1"), "running");
    h.feed(json!({"type":"turnWaiting","agentSessionId":"C1","turnId":"CT1"}));
    assert_eq!(h.phase("CT1"), "waiting");
    h.terminal("C1", "CT1", "completed");
    assert_eq!(h.outcome("CT1").as_deref(), Some("completed"));
    // Later guidance adds a turn to the same child under the same root relation.
    h.feed(json!({"type":"turnStarted","agentSessionId":"C1","turnId":"CT1b"}));
    assert_eq!(h.turn("CT1b")["trigger"], "guidance");
    assert_eq!(h.session("C1").unwrap()["rootTurnId"], "T");
    assert_eq!(h.session("C1").unwrap()["activeTurnId"], "CT1b");
    assert_eq!(h.session("C1").unwrap()["lastTurnId"], "CT1b");
    h.completed("R", "p1", "completed");
    assert_eq!(h.phase("T"), "waiting", "the guidance turn gates the root");
    h.terminal("C1", "CT1b", "completed");
    assert_eq!(h.outcome("T").as_deref(), Some("completed"));
    h.check();
}

#[test]
fn rule_3_root_gate_in_either_order_and_failed_child_never_fails_root() {
    for provider_first in [true, false] {
        let mut h = tree_with_children(2);
        if provider_first {
            h.completed("R", "p1", "completed");
            assert_eq!(h.phase("T"), "waiting");
        }
        h.terminal("C1", "CT1", "failed");
        assert!(h.outcome("T").is_none());
        h.terminal("C2", "CT2", "completed");
        if !provider_first {
            assert_eq!(
                h.phase("T"),
                "running",
                "children done, provider still running"
            );
            h.completed("R", "p1", "completed");
        }
        assert_eq!(h.outcome("T").as_deref(), Some("completed"));
        assert!(h.session("R").unwrap().get("activeTurnId").is_none());
        h.check();
    }
    // Only the gate settles roots.
    let mut h = tree_with_children(0);
    let e = h.reject(
        json!({"type":"turnTerminal","agentSessionId":"R","turnId":"T","outcome":"completed"}),
    );
    assert!(matches!(e, Rejected::WrongKind { .. }));
}

#[test]
fn rule_3_nested_grandchild_gates_the_root() {
    let mut h = tree_with_children(1);
    h.child("G1", "GT1", "C1", "CT1", "R", "T");
    h.child("GG1", "GGT1", "G1", "GT1", "R", "T");
    h.terminal("C1", "CT1", "completed");
    h.terminal("G1", "GT1", "completed");
    h.completed("R", "p1", "completed");
    assert_eq!(
        h.phase("T"),
        "waiting",
        "a great-grandchild is still active"
    );
    assert_eq!(h.engine.active_child_turns("R", "T"), 1);
    h.terminal("GG1", "GGT1", "completed");
    assert_eq!(h.outcome("T").as_deref(), Some("completed"));
    h.check();
}

#[test]
fn rule_4_goal_metadata_never_settles_or_unlocks_the_root() {
    let mut h = tree_with_children(1);
    h.completed("R", "p1", "completed");
    h.feed(
        json!({"type":"sessionMetadataUpdated","agentSessionId":"R","goal":{"status":"complete"}}),
    );
    assert_eq!(h.phase("T"), "waiting");
    assert_eq!(h.session("R").unwrap()["activeTurnId"], "T");
    assert_eq!(h.session("R").unwrap()["goal"]["status"], "complete");
    let step = h.submit("R", "T2");
    assert_eq!(
        step.reply.unwrap().name(),
        "appended",
        "composer stays on the same root turn"
    );
    h.check();
}

#[test]
fn rule_5_submit_appends_steers_or_reserves_and_never_starts_a_second_root_turn() {
    let mut h = tree_with_children(1);
    let step = h.submit("R", "T2");
    let req = &provider_requests(&step)[0];
    assert_eq!(req["type"], "guide");
    assert_eq!(req["mode"], "steer");
    assert_eq!(req["providerTurnId"], "p1");
    assert!(h.store.turn("T2").unwrap().is_none(), "no second root turn");
    h.completed("R", "p1", "completed");
    let step = h.submit("R", "T3");
    assert_eq!(provider_requests(&step)[0]["mode"], "startOnRoot");
    // The reservation holds the gate: the last child ends, the root stays active.
    h.terminal("C1", "CT1", "completed");
    assert_eq!(h.phase("T"), "running");
    h.started("R", "p2");
    h.completed("R", "p2", "completed");
    assert_eq!(h.outcome("T").as_deref(), Some("completed"));
    // A guideFailed releases a reservation.
    let mut h = tree_with_children(1);
    h.completed("R", "p1", "completed");
    h.submit("R", "T2");
    h.terminal("C1", "CT1", "completed");
    assert!(h.outcome("T").is_none());
    h.feed(json!({"type":"guideFailed","agentSessionId":"R","turnId":"T","error":"write failed"}));
    assert_eq!(h.outcome("T").as_deref(), Some("completed"));
    // After the root settles, submit starts a new root turn.
    let step = h.submit("R", "T9");
    assert_eq!(step.reply.unwrap().name(), "started");
    h.check();
}

#[test]
fn rule_5_pending_unsupported_when_provider_cannot_guide_children_only() {
    let mut h = H::new();
    h.feed(
        json!({"type":"createSession","agentSessionId":"R","workspaceId":"W","provider":"acp",
        "capabilities":{"guideWhileChildrenOnly":false}}),
    );
    h.submit("R", "T");
    h.started("R", "p1");
    h.child("C1", "CT1", "R", "T", "R", "T");
    h.completed("R", "p1", "completed");
    let step = h.submit("R", "T2");
    assert_eq!(step.reply.unwrap().name(), "pendingUnsupported");
    assert!(step.provider.is_empty() && step.persist.is_empty());
    h.check();
}

#[test]
fn rule_6_root_cancel_records_exact_targets_closes_creation_and_settles_on_result() {
    let mut h = tree_with_children(2);
    h.feed(json!({"type":"interactionRequested","agentSessionId":"C2","turnId":"CT2","requestId":"q1","kind":"approval"}));
    let step = h.cancel("op1", "R", "T");
    let req = &provider_requests(&step)[0];
    assert_eq!(req["type"], "cancel");
    assert_eq!(req["rootAgentSessionId"], "R");
    let exact = json!([
        {"agentSessionId":"R","turnId":"T"},
        {"agentSessionId":"C1","turnId":"CT1"},
        {"agentSessionId":"C2","turnId":"CT2"},
    ]);
    assert_eq!(
        req["targets"], exact,
        "the root and every active child, nothing else"
    );
    let op = h.store.cancel_operation("op1").unwrap().unwrap();
    assert_eq!(
        serde_json::to_value(&op.targets).unwrap(),
        exact,
        "the operation records the same exact targets before any provider I/O"
    );
    assert_eq!(op.state, tutti_core::model::CancelState::Prepared);
    assert_eq!(step.timers.len(), 1, "a cancel deadline is armed");
    let e = h.reject(
        json!({"type":"childSessionCreated","agentSessionId":"C3","turnId":"CT3",
        "parentAgentSessionId":"R","parentTurnId":"T","rootAgentSessionId":"R","rootTurnId":"T"}),
    );
    assert!(matches!(e, Rejected::ChildCreationClosed(_)));
    h.feed(json!({"type":"cancelResult","operationId":"op1","acked":[{"agentSessionId":"C1","turnId":"CT1"}]}));
    assert_eq!(h.outcome("CT1").as_deref(), Some("canceled"));
    assert_eq!(h.outcome("CT2").as_deref(), Some("interrupted"));
    assert_eq!(h.outcome("T").as_deref(), Some("canceled"));
    assert!(h.turn("T").get("error").is_none());
    let i = h.store.interaction("CT2", "q1").unwrap().unwrap();
    assert_eq!(i.status, tutti_core::model::InteractionStatus::Superseded);
    h.check();
}

#[test]
fn rule_6_cancel_failed_is_not_confirmation() {
    let mut h = tree_with_children(1);
    h.cancel("op1", "R", "T");
    h.feed(json!({"type":"cancelFailed","operationId":"op1","error":"write failed"}));
    assert_eq!(h.outcome("CT1").as_deref(), Some("interrupted"));
    assert_eq!(h.outcome("T").as_deref(), Some("canceled"));
    let op = h.store.cancel_operation("op1").unwrap().unwrap();
    assert_eq!(op.state, tutti_core::model::CancelState::Failed);
    assert_eq!(op.error.as_deref(), Some("write failed"));
    h.check();
}

#[test]
fn rule_7_child_only_cancel_settles_root_from_retained_outcome() {
    let mut h = tree_with_children(1);
    h.completed("R", "p1", "completed");
    let step = h.cancel("op1", "C1", "CT1");
    let targets = provider_requests(&step)[0]["targets"].clone();
    assert_eq!(targets, json!([{"agentSessionId":"C1","turnId":"CT1"}]));
    let step = h.feed(json!({"type":"cancelResult","operationId":"op1","acked":[{"agentSessionId":"C1","turnId":"CT1"}]}));
    let published: Vec<String> = step.outbox_turns().map(|t| t.to_string()).collect();
    assert!(published.contains(&"CT1".to_string()) && published.contains(&"T".to_string()));
    assert_eq!(h.outcome("CT1").as_deref(), Some("canceled"));
    assert_eq!(
        h.outcome("T").as_deref(),
        Some("completed"),
        "not relabeled canceled"
    );
    h.check();
}

#[test]
fn rule_8_nothing_resurrects_after_cancel() {
    let mut h = tree_with_children(1);
    h.cancel("op1", "R", "T");
    // A child terminal while the cancel is in flight does not decide the outcome.
    h.terminal("C1", "CT1", "failed");
    assert_eq!(h.phase("CT1"), "settling");
    h.feed(json!({"type":"cancelResult","operationId":"op1","acked":[]}));
    let before = h.store.outbox().len();
    h.terminal("C1", "CT1", "failed");
    h.feed(json!({"type":"messageAppended","agentSessionId":"C1","turnId":"CT1","messageId":"m1","role":"assistant","text":"late"}));
    h.started("R", "p9");
    assert_eq!(h.store.outbox().len(), before, "late facts publish nothing");
    let step = h.completed("R", "p1", "interrupted");
    assert_eq!(
        step.outbox_turns().count(),
        0,
        "late provider terminal is not republished"
    );
    assert_eq!(h.turn("T")["rootProviderTurn"]["phase"], "completed");
    assert_eq!(h.outcome("T").as_deref(), Some("canceled"));
    assert_eq!(h.outcome("CT1").as_deref(), Some("interrupted"));
    h.check();
}

#[test]
fn rule_8_late_child_history_is_kept_unless_closed_target() {
    let mut h = tree_with_children(2);
    // A child that settled normally: its late output is history and is kept.
    h.terminal("C1", "CT1", "completed");
    h.feed(json!({"type":"messageAppended","agentSessionId":"C1","turnId":"CT1","messageId":"m1","role":"assistant","text":"late but fine"}));
    let kept = h.store.messages("C1", None, 10).unwrap();
    assert_eq!(kept.len(), 1);
    assert_eq!(&*kept[0].text, "late but fine");
    // A child that was a cancel target (a closed target): its late output is dropped.
    h.cancel("op1", "C2", "CT2");
    h.feed(json!({"type":"cancelResult","operationId":"op1","acked":[{"agentSessionId":"C2","turnId":"CT2"}]}));
    assert_eq!(h.outcome("CT2").as_deref(), Some("canceled"));
    let before = h.store.outbox().len();
    h.feed(json!({"type":"messageAppended","agentSessionId":"C2","turnId":"CT2","messageId":"m2","role":"assistant","text":"too late"}));
    assert!(
        h.store.messages("C2", None, 10).unwrap().is_empty(),
        "a closed cancel target keeps no late output"
    );
    assert_eq!(h.store.outbox().len(), before, "and publishes nothing");
    h.check();
}

#[test]
fn rule_9_interactions_are_owned_by_the_exact_child_tuple() {
    let mut h = tree_with_children(1);
    h.feed(
        json!({"type":"interactionRequested","agentSessionId":"C1","turnId":"CT1","requestId":"q1",
        "providerTurnId":"native-turn-7","kind":"commandApproval","payload":{"command":"ls"}}),
    );
    for (s, t) in [("R", "T"), ("R", "CT1"), ("C1", "T")] {
        let e = h.reject(json!({"type":"respondInteraction","agentSessionId":s,"turnId":t,"requestId":"q1","response":"allow"}));
        assert!(matches!(
            e,
            Rejected::UnknownInteraction { .. } | Rejected::UnknownTurn { .. }
        ));
    }
    let step = h.feed(json!({"type":"respondInteraction","agentSessionId":"C1","turnId":"CT1","requestId":"q1","response":"allow"}));
    let req = &provider_requests(&step)[0];
    assert_eq!(req["providerTurnId"], "native-turn-7");
    assert_eq!(req["agentSessionId"], "C1");
    assert_eq!(req["rootAgentSessionId"], "R");
    h.reject(json!({"type":"respondInteraction","agentSessionId":"C1","turnId":"CT1","requestId":"q1","response":"allow"}));
    h.check();
}

#[test]
fn rule_10_delete_tombstones_the_subtree_and_refuses_active_trees() {
    let mut h = tree_with_children(1);
    h.child("G1", "GT1", "C1", "CT1", "R", "T");
    let e = h.reject(json!({"type":"deleteSession","agentSessionId":"R"}));
    assert!(matches!(e, Rejected::ActiveTurnBlocksDelete { .. }));
    h.terminal("G1", "GT1", "completed");
    h.terminal("C1", "CT1", "completed");
    h.completed("R", "p1", "completed");
    h.feed(json!({"type":"deleteSession","agentSessionId":"C1"}));
    assert!(h.session("C1").is_none() && h.session("G1").is_none());
    assert!(h.store.turn("GT1").unwrap().is_none());
    assert!(h.session("R").is_some());
    h.feed(json!({"type":"deleteSession","agentSessionId":"R"}));
    assert!(h.session("R").is_none());
    assert!(h.store.turn("T").unwrap().is_none());
    h.check();
}

/// The engine finds a session's latest turn by a remembered position; deleting a subtree moves
/// the positions of the turns behind it. Events must still reach exactly their own turn, and a
/// turn of another session (now at the remembered position) must stay out of reach.
#[test]
fn events_reach_their_exact_turn_after_a_deletion_moved_the_turns() {
    let mut h = tree_with_children(2);
    h.terminal("C1", "CT1", "completed");
    // Turns were T, CT1, CT2; after the deletion CT2 moves down and CT3 takes its old place.
    h.feed(json!({"type":"deleteSession","agentSessionId":"C1"}));
    h.child("C3", "CT3", "R", "T", "R", "T");
    let step = h.feed(
        json!({"type":"messageAppended","agentSessionId":"C2","turnId":"CT2",
        "messageId":"m1","role":"assistant","text":"hi"}),
    );
    match step.persist.rows.first() {
        Some(tutti_core::Row::Message(m)) => {
            assert_eq!((&*m.agent_session_id, &*m.turn_id), ("C2", "CT2"));
        }
        other => panic!("expected a message row, got {other:?}"),
    }
    let e = h.reject(
        json!({"type":"messageAppended","agentSessionId":"C2","turnId":"CT3",
        "messageId":"m2","role":"assistant","text":"hi"}),
    );
    assert!(matches!(e, Rejected::UnknownTurn { .. }), "{e:?}");
    let e = h.reject(
        json!({"type":"toolCallUpdated","agentSessionId":"C2","turnId":"CT3",
        "toolCallId":"x","status":"started"}),
    );
    assert!(matches!(e, Rejected::UnknownTurn { .. }), "{e:?}");
    h.feed(json!({"type":"turnWaiting","agentSessionId":"C2","turnId":"CT2"}));
    assert_eq!(h.phase("CT2"), "waiting");
    assert_eq!(h.phase("CT3"), "submitted");
    h.feed(json!({"type":"turnStarted","agentSessionId":"C3","turnId":"CT3"}));
    assert_eq!(h.phase("CT3"), "running");
    assert_eq!(h.phase("CT2"), "waiting");
    h.terminal("C2", "CT2", "failed");
    assert_eq!(h.outcome("CT2").as_deref(), Some("failed"));
    assert_eq!(h.phase("CT3"), "running");
    // A guidance turn of C2 becomes its latest turn.
    h.feed(json!({"type":"turnStarted","agentSessionId":"C2","turnId":"CT2b"}));
    h.feed(json!({"type":"turnWaiting","agentSessionId":"C2","turnId":"CT2b"}));
    assert_eq!(h.phase("CT2b"), "waiting");
    assert_eq!(h.turn("CT2b")["agentSessionId"], "C2");
    h.check();
}

/// Message and tool call steps are built without a transaction: each is one published row of
/// its tree, with no guard, and a repeat is an ignored step that writes nothing.
#[test]
fn transcript_steps_publish_exactly_one_row_of_their_tree() {
    let mut h = tree_with_children(1);
    let message = json!({"type":"messageAppended","agentSessionId":"C1","turnId":"CT1",
        "messageId":"m1","role":"assistant","text":"hi"});
    let tool = json!({"type":"toolCallUpdated","agentSessionId":"C1","turnId":"CT1",
        "toolCallId":"x","name":"shell","status":"started"});
    for fact in [&message, &tool] {
        let step = h.feed(fact.clone());
        let batch = &step.persist;
        assert_eq!(batch.root_agent_session_id.as_deref(), Some("R"));
        assert_eq!(batch.workspace_id.as_deref(), Some("W"));
        assert_eq!(batch.rows.len(), 1);
        assert_eq!(batch.outbox.as_slice(), &[0]);
        assert!(batch.guards.is_empty());
        assert!(step.provider.is_empty() && step.timers.is_empty() && step.reply.is_none());
        assert!(step.ignored.is_none());
        let again = h.feed(fact.clone());
        assert!(again.persist.is_empty() && again.persist.root_agent_session_id.is_none());
        assert_eq!(again.ignored, Some(tutti_core::step::Ignored::Duplicate));
    }
    h.check();
}

/// A step's rows share the engine's copy of each entity, which the engine copies on write: a
/// step still held (queued for its commit, say) keeps every entity exactly as published, however
/// the same entities change afterwards. Sessions, turns, tool calls, interactions and cancel
/// operations are all published, then all changed again, while the first steps are held.
#[test]
fn held_steps_keep_their_rows_as_published_when_the_entities_change_later() {
    let mut h = tree_with_children(1);
    let held = [
        h.feed(json!({"type":"childSessionUpdated","agentSessionId":"C1","title":"worker"})),
        h.feed(json!({"type":"turnStarted","agentSessionId":"C1","turnId":"CT1"})),
        h.feed(
            json!({"type":"toolCallUpdated","agentSessionId":"C1","turnId":"CT1",
            "toolCallId":"x","name":"shell","status":"started"}),
        ),
        h.feed(
            json!({"type":"interactionRequested","agentSessionId":"C1","turnId":"CT1",
            "requestId":"q1","kind":"approval"}),
        ),
        h.cancel("op1", "R", "T"),
    ];
    let as_published: Vec<Value> = held
        .iter()
        .map(|s| serde_json::to_value(s).unwrap())
        .collect();
    let kinds: Vec<&str> = held
        .iter()
        .flat_map(|s| s.persist.rows.iter().map(|r| r.kind()))
        .collect();
    for kind in [
        "session",
        "turn",
        "toolCall",
        "interaction",
        "cancelOperation",
    ] {
        assert!(kinds.contains(&kind), "{kind} not published: {kinds:?}");
    }
    // Every entity above changes again: the tool call, the interaction (superseded), the
    // cancel operation, both turns, and the child session (its active turn cleared).
    h.feed(
        json!({"type":"toolCallUpdated","agentSessionId":"C1","turnId":"CT1",
        "toolCallId":"x","status":"completed"}),
    );
    let resolved = h.feed(json!({"type":"cancelResult","operationId":"op1",
        "acked":[{"agentSessionId":"C1","turnId":"CT1"}]}));
    let changed: Vec<&str> = resolved.persist.rows.iter().map(|r| r.kind()).collect();
    for kind in ["turn", "interaction", "cancelOperation", "session"] {
        assert!(changed.contains(&kind), "{kind} not changed: {changed:?}");
    }
    assert!(resolved.persist.rows.iter().any(
        |r| matches!(r, tutti_core::step::Row::Session(s) if &*s.id == "C1" && s.active_turn_id.is_none())
    ));
    for (step, before) in held.iter().zip(&as_published) {
        assert_eq!(&serde_json::to_value(step).unwrap(), before);
    }
    // And the engine's own copies did change.
    assert_eq!(h.outcome("CT1").as_deref(), Some("canceled"));
    assert_eq!(h.outcome("T").as_deref(), Some("canceled"));
    h.check();
}

#[test]
fn rule_11_detail_is_flat_and_lists_are_roots_only() {
    let mut h = tree_with_children(2);
    h.child("G1", "GT1", "C1", "CT1", "R", "T");
    let d = h.store.session_detail("R").unwrap().unwrap();
    let ids: Vec<&str> = d.child_sessions.iter().map(|s| &*s.id).collect();
    assert_eq!(ids, ["C1", "C2", "G1"]);
    let d = h.store.session_detail("C1").unwrap().unwrap();
    assert_eq!(d.child_sessions.len(), 1);
    let d = h.store.session_detail("G1").unwrap().unwrap();
    assert!(d.child_sessions.is_empty());
    let roots = h.store.roots("W");
    assert_eq!(roots.len(), 1);
    assert_eq!(&*roots[0].id, "R");
}

#[test]
fn provider_exit_interrupts_every_active_turn() {
    let mut h = tree_with_children(2);
    h.feed(json!({"type":"providerExited","rootAgentSessionId":"R","error":"exit status 137"}));
    for t in ["T", "CT1", "CT2"] {
        assert_eq!(h.outcome(t).as_deref(), Some("interrupted"));
        assert!(h.turn(t)["error"].as_str().unwrap().contains("137"));
    }
    h.check();
}

#[test]
fn rejected_input_changes_nothing() {
    let mut h = tree_with_children(1);
    let before = h.engine.snapshot("R");
    h.reject(json!({"type":"turnStarted","agentSessionId":"nope","turnId":"x"}));
    h.reject(json!({"type":"submit","agentSessionId":"C1","turnId":"x","text":"hi"}));
    assert_eq!(before, h.engine.snapshot("R"));
}

#[test]
fn restore_from_snapshot_continues_identically() {
    let mut h = tree_with_children(2);
    h.completed("R", "p1", "completed");
    let snap = h.store.load_tree("R").unwrap().unwrap();
    let mut fresh = tutti_core::Engine::new();
    fresh.restore(snap).unwrap();
    assert_eq!(fresh.snapshot("R"), h.engine.snapshot("R"));
    assert_eq!(fresh.active_child_turns("R", "T"), 2);
    h.engine = fresh;
    h.terminal("C1", "CT1", "completed");
    h.terminal("C2", "CT2", "completed");
    assert_eq!(h.outcome("T").as_deref(), Some("completed"));
    h.check();
}

/// A fresh engine refuses the snapshot of tree `R` as inconsistent and loads nothing of it.
fn assert_restore_refused(bad: tutti_core::TreeSnapshot) {
    let mut fresh = tutti_core::Engine::new();
    let err = fresh.restore(bad).expect_err("inconsistent snapshot");
    assert!(
        matches!(err, tutti_core::RestoreError::Inconsistent(_)),
        "{err}"
    );
    assert!(fresh.snapshot("R").is_none(), "nothing was loaded");
}

#[test]
fn restore_refuses_a_turn_whose_trigger_contradicts_its_session_kind() {
    use tutti_core::model::{ChildTrigger, ChildTurn, RootTurn, TurnRole};
    let h = tree_with_children(1);
    let good = h.store.load_tree("R").unwrap().unwrap();
    // A child turn claiming a user submission, and a root turn claiming delegation: the engine
    // tells root from child turns by their trigger (their role), so either would mislead it.
    let child = TurnRole::Child(ChildTurn {
        trigger: ChildTrigger::Delegation,
        provider_turn_id: None,
    });
    for (turn, role) in [("CT1", TurnRole::Root(RootTurn::default())), ("T", child)] {
        let mut bad = good.clone();
        let t = bad.turns.iter_mut().find(|t| &*t.id == turn).expect("turn");
        let mut swapped = tutti_core::model::Turn::new(
            t.id.clone(),
            t.agent_session_id.clone(),
            role,
            t.state.clone(),
            t.created_at,
        );
        swapped.version = t.version;
        *t = swapped;
        assert_restore_refused(bad);
    }
    let mut fresh = tutti_core::Engine::new();
    fresh.restore(good).expect("the real snapshot restores");
}

#[test]
fn restore_refuses_message_ids_of_a_session_outside_the_tree() {
    let h = tree_with_children(1);
    let good = h.store.load_tree("R").unwrap().unwrap();
    assert!(
        !good.message_ids.is_empty(),
        "the root turn recorded the user's message"
    );
    let mut bad = good.clone();
    bad.message_ids.push((
        tutti_core::model::Id::from("elsewhere"),
        tutti_core::model::Id::from("m1"),
    ));
    assert_restore_refused(bad);
    let mut fresh = tutti_core::Engine::new();
    fresh
        .restore(good.clone())
        .expect("the real snapshot restores");
    assert_eq!(
        fresh.snapshot("R").expect("loaded").message_ids,
        good.message_ids,
        "every message id comes back under its session"
    );
}

/// Rule 3 ("the root turn stays running while any nested child turn is active"): a root turn
/// whose provider turn has not started yet but which already has an active child (a provider that
/// reports the child before its own turn id) shows `running`, not `submitted`; when the child
/// settles and no provider turn is running, it is `submitted` again.
#[test]
fn rule_3_root_with_active_child_before_its_provider_turn_shows_running() {
    let mut h = H::new();
    h.root("R");
    h.submit("R", "T");
    assert_eq!(h.phase("T"), "submitted");
    let step = h.child("C1", "CT1", "R", "T", "R", "T");
    assert_eq!(
        h.phase("T"),
        "running",
        "an active child runs the root turn"
    );
    assert!(
        step.outbox_turns().any(|t| &**t == "T"),
        "the root's phase change is published"
    );
    h.terminal("C1", "CT1", "completed");
    assert_eq!(h.phase("T"), "submitted", "no provider turn and no child");
    assert_eq!(
        h.outcome("T"),
        None,
        "no provider outcome: the root stays open"
    );
    h.check();
}

/// Rule 7 ("an exact child-only cancel ... without adding the root as a cancel target"): preparing
/// a child-only cancel settles only that child's turn; the root keeps its phase (running while its
/// provider turn runs, waiting once the provider finished) and is not republished.
#[test]
fn rule_7_preparing_a_child_only_cancel_leaves_the_root_phase_alone() {
    for provider_done in [false, true] {
        let mut h = tree_with_children(2);
        if provider_done {
            h.completed("R", "p1", "completed");
        }
        let root_before = h.turn("T");
        let step = h.cancel("op1", "C1", "CT1");
        assert_eq!(h.phase("CT1"), "settling");
        assert_eq!(h.phase("CT2"), "submitted", "the sibling is not a target");
        assert_eq!(h.turn("T"), root_before, "the root turn is unchanged");
        assert_eq!(
            h.phase("T"),
            if provider_done { "waiting" } else { "running" }
        );
        let published: Vec<String> = step.outbox_turns().map(|t| t.to_string()).collect();
        assert_eq!(
            published,
            vec!["CT1".to_string()],
            "only the target is published"
        );
        h.check();
    }
}

/// Rule 6 ("cancel is idempotent by operation id"): the same operation id repeated for the same
/// turn answers the same operation; the same id for another turn of the same session is refused
/// (an operation id names one exact cancel, not one session).
#[test]
fn rule_6_an_operation_id_names_one_exact_turn() {
    let mut h = tree_with_children(0);
    h.cancel("op1", "R", "T");
    let again = h.cancel("op1", "R", "T");
    assert!(
        again.persist.is_empty() && again.provider.is_empty(),
        "a repeat is a no-op"
    );
    h.feed(json!({"type":"cancelResult","operationId":"op1","acked":[]}));
    assert_eq!(h.outcome("T").as_deref(), Some("canceled"));
    h.submit("R", "T2");
    let e = h.reject(
        json!({"type":"cancelTurn","operationId":"op1","agentSessionId":"R","turnId":"T2"}),
    );
    assert!(matches!(e, Rejected::OperationExists(_)), "{e:?}");
    assert_eq!(
        h.phase("T2"),
        "submitted",
        "the second turn is not canceled"
    );
    h.check();
}

/// Rule 6 ("a root cancel records every active nested child turn", including one a child-only
/// cancel already targets): once the root cancel took the child target over, the earlier
/// operation's answer settles that child only if the provider confirmed it; an unconfirmed or
/// failed earlier answer leaves the child to the root cancel.
#[test]
fn rule_6_a_taken_over_child_target_is_left_to_the_later_cancel_unless_confirmed() {
    for first in ["acked none", "failed"] {
        let mut h = tree_with_children(2);
        h.cancel("op1", "C1", "CT1");
        h.cancel("op2", "R", "T");
        let step = if first == "failed" {
            h.feed(json!({"type":"cancelFailed","operationId":"op1","error":"write failed"}))
        } else {
            h.feed(json!({"type":"cancelResult","operationId":"op1","acked":[]}))
        };
        assert_eq!(
            h.phase("CT1"),
            "settling",
            "{first}: CT1 belongs to op2 now"
        );
        assert_eq!(h.outcome("CT1"), None, "{first}");
        assert_eq!(step.outbox_turns().count(), 0, "{first}: nothing settled");
        h.feed(json!({"type":"cancelResult","operationId":"op2",
            "acked":[{"agentSessionId":"R","turnId":"T"},{"agentSessionId":"C1","turnId":"CT1"}]}));
        assert_eq!(
            h.outcome("CT1").as_deref(),
            Some("canceled"),
            "{first}: op2 confirmed it"
        );
        assert_eq!(h.outcome("CT2").as_deref(), Some("interrupted"), "{first}");
        assert_eq!(h.outcome("T").as_deref(), Some("canceled"), "{first}");
        h.check();
    }
}

/// Rule 3 ("the root turn settles when the root provider turn is terminal ..."): only the
/// running provider turn's terminal counts. A repeated terminal of the completed provider turn
/// is a duplicate; a terminal naming another provider turn is stale, while that turn runs and
/// after it completed; neither changes the root.
#[test]
fn rule_3_only_the_running_provider_turns_terminal_counts() {
    use tutti_core::step::Ignored;
    let mut h = tree_with_children(1);
    let stale = h.completed("R", "p9", "failed");
    assert_eq!(
        stale.ignored,
        Some(Ignored::StaleProviderTurn),
        "p9 is not running"
    );
    assert!(stale.persist.is_empty());
    assert_eq!(h.turn("T")["rootProviderTurn"]["phase"], "running");
    let done = h.completed("R", "p1", "completed");
    assert_eq!(done.ignored, None);
    assert_eq!(h.phase("T"), "waiting", "the child still runs");
    let again = h.completed("R", "p1", "failed");
    assert_eq!(
        again.ignored,
        Some(Ignored::Duplicate),
        "a repeat of p1's terminal"
    );
    assert!(again.persist.is_empty());
    let other = h.completed("R", "p8", "failed");
    assert_eq!(
        other.ignored,
        Some(Ignored::StaleProviderTurn),
        "p8 never ran"
    );
    assert!(other.persist.is_empty());
    h.terminal("C1", "CT1", "completed");
    assert_eq!(
        h.outcome("T").as_deref(),
        Some("completed"),
        "p1's outcome, not a repeat's"
    );
    h.check();
}

/// Rule 3: a root provider turn whose provider gives it no id (transport metadata is optional)
/// still starts: the root provider phase and the root turn are `running`, and its terminal
/// (also without an id) settles the root.
#[test]
fn rule_3_a_root_provider_turn_without_a_provider_id_is_adopted() {
    let mut h = H::new();
    h.root("R");
    h.submit("R", "T");
    let step = h.feed(json!({"type":"rootProviderTurnStarted","agentSessionId":"R"}));
    assert_eq!(step.ignored, None, "not taken for a duplicate");
    assert_eq!(h.turn("T")["rootProviderTurn"]["phase"], "running");
    assert_eq!(h.phase("T"), "running");
    h.feed(json!({"type":"rootProviderTurnCompleted","agentSessionId":"R","outcome":"completed"}));
    assert_eq!(h.outcome("T").as_deref(), Some("completed"));
    h.check();
}

/// Rule 3: a root provider event that names a canonical turn must name a turn of its own root
/// session; a child's turn named by a root provider event is refused and changes nothing.
#[test]
fn rule_3_root_provider_events_name_a_turn_of_their_own_session() {
    let mut h = tree_with_children(1);
    let e = h.reject(json!({"type":"rootProviderTurnStarted","agentSessionId":"R","turnId":"CT1","providerTurnId":"px"}));
    assert!(matches!(e, Rejected::UnknownTurn { .. }), "{e:?}");
    let e = h.reject(json!({"type":"rootProviderTurnCompleted","agentSessionId":"R","turnId":"CT1","providerTurnId":"py","outcome":"failed"}));
    assert!(matches!(e, Rejected::UnknownTurn { .. }), "{e:?}");
    // A provider turn already recorded on the root turn resolves to that turn only (issue 18).
    let e = h.reject(json!({"type":"rootProviderTurnCompleted","agentSessionId":"R","turnId":"CT1","providerTurnId":"p1","outcome":"failed"}));
    assert!(
        matches!(e, Rejected::ProviderTurnOfAnotherTurn { .. }),
        "{e:?}"
    );
    assert_eq!(h.phase("CT1"), "submitted");
    assert!(h.turn("CT1").get("rootProviderTurn").is_none());
    h.check();
}

/// Issue 23 ("When a turn settles, its still-open tool calls get a terminal status") across a
/// reload: the open tool calls of active turns are found again from the stored snapshot, so a
/// turn that settles after the tree was restored still closes them as `interrupted`.
#[test]
fn open_tool_calls_are_closed_at_settle_after_a_restore() {
    let mut h = tree_with_children(1);
    h.feed(json!({"type":"toolCallUpdated","agentSessionId":"C1","turnId":"CT1","toolCallId":"a","status":"started"}));
    h.feed(json!({"type":"toolCallUpdated","agentSessionId":"R","turnId":"T","toolCallId":"task","name":"Task","status":"in_progress"}));
    let snap = h.store.load_tree("R").unwrap().unwrap();
    let mut fresh = tutti_core::Engine::new();
    fresh.restore(snap).unwrap();
    h.engine = fresh;
    h.check();
    h.terminal("C1", "CT1", "completed");
    h.completed("R", "p1", "completed");
    assert_eq!(h.outcome("T").as_deref(), Some("completed"));
    for (s, c) in [("C1", "a"), ("R", "task")] {
        let call = h.engine.tool_call(s, c).expect("tool call");
        assert_eq!(
            &*call.status,
            tutti_core::model::TOOL_CALL_INTERRUPTED,
            "{s}/{c}"
        );
    }
    h.check();
}

// --- mutants: mod.rs, transcript.rs, guidance.rs, interaction.rs, provider_turns.rs ---

/// Rule 6 ("settle unconfirmed child turns interrupted after timeout"): the timeout is the
/// engine's configured `cancel_timeout_ms`, so the deadline timer a cancel arms is the cancel's
/// time plus that configured value (not the default), and the engine reports the configuration
/// it was built with.
#[test]
fn rule_6_the_cancel_deadline_is_the_configured_cancel_timeout() {
    let config = tutti_core::EngineConfig {
        cancel_timeout_ms: 250,
    };
    assert_ne!(config, tutti_core::EngineConfig::default());
    let mut h = H::new();
    h.engine = tutti_core::Engine::with_config(config);
    assert_eq!(h.engine.config(), config);
    h.root("R");
    h.submit("R", "T");
    h.started("R", "p1");
    let step = h.cancel("op1", "R", "T");
    assert_eq!(
        step.timers,
        vec![tutti_core::step::TimerRequest {
            timer: tutti_core::TimerId::CancelDeadline {
                operation_id: "op1".into()
            },
            at: h.now + 250,
        }]
    );
    h.check();
}

/// Rule 6 ("Recovery replays the same idempotent target set"): the engine lists exactly the
/// cancel operations still prepared, across every loaded tree and sorted by id, so a driver can
/// replay them after a restart; a resolved operation is no longer listed but is still readable.
#[test]
fn rule_6_prepared_cancel_operations_are_listed_for_recovery() {
    let mut h = H::new();
    for (r, t) in [("R", "T"), ("S", "U")] {
        h.root(r);
        h.submit(r, t);
        h.started(r, "p1");
    }
    assert!(h.engine.prepared_cancels().is_empty());
    h.cancel("op2", "R", "T");
    h.cancel("op1", "S", "U");
    let ids = |h: &H| -> Vec<String> {
        h.engine
            .prepared_cancels()
            .iter()
            .map(|o| o.id.to_string())
            .collect()
    };
    assert_eq!(ids(&h), ["op1", "op2"]);
    h.feed(json!({"type":"cancelResult","operationId":"op2","acked":[{"agentSessionId":"R","turnId":"T"}]}));
    assert_eq!(
        ids(&h),
        ["op1"],
        "the resolved operation is no longer prepared"
    );
    let done = h.engine.cancel_operation("op2").expect("op2 stays loaded");
    assert_ne!(done.state, tutti_core::model::CancelState::Prepared);
    assert_eq!(
        h.engine
            .cancel_operation("op1")
            .map(|o| &*o.root_agent_session_id),
        Some("S")
    );
    assert!(h.engine.cancel_operation("op3").is_none());
    h.check();
}

/// Issue 17 ("a runtime whose tree is quiescent (no active turn, no prepared cancel, no pending
/// interaction)"): a tree with an active turn is never quiescent, even with no cancel and no
/// interaction; a settled tree is, also when it holds a finished cancel operation; a tree that
/// is not loaded is.
#[test]
fn a_tree_is_quiescent_only_without_active_turns_prepared_cancels_or_pending_interactions() {
    let mut h = H::new();
    h.root("R");
    assert!(h.engine.is_quiescent("R"), "a root without a turn");
    h.submit("R", "T");
    assert!(!h.engine.is_quiescent("R"), "an active root turn");
    h.started("R", "p1");
    h.completed("R", "p1", "completed");
    assert!(h.engine.is_quiescent("R"), "the root turn settled");
    h.submit("R", "T2");
    h.started("R", "p2");
    h.cancel("op1", "R", "T2");
    assert!(!h.engine.is_quiescent("R"), "a prepared cancel");
    h.feed(json!({"type":"cancelResult","operationId":"op1","acked":[{"agentSessionId":"R","turnId":"T2"}]}));
    assert_eq!(h.outcome("T2").as_deref(), Some("canceled"));
    assert!(
        h.engine.is_quiescent("R"),
        "a settled tree holding a completed cancel operation"
    );
    assert!(h.engine.is_quiescent("nope"), "an unloaded tree");
    h.check();
}

/// Design ("Resources follow the tree: a quiescent tree leaves memory"): every read of the
/// engine answers from the loaded tree that holds the id (roots, a session's root, sessions,
/// turns, tool calls, pending interactions); an evicted tree answers nothing and leaves the
/// other trees alone; restoring its snapshot answers as before.
#[test]
fn engine_reads_answer_from_the_loaded_tree_and_an_evicted_tree_answers_nothing() {
    let mut h = tree_with_children(1);
    h.root("S");
    h.submit("S", "U");
    h.feed(json!({"type":"toolCallUpdated","agentSessionId":"C1","turnId":"CT1","toolCallId":"a","status":"started"}));
    h.feed(json!({"type":"interactionRequested","agentSessionId":"C1","turnId":"CT1","requestId":"q1","kind":"approval"}));
    h.feed(json!({"type":"interactionRequested","agentSessionId":"C1","turnId":"CT1","requestId":"q2","kind":"approval"}));
    let root_of = |h: &H, s: &str| h.engine.root_of(s).map(|r| r.to_string());
    let pending = |h: &H, r: &str| -> Vec<String> {
        h.engine
            .pending_interactions(r)
            .iter()
            .map(|i| i.request_id.to_string())
            .collect()
    };
    let reads = |h: &H| {
        assert_eq!(
            h.engine.roots(),
            ["R", "S"].map(tutti_core::model::Id::from)
        );
        assert_eq!(root_of(h, "C1").as_deref(), Some("R"));
        assert_eq!(root_of(h, "S").as_deref(), Some("S"));
        assert_eq!(
            h.engine.session("C1").map(|s| &*s.id),
            Some("C1"),
            "a child session"
        );
        assert_eq!(
            h.engine.turn("C1", "CT1").map(|t| &*t.agent_session_id),
            Some("C1")
        );
        assert_eq!(h.engine.turn("S", "U").map(|t| &*t.id), Some("U"));
        assert_eq!(
            h.engine.tool_call("C1", "a").map(|c| &*c.status),
            Some("started")
        );
        assert!(
            h.engine.tool_call("R", "a").is_none(),
            "another session's call"
        );
        assert_eq!(pending(h, "S"), Vec::<String>::new());
    };
    reads(&h);
    assert_eq!(pending(&h, "R"), ["q1", "q2"]);
    h.feed(json!({"type":"respondInteraction","agentSessionId":"C1","turnId":"CT1","requestId":"q1","response":"allow"}));
    assert_eq!(
        pending(&h, "R"),
        ["q2"],
        "an answered interaction is not pending"
    );
    for unknown in ["nope", "CT1"] {
        assert!(root_of(&h, unknown).is_none());
        assert!(h.engine.session(unknown).is_none());
    }
    assert!(h.engine.turn("C1", "nope").is_none());

    let snap = h.engine.snapshot("R").expect("R is loaded");
    h.engine.evict("R");
    assert_eq!(h.engine.roots(), [tutti_core::model::Id::from("S")]);
    assert!(h.engine.snapshot("R").is_none());
    assert!(root_of(&h, "C1").is_none());
    assert!(h.engine.session("C1").is_none());
    assert!(h.engine.tool_call("C1", "a").is_none());
    assert!(pending(&h, "R").is_empty());
    assert_eq!(h.engine.turn("S", "U").map(|t| &*t.id), Some("U"));
    h.engine
        .restore(snap.clone())
        .expect("the snapshot restores");
    assert_eq!(h.engine.snapshot("R"), Some(snap));
    reads(&h);
    assert_eq!(pending(&h, "R"), ["q2"]);
    h.check();
}

// --- mutants: core/src/engine/child.rs, core/src/engine/tree.rs, the Claude adapter ---

/// Spec, cancel: "Recovery replays the same idempotent target set instead of assuming that an
/// earlier provider side effect completed." A committed batch applied again (the daemon crashed
/// after the commit, before it learned so) is accepted and changes nothing: its version guards
/// name the version it was decided on *and* the version it writes. A batch decided on an older
/// version of an entity (a stale replay) is refused and never rolls the entity back.
#[test]
fn rule_6_a_committed_batch_replayed_after_a_crash_is_a_no_op_and_a_stale_one_is_refused() {
    let mut h = H::new();
    h.root("R");
    let mut steps = vec![h.submit("R", "T"), h.started("R", "p1")];
    // A child creation writes a session row and two turn rows; a cancel an operation row.
    steps.push(h.child("C1", "CT1", "R", "T", "R", "T"));
    steps.push(h.feed(json!({"type":"turnStarted","agentSessionId":"C1","turnId":"CT1"})));
    steps.push(h.cancel("op1", "R", "T"));
    steps.push(h.feed(json!({"type":"cancelResult","operationId":"op1",
        "acked":[{"agentSessionId":"R","turnId":"T"},{"agentSessionId":"C1","turnId":"CT1"}]})));
    assert_eq!(h.outcome("T").as_deref(), Some("canceled"));
    // Each of those steps, replayed right after its own commit: a no-op.
    let mut r = H::new();
    r.root("R");
    let kinds = |s: &tutti_core::Step| {
        s.persist
            .rows
            .iter()
            .map(|row| row.kind().to_string())
            .collect::<Vec<_>>()
    };
    let mut seen = std::collections::BTreeSet::new();
    for (i, step) in steps.iter().enumerate() {
        r.store.apply(&step.persist).expect("first apply");
        let state = r.store.load_tree("R").unwrap();
        let outbox = r.store.outbox().len();
        let replay = r.store.apply(&step.persist);
        assert!(
            replay.is_ok(),
            "step {i} ({:?}) replayed: {replay:?}",
            kinds(step)
        );
        assert_eq!(r.store.load_tree("R").unwrap(), state, "step {i} changed");
        assert_eq!(r.store.outbox().len(), outbox, "step {i} republished");
        seen.extend(kinds(step));
    }
    for kind in ["session", "turn", "cancelOperation"] {
        assert!(
            seen.contains(kind),
            "the replayed steps wrote a {kind} row: {seen:?}"
        );
    }
    // A stale batch (the child's start, decided before the cancel settled CT1) is refused.
    let ct1 = r.store.turn("CT1").unwrap().expect("CT1");
    let stale = r.store.apply(&steps[3].persist);
    assert!(stale.is_err(), "a stale batch is refused");
    assert_eq!(r.store.turn("CT1").unwrap().expect("CT1"), ct1);
    assert_eq!(
        r.store.load_tree("R").unwrap(),
        h.store.load_tree("R").unwrap()
    );
}

/// Rule 1 with rule 6 ("Preparing the durable root cancel operation also closes child creation
/// for that root turn"): a child creation's batch is decided under child creation being open and
/// says so to the store (the `ChildCreationOpen` guard, checked inside the transaction), so a
/// creation racing a committed cancel preparation is refused by persistence and writes nothing.
#[test]
fn rule_1_child_creation_is_committed_only_while_child_creation_is_open() {
    use tutti_core::step::Guard;
    let mut h = tree_with_children(1);
    let racing = {
        // A second engine with the same state decides a creation; the first prepares a cancel.
        let mut other = tutti_core::Engine::new();
        other
            .restore(h.store.load_tree("R").unwrap().unwrap())
            .unwrap();
        let input: tutti_core::Input = serde_json::from_value(json!({"type":"childSessionCreated",
            "agentSessionId":"C2","turnId":"CT2","parentAgentSessionId":"R","parentTurnId":"T",
            "rootAgentSessionId":"R","rootTurnId":"T"}))
        .unwrap();
        other.handle(100, &input).expect("accepted by that engine")
    };
    assert!(
        racing.persist.guards.iter().any(|g| matches!(g,
            Guard::ChildCreationOpen { root_turn_id, child_agent_session_id }
                if &**root_turn_id == "T" && &**child_agent_session_id == "C2")),
        "the creation batch is guarded by open child creation: {:?}",
        racing.persist.guards
    );
    h.cancel("op1", "R", "T");
    assert!(
        h.store.apply(&racing.persist).is_err(),
        "refused by persistence"
    );
    assert!(h.session("C2").is_none());
    assert_eq!(h.turn("T")["childSessionCount"], 1);
    h.check();
}

/// "The durable cancel operation, every target transition, pending interaction supersession, and
/// outbox data commit together": a cancel over a wide tree (more targets than a step keeps in its
/// small inline list) writes each session, turn and operation exactly once in one batch that the
/// store accepts, and publishes each turn once.
#[test]
fn rule_6_a_wide_cancel_writes_each_entity_once_in_one_batch() {
    use tutti_core::step::Row;
    let n = 24;
    let mut h = tree_with_children(n);
    for i in 1..=n {
        h.feed(json!({"type":"turnStarted","agentSessionId":format!("C{i}"),"turnId":format!("CT{i}")}));
    }
    let mut acked = vec![json!({"agentSessionId":"R","turnId":"T"})];
    acked.extend(
        (1..=n).map(|i| json!({"agentSessionId":format!("C{i}"),"turnId":format!("CT{i}")})),
    );
    let steps = [
        h.cancel("op1", "R", "T"),
        h.feed(json!({"type":"cancelResult","operationId":"op1","acked":acked})),
    ];
    for (i, step) in steps.iter().enumerate() {
        let mut keys: Vec<String> = step
            .persist
            .rows
            .iter()
            .filter_map(|r| match r {
                Row::Session(s) => Some(format!("session {}", s.id)),
                Row::Turn(t) => Some(format!("turn {}", t.id)),
                Row::CancelOperation(o) => Some(format!("op {}", o.id)),
                _ => None,
            })
            .collect();
        let all = keys.len();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), all, "step {i} wrote an entity twice");
        let published: Vec<&tutti_core::model::Id> = step.outbox_turns().collect();
        let mut once = published.clone();
        once.sort();
        once.dedup();
        assert_eq!(
            once.len(),
            published.len(),
            "step {i} published a turn twice"
        );
        assert!(all > 16, "step {i} is wide: {all} rows");
    }
    for i in 1..=n {
        assert_eq!(h.outcome(&format!("CT{i}")).as_deref(), Some("canceled"));
    }
    assert_eq!(h.outcome("T").as_deref(), Some("canceled"));
    h.check();
}

/// Rule 3, as `engine/gate.rs` decides it by a match over the root provider turn's state (issue
/// 30): a repeated unnamed start of the running provider turn is a duplicate; after the canonical
/// root settled, the terminal of a provider turn other than the recorded one is late and changes
/// nothing, the recorded one's terminal is persisted (late after settled), and its repeat is a
/// duplicate.
#[test]
fn rule_3_settled_roots_provider_terminals_are_late_or_duplicates_by_their_state() {
    use tutti_core::step::Ignored;
    let mut h = H::new();
    h.root("R");
    h.submit("R", "T");
    h.started("R", "p1");
    let step = h.feed(json!({"type": "rootProviderTurnStarted", "agentSessionId": "R"}));
    assert_eq!(step.ignored, Some(Ignored::Duplicate));
    assert!(step.persist.is_empty(), "{:?}", step.persist);
    h.cancel("op1", "R", "T");
    h.feed(json!({"type": "cancelResult", "operationId": "op1",
        "acked": [{"agentSessionId": "R", "turnId": "T"}]}));
    assert_eq!(h.outcome("T").as_deref(), Some("canceled"));
    let running = json!({"phase": "running", "providerTurnId": "p1"});
    assert_eq!(h.turn("T")["rootProviderTurn"], running);
    // Another provider turn's terminal, named on the settled root turn: late, nothing changes.
    let step = h.feed(
        json!({"type": "rootProviderTurnCompleted", "agentSessionId": "R",
        "turnId": "T", "providerTurnId": "p2", "outcome": "completed"}),
    );
    assert_eq!(step.ignored, Some(Ignored::LateAfterSettled));
    assert!(step.persist.is_empty(), "{:?}", step.persist);
    assert_eq!(h.turn("T")["rootProviderTurn"], running);
    // The recorded provider turn's terminal: persisted into the lifecycle, late after settled.
    let step = h.completed("R", "p1", "interrupted");
    assert_eq!(step.ignored, Some(Ignored::LateAfterSettled));
    assert!(!step.persist.is_empty());
    assert_eq!(h.turn("T")["rootProviderTurn"]["phase"], "completed");
    // Its repeat: a duplicate.
    let step = h.completed("R", "p1", "interrupted");
    assert_eq!(step.ignored, Some(Ignored::Duplicate));
    assert!(step.persist.is_empty(), "{:?}", step.persist);
    assert_eq!(h.outcome("T").as_deref(), Some("canceled"));
    h.check();
}

/// Rule 3 under a guidance reservation (issue 30, the match over the root provider turn's
/// state): once the canonical root settled, a terminal of the provider turn recorded before the
/// reservation is late and releases nothing; only the provider turn the reservation waited for
/// may complete it.
#[test]
fn rule_3_settled_roots_reservation_keeps_the_terminal_it_did_not_wait_for_out() {
    use tutti_core::step::Ignored;
    let mut h = H::new();
    h.feed(
        json!({"type": "createSession", "agentSessionId": "R", "workspaceId": "W",
        "provider": "codex"}),
    );
    h.submit("R", "T");
    h.started("R", "p1");
    h.child("C1", "CT1", "R", "T", "R", "T");
    h.feed(json!({"type": "turnStarted", "agentSessionId": "C1", "turnId": "CT1"}));
    h.completed("R", "p1", "completed");
    h.feed(json!({"type": "submit", "agentSessionId": "R", "turnId": "T2", "text": "more"}));
    assert_eq!(h.turn("T")["rootProviderTurn"]["reserved"], true);
    h.cancel("op1", "R", "T");
    h.feed(
        json!({"type": "cancelResult", "operationId": "op1", "acked": [
        {"agentSessionId": "R", "turnId": "T"}, {"agentSessionId": "C1", "turnId": "CT1"}]}),
    );
    assert_eq!(h.outcome("T").as_deref(), Some("canceled"));
    let before = h.turn("T")["rootProviderTurn"].clone();
    assert_eq!(before["reserved"], true, "{before}");
    let step = h.completed("R", "p1", "completed");
    assert_eq!(step.ignored, Some(Ignored::LateAfterSettled));
    assert!(step.persist.is_empty(), "{:?}", step.persist);
    assert_eq!(h.turn("T")["rootProviderTurn"], before);
    h.check();
}
