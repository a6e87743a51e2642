//! `tutti-demo-agent`: a real ACP (Agent Client Protocol, v1) agent over stdio that works
//! through a prompt by delegating to provider-native subagents, exposed as child sessions.
//!
//! It is built with the `agent-client-protocol` crate (5.2) and its subagent types, and speaks
//! the standard ACP v1 subagent sessions (stabilized 2026-11-20: `subagent_update` with v1
//! `state` snapshots, `session` tool-call content), the shapes the daemon's ACP adapter maps
//! (`tutti_core::adapters::acp::subagents`). It uses no extension of its own.
//!
//! # Capability negotiation
//!
//! There is no agent capability for subagents: `initialize` answers
//!
//! ```json
//! {"protocolVersion":1,
//!  "agentCapabilities":{"loadSession":true, "...":"..."},
//!  "authMethods":[],
//!  "agentInfo":{"name":"tutti-demo-agent","version":"0.1.0"}}
//! ```
//!
//! Child sessions are exposed only when the client opted in with the v1 client capability
//! `{"clientCapabilities":{"subagents":{}}}`. Without it the
//! agent still delegates internally but stays root-only: no `subagent_update`, no child-scoped
//! traffic, no session references in tool calls, no child permission requests (the work is
//! treated as allowed), and the prompt waits for every subagent, including the ones that
//! would otherwise run in the background, before it answers.
//!
//! # Wire shapes (client opted in)
//!
//! All child facts are `session/update` notifications. The outer `params.sessionId` is the
//! session whose stream carries the update; for `subagent_update` that is the child's
//! **immediate parent** (the root session, or another child for a nested subagent).
//!
//! 1. The parent's delegation tool call comes first, on the parent stream (an ordinary
//!    `tool_call`; `kind` is `other`, which the wire omits as the default):
//!
//!    ```json
//!    {"sessionId":"demo-session-1","update":{"sessionUpdate":"tool_call",
//!      "toolCallId":"demo-session-1-t1-delegate-1","title":"Delegate to explorer",
//!      "status":"in_progress","rawInput":{"agent":"explorer","background":false}}}
//!    ```
//!
//! 2. **Spawned**: the announcing `subagent_update` (the first one for an unknown child id),
//!    sent before any traffic bearing the child id and before the parent prompt answers.
//!    `update.sessionId` is the stable child session id (unique on the connection, never
//!    reused):
//!
//!    ```json
//!    {"sessionId":"demo-session-1","update":{"sessionUpdate":"subagent_update",
//!      "sessionId":"demo-session-1-t1-child-1","title":"explorer",
//!      "description":"subtask 1 of 3","capabilities":{"cancel":{}}}}
//!    ```
//!
//!    Right after it the parent's tool call gains the standard session reference, which is
//!    what links the child to the tool call that delegated it:
//!
//!    ```json
//!    {"sessionId":"demo-session-1","update":{"sessionUpdate":"tool_call_update",
//!      "toolCallId":"demo-session-1-t1-delegate-1",
//!      "content":[{"type":"session","sessionId":"demo-session-1-t1-child-1"}]}}
//!    ```
//!
//!    For a background child (`"background":true`) the delegation tool call completes at
//!    once (the spawn was accepted: `"status":"completed","rawOutput":{"launched":true}`);
//!    the child keeps running after the prompt answered `end_turn`; its later messages are
//!    on its own stream and its terminal `subagent_update` arrives on the root stream after
//!    the prompt answer. That update names an announced child, so it is child-scoped, not
//!    late root-turn traffic. (The latest RFD revision allows child events after the
//!    parent's prompt response; earlier drafts kept children inside the turn.) For a foreground child the delegation tool call completes
//!    (`completed`, or `failed` with `rawOutput: {"outcome":"failed"|"cancelled"}`) after
//!    the child's terminal update.
//!
//! 3. **State** snapshots, on the parent stream (v1 `state` object, replaced wholesale):
//!
//!    | tutti fact | `update.state` |
//!    |---|---|
//!    | running   | `{"state":"running"}` |
//!    | waiting (permission pending) | `{"state":"requires_action"}` |
//!    | completed | `{"state":"idle","stopReason":"end_turn"}` |
//!    | failed    | `{"state":"idle","stopReason":"error","error":{"code":-32603,"message":"TEXT"}}` |
//!    | cancelled | `{"state":"idle","stopReason":"cancelled"}` |
//!
//!    ```json
//!    {"sessionId":"demo-session-1","update":{"sessionUpdate":"subagent_update",
//!      "sessionId":"demo-session-1-t1-child-2",
//!      "state":{"state":"idle","stopReason":"error",
//!               "error":{"code":-32603,"message":"subagent failed: simulated failure in subtask 2"}}}}
//!    ```
//!
//!    Every exposed child gets exactly one `idle` snapshot and nothing child-scoped after it
//!    (this agent never reuses a child). On cancellation, descendants report `cancelled`
//!    before their parents, and all of them before the cancelled prompt answers.
//!
//! 4. **Child messages and tool calls** are ordinary updates whose outer `sessionId` is the
//!    child id:
//!
//!    ```json
//!    {"sessionId":"demo-session-1-t1-child-1","update":{"sessionUpdate":"agent_message_chunk",
//!      "content":{"type":"text","text":"explorer: starting on subtask 1."}}}
//!    ```
//!
//!    After its search a child reports its token use on its own stream (`usage_update`, a
//!    made-up deterministic count of a 200k context and a cost), so its lane shows it:
//!
//!    ```json
//!    {"sessionId":"demo-session-1-t1-child-1","update":{"sessionUpdate":"usage_update",
//!      "used":1100,"size":200000,"cost":{"amount":0.0011,"currency":"USD"}}}
//!    ```
//!
//! 5. **Child permission requests** use the child's session id as `sessionId` (no extra
//!    `_meta`); the tool call id belongs to the child's stream, where a `tool_call` for it
//!    (status `pending`, omitted on the wire) was sent first. While the request is pending
//!    the child's state is `requires_action`. The SDK picks string request ids (UUIDs):
//!
//!    ```json
//!    {"jsonrpc":"2.0","id":"d4e6721c-...","method":"session/request_permission","params":{
//!      "sessionId":"demo-session-1-t1-child-1",
//!      "toolCall":{"toolCallId":"demo-session-1-t1-child-1-edit","title":"Edit src/lib.rs",
//!                  "kind":"edit","status":"pending"},
//!      "options":[{"optionId":"allow","name":"Allow","kind":"allow_once"},
//!                 {"optionId":"reject","name":"Reject","kind":"reject_once"}]}}
//!    ```
//!
//!    `allow` lets the child go on; `reject` fails it ("permission rejected by the user");
//!    the `cancelled` outcome cancels it. When the child is cancelled while the request is
//!    pending, the agent abandons the request (the SDK sends `$/cancel_request` for it) before
//!    the child's `cancelled` snapshot; the client should still answer it with the
//!    `cancelled` outcome, and the agent ignores that answer.
//!
//! 6. **Nested** children are announced on their parent child's stream (outer `sessionId` =
//!    the child), and linked by a session reference on a tool call of that child's stream.
//!
//! # Cancellation
//!
//! * `session/cancel` with the root session id cancels every live subagent of that session
//!   (including background ones that outlived their prompt), each reports
//!   `idle`/`cancelled`, and then the pending prompt (if any) answers
//!   `{"stopReason":"cancelled"}`.
//! * `session/cancel` with a child session id (advertised per child by
//!   `"capabilities":{"cancel":{}}`) cancels that child and its descendants only.
//!
//! # Directives
//!
//! The behaviour is deterministic given the prompt text. Whitespace-separated
//! `key=value` tokens (surrounding punctuation ignored, keys case-insensitive) script it:
//!
//! | directive | meaning | default |
//! |---|---|---|
//! | `children=N` | number of top-level subagents (0..=8) | `3` |
//! | `permission=LIST` | these children ask for a permission | `1` |
//! | `fail=LIST` | these children fail | `2` |
//! | `late=LIST` | these children run in the background and finish after the prompt answered | `3` |
//! | `nested=LIST` | these children spawn one grandchild | none; the bare word `nested` means `1` |
//! | `hang=LIST` | these children work until cancelled | none |
//!
//! `LIST` is a comma-separated list of 1-based child numbers; `0` or `none` means no child.
//! A child may carry several roles (e.g. `children=1 permission=1 fail=1`). Numbers above
//! `children` are ignored; malformed values keep the default (a warning goes to stderr).
//!
//! # Environment
//!
//! * `TUTTI_DEMO_SPEED`: time divisor (`2` runs twice as fast, `0.5` half as fast; default
//!   `1`: the default scenario answers the prompt after about 5 s plus the time the client
//!   takes to answer the permission request, and the background child settles about 3 s
//!   later).
//! * `TUTTI_DEMO_GARBAGE=1`: write one non-JSON line to stdout before the first real message.
//! * `TUTTI_DEMO_STATE_DIR`: where the agent keeps its sessions' conversation state, one file
//!   `<session id>.json` each, so that a restarted agent process can `session/load` them. With
//!   it set, `initialize` advertises `loadSession: true`; without it, `false`. `tuttid` sets it
//!   for the bundled `demo` provider to a directory beside its database (unless the daemon's own
//!   environment names one).
//! * `TUTTI_DEMO_GRANDCHILD=1`: the agent starts a long-running `sleep` child process (a
//!   grandchild of the daemon) at start-up, so tests can check that stopping the provider ends its
//!   whole process group. The agent ends it itself only on a clean exit (stdin closed), not when
//!   a signal kills the agent.
//!
//! # Sessions and `session/load`
//!
//! Session ids are `demo-session-<start time and pid, hex>-<n>`, unique across agent processes.
//! The state file of a session holds its number of turns and its user prompts:
//! `{"turns":2,"prompts":["...","..."]}`. `session/load` of a known id replays the prompts as
//! `user_message_chunk` updates (the ACP history replay), then answers; the next prompt is turn
//! `turns + 1` (visible in the ids of its tool calls, `<session>-t<turn>-...`). An unknown id is
//! answered with a JSON-RPC "invalid params" error.
//!
//! Logs go to stderr and carry identifiers, counts and lengths only, never prompt text.

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use agent_client_protocol::schema::ProtocolVersion;
use agent_client_protocol::v1::schema::{
    AgentCapabilities, CancelNotification, ContentBlock, ContentChunk, Cost, ErrorStopReason,
    IdleStateUpdate, IdleStopReason, Implementation, InitializeRequest, InitializeResponse,
    LoadSessionRequest, LoadSessionResponse, NewSessionRequest, NewSessionResponse,
    PermissionOption, PermissionOptionKind, PromptRequest, PromptResponse,
    RequestPermissionOutcome, RequestPermissionRequest, RequiresActionStateUpdate,
    RunningStateUpdate, SessionCancelCapabilities, SessionNotification, SessionReference,
    SessionUpdate, StateUpdate, StopReason, SubagentSessionCapabilities, SubagentUpdate,
    TextContent, ToolCall, ToolCallContent, ToolCallStatus, ToolCallUpdate, ToolCallUpdateFields,
    ToolKind, UsageUpdate,
};
use agent_client_protocol::v1::{ConnectionTo, Responder};
use agent_client_protocol::{Agent, ByteStreams, Client, Error};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::compat::{TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};
use tokio_util::sync::CancellationToken;

/// Upper bound of `children=N`.
const MAX_CHILDREN: usize = 8;
/// JSON-RPC "internal error", used as the code of a failed child's error object.
const CHILD_FAILURE_CODE: i32 = -32603;
/// Display names of the top-level subagents, by child number.
const NAMES: [&str; MAX_CHILDREN] = [
    "explorer", "tester", "reviewer", "planner", "writer", "auditor", "fixer", "scout",
];

/// Writes one line to stderr, ignoring a closed stderr.
macro_rules! log {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr(), "tutti-demo-agent: {}", format_args!($($arg)*));
    }};
}

// ---------------------------------------------------------------------------------------
// Directives
// ---------------------------------------------------------------------------------------

/// The scenario a prompt asks for (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Script {
    children: usize,
    permission: Vec<usize>,
    fail: Vec<usize>,
    late: Vec<usize>,
    nested: Vec<usize>,
    hang: Vec<usize>,
}

impl Default for Script {
    fn default() -> Self {
        Self {
            children: 3,
            permission: vec![1],
            fail: vec![2],
            late: vec![3],
            nested: Vec::new(),
            hang: Vec::new(),
        }
    }
}

/// A directive that could not be applied; the default stays in force.
#[derive(Debug, Clone, PartialEq, Eq)]
struct DirectiveError {
    key: String,
    value_len: usize,
}

fn parse_count(value: &str) -> Option<usize> {
    value.parse::<usize>().ok().map(|n| n.min(MAX_CHILDREN))
}

fn parse_list(value: &str) -> Option<Vec<usize>> {
    if value.is_empty() || value == "0" || value.eq_ignore_ascii_case("none") {
        return Some(Vec::new());
    }
    let mut numbers = Vec::new();
    for part in value.split(',').filter(|p| !p.is_empty()) {
        let n = part.parse::<usize>().ok()?;
        if n > 0 && !numbers.contains(&n) {
            numbers.push(n);
        }
    }
    Some(numbers)
}

/// Parses the directives out of the prompt text.
fn parse_script(text: &str) -> (Script, Vec<DirectiveError>) {
    let mut script = Script::default();
    let mut errors = Vec::new();
    let mut nested_word = false;
    let mut nested_explicit = false;
    let trim = |c: char| {
        matches!(
            c,
            '.' | ',' | ';' | ':' | '!' | '?' | '(' | ')' | '[' | ']' | '"' | '\'' | '`'
        )
    };
    for token in text.split_whitespace() {
        let token = token.trim_matches(trim);
        let Some((key, value)) = token.split_once('=') else {
            if token.eq_ignore_ascii_case("nested") {
                nested_word = true;
            }
            continue;
        };
        let key = key.to_ascii_lowercase();
        let applied = match key.as_str() {
            "children" => parse_count(value).map(|n| script.children = n),
            "permission" => parse_list(value).map(|l| script.permission = l),
            "fail" => parse_list(value).map(|l| script.fail = l),
            "late" => parse_list(value).map(|l| script.late = l),
            "hang" => parse_list(value).map(|l| script.hang = l),
            "nested" => parse_list(value).map(|l| {
                nested_explicit = true;
                script.nested = l;
            }),
            _ => Some(()),
        };
        if applied.is_none() {
            errors.push(DirectiveError {
                key,
                value_len: value.len(),
            });
        }
    }
    if nested_word && !nested_explicit {
        script.nested = vec![1];
    }
    (script, errors)
}

// ---------------------------------------------------------------------------------------
// Agent state
// ---------------------------------------------------------------------------------------

/// How one subagent's work ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ChildOutcome {
    Completed,
    Failed(String),
    Cancelled,
}

/// One subagent to run.
#[derive(Debug, Clone)]
struct ChildSpec {
    id: String,
    parent_session: String,
    parent_tool_call: String,
    name: String,
    number: usize,
    /// Number of siblings including this child.
    of: usize,
    permission: bool,
    fail: bool,
    background: bool,
    nested: bool,
    hang: bool,
}

#[derive(Default)]
struct RootSession {
    turns: u64,
    /// The user prompts so far (persisted for `session/load`).
    prompts: Vec<String>,
    prompt_active: bool,
    /// Cancellation tokens of turns that still have live work (the prompt or background
    /// subagents), by turn number.
    live_turns: HashMap<u64, CancellationToken>,
}

#[derive(Default)]
struct State {
    next_session: u64,
    sessions: HashMap<String, RootSession>,
    /// Live subagents by child session id (for a child-scoped `session/cancel`).
    children: HashMap<String, CancellationToken>,
}

/// State shared by every handler of the connection.
struct Shared {
    speed: f64,
    /// Where session state files live (`TUTTI_DEMO_STATE_DIR`); `None`: no `session/load`.
    state_dir: Option<std::path::PathBuf>,
    /// Unique prefix of this process's session ids.
    id_prefix: String,
    /// Whether the client advertised `clientCapabilities.subagents`.
    expose: AtomicBool,
    state: Mutex<State>,
}

/// Writes a state file readable by its owner only: the file is mode 0600 in a folder of mode
/// 0700 (the files hold prompt text; the database beside them is 0600 too). Both are created
/// with those modes, and an existing folder or file (from an older version) gets them set.
fn write_private(path: &std::path::Path, body: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(body)
}

impl Shared {
    fn new(speed: f64) -> Self {
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or_default();
        Self {
            speed,
            state_dir: std::env::var_os("TUTTI_DEMO_STATE_DIR")
                .filter(|d| !d.is_empty())
                .map(std::path::PathBuf::from),
            id_prefix: format!("demo-session-{started:x}{:x}", std::process::id()),
            expose: AtomicBool::new(false),
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The state file of a session (only for ids this agent could have made).
    fn state_file(&self, id: &str) -> Option<std::path::PathBuf> {
        let valid = !id.is_empty()
            && id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !valid {
            return None;
        }
        Some(self.state_dir.as_ref()?.join(format!("{id}.json")))
    }

    /// Writes a session's state file (logged, not fatal, when it fails).
    fn save(&self, id: &str, session: &RootSession) {
        let Some(path) = self.state_file(id) else {
            return;
        };
        let body = json!({"turns": session.turns, "prompts": session.prompts}).to_string();
        if let Err(e) = write_private(&path, body.as_bytes()) {
            log!("session {id}: state not saved: {}", e.kind());
        }
    }

    /// Reads a session's state file.
    fn load(&self, id: &str) -> Option<RootSession> {
        let text = std::fs::read_to_string(self.state_file(id)?).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        Some(RootSession {
            turns: v.get("turns")?.as_u64()?,
            prompts: v
                .get("prompts")?
                .as_array()?
                .iter()
                .filter_map(|p| p.as_str().map(String::from))
                .collect(),
            ..RootSession::default()
        })
    }
}

/// The connection plus the shared state: what a prompt turn and its subagents work with.
struct Demo {
    cx: ConnectionTo<Client>,
    shared: Arc<Shared>,
}

/// One prompt turn of a root session.
#[derive(Clone)]
struct Turn {
    session_id: String,
    number: u64,
    token: CancellationToken,
}

fn text_block(text: impl Into<String>) -> ContentBlock {
    ContentBlock::Text(TextContent::new(text.into()))
}

impl Demo {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }

    fn exposing(&self) -> bool {
        self.shared.expose.load(Ordering::Relaxed)
    }

    async fn pause(&self, millis: u64) {
        let secs = millis as f64 / 1000.0 / self.shared.speed;
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    }

    fn update(&self, session: &str, update: SessionUpdate) -> Result<(), Error> {
        self.cx
            .send_notification(SessionNotification::new(session.to_owned(), update))
    }

    /// One `agent_message_chunk`. A chunk that ends a sentence ends with a newline, so the
    /// chunks a client joins into one message do not run together ("found what I need.tester:").
    fn say(&self, session: &str, text: impl Into<String>) -> Result<(), Error> {
        let mut text = text.into();
        if text.ends_with(['.', '!', '?']) {
            text.push('\n');
        }
        self.update(
            session,
            SessionUpdate::AgentMessageChunk(ContentChunk::new(text_block(text))),
        )
    }

    /// One `usage_update`: `used` tokens of a 200k context, and a cost of 1 USD per million
    /// tokens used (made up, deterministic: the web view shows it per lane).
    fn usage(&self, session: &str, used: u64) -> Result<(), Error> {
        self.update(
            session,
            SessionUpdate::UsageUpdate(
                UsageUpdate::new(used, 200_000).cost(Cost::new(used as f64 / 1e6, "USD")),
            ),
        )
    }

    fn tool_call(&self, session: &str, call: ToolCall) -> Result<(), Error> {
        self.update(session, SessionUpdate::ToolCall(call))
    }

    fn tool_update(
        &self,
        session: &str,
        id: &str,
        fields: ToolCallUpdateFields,
    ) -> Result<(), Error> {
        self.update(
            session,
            SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(id.to_owned(), fields)),
        )
    }

    /// Sends a `subagent_update` on the child's immediate parent stream.
    fn subagent(&self, spec: &ChildSpec, update: SubagentUpdate) -> Result<(), Error> {
        self.update(&spec.parent_session, SessionUpdate::SubagentUpdate(update))
    }

    fn subagent_state(&self, spec: &ChildSpec, state: StateUpdate) -> Result<(), Error> {
        self.subagent(spec, SubagentUpdate::new(spec.id.clone()).state(state))
    }

    /// Opens the delegation tool call on the parent stream, announces the child (when
    /// exposing) and links the tool call to it.
    fn delegate(&self, spec: &ChildSpec) -> Result<(), Error> {
        self.tool_call(
            &spec.parent_session,
            ToolCall::new(
                spec.parent_tool_call.clone(),
                format!("Delegate to {}", spec.name),
            )
            .kind(ToolKind::Other)
            .status(ToolCallStatus::InProgress)
            .raw_input(json!({"agent": spec.name, "background": spec.background})),
        )?;
        if self.exposing() {
            let announce = SubagentUpdate::new(spec.id.clone())
                .title(spec.name.clone())
                .description(format!("subtask {} of {}", spec.number, spec.of))
                .capabilities(
                    SubagentSessionCapabilities::new().cancel(SessionCancelCapabilities::new()),
                );
            self.subagent(spec, announce)?;
            self.tool_update(
                &spec.parent_session,
                &spec.parent_tool_call,
                ToolCallUpdateFields::new().content(vec![ToolCallContent::Session(
                    SessionReference::new(spec.id.clone()),
                )]),
            )?;
        }
        if spec.background {
            self.tool_update(
                &spec.parent_session,
                &spec.parent_tool_call,
                ToolCallUpdateFields::new()
                    .status(ToolCallStatus::Completed)
                    .raw_output(json!({"launched": true})),
            )?;
        }
        Ok(())
    }

    /// Closes a foreground delegation tool call after the child's terminal update.
    fn finish_delegation(&self, spec: &ChildSpec, outcome: &ChildOutcome) -> Result<(), Error> {
        if spec.background {
            return Ok(());
        }
        let fields = match outcome {
            ChildOutcome::Completed => ToolCallUpdateFields::new()
                .status(ToolCallStatus::Completed)
                .raw_output(json!({"outcome": "completed"})),
            ChildOutcome::Failed(_) => ToolCallUpdateFields::new()
                .status(ToolCallStatus::Failed)
                .raw_output(json!({"outcome": "failed"})),
            ChildOutcome::Cancelled => ToolCallUpdateFields::new()
                .status(ToolCallStatus::Failed)
                .raw_output(json!({"outcome": "cancelled"})),
        };
        self.tool_update(&spec.parent_session, &spec.parent_tool_call, fields)
    }

    /// Registers a child for child-scoped cancellation and starts it.
    fn spawn_child(
        self: &Arc<Self>,
        spec: ChildSpec,
        token: CancellationToken,
        answered: watch::Receiver<bool>,
        done: Option<mpsc::UnboundedSender<(ChildSpec, ChildOutcome)>>,
    ) -> JoinHandle<ChildOutcome> {
        self.lock().children.insert(spec.id.clone(), token.clone());
        let demo = Arc::clone(self);
        tokio::spawn(async move {
            let outcome = demo.run_child(&spec, token, answered).await;
            demo.lock().children.remove(&spec.id);
            if let Some(done) = done {
                let _ = done.send((spec, outcome.clone()));
            }
            outcome
        })
    }

    /// Runs one subagent to its terminal state and reports it.
    async fn run_child(
        self: &Arc<Self>,
        spec: &ChildSpec,
        token: CancellationToken,
        answered: watch::Receiver<bool>,
    ) -> ChildOutcome {
        let mut nested: Vec<JoinHandle<ChildOutcome>> = Vec::new();
        let result = tokio::select! {
            biased;
            () = token.cancelled() => None,
            result = self.child_work(spec, &token, &mut nested, answered) => Some(result),
        };
        // Descendants report their terminal state before this child does.
        for handle in nested {
            let _ = handle.await;
        }
        let outcome = match result {
            None => ChildOutcome::Cancelled,
            Some(Ok(outcome)) => outcome,
            Some(Err(error)) => {
                log!("child {} stopped: transport error {}", spec.id, error.code);
                ChildOutcome::Failed("transport error".to_owned())
            }
        };
        log!("child {} {}", spec.id, outcome_name(&outcome));
        if self.exposing() {
            let stop = match &outcome {
                ChildOutcome::Completed => IdleStopReason::EndTurn,
                ChildOutcome::Cancelled => IdleStopReason::Cancelled,
                ChildOutcome::Failed(message) => IdleStopReason::Error(
                    ErrorStopReason::new().error(agent_client_protocol::v1::schema::Error::new(
                        CHILD_FAILURE_CODE,
                        format!("subagent failed: {message}"),
                    )),
                ),
            };
            let state = StateUpdate::Idle(IdleStateUpdate::new().stop_reason(stop));
            if let Err(error) = self.subagent_state(spec, state) {
                log!("child {} terminal not sent: {}", spec.id, error.code);
            }
        }
        outcome
    }

    /// The scripted work of one subagent. Dropped at any await point on cancellation.
    async fn child_work(
        self: &Arc<Self>,
        spec: &ChildSpec,
        token: &CancellationToken,
        nested: &mut Vec<JoinHandle<ChildOutcome>>,
        mut answered: watch::Receiver<bool>,
    ) -> Result<ChildOutcome, Error> {
        let expose = self.exposing();
        let child = spec.id.as_str();
        let name = spec.name.as_str();
        if expose {
            self.subagent_state(spec, StateUpdate::Running(RunningStateUpdate::new()))?;
        }
        self.pause(300 + 150 * spec.number as u64).await;
        if expose {
            self.say(
                child,
                format!("{name}: starting on subtask {}.", spec.number),
            )?;
        }
        self.pause(700).await;
        let search = format!("{child}-search");
        if expose {
            self.tool_call(
                child,
                ToolCall::new(search.clone(), "Search the codebase")
                    .kind(ToolKind::Search)
                    .status(ToolCallStatus::InProgress),
            )?;
        }
        self.pause(900).await;
        if expose {
            self.tool_update(
                child,
                &search,
                ToolCallUpdateFields::new()
                    .status(ToolCallStatus::Completed)
                    .content(vec![ToolCallContent::from(text_block("3 matches"))]),
            )?;
            self.say(child, format!("{name}: found what I need."))?;
            self.usage(child, 1000 + 100 * spec.number as u64)?;
        }
        self.pause(500).await;

        if spec.permission && expose {
            if let Some(outcome) = self.ask_permission(spec).await? {
                return Ok(outcome);
            }
        }

        if spec.nested {
            let helper_call = format!("{child}-delegate-1");
            let helper = ChildSpec {
                id: format!("{child}-child-1"),
                parent_session: spec.id.clone(),
                parent_tool_call: helper_call,
                name: format!("{name}-helper"),
                number: 1,
                of: 1,
                permission: false,
                fail: false,
                background: false,
                nested: false,
                hang: false,
            };
            self.delegate(&helper)?;
            let handle =
                self.spawn_child(helper.clone(), token.child_token(), answered.clone(), None);
            nested.push(handle);
            let outcome = match nested.last_mut() {
                Some(handle) => handle.await.unwrap_or_else(|_| {
                    ChildOutcome::Failed("subagent task ended unexpectedly".to_owned())
                }),
                None => ChildOutcome::Failed("subagent task missing".to_owned()),
            };
            // Joined: `run_child` must not poll this handle again.
            nested.pop();
            self.finish_delegation(&helper, &outcome)?;
            if expose {
                self.say(
                    child,
                    format!("{name}: my helper {}.", outcome_name(&outcome)),
                )?;
            }
        }

        if spec.hang {
            log!("child {child} hangs until cancelled");
            std::future::pending::<()>().await;
        }

        if spec.background {
            // A background child finishes only after the root prompt answered.
            let _ = answered.wait_for(|answered| *answered).await;
            if expose {
                self.say(child, format!("{name}: still working in the background."))?;
            }
            self.pause(2500).await;
        }

        self.pause(400).await;
        if spec.fail {
            if expose {
                self.say(child, format!("{name}: the build step failed."))?;
            }
            return Ok(ChildOutcome::Failed(format!(
                "simulated failure in subtask {}",
                spec.number
            )));
        }
        if expose {
            self.say(child, format!("{name}: done."))?;
        }
        Ok(ChildOutcome::Completed)
    }

    /// Asks the client for a child-scoped permission. Returns a terminal outcome when the
    /// answer ends the child's work.
    async fn ask_permission(&self, spec: &ChildSpec) -> Result<Option<ChildOutcome>, Error> {
        let child = spec.id.as_str();
        let edit = format!("{child}-edit");
        self.tool_call(
            child,
            ToolCall::new(edit.clone(), "Edit src/lib.rs")
                .kind(ToolKind::Edit)
                .status(ToolCallStatus::Pending),
        )?;
        self.subagent_state(
            spec,
            StateUpdate::RequiresAction(RequiresActionStateUpdate::new()),
        )?;
        log!("child {child} asks for a permission");
        let request = RequestPermissionRequest::new(
            child.to_owned(),
            ToolCallUpdate::new(
                edit.clone(),
                ToolCallUpdateFields::new()
                    .title("Edit src/lib.rs".to_owned())
                    .kind(ToolKind::Edit)
                    .status(ToolCallStatus::Pending),
            ),
            vec![
                PermissionOption::new("allow", "Allow", PermissionOptionKind::AllowOnce),
                PermissionOption::new("reject", "Reject", PermissionOptionKind::RejectOnce),
            ],
        );
        let response = self.cx.send_request(request).block_task().await?;
        self.subagent_state(spec, StateUpdate::Running(RunningStateUpdate::new()))?;
        match response.outcome {
            RequestPermissionOutcome::Selected(selected) if &*selected.option_id.0 == "allow" => {
                log!("child {child} permission allowed");
                self.tool_update(
                    child,
                    &edit,
                    ToolCallUpdateFields::new().status(ToolCallStatus::InProgress),
                )?;
                self.pause(400).await;
                self.tool_update(
                    child,
                    &edit,
                    ToolCallUpdateFields::new().status(ToolCallStatus::Completed),
                )?;
                Ok(None)
            }
            RequestPermissionOutcome::Selected(_) => {
                log!("child {child} permission rejected");
                self.tool_update(
                    child,
                    &edit,
                    ToolCallUpdateFields::new().status(ToolCallStatus::Failed),
                )?;
                Ok(Some(ChildOutcome::Failed(
                    "permission rejected by the user".to_owned(),
                )))
            }
            RequestPermissionOutcome::Cancelled => {
                log!("child {child} permission cancelled");
                Ok(Some(ChildOutcome::Cancelled))
            }
            _ => {
                log!("child {child} permission outcome not understood");
                Ok(Some(ChildOutcome::Failed(
                    "unknown permission outcome".to_owned(),
                )))
            }
        }
    }

    /// Runs one prompt turn: answers the prompt, then keeps the turn registered until its
    /// background subagents are done.
    async fn run_turn(
        self: Arc<Self>,
        turn: Turn,
        script: Script,
        text_len: usize,
        responder: Responder<PromptResponse>,
    ) {
        let (answered_tx, answered_rx) = watch::channel(false);
        let mut children: Vec<JoinHandle<ChildOutcome>> = Vec::new();
        let result = tokio::select! {
            biased;
            () = turn.token.cancelled() => None,
            result = self.root_work(&turn, &script, text_len, &mut children, answered_rx) => Some(result),
        };
        let stop_reason = match result {
            None => {
                // Every subagent of this turn reports `cancelled` before the prompt answers.
                for handle in children.drain(..) {
                    let _ = handle.await;
                }
                StopReason::Cancelled
            }
            Some(Ok(())) => StopReason::EndTurn,
            Some(Err(error)) => {
                log!(
                    "session {} turn {} failed: transport error {}",
                    turn.session_id,
                    turn.number,
                    error.code
                );
                turn.token.cancel();
                for handle in children.drain(..) {
                    let _ = handle.await;
                }
                self.end_prompt(&turn);
                let _ = responder.respond_with_error(error);
                self.end_turn(&turn);
                return;
            }
        };
        self.end_prompt(&turn);
        log!(
            "session {} turn {} answers {:?}",
            turn.session_id,
            turn.number,
            stop_reason
        );
        if let Err(error) = responder.respond(PromptResponse::new(stop_reason)) {
            log!("prompt answer not sent: {}", error.code);
        }
        let _ = answered_tx.send(true);
        // Background subagents outlive the prompt; the turn stays cancellable until then.
        for handle in children {
            let _ = handle.await;
        }
        self.end_turn(&turn);
    }

    fn end_prompt(&self, turn: &Turn) {
        if let Some(session) = self.lock().sessions.get_mut(&turn.session_id) {
            session.prompt_active = false;
        }
    }

    fn end_turn(&self, turn: &Turn) {
        if let Some(session) = self.lock().sessions.get_mut(&turn.session_id) {
            session.live_turns.remove(&turn.number);
        }
    }

    /// The scripted work of the root agent for one prompt.
    async fn root_work(
        self: &Arc<Self>,
        turn: &Turn,
        script: &Script,
        text_len: usize,
        children: &mut Vec<JoinHandle<ChildOutcome>>,
        answered: watch::Receiver<bool>,
    ) -> Result<(), Error> {
        let root = turn.session_id.as_str();
        let prefix = format!("{root}-t{}", turn.number);
        let expose = self.exposing();
        self.say(
            root,
            format!("Reading the request ({text_len} characters) "),
        )?;
        self.pause(150).await;
        self.say(root, "and planning the work.")?;
        self.pause(300).await;
        let read = format!("{prefix}-read");
        self.tool_call(
            root,
            ToolCall::new(read.clone(), "Read workspace files")
                .kind(ToolKind::Read)
                .status(ToolCallStatus::InProgress),
        )?;
        self.pause(500).await;
        self.tool_update(
            root,
            &read,
            ToolCallUpdateFields::new()
                .status(ToolCallStatus::Completed)
                .content(vec![ToolCallContent::from(text_block("12 files"))]),
        )?;
        let count = script.children;
        self.say(
            root,
            format!("Splitting the work across {count} subagents."),
        )?;

        let (done_tx, mut done_rx) = mpsc::unbounded_channel();
        let mut awaited = 0usize;
        for number in 1..=count {
            let has = |list: &[usize]| list.contains(&number);
            // Without exposure every subagent is awaited (RFD v1 scope rule).
            let background = expose && has(&script.late);
            let spec = ChildSpec {
                id: format!("{prefix}-child-{number}"),
                parent_session: root.to_owned(),
                parent_tool_call: format!("{prefix}-delegate-{number}"),
                name: NAMES[(number - 1) % MAX_CHILDREN].to_owned(),
                number,
                of: count,
                permission: has(&script.permission),
                fail: has(&script.fail),
                background,
                nested: has(&script.nested),
                hang: has(&script.hang),
            };
            self.delegate(&spec)?;
            if !background {
                awaited += 1;
            }
            log!(
                "session {root} spawns child {} (background: {background})",
                spec.id
            );
            let handle = self.spawn_child(
                spec,
                turn.token.child_token(),
                answered.clone(),
                Some(done_tx.clone()),
            );
            children.push(handle);
            self.pause(250).await;
        }
        drop(done_tx);

        let (mut completed, mut failed, mut cancelled) = (0usize, 0usize, 0usize);
        while awaited > 0 {
            let Some((spec, outcome)) = done_rx.recv().await else {
                break;
            };
            if spec.background {
                continue;
            }
            awaited -= 1;
            self.finish_delegation(&spec, &outcome)?;
            match outcome {
                ChildOutcome::Completed => completed += 1,
                ChildOutcome::Failed(_) => failed += 1,
                ChildOutcome::Cancelled => cancelled += 1,
            }
            self.say(root, format!("{} {}. ", spec.name, outcome_name(&outcome)))?;
        }
        let background = children.len() - completed - failed - cancelled;
        self.pause(300).await;
        self.say(
            root,
            format!(
                "Summary: {completed} completed, {failed} failed, {cancelled} cancelled, \
                 {background} still running in the background."
            ),
        )?;
        Ok(())
    }
}

fn outcome_name(outcome: &ChildOutcome) -> &'static str {
    match outcome {
        ChildOutcome::Completed => "finished",
        ChildOutcome::Failed(_) => "failed",
        ChildOutcome::Cancelled => "was cancelled",
    }
}

fn prompt_text(prompt: &[ContentBlock]) -> String {
    let mut text = String::new();
    for block in prompt {
        if let ContentBlock::Text(block) = block {
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(&block.text);
        }
    }
    text
}

// ---------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------

fn handle_initialize(
    shared: &Shared,
    request: InitializeRequest,
    responder: Responder<InitializeResponse>,
) -> Result<(), Error> {
    let expose = request.client_capabilities.subagents.is_some();
    shared.expose.store(expose, Ordering::Relaxed);
    log!(
        "initialize (client protocol {}, client subagents capability: {expose})",
        request.protocol_version
    );
    responder.respond(
        InitializeResponse::new(ProtocolVersion::V1)
            .agent_capabilities(AgentCapabilities::new().load_session(shared.state_dir.is_some()))
            .agent_info(Implementation::new(
                "tutti-demo-agent",
                env!("CARGO_PKG_VERSION"),
            )),
    )
}

fn handle_new_session(
    shared: &Shared,
    _request: NewSessionRequest,
    responder: Responder<NewSessionResponse>,
) -> Result<(), Error> {
    let id = {
        let mut state = shared.lock();
        state.next_session += 1;
        let id = format!("{}-{}", shared.id_prefix, state.next_session);
        let session = RootSession::default();
        shared.save(&id, &session);
        state.sessions.insert(id.clone(), session);
        id
    };
    log!("session/new -> {id}");
    responder.respond(NewSessionResponse::new(id))
}

/// `session/load`: restores a session from its state file, replays its user prompts as
/// `user_message_chunk` updates, then answers.
fn handle_load_session(
    shared: &Shared,
    request: LoadSessionRequest,
    responder: Responder<LoadSessionResponse>,
    cx: &ConnectionTo<Client>,
) -> Result<(), Error> {
    let id = request.session_id.0.to_string();
    let live = shared
        .lock()
        .sessions
        .get(&id)
        .map(|s| (s.turns, s.prompts.clone()));
    let loaded = live.or_else(|| {
        let session = shared.load(&id)?;
        let found = (session.turns, session.prompts.clone());
        shared.lock().sessions.insert(id.clone(), session);
        Some(found)
    });
    let Some((turns, prompts)) = loaded else {
        log!("session/load of unknown session {id} refused");
        return responder.respond_with_error(
            Error::invalid_params().data(json!({"reason": "unknown session"})),
        );
    };
    for prompt in &prompts {
        cx.send_notification(SessionNotification::new(
            id.clone(),
            SessionUpdate::UserMessageChunk(ContentChunk::new(text_block(prompt.clone()))),
        ))?;
    }
    log!(
        "session/load {id}: {turns} turn(s), {} prompt(s) replayed",
        prompts.len()
    );
    responder.respond(LoadSessionResponse::new())
}

fn handle_prompt(
    demo: Arc<Demo>,
    request: PromptRequest,
    responder: Responder<PromptResponse>,
) -> Result<(), Error> {
    let session_id = request.session_id.0.to_string();
    let text = prompt_text(&request.prompt);
    let (script, errors) = parse_script(&text);
    for error in &errors {
        log!(
            "ignored directive {} (value of {} bytes)",
            error.key,
            error.value_len
        );
    }
    let turn = {
        let mut state = demo.lock();
        match state.sessions.get_mut(&session_id) {
            None => Err(Error::invalid_params().data(json!({"reason": "unknown session"}))),
            Some(session) if session.prompt_active => Err(Error::invalid_request()
                .data(json!({"reason": "a prompt is already running in this session"}))),
            Some(session) => {
                session.turns += 1;
                session.prompt_active = true;
                session.prompts.push(text.clone());
                demo.shared.save(&session_id, session);
                let token = CancellationToken::new();
                session.live_turns.insert(session.turns, token.clone());
                Ok(Turn {
                    session_id: session_id.clone(),
                    number: session.turns,
                    token,
                })
            }
        }
    };
    let turn = match turn {
        Ok(turn) => turn,
        Err(error) => {
            log!("session/prompt rejected for session {session_id}");
            return responder.respond_with_error(error);
        }
    };
    log!(
        "session {session_id} turn {} prompt ({} blocks, {} characters): {script:?}",
        turn.number,
        request.prompt.len(),
        text.chars().count()
    );
    tokio::spawn(demo.run_turn(turn, script, text.chars().count(), responder));
    Ok(())
}

fn handle_cancel(shared: &Shared, notification: CancelNotification) {
    let id = notification.session_id.0.to_string();
    let state = shared.lock();
    if let Some(session) = state.sessions.get(&id) {
        log!(
            "session/cancel {id}: cancelling {} live turn(s)",
            session.live_turns.len()
        );
        for token in session.live_turns.values() {
            token.cancel();
        }
    } else if let Some(token) = state.children.get(&id) {
        log!("session/cancel for child {id}");
        token.cancel();
    } else {
        log!("session/cancel for unknown session {id} ignored");
    }
}

fn speed_from_env() -> f64 {
    std::env::var("TUTTI_DEMO_SPEED")
        .ok()
        .and_then(|value| value.trim().parse::<f64>().ok())
        .filter(|speed| speed.is_finite() && *speed > 0.0)
        .map_or(1.0, |speed| speed.clamp(0.01, 1000.0))
}

fn write_garbage_if_asked() {
    if std::env::var("TUTTI_DEMO_GARBAGE").is_ok_and(|value| value.trim() == "1") {
        let mut stdout = std::io::stdout().lock();
        let written = stdout
            .write_all(b"tutti-demo-agent: this line is not JSON\n")
            .and_then(|()| stdout.flush());
        if written.is_err() {
            log!("garbage line not written");
        }
    }
}

/// With `TUTTI_DEMO_GRANDCHILD=1`, starts `sleep 3600` as a child of this agent (in its process
/// group), for tests that check that the whole group ends with the provider.
fn start_grandchild_if_asked() -> Option<std::process::Child> {
    if !std::env::var("TUTTI_DEMO_GRANDCHILD").is_ok_and(|value| value.trim() == "1") {
        return None;
    }
    match std::process::Command::new("sleep")
        .arg("3600")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
    {
        Ok(child) => {
            log!("grandchild {} started", child.id());
            Some(child)
        }
        Err(e) => {
            log!("grandchild not started: {}", e.kind());
            None
        }
    }
}

/// Serves the agent on stdio until the client disconnects.
pub async fn serve() -> std::process::ExitCode {
    let shared = Arc::new(Shared::new(speed_from_env()));
    log!("starting (speed {})", shared.speed);
    write_garbage_if_asked();
    let grandchild = start_grandchild_if_asked();
    let result = Agent
        .v1()
        .name("tutti-demo-agent")
        .on_receive_request(
            {
                let shared = Arc::clone(&shared);
                async move |request: InitializeRequest, responder, _cx| {
                    handle_initialize(&shared, request, responder)
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            {
                let shared = Arc::clone(&shared);
                async move |request: NewSessionRequest, responder, _cx| {
                    handle_new_session(&shared, request, responder)
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            {
                let shared = Arc::clone(&shared);
                async move |request: LoadSessionRequest, responder, cx: ConnectionTo<Client>| {
                    handle_load_session(&shared, request, responder, &cx)
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            {
                let shared = Arc::clone(&shared);
                async move |request: PromptRequest, responder, cx: ConnectionTo<Client>| {
                    let demo = Arc::new(Demo {
                        cx,
                        shared: Arc::clone(&shared),
                    });
                    handle_prompt(demo, request, responder)
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_notification(
            {
                let shared = Arc::clone(&shared);
                async move |notification: CancelNotification, _cx| {
                    handle_cancel(&shared, notification);
                    Ok(())
                }
            },
            agent_client_protocol::on_receive_notification!(),
        )
        .connect_to(ByteStreams::new(
            tokio::io::stdout().compat_write(),
            tokio::io::stdin().compat(),
        ))
        .await;
    // A clean exit (the client closed stdin) ends the grandchild; only a signal that kills this
    // process (the daemon ending the process group) can leave it, unless the group is ended too.
    if let Some(mut child) = grandchild {
        let _ = child.kill();
        let _ = child.wait();
    }
    match result {
        Ok(()) => {
            log!("client closed the connection");
            std::process::ExitCode::SUCCESS
        }
        Err(error) => {
            log!("connection ended with error {}", error.code);
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &std::path::Path) -> u32 {
        std::fs::metadata(p).map_or(0, |m| m.permissions().mode() & 0o777)
    }

    fn shared(dir: &std::path::Path) -> Shared {
        Shared {
            speed: 1.0,
            state_dir: Some(dir.to_path_buf()),
            id_prefix: "demo-session-test".into(),
            expose: AtomicBool::new(false),
            state: Mutex::new(State::default()),
        }
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        std::env::temp_dir().join(format!("tutti-{name}-{}-{nanos}", std::process::id()))
    }

    #[test]
    fn demo_state_files_are_0600_in_a_0700_folder() {
        let base = scratch("demo-state");
        let dir = base.join("db.sqlite.demo-agent");
        let a = shared(&dir);
        let session = RootSession {
            turns: 1,
            prompts: vec!["secret prompt".into()],
            ..RootSession::default()
        };
        a.save("s1", &session);
        let file = dir.join("s1.json");
        assert_eq!(mode(&dir), 0o700, "new folder");
        assert_eq!(mode(&file), 0o600, "new file");
        assert_eq!(
            a.load("s1").map(|s| s.prompts),
            Some(session.prompts.clone())
        );

        // A folder and file left world-readable by an older version are tightened on the next save.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        a.save("s1", &session);
        assert_eq!(mode(&dir), 0o700, "existing folder");
        assert_eq!(mode(&file), 0o600, "existing file");
        let _ = std::fs::remove_dir_all(&base);
    }
}
