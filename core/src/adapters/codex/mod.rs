//! The Codex app-server adapter: a pure state machine between one root session and one
//! `codex app-server` process (JSON-RPC over stdio, codex 0.171).
//!
//! "Provider transports report provider facts; they do not decide whether a root
//! WorkspaceAgentTurn is complete." The adapter only routes: it identifies the root, parent and
//! child session/turn of every native event and normalizes it; the engine applies the root gate.
//!
//! # Mapping
//!
//! - **Root thread** = the root session's `providerSessionId`. It comes from the `thread/start`
//!   response (or `thread/resume` when [`CodexConfig::resume_thread_id`] is set), announced once
//!   as `sessionMetadataUpdated{providerSessionId}`.
//! - **Root turns.** [`ProviderRequest::Start`] remembers the canonical root turn and sends
//!   `turn/start` on the root thread (queued until the thread exists). Every root-thread
//!   `turn/started` becomes `rootProviderTurnStarted` and every root `turn/completed` becomes
//!   `rootProviderTurnCompleted` for that canonical root turn, never a canonical completion.
//!   Status `completed | interrupted | failed` maps to the outcome; `turn.error.message` is kept
//!   for failed/interrupted only.
//! - **Spawn edges**, in both shapes: a `collabAgentToolCall` with `tool: spawnAgent` whose
//!   `item/completed` names `receiverThreadIds`, and a `subAgentActivity` item with
//!   `kind: started` (`id` = the parent tool call, `agentThreadId` = the child). Either one emits
//!   the parent delegation call as `toolCallUpdated{status: completed}` ("spawn tool success
//!   means delegation was accepted") on the parent session/turn, then one `childSessionCreated`
//!   per child thread with its submitted first turn (ids from [`child_ids`]`(root, "thread",
//!   threadId, n)`: child turn n is the child's n-th canonical turn). Repeats emit nothing. A spawn on a child thread creates a grandchild whose
//!   parent is that child session/turn and whose root relation is the original root turn.
//! - **Foreign threads.** "threadId != root provider_session_id events are child events only
//!   after the child thread has been registered from a spawn edge." Earlier events (the real
//!   binary sends `thread/status/changed` and `warning` for a child before the spawn item
//!   completes) never touch the root: they are counted per thread, and lifecycle/item events
//!   among them (bounded by [`MAX_EARLY_EVENTS`] per thread and [`MAX_EARLY_THREADS`] threads)
//!   are replayed into the child when its edge registers, so an early child `turn/started` starts
//!   the right child turn. The rest stay diagnostics.
//! - **Child turns.** A child's first native `turn/started` binds its native turn id (an alias,
//!   reported as `turnStarted.providerTurnId`) to the child's turn 1; after that turn completed,
//!   a new native turn opens its turn n+1 (guidance into the child). `turn/completed`
//!   becomes `turnTerminal` on the exact child turn. `thread/status/changed` with
//!   `waitingOnApproval`/`waitingOnUserInput` becomes `turnWaiting`, and back to plain active
//!   `turnStarted` (running) again.
//! - **Transcript.** `agentMessage` `item/completed` becomes `messageAppended` (messageId = item
//!   id, role `assistant`) on the exact session/turn; a child's `userMessage` (its delegated task)
//!   becomes a `user` message of the child (the root's own user message is recorded by the engine
//!   at submit, so the root's `userMessage` item is not repeated). Spawn, wait and other tool
//!   items become `toolCallUpdated` on the session/turn whose thread ran them.
//! - **Server requests** (approvals, user input, permissions, elicitations, ...) follow "the same
//!   threadId ownership rule as notifications": on the root thread they belong to the canonical
//!   root turn, on a registered child thread to that child session and its canonical turn;
//!   `interactionRequested` carries `requestId` = the JSON-RPC id as a string, `providerTurnId` =
//!   the native `turnId`, `kind` = the method name and `payload` = the params. A request on an
//!   unknown non-root thread (or without a thread) is answered at once with a JSON-RPC error
//!   ([`UNOWNED_REQUEST`]), "never attributed to the root". `serverRequest/resolved` becomes
//!   `interactionResolved` through the owning session/turn recorded with the request. An
//!   `interactionRequested` the engine does not accept (e.g. an approval on the root thread after
//!   the canonical root turn settled) comes back through `on_dropped` and is refused natively at
//!   once (a `decline`, or [`DROPPED_REQUEST`] for a method without a refusal shape), so codex
//!   never waits on it.
//! - **Guidance**: [`GuideMode::Steer`] sends `turn/steer` with `expectedTurnId` = the running
//!   native root turn; [`GuideMode::StartOnRoot`] sends `turn/start` on the root thread, whose
//!   turn then attaches to the same canonical root turn. An error answer becomes
//!   [`RuntimeAnswer::GuideFailed`].
//! - **Cancel** (see [`CodexAdapter`]'s `on_request`): only the supplied targets, root first,
//!   acknowledged subset returned as [`RuntimeAnswer::CancelResult`]; then the execution-local
//!   cancellation boundary.
//!
//! # Decisions where the spec is silent
//!
//! - `open()` pipelines `initialize` and `thread/start` (checked against codex 0.171: the
//!   app-server handles requests in order); `initialized` follows the initialize response.
//! - A refused `turn/start` of a new canonical root turn (or a refused `thread/start` while a
//!   start is queued) is reported as `rootProviderTurnCompleted{failed, error}` with no provider
//!   turn id, so the canonical root turn does not stay submitted forever; queued guidance then
//!   gets `guideFailed`.
//! - A steer before the native root turn id is known (the `turn/start` response is still out) is
//!   held and sent as soon as the id arrives.
//! - Tool call status: native `inProgress` becomes `started`; other native statuses pass
//!   through; `subAgentActivity` items other than `started` (`completed`, `interrupted`,
//!   `interacted`) are progress on the parent turn (`toolCallUpdated` named `subAgentActivity`),
//!   never a child terminal. An identical repeat of a tool call status is not re-emitted.
//! - A v2 child's title is the last segment of its `agentPath`; `thread/name/updated` updates the
//!   root's or a child's title.
//! - A child native turn that starts while the child's current turn is bound to another native
//!   turn and not completed is dropped with a diagnostic (the engine allows one active turn per
//!   child). A new child turn that starts inside the cancellation boundary is interrupted.
//! - A spawn revealed by a closed (canceled) child turn is treated like a spawn inside the
//!   boundary: the new thread is interrupted and never registered.
//! - A server request without a thread (auth refresh, attestation) and a request that belongs to
//!   a canceled execution (closed child turn, root inside the boundary) are answered with a
//!   JSON-RPC error at once, so the provider never waits on a request nobody can answer.
//! - `respondInteraction` for a request that is unknown, already answered, already resolved by
//!   the provider, or whose recorded owner is not the named session/turn sends nothing (a
//!   diagnostic). An object answer is passed through as the native result; the plain answers
//!   `allow`/`accept`/`true` and `deny`/`decline`/`false` (and `cancel`, `acceptForSession`) map per
//!   method: `{"decision": ..}` for command and file approvals, the legacy review decisions for
//!   `execCommandApproval`/`applyPatchApproval`, the requested permission profile (or an empty
//!   grant) for `item/permissions/requestApproval`, an `action` for MCP elicitations, and the single
//!   question's answer for `item/tool/requestUserInput`; an answer with no native shape is sent as a
//!   JSON-RPC error.

mod protocol;
pub(crate) use protocol::answer;
pub(crate) use protocol::id_key;

use super::{child_ids, Adapter, AdapterError, AdapterOutput, AdapterTimer};
use crate::input::{NormalizedEvent, RuntimeAnswer};
use crate::model::{Id, Millis, Outcome, ProviderAliases, Target};
use crate::step::{GuideMode, ProviderRequest};
use protocol::{Incoming, Item, Note, RpcError, ServerRequest};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Default bound of a provider cancel before the adapter answers with the subset acknowledged so
/// far.
pub const DEFAULT_CANCEL_TIMEOUT_MS: Millis = 10_000;
/// At most this many unregistered foreign threads are tracked; events of further ones are only
/// counted in total.
pub const MAX_EARLY_THREADS: usize = 256;
/// At most this many early lifecycle/item events are kept per unregistered thread for replay.
pub const MAX_EARLY_EVENTS: usize = 256;
/// JSON-RPC error code of the answer to a server request this client cannot own (unknown
/// non-root thread, no thread, or a canceled execution).
pub const UNOWNED_REQUEST: i64 = -32001;
/// JSON-RPC error code of the answer to a server request whose user answer has no native shape.
pub const UNSUPPORTED_ANSWER: i64 = -32002;

/// JSON-RPC error code of the answer to a server request the engine did not accept (see
/// [`CodexAdapter`]'s `on_dropped`) when its method has no native refusal shape.
pub const DROPPED_REQUEST: i64 = -32003;

const TIMER_CANCEL: &str = "cancel:";

/// How the adapter starts the root thread.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CodexConfig {
    /// `cwd` of the root thread.
    pub cwd: Option<String>,
    /// `approvalPolicy` (`never`, `on-request`, `on-failure`, `untrusted`).
    pub approval_policy: Option<String>,
    /// `sandbox` (`read-only`, `workspace-write`, `danger-full-access`).
    pub sandbox: Option<String>,
    /// Dotted config overrides passed as `thread/start` `config`, e.g.
    /// `{"features.multi_agent": true, "agents.max_depth": 2}`.
    pub config: Map<String, Value>,
    /// How long a provider cancel may take before the adapter answers with the acknowledged
    /// subset so far (default [`DEFAULT_CANCEL_TIMEOUT_MS`]).
    pub cancel_timeout_ms: Millis,
    /// Resume this existing root thread (`thread/resume`) instead of starting a new one.
    pub resume_thread_id: Option<String>,
}

impl Default for CodexConfig {
    fn default() -> Self {
        CodexConfig {
            cwd: None,
            approval_policy: None,
            sandbox: None,
            config: Map::new(),
            cancel_timeout_ms: DEFAULT_CANCEL_TIMEOUT_MS,
            resume_thread_id: None,
        }
    }
}

/// A client request waiting for its response.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    Initialize,
    ThreadStart,
    /// `turn/start` for a canonical root turn (`guide`: a [`GuideMode::StartOnRoot`]).
    TurnStart {
        turn: Id,
        guide: bool,
    },
    Steer {
        turn: Id,
    },
    /// `turn/interrupt`; `op` when it answers a cancel target.
    Interrupt {
        op: Option<(Id, Target)>,
    },
}

/// A root `turn/start` waiting for the root thread.
#[derive(Debug, Clone, PartialEq)]
struct Queued {
    turn: Id,
    text: String,
    guide: bool,
}

/// A registered child thread.
#[derive(Debug, Clone, PartialEq)]
struct Child {
    session: Id,
    root_turn: Id,
    /// Canonical turns created so far (turn n is `child_ids(root, "thread", thread, n)`).
    turn_no: u32,
    /// The latest canonical turn.
    current: Id,
    /// Its native turn id, once `turn/started` bound it.
    current_native: Option<String>,
    /// Whether the latest turn reached `turn/completed`.
    current_done: bool,
    /// Native turn id -> canonical turn.
    natives: BTreeMap<String, Id>,
    /// A `turnWaiting` was emitted for the current turn.
    waiting: bool,
}

/// An unregistered foreign thread.
#[derive(Debug, Clone, Default, PartialEq)]
struct Early {
    count: u64,
    buffered: Vec<Note>,
    native_turn: Option<String>,
    turn_done: bool,
}

/// The execution-local cancellation boundary of a canceled root turn.
#[derive(Debug, Clone, PartialEq)]
struct Boundary {
    /// The canceled canonical root turn.
    root_turn: Id,
    /// The native root turn of the canceled execution, whose `turn/completed` is still
    /// normalized.
    canceled_native: Option<String>,
    /// Native root turns already interrupted.
    interrupted: BTreeSet<String>,
}

/// One cancel operation as the adapter runs it.
#[derive(Debug, Clone, PartialEq)]
struct CancelOp {
    targets: Vec<Target>,
    acked: Vec<Target>,
    /// Interrupts sent or deferred and not answered yet.
    outstanding: u32,
    /// Targets whose native turn id is not known yet: interrupted as soon as it is.
    deferred: Vec<Target>,
    answered: bool,
}

/// A server request the engine knows as an interaction.
#[derive(Debug, Clone, PartialEq)]
struct Pending {
    id: Value,
    method: String,
    params: Value,
    session: Id,
    turn: Id,
    answered: bool,
}

/// The Codex adapter of one root session. See the [module docs](self) for the mapping.
///
/// Cancel (`ProviderRequest::Cancel{operationId, targets}`):
/// - "The adapter interrupts only child threads named by the daemon-supplied target set; it does
///   not independently enumerate linked children." For a target set with the root, the root's
///   `turn/interrupt` is written first, then one `turn/interrupt` per supplied child target whose
///   thread is registered and whose native turn is running, all in the same output (the
///   app-server handles requests in order, so the root stops before the children).
/// - A target whose native turn id is not known yet (the root `turn/start` or the child's first
///   `turn/started` is still in flight) is interrupted as soon as the id arrives, within the same
///   operation. A target whose turn is already terminal or whose thread is unknown is a no-op
///   and is simply not acknowledged.
/// - The answer is `cancelResult` with the exact subset of targets whose `turn/interrupt` got a
///   success response: sent once every interrupt was answered, or when the adapter's own timer
///   (`cancel_timeout_ms`) fires, with the subset acknowledged so far. With nothing to interrupt
///   the answer is immediate (`acked: []`). A repeated cancel of a finished operation repeats its
///   answer.
/// - Child targets become closed projection targets: later output, lifecycle and requests of
///   exactly those child turns are dropped (requests answered with an error); a closed child
///   turn that starts late is interrupted.
/// - A root target opens the execution-local cancellation boundary (cleared by the next
///   `Start` of another canonical root turn): a later root `turn/started` is interrupted at once
///   and not adopted; a child first revealed by a spawn is interrupted and never registered;
///   root-thread output and requests are dropped (requests answered with an error); the
///   canceled execution's own `turn/completed` is still normalized.
#[derive(Debug, Clone, PartialEq)]
pub struct CodexAdapter {
    root: Id,
    config: CodexConfig,
    next_id: i64,
    calls: BTreeMap<i64, Call>,
    root_thread: Option<String>,
    queued: Vec<Queued>,
    steers: Vec<(Id, String)>,
    root_turn: Option<Id>,
    root_native: Option<String>,
    /// Native root turn -> the canonical root turn it ran for.
    root_natives: BTreeMap<String, Id>,
    root_running: bool,
    children: BTreeMap<String, Child>,
    session_threads: BTreeMap<Id, String>,
    early: BTreeMap<String, Early>,
    early_overflow: u64,
    doomed: BTreeSet<String>,
    doomed_turns: BTreeSet<String>,
    boundary: Option<Boundary>,
    closed: BTreeSet<Id>,
    cancels: BTreeMap<Id, CancelOp>,
    /// Operations that may still hold deferred targets.
    deferring: BTreeSet<Id>,
    requests: BTreeMap<String, Pending>,
    tool_status: BTreeMap<(Id, String), String>,
}

impl CodexAdapter {
    /// What Codex can do (the one place it is declared; see [`Capabilities`](crate::model::Capabilities)): it can start a
    /// root provider turn (`turn/start` on the root thread) while only children run.
    pub const CAPABILITIES: crate::model::Capabilities = crate::model::Capabilities {
        guide_while_children_only: true,
    };

    /// An adapter for the root session `root_agent_session_id`.
    pub fn new(root_agent_session_id: Id, config: CodexConfig) -> CodexAdapter {
        CodexAdapter {
            root: root_agent_session_id,
            config,
            next_id: 1,
            calls: BTreeMap::new(),
            root_thread: None,
            queued: Vec::new(),
            steers: Vec::new(),
            root_turn: None,
            root_native: None,
            root_natives: BTreeMap::new(),
            root_running: false,
            children: BTreeMap::new(),
            session_threads: BTreeMap::new(),
            early: BTreeMap::new(),
            early_overflow: 0,
            doomed: BTreeSet::new(),
            doomed_turns: BTreeSet::new(),
            boundary: None,
            closed: BTreeSet::new(),
            cancels: BTreeMap::new(),
            deferring: BTreeSet::new(),
            requests: BTreeMap::new(),
            tool_status: BTreeMap::new(),
        }
    }

    /// The root session.
    pub fn root_agent_session_id(&self) -> &Id {
        &self.root
    }

    /// The root thread (the root session's `providerSessionId`), once known.
    pub fn root_thread_id(&self) -> Option<&str> {
        self.root_thread.as_deref()
    }

    /// The canonical child session of a registered child thread.
    pub fn child_session_for_thread(&self, thread: &str) -> Option<&Id> {
        self.children.get(thread).map(|c| &c.session)
    }

    /// The native thread of a registered child session.
    pub fn thread_for_session(&self, session: &str) -> Option<&str> {
        self.session_threads.get(session).map(String::as_str)
    }

    /// How many events arrived on a thread that is not (yet) registered.
    pub fn early_event_count(&self, thread: &str) -> u64 {
        self.early.get(thread).map_or(0, |e| e.count)
    }

    /// Whether the execution-local cancellation boundary of a canceled root turn is active.
    pub fn cancellation_boundary_active(&self) -> bool {
        self.boundary.is_some()
    }

    /// Adopts an already known root thread without a `thread/start` (replaying a transcript, or a
    /// host that created the thread itself): same effect as a successful `thread/start` response.
    pub fn attach_root_thread(&mut self, now: Millis, thread: &str) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        self.adopt_root_thread(now, thread.to_string(), &mut out);
        out
    }

    fn call(&mut self, method: &str, params: Value, call: Call, out: &mut AdapterOutput) {
        let id = self.next_id;
        self.next_id += 1;
        self.calls.insert(id, call);
        out.native.push(protocol::request(id, method, params));
    }

    fn thread_params(&self) -> Value {
        let mut p = Map::new();
        if let Some(t) = &self.config.resume_thread_id {
            p.insert("threadId".into(), json!(t));
        }
        if let Some(cwd) = &self.config.cwd {
            p.insert("cwd".into(), json!(cwd));
        }
        if let Some(a) = &self.config.approval_policy {
            p.insert("approvalPolicy".into(), json!(a));
        }
        if let Some(s) = &self.config.sandbox {
            p.insert("sandbox".into(), json!(s));
        }
        if !self.config.config.is_empty() {
            p.insert("config".into(), Value::Object(self.config.config.clone()));
        }
        Value::Object(p)
    }

    /// The canonical root turn of a root-thread event: the one its native turn ran for (so late
    /// output of an earlier root turn never lands on a newer one), else the current one.
    fn root_owner(&self, native: Option<&str>) -> Option<Id> {
        native
            .and_then(|n| self.root_natives.get(n))
            .cloned()
            .or_else(|| self.root_turn.clone())
    }

    fn closed_turn(&self, turn: &Id) -> bool {
        self.closed.contains(turn)
    }

    // ---- root thread and root turns ------------------------------------------------------

    fn adopt_root_thread(&mut self, now: Millis, thread: String, out: &mut AdapterOutput) {
        if let Some(known) = &self.root_thread {
            if *known != thread {
                out.diagnostics.push(format!(
                    "root thread already {known}; ignoring thread {thread}"
                ));
            }
            return;
        }
        self.root_thread = Some(thread.clone());
        out.events.push(NormalizedEvent::SessionMetadataUpdated {
            agent_session_id: self.root.clone(),
            goal: None,
            title: None,
            provider_session_id: Some(thread.clone()),
            usage: None,
        });
        for q in std::mem::take(&mut self.queued) {
            self.send_turn_start(q.turn, &q.text, q.guide, out);
        }
        if let Some(early) = self.early.remove(&thread) {
            out.diagnostics.push(format!(
                "root thread {thread}: {} events before it was known, {} replayed",
                early.count,
                early.buffered.len()
            ));
            for note in early.buffered {
                self.root_note(now, note, out);
            }
        }
    }

    fn send_turn_start(&mut self, turn: Id, text: &str, guide: bool, out: &mut AdapterOutput) {
        let Some(thread) = self.root_thread.clone() else {
            self.queued.push(Queued {
                turn,
                text: text.to_string(),
                guide,
            });
            return;
        };
        self.call(
            "turn/start",
            json!({ "threadId": thread, "input": protocol::text_input(text) }),
            Call::TurnStart { turn, guide },
            out,
        );
    }

    fn flush_steers(&mut self, out: &mut AdapterOutput) {
        let (Some(thread), Some(expected)) = (self.root_thread.clone(), self.root_native.clone())
        else {
            return;
        };
        for (turn, text) in std::mem::take(&mut self.steers) {
            self.call(
                "turn/steer",
                json!({
                    "threadId": thread,
                    "expectedTurnId": expected,
                    "input": protocol::text_input(&text),
                }),
                Call::Steer { turn },
                out,
            );
        }
    }

    /// A native turn id is now known for the canonical root turn `turn` (its `turn/start`
    /// response).
    fn root_turn_known(&mut self, turn: Id, native: String, out: &mut AdapterOutput) {
        if let Some(b) = self.boundary.as_mut().filter(|b| b.root_turn == turn) {
            if b.canceled_native.is_none() {
                b.canceled_native = Some(native.clone());
            }
            let interrupt_now =
                b.canceled_native.as_ref() == Some(&native) && b.interrupted.insert(native.clone());
            if interrupt_now {
                let root = self.root.clone();
                let ops = self.take_deferred(|t| t.agent_session_id == root && t.turn_id == turn);
                self.interrupt_native_root(native, ops, out);
            }
            return;
        }
        self.root_natives.insert(native.clone(), turn.clone());
        if self.root_turn.as_ref() == Some(&turn) {
            self.root_native = Some(native);
            self.flush_steers(out);
        }
    }

    fn interrupt_native_root(
        &mut self,
        native: String,
        ops: Vec<(Id, Target)>,
        out: &mut AdapterOutput,
    ) {
        let Some(thread) = self.root_thread.clone() else {
            return;
        };
        self.interrupt(&thread, &native, ops, out);
    }

    /// Sends one `turn/interrupt` per operation waiting for it (at least one).
    fn interrupt(
        &mut self,
        thread: &str,
        native: &str,
        ops: Vec<(Id, Target)>,
        out: &mut AdapterOutput,
    ) {
        let params = json!({ "threadId": thread, "turnId": native });
        if ops.is_empty() {
            self.call(
                "turn/interrupt",
                params.clone(),
                Call::Interrupt { op: None },
                out,
            );
        }
        for op in ops {
            self.call(
                "turn/interrupt",
                params.clone(),
                Call::Interrupt { op: Some(op) },
                out,
            );
        }
    }

    /// Removes and returns the deferred targets matching `pred`, with their operations (only
    /// operations that still defer something are visited).
    fn take_deferred(&mut self, pred: impl Fn(&Target) -> bool) -> Vec<(Id, Target)> {
        let mut taken = Vec::new();
        let ids: Vec<Id> = self.deferring.iter().cloned().collect();
        for id in ids {
            let Some(op) = self.cancels.get_mut(&id) else {
                self.deferring.remove(&id);
                continue;
            };
            let mut keep = Vec::new();
            for t in std::mem::take(&mut op.deferred) {
                if !op.answered && pred(&t) {
                    taken.push((id.clone(), t));
                } else if !op.answered {
                    keep.push(t);
                }
            }
            op.deferred = keep;
            if op.deferred.is_empty() {
                self.deferring.remove(&id);
            }
        }
        taken
    }

    /// One interrupt (or deferral) of an operation ended, acknowledged or not.
    fn interrupt_done(&mut self, op: &Id, acked: Option<Target>, out: &mut AdapterOutput) {
        let Some(o) = self.cancels.get_mut(op) else {
            return;
        };
        if o.answered {
            return;
        }
        if let Some(t) = acked {
            if !o.acked.contains(&t) {
                o.acked.push(t);
            }
        }
        o.outstanding = o.outstanding.saturating_sub(1);
        if o.outstanding == 0 {
            Self::answer_cancel(op, o, out);
        }
    }

    fn answer_cancel(id: &Id, o: &mut CancelOp, out: &mut AdapterOutput) {
        o.answered = true;
        o.deferred.clear();
        let acked: Vec<Target> = o
            .targets
            .iter()
            .filter(|t| o.acked.contains(t))
            .cloned()
            .collect();
        out.answers.push(RuntimeAnswer::CancelResult {
            operation_id: id.clone(),
            acked,
        });
    }

    fn root_note(&mut self, _now: Millis, note: Note, out: &mut AdapterOutput) {
        match note {
            Note::TurnStarted { turn, .. } => self.root_turn_started(turn, out),
            Note::TurnCompleted {
                turn,
                outcome,
                error,
                ..
            } => self.root_turn_completed(turn, outcome, error, out),
            Note::Item {
                thread,
                turn,
                done,
                item,
            } => {
                if self.boundary.is_some() {
                    // "Output from the canceled root execution is dropped"; a child it reveals
                    // is interrupted and never registered.
                    for child in spawned_threads(&item, done) {
                        self.doom(child, out);
                    }
                    return;
                }
                let Some(turn) = self.root_owner(turn.as_deref()) else {
                    out.diagnostics.push(format!(
                        "root item on thread {thread} before any canonical root turn: dropped"
                    ));
                    return;
                };
                let root = self.root.clone();
                self.item(&root, &turn, &turn, done, item, out);
            }
            Note::Name { name, .. } => {
                if name.is_some() {
                    out.events.push(NormalizedEvent::SessionMetadataUpdated {
                        agent_session_id: self.root.clone(),
                        goal: None,
                        title: name,
                        provider_session_id: None,
                        usage: None,
                    });
                }
            }
            Note::Resolved { thread, key } => self.resolved(&thread, &key, out),
            Note::Usage { usage, .. } => {
                let root = self.root.clone();
                Self::usage(root, usage, out);
            }
            Note::ThreadStarted { .. } | Note::Status { .. } | Note::Other { .. } => {}
        }
    }

    fn root_turn_started(&mut self, turn: String, out: &mut AdapterOutput) {
        // "Root provider facts belong to the provider turn they name": a native turn whose
        // `turn/start` answered for an earlier canonical root turn is that turn's, also when its
        // `turn/started` arrives after the next canonical root turn began. It is reported under
        // its own turn (the engine does not adopt it: that turn settled) and interrupted, never
        // adopted by the newer root turn.
        if let Some(owner) = self
            .root_natives
            .get(&turn)
            .filter(|o| Some(*o) != self.root_turn.as_ref())
            .cloned()
        {
            out.events.push(NormalizedEvent::RootProviderTurnStarted {
                agent_session_id: self.root.clone(),
                turn_id: Some(owner),
                provider_turn_id: Some(turn.clone()),
            });
            out.diagnostics.push(format!(
                "root provider turn {turn} of an earlier canonical root turn started late: interrupted, not adopted"
            ));
            self.interrupt_native_root(turn, Vec::new(), out);
            return;
        }
        if let Some(b) = self.boundary.as_mut() {
            if b.interrupted.contains(&turn) {
                return;
            }
            // The canceled canonical turn's own turn/start may still be unanswered: then this
            // is the canceled execution (its terminal is normalized later).
            let canceled_turn = b.root_turn.clone();
            let own_start = b.canceled_native.is_none()
                && self
                    .calls
                    .values()
                    .any(|c| matches!(c, Call::TurnStart { turn: t, .. } if *t == canceled_turn));
            if own_start {
                b.canceled_native = Some(turn.clone());
            }
            b.interrupted.insert(turn.clone());
            let ops = if own_start {
                let root = self.root.clone();
                self.take_deferred(|t| t.agent_session_id == root && t.turn_id == canceled_turn)
            } else {
                Vec::new()
            };
            out.diagnostics.push(format!(
                "root provider turn {turn} started inside the cancellation boundary: interrupted, not adopted"
            ));
            self.interrupt_native_root(turn, ops, out);
            return;
        }
        self.root_native = Some(turn.clone());
        self.root_running = true;
        if let Some(rt) = &self.root_turn {
            self.root_natives.insert(turn.clone(), rt.clone());
        }
        match &self.root_turn {
            Some(rt) => out.events.push(NormalizedEvent::RootProviderTurnStarted {
                agent_session_id: self.root.clone(),
                turn_id: Some(rt.clone()),
                provider_turn_id: Some(turn),
            }),
            None => out.diagnostics.push(format!(
                "root provider turn {turn} started before any canonical root turn: not adopted"
            )),
        }
        self.flush_steers(out);
    }

    fn root_turn_completed(
        &mut self,
        turn: String,
        outcome: Outcome,
        error: Option<String>,
        out: &mut AdapterOutput,
    ) {
        if self.root_native.as_ref() == Some(&turn) {
            self.root_running = false;
        }
        let canonical = match &self.boundary {
            Some(b) if b.canceled_native.as_ref() == Some(&turn) => Some(b.root_turn.clone()),
            Some(_) => {
                out.diagnostics.push(format!(
                    "root provider turn {turn} completed inside the cancellation boundary: dropped"
                ));
                return;
            }
            None => self.root_owner(Some(&turn)),
        };
        match canonical {
            Some(rt) => out.events.push(NormalizedEvent::RootProviderTurnCompleted {
                agent_session_id: self.root.clone(),
                turn_id: Some(rt),
                provider_turn_id: Some(turn),
                outcome,
                error,
            }),
            None => out.diagnostics.push(format!(
                "root provider turn {turn} completed before any canonical root turn: dropped"
            )),
        }
    }

    // ---- children --------------------------------------------------------------------------

    /// The canonical turn of a child event: the turn its native id is bound to, else the
    /// child's latest turn.
    fn child_turn(c: &Child, native: Option<&str>) -> Id {
        native
            .and_then(|n| c.natives.get(n))
            .cloned()
            .unwrap_or_else(|| c.current.clone())
    }

    fn child_note(&mut self, thread: &str, note: Note, out: &mut AdapterOutput) {
        let Some(c) = self.children.get(thread) else {
            return;
        };
        let session = c.session.clone();
        match note {
            Note::TurnStarted { turn, .. } => self.child_turn_started(thread, turn, out),
            Note::TurnCompleted {
                turn,
                outcome,
                error,
                ..
            } => {
                let Some(c) = self.children.get_mut(thread) else {
                    return;
                };
                let canonical = match c.natives.get(&turn) {
                    Some(t) => t.clone(),
                    None if c.current_native.is_none() && !c.current_done => {
                        c.natives.insert(turn.clone(), c.current.clone());
                        c.current_native = Some(turn.clone());
                        c.current.clone()
                    }
                    None => {
                        out.diagnostics.push(format!(
                            "child thread {thread}: turn/completed for unknown native turn {turn}: dropped"
                        ));
                        return;
                    }
                };
                if canonical == c.current {
                    c.current_done = true;
                    c.waiting = false;
                }
                if self.closed_turn(&canonical) {
                    out.diagnostics.push(format!(
                        "child turn {canonical}: terminal after its cancellation: dropped"
                    ));
                    return;
                }
                out.events.push(NormalizedEvent::TurnTerminal {
                    agent_session_id: session,
                    turn_id: canonical,
                    outcome,
                    error,
                });
            }
            Note::Item {
                turn, done, item, ..
            } => {
                let canonical = Self::child_turn(c, turn.as_deref());
                let root_turn = c.root_turn.clone();
                if self.closed_turn(&canonical) {
                    for child in spawned_threads(&item, done) {
                        self.doom(child, out);
                    }
                    return;
                }
                self.item(&session, &canonical, &root_turn, done, item, out);
            }
            Note::Status { waiting, .. } => {
                let closed = self.closed.contains(&c.current);
                let Some(c) = self.children.get_mut(thread) else {
                    return;
                };
                let Some(native) = c.current_native.clone() else {
                    return;
                };
                if c.current_done || closed {
                    return;
                }
                match waiting {
                    Some(true) if !c.waiting => {
                        c.waiting = true;
                        out.events.push(NormalizedEvent::TurnWaiting {
                            agent_session_id: session,
                            turn_id: c.current.clone(),
                        });
                    }
                    Some(false) if c.waiting => {
                        c.waiting = false;
                        out.events.push(NormalizedEvent::TurnStarted {
                            agent_session_id: session,
                            turn_id: c.current.clone(),
                            provider_turn_id: Some(native),
                        });
                    }
                    _ => {}
                }
            }
            Note::Name { name, .. } => {
                if name.is_some() {
                    out.events.push(NormalizedEvent::ChildSessionUpdated {
                        agent_session_id: session,
                        title: name,
                        provider_session_id: None,
                        provider_aliases: None,
                    });
                }
            }
            Note::Resolved { thread, key } => self.resolved(&thread, &key, out),
            Note::Usage { usage, .. } => Self::usage(session, usage, out),
            Note::ThreadStarted { .. } | Note::Other { .. } => {}
        }
    }

    /// A thread's token use, as its session's usage (a report with no counts is dropped).
    fn usage(session: Id, usage: crate::model::TokenUsage, out: &mut AdapterOutput) {
        out.events.extend(NormalizedEvent::usage(session, usage));
    }

    fn child_turn_started(&mut self, thread: &str, turn: String, out: &mut AdapterOutput) {
        let root = self.root.clone();
        let boundary = self.boundary.is_some();
        let Some(c) = self.children.get_mut(thread) else {
            return;
        };
        if c.natives.contains_key(&turn) {
            return; // a repeat
        }
        let canonical = if c.current_native.is_none() && !c.current_done {
            c.current.clone()
        } else if c.current_done {
            if boundary {
                // A new child turn under a canceled root is canceled execution, not progress.
                out.diagnostics.push(format!(
                    "child thread {thread}: turn {turn} started inside the cancellation boundary: interrupted"
                ));
                self.interrupt(thread, &turn, Vec::new(), out);
                return;
            }
            c.turn_no += 1;
            let (_, t) = child_ids(&root, "thread", thread, c.turn_no);
            c.current = t.clone();
            c.current_done = false;
            t
        } else {
            out.diagnostics.push(format!(
                "child thread {thread}: native turn {turn} started while turn {} is active: dropped",
                c.current
            ));
            return;
        };
        c.natives.insert(turn.clone(), canonical.clone());
        c.current_native = Some(turn.clone());
        c.waiting = false;
        let session = c.session.clone();
        let ops = self.take_deferred(|t| t.agent_session_id == session && t.turn_id == canonical);
        let closed = self.closed_turn(&canonical);
        if !ops.is_empty() || closed {
            self.interrupt(thread, &turn, ops, out);
        }
        if closed {
            out.diagnostics.push(format!(
                "child turn {canonical}: started after its cancellation: interrupted"
            ));
            return;
        }
        out.events.push(NormalizedEvent::TurnStarted {
            agent_session_id: session,
            turn_id: canonical,
            provider_turn_id: Some(turn),
        });
    }

    /// A spawn edge: registers `thread` as a child of `parent`/`parent_turn` (idempotent).
    #[allow(clippy::too_many_arguments)]
    fn edge(
        &mut self,
        parent: &Id,
        parent_turn: &Id,
        root_turn: &Id,
        call: &str,
        thread: &str,
        title: Option<String>,
        out: &mut AdapterOutput,
    ) {
        if self.root_thread.as_deref() == Some(thread) {
            out.diagnostics.push(format!(
                "spawn edge names the root thread {thread}: ignored"
            ));
            return;
        }
        if self.children.contains_key(thread) || self.doomed.contains(thread) {
            return;
        }
        if self.boundary.is_some() || self.closed_turn(parent_turn) {
            self.doom(thread.to_string(), out);
            return;
        }
        let (session, turn) = child_ids(&self.root, "thread", thread, 1);
        self.children.insert(
            thread.to_string(),
            Child {
                session: session.clone(),
                root_turn: root_turn.clone(),
                turn_no: 1,
                current: turn.clone(),
                current_native: None,
                current_done: false,
                natives: BTreeMap::new(),
                waiting: false,
            },
        );
        self.session_threads
            .insert(session.clone(), thread.to_string());
        out.events.push(NormalizedEvent::ChildSessionCreated {
            agent_session_id: session,
            turn_id: turn,
            parent_agent_session_id: parent.clone(),
            parent_turn_id: parent_turn.clone(),
            parent_tool_call_id: Some(call.into()),
            root_agent_session_id: self.root.clone(),
            root_turn_id: root_turn.clone(),
            title,
            provider_session_id: Some(thread.to_string()),
            provider_aliases: Some(ProviderAliases {
                thread_id: Some(thread.to_string()),
                ..ProviderAliases::default()
            }),
        });
        if let Some(early) = self.early.remove(thread) {
            out.diagnostics.push(format!(
                "child thread {thread}: {} early events before registration, {} replayed",
                early.count,
                early.buffered.len()
            ));
            for note in early.buffered {
                self.child_note(thread, note, out);
            }
        }
    }

    /// A child first revealed inside a cancellation boundary (or by a closed child turn): it is
    /// interrupted and never registered.
    fn doom(&mut self, thread: String, out: &mut AdapterOutput) {
        if self.children.contains_key(&thread) || !self.doomed.insert(thread.clone()) {
            return;
        }
        out.diagnostics.push(format!(
            "child thread {thread} revealed after cancellation: interrupted, not registered"
        ));
        if let Some(e) = self.early.remove(&thread) {
            if let (Some(turn), false) = (e.native_turn, e.turn_done) {
                self.doomed_turns.insert(turn.clone());
                self.interrupt(&thread, &turn, Vec::new(), out);
            }
        }
    }

    fn doomed_note(&mut self, thread: &str, note: Note, out: &mut AdapterOutput) {
        if let Note::Resolved { thread, key } = &note {
            self.resolved(thread, key, out);
        } else if let Note::TurnStarted { turn, .. } = note {
            if self.doomed_turns.insert(turn.clone()) {
                self.interrupt(thread, &turn, Vec::new(), out);
            }
        }
    }

    fn early_note(&mut self, thread: String, note: Note, out: &mut AdapterOutput) {
        if let Note::Resolved { thread, key } = note {
            self.resolved(&thread, &key, out);
            return;
        }
        if !self.early.contains_key(&thread) && self.early.len() >= MAX_EARLY_THREADS {
            self.early_overflow += 1;
            out.diagnostics.push(format!(
                "event on unregistered thread {thread} not tracked ({} untracked so far)",
                self.early_overflow
            ));
            return;
        }
        let e = self.early.entry(thread).or_default();
        e.count += 1;
        match &note {
            Note::TurnStarted { turn, .. } => {
                e.native_turn = Some(turn.clone());
                e.turn_done = false;
            }
            Note::TurnCompleted { turn, .. } if e.native_turn.as_ref() == Some(turn) => {
                e.turn_done = true;
            }
            _ => {}
        }
        let replayable = matches!(
            note,
            Note::TurnStarted { .. }
                | Note::TurnCompleted { .. }
                | Note::Item { .. }
                | Note::Name { .. }
                | Note::Status { .. }
        );
        if replayable && e.buffered.len() < MAX_EARLY_EVENTS {
            e.buffered.push(note);
        }
    }

    // ---- items -----------------------------------------------------------------------------

    #[allow(clippy::too_many_arguments)]
    fn tool(
        &mut self,
        session: &Id,
        turn: &Id,
        id: &str,
        name: String,
        status: String,
        kind: &str,
        raw: Value,
        out: &mut AdapterOutput,
    ) {
        let key = (session.clone(), id.to_string());
        if self.tool_status.get(&key) == Some(&status) {
            return; // an identical repeat
        }
        self.tool_status.insert(key, status.clone());
        out.events.push(NormalizedEvent::ToolCallUpdated {
            agent_session_id: session.clone(),
            turn_id: turn.clone(),
            tool_call_id: id.into(),
            name: Some(name.into()),
            status: status.into(),
            kind: Some(Value::String(kind.to_string())),
            payload: Some(Arc::new(raw)),
        });
    }

    fn item(
        &mut self,
        session: &Id,
        turn: &Id,
        root_turn: &Id,
        done: bool,
        item: Item,
        out: &mut AdapterOutput,
    ) {
        match item {
            Item::AgentMessage { id, text } if done => {
                out.events.push(NormalizedEvent::MessageAppended {
                    agent_session_id: session.clone(),
                    turn_id: turn.clone(),
                    message_id: id.into(),
                    role: "assistant".into(),
                    text: text.into(),
                })
            }
            Item::UserMessage { id, text } if done && *session != self.root => {
                out.events.push(NormalizedEvent::MessageAppended {
                    agent_session_id: session.clone(),
                    turn_id: turn.clone(),
                    message_id: id.into(),
                    role: "user".into(),
                    text: text.into(),
                })
            }
            Item::Collab {
                id,
                tool,
                status,
                receivers,
                raw,
            } => {
                let rejected = matches!(status.as_deref(), Some("failed") | Some("interrupted"));
                let accepted = tool == "spawnAgent" && done && !receivers.is_empty() && !rejected;
                let st = if accepted {
                    "completed".to_string()
                } else {
                    protocol::tool_status(status.as_deref(), done)
                };
                self.tool(
                    session,
                    turn,
                    &id,
                    tool,
                    st,
                    "collabAgentToolCall",
                    raw,
                    out,
                );
                if accepted {
                    for r in receivers {
                        self.edge(session, turn, root_turn, &id, &r, None, out);
                    }
                }
            }
            Item::SubAgent {
                id,
                kind,
                agent_thread,
                agent_path,
                raw,
            } => {
                if kind == "started" {
                    // "A subAgentActivity started item means the provider accepted the spawn,
                    // so its normalized parent delegation call is completed."
                    self.tool(
                        session,
                        turn,
                        &id,
                        "spawnAgent".into(),
                        "completed".into(),
                        "subAgentActivity",
                        raw,
                        out,
                    );
                    let title = agent_path.as_deref().and_then(path_title);
                    self.edge(session, turn, root_turn, &id, &agent_thread, title, out);
                } else {
                    let st = protocol::tool_status(None, done);
                    self.tool(
                        session,
                        turn,
                        &id,
                        "subAgentActivity".into(),
                        st,
                        "subAgentActivity",
                        raw,
                        out,
                    );
                }
            }
            Item::Tool {
                id,
                item_type,
                name,
                status,
                raw,
            } => {
                let st = protocol::tool_status(status.as_deref(), done);
                let name = name.unwrap_or_else(|| item_type.clone());
                self.tool(session, turn, &id, name, st, &item_type, raw, out);
            }
            _ => {}
        }
    }

    // ---- server requests ---------------------------------------------------------------------

    fn server_request(&mut self, r: ServerRequest, out: &mut AdapterOutput) {
        if self.requests.get(&r.key).is_some_and(|p| !p.answered) {
            out.diagnostics
                .push(format!("server request {} repeated: ignored", r.key));
            return;
        }
        let owner: Result<(Id, Id), &str> = match r.thread.as_deref() {
            None => Err("request without a thread is not supported by this client"),
            Some(t) if self.root_thread.as_deref() == Some(t) => {
                if self.boundary.is_some() {
                    Err("the root turn was canceled")
                } else {
                    match self.root_owner(r.turn.as_deref()) {
                        Some(rt) => Ok((self.root.clone(), rt)),
                        None => Err("no root turn is active"),
                    }
                }
            }
            Some(t) => match self.children.get(t) {
                Some(c) => {
                    let turn = Self::child_turn(c, r.turn.as_deref());
                    if self.closed_turn(&turn) {
                        Err("the child turn was canceled")
                    } else {
                        Ok((c.session.clone(), turn))
                    }
                }
                None => Err("thread is not registered with this session"),
            },
        };
        match owner {
            Err(why) => {
                out.diagnostics.push(format!(
                    "server request {} ({}) on thread {}: answered with an error: {why}",
                    r.key,
                    r.method,
                    r.thread.as_deref().unwrap_or("-")
                ));
                out.native
                    .push(protocol::error(&r.id, UNOWNED_REQUEST, why));
            }
            Ok((session, turn)) => {
                out.events.push(NormalizedEvent::InteractionRequested {
                    agent_session_id: session.clone(),
                    turn_id: turn.clone(),
                    request_id: r.key.as_str().into(),
                    provider_turn_id: r.turn.clone(),
                    kind: Value::String(r.method.clone()),
                    payload: r.params.clone(),
                });
                self.requests.insert(
                    r.key,
                    Pending {
                        id: r.id,
                        method: r.method,
                        params: r.params,
                        session,
                        turn,
                        answered: false,
                    },
                );
            }
        }
    }

    fn resolved(&mut self, thread: &str, key: &str, out: &mut AdapterOutput) {
        match self.requests.remove(key) {
            Some(p) => out.events.push(NormalizedEvent::InteractionResolved {
                agent_session_id: p.session,
                turn_id: p.turn,
                request_id: key.into(),
                resolution: json!({ "threadId": thread, "requestId": p.id }),
            }),
            None => out.diagnostics.push(format!(
                "serverRequest/resolved for unknown request {key} on thread {thread}"
            )),
        }
    }

    fn respond(
        &mut self,
        session: &Id,
        turn: &Id,
        request: &Id,
        response: &Value,
        out: &mut AdapterOutput,
    ) {
        let Some(p) = self.requests.get_mut(&**request) else {
            out.diagnostics.push(format!(
                "respondInteraction for request {request}: no pending server request (resolved or unknown)"
            ));
            return;
        };
        if p.answered {
            out.diagnostics
                .push(format!("request {request} already answered"));
            return;
        }
        if p.session != *session || p.turn != *turn {
            out.diagnostics.push(format!(
                "respondInteraction for request {request} names {session}/{turn}, owned by {}/{}: not sent",
                p.session, p.turn
            ));
            return;
        }
        p.answered = true;
        match protocol::answer(&p.method, &p.params, response) {
            Ok(result) => out.native.push(protocol::result(&p.id, result)),
            Err(why) => {
                out.diagnostics.push(format!(
                    "request {request} ({}): answer has no native shape ({why}); answered with an error",
                    p.method
                ));
                out.native
                    .push(protocol::error(&p.id, UNSUPPORTED_ANSWER, &why));
            }
        }
        p.params = Value::Null;
    }

    // ---- engine requests ---------------------------------------------------------------------

    fn start(&mut self, turn: &Id, text: &str, out: &mut AdapterOutput) {
        if self.boundary.as_ref().is_some_and(|b| b.root_turn != *turn) {
            // "A later explicit canonical root turn clears it."
            self.boundary = None;
        }
        self.root_turn = Some(turn.clone());
        self.root_native = None;
        self.root_running = false;
        self.send_turn_start(turn.clone(), text, false, out);
    }

    fn guide(
        &mut self,
        turn: &Id,
        mode: GuideMode,
        provider_turn_id: Option<&String>,
        text: &str,
        out: &mut AdapterOutput,
    ) {
        match mode {
            GuideMode::Steer => {
                // expectedTurnId = the running native root turn (the adapter's own knowledge
                // first, then the engine's record); unknown yet: sent once it is known.
                let expected = self
                    .root_native
                    .clone()
                    .or_else(|| provider_turn_id.cloned());
                match (self.root_thread.clone(), expected) {
                    (Some(thread), Some(expected)) => self.call(
                        "turn/steer",
                        json!({
                            "threadId": thread,
                            "expectedTurnId": expected,
                            "input": protocol::text_input(text),
                        }),
                        Call::Steer { turn: turn.clone() },
                        out,
                    ),
                    _ => self.steers.push((turn.clone(), text.to_string())),
                }
            }
            GuideMode::StartOnRoot => self.send_turn_start(turn.clone(), text, true, out),
        }
    }

    fn cancel(&mut self, now: Millis, op_id: &Id, targets: &[Target], out: &mut AdapterOutput) {
        if let Some(o) = self.cancels.get(op_id) {
            if o.answered {
                let acked = o
                    .targets
                    .iter()
                    .filter(|t| o.acked.contains(t))
                    .cloned()
                    .collect();
                out.answers.push(RuntimeAnswer::CancelResult {
                    operation_id: op_id.clone(),
                    acked,
                });
            }
            return;
        }
        let mut op = CancelOp {
            targets: targets.to_vec(),
            acked: Vec::new(),
            outstanding: 0,
            deferred: Vec::new(),
            answered: false,
        };
        let mut sends: Vec<(String, String, Target)> = Vec::new();
        // The root first: "the adapter stops the root provider turn before waiting on
        // child-thread interrupts. This closes the source of new serial spawns first."
        if let Some(rt) = targets.iter().find(|t| t.agent_session_id == self.root) {
            let running = self
                .root_native
                .clone()
                .filter(|_| self.root_running && self.root_turn.as_ref() == Some(&rt.turn_id));
            let mut boundary = Boundary {
                root_turn: rt.turn_id.clone(),
                canceled_native: running.clone(),
                interrupted: BTreeSet::new(),
            };
            self.queued.retain(|q| q.turn != rt.turn_id);
            self.steers.retain(|(t, _)| *t != rt.turn_id);
            let start_in_flight = self
                .calls
                .values()
                .any(|c| matches!(c, Call::TurnStart { turn, .. } if *turn == rt.turn_id));
            match (running, &self.root_thread) {
                (Some(native), Some(thread)) => {
                    boundary.interrupted.insert(native.clone());
                    sends.push((thread.clone(), native, rt.clone()));
                }
                _ if start_in_flight => {
                    op.deferred.push(rt.clone());
                    op.outstanding += 1;
                }
                _ => {}
            }
            self.boundary = Some(boundary);
        }
        for t in targets.iter().filter(|t| t.agent_session_id != self.root) {
            self.closed.insert(t.turn_id.clone());
            let Some(thread) = self.session_threads.get(&t.agent_session_id).cloned() else {
                continue; // no native handle: not acknowledged
            };
            let Some(c) = self.children.get(&thread) else {
                continue;
            };
            if c.current != t.turn_id || c.current_done {
                continue; // already terminal: nothing to interrupt
            }
            match &c.current_native {
                Some(native) => sends.push((thread.clone(), native.clone(), t.clone())),
                None => {
                    op.deferred.push(t.clone());
                    op.outstanding += 1;
                }
            }
        }
        op.outstanding += sends.len() as u32;
        if !op.deferred.is_empty() {
            self.deferring.insert(op_id.clone());
        }
        self.cancels.insert(op_id.clone(), op);
        for (thread, native, target) in sends {
            self.interrupt(&thread, &native, vec![(op_id.clone(), target)], out);
        }
        if let Some(o) = self.cancels.get_mut(op_id) {
            if o.outstanding == 0 {
                Self::answer_cancel(op_id, o, out);
            } else {
                out.timers.push(AdapterTimer {
                    id: format!("{TIMER_CANCEL}{op_id}"),
                    at: now.saturating_add(self.config.cancel_timeout_ms),
                });
            }
        }
    }

    // ---- responses ---------------------------------------------------------------------------

    fn response(
        &mut self,
        now: Millis,
        id: &Value,
        answer: Result<Value, RpcError>,
        out: &mut AdapterOutput,
    ) -> Result<(), AdapterError> {
        let Some(n) = id.as_i64().filter(|n| self.calls.contains_key(n)) else {
            out.diagnostics
                .push(format!("response to unknown request id {id}: dropped"));
            return Ok(());
        };
        // Validate before changing anything.
        let needed = match (self.calls.get(&n), &answer) {
            (Some(Call::ThreadStart), Ok(r)) => Some(
                r.pointer("/thread/id")
                    .and_then(Value::as_str)
                    .ok_or(AdapterError::MissingField {
                        method: "thread/start response".into(),
                        field: "result.thread.id",
                    })?
                    .to_string(),
            ),
            (Some(Call::TurnStart { .. }), Ok(r)) => Some(
                r.pointer("/turn/id")
                    .and_then(Value::as_str)
                    .ok_or(AdapterError::MissingField {
                        method: "turn/start response".into(),
                        field: "result.turn.id",
                    })?
                    .to_string(),
            ),
            _ => None,
        };
        let Some(call) = self.calls.remove(&n) else {
            return Ok(());
        };
        match (call, answer) {
            (Call::Initialize, Ok(_)) => out.native.push(protocol::notification("initialized")),
            (Call::Initialize, Err(e)) => out
                .diagnostics
                .push(format!("initialize failed: code {}", e.code)),
            (Call::ThreadStart, Ok(_)) => {
                if let Some(thread) = needed {
                    self.adopt_root_thread(now, thread, out);
                }
            }
            (Call::ThreadStart, Err(e)) => {
                out.diagnostics
                    .push(format!("thread/start failed: code {}", e.code));
                for q in std::mem::take(&mut self.queued) {
                    self.turn_start_failed(q.turn, q.guide, &e.message, out);
                }
                for (turn, _) in std::mem::take(&mut self.steers) {
                    self.guide_failed(turn, &e.message, out);
                }
            }
            (Call::TurnStart { turn, .. }, Ok(_)) => {
                if let Some(native) = needed {
                    self.root_turn_known(turn, native, out);
                }
            }
            (Call::TurnStart { turn, guide }, Err(e)) => {
                let root = self.root.clone();
                let t2 = turn.clone();
                for (op, _) in self.take_deferred(|t| t.agent_session_id == root && t.turn_id == t2)
                {
                    self.interrupt_done(&op, None, out);
                }
                self.turn_start_failed(turn, guide, &e.message, out);
            }
            (Call::Steer { .. }, Ok(_)) => {}
            (Call::Steer { turn }, Err(e)) => self.guide_failed(turn, &e.message, out),
            (Call::Interrupt { op }, answer) => {
                if let Err(e) = &answer {
                    out.diagnostics
                        .push(format!("turn/interrupt failed: code {}", e.code));
                }
                if let Some((op, target)) = op {
                    self.interrupt_done(&op, answer.is_ok().then_some(target), out);
                }
            }
        }
        Ok(())
    }

    /// A root `turn/start` was refused. For a guidance start: `guideFailed`. For a new canonical
    /// root turn the provider turn never existed, so the adapter reports it as a failed root
    /// provider turn (otherwise that canonical root turn would stay submitted forever).
    fn turn_start_failed(&mut self, turn: Id, guide: bool, error: &str, out: &mut AdapterOutput) {
        if guide {
            self.guide_failed(turn, error, out);
        } else if self.root_turn.as_ref() == Some(&turn) {
            out.events.push(NormalizedEvent::RootProviderTurnCompleted {
                agent_session_id: self.root.clone(),
                turn_id: Some(turn),
                provider_turn_id: None,
                outcome: Outcome::Failed,
                error: Some(error.to_string()),
            });
        }
    }

    fn guide_failed(&mut self, turn: Id, error: &str, out: &mut AdapterOutput) {
        out.answers.push(RuntimeAnswer::GuideFailed {
            agent_session_id: self.root.clone(),
            turn_id: turn,
            error: error.to_string(),
        });
    }
}

/// The child threads a spawn item reveals.
fn spawned_threads(item: &Item, done: bool) -> Vec<String> {
    match item {
        Item::Collab {
            tool, receivers, ..
        } if tool == "spawnAgent" && done => receivers.clone(),
        Item::SubAgent {
            kind, agent_thread, ..
        } if kind == "started" => vec![agent_thread.clone()],
        _ => Vec::new(),
    }
}

/// The title of a v2 child from its `agentPath` (`/root/helper_one` -> `helper_one`).
fn path_title(path: &str) -> Option<String> {
    path.rsplit('/').find(|s| !s.is_empty()).map(str::to_string)
}

impl Adapter for CodexAdapter {
    /// `initialize` and `thread/start` (or `thread/resume`), pipelined: the app-server handles
    /// requests in order, so the thread request waits for the handshake; `initialized` follows
    /// the initialize response.
    fn open(&mut self, _now: Millis) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        self.call(
            "initialize",
            json!({
                "clientInfo": { "name": "tutti", "title": null, "version": env!("CARGO_PKG_VERSION") },
                "capabilities": { "experimentalApi": true },
            }),
            Call::Initialize,
            &mut out,
        );
        let method = if self.config.resume_thread_id.is_some() {
            "thread/resume"
        } else {
            "thread/start"
        };
        let params = self.thread_params();
        self.call(method, params, Call::ThreadStart, &mut out);
        out
    }

    fn on_request(&mut self, now: Millis, request: &ProviderRequest) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        if *request.root_agent_session_id() != self.root {
            out.diagnostics.push(format!(
                "request for root {} reached the adapter of {}: ignored",
                request.root_agent_session_id(),
                self.root
            ));
            return out;
        }
        match request {
            ProviderRequest::Start { turn_id, text, .. } => self.start(turn_id, text, &mut out),
            ProviderRequest::Guide {
                turn_id,
                mode,
                provider_turn_id,
                text,
                ..
            } => self.guide(turn_id, *mode, provider_turn_id.as_ref(), text, &mut out),
            ProviderRequest::Cancel {
                operation_id,
                targets,
                ..
            } => self.cancel(now, operation_id, targets, &mut out),
            ProviderRequest::RespondInteraction {
                agent_session_id,
                turn_id,
                request_id,
                response,
                ..
            } => self.respond(agent_session_id, turn_id, request_id, response, &mut out),
        }
        out
    }

    fn on_native(&mut self, now: Millis, message: &Value) -> Result<AdapterOutput, AdapterError> {
        let incoming = protocol::parse(message)?;
        let mut out = AdapterOutput::default();
        match incoming {
            Incoming::Response { id, answer } => self.response(now, &id, answer, &mut out)?,
            Incoming::Request(r) => self.server_request(r, &mut out),
            Incoming::Note(note) => {
                let Some(thread) = note.thread().map(str::to_string) else {
                    return Ok(out);
                };
                if self.root_thread.as_deref() == Some(thread.as_str()) {
                    self.root_note(now, note, &mut out);
                } else if self.children.contains_key(&thread) {
                    self.child_note(&thread, note, &mut out);
                } else if self.doomed.contains(&thread) {
                    self.doomed_note(&thread, note, &mut out);
                } else {
                    self.early_note(thread, note, &mut out);
                }
            }
        }
        Ok(out)
    }

    fn on_timer(&mut self, _now: Millis, id: &str) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        let op = id.strip_prefix(TIMER_CANCEL).map(Id::from);
        match op
            .as_ref()
            .and_then(|op| self.cancels.get_mut(op).map(|o| (op, o)))
        {
            Some((op, o)) => {
                if !o.answered {
                    out.diagnostics.push(format!(
                        "cancel {op}: timed out with {} interrupts unanswered",
                        o.outstanding
                    ));
                    Self::answer_cancel(op, o, &mut out);
                }
            }
            None => out.diagnostics.push(format!("unknown timer {id}")),
        }
        out
    }

    /// An `interactionRequested` the engine did not take (the canonical turn already settled, a
    /// closed cancellation target, a duplicate, an unknown session): codex still waits on that
    /// JSON-RPC server request, so it is refused natively at once. Approvals get `decline` (legacy
    /// ones `denied`), a permission request an empty grant, user input no answers, an MCP
    /// elicitation `decline`; a method without a refusal shape gets a JSON-RPC error
    /// ([`DROPPED_REQUEST`]). Only the exact pending request recorded for that session/turn is
    /// answered, and only once: a request that was already answered or resolved, or whose key
    /// now belongs to another owner, is left alone (a diagnostic).
    fn on_dropped(&mut self, _now: Millis, event: &NormalizedEvent) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        let NormalizedEvent::InteractionRequested {
            agent_session_id,
            turn_id,
            request_id,
            ..
        } = event
        else {
            return out;
        };
        let owned = self
            .requests
            .get(&**request_id)
            .is_some_and(|p| !p.answered && p.session == *agent_session_id && p.turn == *turn_id);
        let pending = if owned {
            self.requests.remove(&**request_id)
        } else {
            None
        };
        let Some(p) = pending else {
            out.diagnostics.push(format!(
                "dropped interaction {request_id} of {agent_session_id}/{turn_id}: no such pending server request; nothing sent"
            ));
            return out;
        };
        match protocol::decline(&p.method, &p.params) {
            Some(result) => {
                out.diagnostics.push(format!(
                    "server request {request_id} ({}): not accepted for {agent_session_id}/{turn_id}; declined",
                    p.method
                ));
                out.native.push(protocol::result(&p.id, result));
            }
            None => {
                out.diagnostics.push(format!(
                    "server request {request_id} ({}): not accepted for {agent_session_id}/{turn_id}; answered with an error",
                    p.method
                ));
                out.native.push(protocol::error(
                    &p.id,
                    DROPPED_REQUEST,
                    "the session did not accept this request (its turn is over or canceled)",
                ));
            }
        }
        out
    }
}
