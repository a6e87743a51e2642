//! The Claude Agent SDK adapter: a pure state machine between the project's Node sidecar
//! (`io-tokio/sidecar/claude/sidecar.mjs`) and the engine.
//!
//! Its native input is one sidecar stdout line (`ready`, `message` with an SDKMessage verbatim,
//! `canUseTool`, `canUseToolCancelled`, `hook`, `ack`, `exited`) and its native output is sidecar
//! stdin commands (`start`, `input`, `interrupt`, `stopTask`, `permission`). It never reads a
//! clock: the 30 s continuation wait and the bounded cancel are [`AdapterTimer`]s.
//!
//! # Mapping (spec, "Claude Code SDK Mapping")
//!
//! - **Root provider turns.** Every SDK root turn (the messages up to one `result`) is one root
//!   provider turn with an adapter-chosen provider id: `claude-N` for turns the adapter started
//!   (`ProviderRequest::Start`) or that the SDK started on its own, `synthetic-N` for the turn
//!   reserved at a task-notification boundary or opened by guidance while only children run. They
//!   are queued in SDK order; a `result` completes the oldest. "The Claude SDK root turn_completed
//!   maps to root_provider_turn_completed, never directly to canonical root turn.completed."
//!   Every root event names its canonical root turn explicitly, so output of an older provider
//!   turn can never land on a later canonical turn.
//! - **Children.** "A parent Task tool use creates a subordinate WorkspaceAgentSession and a
//!   submitted child turn, keyed initially by the parent tool-use id": the earliest `Agent` / `Task`
//!   tool-use event (a partial `content_block_start`, the assistant message, or a `PreToolUse`
//!   hook) creates the child with [`child_ids`]`(root, "task", tool_use_id, 1)`. Later events merge
//!   the description (a title update) and bind `taskId` / `agentId` aliases to that exact child.
//!   Only messages whose `parent_tool_use_id` points into a child are child events; a nested
//!   `Agent` call inside a child creates a grandchild whose direct parent is that child.
//! - **Child terminals.** A foreground Task settles from its parent tool result (or its task
//!   terminal, whichever comes first); a background one only from its task terminal
//!   (`task_notification`, or a terminal `task_updated` patch). Task-system work without subagent
//!   identity (a `run_in_background` Bash shell) is never a child: it is remembered only so that it
//!   stays stoppable ([`ClaudeAdapter::stop_native_task`]).
//! - **The notification boundary.** "When the final active async child is about to become terminal
//!   and no root provider turn is active", the adapter opens a `synthetic-N` root provider turn
//!   *before* emitting the child terminal and arms a timer ([`ClaudeConfig::continuation_timeout_ms`],
//!   30 s). The first root stream or assistant event disarms it. On expiry the adapter completes
//!   the reserved turn with a timeout stop reason, interrupts the pending continuation, and drops
//!   every later output of that continuation. "A user-initiated stop needs no model follow-up":
//!   a `stopped` / `killed` terminal opens nothing.
//! - **Every notification is answered first.** When background children finish close together,
//!   the SDK answers their task notifications with more than one follow-up turn (or an empty one
//!   and then a real one). The adapter counts the notifications it expects and the follow-ups
//!   that answer them (`origin.kind == "task-notification"`, matched by `origin.runId`; the rule
//!   and its evidence are in the `notifications` module; a notification delivered before a tool
//!   round of the running root turn is folded into that turn and answered by its `result`). A
//!   root `result` that leaves one outstanding for its canonical root turn does not complete the
//!   provider turn: the turn is *held*, the next follow-up's messages land on the same canonical
//!   root turn, and only the `result` that answers the last notification emits
//!   `rootProviderTurnCompleted`. The 30 s bound is armed while held; on expiry it ends the
//!   reservation as above, naming the outstanding notification count.
//! - **Cancel.** Every supplied target is first recorded as a closed projection boundary; a target
//!   set with the root uses the root-query `interrupt`, a child-only set one `stopTask` per child.
//!   The engine gets a `cancelResult` with exactly the acknowledged subset (an `ack` with
//!   `ok: false`, or none within [`ClaudeConfig::cancel_timeout_ms`], confirms nothing; a failed
//!   write is the driver's `cancelFailed`). Sending cancel emits no terminal fact.
//!
//! # Decisions where the spec is silent
//!
//! - A `Start` for a new canonical turn announces its root provider turn (`claude-N`) at once, and
//!   guidance with `startOnRoot` its `synthetic-N` turn (adopting the engine's reservation). If the
//!   sidecar refuses that `start` / `input`, the turn completes `failed` with the sidecar's error
//!   (a refused guidance also answers `guideFailed`).
//! - The continuation timeout completes the reserved turn with outcome `interrupted` and the error
//!   `stop_reason=timeout: ...` (the wire model carries a stop reason only as the error of a failed
//!   or interrupted outcome). The gate may then settle the canonical root from it.
//! - A held turn (see above) is held only after a successful `result` with nothing queued behind
//!   it; its timeout completes it `interrupted` like a reservation that never began (the spec's
//!   "as today"), and the outstanding notifications are forgotten, so their later follow-ups are
//!   stale output. A root cancel closes a held turn `canceled` at once, before the interrupt is
//!   acknowledged: its SDK turn already ended, so nothing is left for the interrupt to confirm
//!   (only a turn whose follow-up output already began waits for its own `result`). A
//!   follow-up that nothing reserved (it arrives after the reservation ended) is still projected
//!   on its canonical root turn, which records it only while that turn is active ("it cannot
//!   reopen the settled root"); the adapter logs it with ids and counts (`unreserved
//!   follow-up`), as it logs a dropped timed-out continuation.
//! - Output of a timed-out continuation is dropped up to its `result`. If a newer provider turn is
//!   already queued behind it and a `result` arrives that is not a task-notification continuation
//!   (`origin.kind`), the continuation never ran: its buffered output is re-attributed to the newer
//!   turn instead of being lost.
//! - An unsolicited `stopped` / `killed` task terminal (the model's own TaskStop, not our cancel)
//!   settles the child `interrupted`; `failed` settles it `failed`.
//! - A child permission request emits `turnWaiting` on the child turn; the child runs again when
//!   the answer is acknowledged, the callback is cancelled, or the SDK shows the tool's result.
//! - A permission callback that cannot be scoped to a known session (an `agentID` bound to no
//!   child), or whose owner is closed or settled, is denied at once: the SDK would otherwise wait
//!   forever, and attributing it to the root is forbidden. When the owner looked open to the
//!   adapter but the engine did not take the `interactionRequested` (for example a root callback
//!   of a timed-out continuation after the canonical root settled), [`Adapter::on_dropped`]
//!   denies that callback the same way.
//! - A `stopTask` for a child whose task id is not known yet is sent as soon as `task_started`
//!   reveals it (the cancel waits for that, bounded by [`ClaudeConfig::cancel_timeout_ms`]).
//! - An `exited` line (the SDK query ended) completes the open root provider turns (`failed` with
//!   the sidecar's error, else `interrupted`) and settles active children `interrupted`: no child
//!   can report after its query ended. The next `Start` sends `start` again.
//! - Relaunch (issue 17: "Claude Agent SDK `resume` with the recorded session id"): a `start`
//!   (the SDK query begins) carries `resume: <session id>` in its options whenever the adapter
//!   knows the root's SDK session id, from [`ClaudeConfig::resume_session_id`] (a new sidecar
//!   after an idle stop, a crash or a daemon restart) or from an earlier query of the same
//!   sidecar, unless the configured options name `resume` themselves. The root's conversation
//!   thus continues instead of starting over.
//! - Adapter-generated Goal control turns ([`ClaudeAdapter::control_turn`],
//!   [`ClaudeAdapter::set_goal`]) are queued like SDK turns but emit nothing; `active_goal` messages
//!   always become `sessionMetadataUpdated` on the root (goal `{status: active|complete, value}`).

mod native;
mod notifications;
mod requests;
mod sidecar;

pub(crate) use requests::permission_decision;
pub use sidecar::sidecar_line;

use crate::adapters::{child_ids, Adapter, AdapterError, AdapterOutput, AdapterTimer};
use crate::hash::{FxMap, FxSet};
use crate::input::NormalizedEvent;
use crate::model::{Id, Millis, Outcome, ProviderAliases, Target};
use crate::step::ProviderRequest;
use notifications::NotificationLedger;
use serde_json::{json, Map, Value};
use std::collections::VecDeque;

/// Settings of one Claude adapter.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaudeConfig {
    /// The `options` object of the sidecar's `start` command (passed to the SDK's `query()` as
    /// given: `cwd`, `env`, `model`, `permissionMode`, `settingSources`, ...).
    pub options: Value,
    /// How long a notification-reserved `synthetic-*` root provider turn waits for the first
    /// root stream or assistant event ("the sidecar waits at most 30 seconds").
    pub continuation_timeout_ms: Millis,
    /// How long a provider cancel may wait for the sidecar's acknowledgements before the adapter
    /// answers with the subset acknowledged so far.
    pub cancel_timeout_ms: Millis,
    /// The SDK session a relaunched root continues (its recorded provider session id): the
    /// first `start` passes it as the SDK's `resume` option.
    pub resume_session_id: Option<String>,
}

impl Default for ClaudeConfig {
    fn default() -> Self {
        ClaudeConfig {
            options: Value::Object(Map::new()),
            continuation_timeout_ms: 30_000,
            cancel_timeout_ms: 10_000,
            resume_session_id: None,
        }
    }
}

/// Prefix of the continuation timer ids (`claude:continuation:<providerTurnId>#<n>`).
const CONTINUATION_TIMER: &str = "claude:continuation:";
/// Prefix of the cancel timer ids (`claude:cancel:<operationId>`).
const CANCEL_TIMER: &str = "claude:cancel:";
/// How many root messages of a timed-out continuation are kept for re-attribution.
const STALE_BUFFER_MAX: usize = 512;

/// The state of the SDK query inside the sidecar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Query {
    /// No query yet (the next `Start` sends `start`).
    Idle,
    /// `start` sent, not yet acknowledged.
    Starting,
    /// The query runs; later root turns are `input`.
    Running,
    /// The query ended (`exited`, or `start` failed); the next `Start` sends `start` again.
    Ended,
}

/// Why a root provider turn exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TurnKind {
    /// Started by `ProviderRequest::Start` (`claude-N`).
    User,
    /// Opened by guidance while only children ran (`synthetic-N`).
    Guidance,
    /// Reserved at the final async child's task-notification boundary (`synthetic-N`).
    Notification,
    /// Started by the SDK on its own (`claude-N`), for example a continuation after a stop.
    Server,
    /// An adapter-generated control turn (Goal): emits nothing.
    Control,
    /// A server-initiated turn after a root cancel: interrupted instead of adopted.
    Rejected,
}

/// One SDK root turn, queued in SDK order.
#[derive(Debug, Clone, PartialEq)]
struct ProviderTurn {
    /// Provider turn id (`claude-N`, `synthetic-N`, `control-N`, `rejected-N`).
    id: String,
    /// The canonical root turn it is attached to.
    turn: Id,
    kind: TurnKind,
    /// `rootProviderTurnStarted` was emitted.
    announced: bool,
    /// The SDK emitted output for it.
    began: bool,
    /// The armed continuation timer, if any.
    timer: Option<String>,
    /// Timed out: completed already, its late output is dropped.
    stale: bool,
    /// Its SDK `result` arrived, but task notifications of its canonical root turn are still
    /// owed a follow-up: the provider lifecycle stays reserved and the next follow-up joins it.
    /// Cleared again as soon as that follow-up's output begins.
    held: bool,
    /// Root messages attributed to it (for the logs).
    messages: u32,
}

impl ProviderTurn {
    fn new(id: String, turn: Id, kind: TurnKind) -> Self {
        ProviderTurn {
            id,
            turn,
            kind,
            announced: false,
            began: false,
            timer: None,
            stale: false,
            held: false,
            messages: 0,
        }
    }

    /// A root provider turn in the spec's sense (not control traffic, not rejected, not over).
    fn is_live(&self) -> bool {
        !self.stale
            && matches!(
                self.kind,
                TurnKind::User | TurnKind::Guidance | TurnKind::Notification | TurnKind::Server
            )
    }
}

/// A delegated child (one Agent / Task tool use), keyed by its launching tool-use id.
#[derive(Debug, Clone, PartialEq)]
struct Child {
    session: Id,
    turn: Id,
    /// The root turn of the tree (the canonical turn that owns it).
    root_turn: Id,
    tool_use_id: Option<String>,
    title: Option<String>,
    task_id: Option<String>,
    agent_id: Option<String>,
    /// `Some(true)`: background/async, `Some(false)`: foreground, `None`: not known yet.
    background: Option<bool>,
    started: bool,
    run_id: Option<String>,
    /// The provider reported (or the adapter emitted) its terminal.
    terminal: bool,
    /// A closed cancellation target: nothing more is projected for it.
    closed: bool,
    waiting: bool,
    pending_permissions: u32,
    /// A `stopTask` is owed to this operation as soon as the task id is known.
    stop_pending: Option<(Id, String)>,
}

impl Child {
    fn active(&self) -> bool {
        !self.terminal && !self.closed
    }
}

/// A tool call the adapter has seen.
#[derive(Debug, Clone, PartialEq)]
struct Tool {
    session: Id,
    turn: Id,
    name: String,
    status: String,
    payload: Map<String, Value>,
    /// A delegation (Agent / Task) tool: its child is keyed by this tool-use id.
    delegation: bool,
    /// A `run_in_background` launch of task-system work (not a child).
    background_launch: bool,
}

/// Task-system work without subagent identity (a background Bash shell), kept for stop routing.
#[derive(Debug, Clone, PartialEq)]
struct SystemTask {
    tool_use_id: Option<String>,
    terminal: bool,
}

/// A pending SDK permission callback.
#[derive(Debug, Clone, PartialEq)]
struct Permission {
    session: Id,
    turn: Id,
    child: Option<String>,
    tool_use_id: Option<String>,
}

/// A provider cancel waiting for acknowledgements.
#[derive(Debug, Clone, PartialEq)]
struct PendingCancel {
    includes_root: bool,
    waiting: FxSet<String>,
    acked: Vec<Target>,
    error: Option<String>,
}

/// What a command id written to the sidecar was for (matched against its `ack`).
#[derive(Debug, Clone, PartialEq)]
enum NativeOp {
    /// `start` for this provider turn.
    Start(String),
    /// `input` for a root turn (`entry`) and/or guidance (`guide`: root session, turn).
    Input {
        entry: Option<String>,
        guide: Option<(Id, Id)>,
    },
    /// Part of a cancel operation; an `ok` ack confirms `covered`.
    Cancel { op: Id, covered: Vec<Target> },
    /// The answer to a permission callback.
    Permission(String),
    /// The interrupt after a continuation timeout, a stop of a rejected launch, ...
    Other,
}

/// Which kind of root output a message is (for the provider-turn gateway).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RootKind {
    Init,
    Stream,
    Assistant,
    User,
    Result,
}

/// Where a tool use was observed.
#[derive(Debug, Clone, PartialEq)]
struct Owner {
    session: Id,
    turn: Id,
    root_turn: Id,
    /// The child key when the owner is a child.
    child: Option<String>,
}

/// The Claude adapter of one root session. See the module docs for the mapping.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaudeAdapter {
    root: Id,
    config: ClaudeConfig,
    query: Query,
    /// The latest canonical root turn (from `Start`).
    canonical_turn: Option<Id>,
    /// SDK root turns in SDK order; the front is the one the SDK is executing.
    turns: VecDeque<ProviderTurn>,
    /// Root messages seen while a timed-out continuation is at the front and newer turns wait.
    stale_buffer: Vec<(RootKind, Value)>,
    /// The provider turn id of the last announced live root provider turn.
    last_provider_turn: Option<String>,
    seq: u64,
    /// Counters of the provider turn ids `claude-N` and `synthetic-N`.
    claude_seq: u64,
    synthetic_seq: u64,
    provider_session_id: Option<String>,

    children: FxMap<String, Child>,
    child_order: Vec<String>,
    by_session: FxMap<Id, String>,
    by_task: FxMap<String, String>,
    by_agent: FxMap<String, String>,
    /// Active (not terminal, not closed) delegated children: the final-child gate's count.
    active_children: usize,
    tools: FxMap<String, Tool>,
    /// Background launches whose tool call is still open, in order.
    open_launches: Vec<String>,
    system_tasks: FxMap<String, SystemTask>,
    /// Delegations revealed after their owner was closed: never created; their tasks are stopped.
    rejected_launches: FxSet<String>,
    /// Canonical root turns closed by a root cancel (the execution-local cancellation boundary).
    canceled_roots: FxSet<Id>,

    permissions: FxMap<String, Permission>,
    cancels: FxMap<Id, PendingCancel>,
    native_ops: FxMap<String, NativeOp>,
    /// Task notifications still owed an SDK follow-up (see [`notifications`]).
    notifications: NotificationLedger,
}

impl ClaudeAdapter {
    /// What the Claude SDK can do (the one place it is declared; see [`Capabilities`](crate::model::Capabilities)):
    /// "guidance always targets the root session": while only children run, the adapter opens
    /// a `synthetic-*` root provider turn and streams the guidance in.
    pub const CAPABILITIES: crate::model::Capabilities = crate::model::Capabilities {
        guide_while_children_only: true,
    };

    /// An adapter for one root session.
    pub fn new(root_agent_session_id: Id, config: ClaudeConfig) -> Self {
        let provider_session_id = config.resume_session_id.clone();
        ClaudeAdapter {
            root: root_agent_session_id,
            config,
            query: Query::Idle,
            canonical_turn: None,
            turns: VecDeque::new(),
            stale_buffer: Vec::new(),
            last_provider_turn: None,
            seq: 0,
            claude_seq: 0,
            synthetic_seq: 0,
            provider_session_id,
            children: FxMap::default(),
            child_order: Vec::new(),
            by_session: FxMap::default(),
            by_task: FxMap::default(),
            by_agent: FxMap::default(),
            active_children: 0,
            tools: FxMap::default(),
            open_launches: Vec::new(),
            system_tasks: FxMap::default(),
            rejected_launches: FxSet::default(),
            canceled_roots: FxSet::default(),
            permissions: FxMap::default(),
            cancels: FxMap::default(),
            native_ops: FxMap::default(),
            notifications: NotificationLedger::default(),
        }
    }

    /// The root session this adapter serves.
    pub fn root_agent_session_id(&self) -> &Id {
        &self.root
    }

    /// The configuration.
    pub fn config(&self) -> &ClaudeConfig {
        &self.config
    }

    /// Number of active delegated children (the final-child continuation gate's count).
    /// Task-system work such as a background Bash shell never counts.
    pub fn active_child_count(&self) -> usize {
        self.active_children
    }

    /// Task notifications the SDK still owes a follow-up root turn for (every canonical root
    /// turn); while one is outstanding for a turn, its root provider lifecycle stays reserved.
    pub fn outstanding_notifications(&self) -> usize {
        self.notifications.total()
    }

    /// The provider turn id of the running root provider turn, if one is live.
    pub fn live_provider_turn(&self) -> Option<&str> {
        self.turns
            .iter()
            .find(|t| t.is_live())
            .map(|t| t.id.as_str())
    }

    /// Sends an adapter-generated control command (for example a `/goal` command) as its own SDK
    /// turn. "An adapter-generated Claude Goal command turn is internal control traffic, not a root
    /// provider turn": its start, acknowledgement output and terminal emit nothing; `active_goal`
    /// updates still flow as session metadata. Needs a running query.
    pub fn control_turn(&mut self, _now: Millis, text: &str) -> AdapterOutput {
        let mut out = AdapterOutput::default();
        if !matches!(self.query, Query::Starting | Query::Running) {
            out.diagnostics
                .push("claude: control turn dropped: no running query".into());
            return out;
        }
        let turn = self
            .canonical_turn
            .clone()
            .unwrap_or_else(|| Id::from("control"));
        let id = format!("control-{}", self.bump());
        self.turns
            .push_back(ProviderTurn::new(id.clone(), turn, TurnKind::Control));
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
        out
    }

    /// Sets a Claude Goal through a control turn (`/goal <condition>`); see
    /// [`ClaudeAdapter::control_turn`].
    pub fn set_goal(&mut self, now: Millis, condition: &str) -> AdapterOutput {
        self.control_turn(now, &format!("/goal {condition}"))
    }

    /// Stops task-system work by its task id or launching tool-use id (for example a detached
    /// background Bash shell, which "remains independently stoppable" but is not a child). Returns
    /// `None` when no such task is known or it already ended.
    pub fn stop_native_task(&mut self, _now: Millis, id: &str) -> Option<AdapterOutput> {
        let task_id = if self.system_tasks.contains_key(id) {
            id.to_string()
        } else {
            self.system_tasks
                .iter()
                .find(|(_, t)| t.tool_use_id.as_deref() == Some(id))
                .map(|(k, _)| k.clone())?
        };
        if self.system_tasks.get(&task_id).is_some_and(|t| t.terminal) {
            return None;
        }
        let mut out = AdapterOutput::default();
        let cmd = self.command_id("stop");
        self.native_ops.insert(cmd.clone(), NativeOp::Other);
        out.native
            .push(json!({"op": "stopTask", "id": cmd, "taskId": task_id}));
        Some(out)
    }

    // ----- small helpers -------------------------------------------------------------------

    fn bump(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// A new provider turn id: `claude-N` (`synthetic == false`) or `synthetic-N`.
    fn provider_turn_id(&mut self, synthetic: bool) -> String {
        if synthetic {
            self.synthetic_seq += 1;
            format!("synthetic-{}", self.synthetic_seq)
        } else {
            self.claude_seq += 1;
            format!("claude-{}", self.claude_seq)
        }
    }

    fn command_id(&mut self, what: &str) -> String {
        format!("tutti:{what}:{}", self.bump())
    }

    /// The canonical root turn and provider turn id that own a root-scoped callback right now.
    fn current_root_owner(&self) -> Option<(Id, Option<String>)> {
        if let Some(t) = self.turns.iter().find(|t| t.is_live()) {
            return Some((t.turn.clone(), Some(t.id.clone())));
        }
        self.canonical_turn
            .clone()
            .map(|t| (t, self.last_provider_turn.clone()))
    }

    fn announce(&mut self, index: usize, out: &mut AdapterOutput) {
        let Some(t) = self.turns.get_mut(index) else {
            return;
        };
        if t.announced {
            return;
        }
        t.announced = true;
        let (turn, id) = (t.turn.clone(), t.id.clone());
        self.last_provider_turn = Some(id.clone());
        out.events.push(NormalizedEvent::RootProviderTurnStarted {
            agent_session_id: self.root.clone(),
            turn_id: Some(turn),
            provider_turn_id: Some(id),
        });
    }

    fn completed(
        &self,
        turn: &Id,
        provider_turn_id: &str,
        outcome: Outcome,
        error: Option<String>,
    ) -> NormalizedEvent {
        NormalizedEvent::RootProviderTurnCompleted {
            agent_session_id: self.root.clone(),
            turn_id: Some(turn.clone()),
            provider_turn_id: Some(provider_turn_id.to_string()),
            outcome,
            error,
        }
    }

    /// Marks a child inactive (terminal or closed) and keeps the gate count.
    fn deactivate(&mut self, key: &str, closed: bool) {
        let Some(c) = self.children.get_mut(key) else {
            return;
        };
        let was_active = c.active();
        if closed {
            c.closed = true;
        } else {
            c.terminal = true;
        }
        if was_active && !c.active() {
            self.active_children = self.active_children.saturating_sub(1);
        }
    }

    fn child_by_alias(&self, id: &str) -> Option<String> {
        self.by_agent
            .get(id)
            .or_else(|| self.by_task.get(id))
            .cloned()
    }

    /// Creates a child (session and submitted initial turn, atomically) keyed by `key`.
    #[allow(clippy::too_many_arguments)]
    fn create_child(
        &mut self,
        key: &str,
        owner: &Owner,
        tool_use_id: Option<&str>,
        title: Option<String>,
        background: Option<bool>,
        task_id: Option<&str>,
        out: &mut AdapterOutput,
    ) {
        let (session, turn) = child_ids(&self.root, "task", key, 1);
        let aliases = ProviderAliases {
            task_id: task_id.map(str::to_string),
            parent_tool_use_id: tool_use_id.map(str::to_string),
            ..ProviderAliases::default()
        };
        out.events.push(NormalizedEvent::ChildSessionCreated {
            agent_session_id: session.clone(),
            turn_id: turn.clone(),
            parent_agent_session_id: owner.session.clone(),
            parent_turn_id: owner.turn.clone(),
            parent_tool_call_id: tool_use_id.map(Id::from),
            root_agent_session_id: self.root.clone(),
            root_turn_id: owner.root_turn.clone(),
            title: title.clone(),
            provider_session_id: None,
            provider_aliases: Some(aliases),
        });
        self.children.insert(
            key.to_string(),
            Child {
                session: session.clone(),
                turn,
                root_turn: owner.root_turn.clone(),
                tool_use_id: tool_use_id.map(str::to_string),
                title,
                task_id: task_id.map(str::to_string),
                agent_id: None,
                background,
                started: false,
                run_id: None,
                terminal: false,
                closed: false,
                waiting: false,
                pending_permissions: 0,
                stop_pending: None,
            },
        );
        if let Some(t) = task_id {
            self.by_task.insert(t.to_string(), key.to_string());
        }
        self.child_order.push(key.to_string());
        self.by_session.insert(session, key.to_string());
        self.active_children += 1;
    }

    /// Emits `turnStarted` for a child that has not started yet (or whose run id is new).
    fn child_running(&mut self, key: &str, run_id: Option<&str>, out: &mut AdapterOutput) {
        let Some(c) = self.children.get_mut(key) else {
            return;
        };
        if !c.active() {
            return;
        }
        let new_run = run_id.is_some() && c.run_id.as_deref() != run_id;
        let resume = c.waiting && c.pending_permissions == 0;
        if c.started && !new_run && !resume {
            return;
        }
        c.started = true;
        c.waiting = false;
        if new_run {
            c.run_id = run_id.map(str::to_string);
        }
        out.events.push(NormalizedEvent::TurnStarted {
            agent_session_id: c.session.clone(),
            turn_id: c.turn.clone(),
            provider_turn_id: c.run_id.clone(),
        });
    }

    /// Merges a more specific description (title), aliases and mode into an existing child.
    fn merge_child(
        &mut self,
        key: &str,
        title: Option<&str>,
        task_id: Option<&str>,
        agent_id: Option<&str>,
        out: &mut AdapterOutput,
    ) {
        let Some(c) = self.children.get_mut(key) else {
            return;
        };
        let mut aliases = ProviderAliases::default();
        let mut changed = false;
        let mut new_title = None;
        if let Some(t) = title.filter(|t| !t.trim().is_empty()) {
            if c.title.as_deref() != Some(t) {
                c.title = Some(t.to_string());
                new_title = Some(t.to_string());
                changed = true;
            }
        }
        let mut bind_task = None;
        if let Some(t) = task_id {
            if c.task_id.is_none() {
                c.task_id = Some(t.to_string());
                aliases.task_id = Some(t.to_string());
                bind_task = Some(t.to_string());
                changed = true;
            } else if c.task_id.as_deref() != Some(t) {
                out.diagnostics.push(format!(
                    "claude: child {} already has another task id; alias not rebound",
                    c.session
                ));
            }
        }
        let mut bind_agent = None;
        if let Some(a) = agent_id {
            if c.agent_id.is_none() {
                c.agent_id = Some(a.to_string());
                aliases.agent_id = Some(a.to_string());
                bind_agent = Some(a.to_string());
                changed = true;
            } else if c.agent_id.as_deref() != Some(a) {
                out.diagnostics.push(format!(
                    "claude: child {} already has another agent id; alias not rebound",
                    c.session
                ));
            }
        }
        let session = c.session.clone();
        let closed = c.closed;
        if let Some(t) = bind_task {
            self.by_task.insert(t, key.to_string());
        }
        if let Some(a) = bind_agent {
            self.by_agent.insert(a, key.to_string());
        }
        if changed && !closed {
            let has_alias = aliases != ProviderAliases::default();
            out.events.push(NormalizedEvent::ChildSessionUpdated {
                agent_session_id: session,
                title: new_title,
                provider_session_id: None,
                provider_aliases: has_alias.then_some(aliases),
            });
        }
    }

    /// A child's terminal fact. Idempotent; nothing for a closed child ("cancellation fallout").
    /// For the final active async child with no live root provider turn, a `synthetic-*` root
    /// provider turn is opened *before* the child terminal is emitted.
    fn child_terminal(
        &mut self,
        now: Millis,
        key: &str,
        outcome: Outcome,
        error: Option<String>,
        stopped: bool,
        out: &mut AdapterOutput,
    ) {
        let Some(c) = self.children.get(key) else {
            return;
        };
        if c.terminal {
            return;
        }
        if c.closed {
            out.diagnostics.push(format!(
                "claude: dropped the terminal of closed child {} (cancellation fallout)",
                c.session
            ));
            self.deactivate(key, false);
            self.stop_no_longer_owed(key, out);
            return;
        }
        let (session, turn, root_turn) = (c.session.clone(), c.turn.clone(), c.root_turn.clone());
        let asynchronous = c.background != Some(false);
        self.deactivate(key, false);
        let final_child = self.active_children == 0;
        if asynchronous
            && final_child
            && !stopped
            && !self.turns.iter().any(ProviderTurn::is_live)
            && !self.canceled_roots.contains(&root_turn)
            && self.query != Query::Ended
        {
            self.open_notification_turn(now, &root_turn, out);
        }
        out.events.push(NormalizedEvent::TurnTerminal {
            agent_session_id: session,
            turn_id: turn,
            outcome,
            error: if outcome.allows_error() { error } else { None },
        });
    }

    /// Reserves the root provider lifecycle at the task-notification boundary.
    fn open_notification_turn(&mut self, now: Millis, root_turn: &Id, out: &mut AdapterOutput) {
        let id = self.provider_turn_id(true);
        let t = ProviderTurn::new(id, root_turn.clone(), TurnKind::Notification);
        self.turns.push_back(t);
        self.announce(self.turns.len() - 1, out);
        self.arm_continuation(now, self.turns.len() - 1, out);
    }

    /// Arms the 30 s continuation bound of a queued provider turn ("the sidecar waits at most 30
    /// seconds for the first root stream or assistant event"). Each arming has its own timer id
    /// (`claude:continuation:<providerTurnId>#<n>`), so an older, disarmed timer of the same turn
    /// can never end a later wait.
    fn arm_continuation(&mut self, now: Millis, index: usize, out: &mut AdapterOutput) {
        let n = self.bump();
        let Some(t) = self.turns.get_mut(index) else {
            return;
        };
        let timer = format!("{CONTINUATION_TIMER}{}#{n}", t.id);
        t.timer = Some(timer.clone());
        out.timers.push(AdapterTimer {
            id: timer,
            at: now.saturating_add(self.config.continuation_timeout_ms),
        });
    }

    /// Counts the task notification a delegated background child's terminal makes the SDK
    /// deliver (see [`notifications`]): not for a foreground child (its result returns inline),
    /// not for a user-initiated stop ("needs no model follow-up"), not for a closed cancellation
    /// target or a canceled root, and not once the query ended.
    /// `run_id` is the terminal message's own run id (else the one `task_started` gave).
    fn expect_notification(&mut self, key: &str, run_id: Option<&str>, stopped: bool) {
        let Some(c) = self.children.get(key) else {
            return;
        };
        if stopped
            || c.closed
            || c.background == Some(false)
            || self.canceled_roots.contains(&c.root_turn)
            || !matches!(self.query, Query::Starting | Query::Running)
        {
            return;
        }
        let run_id = run_id.map(str::to_string).or_else(|| c.run_id.clone());
        let root_turn = c.root_turn.clone();
        // The root provider turn whose model call is in flight right now, if any.
        let during = self
            .turns
            .front()
            .filter(|t| t.is_live() && t.began && !t.held)
            .map(|t| t.id.clone());
        self.notifications
            .expect(key, run_id.as_deref(), &root_turn, during.as_deref());
    }

    /// A closed child whose `stopTask` was still owed ended: that target stays unconfirmed.
    fn stop_no_longer_owed(&mut self, key: &str, out: &mut AdapterOutput) {
        let Some((op, cmd)) = self
            .children
            .get_mut(key)
            .and_then(|c| c.stop_pending.take())
        else {
            return;
        };
        if let Some(p) = self.cancels.get_mut(&op) {
            p.waiting.remove(&cmd);
        }
        self.maybe_answer_cancel(&op, out);
    }

    /// Answers a cancel operation once nothing is awaited any more.
    fn maybe_answer_cancel(&mut self, op: &Id, out: &mut AdapterOutput) {
        let done = self.cancels.get(op).is_some_and(|p| p.waiting.is_empty());
        if done {
            self.answer_cancel(op, out);
        }
    }

    fn answer_cancel(&mut self, op: &Id, out: &mut AdapterOutput) {
        let Some(p) = self.cancels.remove(op) else {
            return;
        };
        for cmd in &p.waiting {
            self.native_ops.remove(cmd);
        }
        // "The adapter returns the exact subset of supplied targets whose native cancel operation
        // was acknowledged": a refused (`ok: false`) or unanswered command confirms nothing.
        if let Some(e) = &p.error {
            out.diagnostics.push(format!(
                "claude: cancel {op}: {} target(s) confirmed; {e}",
                p.acked.len()
            ));
        }
        let answer = crate::input::RuntimeAnswer::CancelResult {
            operation_id: op.clone(),
            acked: p.acked,
        };
        out.answers.push(answer);
    }
}

impl Adapter for ClaudeAdapter {
    /// The sidecar needs no handshake (it announces itself with `ready`); the query starts with
    /// the first root turn.
    fn open(&mut self, _now: Millis) -> AdapterOutput {
        AdapterOutput::default()
    }

    fn on_request(&mut self, now: Millis, request: &ProviderRequest) -> AdapterOutput {
        self.request(now, request)
    }

    fn on_native(&mut self, now: Millis, message: &Value) -> Result<AdapterOutput, AdapterError> {
        self.native(now, message)
    }

    fn on_timer(&mut self, now: Millis, id: &str) -> AdapterOutput {
        self.timer(now, id)
    }

    /// The engine did not take an `interactionRequested` this adapter emitted (its owner turn
    /// settled, for example a root permission callback that arrives after the canonical root turn
    /// settled, or it is a closed cancellation target): nobody can answer that SDK `canUseTool`
    /// callback any more, so it is denied at once ("the SDK would otherwise wait forever").
    /// Only a callback the adapter still holds for exactly that session/turn is denied; anything
    /// else (an answered, cancelled or unknown request, another event kind) changes nothing.
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
        let held = self
            .permissions
            .get(request_id.as_ref())
            .is_some_and(|p| p.session == *agent_session_id && p.turn == *turn_id);
        if !held {
            return out;
        }
        let Some(p) = self.permissions.remove(request_id.as_ref()) else {
            return out;
        };
        if let Some(c) = p.child.as_ref().and_then(|k| self.children.get_mut(k)) {
            // The child runs again as soon as the SDK shows the (denied) tool's result.
            c.pending_permissions = c.pending_permissions.saturating_sub(1);
        }
        out.diagnostics.push(format!(
            "claude: the engine did not take permission request {request_id}; denied"
        ));
        self.auto_deny(
            request_id,
            "tutti: the turn no longer accepts interactions",
            &mut out,
        );
        out
    }
}

/// A string field.
fn s<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// The outcome of an SDK `result` (root or child).
fn result_outcome(m: &Value) -> (Outcome, Option<String>) {
    let sub = s(m, "subtype").unwrap_or("");
    let is_error = m
        .get("is_error")
        .and_then(Value::as_bool)
        .unwrap_or(sub != "success");
    if let Some(r) = s(m, "terminal_reason").filter(|r| r.starts_with("aborted")) {
        return (Outcome::Interrupted, Some(format!("interrupted ({r})")));
    }
    if sub == "success" && !is_error {
        return (Outcome::Completed, None);
    }
    let errors: Vec<&str> = m
        .get("errors")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let error = if errors.is_empty() {
        format!(
            "claude result {}",
            if sub.is_empty() { "error" } else { sub }
        )
    } else {
        format!("{sub}: {}", errors.join("; "))
    };
    (Outcome::Failed, Some(error))
}
