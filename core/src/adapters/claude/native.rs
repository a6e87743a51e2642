//! Sidecar stdout lines and the SDK messages they carry.
//!
//! Every handler validates what it needs before it changes any state, so a line that is not the
//! protocol's is an [`AdapterError`] and changes nothing. Lines that are well formed but carry
//! nothing to project (an SDK message type this adapter does not use) are accepted and dropped.

use super::{
    result_outcome, s, ClaudeAdapter, NativeOp, Owner, Permission, ProviderTurn, Query, RootKind,
    SystemTask, Tool, TurnKind, STALE_BUFFER_MAX,
};
use crate::adapters::{AdapterError, AdapterOutput};
use crate::input::{NormalizedEvent, RuntimeAnswer};
use crate::model::{Id, Millis, Outcome};
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// Where an SDK message belongs.
enum Scope {
    Root,
    Child(String),
    Drop(&'static str),
}

fn missing(method: &str, field: &'static str) -> AdapterError {
    AdapterError::MissingField {
        method: method.to_string(),
        field,
    }
}

/// The delegation tools: `Agent` (what the model sees) and `Task` (its older name).
fn is_delegation(name: &str) -> bool {
    matches!(name, "Agent" | "Task")
}

/// Maps a task terminal status: (outcome, error, user-initiated stop).
fn task_terminal(status: &str, error: Option<&str>) -> Option<(Outcome, Option<String>, bool)> {
    match status {
        "completed" => Some((Outcome::Completed, None, false)),
        "failed" => Some((
            Outcome::Failed,
            Some(error.unwrap_or("task failed").to_string()),
            false,
        )),
        "stopped" | "killed" => Some((Outcome::Interrupted, Some("task stopped".into()), true)),
        _ => None,
    }
}

fn nonempty_object(v: Option<&Value>) -> Option<&Value> {
    v.filter(|x| x.as_object().is_some_and(|o| !o.is_empty()))
}

impl ClaudeAdapter {
    pub(super) fn native(
        &mut self,
        now: Millis,
        line: &Value,
    ) -> Result<AdapterOutput, AdapterError> {
        if !line.is_object() {
            return Err(AdapterError::Malformed("not a JSON object".into()));
        }
        let kind = s(line, "kind").ok_or_else(|| missing("sidecar line", "kind"))?;
        let mut out = AdapterOutput::default();
        match kind {
            "ready" => out.diagnostics.push("claude: sidecar ready".into()),
            "message" => {
                let m = line
                    .get("message")
                    .filter(|m| m.is_object())
                    .ok_or_else(|| missing("message", "message"))?;
                self.sdk_message(now, m, &mut out)?;
            }
            "canUseTool" => self.can_use_tool(line, &mut out)?,
            "canUseToolCancelled" => {
                let id = s(line, "requestId").ok_or_else(|| missing(kind, "requestId"))?;
                self.permission_done(id, json!({"status": "cancelled"}), &mut out);
            }
            "hook" => self.hook(now, line, &mut out)?,
            "ack" => self.ack(now, line, &mut out)?,
            "exited" => self.exited(line, &mut out),
            _ => {
                return Err(AdapterError::Malformed(format!(
                    "unknown sidecar line kind ({} bytes)",
                    kind.len()
                )))
            }
        }
        Ok(out)
    }

    // ----- SDK messages ----------------------------------------------------------------------

    fn sdk_message(
        &mut self,
        now: Millis,
        m: &Value,
        out: &mut AdapterOutput,
    ) -> Result<(), AdapterError> {
        let ty = s(m, "type").ok_or_else(|| missing("SDK message", "type"))?;
        match ty {
            "system" => {
                let sub = s(m, "subtype").ok_or_else(|| missing("system", "subtype"))?;
                match sub {
                    "init" => {
                        let scope = self.scope(m)?;
                        self.dispatch(now, RootKind::Init, m, scope, out);
                    }
                    "task_started" => self.task_started(m, out)?,
                    "task_progress" => {
                        let task = s(m, "task_id").ok_or_else(|| missing(sub, "task_id"))?;
                        if let Some(key) = self.by_task.get(task).cloned() {
                            self.child_running(&key, None, out);
                        }
                    }
                    "task_updated" => self.task_updated(now, m, out)?,
                    "task_notification" => self.task_notification(now, m, out)?,
                    // status, background_tasks_changed, api_retry, hook_*, ...: nothing to project.
                    _ => {}
                }
            }
            "assistant" | "user" => {
                let msg = m
                    .get("message")
                    .filter(|x| x.is_object())
                    .ok_or_else(|| missing(ty, "message"))?;
                if !matches!(msg.get("content"), Some(Value::String(_) | Value::Array(_))) {
                    return Err(missing(ty, "message.content"));
                }
                let kind = if ty == "assistant" {
                    RootKind::Assistant
                } else {
                    RootKind::User
                };
                let scope = self.scope(m)?;
                self.dispatch(now, kind, m, scope, out);
            }
            "stream_event" => {
                m.get("event")
                    .filter(|x| x.is_object())
                    .ok_or_else(|| missing(ty, "event"))?;
                let scope = self.scope(m)?;
                self.dispatch(now, RootKind::Stream, m, scope, out);
            }
            "result" => {
                s(m, "subtype").ok_or_else(|| missing(ty, "subtype"))?;
                let scope = self.scope(m)?;
                self.dispatch(now, RootKind::Result, m, scope, out);
            }
            "active_goal" => {
                let value = m.get("value").ok_or_else(|| missing(ty, "value"))?;
                // "Claude Goal completion is a provider-native session metadata update, not a
                // root-turn completion input."
                let goal = if value.is_null() {
                    json!({"status": "complete", "value": null})
                } else {
                    json!({"status": "active", "value": value})
                };
                out.events.push(NormalizedEvent::SessionMetadataUpdated {
                    agent_session_id: self.root.clone(),
                    goal: Some(goal),
                    title: None,
                    provider_session_id: None,
                    usage: None,
                });
            }
            _ => out.diagnostics.push(format!(
                "claude: SDK message type not projected ({} bytes)",
                ty.len()
            )),
        }
        Ok(())
    }

    /// "parent_tool_use_id is the canonical child scope marker for nested messages." A message
    /// whose marker names no known child is dropped, never attributed to the root.
    fn scope(&self, m: &Value) -> Result<Scope, AdapterError> {
        let by_agent = |me: &Self| match s(m, "agent_id") {
            Some(a) => me
                .child_by_alias(a)
                .map_or(Scope::Drop("unknown agent_id"), Scope::Child),
            None => Scope::Drop("unknown parent_tool_use_id"),
        };
        Ok(match m.get("parent_tool_use_id") {
            Some(Value::String(p)) => {
                if self.children.contains_key(p) {
                    Scope::Child(p.clone())
                } else if self.rejected_launches.contains(p) {
                    Scope::Drop("launch rejected by a cancellation boundary")
                } else {
                    by_agent(self)
                }
            }
            None | Some(Value::Null) => {
                if s(m, "agent_id").is_some() {
                    by_agent(self)
                } else {
                    Scope::Root
                }
            }
            Some(_) => return Err(missing("SDK message", "parent_tool_use_id")),
        })
    }

    fn dispatch(
        &mut self,
        now: Millis,
        kind: RootKind,
        m: &Value,
        scope: Scope,
        out: &mut AdapterOutput,
    ) {
        match scope {
            Scope::Root => self.root_output(now, kind, m, out),
            Scope::Child(key) => self.child_output(now, kind, m, &key, out),
            Scope::Drop(why) => out
                .diagnostics
                .push(format!("claude: dropped a message: {why}")),
        }
    }

    /// The root provider-turn gateway: attributes root output to the oldest queued root provider
    /// turn (opening one when the SDK starts a turn on its own), drops output of timed-out
    /// continuations and of a canceled root execution, and disarms the continuation timer on the
    /// first root stream or assistant event.
    fn root_output(&mut self, now: Millis, kind: RootKind, m: &Value, out: &mut AdapterOutput) {
        if kind == RootKind::Init {
            if let Some(sid) = s(m, "session_id") {
                if self.provider_session_id.as_deref() != Some(sid) {
                    self.provider_session_id = Some(sid.to_string());
                    out.events.push(NormalizedEvent::SessionMetadataUpdated {
                        agent_session_id: self.root.clone(),
                        goal: None,
                        title: None,
                        provider_session_id: Some(sid.to_string()),
                        usage: None,
                    });
                }
            }
        }
        if self.turns.is_empty() {
            let Some(turn) = self.canonical_turn.clone() else {
                out.diagnostics
                    .push("claude: root output before any root turn; dropped".into());
                return;
            };
            if self.canceled_roots.contains(&turn) {
                // "A server-initiated root provider turn is interrupted instead of adopted."
                let id = format!("rejected-{}", self.bump());
                self.turns
                    .push_back(ProviderTurn::new(id, turn, TurnKind::Rejected));
                if matches!(self.query, Query::Starting | Query::Running) {
                    let cmd = self.command_id("interrupt");
                    self.native_ops.insert(cmd.clone(), NativeOp::Other);
                    out.native.push(json!({"op": "interrupt", "id": cmd}));
                }
                out.diagnostics
                    .push("claude: root provider turn after a root cancel; interrupted".into());
            } else {
                let id = self.provider_turn_id(false);
                self.turns
                    .push_back(ProviderTurn::new(id, turn, TurnKind::Server));
            }
        }
        let Some(front) = self.turns.front_mut() else {
            return;
        };
        if front.stale {
            self.stale_output(now, kind, m, out);
            return;
        }
        front.began = true;
        if kind != RootKind::Result {
            // The next SDK turn runs on it: no longer only waiting for a follow-up to begin.
            front.held = false;
        }
        if matches!(front.kind, TurnKind::Control | TurnKind::Rejected) {
            // Control traffic and rejected turns emit nothing; their result releases them.
            if kind == RootKind::Result {
                self.turns.pop_front();
            }
            return;
        }
        self.announce(0, out);
        let Some(front) = self.turns.front_mut() else {
            return;
        };
        if matches!(kind, RootKind::Stream | RootKind::Assistant) && front.timer.take().is_some() {
            out.diagnostics.push(format!(
                "claude: continuation {} began; timer disarmed",
                front.id
            ));
        }
        if kind == RootKind::Assistant {
            front.messages = front.messages.saturating_add(1);
        }
        let (turn, pid, turn_kind) = (front.turn.clone(), front.id.clone(), front.kind);
        if self.canceled_roots.contains(&turn) {
            // Output of the canceled root execution is dropped; "the matching root provider
            // terminal is still normalized so persistence can close the provider lifecycle".
            if kind == RootKind::Result {
                self.turns.pop_front();
                out.events
                    .push(self.completed(&turn, &pid, Outcome::Canceled, None));
            }
            return;
        }
        let owner = Owner {
            session: self.root.clone(),
            turn: turn.clone(),
            root_turn: turn.clone(),
            child: None,
        };
        match kind {
            RootKind::Init => {}
            RootKind::Stream => self.stream_event(&owner, m, out),
            RootKind::Assistant => self.assistant_blocks(&owner, m, out),
            RootKind::User => {
                if has_tool_result(m) {
                    self.notifications.tool_round(&pid);
                }
                self.user_blocks(now, &owner, m, out)
            }
            RootKind::Result => {
                let (outcome, error) = result_outcome(m);
                if outcome == Outcome::Completed {
                    self.complete_launches(&turn, out);
                }
                let folded = self.notifications.take_folded(&pid);
                if folded > 0 {
                    out.diagnostics.push(format!(
                        "claude: {pid} on {turn} answered {folded} task notification(s) folded \
                         into its tool rounds"
                    ));
                }
                if self.hold_for_follow_ups(now, &turn, &pid, turn_kind, outcome, m, out) {
                    return;
                }
                self.turns.pop_front();
                out.events.push(self.completed(&turn, &pid, outcome, error));
            }
        }
    }

    /// A root `result` of the live front turn: applies it to the notification ledger and decides
    /// whether the provider lifecycle stays reserved. "The continuation produced after a
    /// background child notification belongs to the same canonical root turn": while the SDK
    /// still owes a follow-up for a task notification of this canonical root turn, completing the
    /// provider turn would let the gate settle the root and the later follow-up's reply would
    /// belong to no turn at all. So the turn is *held*: no `rootProviderTurnCompleted` yet, the
    /// next follow-up's messages join it, and only the `result` that leaves nothing outstanding
    /// completes it. While held, the 30 s continuation bound is armed (unless already running)
    /// so a follow-up that never comes still ends the reservation. Held only after a successful
    /// result, with nothing queued behind it, while the query runs.
    #[allow(clippy::too_many_arguments)]
    fn hold_for_follow_ups(
        &mut self,
        now: Millis,
        turn: &Id,
        pid: &str,
        kind: TurnKind,
        outcome: Outcome,
        m: &Value,
        out: &mut AdapterOutput,
    ) -> bool {
        let answer = self.notifications.answer(turn, m);
        let outstanding = self.notifications.outstanding(turn);
        let messages = self.turns.front().map_or(0, |t| t.messages);
        if let Some(a) = &answer {
            out.diagnostics.push(format!(
                "claude: follow-up result on {turn} ({pid}): empty={}, answered {}, {} task \
                 notification(s) outstanding, {messages} root message(s)",
                a.empty, a.answered, a.outstanding
            ));
            if kind == TurnKind::Server && a.answered == 0 && outstanding == 0 {
                // Nothing reserved this follow-up: if the canonical root already settled, the
                // engine records only what the spec allows (nothing reopens it); say so.
                out.diagnostics.push(format!(
                    "claude: unreserved follow-up {pid} on {turn} ({messages} root message(s)); \
                     recorded only while the root turn is active"
                ));
            }
        }
        let hold = outstanding > 0
            && outcome == Outcome::Completed
            && self.turns.len() == 1
            && matches!(self.query, Query::Starting | Query::Running);
        if !hold {
            return false;
        }
        if let Some(front) = self.turns.front_mut() {
            front.held = true;
            front.messages = 0;
        }
        if self.turns.front().is_some_and(|t| t.timer.is_none()) {
            self.arm_continuation(now, 0, out);
        }
        out.diagnostics.push(format!(
            "claude: {pid} on {turn} stays reserved: {outstanding} task notification(s) \
             outstanding"
        ));
        true
    }

    /// Root output while a timed-out continuation is at the front of the queue: "a later
    /// assistant, stream, result, or synthetic start from that timed-out continuation is stale and
    /// must be dropped".
    fn stale_output(&mut self, now: Millis, kind: RootKind, m: &Value, out: &mut AdapterOutput) {
        let behind = self.turns.len() > 1;
        if kind != RootKind::Result {
            if behind && self.stale_buffer.len() < STALE_BUFFER_MAX {
                self.stale_buffer.push((kind, m.clone()));
            }
            out.diagnostics
                .push("claude: dropped output of a timed-out continuation".into());
            return;
        }
        let continuation = m
            .get("origin")
            .and_then(|o| s(o, "kind"))
            .is_some_and(|k| k == "task-notification");
        let stale = self.turns.pop_front();
        let buffered = std::mem::take(&mut self.stale_buffer);
        if continuation || !behind {
            // Logged with ids and counts, never silently: the spec drops this output ("it cannot
            // reopen the settled root or append output to a later canonical turn").
            let (pid, turn) = stale.map(|t| (t.id, t.turn)).unwrap_or_default();
            let run = m.get("origin").and_then(|o| s(o, "runId")).unwrap_or("-");
            out.diagnostics.push(format!(
                "claude: the timed-out continuation {pid} on {turn} ended (follow-up: \
                 {continuation}, run {run}, {} buffered, num_turns {}); its output was dropped",
                buffered.len(),
                m.get("num_turns").and_then(Value::as_u64).unwrap_or(0)
            ));
            return;
        }
        // The timed-out continuation never ran: this SDK turn was the next queued one.
        out.diagnostics.push(format!(
            "claude: re-attributed {} buffered root messages to the next root provider turn",
            buffered.len()
        ));
        for (k, v) in buffered {
            self.root_output(now, k, &v, out);
        }
        self.root_output(now, RootKind::Result, m, out);
    }

    /// "The successful root result completes the launch tool call even when task_started is
    /// delayed."
    fn complete_launches(&mut self, turn: &Id, out: &mut AdapterOutput) {
        let launches = std::mem::take(&mut self.open_launches);
        for id in launches {
            let done = match self.tools.get_mut(&id) {
                Some(t) if t.turn == *turn => {
                    if t.status == "started" {
                        t.status = "completed".into();
                        let t = t.clone();
                        out.events.push(tool_event(&id, &t));
                    }
                    true
                }
                Some(_) => false,
                None => true,
            };
            if !done {
                self.open_launches.push(id);
            }
        }
    }

    /// Output scoped to a child: progress of the exact child session and turn.
    fn child_output(
        &mut self,
        now: Millis,
        kind: RootKind,
        m: &Value,
        key: &str,
        out: &mut AdapterOutput,
    ) {
        let Some(c) = self.children.get(key) else {
            return;
        };
        if c.closed {
            out.diagnostics.push(format!(
                "claude: dropped output of closed child {} (cancellation fallout)",
                c.session
            ));
            return;
        }
        let owner = Owner {
            session: c.session.clone(),
            turn: c.turn.clone(),
            root_turn: c.root_turn.clone(),
            child: Some(key.to_string()),
        };
        if let Some(a) = s(m, "agent_id") {
            self.merge_child(key, None, None, Some(a), out);
        }
        self.child_running(key, None, out);
        match kind {
            RootKind::Init => {}
            RootKind::Stream => self.stream_event(&owner, m, out),
            RootKind::Assistant => self.assistant_blocks(&owner, m, out),
            RootKind::User => self.user_blocks(now, &owner, m, out),
            // "Completion comes from child result, task notification, or SDK completion hooks."
            RootKind::Result => {
                let (outcome, error) = result_outcome(m);
                self.child_terminal(now, key, outcome, error, false, out);
            }
        }
    }

    /// A partial `content_block_start` of a tool use is the earliest parent tool event.
    fn stream_event(&mut self, owner: &Owner, m: &Value, out: &mut AdapterOutput) {
        let Some(ev) = m.get("event") else {
            return;
        };
        if s(ev, "type") != Some("content_block_start") {
            return;
        }
        let Some(block) = ev.get("content_block") else {
            return;
        };
        if s(block, "type") != Some("tool_use") {
            return;
        }
        if let (Some(id), Some(name)) = (s(block, "id"), s(block, "name")) {
            self.observe_tool_use(owner, id, name, nonempty_object(block.get("input")), out);
        }
    }

    fn message_base(&mut self, m: &Value) -> String {
        s(m, "uuid")
            .or_else(|| m.get("message").and_then(|x| s(x, "id")))
            .map(str::to_string)
            .unwrap_or_else(|| format!("claude-message-{}", self.bump()))
    }

    fn assistant_blocks(&mut self, owner: &Owner, m: &Value, out: &mut AdapterOutput) {
        let base = self.message_base(m);
        let Some(content) = m.get("message").and_then(|x| x.get("content")) else {
            return;
        };
        match content {
            Value::String(text) => self.append(owner, &format!("{base}:0"), "assistant", text, out),
            Value::Array(blocks) => {
                for (i, b) in blocks.iter().enumerate() {
                    let mid = format!("{base}:{i}");
                    match s(b, "type") {
                        Some("text") => {
                            if let Some(t) = s(b, "text") {
                                self.append(owner, &mid, "assistant", t, out);
                            }
                        }
                        Some("thinking") => {
                            if let Some(t) = s(b, "thinking") {
                                self.append(owner, &mid, "thought", t, out);
                            }
                        }
                        Some("tool_use") => {
                            if let (Some(id), Some(name)) = (s(b, "id"), s(b, "name")) {
                                self.observe_tool_use(owner, id, name, b.get("input"), out);
                            }
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }

    /// User-role messages: tool results anywhere; text only inside a child (the delegation prompt
    /// and the child's own user turns). Root user text is the user's own input (already recorded
    /// by the engine) or SDK-injected control text.
    fn user_blocks(&mut self, now: Millis, owner: &Owner, m: &Value, out: &mut AdapterOutput) {
        let base = self.message_base(m);
        let in_child = owner.child.is_some();
        let Some(content) = m.get("message").and_then(|x| x.get("content")) else {
            return;
        };
        match content {
            Value::String(text) if in_child => {
                self.append(owner, &format!("{base}:0"), "user", text, out)
            }
            Value::Array(blocks) => {
                for (i, b) in blocks.iter().enumerate() {
                    match s(b, "type") {
                        Some("text") if in_child => {
                            if let Some(t) = s(b, "text") {
                                self.append(owner, &format!("{base}:{i}"), "user", t, out);
                            }
                        }
                        Some("tool_result") => self.tool_result(now, b, m, out),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }

    fn append(&self, owner: &Owner, id: &str, role: &str, text: &str, out: &mut AdapterOutput) {
        out.events.push(NormalizedEvent::MessageAppended {
            agent_session_id: owner.session.clone(),
            turn_id: owner.turn.clone(),
            message_id: id.into(),
            role: role.into(),
            text: text.into(),
        });
    }

    /// Whether an owner can still project anything (not a closed child, not a canceled root).
    fn owner_open(&self, owner: &Owner) -> bool {
        if self.canceled_roots.contains(&owner.root_turn) {
            return false;
        }
        match &owner.child {
            Some(k) => self.children.get(k).is_some_and(|c| !c.closed),
            None => true,
        }
    }

    /// A tool use seen on any event (partial stream, assistant message, PreToolUse hook). The
    /// first sighting records the tool call on the owner's turn and, for Agent / Task, creates
    /// the child; later sightings only merge facts ("It must not create another child or move the
    /// parent tool completion into the child turn").
    fn observe_tool_use(
        &mut self,
        owner: &Owner,
        id: &str,
        name: &str,
        input: Option<&Value>,
        out: &mut AdapterOutput,
    ) {
        let input = nonempty_object(input);
        let description = input.and_then(|i| s(i, "description"));
        let run_in_background = input
            .and_then(|i| i.get("run_in_background"))
            .and_then(Value::as_bool);
        if let Some(tool) = self.tools.get_mut(id) {
            let mut changed = false;
            if let Some(i) = input {
                if tool.payload.get("input") != Some(i) {
                    tool.payload.insert("input".into(), i.clone());
                    changed = true;
                }
            }
            let tool = tool.clone();
            if changed && self.owner_open(owner) {
                out.events.push(tool_event(id, &tool));
            }
            if tool.delegation {
                if let Some(c) = self.children.get_mut(id) {
                    if c.background.is_none() {
                        c.background = run_in_background;
                    }
                }
                self.merge_child(id, description, None, None, out);
            } else if run_in_background == Some(true) && !tool.background_launch {
                if let Some(t) = self.tools.get_mut(id) {
                    t.background_launch = true;
                }
                self.open_launches.push(id.to_string());
            }
            return;
        }
        let delegation = is_delegation(name);
        if !self.owner_open(owner) {
            if delegation {
                // "A newly revealed native child ... without allocating or emitting a canonical
                // child session/turn": its task is stopped when task_started reveals it.
                self.rejected_launches.insert(id.to_string());
            }
            out.diagnostics
                .push("claude: tool use of a closed owner; not projected".into());
            return;
        }
        let mut payload = Map::new();
        if let Some(i) = input {
            payload.insert("input".into(), i.clone());
        }
        let tool = Tool {
            session: owner.session.clone(),
            turn: owner.turn.clone(),
            name: name.to_string(),
            status: "started".into(),
            payload,
            delegation,
            background_launch: !delegation && run_in_background == Some(true),
        };
        out.events.push(tool_event(id, &tool));
        if tool.background_launch {
            self.open_launches.push(id.to_string());
        }
        self.tools.insert(id.to_string(), tool);
        if delegation {
            let title = description.unwrap_or(name).to_string();
            self.create_child(
                id,
                owner,
                Some(id),
                Some(title),
                run_in_background,
                None,
                out,
            );
        }
    }

    /// A `tool_result` block: completes the tool call on the turn that launched it; for a
    /// foreground delegation it also settles the child ("A foreground Task may settle its child
    /// turn from the terminal parent tool result. An async/background Task does not").
    fn tool_result(&mut self, now: Millis, b: &Value, m: &Value, out: &mut AdapterOutput) {
        let Some(id) = s(b, "tool_use_id") else {
            return;
        };
        let Some(tool) = self.tools.get(id).cloned() else {
            out.diagnostics
                .push("claude: result of an unknown tool use; dropped".into());
            return;
        };
        self.permissions_resolved_by_tool(id, out);
        let is_error = b.get("is_error").and_then(Value::as_bool).unwrap_or(false);
        let tur = m.get("tool_use_result");
        let async_launch = tur
            .and_then(|t| t.get("isAsync"))
            .and_then(Value::as_bool)
            .unwrap_or(false)
            || tur.and_then(|t| s(t, "status")) == Some("async_launched");
        if tool.delegation {
            if let Some(c) = self.children.get_mut(id) {
                if c.closed {
                    out.diagnostics.push(format!(
                        "claude: dropped the launch result of closed child {} (cancellation fallout)",
                        c.session
                    ));
                    return;
                }
                if async_launch {
                    c.background = Some(true);
                }
            }
        }
        let status = if is_error { "failed" } else { "completed" };
        if let Some(t) = self.tools.get_mut(id) {
            t.status = status.into();
            t.payload.insert("isError".into(), Value::Bool(is_error));
            if let Some(task) = tur
                .and_then(|t| s(t, "agentId").or_else(|| s(t, "backgroundTaskId")))
                .filter(|_| !tool.delegation)
            {
                t.payload
                    .insert("taskId".into(), Value::String(task.into()));
            }
            // The result content goes to the engine but is not kept in adapter memory.
            let mut event = tool_event(id, t);
            if let (
                NormalizedEvent::ToolCallUpdated {
                    payload: Some(p), ..
                },
                Some(c),
            ) = (&mut event, b.get("content"))
            {
                // The event's own payload, not shared yet: changed in place.
                if let Value::Object(p) = Arc::make_mut(p) {
                    p.insert("result".into(), c.clone());
                }
            }
            out.events.push(event);
        }
        self.open_launches.retain(|x| x != id);
        if !tool.delegation || !self.children.contains_key(id) {
            return;
        }
        if let Some(agent) = tur.and_then(|t| s(t, "agentId")) {
            self.merge_child(id, None, None, Some(agent), out);
        }
        let background = self.children.get(id).and_then(|c| c.background);
        if is_error {
            self.child_terminal(
                now,
                id,
                Outcome::Failed,
                Some("the delegation tool failed".into()),
                false,
                out,
            );
        } else if !async_launch && background != Some(true) {
            self.child_terminal(now, id, Outcome::Completed, None, false, out);
        }
    }

    // ----- task-system messages --------------------------------------------------------------

    fn task_started(&mut self, m: &Value, out: &mut AdapterOutput) -> Result<(), AdapterError> {
        let task_id = s(m, "task_id").ok_or_else(|| missing("task_started", "task_id"))?;
        let tool_use_id = s(m, "tool_use_id");
        let run_id = s(m, "run_id");
        let description = s(m, "description");
        let backgrounded = m.get("is_backgrounded").and_then(Value::as_bool);
        let subagent = s(m, "task_type") == Some("local_agent") || s(m, "subagent_type").is_some();
        let key = self.by_task.get(task_id).cloned().or_else(|| {
            tool_use_id
                .filter(|t| self.children.contains_key(*t))
                .map(str::to_string)
        });
        if let Some(key) = key {
            if let Some(c) = self.children.get_mut(&key) {
                if backgrounded.is_some() {
                    c.background = backgrounded;
                }
            }
            self.merge_child(&key, description, Some(task_id), None, out);
            self.child_running(&key, run_id, out);
            self.send_owed_stop(&key, task_id, out);
            return Ok(());
        }
        if let Some(tu) = tool_use_id {
            if self.rejected_launches.contains(tu) {
                self.system_tasks.insert(
                    task_id.to_string(),
                    SystemTask {
                        tool_use_id: Some(tu.to_string()),
                        terminal: false,
                    },
                );
                let cmd = self.command_id("stop-rejected");
                self.native_ops.insert(cmd.clone(), NativeOp::Other);
                out.native
                    .push(json!({"op": "stopTask", "id": cmd, "taskId": task_id}));
                return Ok(());
            }
            if let Some(tool) = self.tools.get(tu).cloned() {
                if !tool.delegation {
                    // Task-system work without subagent identity: tracked for stop routing only.
                    self.system_tasks.insert(
                        task_id.to_string(),
                        SystemTask {
                            tool_use_id: Some(tu.to_string()),
                            terminal: false,
                        },
                    );
                    // "An earlier task_started may complete it with the provider task id."
                    let owner_open = !self.canceled_roots.contains(&tool.turn)
                        && self
                            .by_session
                            .get(&tool.session)
                            .and_then(|k| self.children.get(k))
                            .is_none_or(|c| !c.closed);
                    if tool.background_launch && tool.status == "started" && owner_open {
                        if let Some(t) = self.tools.get_mut(tu) {
                            t.status = "completed".into();
                            t.payload
                                .insert("taskId".into(), Value::String(task_id.into()));
                            let t = t.clone();
                            out.events.push(tool_event(tu, &t));
                        }
                        self.open_launches.retain(|x| x != tu);
                    }
                    return Ok(());
                }
            }
        }
        if subagent {
            self.recreate_child(m, task_id, tool_use_id, out);
            if let Some(key) = self.by_task.get(task_id).cloned() {
                self.child_running(&key, run_id, out);
            }
            return Ok(());
        }
        self.system_tasks.insert(
            task_id.to_string(),
            SystemTask {
                tool_use_id: tool_use_id.map(str::to_string),
                terminal: false,
            },
        );
        Ok(())
    }

    /// A delegated task the adapter never saw launched, carrying explicit subagent identity:
    /// "may recreate delegated state only when the message carries explicit subagent identity".
    fn recreate_child(
        &mut self,
        m: &Value,
        task_id: &str,
        tool_use_id: Option<&str>,
        out: &mut AdapterOutput,
    ) {
        let parent = s(m, "parent_task_id").and_then(|p| self.child_by_alias(p));
        let owner = match parent.and_then(|k| self.children.get(&k).map(|c| (k, c))) {
            Some((k, c)) => Owner {
                session: c.session.clone(),
                turn: c.turn.clone(),
                root_turn: c.root_turn.clone(),
                child: Some(k),
            },
            None => {
                let Some((turn, _)) = self.current_root_owner() else {
                    out.diagnostics
                        .push("claude: delegated task before any root turn; dropped".into());
                    return;
                };
                Owner {
                    session: self.root.clone(),
                    turn: turn.clone(),
                    root_turn: turn,
                    child: None,
                }
            }
        };
        if !self.owner_open(&owner) {
            if let Some(tu) = tool_use_id {
                self.rejected_launches.insert(tu.to_string());
            }
            let cmd = self.command_id("stop-rejected");
            self.native_ops.insert(cmd.clone(), NativeOp::Other);
            out.native
                .push(json!({"op": "stopTask", "id": cmd, "taskId": task_id}));
            return;
        }
        let key = tool_use_id.unwrap_or(task_id).to_string();
        let title = s(m, "description")
            .or_else(|| s(m, "subagent_type"))
            .map(str::to_string);
        let background = m.get("is_backgrounded").and_then(Value::as_bool);
        self.create_child(
            &key,
            &owner,
            tool_use_id,
            title,
            background,
            Some(task_id),
            out,
        );
    }

    fn send_owed_stop(&mut self, key: &str, task_id: &str, out: &mut AdapterOutput) {
        let Some((_, cmd)) = self
            .children
            .get_mut(key)
            .and_then(|c| c.stop_pending.take())
        else {
            return;
        };
        out.native
            .push(json!({"op": "stopTask", "id": cmd, "taskId": task_id}));
    }

    fn task_updated(
        &mut self,
        now: Millis,
        m: &Value,
        out: &mut AdapterOutput,
    ) -> Result<(), AdapterError> {
        let task_id = s(m, "task_id").ok_or_else(|| missing("task_updated", "task_id"))?;
        let patch = m.get("patch");
        let status = patch.and_then(|p| s(p, "status"));
        if let Some(key) = self.by_task.get(task_id).cloned() {
            if let Some(b) = patch
                .and_then(|p| p.get("is_backgrounded"))
                .and_then(Value::as_bool)
            {
                if let Some(c) = self.children.get_mut(&key) {
                    c.background = Some(b);
                }
            }
            if let Some((outcome, error, stopped)) =
                status.and_then(|st| task_terminal(st, patch.and_then(|p| s(p, "error"))))
            {
                self.expect_notification(&key, s(m, "run_id"), stopped);
                self.child_terminal(now, &key, outcome, error, stopped, out);
            }
        } else if let Some(t) = self.system_tasks.get_mut(task_id) {
            if status.is_some_and(|st| task_terminal(st, None).is_some()) {
                t.terminal = true;
            }
        }
        Ok(())
    }

    fn task_notification(
        &mut self,
        now: Millis,
        m: &Value,
        out: &mut AdapterOutput,
    ) -> Result<(), AdapterError> {
        let task_id = s(m, "task_id").ok_or_else(|| missing("task_notification", "task_id"))?;
        let status = s(m, "status").ok_or_else(|| missing("task_notification", "status"))?;
        let tool_use_id = s(m, "tool_use_id");
        let terminal = task_terminal(status, None);
        let key = self.by_task.get(task_id).cloned().or_else(|| {
            tool_use_id
                .filter(|t| self.children.contains_key(*t))
                .map(str::to_string)
        });
        if let Some(key) = key {
            self.merge_child(&key, None, Some(task_id), None, out);
            if let Some((outcome, error, stopped)) = terminal {
                self.expect_notification(&key, s(m, "run_id"), stopped);
                self.child_terminal(now, &key, outcome, error, stopped, out);
            }
            return Ok(());
        }
        if let Some(t) = self.system_tasks.get_mut(task_id) {
            t.terminal = true;
            return Ok(());
        }
        if tool_use_id
            .is_some_and(|t| self.rejected_launches.contains(t) || self.tools.contains_key(t))
        {
            return Ok(());
        }
        let subagent = s(m, "subagent_type").is_some()
            || s(m, "agent_id").is_some()
            || s(m, "task_type") == Some("local_agent");
        if !subagent {
            // "An unclaimed generic task-system notice is not enough to invent a child session."
            out.diagnostics
                .push("claude: unclaimed task notification without subagent identity".into());
            return Ok(());
        }
        self.recreate_child(m, task_id, tool_use_id, out);
        if let (Some(key), Some((outcome, error, stopped))) =
            (self.by_task.get(task_id).cloned(), terminal)
        {
            self.expect_notification(&key, s(m, "run_id"), stopped);
            self.child_terminal(now, &key, outcome, error, stopped, out);
        }
        Ok(())
    }

    // ----- hooks -------------------------------------------------------------------------------

    fn hook(
        &mut self,
        now: Millis,
        line: &Value,
        out: &mut AdapterOutput,
    ) -> Result<(), AdapterError> {
        let event = s(line, "event").ok_or_else(|| missing("hook", "event"))?;
        let input = line
            .get("input")
            .filter(|x| x.is_object())
            .ok_or_else(|| missing("hook", "input"))?;
        let tool_use_id = s(input, "tool_use_id").or_else(|| s(line, "toolUseID"));
        match event {
            "PreToolUse" => {
                let name = s(input, "tool_name").unwrap_or("");
                let Some(id) = tool_use_id else {
                    return Ok(());
                };
                if !is_delegation(name)
                    || self.tools.contains_key(id)
                    || self.rejected_launches.contains(id)
                {
                    return Ok(());
                }
                match self.hook_owner(input) {
                    Some(owner) => {
                        self.observe_tool_use(&owner, id, name, input.get("tool_input"), out)
                    }
                    None => out
                        .diagnostics
                        .push("claude: delegation hook without a known owner; dropped".into()),
                }
            }
            "PostToolUse" => {
                let Some(id) = tool_use_id.filter(|id| self.children.contains_key(*id)) else {
                    return Ok(());
                };
                let resp = input.get("tool_response");
                if resp
                    .and_then(|r| r.get("isAsync"))
                    .and_then(Value::as_bool)
                    .unwrap_or(false)
                    || resp.and_then(|r| s(r, "status")) == Some("async_launched")
                {
                    if let Some(c) = self.children.get_mut(id) {
                        c.background = Some(true);
                    }
                }
                if let Some(agent) = resp.and_then(|r| s(r, "agentId")) {
                    self.merge_child(id, None, None, Some(agent), out);
                }
            }
            "PostToolUseFailure" => {
                let Some(id) = tool_use_id.filter(|id| self.children.contains_key(*id)) else {
                    return Ok(());
                };
                let closed = self.children.get(id).is_some_and(|c| c.closed);
                if closed {
                    out.diagnostics.push(
                        "claude: dropped tool_failed of a closed child (cancellation fallout)"
                            .into(),
                    );
                    return Ok(());
                }
                if let Some(t) = self.tools.get_mut(id) {
                    if t.status == "started" {
                        t.status = "failed".into();
                        let t = t.clone();
                        if !self.canceled_roots.contains(&t.turn) {
                            out.events.push(tool_event(id, &t));
                        }
                    }
                }
                let interrupted = input
                    .get("is_interrupt")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let error = s(input, "error").unwrap_or("the delegation tool failed");
                let outcome = if interrupted {
                    Outcome::Interrupted
                } else {
                    Outcome::Failed
                };
                self.child_terminal(now, id, outcome, Some(error.into()), interrupted, out);
            }
            "SubagentStart" => {
                if let Some(agent) = s(input, "agent_id") {
                    match self.child_by_alias(agent) {
                        Some(key) => {
                            self.merge_child(&key, None, None, Some(agent), out);
                            self.child_running(&key, None, out);
                        }
                        // Never "the only running task": an unknown agent id binds nothing.
                        None => out
                            .diagnostics
                            .push("claude: SubagentStart for an unknown agent id".into()),
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The owner of a hooked tool use: the child named by the hook's `agent_id`, else the root's
    /// live provider turn.
    fn hook_owner(&self, input: &Value) -> Option<Owner> {
        match s(input, "agent_id") {
            Some(a) => {
                let key = self.child_by_alias(a)?;
                let c = self.children.get(&key)?;
                Some(Owner {
                    session: c.session.clone(),
                    turn: c.turn.clone(),
                    root_turn: c.root_turn.clone(),
                    child: Some(key),
                })
            }
            None => {
                let t = self.turns.front().filter(|t| t.is_live())?;
                Some(Owner {
                    session: self.root.clone(),
                    turn: t.turn.clone(),
                    root_turn: t.turn.clone(),
                    child: None,
                })
            }
        }
    }

    // ----- permissions -------------------------------------------------------------------------

    /// `canUseTool`: "Claude SDK permission callbacks running inside a child must preserve the
    /// callback agentID as the provider agentId alias. The Claude adapter resolves that alias to
    /// the already-recorded child session and turn before emitting the canonical interaction." The
    /// provider turn that owns the callback is kept on the interaction for the answer.
    fn can_use_tool(&mut self, line: &Value, out: &mut AdapterOutput) -> Result<(), AdapterError> {
        let request_id = s(line, "requestId").ok_or_else(|| missing("canUseTool", "requestId"))?;
        let agent = s(line, "agentID");
        let tool_use = s(line, "toolUseID");
        if self.permissions.contains_key(request_id) {
            return Ok(());
        }
        let tool_owner_child = tool_use
            .and_then(|t| self.tools.get(t))
            .and_then(|t| self.by_session.get(&t.session))
            .cloned();
        let child = match agent {
            Some(a) => match self.child_by_alias(a).or(tool_owner_child) {
                Some(k) => Some(k),
                None => {
                    out.diagnostics
                        .push("claude: permission request from an unknown subagent; denied".into());
                    self.auto_deny(request_id, "tutti: unknown subagent", out);
                    return Ok(());
                }
            },
            None => tool_owner_child,
        };
        let provider_turn_id = self.current_root_owner().and_then(|(_, p)| p);
        let payload = json!({
            "toolName": line.get("toolName").cloned().unwrap_or(Value::Null),
            "input": line.get("input").cloned().unwrap_or(Value::Null),
            "toolUseId": tool_use,
            "agentId": agent,
            "options": line.get("options").cloned().unwrap_or(Value::Null),
        });
        let (session, turn) = match &child {
            Some(key) => {
                let Some(c) = self.children.get(key).filter(|c| c.active()) else {
                    self.auto_deny(request_id, "tutti: the subagent is no longer running", out);
                    return Ok(());
                };
                (c.session.clone(), c.turn.clone())
            }
            None => {
                let Some((turn, _)) = self.current_root_owner() else {
                    self.auto_deny(request_id, "tutti: no root turn", out);
                    return Ok(());
                };
                if self.canceled_roots.contains(&turn) {
                    self.auto_deny(request_id, "tutti: the turn was canceled", out);
                    return Ok(());
                }
                (self.root.clone(), turn)
            }
        };
        self.permissions.insert(
            request_id.to_string(),
            Permission {
                session: session.clone(),
                turn: turn.clone(),
                child: child.clone(),
                tool_use_id: tool_use.map(str::to_string),
            },
        );
        out.events.push(NormalizedEvent::InteractionRequested {
            agent_session_id: session.clone(),
            turn_id: turn.clone(),
            request_id: request_id.into(),
            provider_turn_id,
            kind: json!("permission"),
            payload,
        });
        if let Some(c) = child.as_ref().and_then(|k| self.children.get_mut(k)) {
            c.pending_permissions += 1;
            if !c.waiting {
                c.waiting = true;
                out.events.push(NormalizedEvent::TurnWaiting {
                    agent_session_id: session,
                    turn_id: turn,
                });
            }
        }
        Ok(())
    }

    /// A pending callback ended (answer acknowledged, cancelled by the SDK, or the tool ran).
    fn permission_done(&mut self, request_id: &str, resolution: Value, out: &mut AdapterOutput) {
        let Some(p) = self.permissions.remove(request_id) else {
            return;
        };
        let closed = p
            .child
            .as_ref()
            .and_then(|k| self.children.get(k))
            .is_some_and(|c| c.closed);
        if closed || self.canceled_roots.contains(&p.turn) {
            return;
        }
        out.events.push(NormalizedEvent::InteractionResolved {
            agent_session_id: p.session,
            turn_id: p.turn,
            request_id: request_id.into(),
            resolution,
        });
        if let Some(key) = p.child {
            if let Some(c) = self.children.get_mut(&key) {
                c.pending_permissions = c.pending_permissions.saturating_sub(1);
            }
            self.child_running(&key, None, out);
        }
    }

    fn permissions_resolved_by_tool(&mut self, tool_use_id: &str, out: &mut AdapterOutput) {
        if self.permissions.is_empty() {
            return;
        }
        let mut ids: Vec<String> = self
            .permissions
            .iter()
            .filter(|(_, p)| p.tool_use_id.as_deref() == Some(tool_use_id))
            .map(|(k, _)| k.clone())
            .collect();
        ids.sort();
        for id in ids {
            self.permission_done(&id, json!({"status": "resolvedByProvider"}), out);
        }
    }

    // ----- acks and exit -----------------------------------------------------------------------

    fn ack(
        &mut self,
        _now: Millis,
        line: &Value,
        out: &mut AdapterOutput,
    ) -> Result<(), AdapterError> {
        let ok = line
            .get("ok")
            .and_then(Value::as_bool)
            .ok_or_else(|| missing("ack", "ok"))?;
        let error = s(line, "error").unwrap_or("the Claude sidecar refused the command");
        let Some(id) = s(line, "id") else {
            out.diagnostics.push("claude: ack without id".into());
            return Ok(());
        };
        let Some(op) = self.native_ops.remove(id) else {
            out.diagnostics
                .push("claude: ack for an unknown command".into());
            return Ok(());
        };
        match op {
            NativeOp::Start(pid) => {
                if ok {
                    if self.query == Query::Starting {
                        self.query = Query::Running;
                    }
                } else {
                    self.query = Query::Ended;
                    self.fail_turn(&pid, error, out);
                }
            }
            NativeOp::Input { entry, guide } => {
                // An accepted `input` changes nothing: the guidance turn it opens was announced
                // when the input was sent ("guidance with `startOnRoot` its `synthetic-N` turn").
                if !ok {
                    if let Some(e) = entry {
                        self.fail_turn(&e, error, out);
                    }
                    if let Some((session, turn)) = guide {
                        out.answers.push(RuntimeAnswer::GuideFailed {
                            agent_session_id: session,
                            turn_id: turn,
                            error: error.to_string(),
                        });
                    }
                }
            }
            NativeOp::Cancel { op, covered } => {
                let includes_root = match self.cancels.get_mut(&op) {
                    Some(p) => {
                        p.waiting.remove(id);
                        if ok {
                            p.acked.extend(covered);
                        } else {
                            p.error = Some(error.to_string());
                        }
                        p.includes_root
                    }
                    None => false,
                };
                if ok && includes_root {
                    self.root_interrupt_acked(out);
                }
                self.maybe_answer_cancel(&op, out);
            }
            NativeOp::Permission(request) => {
                if ok {
                    self.permission_done(&request, json!({"status": "answered"}), out);
                } else {
                    out.diagnostics
                        .push("claude: the sidecar refused a permission answer".into());
                }
            }
            NativeOp::Other => {}
        }
        Ok(())
    }

    /// The root-query interrupt was acknowledged: provider turns of canceled roots that never
    /// produced output will not produce any; close their provider lifecycle now. Turns that began
    /// are closed by their own `result`.
    fn root_interrupt_acked(&mut self, out: &mut AdapterOutput) {
        let mut kept = std::collections::VecDeque::with_capacity(self.turns.len());
        while let Some(t) = self.turns.pop_front() {
            if self.canceled_roots.contains(&t.turn) && !t.began {
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

    /// A root provider turn whose command failed: "a failed write is not confirmation"; its
    /// lifecycle completes failed (or is simply dropped if it was never announced).
    fn fail_turn(&mut self, pid: &str, error: &str, out: &mut AdapterOutput) {
        let Some(i) = self.turns.iter().position(|t| t.id == pid) else {
            return;
        };
        let Some(t) = self.turns.remove(i) else {
            return;
        };
        if t.announced && t.is_live() {
            let outcome = if self.canceled_roots.contains(&t.turn) {
                Outcome::Canceled
            } else {
                Outcome::Failed
            };
            out.events
                .push(self.completed(&t.turn, &t.id, outcome, Some(error.to_string())));
        }
    }

    /// `exited`: the SDK query ended. No child can report any more and no root provider turn can
    /// complete on its own: close them all.
    fn exited(&mut self, line: &Value, out: &mut AdapterOutput) {
        let error = s(line, "error");
        self.query = Query::Ended;
        for key in self.child_order.clone() {
            let Some(c) = self.children.get(&key) else {
                continue;
            };
            let (active, closed) = (c.active(), c.closed);
            let (session, turn) = (c.session.clone(), c.turn.clone());
            if active {
                self.deactivate(&key, false);
                out.events.push(NormalizedEvent::TurnTerminal {
                    agent_session_id: session,
                    turn_id: turn,
                    outcome: Outcome::Interrupted,
                    error: Some(format!(
                        "the Claude query ended{}",
                        error.map(|e| format!(": {e}")).unwrap_or_default()
                    )),
                });
            } else if closed {
                self.stop_no_longer_owed(&key, out);
            }
        }
        for t in std::mem::take(&mut self.turns) {
            if !(t.announced && t.is_live()) {
                continue;
            }
            let (outcome, err) = if self.canceled_roots.contains(&t.turn) {
                (Outcome::Canceled, None)
            } else if let Some(e) = error {
                (Outcome::Failed, Some(e.to_string()))
            } else {
                (
                    Outcome::Interrupted,
                    Some("the Claude query ended".to_string()),
                )
            };
            out.events
                .push(self.completed(&t.turn, &t.id, outcome, err));
        }
        self.stale_buffer.clear();
        self.notifications.clear();
        self.permissions.clear();
        for c in self.children.values_mut() {
            c.pending_permissions = 0;
            c.waiting = false;
        }
        for t in self.system_tasks.values_mut() {
            t.terminal = true;
        }
    }
}

/// Whether a `user` message carries a `tool_result` block (a completed tool round).
fn has_tool_result(m: &Value) -> bool {
    m.get("message")
        .and_then(|x| x.get("content"))
        .and_then(Value::as_array)
        .is_some_and(|blocks| blocks.iter().any(|b| s(b, "type") == Some("tool_result")))
}

/// A `toolCallUpdated` for a recorded tool call, on the turn that launched it.
fn tool_event(id: &str, t: &Tool) -> NormalizedEvent {
    NormalizedEvent::ToolCallUpdated {
        agent_session_id: t.session.clone(),
        turn_id: t.turn.clone(),
        tool_call_id: id.into(),
        name: Some(t.name.as_str().into()),
        status: t.status.as_str().into(),
        kind: t.delegation.then(|| json!("delegation")),
        payload: (!t.payload.is_empty()).then(|| Arc::new(Value::Object(t.payload.clone()))),
    }
}
