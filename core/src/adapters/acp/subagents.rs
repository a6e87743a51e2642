//! ACP v1 subagent sessions (stabilized 2026-11-20) as tutti child sessions.
//!
//! The client opts in with `clientCapabilities.subagents: {}` in `initialize`; the agent has no
//! capability of its own: it exposes subagents by sending `subagent_update` session updates.
//! Everything here is pure mapping onto the engine's ordinary events; the engine learns nothing
//! ACP-specific.
//!
//! # Mapping (choices written down)
//!
//! - **Creation.** The first `subagent_update` for an unknown child `sessionId` (the id *inside*
//!   the update; the notification's outer `sessionId` is the child's direct parent: the root, or
//!   another child for a nested subagent) announces a child under the parent's active turn. The
//!   announcement is held until the next message from the agent, because the standard link to
//!   the delegation arrives right after it (see below); any other message, the prompt's answer
//!   or a request from the engine first creates every held child without a link. The child is
//!   created as `childSessionCreated` with `title` (the update's `title`, else its
//!   `description`) and the child's ACP session id as its provider session id, and its first
//!   turn is `{child}~turn-1` ([`super::super::child_ids`]).
//! - **The delegation link**, in order of preference: a `session` tool-call content
//!   (`{"type":"session","sessionId":CHILD}`) on a parent `tool_call`/`tool_call_update` makes
//!   that tool call the child's `parentToolCallId`; otherwise the parent-to-child
//!   `session_message` (whose `messageId` is the model's tool-use id; claude-agent-acp shows no
//!   tool call for the delegation) does: its `messageId` becomes `parentToolCallId` and the
//!   provider alias `parentToolUseId`, and the adapter records a delegation tool call with that
//!   id on the parent turn (status `completed`: the delegation was accepted; the lane's state
//!   is the child's own turn), so the web view has a card to hang the lane on.
//! - **Patches.** A later `subagent_update` for a known child patches it: a `title` string is a
//!   `childSessionUpdated` title; `"title": null` clears it, recorded as an empty title (the
//!   engine's updates merge and never erase); `capabilities` replace the child's capabilities.
//! - **`state`**: `running` is the child turn running (again, after `requires_action`);
//!   `requires_action` is the turn waiting (its permission request follows); `idle` settles the
//!   turn by its `stopReason`: `end_turn`, `max_tokens`, `max_turn_requests` completed;
//!   `refusal` and `error` failed (with `error.message`); `cancelled` canceled when the child
//!   is a target of a cancel tutti sent (which it acknowledges), interrupted otherwise (the agent
//!   stopped it on its own); any other stop reason failed. A `running` on an idle child is the
//!   child's next turn (guidance into a reused child), `{child}~turn-{root turn}-{n}`: the root
//!   turn in the id keeps it unique across relaunched agent processes. It is accepted only
//!   while the root turn is active; an `idle` for an idle child changes nothing.
//! - **Session messages** (`session_message`) are messages of the session whose stream carries
//!   them, with the other end kept in the role: `to:{session}` when this session sent it,
//!   `from:{session}` when it came from that session (canonical session ids). Their id is
//!   `acp-sm-{messageId}`.
//! - **Shapes that break the rules** are diagnostics and change nothing: a `subagent_update` for
//!   the root itself, for a known child on a stream that is not its parent's, for a parent that
//!   is unknown or not working, or with a `state` that is not one of the three; a
//!   `session_message` naming a session the adapter does not know.
//! - **Cancel boundary.** After a root cancel is prepared, a newly announced child is never
//!   recorded as live work: it is sent `session/cancel` (when it advertises `cancel`) and
//!   dropped; the same holds for a child announced by a child that is itself a closed cancel
//!   target.
//! - **Relaunch.** The history an agent replays during `session/load` is not re-recorded, but
//!   the children it replays are bound: their canonical ids are the deterministic ids the
//!   recorded children already have, so a restored child that the agent resumes later opens its
//!   next turn in the recorded child session, never a duplicate. A restored child is taken to
//!   accept `session/cancel` (the replay omits `capabilities`; the notification is harmless to
//!   an agent that does not).

use super::AcpAdapter;
use crate::adapters::fields::Fields;
use crate::adapters::{child_ids, AdapterOutput};
use crate::input::NormalizedEvent;
use crate::model::{Id, Outcome, ProviderAliases, Target};
use serde_json::{json, Value};
use std::sync::Arc;

/// A child session the adapter knows.
#[derive(Debug, Clone)]
pub(super) struct Child {
    /// Canonical child session id.
    pub(super) session: Id,
    /// The native session whose stream announced it (its direct parent).
    pub(super) parent_native: String,
    /// The child's current (or last) turn.
    pub(super) turn: Id,
    /// Turns this adapter opened for it.
    pub(super) turn_no: u32,
    /// Whether its current turn is not settled.
    pub(super) active: bool,
    /// Whether it accepts `session/cancel`.
    pub(super) can_cancel: bool,
}

/// A child announced by a `subagent_update`, waiting one message for its delegation link.
#[derive(Debug, Clone)]
pub(super) struct Announcement {
    parent_native: String,
    child_native: String,
    update: Value,
}

/// A parsed v1 `state` snapshot.
#[derive(Debug, Clone, PartialEq)]
enum ChildState {
    Running,
    RequiresAction,
    Idle { stop: String, error: Option<String> },
}

fn parse_state(v: &Value) -> Option<ChildState> {
    match v.field("state")?.as_str()? {
        "running" => Some(ChildState::Running),
        "requires_action" => Some(ChildState::RequiresAction),
        "idle" => Some(ChildState::Idle {
            stop: match v.field("stopReason") {
                None | Some(Value::Null) => "end_turn".to_string(),
                Some(s) => s.as_str()?.to_string(),
            },
            error: v
                .at(&["error", "message"])
                .and_then(Value::as_str)
                .map(String::from),
        }),
        _ => None,
    }
}

/// What links a held announcement to its delegation: (parent native, child native, id, whether
/// the id names no tool call the agent showed).
fn link_of(msg: &Value) -> Option<(String, String, String, bool)> {
    if msg.field("method").and_then(Value::as_str) != Some("session/update") {
        return None;
    }
    let outer = msg.at(&["params", "sessionId"])?.as_str()?;
    let update = msg.at(&["params", "update"])?;
    match update.field("sessionUpdate")?.as_str()? {
        "session_message" => {
            if update.field("senderSessionId")?.as_str()? != outer {
                return None;
            }
            let child = update.field("recipientSessionId")?.as_str()?;
            let id = update.field("messageId")?.as_str()?;
            Some((outer.into(), child.into(), id.into(), true))
        }
        "tool_call" | "tool_call_update" => {
            let call = update.field("toolCallId")?.as_str()?;
            let child = update
                .field("content")?
                .as_array()?
                .iter()
                .find(|c| c.field("type").and_then(Value::as_str) == Some("session"))?
                .field("sessionId")?
                .as_str()?;
            Some((outer.into(), child.into(), call.into(), false))
        }
        _ => None,
    }
}

/// The child id a `subagent_update` message names, if `msg` is one.
fn announced_child(msg: &Value) -> Option<&str> {
    if msg.field("method").and_then(Value::as_str) != Some("session/update") {
        return None;
    }
    let update = msg.at(&["params", "update"])?;
    if update.field("sessionUpdate")?.as_str()? != "subagent_update" {
        return None;
    }
    update.field("sessionId")?.as_str()
}

fn title_of(update: &Value) -> Option<String> {
    update
        .field("title")
        .and_then(Value::as_str)
        .or_else(|| update.field("description").and_then(Value::as_str))
        .map(String::from)
}

fn can_cancel(update: &Value) -> bool {
    update.at(&["capabilities", "cancel"]).is_some()
}

impl AcpAdapter {
    /// Whether the current canonical root turn is still working: its prompt is open, or a child
    /// is (the root gate keeps the turn open), and it is not being canceled.
    pub(super) fn root_active(&self) -> bool {
        !self.boundary
            && self.root_turn.is_some()
            && (self.prompt.is_some() || self.children.values().any(|c| c.active))
    }

    /// Before `msg` is handled: held announcements that `msg` links are created with the link;
    /// unless `msg` announces another child, the others are created without one.
    pub(super) fn settle_announcements(&mut self, out: &mut AdapterOutput, msg: &Value) {
        if self.announcements.is_empty() {
            return;
        }
        if let Some((parent, child, id, synthetic)) = link_of(msg) {
            if let Some(i) = self
                .announcements
                .iter()
                .position(|a| a.parent_native == parent && a.child_native == child)
            {
                let a = self.announcements.remove(i);
                self.create_child(out, a, Some((id, synthetic)));
                return;
            }
        }
        if let Some(child) = announced_child(msg) {
            let known = self.children.contains_key(child)
                || self.announcements.iter().any(|a| a.child_native == child);
            if !known {
                return;
            }
        }
        self.create_announced(out);
    }

    /// Creates every held announcement without a delegation link.
    pub(super) fn create_announced(&mut self, out: &mut AdapterOutput) {
        for a in std::mem::take(&mut self.announcements) {
            self.create_child(out, a, None);
        }
    }

    /// A root cancel was prepared: held announcements are not live work; they are cancelled.
    pub(super) fn cancel_announced(&mut self, out: &mut AdapterOutput) {
        for a in std::mem::take(&mut self.announcements) {
            out.diagnostics
                .push("acp: a child announced during a cancel is not recorded".into());
            if can_cancel(&a.update) {
                out.native.push(cancel_notification(&a.child_native));
            }
        }
    }

    fn create_child(
        &mut self,
        out: &mut AdapterOutput,
        a: Announcement,
        link: Option<(String, bool)>,
    ) {
        let (Some((parent_session, parent_turn, true)), Some(root_turn)) =
            (self.owner(&a.parent_native), self.root_turn.clone())
        else {
            out.diagnostics
                .push("acp: child of a parent that is not working dropped".into());
            return;
        };
        let (session, turn) = child_ids(&self.root, "acp", &a.child_native, 1);
        let title = title_of(&a.update);
        let mut aliases = None;
        if let Some((id, true)) = &link {
            // claude-agent-acp shows no tool call for the delegation: the card is recorded here.
            self.flush(out, &a.parent_native);
            out.events.push(NormalizedEvent::ToolCallUpdated {
                agent_session_id: parent_session.clone(),
                turn_id: parent_turn.clone(),
                tool_call_id: id.as_str().into(),
                name: Some(title.clone().unwrap_or_else(|| "Delegate".into()).into()),
                status: "completed".into(),
                kind: Some(json!("delegate")),
                payload: Some(Arc::new(json!({"childSessionId": session}))),
            });
            aliases = Some(ProviderAliases {
                parent_tool_use_id: Some(id.clone()),
                ..ProviderAliases::default()
            });
        }
        out.events.push(NormalizedEvent::ChildSessionCreated {
            agent_session_id: session.clone(),
            turn_id: turn.clone(),
            parent_agent_session_id: parent_session,
            parent_turn_id: parent_turn,
            parent_tool_call_id: link.map(|(id, _)| Id::from(id.as_str())),
            root_agent_session_id: self.root.clone(),
            root_turn_id: root_turn,
            title,
            provider_session_id: Some(a.child_native.clone()),
            provider_aliases: aliases,
        });
        self.native_of
            .insert(session.clone(), a.child_native.clone());
        self.children.insert(
            a.child_native.clone(),
            Child {
                session,
                parent_native: a.parent_native,
                turn,
                turn_no: 1,
                active: true,
                can_cancel: can_cancel(&a.update),
            },
        );
        if let Some(state) = a.update.field("state").and_then(parse_state) {
            self.apply_state(out, &a.child_native, state);
        }
    }

    /// A `subagent_update` on the stream of `parent_native`.
    pub(super) fn on_subagent(
        &mut self,
        out: &mut AdapterOutput,
        parent_native: &str,
        update: &Value,
    ) {
        let Some(child) = update.field("sessionId").and_then(Value::as_str) else {
            out.diagnostics
                .push("acp: subagent_update without a sessionId dropped".into());
            return;
        };
        let child = child.to_string();
        let state = match update.field("state") {
            None | Some(Value::Null) => None,
            Some(s) => match parse_state(s) {
                Some(st) => Some(st),
                None => {
                    out.diagnostics
                        .push("acp: subagent_update with a malformed state dropped".into());
                    return;
                }
            },
        };
        if Some(child.as_str()) == self.session.as_deref()
            || self.loading.as_deref() == Some(child.as_str())
            || child == parent_native
        {
            out.diagnostics
                .push("acp: subagent_update for the root session itself dropped".into());
            return;
        }
        if self.session.is_none() {
            if self.loading.is_some() {
                self.restore_child(&child, parent_native);
            } else {
                out.diagnostics
                    .push("acp: subagent_update before the session exists dropped".into());
            }
            return;
        }
        if let Some(c) = self.children.get_mut(&child) {
            if c.parent_native != parent_native {
                out.diagnostics.push(
                    "acp: subagent_update for a child on a stream that is not its parent's dropped"
                        .into(),
                );
                return;
            }
            if update.field("capabilities").is_some() {
                c.can_cancel = can_cancel(update);
            }
            let session = c.session.clone();
            match update.field("title") {
                Some(Value::String(t)) => out.events.push(NormalizedEvent::ChildSessionUpdated {
                    agent_session_id: session,
                    title: Some(t.clone()),
                    provider_session_id: None,
                    provider_aliases: None,
                }),
                Some(Value::Null) => out.events.push(NormalizedEvent::ChildSessionUpdated {
                    agent_session_id: session,
                    title: Some(String::new()),
                    provider_session_id: None,
                    provider_aliases: None,
                }),
                _ => {}
            }
            if let Some(state) = state {
                self.apply_state(out, &child, state);
            }
            return;
        }
        let parent_closed = self.closed.contains(parent_native);
        if self.boundary || parent_closed {
            // "A newly revealed native child thread is interrupted without allocating or
            // emitting a canonical child session/turn."
            out.diagnostics
                .push("acp: a child announced after a cancel is not recorded".into());
            if can_cancel(update) {
                out.native.push(cancel_notification(&child));
            }
            return;
        }
        if !matches!(self.owner(parent_native), Some((_, _, true))) {
            out.diagnostics
                .push("acp: child of a parent that is not working dropped".into());
            return;
        }
        self.announcements.push(Announcement {
            parent_native: parent_native.to_string(),
            child_native: child,
            update: update.clone(),
        });
    }

    /// A child replayed by `session/load`: bound to its recorded canonical ids, idle.
    fn restore_child(&mut self, child: &str, parent_native: &str) {
        if self.children.contains_key(child) {
            return;
        }
        let (session, turn) = child_ids(&self.root, "acp", child, 1);
        self.native_of.insert(session.clone(), child.to_string());
        self.children.insert(
            child.to_string(),
            Child {
                session,
                parent_native: parent_native.to_string(),
                turn,
                turn_no: 1,
                active: false,
                can_cancel: true,
            },
        );
    }

    fn apply_state(&mut self, out: &mut AdapterOutput, child: &str, state: ChildState) {
        let root_active = self.root_active();
        let root_turn = self.root_turn.clone();
        let Some(c) = self.children.get_mut(child) else {
            return;
        };
        match state {
            ChildState::Running => {
                if !c.active {
                    let Some(root_turn) = root_turn.filter(|_| root_active) else {
                        out.diagnostics
                            .push("acp: a child of a settled tree cannot start again".into());
                        return;
                    };
                    c.turn_no += 1;
                    c.turn = format!("{}~turn-{}-{}", c.session, root_turn, c.turn_no).into();
                    c.active = true;
                    self.closed.remove(child);
                }
                out.events.push(NormalizedEvent::TurnStarted {
                    agent_session_id: c.session.clone(),
                    turn_id: c.turn.clone(),
                    provider_turn_id: None,
                });
            }
            ChildState::RequiresAction => {
                if c.active {
                    out.events.push(NormalizedEvent::TurnWaiting {
                        agent_session_id: c.session.clone(),
                        turn_id: c.turn.clone(),
                    });
                } else {
                    out.diagnostics
                        .push("acp: requires_action for an idle child dropped".into());
                }
            }
            ChildState::Idle { stop, error } => {
                if !c.active {
                    out.diagnostics
                        .push("acp: idle for an idle child changes nothing".into());
                    return;
                }
                c.active = false;
                let target = Target {
                    agent_session_id: c.session.clone(),
                    turn_id: c.turn.clone(),
                };
                self.flush(out, child);
                let targeted = self.closed.contains(child)
                    || self.cancels.iter().any(|op| op.targets.contains(&target));
                let (outcome, error) = match stop.as_str() {
                    "end_turn" | "max_tokens" | "max_turn_requests" => (Outcome::Completed, None),
                    "cancelled" if targeted => {
                        self.ack(out, &target);
                        (Outcome::Canceled, None)
                    }
                    "cancelled" => (
                        Outcome::Interrupted,
                        Some("the agent cancelled the subagent".to_string()),
                    ),
                    "refusal" => (Outcome::Failed, Some("the agent refused".to_string())),
                    "error" => (
                        Outcome::Failed,
                        Some(error.unwrap_or_else(|| "subagent failed".to_string())),
                    ),
                    _ => (
                        Outcome::Failed,
                        Some("the subagent stopped for an unknown reason".to_string()),
                    ),
                };
                out.events.push(NormalizedEvent::TurnTerminal {
                    agent_session_id: target.agent_session_id,
                    turn_id: target.turn_id,
                    outcome,
                    error,
                });
            }
        }
    }

    /// A `session_message` on the stream of `native`, owned by (`session`, `turn`).
    pub(super) fn on_session_message(
        &mut self,
        out: &mut AdapterOutput,
        native: &str,
        session: Id,
        turn: Id,
        update: &Value,
    ) {
        let field = |k: &str| update.field(k).and_then(Value::as_str);
        let (Some(sender), Some(recipient)) =
            (field("senderSessionId"), field("recipientSessionId"))
        else {
            out.diagnostics
                .push("acp: session_message without sender or recipient dropped".into());
            return;
        };
        let (direction, other) = if sender == native {
            ("to", recipient)
        } else if recipient == native {
            ("from", sender)
        } else {
            out.diagnostics
                .push("acp: session_message neither from nor to its stream dropped".into());
            return;
        };
        let Some(other) = self.canonical(other) else {
            out.diagnostics
                .push("acp: session_message with an unknown session dropped".into());
            return;
        };
        let text: String = update
            .field("content")
            .and_then(Value::as_array)
            .map(|blocks| {
                blocks
                    .iter()
                    .filter_map(|b| b.field("text").and_then(Value::as_str))
                    .collect()
            })
            .unwrap_or_default();
        self.flush(out, native);
        let message_id: Id = match field("messageId") {
            Some(id) => format!("acp-sm-{id}").into(),
            None => {
                self.message_no += 1;
                super::message_id(&turn, self.message_no)
            }
        };
        out.events.push(NormalizedEvent::MessageAppended {
            agent_session_id: session,
            turn_id: turn,
            message_id,
            role: format!("{direction}:{other}").into(),
            text: text.into(),
        });
    }

    /// The canonical session id of a native ACP session id.
    fn canonical(&self, native: &str) -> Option<Id> {
        if Some(native) == self.session.as_deref() {
            return Some(self.root.clone());
        }
        self.children.get(native).map(|c| c.session.clone())
    }
}

/// `session/cancel` for one ACP session (a notification).
pub(super) fn cancel_notification(native: &str) -> Value {
    json!({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": native}})
}
