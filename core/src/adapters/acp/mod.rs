//! The ACP (Agent Client Protocol v1) adapter: JSON-RPC 2.0 over the agent's stdio.
//!
//! The client advertises `clientCapabilities.subagents: {}` in `initialize` (ACP v1's opt-in to
//! the standard subagent sessions, stabilized 2026-11-20). An agent exposes its subagents by
//! sending `subagent_update` session updates; there is no agent capability. Those become real
//! child sessions through the same engine rules as Codex and Claude ([`subagents`] states each
//! mapping choice). An agent that sends no `subagent_update` stays root-only: "it does not infer
//! child sessions from ordinary tool/progress updates"; a tool named Task or Agent stays an
//! ordinary tool call (claude-agent-acp without the capability flattens its subagents' tool
//! calls onto the root this way).
//!
//! Choices where the spec is silent, written down here:
//! - The prompt request *is* the root provider turn: sending `session/prompt` emits
//!   `rootProviderTurnStarted` (provider turn id `prompt-<rpc id>`), its result emits
//!   `rootProviderTurnCompleted`. Stop reasons: `end_turn`, `max_tokens`, `max_turn_requests` →
//!   completed; `cancelled` → interrupted; `refusal` → failed; a JSON-RPC error → failed.
//! - ACP has no steer: guidance while a prompt runs is queued and sent as the next prompt as soon
//!   as the current one answers, and the root provider turn stays open in between (no completion
//!   is reported for the intermediate prompt).
//! - Message chunks are aggregated per session and flushed as one message when another kind of
//!   update arrives, the prompt answers, the child settles, or the driver asks before a cancel
//!   ([`Adapter::flush_text`]: text streamed before a cancel is kept on the canceled turn).
//! - Cancel: for a target set with the root, `session/cancel` for the root and for every
//!   running child that advertised `capabilities.cancel` (claude-agent-acp keeps background
//!   subagents running after a parent cancel for clients that can cancel them); for a
//!   child-only target set, `session/cancel` per child that advertised it, otherwise nothing is
//!   sent and the target is simply not confirmed. Confirmation is the provider's own
//!   fact: the prompt answering `cancelled` (root; immediately if no prompt was running) and a
//!   child's `idle`/`cancelled` state. The acknowledged subset is reported when every target is
//!   confirmed or the cancel timer fires.
//! - Pending permission requests of a canceled prompt are answered `cancelled`, as ACP requires.
//! - A permission request's `toolCall` (an ACP `ToolCallUpdate`) for a tool call the agent has not
//!   reported during the running prompt is recorded as that tool call (status `pending` unless
//!   given): codex-acp announces commands needing approval only there.
//! - Relaunch (issue 17/23: "relaunch with `session/load` of the recorded ACP session id when
//!   advertised"): with [`AcpConfig::resume_session_id`] set (the root's recorded provider session
//!   id, after an idle stop, a provider exit or a daemon restart) and the agent advertising
//!   `agentCapabilities.loadSession: true`, the adapter sends `session/load` instead of
//!   `session/new`. The history the agent replays before it answers is not re-recorded (it is
//!   already in the store): updates arrive before the session is bound and are dropped, except
//!   that the children it replays are bound to their recorded child sessions (see
//!   [`subagents`]). If the agent does not advertise `loadSession`, or the load fails, a new ACP
//!   session is created and reported as the root's new provider session id
//!   (`sessionMetadataUpdated`), so the session states which provider conversation it continues.
//! - Root traffic with no prompt open (claude-agent-acp continues on its own after a background
//!   child: `usage_update` `_meta` origin `task-notification`) belongs to the canonical root turn
//!   while that turn is still active (a child still works and the root gate holds it open) and
//!   is not being canceled; otherwise it is a late notification and is dropped, so it never
//!   resurrects a settled root turn. The agent's own request ids (from 0, the same numbers as
//!   ours) are told from our responses by their `method`.

mod by_session;
pub mod subagents;

use super::fields::Fields;
use super::{Adapter, AdapterError, AdapterOutput, AdapterTimer};
use crate::input::{NormalizedEvent, RuntimeAnswer};
use crate::model::{Id, Millis, Outcome, Payload, Target, Text};
use crate::step::{GuideMode, ProviderRequest};
use by_session::BySession;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Settings of one ACP adapter.
#[derive(Debug, Clone)]
pub struct AcpConfig {
    /// Working directory for `session/new`.
    pub cwd: String,
    /// Bound of a provider cancel (ms).
    pub cancel_timeout_ms: i64,
    /// The ACP session to continue with `session/load` (when the agent advertises
    /// `loadSession`), instead of starting a new one.
    pub resume_session_id: Option<String>,
}

impl Default for AcpConfig {
    fn default() -> Self {
        AcpConfig {
            cwd: "/".into(),
            cancel_timeout_ms: 10_000,
            resume_session_id: None,
        }
    }
}

#[derive(Debug, Clone)]
enum Pending {
    Initialize,
    NewSession,
    /// `session/load` of this ACP session id.
    LoadSession(String),
    Prompt,
}

#[derive(Debug, Clone)]
struct CancelOp {
    id: Id,
    targets: Vec<Target>,
    acked: Vec<Target>,
}

#[derive(Debug, Clone)]
struct Permission {
    options: Vec<Value>,
    native: String,
}

/// The ACP adapter of one root session.
#[derive(Debug)]
pub struct AcpAdapter {
    root: Id,
    cfg: AcpConfig,
    next_id: u64,
    pending: BTreeMap<u64, Pending>,
    session: Option<String>,
    /// The ACP session a `session/load` is loading (its replay is arriving).
    loading: Option<String>,
    /// Children announced by `subagent_update`, waiting one message for their link.
    announcements: Vec<subagents::Announcement>,
    /// Requests waiting for `session/new`.
    queued: Vec<ProviderRequest>,
    root_turn: Option<Id>,
    /// The running prompt's rpc id.
    prompt: Option<u64>,
    /// Guidance waiting for the running prompt to answer.
    guidance: Vec<String>,
    children: BTreeMap<String, subagents::Child>,
    /// Canonical child session id -> native child id.
    native_of: BTreeMap<Id, String>,
    /// Cancellation boundary of the canceled root execution.
    boundary: bool,
    cancels: Vec<CancelOp>,
    permissions: BTreeMap<String, Permission>,
    /// Aggregated chunks per (native session, role).
    chunks: BySession<String>,
    /// Messages flushed by this adapter so far; see [`message_id`] for the ids built from it.
    message_no: u64,
    now: Millis,
    announced: Option<String>,
    closed: std::collections::BTreeSet<String>,
    prompt_turn: Option<Id>,
    pending_start: Option<(Id, String)>,
    /// Why the last `session/new` failed; the next request tries again.
    session_error: Option<String>,
    /// (native session, tool call id) of the tool calls reported during the running prompt.
    tool_calls: BySession<()>,
    /// The merged input/output of those tool calls ([`AcpAdapter::tool_payload`]).
    tool_payloads: BySession<serde_json::Map<String, Value>>,
}

impl AcpAdapter {
    /// What an ACP agent can do (the one place it is declared; see [`Capabilities`](crate::model::Capabilities)):
    /// guidance while only children run is a new `session/prompt` on the root session.
    pub const CAPABILITIES: crate::model::Capabilities = crate::model::Capabilities {
        guide_while_children_only: true,
    };

    /// Which tutti session the ACP session `native` is, for a replay: `Some(None)` for the root
    /// session, `Some(Some(id))` for a known child, `None` for an unknown session.
    pub(crate) fn session_of_native(&self, native: &str) -> Option<Option<Id>> {
        if self.session.as_deref() == Some(native) {
            return Some(None);
        }
        self.children.get(native).map(|c| Some(c.session.clone()))
    }

    /// An adapter for one root session.
    pub fn new(root_agent_session_id: Id, config: AcpConfig) -> AcpAdapter {
        AcpAdapter {
            root: root_agent_session_id,
            cfg: config,
            next_id: 0,
            pending: BTreeMap::new(),
            session: None,
            loading: None,
            announcements: Vec::new(),
            queued: Vec::new(),
            root_turn: None,
            prompt: None,
            guidance: Vec::new(),
            children: BTreeMap::new(),
            native_of: BTreeMap::new(),
            boundary: false,
            cancels: Vec::new(),
            permissions: BTreeMap::new(),
            chunks: BySession::default(),
            message_no: 0,
            now: 0,
            announced: None,
            closed: Default::default(),
            prompt_turn: None,
            pending_start: None,
            session_error: None,
            tool_calls: Default::default(),
            tool_payloads: BySession::default(),
        }
    }

    fn request(
        &mut self,
        out: &mut AdapterOutput,
        method: &str,
        params: Value,
        kind: Pending,
    ) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.pending.insert(id, kind);
        out.native
            .push(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        id
    }

    fn new_session(&mut self, out: &mut AdapterOutput) {
        let cwd = self.cfg.cwd.clone();
        self.request(
            out,
            "session/new",
            json!({"cwd": cwd, "mcpServers": []}),
            Pending::NewSession,
        );
    }

    fn send_prompt(&mut self, out: &mut AdapterOutput, text: String, announce: bool) {
        let Some(session) = self.session.clone() else {
            return;
        };
        let id = self.request(
            out,
            "session/prompt",
            json!({"sessionId": session, "prompt": [{"type": "text", "text": text}]}),
            Pending::Prompt,
        );
        self.prompt = Some(id);
        if announce {
            self.prompt_turn = self.root_turn.clone();
            self.announced = Some(format!("prompt-{id}"));
            out.events.push(NormalizedEvent::RootProviderTurnStarted {
                agent_session_id: self.root.clone(),
                turn_id: self.root_turn.clone(),
                provider_turn_id: Some(format!("prompt-{id}")),
            });
        }
    }

    /// `session/new` failed (issue 23: claude-code-acp answers it with an internal error when
    /// its Claude CLI refuses to start): every request waiting for the session is answered
    /// instead of waiting forever. A root turn start becomes a root provider turn that failed
    /// with `error`, so the turn settles `failed` with the agent's reason; guidance is
    /// `guideFailed`; a cancel is acknowledged at once (nothing runs natively); an interaction
    /// answer cannot exist without a session and is dropped. The next request sends `session/new`
    /// again.
    fn fail_queued(&mut self, out: &mut AdapterOutput, error: String) {
        self.session_error = Some(error.clone());
        for r in std::mem::take(&mut self.queued) {
            match r {
                ProviderRequest::Start { turn_id, .. } => {
                    out.events.push(NormalizedEvent::RootProviderTurnStarted {
                        agent_session_id: self.root.clone(),
                        turn_id: Some(turn_id.clone()),
                        provider_turn_id: None,
                    });
                    out.events.push(NormalizedEvent::RootProviderTurnCompleted {
                        agent_session_id: self.root.clone(),
                        turn_id: Some(turn_id),
                        provider_turn_id: None,
                        outcome: Outcome::Failed,
                        error: Some(error.clone()),
                    });
                }
                ProviderRequest::Guide {
                    agent_session_id,
                    turn_id,
                    ..
                } => out.answers.push(RuntimeAnswer::GuideFailed {
                    agent_session_id,
                    turn_id,
                    error: error.clone(),
                }),
                ProviderRequest::Cancel {
                    operation_id,
                    targets,
                    ..
                } => out.answers.push(RuntimeAnswer::CancelResult {
                    operation_id,
                    acked: targets,
                }),
                ProviderRequest::RespondInteraction { request_id, .. } => out.diagnostics.push(
                    format!("acp: answer to {request_id} without a session dropped"),
                ),
            }
        }
    }

    /// The canonical (session, turn) a native session id is scoped to right now.
    fn owner(&self, native: &str) -> Option<(Id, Id, bool)> {
        if Some(native) == self.session.as_deref() {
            let turn = self.root_turn.clone()?;
            return Some((self.root.clone(), turn, self.root_active()));
        }
        let c = self.children.get(native)?;
        Some((c.session.clone(), c.turn.clone(), c.active))
    }

    fn flush(&mut self, out: &mut AdapterOutput, native: &str) {
        for role in ["assistant", "thought"] {
            if let Some(text) = self.chunks.remove(native, role) {
                if let Some((session, turn, _)) = self.owner(native) {
                    self.message_no += 1;
                    let message_id = message_id(&turn, self.message_no);
                    out.events.push(NormalizedEvent::MessageAppended {
                        agent_session_id: session,
                        turn_id: turn,
                        message_id,
                        role: role.into(),
                        text: text.into(),
                    });
                }
            }
        }
    }

    fn flush_all(&mut self, out: &mut AdapterOutput) {
        let keys: Vec<String> = self.chunks.sessions().map(str::to_string).collect();
        for k in keys {
            self.flush(out, &k);
        }
    }

    fn ack(&mut self, out: &mut AdapterOutput, target: &Target) {
        for op in &mut self.cancels {
            if op.targets.contains(target) && !op.acked.contains(target) {
                op.acked.push(target.clone());
            }
        }
        self.finish_cancels(out, false);
    }

    fn finish_cancels(&mut self, out: &mut AdapterOutput, all: bool) {
        let (done, rest): (Vec<CancelOp>, Vec<CancelOp>) = std::mem::take(&mut self.cancels)
            .into_iter()
            .partition(|op| all || op.acked.len() == op.targets.len());
        self.cancels = rest;
        for op in done {
            out.answers.push(RuntimeAnswer::CancelResult {
                operation_id: op.id,
                acked: op.acked,
            });
        }
    }

    fn on_response(&mut self, out: &mut AdapterOutput, id: u64, msg: &Value) {
        let Some(kind) = self.pending.remove(&id) else {
            out.diagnostics
                .push(format!("acp: response to unknown request {id}"));
            return;
        };
        let result = msg.field("result");
        let error = msg.field("error");
        match kind {
            Pending::Initialize => {
                let load = result
                    .and_then(|r| r.at(&["agentCapabilities", "loadSession"]))
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let cwd = self.cfg.cwd.clone();
                match self.cfg.resume_session_id.clone() {
                    Some(sid) if load => {
                        self.loading = Some(sid.clone());
                        self.request(
                            out,
                            "session/load",
                            json!({"sessionId": sid, "cwd": cwd, "mcpServers": []}),
                            Pending::LoadSession(sid),
                        );
                    }
                    resume => {
                        if resume.is_some() {
                            out.diagnostics.push(
                                "acp: the agent cannot load sessions; starting a new one".into(),
                            );
                        }
                        self.new_session(out);
                    }
                }
            }
            Pending::LoadSession(sid) => {
                self.loading = None;
                if error.is_some() {
                    out.diagnostics
                        .push("acp: session/load failed; starting a new session".into());
                    self.new_session(out);
                    return;
                }
                self.session = Some(sid);
                out.diagnostics.push("acp: session loaded".into());
                for r in std::mem::take(&mut self.queued) {
                    let o = self.on_request(self.now, &r);
                    out.extend(o);
                }
            }
            Pending::NewSession => {
                let Some(sid) = result
                    .and_then(|r| r.field("sessionId"))
                    .and_then(Value::as_str)
                else {
                    out.diagnostics.push("acp: session/new failed".into());
                    let why = error
                        .and_then(|e| e.field("message"))
                        .and_then(Value::as_str)
                        .unwrap_or("no session id in the answer");
                    self.fail_queued(out, format!("the agent could not start a session: {why}"));
                    return;
                };
                self.session = Some(sid.to_string());
                out.events.push(NormalizedEvent::SessionMetadataUpdated {
                    agent_session_id: self.root.clone(),
                    goal: None,
                    title: None,
                    provider_session_id: Some(sid.to_string()),
                    usage: None,
                });
                for r in std::mem::take(&mut self.queued) {
                    let o = self.on_request(self.now, &r);
                    out.extend(o);
                }
            }
            Pending::Prompt => {
                if self.prompt != Some(id) {
                    return;
                }
                let root_native = self.session.clone().unwrap_or_default();
                self.flush(out, &root_native);
                self.prompt = None;
                self.tool_calls.clear();
                // Children's tool calls may go on after the prompt; the root's may not.
                self.tool_payloads.retain_sessions(|n| n != root_native);
                let stop = result
                    .and_then(|r| r.field("stopReason"))
                    .and_then(Value::as_str);
                if stop == Some("cancelled") {
                    if let Some(turn) = self.root_turn.clone() {
                        self.ack(
                            out,
                            &Target {
                                agent_session_id: self.root.clone(),
                                turn_id: turn,
                            },
                        );
                    }
                } else if !self.guidance.is_empty() && !self.boundary {
                    // Queued guidance continues the same root provider turn.
                    let text = std::mem::take(&mut self.guidance).join("\n\n");
                    self.send_prompt(out, text, false);
                    return;
                }
                let (outcome, err) = match (stop, error) {
                    (_, Some(e)) => (
                        Outcome::Failed,
                        Some(
                            e.field("message")
                                .and_then(Value::as_str)
                                .unwrap_or("prompt failed")
                                .to_string(),
                        ),
                    ),
                    (Some("cancelled"), _) => {
                        (Outcome::Interrupted, Some("prompt cancelled".to_string()))
                    }
                    (Some("refusal"), _) => {
                        (Outcome::Failed, Some("the agent refused".to_string()))
                    }
                    _ => (Outcome::Completed, None),
                };
                out.events.push(NormalizedEvent::RootProviderTurnCompleted {
                    agent_session_id: self.root.clone(),
                    turn_id: self.prompt_turn.clone().or(self.root_turn.clone()),
                    provider_turn_id: self.announced.clone().or(Some(format!("prompt-{id}"))),
                    outcome,
                    error: err,
                });
                if let Some((turn, text)) = self.pending_start.take() {
                    self.boundary = false;
                    self.root_turn = Some(turn);
                    self.send_prompt(out, text, true);
                }
            }
        }
    }

    fn on_update(&mut self, out: &mut AdapterOutput, params: &Value) -> Result<(), AdapterError> {
        let native = params
            .field("sessionId")
            .and_then(Value::as_str)
            .ok_or(AdapterError::MissingField {
                method: "session/update".into(),
                field: "sessionId",
            })?
            .to_string();
        let update = params.field("update").ok_or(AdapterError::MissingField {
            method: "session/update".into(),
            field: "update",
        })?;
        // Every update of the schema carries its tag: one without it is refused whole (the
        // transport forwards updates as the agent wrote them, see tutti-tokio's `acp_transport`).
        let kind = update
            .field("sessionUpdate")
            .and_then(Value::as_str)
            .ok_or(AdapterError::MissingField {
                method: "session/update".into(),
                field: "sessionUpdate",
            })?;
        if kind == "subagent_update" {
            self.on_subagent(out, &native, update);
            return Ok(());
        }
        let Some((session, turn, accepting)) = self.owner(&native) else {
            out.diagnostics
                .push(format!("acp: update {kind} for an unknown session dropped"));
            return Ok(());
        };
        if kind == "usage_update" {
            // Session metadata, not turn content: also after the prompt's answer (the agent
            // reports the turn's cost then), and never attached to a turn. Like every update
            // that is not a chunk, it ends the message being streamed.
            if accepting {
                self.flush(out, &native);
            }
            out.events
                .extend(NormalizedEvent::usage(session, usage_of(update)));
            return Ok(());
        }
        if !accepting {
            // "A late notification after the prompt result must not be attached to a recently
            // settled root turn"; nothing is invented to make it persistable.
            out.diagnostics.push(format!("acp: late {kind} dropped"));
            return Ok(());
        }
        match kind {
            "agent_message_chunk" | "agent_thought_chunk" => {
                let role = if kind == "agent_message_chunk" {
                    "assistant"
                } else {
                    "thought"
                };
                let text = update
                    .field("content")
                    .and_then(|c| c.field("text"))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                self.chunks.get_or_default(&native, role).push_str(text);
            }
            "session_message" => self.on_session_message(out, &native, session, turn, update),
            "tool_call" | "tool_call_update" => {
                self.flush(out, &native);
                let Some(call) = update.field("toolCallId").and_then(Value::as_str) else {
                    return Err(AdapterError::MissingField {
                        method: kind.into(),
                        field: "toolCallId",
                    });
                };
                self.tool_calls.insert_new(&native, call, ());
                let status = update.field("status").and_then(Value::as_str).unwrap_or(
                    if kind == "tool_call" {
                        "pending"
                    } else {
                        "in_progress"
                    },
                );
                let last = matches!(status, "completed" | "failed");
                let payload = self.tool_payload(&native, call, update, last);
                out.events.push(NormalizedEvent::ToolCallUpdated {
                    agent_session_id: session,
                    turn_id: turn,
                    tool_call_id: call.into(),
                    name: update
                        .field("title")
                        .and_then(Value::as_str)
                        .map(Text::from),
                    status: status.into(),
                    kind: update.field("kind").cloned(),
                    payload,
                });
            }
            _ => self.flush(out, &native),
        }
        Ok(())
    }

    /// What the agent sent of a tool call's input and output (`rawInput`, `rawOutput`,
    /// `content`, `locations`), merged over its updates (a `tool_call_update` carries only what
    /// changed), as the tool call's payload: the web view opens a tool call to show it. `None`
    /// when this update carries none of them (the recorded payload stays). The `last` update of
    /// a tool call (completed or failed) forgets its recorded payload.
    fn tool_payload(
        &mut self,
        native: &str,
        call: &str,
        update: &Value,
        last: bool,
    ) -> Option<Payload> {
        const KEYS: [&str; 4] = ["rawInput", "rawOutput", "content", "locations"];
        let merge = |entry: &mut serde_json::Map<String, Value>| {
            for k in KEYS {
                if let Some(v) = update.field(k) {
                    entry.insert(k.to_string(), v.clone());
                }
            }
        };
        let carries = KEYS.iter().any(|k| update.field(k).is_some());
        if last {
            // Taken out rather than copied: nothing reads it again.
            let recorded = self.tool_payloads.remove(native, call);
            if !carries {
                return None;
            }
            let mut entry = recorded.unwrap_or_default();
            merge(&mut entry);
            return Some(Arc::new(Value::Object(entry)));
        }
        if !carries {
            return None;
        }
        let entry = self.tool_payloads.get_or_default(native, call);
        merge(entry);
        Some(Arc::new(Value::Object(entry.clone())))
    }

    fn on_permission(&mut self, out: &mut AdapterOutput, id: &Value, params: &Value) {
        let native = params
            .field("sessionId")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let owner = self
            .owner(native)
            .filter(|(_, _, accepting)| *accepting)
            .filter(|_| !self.closed.contains(native));
        let Some((session, turn, _)) = owner else {
            // Never attributed to the root: the request is refused.
            out.native.push(json!({"jsonrpc": "2.0", "id": id, "result": {"outcome": {"outcome": "cancelled"}}}));
            return;
        };
        let request_id = match id {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let options = params
            .field("options")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        self.permissions.insert(
            request_id.clone(),
            Permission {
                options,
                native: native.to_string(),
            },
        );
        // Issue 23 (codex-acp): an agent may announce a tool call only inside the permission
        // request (its `toolCall` is an ACP `ToolCallUpdate`). A tool call not reported before
        // is recorded from it (status `pending` unless given), so the turn's record shows the
        // call and its end (`interrupted` when the turn settles first). One already reported
        // is left as the agent last reported it.
        if let Some(call) = params
            .at(&["toolCall", "toolCallId"])
            .and_then(Value::as_str)
        {
            if self.tool_calls.insert_new(native, call, ()) {
                self.flush(out, native);
                let tool = params.field("toolCall");
                let field = |k: &str| tool.and_then(|t| t.field(k));
                out.events.push(NormalizedEvent::ToolCallUpdated {
                    agent_session_id: session.clone(),
                    turn_id: turn.clone(),
                    tool_call_id: call.into(),
                    name: field("title").and_then(Value::as_str).map(Text::from),
                    status: field("status")
                        .and_then(Value::as_str)
                        .unwrap_or("pending")
                        .into(),
                    kind: field("kind").cloned(),
                    payload: None,
                });
            }
        }
        out.events.push(NormalizedEvent::InteractionRequested {
            agent_session_id: session,
            turn_id: turn,
            request_id: request_id.into(),
            provider_turn_id: self.prompt.map(|p| format!("prompt-{p}")),
            kind: json!("permission"),
            payload: json!({"toolCall": params.field("toolCall"), "options": params.field("options")}),
        });
    }

    fn answer_permission(&self, request: &str, response: &Value) -> Option<Value> {
        let p = self.permissions.get(request)?;
        let id: Value = request
            .parse::<u64>()
            .map(Value::from)
            .unwrap_or_else(|_| Value::String(request.to_string()));
        // The documented shapes (see `adapters::response`): "allow" picks the `allow_once`
        // option, "deny" the `reject_once` one, never an "always" option unless asked for by id.
        // The API refuses anything else before it gets here; a replayed or direct answer that
        // does not fit is sent as a refusal (`cancelled`).
        let outcome = match super::response::acp_permission_choice(&p.options, response) {
            Ok(super::response::AcpChoice::Native(v)) => {
                return Some(json!({"jsonrpc": "2.0", "id": id, "result": v}));
            }
            Ok(super::response::AcpChoice::Option(o)) => {
                json!({"outcome": "selected", "optionId": o})
            }
            Err(_) => json!({"outcome": "cancelled"}),
        };
        Some(json!({"jsonrpc": "2.0", "id": id, "result": {"outcome": outcome}}))
    }
}

impl Adapter for AcpAdapter {
    fn open(&mut self, _now: Millis) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        self.request(
            &mut out,
            "initialize",
            json!({"protocolVersion": 1, "clientCapabilities": {
                "fs": {"readTextFile": false, "writeTextFile": false}, "terminal": false,
                "subagents": {}}}),
            Pending::Initialize,
        );
        out
    }

    fn on_request(&mut self, now: Millis, request: &ProviderRequest) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        if self.session.is_none() {
            self.queued.push(request.clone());
            if self.session_error.take().is_some() {
                // The last `session/new` failed: this request tries again.
                self.new_session(&mut out);
            }
            return out;
        }
        match request {
            ProviderRequest::Cancel { targets, .. }
                if targets.iter().any(|t| t.agent_session_id == self.root) =>
            {
                self.cancel_announced(&mut out)
            }
            _ => self.create_announced(&mut out),
        }
        match request {
            ProviderRequest::Start { turn_id, text, .. }
                if self.prompt.is_some() && self.prompt_turn.as_ref() != Some(turn_id) =>
            {
                self.guidance.clear();
                self.pending_start = Some((turn_id.clone(), text.clone()));
            }
            ProviderRequest::Start { turn_id, text, .. } => {
                // A new explicit root turn clears the cancellation boundary.
                self.boundary = false;
                self.root_turn = Some(turn_id.clone());
                self.guidance.clear();
                if self.prompt.is_some() {
                    self.guidance.push(text.clone());
                } else {
                    self.send_prompt(&mut out, text.clone(), true);
                }
            }
            ProviderRequest::Guide {
                mode: GuideMode::Steer,
                turn_id,
                agent_session_id,
                ..
            } if self.prompt.is_none() => {
                out.answers.push(RuntimeAnswer::GuideFailed {
                    agent_session_id: agent_session_id.clone(),
                    turn_id: turn_id.clone(),
                    error: "the steered prompt already answered".into(),
                });
            }
            ProviderRequest::Guide {
                mode,
                text,
                turn_id,
                ..
            } => {
                self.root_turn = Some(turn_id.clone());
                match (mode, self.prompt) {
                    (_, Some(_)) => self.guidance.push(text.clone()),
                    (GuideMode::StartOnRoot, None) | (GuideMode::Steer, None) => {
                        self.send_prompt(&mut out, text.clone(), true)
                    }
                }
            }
            ProviderRequest::Cancel {
                operation_id,
                targets,
                ..
            } => {
                let session = self.session.clone().unwrap_or_default();
                let root_target = targets
                    .iter()
                    .find(|t| t.agent_session_id == self.root)
                    .cloned();
                let mut op = CancelOp {
                    id: operation_id.clone(),
                    targets: targets.clone(),
                    acked: Vec::new(),
                };
                if let Some(rt) = root_target {
                    self.boundary = true;
                    self.guidance.clear();
                    self.flush_all(&mut out);
                    out.native.push(subagents::cancel_notification(&session));
                    // claude-agent-acp keeps background subagents running after a parent
                    // cancel (for clients that can cancel them): every running child that
                    // accepts `session/cancel` is sent one, targets or not.
                    for t in targets {
                        if let Some(n) = self.native_of.get(&t.agent_session_id) {
                            self.closed.insert(n.clone());
                        }
                    }
                    for (n, c) in &self.children {
                        if c.active && c.can_cancel {
                            out.native.push(subagents::cancel_notification(n));
                        }
                    }
                    if self.prompt.is_none() {
                        op.acked.push(rt);
                    }
                    // Pending permissions of the canceled execution are answered `cancelled`.
                    for (req, _) in std::mem::take(&mut self.permissions) {
                        let id: Value = req
                            .parse::<u64>()
                            .map(Value::from)
                            .unwrap_or(Value::String(req));
                        out.native.push(json!({"jsonrpc": "2.0", "id": id, "result": {"outcome": {"outcome": "cancelled"}}}));
                    }
                } else {
                    for t in targets {
                        let native = self.native_of.get(&t.agent_session_id).cloned();
                        if let Some(n) = native.clone() {
                            self.closed.insert(n.clone());
                            let reqs: Vec<String> = self
                                .permissions
                                .iter()
                                .filter(|(_, p)| p.native == n)
                                .map(|(k, _)| k.clone())
                                .collect();
                            for req in reqs {
                                self.permissions.remove(&req);
                                let id: Value = req
                                    .parse::<u64>()
                                    .map(Value::from)
                                    .unwrap_or(Value::String(req));
                                out.native.push(json!({"jsonrpc": "2.0", "id": id, "result": {"outcome": {"outcome": "cancelled"}}}));
                            }
                        }
                        if let Some(n) = native {
                            if self
                                .children
                                .get(&n)
                                .is_some_and(|c| c.can_cancel && c.active)
                            {
                                out.native.push(subagents::cancel_notification(&n));
                            }
                        }
                    }
                }
                self.cancels.push(op);
                out.timers.push(AdapterTimer {
                    id: format!("cancel:{operation_id}"),
                    at: now + self.cfg.cancel_timeout_ms,
                });
                self.finish_cancels(&mut out, false);
            }
            ProviderRequest::RespondInteraction {
                request_id,
                response,
                ..
            } => match self.answer_permission(request_id, response) {
                Some(msg) => {
                    self.permissions.remove(&**request_id);
                    out.native.push(msg);
                }
                None => out
                    .diagnostics
                    .push("acp: answer for an unknown permission request".into()),
            },
        }
        out
    }

    fn on_native(&mut self, now: Millis, msg: &Value) -> Result<AdapterOutput, AdapterError> {
        self.now = now;
        let mut out = AdapterOutput::default();
        let obj = msg
            .as_object()
            .ok_or_else(|| AdapterError::Malformed("not a JSON object".into()))?;
        self.settle_announcements(&mut out, msg);
        let method = obj.field("method").and_then(Value::as_str);
        let id = obj.field("id");
        match (method, id) {
            (None, Some(id)) => {
                let id = id
                    .as_u64()
                    .ok_or_else(|| AdapterError::Malformed("response id is not ours".into()))?;
                self.on_response(&mut out, id, msg);
            }
            (Some("session/update"), None) => {
                let params = obj.field("params").ok_or(AdapterError::MissingField {
                    method: "session/update".into(),
                    field: "params",
                })?;
                self.on_update(&mut out, params)?;
            }
            (Some("session/request_permission"), Some(id)) => {
                let params = obj.field("params").cloned().unwrap_or(Value::Null);
                self.on_permission(&mut out, id, &params);
            }
            (Some(m), Some(id)) => {
                // We advertised no fs/terminal capabilities.
                out.diagnostics
                    .push(format!("acp: unsupported request {m}"));
                out.native.push(json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "method not found"}}));
            }
            (Some(m), None) => out
                .diagnostics
                .push(format!("acp: notification {m} ignored")),
            (None, None) => {
                return Err(AdapterError::Malformed(
                    "neither request, response nor notification".into(),
                ))
            }
        }
        Ok(out)
    }

    fn on_dropped(&mut self, _now: Millis, event: &NormalizedEvent) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        if let NormalizedEvent::InteractionRequested { request_id, .. } = event {
            if self.permissions.remove(&**request_id).is_some() {
                let id: Value = request_id
                    .parse::<u64>()
                    .map(Value::from)
                    .unwrap_or_else(|_| Value::String(request_id.to_string()));
                out.native.push(json!({"jsonrpc": "2.0", "id": id, "result": {"outcome": {"outcome": "cancelled"}}}));
            }
        }
        out
    }

    /// Buffered `agent_message_chunk`/`agent_thought_chunk` text of sessions still accepting
    /// output, as one message each (the same aggregation as any other flush).
    fn flush_text(&mut self, _now: Millis) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        self.flush_all(&mut out);
        out
    }

    fn on_timer(&mut self, _now: Millis, id: &str) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        if let Some(op) = id.strip_prefix("cancel:") {
            let (done, rest): (Vec<CancelOp>, Vec<CancelOp>) = std::mem::take(&mut self.cancels)
                .into_iter()
                .partition(|o| &*o.id == op);
            self.cancels = rest;
            for o in done {
                out.answers.push(RuntimeAnswer::CancelResult {
                    operation_id: o.id,
                    acked: o.acked,
                });
            }
        }
        out
    }
}

/// The id of the `n`-th message this adapter flushed, on `turn`.
///
/// ACP messages carry no id of their own, so the adapter numbers them. The number alone is not
/// enough: a relaunched agent process gets a new adapter whose numbering starts again, and the
/// engine drops a message whose id the session already has as a duplicate, so the relaunched
/// agent's first answers would be lost. The turn id makes the id unique: turn ids are never
/// reused, and a turn never spans two adapters (a provider exit or a daemon restart settles the
/// turns it ran).
fn message_id(turn: &Id, n: u64) -> Id {
    format!("acp-{turn}-m{n}").into()
}

/// The token use an ACP `usage_update` reports: `used` (tokens in the context), `size` (the
/// context window) and the optional cumulative `cost`. A field that is not a count (or a cost
/// without a finite amount and a short currency code) is left out: nothing is guessed.
fn usage_of(update: &Value) -> crate::model::TokenUsage {
    let cost = update.field("cost").and_then(|c| {
        let amount = c
            .field("amount")
            .and_then(Value::as_f64)
            .filter(|a| a.is_finite())?;
        let currency = c
            .field("currency")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty() && c.len() <= 8)?;
        Some(crate::model::Cost {
            amount,
            currency: currency.to_string(),
        })
    });
    crate::model::TokenUsage {
        total_tokens: None,
        context_tokens: update.field("used").and_then(Value::as_u64),
        context_window: update.field("size").and_then(Value::as_u64),
        cost,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter(resume: Option<&str>) -> AcpAdapter {
        AcpAdapter::new(
            "root".into(),
            AcpConfig {
                cwd: "/w".into(),
                resume_session_id: resume.map(String::from),
                ..AcpConfig::default()
            },
        )
    }

    fn initialized(a: &mut AcpAdapter, load_session: bool) -> AdapterOutput {
        let open = a.open(0);
        assert_eq!(open.native[0]["method"], "initialize");
        let id = open.native[0]["id"].clone();
        a.on_native(
            1,
            &json!({"jsonrpc": "2.0", "id": id, "result": {"protocolVersion": 1,
                "agentCapabilities": {"loadSession": load_session}}}),
        )
        .expect("initialize answer")
    }

    fn start() -> ProviderRequest {
        ProviderRequest::Start {
            root_agent_session_id: "root".into(),
            agent_session_id: "root".into(),
            turn_id: "t2".into(),
            text: "again".into(),
        }
    }

    /// Runs one prompt of `turn` in an initialized adapter bound to ACP session `sid`: the agent
    /// sends one message chunk and ends the turn. Returns the ids of the messages it appended.
    fn one_answered_prompt(a: &mut AcpAdapter, sid: &str, turn: &str) -> Vec<Id> {
        let prompt = a.on_request(
            10,
            &ProviderRequest::Start {
                root_agent_session_id: "root".into(),
                agent_session_id: "root".into(),
                turn_id: turn.into(),
                text: "hello".into(),
            },
        );
        let prompt_id = prompt
            .native
            .iter()
            .find(|m| m["method"] == "session/prompt")
            .expect("the prompt is sent")["id"]
            .clone();
        let chunk = a
            .on_native(
                11,
                &json!({"jsonrpc": "2.0", "method": "session/update", "params": {
                    "sessionId": sid, "update": {"sessionUpdate": "agent_message_chunk",
                    "content": {"type": "text", "text": "answer"}}}}),
            )
            .expect("chunk");
        let end = a
            .on_native(
                12,
                &json!({"jsonrpc": "2.0", "id": prompt_id, "result": {"stopReason": "end_turn"}}),
            )
            .expect("prompt answer");
        chunk
            .events
            .iter()
            .chain(&end.events)
            .filter_map(|e| match e {
                NormalizedEvent::MessageAppended { message_id, .. } => Some(message_id.clone()),
                _ => None,
            })
            .collect()
    }

    /// "Never loses work": a relaunched agent process gets a new adapter, whose messages must
    /// not take ids the session's earlier messages have (the engine drops those as duplicates,
    /// which lost the first answers after every relaunch).
    #[test]
    fn a_relaunched_adapter_never_reuses_a_message_id_of_the_session() {
        let mut first = adapter(None);
        let out = initialized(&mut first, true);
        let new_id = out.native[0]["id"].clone();
        first
            .on_native(
                2,
                &json!({"jsonrpc": "2.0", "id": new_id, "result": {"sessionId": "acp-1"}}),
            )
            .expect("session/new answer");
        let before = one_answered_prompt(&mut first, "acp-1", "t1");
        assert_eq!(before, vec![Id::from("acp-t1-m1")], "written out literally");

        let mut relaunched = adapter(Some("acp-1"));
        let out = initialized(&mut relaunched, true);
        let load_id = out.native[0]["id"].clone();
        relaunched
            .on_native(3, &json!({"jsonrpc": "2.0", "id": load_id, "result": {}}))
            .expect("load answer");
        let after = one_answered_prompt(&mut relaunched, "acp-1", "t2");
        assert_eq!(after.len(), 1, "the relaunched agent's answer is a message");
        assert!(
            !before.contains(&after[0]),
            "a new id after the relaunch: {before:?} then {after:?}"
        );
    }

    /// Issue 23 item 4: "relaunch with `session/load` of the recorded ACP session id when
    /// advertised"; the queued prompt goes to the loaded session, and the replayed history is not
    /// recorded again.
    #[test]
    fn a_relaunch_loads_the_recorded_session_when_the_agent_advertises_load_session() {
        let mut a = adapter(Some("acp-1"));
        let out = initialized(&mut a, true);
        assert_eq!(out.native.len(), 1);
        assert_eq!(out.native[0]["method"], "session/load");
        assert_eq!(out.native[0]["params"]["sessionId"], "acp-1");
        assert_eq!(out.native[0]["params"]["cwd"], "/w");
        let load_id = out.native[0]["id"].clone();
        let queued = a.on_request(2, &start());
        assert!(queued.native.is_empty(), "the prompt waits for the load");
        let replay = a
            .on_native(
                3,
                &json!({"jsonrpc": "2.0", "method": "session/update", "params": {
                    "sessionId": "acp-1", "update": {"sessionUpdate": "user_message_chunk",
                    "content": {"type": "text", "text": "earlier"}}}}),
            )
            .expect("replayed history");
        assert!(
            replay.events.is_empty(),
            "replayed history is not re-recorded"
        );
        let loaded = a
            .on_native(4, &json!({"jsonrpc": "2.0", "id": load_id, "result": {}}))
            .expect("load answer");
        let prompt = loaded
            .native
            .iter()
            .find(|m| m["method"] == "session/prompt")
            .expect("the queued prompt is sent");
        assert_eq!(prompt["params"]["sessionId"], "acp-1");
        assert!(
            !loaded.events.iter().any(|e| matches!(
                e,
                NormalizedEvent::SessionMetadataUpdated {
                    provider_session_id: Some(_),
                    ..
                }
            )),
            "the provider session id stays as recorded"
        );
    }

    /// "Otherwise a new ACP session, stated in the session's provider aliases": without
    /// `loadSession` the adapter starts a new session and reports its id.
    #[test]
    fn without_load_session_a_relaunch_starts_a_new_session_and_records_it() {
        let mut a = adapter(Some("acp-1"));
        let out = initialized(&mut a, false);
        assert_eq!(out.native[0]["method"], "session/new");
        let new_id = out.native[0]["id"].clone();
        let created = a
            .on_native(
                2,
                &json!({"jsonrpc": "2.0", "id": new_id, "result": {"sessionId": "acp-2"}}),
            )
            .expect("session/new answer");
        assert!(created.events.iter().any(|e| matches!(
            e,
            NormalizedEvent::SessionMetadataUpdated { provider_session_id: Some(s), .. } if s == "acp-2"
        )));
    }

    /// A failed `session/load` (the agent lost the session) falls back to a new session.
    #[test]
    fn a_failed_load_falls_back_to_a_new_session() {
        let mut a = adapter(Some("acp-1"));
        let out = initialized(&mut a, true);
        let load_id = out.native[0]["id"].clone();
        let failed = a
            .on_native(
                2,
                &json!({"jsonrpc": "2.0", "id": load_id, "error": {"code": -32602, "message": "unknown"}}),
            )
            .expect("load error");
        assert_eq!(failed.native.len(), 1);
        assert_eq!(failed.native[0]["method"], "session/new");
    }

    /// A first launch (nothing recorded) never loads, whatever the agent advertises.
    #[test]
    fn a_first_launch_starts_a_new_session() {
        let mut a = adapter(None);
        let out = initialized(&mut a, true);
        assert_eq!(out.native[0]["method"], "session/new");
    }
}
