//! Transcript facts: messages, tool calls and provider metadata of an exact session/turn.
//!
//! "Late child output ... is appended as historical child-session progress only when it can be
//! scoped to an existing child session and turn", unless that turn is a closed cancellation
//! target; output for a settled root turn is dropped (never attached to a settled root).

use super::child::turn_of;
use super::tree::{Tree, Tx};
use crate::error::Rejected;
use crate::keyed::{same, Hint};
use crate::model::{Id, Message, Payload, Text, ToolCall, Turn};
use crate::step::{Ignored, PersistBatch, Row, Step};
use serde_json::Value;
use smallvec::SmallVec;
use std::sync::Arc;

/// The step of a message or tool call fact that changes something: exactly one published row
/// (no guard: a message is keyed by its session and `seq`, a tool call row carries its
/// version). The same step a transaction touching only this row would finish as, built as one
/// value (the row goes straight into its inline slot) in the caller's return slot.
#[inline(always)]
fn publish(tree: &Tree, row: Row) -> Step {
    Step {
        persist: PersistBatch {
            root_agent_session_id: Some(tree.root_id.clone()),
            workspace_id: Some(tree.workspace_id.clone()),
            guards: SmallVec::new(),
            rows: SmallVec::from_buf([row]),
            outbox: SmallVec::from_buf_and_len([0, 0], 1),
        },
        provider: Vec::new(),
        timers: Vec::new(),
        reply: None,
        ignored: None,
    }
}

/// The step of a fact that changes nothing.
fn ignored(why: Ignored) -> Step {
    Step {
        ignored: Some(why),
        ..Step::default()
    }
}

/// Whether late facts for this turn are dropped, and why.
fn drop_reason(t: &Turn) -> Option<Ignored> {
    if t.cancel_operation_id.is_some() {
        return Some(Ignored::ClosedCancelTarget);
    }
    // Only root turns are triggered by the user (checked on restore): no session lookup.
    let is_child = t.is_child();
    if !t.is_active() && !is_child {
        return Some(Ignored::LateAfterSettled);
    }
    None
}

/// `messageAppended`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn message(
    tree: &mut Tree,
    now: i64,
    at: (&Id, Hint),
    turn: &Id,
    message_id: &Id,
    role: &Text,
    text: &Text,
) -> Result<Step, Rejected> {
    let session = at.0;
    let (_, t) = turn_of(tree, at, turn)?;
    let dropped = drop_reason(t);
    // The session's message ids are found by its (checked) position.
    let Some(hot) = tree.hot(session, at.1) else {
        return Err(Rejected::UnknownSession(session.clone()));
    };
    let ids = &mut hot.message_ids;
    if let Some(why) = dropped {
        let why = if ids.contains(message_id) {
            Ignored::Duplicate
        } else {
            why
        };
        return Ok(ignored(why));
    }
    // The session's messages are numbered densely from 0, in the same search that proves the
    // message id new.
    let Some(seq) = ids.insert_numbered(message_id) else {
        return Ok(ignored(Ignored::Duplicate));
    };
    Ok(publish(
        tree,
        Row::Message(Message {
            agent_session_id: session.clone(),
            turn_id: turn.clone(),
            message_id: message_id.clone(),
            seq,
            role: role.clone(),
            text: text.clone(),
            created_at: now,
        }),
    ))
}

/// `toolCallUpdated`: the tool call stays on the turn that launched it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn tool_call(
    tree: &mut Tree,
    now: i64,
    at: (&Id, Hint),
    turn: &Id,
    call: &Id,
    name: Option<&Text>,
    status: &Text,
    kind: Option<&Value>,
    payload: Option<&Payload>,
) -> Result<Step, Rejected> {
    let session = at.0;
    let (_, t) = turn_of(tree, at, turn)?;
    if let Some(why) = drop_reason(t) {
        return Ok(ignored(why));
    }
    let active = t.is_active();
    let Some((c, fresh)) = tree.tool_calls.slot(session, call, || {
        Arc::new(ToolCall {
            agent_session_id: session.clone(),
            turn_id: turn.clone(),
            tool_call_id: call.clone(),
            name: name.cloned(),
            status: status.clone(),
            kind: kind.cloned(),
            payload: payload.cloned(),
            created_at: now,
            updated_at: now,
            version: 0,
        })
    }) else {
        return Err(Rejected::Internal {
            what: "tool call index and tool calls out of step",
            id: call.clone(),
        });
    };
    // What changes, found before the tool call is written to, so that an unchanged one is
    // not copied (it is copied on write only while a step still holds it).
    let mut changes = (None, None, None, None);
    if !fresh {
        if !same(&c.turn_id, turn) {
            return Err(Rejected::Invalid("tool call id reused on another turn"));
        }
        changes = (
            name.filter(|&n| c.name.as_ref() != Some(n)),
            Some(status).filter(|&s| c.status != *s),
            kind.filter(|&k| c.kind.as_ref() != Some(k)),
            // (`Arc<Value>` equality: the same allocation is equal without a look inside.)
            payload.filter(|&p| c.payload.as_ref() != Some(p)),
        );
        if changes == (None, None, None, None) {
            return Ok(ignored(Ignored::Duplicate));
        }
    }
    let status_changed = fresh || changes.1.is_some();
    let m = Arc::make_mut(c);
    let (name, status, kind, payload) = changes;
    if let Some(n) = name {
        m.name = Some(n.clone());
    }
    if let Some(s) = status {
        m.status = s.clone();
    }
    if let Some(k) = kind {
        m.kind = Some(k.clone());
    }
    if let Some(p) = payload {
        m.payload = Some(Arc::clone(p));
    }
    // The row is built here, where the entry is at hand, instead of being looked up again.
    m.version += 1;
    m.updated_at = now;
    let terminal = crate::model::tool_call_status_is_terminal(&m.status);
    let row = Row::ToolCall(Arc::clone(c));
    if status_changed && active {
        track_open(tree, turn, call, terminal);
    }
    Ok(publish(tree, row))
}

/// Keeps [`Tree::open_tool_calls`] of an active turn: an open call is listed once, a terminal one
/// is not. Only the turn's own (short) list is touched.
fn track_open(tree: &mut Tree, turn: &Id, call: &Id, terminal: bool) {
    if terminal {
        if let Some(v) = tree.open_tool_calls.get_mut(turn) {
            v.retain(|c| c != call);
            if v.is_empty() {
                tree.open_tool_calls.remove(turn);
            }
        }
    } else {
        let v = tree.open_tool_calls.get_or_insert_with(turn, Vec::new);
        if !v.iter().any(|c| c == call) {
            v.push(call.clone());
        }
    }
}

/// What a `sessionMetadataUpdated` carries (each `None` leaves that field as it is).
pub(crate) struct Metadata<'a> {
    pub(crate) goal: Option<&'a Value>,
    pub(crate) title: Option<&'a String>,
    pub(crate) provider_session_id: Option<&'a String>,
    pub(crate) usage: Option<&'a crate::model::TokenUsage>,
}

/// `sessionMetadataUpdated`: "Goal status must not settle the root, clear its active-turn
/// reference, or unlock those surfaces". Only the session row changes.
pub(crate) fn metadata(
    tree: &mut Tree,
    now: i64,
    session: &Id,
    m: Metadata<'_>,
) -> Result<Tx, Rejected> {
    let Metadata {
        goal,
        title,
        provider_session_id,
        usage,
    } = m;
    let Some(s) = tree.sessions.get_mut(session) else {
        return Err(Rejected::UnknownSession(session.clone()));
    };
    if s.deleted_at.is_some() {
        return Err(Rejected::SessionDeleted(session.clone()));
    }
    let mut changed = false;
    if goal.is_some() && s.goal.as_ref() != goal {
        Arc::make_mut(s).goal = goal.cloned();
        changed = true;
    }
    if title.is_some() && s.title.as_ref() != title {
        Arc::make_mut(s).title = title.cloned();
        changed = true;
    }
    if provider_session_id.is_some() && s.provider_session_id.as_ref() != provider_session_id {
        Arc::make_mut(s).provider_session_id = provider_session_id.cloned();
        changed = true;
    }
    if let Some(report) = usage.filter(|u| !u.is_empty()) {
        let mut merged = s.usage.clone().unwrap_or_default();
        if merged.merge(report) || s.usage.is_none() {
            Arc::make_mut(s).usage = Some(merged);
            changed = true;
        }
    }
    if !changed {
        return Ok(Tx::ignore(now, Ignored::Duplicate));
    }
    let mut tx = Tx::new(now);
    tx.session(session, Hint::NONE, true);
    Ok(tx)
}

#[cfg(test)]
mod tests {
    use super::message;
    use crate::keyed::Hint;
    use crate::model::Id;
    use crate::step::Row;
    use crate::{Engine, Input};
    use serde_json::json;

    /// "A position hint verifies the id it finds": a message event for child `C` that arrives
    /// with the position of root `R` (which holds one message already) is numbered from `C`'s
    /// own messages. Trusting the position would have given it `seq` 1 and recorded its id
    /// among `R`'s.
    #[test]
    fn a_wrong_session_hint_never_numbers_a_message_from_another_session() {
        let mut e = Engine::new();
        for (now, v) in [
            (
                1,
                json!({"type": "createSession", "agentSessionId": "R", "workspaceId": "W", "provider": "codex"}),
            ),
            (
                2,
                json!({"type": "submit", "agentSessionId": "R", "turnId": "T", "text": "go"}),
            ),
            (
                3,
                json!({"type": "childSessionCreated", "agentSessionId": "C", "turnId": "CT", "parentAgentSessionId": "R", "parentTurnId": "T", "rootAgentSessionId": "R", "rootTurnId": "T"}),
            ),
        ] {
            let input: Input = serde_json::from_value(v).expect("input");
            e.handle(now, &input).expect("accepted");
        }
        let mut tree = e.trees().next().expect("one tree").clone();
        let (r_pos, _) = tree.sessions.get_hinted("R", Hint::NONE).expect("R");
        let (c_pos, _) = tree.sessions.get_hinted("C", Hint::NONE).expect("C");
        assert_ne!(r_pos, c_pos);
        let c = tree
            .sessions
            .at(c_pos)
            .map(|(id, _)| id.clone())
            .expect("C id");
        let r_messages =
            |tree: &super::Tree| tree.message_ids().filter(|(s, _)| &***s == "R").count();
        assert_eq!(
            r_messages(&tree),
            1,
            "the submit recorded the user's message"
        );

        let (turn, message_id): (Id, Id) = ("CT".into(), "m1".into());
        let step = message(
            &mut tree,
            4,
            (&c, Hint::at(r_pos)),
            &turn,
            &message_id,
            &"assistant".into(),
            &"hi".into(),
        )
        .expect("accepted");
        match step.persist.rows.first() {
            Some(Row::Message(m)) => {
                assert_eq!(&*m.agent_session_id, "C");
                assert_eq!(m.seq, 0, "C's first message");
            }
            other => panic!("expected a message row, got {other:?}"),
        }
        assert_eq!(r_messages(&tree), 1, "R's message ids are untouched");
        assert!(tree.message_ids().any(|(s, m)| &**s == "C" && &**m == "m1"));
    }
    /// A user message's id is synthetic (`user-{turn}-{n}`); a provider message that already
    /// took that id does not make the user's message reuse a `seq` (before, the id insert
    /// failed silently and the next message got the same `seq`).
    #[test]
    fn a_user_message_id_taken_by_the_provider_never_reuses_a_seq() {
        let mut e = Engine::new();
        let mut seqs = Vec::new();
        for (now, v) in [
            (
                1,
                json!({"type": "createSession", "agentSessionId": "R", "workspaceId": "W", "provider": "codex"}),
            ),
            (
                2,
                json!({"type": "submit", "agentSessionId": "R", "turnId": "T", "text": "go"}),
            ),
            (
                3,
                json!({"type": "rootProviderTurnStarted", "agentSessionId": "R", "providerTurnId": "p1"}),
            ),
            (
                4,
                json!({"type": "messageAppended", "agentSessionId": "R", "turnId": "T", "messageId": "user-T-2", "role": "assistant", "text": "a"}),
            ),
            (
                5,
                json!({"type": "submit", "agentSessionId": "R", "turnId": "T2", "text": "more"}),
            ),
            (
                6,
                json!({"type": "messageAppended", "agentSessionId": "R", "turnId": "T", "messageId": "m3", "role": "assistant", "text": "b"}),
            ),
        ] {
            let input: Input = serde_json::from_value(v).expect("input");
            let step = e.handle(now, &input).expect("accepted");
            for row in &step.persist.rows {
                if let Row::Message(m) = row {
                    seqs.push((m.seq, m.message_id.to_string()));
                }
            }
        }
        let numbers: Vec<u64> = seqs.iter().map(|(n, _)| *n).collect();
        assert_eq!(numbers, [0, 1, 2, 3], "dense and distinct: {seqs:?}");
        assert_eq!(seqs[2].1, "user-T-2.1", "the user's message got a free id");
    }
}

#[cfg(test)]
mod payload_tests {
    use crate::input::{Input, NormalizedEvent};
    use crate::model::Payload;
    use crate::step::Row;
    use crate::Engine;
    use serde_json::json;
    use std::sync::Arc;

    /// The payload's JSON is shared, not copied: the tool call's row holds the very allocation
    /// the event carried, at its first update and at a later one, while the row of the update
    /// before is still held (as a batch in flight holds it), and a repeat of the same payload
    /// changes nothing.
    #[test]
    fn a_tool_calls_payload_passes_through_the_engine_without_a_copy() {
        let mut e = Engine::new();
        for (now, v) in [
            json!({"type": "createSession", "agentSessionId": "R", "workspaceId": "W", "provider": "acp"}),
            json!({"type": "submit", "agentSessionId": "R", "turnId": "T", "text": "go"}),
        ]
        .into_iter()
        .enumerate()
        {
            let input: Input = serde_json::from_value(v).expect("input");
            e.handle(now as i64 + 1, &input).expect("accepted");
        }
        let update = |status: &str, payload: &Payload| {
            Input::Event(NormalizedEvent::ToolCallUpdated {
                agent_session_id: "R".into(),
                turn_id: "T".into(),
                tool_call_id: "c1".into(),
                name: Some("shell".into()),
                status: status.into(),
                kind: None,
                payload: Some(Arc::clone(payload)),
            })
        };
        let row_payload = |step: &crate::Step| match step.persist.rows.first() {
            Some(Row::ToolCall(c)) => c.payload.clone().expect("a payload"),
            other => panic!("expected a tool call row, got {other:?}"),
        };
        let first: Payload = Arc::new(json!({"rawInput": {"cmd": "ls"}}));
        let held = e.handle(10, &update("started", &first)).expect("accepted");
        assert!(Arc::ptr_eq(&row_payload(&held), &first));
        let second: Payload = Arc::new(json!({"rawInput": {"cmd": "ls"}, "rawOutput": "a b"}));
        let step = e
            .handle(11, &update("completed", &second))
            .expect("accepted");
        assert!(Arc::ptr_eq(&row_payload(&step), &second));
        assert!(
            Arc::ptr_eq(&row_payload(&held), &first),
            "the held row is unchanged"
        );
        let repeat = e
            .handle(12, &update("completed", &second))
            .expect("accepted");
        assert!(
            repeat.persist.is_empty(),
            "an identical update writes nothing"
        );
        assert_eq!(
            e.tool_call("R", "c1").and_then(|c| c.payload.clone()),
            Some(second)
        );
    }
}
