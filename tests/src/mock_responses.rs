//! A scripted OpenAI Responses-API model server for driving the real `codex app-server` offline.
//!
//! Codex (configured with a custom `model_providers.<id>.base_url`, `wire_api = "responses"`) only
//! ever calls `POST <base_url>/responses` and reads the reply as server-sent events. This server
//! listens on `127.0.0.1:0`, answers each request from a script of rules, and records every request
//! for later assertions.
//!
//! ```no_run
//! # async fn demo() {
//! use tutti_tests::mock_responses::{Match, MockResponses, Reply};
//! let mock = MockResponses::builder()
//!     // The root thread's first model request: spawn a child (multi_agent_v1).
//!     .on(Match::root().tool_outputs(0), Reply::spawn_agent("CHILD_TASK: say hi"))
//!     // After the spawn result came back: wait for every child spawned so far.
//!     .on(Match::root().tool_outputs(1), Reply::wait_spawned_agents())
//!     .on(Match::root(), Reply::text("parent done"))
//!     .on(Match::child(), Reply::text("child says hi"))
//!     .start()
//!     .await
//!     .unwrap();
//! let base_url = mock.base_url(); // "http://127.0.0.1:PORT/v1"
//! # let _ = base_url;
//! # }
//! ```
//!
//! # Telling requests apart
//!
//! Every request of codex 0.171 carries these headers (see [`ModelRequest`]):
//! - `thread-id`: the app-server thread that makes the request (root or child).
//! - `session-id`: the *root* thread id, the same for a root and all of its children.
//! - `x-codex-parent-thread-id` and `x-openai-subagent: collab_spawn`: only on a spawned child's
//!   requests.
//! - `x-codex-turn-metadata`: JSON with `thread_id`, `turn_id`, `root_turn_id`, and for children
//!   `parent_thread_id`, `parent_turn_id`, `subagent_kind: "thread_spawn"`,
//!   `thread_source: "subagent"`.
//!
//! The body's `input` holds the whole conversation of that thread so far: developer/user
//! `message`s, then `function_call` / `function_call_output` pairs. A child's `input` starts with
//! the spawn `message` as its last user text; it does not contain the parent's conversation.
//!
//! Rules are tried in order; the first one whose [`Match`] holds (and that has uses left) answers.
//! A request that no rule matches gets HTTP 500 and is listed by [`MockResponses::unmatched`].

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

/// One model request as the rules see it (and as it is recorded).
#[derive(Clone, Debug)]
pub struct ModelRequest {
    /// 0-based arrival order over the whole server.
    pub seq: usize,
    /// Milliseconds since the server started.
    pub at_ms: u128,
    pub method: String,
    pub path: String,
    /// Header names are lower-case, in arrival order.
    pub headers: Vec<(String, String)>,
    /// The JSON body (`Value::Null` if it was not JSON).
    pub body: Value,
    /// `thread-id` header (falls back to `x-codex-turn-metadata.thread_id`).
    pub thread_id: Option<String>,
    /// `x-codex-parent-thread-id` header (falls back to the turn metadata's `parent_thread_id`).
    pub parent_thread_id: Option<String>,
    /// The app-server turn id from `x-codex-turn-metadata.turn_id`.
    pub turn_id: Option<String>,
    /// 0 for a root thread, 1 for its children, 2 for grandchildren, ... (from the parent chain
    /// this server has seen so far).
    pub depth: usize,
    /// 0-based index of this request among the requests of the same thread and turn.
    pub nth_in_turn: usize,
    /// 0-based index of this request among the requests of the same thread.
    pub nth_in_thread: usize,
}

impl ModelRequest {
    /// The value of a header (name matched case-insensitively).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The parsed `x-codex-turn-metadata` header, or `Value::Null`.
    pub fn turn_metadata(&self) -> Value {
        self.header("x-codex-turn-metadata")
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or(Value::Null)
    }

    /// True for a request of a root thread (no parent thread).
    pub fn is_root(&self) -> bool {
        self.parent_thread_id.is_none()
    }

    /// True for a request made by a spawned sub-agent thread.
    pub fn is_child(&self) -> bool {
        self.parent_thread_id.is_some()
    }

    /// The body's `input` array.
    pub fn input(&self) -> &[Value] {
        self.body
            .get("input")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Input items of a given `type` (`message`, `function_call`, `function_call_output`, ...).
    pub fn input_items(&self, kind: &str) -> Vec<&Value> {
        self.input()
            .iter()
            .filter(|it| it.get("type").and_then(Value::as_str) == Some(kind))
            .collect()
    }

    /// How many tool results (`function_call_output` / `custom_tool_call_output`) the input holds.
    pub fn tool_outputs(&self) -> usize {
        self.input_items("function_call_output").len()
            + self.input_items("custom_tool_call_output").len()
    }

    /// The `function_call` items of the input.
    pub fn function_calls(&self) -> Vec<&Value> {
        self.input_items("function_call")
    }

    /// The output string of the last `function_call_output` in the input.
    pub fn last_tool_output(&self) -> Option<String> {
        self.input_items("function_call_output")
            .last()
            .and_then(|it| it.get("output"))
            .map(|o| match o {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
    }

    /// The output of the tool call with this `call_id`.
    pub fn tool_output_for(&self, call_id: &str) -> Option<String> {
        self.input_items("function_call_output")
            .into_iter()
            .find(|it| it.get("call_id").and_then(Value::as_str) == Some(call_id))
            .and_then(|it| it.get("output"))
            .map(|o| match o {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
    }

    /// Texts of the messages with this role (`user`, `developer`, `assistant`), in order.
    pub fn texts_of(&self, role: &str) -> Vec<String> {
        let mut out = Vec::new();
        for it in self.input_items("message") {
            if it.get("role").and_then(Value::as_str) != Some(role) {
                continue;
            }
            if let Some(parts) = it.get("content").and_then(Value::as_array) {
                for part in parts {
                    if let Some(t) = part.get("text").and_then(Value::as_str) {
                        out.push(t.to_string());
                    }
                }
            } else if let Some(t) = it.get("content").and_then(Value::as_str) {
                out.push(t.to_string());
            }
        }
        out
    }

    /// User message texts, in order (includes codex's `<environment_context>` and
    /// `<subagent_notification>` wrappers).
    pub fn user_texts(&self) -> Vec<String> {
        self.texts_of("user")
    }

    /// The last user message text.
    pub fn last_user_text(&self) -> Option<String> {
        self.user_texts().pop()
    }

    /// The body's `instructions` string (codex's base instructions), if any.
    pub fn instructions(&self) -> Option<&str> {
        self.body.get("instructions").and_then(Value::as_str)
    }

    /// Names of the tools offered to the model; namespaced tools are listed as `namespace` and
    /// also as `namespace/tool`.
    pub fn tool_names(&self) -> Vec<String> {
        let mut out = Vec::new();
        for tool in self
            .body
            .get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let name = tool
                .get("name")
                .or_else(|| tool.get("type"))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            for inner in tool
                .get("tools")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(n) = inner.get("name").and_then(Value::as_str) {
                    out.push(format!("{name}/{n}"));
                }
            }
            out.push(name);
        }
        out
    }

    /// The ids of the agents that `spawn_agent` calls in this input created (parsed from the
    /// spawn results: v1 `{"agent_id": ..}`, v2 `{"task_name": ..}`), in order.
    pub fn spawned_agent_ids(&self) -> Vec<String> {
        let mut out = Vec::new();
        for call in self.function_calls() {
            if call.get("name").and_then(Value::as_str) != Some("spawn_agent") {
                continue;
            }
            let Some(call_id) = call.get("call_id").and_then(Value::as_str) else {
                continue;
            };
            let Some(output) = self.tool_output_for(call_id) else {
                continue;
            };
            let Ok(parsed) = serde_json::from_str::<Value>(&output) else {
                continue;
            };
            for key in ["agent_id", "task_name", "id"] {
                if let Some(id) = parsed.get(key).and_then(Value::as_str) {
                    out.push(id.to_string());
                    break;
                }
            }
        }
        out
    }

    /// True if the serialized `input` contains `needle` anywhere.
    pub fn input_contains(&self, needle: &str) -> bool {
        self.body
            .get("input")
            .map(|i| i.to_string().contains(needle))
            .unwrap_or(false)
    }

    /// A one-line description for diagnostics.
    pub fn summary(&self) -> String {
        format!(
            "#{seq} {method} {path} thread={thread} depth={depth} turn={turn} nth_in_turn={nth} \
             tool_outputs={outs} last_user_text={last:?}",
            seq = self.seq,
            method = self.method,
            path = self.path,
            thread = self.thread_id.as_deref().unwrap_or("?"),
            depth = self.depth,
            turn = self.turn_id.as_deref().unwrap_or("?"),
            nth = self.nth_in_turn,
            outs = self.tool_outputs(),
            last = self
                .last_user_text()
                .map(|t| t.chars().take(80).collect::<String>()),
        )
    }
}

/// A request together with what the server answered.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub request: ModelRequest,
    /// Index of the rule that answered (in the order rules were added), `None` if none matched.
    pub rule: Option<usize>,
    /// A short description of the reply (`text "…"`, `function_call multi_agent_v1.spawn_agent`,
    /// `http 500`, `hang`, ...).
    pub reply: String,
}

impl std::ops::Deref for RecordedRequest {
    type Target = ModelRequest;
    fn deref(&self) -> &ModelRequest {
        &self.request
    }
}

type Pred = Arc<dyn Fn(&ModelRequest) -> bool + Send + Sync>;

/// A condition on a [`ModelRequest`]; the builder methods add conditions that must all hold.
#[derive(Clone, Default)]
pub struct Match {
    conds: Vec<(String, Pred)>,
}

impl fmt::Debug for Match {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.conds.iter().map(|(n, _)| n.as_str()).collect();
        write!(f, "Match[{}]", names.join(" && "))
    }
}

impl Match {
    /// Matches every request.
    pub fn any() -> Self {
        Self::default()
    }

    /// Requests of a root thread (no `x-codex-parent-thread-id`).
    pub fn root() -> Self {
        Self::any().when("root", ModelRequest::is_root)
    }

    /// Requests of any spawned sub-agent thread.
    pub fn child() -> Self {
        Self::any().when("child", ModelRequest::is_child)
    }

    /// Requests of threads at this depth (0 = root, 1 = child, 2 = grandchild).
    pub fn depth(depth: usize) -> Self {
        Self::any().when(format!("depth=={depth}"), move |r| r.depth == depth)
    }

    /// Requests of one app-server thread.
    pub fn thread(thread_id: impl Into<String>) -> Self {
        let id = thread_id.into();
        Self::any().when(format!("thread=={id}"), move |r| {
            r.thread_id.as_deref() == Some(id.as_str())
        })
    }

    /// Adds an arbitrary condition.
    pub fn when(
        mut self,
        name: impl Into<String>,
        pred: impl Fn(&ModelRequest) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.conds.push((name.into(), Arc::new(pred)));
        self
    }

    /// Exactly `n` tool results are already in the input.
    pub fn tool_outputs(self, n: usize) -> Self {
        self.when(format!("tool_outputs=={n}"), move |r| r.tool_outputs() == n)
    }

    /// At least `n` tool results are already in the input.
    pub fn tool_outputs_at_least(self, n: usize) -> Self {
        self.when(format!("tool_outputs>={n}"), move |r| r.tool_outputs() >= n)
    }

    /// The `n`-th (0-based) model request of its thread's current turn.
    pub fn nth_in_turn(self, n: usize) -> Self {
        self.when(format!("nth_in_turn=={n}"), move |r| r.nth_in_turn == n)
    }

    /// The `n`-th (0-based) model request of its thread.
    pub fn nth_in_thread(self, n: usize) -> Self {
        self.when(format!("nth_in_thread=={n}"), move |r| r.nth_in_thread == n)
    }

    /// Some user message of the input contains `needle`.
    pub fn user_text_contains(self, needle: impl Into<String>) -> Self {
        let needle = needle.into();
        self.when(format!("user_text~{needle:?}"), move |r| {
            r.user_texts().iter().any(|t| t.contains(&needle))
        })
    }

    /// The last user message of the input contains `needle`.
    pub fn last_user_text_contains(self, needle: impl Into<String>) -> Self {
        let needle = needle.into();
        self.when(format!("last_user_text~{needle:?}"), move |r| {
            r.last_user_text()
                .map(|t| t.contains(&needle))
                .unwrap_or(false)
        })
    }

    /// The serialized input contains `needle` anywhere.
    pub fn input_contains(self, needle: impl Into<String>) -> Self {
        let needle = needle.into();
        self.when(format!("input~{needle:?}"), move |r| {
            r.input_contains(&needle)
        })
    }

    /// The model is offered a tool with this name (`namespace` or `namespace/tool` for
    /// namespaced tools).
    pub fn has_tool(self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.when(format!("has_tool {name}"), move |r| {
            r.tool_names().contains(&name)
        })
    }

    /// True if every condition holds for `req`.
    pub fn matches(&self, req: &ModelRequest) -> bool {
        self.conds.iter().all(|(_, p)| p(req))
    }
}

/// One output item of a scripted model response.
#[derive(Clone, Debug)]
pub enum OutputItem {
    /// An assistant `message` with one `output_text` part (streamed as two deltas).
    Message(String),
    /// A `function_call` item. `call_id` defaults to a unique `call-<n>`.
    FunctionCall {
        name: String,
        namespace: Option<String>,
        arguments: String,
        call_id: Option<String>,
    },
    /// Any other item JSON, sent as-is in `response.output_item.done`.
    Raw(Value),
}

type DynReply = Arc<dyn Fn(&ModelRequest) -> Reply + Send + Sync>;

/// What the server answers to one request.
#[derive(Clone)]
pub enum Reply {
    /// HTTP 200 with an SSE stream `response.created`, the items, `response.completed`.
    Output(Vec<OutputItem>),
    /// An HTTP error with an OpenAI-style JSON error body.
    HttpError { status: u16, message: String },
    /// Wait, then answer with the inner reply.
    Delay(Duration, Box<Reply>),
    /// Send the response headers and `response.created`, then never finish; the connection is
    /// held until codex closes it (e.g. on `turn/interrupt`) or the server is dropped.
    Hang,
    /// Decide at request time.
    Dynamic(DynReply),
    /// Hold the request until the [`Gate`] opens (or the server stops), then answer with the
    /// inner reply. Deterministic alternative to [`Reply::Delay`] for a thread that must still be
    /// running when the test acts.
    Gated(Gate, Box<Reply>),
}

/// A latch a test opens to release every request held by [`Reply::until`]. Cloning shares it.
#[derive(Clone, Debug)]
pub struct Gate(Arc<watch::Sender<bool>>);

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Self {
        Gate(Arc::new(watch::channel(false).0))
    }

    /// Opens the gate: held requests are answered now, later ones at once.
    pub fn open(&self) {
        self.0.send_replace(true);
    }

    /// Whether the gate is open.
    pub fn is_open(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves once the gate is open.
    pub async fn opened(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }
}

impl fmt::Debug for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reply::Output(items) => f.debug_tuple("Output").field(items).finish(),
            Reply::HttpError { status, message } => f
                .debug_struct("HttpError")
                .field("status", status)
                .field("message", message)
                .finish(),
            Reply::Delay(d, r) => f.debug_tuple("Delay").field(d).field(r).finish(),
            Reply::Hang => f.write_str("Hang"),
            Reply::Dynamic(_) => f.write_str("Dynamic(..)"),
            Reply::Gated(_, r) => f.debug_tuple("Gated").field(r).finish(),
        }
    }
}

/// The `multi_agent_v1` namespace of codex's v1 collaboration tools (the default).
pub const MULTI_AGENT_V1: &str = "multi_agent_v1";
/// The `collaboration` namespace of codex's v2 tools (`[features] multi_agent_v2 = true`).
pub const COLLABORATION_V2: &str = "collaboration";

impl Reply {
    /// An assistant text message (ends the thread's turn).
    pub fn text(text: impl Into<String>) -> Self {
        Reply::Output(vec![OutputItem::Message(text.into())])
    }

    /// Several output items in one response (e.g. two `spawn_agent` calls in parallel).
    pub fn items(items: Vec<OutputItem>) -> Self {
        Reply::Output(items)
    }

    /// A plain (not namespaced) function call, e.g. `exec_command`, `request_user_input`.
    pub fn function_call(name: impl Into<String>, arguments: Value) -> Self {
        Reply::Output(vec![OutputItem::call(None, name, arguments)])
    }

    /// A namespaced function call, e.g. `("multi_agent_v1", "spawn_agent", {...})`.
    pub fn namespaced_call(
        namespace: impl Into<String>,
        name: impl Into<String>,
        arguments: Value,
    ) -> Self {
        Reply::Output(vec![OutputItem::call(
            Some(namespace.into()),
            name,
            arguments,
        )])
    }

    /// v1 `spawn_agent {message}`; the child thread's first user message is `message`.
    pub fn spawn_agent(message: impl Into<String>) -> Self {
        Self::namespaced_call(
            MULTI_AGENT_V1,
            "spawn_agent",
            json!({ "message": message.into() }),
        )
    }

    /// v1 `wait_agent {targets, timeout_ms}` (codex requires `timeout_ms >= 10000`).
    pub fn wait_agent(targets: Vec<String>, timeout_ms: u64) -> Self {
        Self::namespaced_call(
            MULTI_AGENT_V1,
            "wait_agent",
            json!({ "targets": targets, "timeout_ms": timeout_ms }),
        )
    }

    /// v1 `wait_agent` on every agent spawned so far in this thread (ids read from the
    /// `spawn_agent` results in the request), with a 30 s timeout.
    pub fn wait_spawned_agents() -> Self {
        Reply::dynamic(|req| Reply::wait_agent(req.spawned_agent_ids(), 30_000))
    }

    /// v1 `close_agent {target}`.
    pub fn close_agent(target: impl Into<String>) -> Self {
        Self::namespaced_call(
            MULTI_AGENT_V1,
            "close_agent",
            json!({ "target": target.into() }),
        )
    }

    /// v2 `spawn_agent {task_name, message}` (needs `[features] multi_agent_v2 = true`).
    pub fn spawn_agent_v2(task_name: impl Into<String>, message: impl Into<String>) -> Self {
        Self::namespaced_call(
            COLLABORATION_V2,
            "spawn_agent",
            json!({ "task_name": task_name.into(), "message": message.into() }),
        )
    }

    /// v2 `wait_agent {timeout_ms}`.
    pub fn wait_agent_v2(timeout_ms: u64) -> Self {
        Self::namespaced_call(
            COLLABORATION_V2,
            "wait_agent",
            json!({ "timeout_ms": timeout_ms }),
        )
    }

    /// `exec_command {cmd}`: runs a shell command inside the sandbox.
    pub fn exec_command(cmd: impl Into<String>) -> Self {
        Self::function_call("exec_command", json!({ "cmd": cmd.into() }))
    }

    /// `exec_command` asking to run outside the sandbox (`sandbox_permissions:
    /// "require_escalated"`); with `approval_policy = "on-request"` this makes codex send
    /// `item/commandExecution/requestApproval` on the calling thread.
    pub fn exec_command_escalated(
        cmd: impl Into<String>,
        justification: impl Into<String>,
    ) -> Self {
        Self::function_call(
            "exec_command",
            json!({
                "cmd": cmd.into(),
                "sandbox_permissions": "require_escalated",
                "justification": justification.into(),
            }),
        )
    }

    /// An HTTP error (codex turns it into an `error` notification and a failed turn when
    /// retries are off).
    pub fn http_error(status: u16, message: impl Into<String>) -> Self {
        Reply::HttpError {
            status,
            message: message.into(),
        }
    }

    /// Never finish the response (see [`Reply::Hang`]).
    pub fn hang() -> Self {
        Reply::Hang
    }

    /// Decide the reply at request time.
    pub fn dynamic(f: impl Fn(&ModelRequest) -> Reply + Send + Sync + 'static) -> Self {
        Reply::Dynamic(Arc::new(f))
    }

    /// This reply, sent after `delay`.
    pub fn after(self, delay: Duration) -> Self {
        Reply::Delay(delay, Box::new(self))
    }

    /// This reply, sent once `gate` is open (see [`Gate`]).
    pub fn until(self, gate: &Gate) -> Self {
        Reply::Gated(gate.clone(), Box::new(self))
    }
}

impl OutputItem {
    /// A function call item with an automatic call id.
    pub fn call(namespace: Option<String>, name: impl Into<String>, arguments: Value) -> Self {
        OutputItem::FunctionCall {
            name: name.into(),
            namespace,
            arguments: arguments.to_string(),
            call_id: None,
        }
    }

    /// An assistant text message item.
    pub fn text(text: impl Into<String>) -> Self {
        OutputItem::Message(text.into())
    }
}

/// One scripted rule.
#[derive(Clone, Debug)]
pub struct Rule {
    pub when: Match,
    pub reply: Reply,
    /// How many more requests this rule may answer (`None` = unlimited).
    pub remaining: Option<usize>,
}

impl Rule {
    pub fn new(when: Match, reply: Reply) -> Self {
        Self {
            when,
            reply,
            remaining: None,
        }
    }

    /// Answer at most `n` requests.
    pub fn times(mut self, n: usize) -> Self {
        self.remaining = Some(n);
        self
    }
}

/// Builds a [`MockResponses`] server.
#[derive(Default)]
pub struct MockResponsesBuilder {
    rules: Vec<Rule>,
}

impl MockResponsesBuilder {
    /// Answer every request matching `when` with `reply`.
    pub fn on(mut self, when: Match, reply: Reply) -> Self {
        self.rules.push(Rule::new(when, reply));
        self
    }

    /// Answer only the first request matching `when` with `reply`.
    pub fn once(mut self, when: Match, reply: Reply) -> Self {
        self.rules.push(Rule::new(when, reply).times(1));
        self
    }

    /// Adds a prepared rule.
    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Binds `127.0.0.1:0` and starts serving (needs a tokio runtime).
    pub async fn start(self) -> std::io::Result<MockResponses> {
        MockResponses::start_with(self.rules).await
    }
}

struct Shared {
    started: Instant,
    rules: Mutex<Vec<Rule>>,
    requests: Mutex<Vec<RecordedRequest>>,
    /// thread id -> parent thread id.
    parents: Mutex<HashMap<String, Option<String>>>,
    per_turn: Mutex<HashMap<(String, String), usize>>,
    per_thread: Mutex<HashMap<String, usize>>,
    seq: AtomicUsize,
    responses: AtomicUsize,
    arrived: Notify,
}

/// The running scripted model server. Dropping it stops the server and closes hung responses.
pub struct MockResponses {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    accept_task: JoinHandle<()>,
}

impl Drop for MockResponses {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        self.accept_task.abort();
    }
}

impl MockResponses {
    pub fn builder() -> MockResponsesBuilder {
        MockResponsesBuilder::default()
    }

    async fn start_with(rules: Vec<Rule>) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            started: Instant::now(),
            rules: Mutex::new(rules),
            requests: Mutex::new(Vec::new()),
            parents: Mutex::new(HashMap::new()),
            per_turn: Mutex::new(HashMap::new()),
            per_thread: Mutex::new(HashMap::new()),
            seq: AtomicUsize::new(0),
            responses: AtomicUsize::new(0),
            arrived: Notify::new(),
        });
        let (shutdown, shutdown_rx) = watch::channel(false);
        let accept_shared = shared.clone();
        let accept_task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let shared = accept_shared.clone();
                let shutdown = shutdown_rx.clone();
                tokio::spawn(async move {
                    let _ = serve_connection(stream, shared, shutdown).await;
                });
            }
        });
        Ok(Self {
            addr,
            shared,
            shutdown,
            accept_task,
        })
    }

    /// The listening address (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The provider `base_url` for codex's config: `http://127.0.0.1:<port>/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Appends a rule at run time (tried after the existing ones).
    pub fn push_rule(&self, rule: Rule) {
        lock(&self.shared.rules).push(rule);
    }

    /// Puts a rule in front of all existing ones.
    pub fn prepend_rule(&self, rule: Rule) {
        lock(&self.shared.rules).insert(0, rule);
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.shared.requests).clone()
    }

    /// Requests that no rule answered.
    pub fn unmatched(&self) -> Vec<RecordedRequest> {
        self.requests()
            .into_iter()
            .filter(|r| r.rule.is_none())
            .collect()
    }

    /// One line per request received so far (for failure messages).
    pub fn describe_requests(&self) -> String {
        self.requests()
            .iter()
            .map(|r| format!("{} -> {}", r.summary(), r.reply))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Waits until a recorded request satisfies `pred` and returns it.
    pub async fn wait_for_request(
        &self,
        timeout: Duration,
        pred: impl Fn(&RecordedRequest) -> bool,
    ) -> Result<RecordedRequest, String> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.shared.arrived.notified();
            if let Some(r) = self.requests().into_iter().find(|r| pred(r)) {
                return Ok(r);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(format!(
                    "no matching model request within {timeout:?}; requests so far:\n{}",
                    self.describe_requests()
                ));
            }
        }
    }

    /// Panics with a readable list if some request matched no rule.
    pub fn assert_all_matched(&self) {
        let unmatched = self.unmatched();
        assert!(
            unmatched.is_empty(),
            "model requests without a matching rule:\n{}",
            unmatched
                .iter()
                .map(|r| r.summary())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct RawRequest {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl RawRequest {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

async fn read_request(
    reader: &mut BufReader<OwnedReadHalf>,
) -> std::io::Result<Option<RawRequest>> {
    let mut line = String::new();
    // Skip stray blank lines between keep-alive requests.
    loop {
        line.clear();
        if reader.read_line(&mut line).await? == 0 {
            return Ok(None);
        }
        if !line.trim().is_empty() {
            break;
        }
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).await? == 0 {
            return Ok(None);
        }
        let l = line.trim_end_matches(['\r', '\n']);
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let mut req = RawRequest {
        method,
        path,
        headers,
        body: Vec::new(),
    };
    let chunked = req
        .header("transfer-encoding")
        .map(|v| v.to_ascii_lowercase().contains("chunked"))
        .unwrap_or(false);
    if chunked {
        loop {
            line.clear();
            reader.read_line(&mut line).await?;
            let size_str = line.trim().split(';').next().unwrap_or("0");
            let size = usize::from_str_radix(size_str, 16)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
            if size == 0 {
                // Trailers until a blank line.
                loop {
                    line.clear();
                    if reader.read_line(&mut line).await? == 0 || line.trim().is_empty() {
                        break;
                    }
                }
                break;
            }
            let start = req.body.len();
            req.body.resize(start + size, 0);
            reader.read_exact(&mut req.body[start..]).await?;
            line.clear();
            reader.read_line(&mut line).await?;
        }
    } else if let Some(len) = req
        .header("content-length")
        .and_then(|v| v.parse::<usize>().ok())
    {
        req.body.resize(len, 0);
        reader.read_exact(&mut req.body).await?;
    }
    Ok(Some(req))
}

async fn serve_connection(
    stream: TcpStream,
    shared: Arc<Shared>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    loop {
        let raw = tokio::select! {
            r = read_request(&mut reader) => r?,
            _ = shutdown.changed() => return Ok(()),
        };
        let Some(raw) = raw else {
            return Ok(());
        };
        let close = raw
            .header("connection")
            .map(|v| v.eq_ignore_ascii_case("close"))
            .unwrap_or(false);
        let keep_going = handle(raw, &shared, &mut reader, &mut write, &mut shutdown).await?;
        if close || !keep_going {
            return Ok(());
        }
    }
}

/// Answers one request; returns false if the connection must be closed afterwards.
async fn handle(
    raw: RawRequest,
    shared: &Arc<Shared>,
    reader: &mut BufReader<OwnedReadHalf>,
    write: &mut OwnedWriteHalf,
    shutdown: &mut watch::Receiver<bool>,
) -> std::io::Result<bool> {
    let request = classify(raw, shared);
    let is_responses = request.method == "POST" && request.path.ends_with("/responses");

    let (rule, mut reply) = if is_responses {
        let mut rules = lock(&shared.rules);
        let found = rules
            .iter_mut()
            .enumerate()
            .find(|(_, r)| r.remaining.map(|n| n > 0).unwrap_or(true) && r.when.matches(&request));
        match found {
            Some((i, r)) => {
                if let Some(n) = r.remaining.as_mut() {
                    *n -= 1;
                }
                (Some(i), r.reply.clone())
            }
            None => (
                None,
                Reply::http_error(
                    500,
                    format!("mock_responses: no rule matched {}", request.summary()),
                ),
            ),
        }
    } else {
        (
            None,
            Reply::HttpError {
                status: 404,
                message: format!(
                    "mock_responses: no route {} {}",
                    request.method, request.path
                ),
            },
        )
    };
    if rule.is_none() && is_responses {
        eprintln!("mock_responses: no rule matched {}", request.summary());
    }

    // Resolve dynamic replies, delays and gates (spent before anything is written).
    let mut delay = Duration::ZERO;
    let mut gates = Vec::new();
    let reply = loop {
        reply = match reply {
            Reply::Dynamic(f) => f(&request),
            Reply::Delay(d, inner) => {
                delay += d;
                *inner
            }
            Reply::Gated(g, inner) => {
                gates.push(g);
                *inner
            }
            other => break other,
        };
    };
    let n = shared.responses.fetch_add(1, Ordering::SeqCst) + 1;
    let description = describe_reply(&reply, n);
    lock(&shared.requests).push(RecordedRequest {
        request,
        rule,
        reply: match (delay.is_zero(), gates.is_empty()) {
            (true, true) => description,
            (false, true) => format!("{description} after {delay:?}"),
            (true, false) => format!("{description} once gated"),
            (false, false) => format!("{description} once gated, after {delay:?}"),
        },
    });
    shared.arrived.notify_waiters();

    for gate in gates {
        tokio::select! {
            _ = gate.opened() => {}
            _ = shutdown.changed() => return Ok(false),
        }
    }
    if !delay.is_zero() {
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.changed() => return Ok(false),
        }
    }

    match reply {
        Reply::Output(items) => {
            let body = sse_body(n, &items);
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n\
                 content-length: {}\r\n\r\n",
                body.len()
            );
            write.write_all(head.as_bytes()).await?;
            write.write_all(body.as_bytes()).await?;
            write.flush().await?;
            Ok(true)
        }
        Reply::HttpError { status, message } => {
            let body = json!({
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "code": "mock_error",
                }
            })
            .to_string();
            let head = format!(
                "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                reason(status),
                body.len()
            );
            write.write_all(head.as_bytes()).await?;
            write.write_all(body.as_bytes()).await?;
            write.flush().await?;
            Ok(true)
        }
        Reply::Hang => {
            let created = sse_event(&json!({
                "type": "response.created",
                "response": { "id": format!("resp-{n}") },
            }));
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                        cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";
            write.write_all(head.as_bytes()).await?;
            write
                .write_all(format!("{:x}\r\n{created}\r\n", created.len()).as_bytes())
                .await?;
            write.flush().await?;
            // Hold the response open until the client goes away or the server stops.
            let mut sink = [0u8; 1024];
            loop {
                tokio::select! {
                    r = reader.read(&mut sink) => match r {
                        Ok(0) | Err(_) => return Ok(false),
                        Ok(_) => {}
                    },
                    _ = shutdown.changed() => return Ok(false),
                }
            }
        }
        Reply::Delay(..) | Reply::Dynamic(_) | Reply::Gated(..) => unreachable!("resolved above"),
    }
}

/// Builds the [`ModelRequest`] view and updates the thread bookkeeping.
fn classify(raw: RawRequest, shared: &Shared) -> ModelRequest {
    let body: Value = if raw.header("content-encoding").is_some() {
        // Codex does not compress requests to custom providers; keep going without a body.
        Value::Null
    } else {
        serde_json::from_slice(&raw.body).unwrap_or(Value::Null)
    };
    let meta: Value = raw
        .header("x-codex-turn-metadata")
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or(Value::Null);
    let meta_str = |k: &str| meta.get(k).and_then(Value::as_str).map(str::to_string);
    let thread_id = raw
        .header("thread-id")
        .map(str::to_string)
        .or_else(|| meta_str("thread_id"));
    let parent_thread_id = raw
        .header("x-codex-parent-thread-id")
        .map(str::to_string)
        .or_else(|| meta_str("parent_thread_id"));
    let turn_id = meta_str("turn_id");

    let depth = {
        let mut parents = lock(&shared.parents);
        if let Some(t) = &thread_id {
            parents.insert(t.clone(), parent_thread_id.clone());
        }
        let mut depth = 0;
        let mut cur = parent_thread_id.clone();
        while let Some(p) = cur {
            depth += 1;
            if depth > 64 {
                break;
            }
            cur = parents.get(&p).cloned().flatten();
        }
        depth
    };
    let thread_key = thread_id.clone().unwrap_or_default();
    let nth_in_turn = {
        let mut m = lock(&shared.per_turn);
        let c = m
            .entry((thread_key.clone(), turn_id.clone().unwrap_or_default()))
            .or_insert(0);
        *c += 1;
        *c - 1
    };
    let nth_in_thread = {
        let mut m = lock(&shared.per_thread);
        let c = m.entry(thread_key).or_insert(0);
        *c += 1;
        *c - 1
    };
    ModelRequest {
        seq: shared.seq.fetch_add(1, Ordering::SeqCst),
        at_ms: shared.started.elapsed().as_millis(),
        method: raw.method,
        path: raw.path,
        headers: raw.headers,
        body,
        thread_id,
        parent_thread_id,
        turn_id,
        depth,
        nth_in_turn,
        nth_in_thread,
    }
}

fn describe_reply(reply: &Reply, n: usize) -> String {
    match reply {
        Reply::Output(items) => items
            .iter()
            .enumerate()
            .map(|(i, it)| match it {
                OutputItem::Message(t) => format!("text {t:?}"),
                OutputItem::FunctionCall {
                    name,
                    namespace,
                    arguments,
                    call_id,
                } => format!(
                    "function_call {}{name} {arguments} (call_id {})",
                    namespace
                        .as_ref()
                        .map(|n| format!("{n}."))
                        .unwrap_or_default(),
                    call_id
                        .clone()
                        .unwrap_or_else(|| default_call_id(n, i, items.len())),
                ),
                OutputItem::Raw(v) => format!("raw {v}"),
            })
            .collect::<Vec<_>>()
            .join(" + "),
        Reply::HttpError { status, .. } => format!("http {status}"),
        Reply::Hang => "hang".to_string(),
        Reply::Delay(..) | Reply::Dynamic(_) | Reply::Gated(..) => "unresolved".to_string(),
    }
}

fn default_call_id(n: usize, i: usize, len: usize) -> String {
    if len == 1 {
        format!("call-{n}")
    } else {
        format!("call-{n}-{i}")
    }
}

fn sse_event(ev: &Value) -> String {
    let kind = ev.get("type").and_then(Value::as_str).unwrap_or("message");
    format!("event: {kind}\ndata: {ev}\n\n")
}

/// The SSE body of response number `n`.
fn sse_body(n: usize, items: &[OutputItem]) -> String {
    let mut events = vec![json!({
        "type": "response.created",
        "response": { "id": format!("resp-{n}") },
    })];
    for (i, item) in items.iter().enumerate() {
        match item {
            OutputItem::Message(text) => {
                let id = if items.len() == 1 {
                    format!("msg-{n}")
                } else {
                    format!("msg-{n}-{i}")
                };
                events.push(json!({
                    "type": "response.output_item.added",
                    "output_index": i,
                    "item": { "type": "message", "role": "assistant", "id": id, "content": [] },
                }));
                // Two deltas so that consumers see streaming.
                let split = text
                    .char_indices()
                    .nth(text.chars().count() / 2)
                    .map(|(b, _)| b)
                    .unwrap_or(0);
                for delta in [&text[..split], &text[split..]] {
                    if delta.is_empty() {
                        continue;
                    }
                    events.push(json!({
                        "type": "response.output_text.delta",
                        "item_id": id,
                        "output_index": i,
                        "content_index": 0,
                        "delta": delta,
                    }));
                }
                events.push(json!({
                    "type": "response.output_item.done",
                    "output_index": i,
                    "item": {
                        "type": "message",
                        "role": "assistant",
                        "id": id,
                        "content": [{ "type": "output_text", "text": text, "annotations": [] }],
                    },
                }));
            }
            OutputItem::FunctionCall {
                name,
                namespace,
                arguments,
                call_id,
            } => {
                let call_id = call_id
                    .clone()
                    .unwrap_or_else(|| default_call_id(n, i, items.len()));
                let mut item = json!({
                    "type": "function_call",
                    "id": format!("fc-{call_id}"),
                    "call_id": call_id,
                    "name": name,
                    "arguments": arguments,
                });
                if let Some(ns) = namespace {
                    item["namespace"] = json!(ns);
                }
                events.push(json!({
                    "type": "response.output_item.done",
                    "output_index": i,
                    "item": item,
                }));
            }
            OutputItem::Raw(item) => {
                events.push(json!({
                    "type": "response.output_item.done",
                    "output_index": i,
                    "item": item,
                }));
            }
        }
    }
    events.push(json!({
        "type": "response.completed",
        "response": {
            "id": format!("resp-{n}"),
            "usage": {
                "input_tokens": 10,
                "input_tokens_details": null,
                "output_tokens": 5,
                "output_tokens_details": null,
                "total_tokens": 15,
            },
        },
    }));
    events.iter().map(sse_event).collect()
}

fn reason(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// Sends one request on `stream` (chunked body when `chunked`) and returns (status, body).
    async fn post(
        stream: &mut BufReader<TcpStream>,
        headers: &[(&str, &str)],
        body: &Value,
        chunked: bool,
    ) -> (u16, String) {
        let body = body.to_string();
        let mut req = String::from("POST /v1/responses HTTP/1.1\r\nhost: x\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if chunked {
            let (a, b) = body.split_at(body.len() / 2);
            req.push_str("transfer-encoding: chunked\r\n\r\n");
            req.push_str(&format!(
                "{:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
                a.len(),
                b.len()
            ));
        } else {
            req.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
        }
        stream.get_mut().write_all(req.as_bytes()).await.unwrap();
        let mut line = String::new();
        stream.read_line(&mut line).await.unwrap();
        let status: u16 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        let mut len = 0;
        loop {
            line.clear();
            stream.read_line(&mut line).await.unwrap();
            if line.trim().is_empty() {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut buf = vec![0; len];
        stream.read_exact(&mut buf).await.unwrap();
        (status, String::from_utf8(buf).unwrap())
    }

    fn meta(thread: &str, turn: &str) -> String {
        json!({ "thread_id": thread, "turn_id": turn }).to_string()
    }

    #[tokio::test]
    async fn routes_by_thread_and_tool_outputs_and_records() {
        let mock = MockResponses::builder()
            .on(Match::root().tool_outputs(0), Reply::spawn_agent("CHILD"))
            .on(Match::root().tool_outputs(1), Reply::wait_spawned_agents())
            .on(Match::depth(1), Reply::text("child says hi"))
            .start()
            .await
            .unwrap();
        let mut conn = BufReader::new(TcpStream::connect(mock.addr()).await.unwrap());
        let root_meta = meta("root", "t1");
        let root_headers = [
            ("thread-id", "root"),
            ("x-codex-turn-metadata", root_meta.as_str()),
        ];
        let user = json!({ "type": "message", "role": "user",
            "content": [{ "type": "input_text", "text": "PARENT" }] });

        let (status, sse) =
            post(&mut conn, &root_headers, &json!({ "input": [user] }), false).await;
        assert_eq!(status, 200);
        assert!(sse.contains("event: response.created"));
        assert!(sse.contains("\"namespace\":\"multi_agent_v1\""));
        assert!(sse.contains("\"name\":\"spawn_agent\""));
        assert!(sse.trim_end().ends_with('}') && sse.contains("event: response.completed"));

        // Second request on the same (keep-alive) connection, chunked body, one tool output.
        let call = json!({ "type": "function_call", "name": "spawn_agent",
            "namespace": "multi_agent_v1", "call_id": "call-1", "arguments": "{}" });
        let out = json!({ "type": "function_call_output", "call_id": "call-1",
            "output": "{\"agent_id\":\"kid\",\"nickname\":\"K\"}" });
        let (status, sse) = post(
            &mut conn,
            &root_headers,
            &json!({ "input": [user, call, out] }),
            true,
        )
        .await;
        assert_eq!(status, 200);
        assert!(sse.contains("wait_agent"), "{sse}");
        assert!(sse.contains("\\\"targets\\\":[\\\"kid\\\"]"), "{sse}");

        // A child request (depth 1 through the parent header).
        let kid_meta = meta("kid", "t2");
        let kid_headers = [
            ("thread-id", "kid"),
            ("x-codex-parent-thread-id", "root"),
            ("x-openai-subagent", "collab_spawn"),
            ("x-codex-turn-metadata", kid_meta.as_str()),
        ];
        let (status, sse) = post(&mut conn, &kid_headers, &json!({ "input": [] }), false).await;
        assert_eq!(status, 200);
        assert!(sse.contains("output_text.delta") && sse.contains("child says hi"));

        // A grandchild matches no rule: HTTP 500, recorded as unmatched.
        let gk_meta = meta("grandkid", "t3");
        let gk_headers = [
            ("thread-id", "grandkid"),
            ("x-codex-parent-thread-id", "kid"),
            ("x-codex-turn-metadata", gk_meta.as_str()),
        ];
        let (status, body) = post(&mut conn, &gk_headers, &json!({ "input": [] }), false).await;
        assert_eq!(status, 500);
        assert!(body.contains("no rule matched"));

        let reqs = mock.requests();
        assert_eq!(reqs.len(), 4);
        assert_eq!(reqs[0].depth, 0);
        assert_eq!(reqs[1].nth_in_turn, 1);
        assert_eq!(reqs[1].spawned_agent_ids(), vec!["kid".to_string()]);
        assert_eq!(reqs[1].last_user_text().as_deref(), Some("PARENT"));
        assert!(reqs[2].is_child() && reqs[2].depth == 1);
        assert_eq!(reqs[3].depth, 2);
        assert_eq!(mock.unmatched().len(), 1);
        assert_eq!(mock.unmatched()[0].thread_id.as_deref(), Some("grandkid"));
    }

    #[tokio::test]
    async fn gated_replies_are_held_until_the_gate_opens() {
        let gate = Gate::new();
        let mock = MockResponses::builder()
            .on(Match::any(), Reply::text("released").until(&gate))
            .start()
            .await
            .unwrap();
        let mut conn = BufReader::new(TcpStream::connect(mock.addr()).await.unwrap());
        let seen_by_client = gate.clone();
        let pending = tokio::spawn(async move {
            let r = post(&mut conn, &[], &json!({}), false).await;
            // Whether the gate was open when the answer reached the client.
            (r, conn, seen_by_client.is_open())
        });
        let held = mock
            .wait_for_request(Duration::from_secs(2), |r| r.seq == 0)
            .await
            .unwrap();
        assert!(held.reply.contains("once gated"), "{}", held.reply);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!pending.is_finished(), "answered before the gate opened");
        gate.open();
        let ((status, sse), mut conn, open_when_answered) = pending.await.unwrap();
        assert!(
            open_when_answered,
            "the mock answered the held request before the gate opened"
        );
        assert_eq!(status, 200);
        assert!(sse.contains("released"));
        // An open gate no longer holds anything.
        let (status, _) = post(&mut conn, &[], &json!({}), false).await;
        assert_eq!(status, 200);
    }

    #[tokio::test]
    async fn once_rules_http_errors_and_delays() {
        let mock = MockResponses::builder()
            .once(Match::any(), Reply::http_error(429, "slow down"))
            .on(
                Match::any(),
                Reply::text("later").after(Duration::from_millis(150)),
            )
            .start()
            .await
            .unwrap();
        let mut conn = BufReader::new(TcpStream::connect(mock.addr()).await.unwrap());
        let (status, body) = post(&mut conn, &[], &json!({}), false).await;
        assert_eq!(status, 429);
        assert!(body.contains("slow down"));
        let started = Instant::now();
        let (status, sse) = post(&mut conn, &[], &json!({}), false).await;
        assert_eq!(status, 200);
        assert!(sse.contains("later"));
        assert!(started.elapsed() >= Duration::from_millis(150));
        let found = mock
            .wait_for_request(Duration::from_secs(1), |r| r.seq == 1)
            .await
            .unwrap();
        assert!(found.reply.contains("after"), "{}", found.reply);
    }
}
