//! Engine requests (start, guide, cancel, respondInteraction) and timers, turned into sidecar
//! commands.

use super::{
    ClaudeAdapter, NativeOp, PendingCancel, ProviderTurn, Query, TurnKind, CANCEL_TIMER,
    CONTINUATION_TIMER,
};
use crate::adapters::{AdapterOutput, AdapterTimer};
use crate::hash::FxSet;
use crate::input::RuntimeAnswer;
use crate::model::{Id, Millis, Outcome, Target};
use crate::step::{GuideMode, ProviderRequest};
use serde_json::{json, Map, Value};

impl ClaudeAdapter {
    pub(super) fn request(&mut self, now: Millis, request: &ProviderRequest) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        match request {
            ProviderRequest::Start { turn_id, text, .. } => self.start(turn_id, text, &mut out),
            ProviderRequest::Guide {
                agent_session_id,
                turn_id,
                mode,
                text,
                provider_turn_id,
                ..
            } => {
                if *mode == GuideMode::Steer
                    && provider_turn_id
                        .as_ref()
                        .is_some_and(|p| !self.turns.iter().any(|t| &t.id == p && t.is_live()))
                {
                    out.answers.push(RuntimeAnswer::GuideFailed {
                        agent_session_id: agent_session_id.clone(),
                        turn_id: turn_id.clone(),
                        error: "the steered provider turn already ended".into(),
                    });
                    return out;
                }
                self.guide(agent_session_id, turn_id, *mode, text, &mut out)
            }
            ProviderRequest::Cancel {
                operation_id,
                targets,
                ..
            } => self.cancel(now, operation_id, targets, &mut out),
            ProviderRequest::RespondInteraction {
                request_id,
                response,
                ..
            } => self.respond(request_id, response, &mut out),
        }
        out
    }

    /// `Start`: the first root turn starts the SDK query (`start`); later root turns are streamed
    /// into it (`input`). The canonical root turn is remembered; its root provider turn `claude-N`
    /// is announced at once. "A later explicit canonical root turn clears" the cancellation
    /// boundary of an earlier one.
    fn start(&mut self, turn_id: &Id, text: &str, out: &mut AdapterOutput) {
        self.canonical_turn = Some(turn_id.clone());
        let forgotten = self.notifications.forget_others(turn_id);
        if forgotten > 0 {
            out.diagnostics.push(format!(
                "claude: new root turn {turn_id}: {forgotten} task notification(s) of an earlier \
                 root turn no longer awaited"
            ));
        }
        let id = self.provider_turn_id(false);
        self.turns.push_back(ProviderTurn::new(
            id.clone(),
            turn_id.clone(),
            TurnKind::User,
        ));
        self.announce(self.turns.len() - 1, out);
        match self.query {
            Query::Idle | Query::Ended => {
                let cmd = self.command_id("start");
                self.native_ops
                    .insert(cmd.clone(), NativeOp::Start(id.clone()));
                self.query = Query::Starting;
                let mut options = match &self.config.options {
                    Value::Object(_) => self.config.options.clone(),
                    _ => Value::Object(Map::new()),
                };
                if let (Some(sid), Some(o)) = (&self.provider_session_id, options.as_object_mut()) {
                    o.entry("resume").or_insert_with(|| json!(sid));
                }
                out.native.push(json!({
                    "op": "start",
                    "id": cmd,
                    "requestId": turn_id.as_ref(),
                    "prompt": text,
                    "options": options,
                }));
            }
            Query::Starting | Query::Running => {
                let cmd = self.command_id("input");
                self.native_ops.insert(
                    cmd.clone(),
                    NativeOp::Input {
                        entry: Some(id),
                        guide: None,
                    },
                );
                out.native
                    .push(json!({"op": "input", "id": cmd, "text": text}));
            }
        }
    }

    /// `Guide`: "Guidance always targets the root session" and is streamed in with `input` in
    /// both modes. `startOnRoot` (only children run) opens a `synthetic-*` root provider turn on
    /// the same canonical root turn; `steer` joins the running one, including a turn reserved at a
    /// notification boundary, whose 30 s boundary it does not reset.
    fn guide(
        &mut self,
        session: &Id,
        turn_id: &Id,
        mode: GuideMode,
        text: &str,
        out: &mut AdapterOutput,
    ) {
        if !matches!(self.query, Query::Starting | Query::Running) {
            out.answers.push(RuntimeAnswer::GuideFailed {
                agent_session_id: session.clone(),
                turn_id: turn_id.clone(),
                error: "no running Claude query".into(),
            });
            return;
        }
        let live = self.turns.iter().any(|t| t.announced && t.is_live());
        let entry = match mode {
            GuideMode::Steer => None,
            GuideMode::StartOnRoot if live => None,
            GuideMode::StartOnRoot => {
                let id = self.provider_turn_id(true);
                self.turns.push_back(ProviderTurn::new(
                    id.clone(),
                    turn_id.clone(),
                    TurnKind::Guidance,
                ));
                self.announce(self.turns.len() - 1, out);
                Some(id)
            }
        };
        let cmd = self.command_id("input");
        let steer = entry.is_none();
        self.native_ops.insert(
            cmd.clone(),
            NativeOp::Input {
                entry,
                guide: Some((session.clone(), turn_id.clone())),
            },
        );
        out.native
            .push(json!({"op": "input", "id": cmd, "text": text, "steer": steer}));
    }

    /// `Cancel`: records every supplied target as a closed projection boundary first, then maps
    /// the target set to native handles — the root-query `interrupt` when it includes the root
    /// ("that native operation covers the Task executions in the same query"), otherwise one
    /// targeted `stopTask` per child ("the root provider turn and every other task keep
    /// running"). A target whose task is unknown or already terminal is simply not confirmed.
    /// "Sending cancel is not a terminal fact": no terminal is emitted here.
    fn cancel(&mut self, now: Millis, op: &Id, targets: &[Target], out: &mut AdapterOutput) {
        if self.cancels.contains_key(op) {
            out.diagnostics
                .push(format!("claude: cancel {op} is already in flight"));
            return;
        }
        let includes_root = targets.iter().any(|t| t.agent_session_id == self.root);
        // 1. The closed projection boundary, for every supplied target, before any provider I/O.
        // `live_children`: targets whose task has not ended (a child already closed by an
        // in-flight child-only cancel is still a Task execution of the query).
        let mut live_children: Vec<(Target, String)> = Vec::new();
        for t in targets {
            if t.agent_session_id == self.root {
                self.canceled_roots.insert(t.turn_id.clone());
                // A canceled root needs no follow-up: its notifications are no longer awaited.
                self.notifications.forget(&t.turn_id);
                self.close_held(&t.turn_id, out);
                for p in self.turns.iter_mut().filter(|p| p.turn == t.turn_id) {
                    // "It cancels the reserved synthetic provider turn, disarms its timeout."
                    p.timer = None;
                }
                continue;
            }
            let Some(key) = self.by_session.get(&t.agent_session_id).cloned() else {
                out.diagnostics.push(format!(
                    "claude: cancel target {} is unknown; not confirmed",
                    t.agent_session_id
                ));
                continue;
            };
            let Some(c) = self.children.get(&key) else {
                continue;
            };
            if c.turn != t.turn_id {
                out.diagnostics.push(format!(
                    "claude: cancel target turn {} is not the child's turn; not confirmed",
                    t.turn_id
                ));
                continue;
            }
            let running = !c.terminal;
            self.deactivate(&key, true);
            if running {
                live_children.push((t.clone(), key));
            } else {
                out.diagnostics.push(format!(
                    "claude: cancel target {} already ended; not confirmed",
                    t.agent_session_id
                ));
            }
        }
        let mut pending = PendingCancel {
            includes_root,
            waiting: FxSet::default(),
            acked: Vec::new(),
            error: None,
        };
        if includes_root {
            if !matches!(self.query, Query::Starting | Query::Running) {
                out.diagnostics
                    .push("claude: root cancel with no running query; nothing to interrupt".into());
                out.answers.push(RuntimeAnswer::CancelResult {
                    operation_id: op.clone(),
                    acked: Vec::new(),
                });
                return;
            }
            let mut covered: Vec<Target> = targets
                .iter()
                .filter(|t| t.agent_session_id == self.root)
                .cloned()
                .collect();
            covered.extend(live_children.into_iter().map(|(t, _)| t));
            let cmd = format!("tutti:cancel:{op}:interrupt");
            self.native_ops.insert(
                cmd.clone(),
                NativeOp::Cancel {
                    op: op.clone(),
                    covered,
                },
            );
            pending.waiting.insert(cmd.clone());
            out.native.push(json!({"op": "interrupt", "id": cmd}));
        } else {
            for (n, (target, key)) in live_children.into_iter().enumerate() {
                let cmd = format!("tutti:cancel:{op}:{n}");
                let task = self
                    .children
                    .get(&key)
                    .and_then(|c| c.task_id.clone().or_else(|| c.agent_id.clone()));
                pending.waiting.insert(cmd.clone());
                match task {
                    Some(task_id) if matches!(self.query, Query::Starting | Query::Running) => {
                        self.native_ops.insert(
                            cmd.clone(),
                            NativeOp::Cancel {
                                op: op.clone(),
                                covered: vec![target],
                            },
                        );
                        out.native
                            .push(json!({"op": "stopTask", "id": cmd, "taskId": task_id}));
                    }
                    Some(_) => {
                        pending.waiting.remove(&cmd);
                    }
                    None => {
                        // The task id is not known yet: stop as soon as task_started reveals it.
                        if let Some(c) = self.children.get_mut(&key) {
                            c.stop_pending = Some((op.clone(), cmd.clone()));
                        }
                        self.native_ops.insert(
                            cmd,
                            NativeOp::Cancel {
                                op: op.clone(),
                                covered: vec![target],
                            },
                        );
                    }
                }
            }
        }
        let nothing_sent = pending.waiting.is_empty();
        self.cancels.insert(op.clone(), pending);
        if nothing_sent {
            self.answer_cancel(op, out);
            return;
        }
        out.timers.push(AdapterTimer {
            id: format!("{CANCEL_TIMER}{op}"),
            at: now.saturating_add(self.config.cancel_timeout_ms),
        });
    }

    /// A held provider turn of a canceled root (its SDK turn already ended with a `result`, and
    /// it only waited for a follow-up to begin) has nothing left that the root-query interrupt
    /// could confirm: its lifecycle closes `canceled` now. Waiting for the interrupt's `ack`
    /// would leave it queued in front of the next canonical turn if that `ack` came after the
    /// cancel's own deadline.
    fn close_held(&mut self, turn: &Id, out: &mut AdapterOutput) {
        let mut kept = std::collections::VecDeque::with_capacity(self.turns.len());
        while let Some(t) = self.turns.pop_front() {
            if t.held && t.turn == *turn {
                // (A live turn was announced when it was queued.)
                if t.is_live() {
                    out.events
                        .push(self.completed(&t.turn, &t.id, Outcome::Canceled, None));
                }
                continue;
            }
            kept.push_back(t);
        }
        self.turns = kept;
    }

    /// `RespondInteraction` → `permission`. The sidecar finds the pending SDK callback by its
    /// `requestId` (the canonical request id is the sidecar's); the canonical child tuple stays
    /// on the engine side.
    fn respond(&mut self, request_id: &Id, response: &Value, out: &mut AdapterOutput) {
        let (behavior, extra) = permission_decision(response);
        if behavior.is_none() {
            out.diagnostics.push(format!(
                "claude: unrecognized answer to {request_id}; sent as deny"
            ));
        }
        let behavior = behavior.unwrap_or("deny");
        let cmd = self.command_id("permission");
        self.native_ops
            .insert(cmd.clone(), NativeOp::Permission(request_id.to_string()));
        let mut v = json!({
            "op": "permission",
            "id": cmd,
            "requestId": request_id.as_ref(),
            "behavior": behavior,
        });
        if let (Value::Object(o), Value::Object(extra)) = (&mut v, extra) {
            for (k, x) in extra {
                o.insert(k, x);
            }
        }
        out.native.push(v);
    }

    /// Sends a deny for a callback nobody can answer (unknown owner, closed or settled owner).
    pub(super) fn auto_deny(&mut self, request_id: &str, why: &str, out: &mut AdapterOutput) {
        let cmd = self.command_id("deny");
        self.native_ops.insert(cmd.clone(), NativeOp::Other);
        out.native.push(json!({
            "op": "permission",
            "id": cmd,
            "requestId": request_id,
            "behavior": "deny",
            "message": why,
        }));
    }

    pub(super) fn timer(&mut self, _now: Millis, id: &str) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        if let Some(rest) = id.strip_prefix(CONTINUATION_TIMER) {
            let pid = rest.rsplit_once('#').map_or(rest, |(p, _)| p);
            self.continuation_expired(pid, id, &mut out);
        } else if let Some(op) = id.strip_prefix(CANCEL_TIMER) {
            let op: Id = op.into();
            if self.cancels.contains_key(&op) {
                if let Some(p) = self.cancels.get_mut(&op) {
                    if p.error.is_none() {
                        p.error = Some("the Claude sidecar did not acknowledge in time".into());
                    }
                }
                out.diagnostics.push(format!(
                    "claude: cancel {op} timed out; answering what was acked"
                ));
                self.answer_cancel(&op, &mut out);
            }
        } else {
            out.diagnostics.push("claude: unknown timer".into());
        }
        out
    }

    /// "If no root continuation begins within 30 seconds, the sidecar completes the reserved
    /// synthetic provider turn with a timeout stop reason and interrupts that pending SDK
    /// continuation." Later output of that continuation is stale and dropped.
    fn continuation_expired(&mut self, pid: &str, timer: &str, out: &mut AdapterOutput) {
        let Some(t) = self
            .turns
            .iter_mut()
            .find(|t| t.id == pid && t.timer.as_deref() == Some(timer))
        else {
            // Disarmed (root output began, or cancel): nothing to do.
            return;
        };
        t.timer = None;
        t.stale = true;
        let (turn, held) = (t.turn.clone(), t.held);
        // "A follow-up that never comes ends the reservation as today, with a diagnostic naming
        // the outstanding notification count." The ledger forgets them: a follow-up arriving
        // later is stale output of this continuation.
        let outstanding = self.notifications.forget(&turn);
        let error = format!(
            "stop_reason=timeout: no root continuation within {} ms ({outstanding} task \
             notification(s) outstanding)",
            self.config.continuation_timeout_ms
        );
        out.diagnostics.push(format!(
            "claude: continuation {pid} on {turn} timed out (held after a result: {held}); \
             {outstanding} task notification(s) outstanding"
        ));
        out.events
            .push(self.completed(&turn, pid, Outcome::Interrupted, Some(error)));
        if matches!(self.query, Query::Starting | Query::Running) {
            let cmd = self.command_id("timeout-interrupt");
            self.native_ops.insert(cmd.clone(), NativeOp::Other);
            out.native.push(json!({"op": "interrupt", "id": cmd}));
        }
    }
}

/// Maps the engine's opaque answer to the sidecar's `behavior` plus pass-through fields
/// (`message`, `updatedInput`, `updatedPermissions`, `interrupt`). Accepted forms: `"allow"` /
/// `"deny"` (and synonyms such as approve/accept/reject/decline), `true` / `false`,
/// `{"behavior": ...}`, `{"decision": ...}`, `{"approved": bool}`, `{"allow": bool}`. `None` when
/// the answer is not recognized (the caller denies).
pub(crate) fn permission_decision(v: &Value) -> (Option<&'static str>, Value) {
    fn word(s: &str) -> Option<&'static str> {
        match s.trim().to_ascii_lowercase().as_str() {
            "allow" | "allowed" | "allow_once" | "allowonce" | "allow_always" | "approve"
            | "approved" | "accept" | "accepted" | "acceptforsession" | "yes" | "ok" => {
                Some("allow")
            }
            "deny" | "denied" | "reject" | "rejected" | "decline" | "declined" | "no"
            | "cancel" | "abort" => Some("deny"),
            _ => None,
        }
    }
    match v {
        Value::String(s) => (word(s), Value::Null),
        Value::Bool(b) => (Some(if *b { "allow" } else { "deny" }), Value::Null),
        Value::Object(o) => {
            let behavior = ["behavior", "decision", "result", "outcome"]
                .iter()
                .find_map(|k| o.get(*k).and_then(Value::as_str).and_then(word))
                .or_else(|| {
                    ["approved", "allow", "allowed"].iter().find_map(|k| {
                        o.get(*k)
                            .and_then(Value::as_bool)
                            .map(|b| if b { "allow" } else { "deny" })
                    })
                });
            let mut extra = Map::new();
            for k in ["message", "updatedInput", "updatedPermissions", "interrupt"] {
                if let Some(x) = o.get(k) {
                    extra.insert(k.to_string(), x.clone());
                }
            }
            (behavior, Value::Object(extra))
        }
        _ => (None, Value::Null),
    }
}
