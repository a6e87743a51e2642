//! A scripted Anthropic Messages API server on 127.0.0.1 for driving the real Claude Agent SDK
//! (its native Claude Code binary) offline.
//!
//! It speaks just enough HTTP/1.1 (keep-alive, `Content-Length` or chunked request bodies,
//! chunked responses) for the CLI's fetch client, and serves:
//!
//! * `POST /v1/messages` (the CLI adds `?beta=true`): a reply chosen by the [`Script`], as a
//!   Server-Sent-Events stream in the Anthropic streaming format (`message_start`, `ping`,
//!   `content_block_start` / `content_block_delta` / `content_block_stop` per block, `message_delta`
//!   with the `stop_reason`, `message_stop`) when the request says `"stream": true`, else as one
//!   JSON `message`;
//! * `POST /v1/messages/count_tokens`: `{"input_tokens": 100}`;
//! * `HEAD` anything: 200; any other path: a 404 Anthropic error.
//!
//! Claude Code 2.1.332 (Agent SDK 0.3.332) only ever calls `POST /v1/messages?beta=true`, streaming.
//!
//! How a subagent's model request differs from the root's (observed with that version):
//! * header `x-claude-code-agent-id: <agent id>` (the same id as the SDK's `task_id` / `agent_id`);
//!   the root's requests carry no such header;
//! * the first `system` block (the billing header text) contains `cc_is_subagent=true`, and a third
//!   system block holds the subagent prompt ("You are an agent for Claude Code ...");
//! * the tool list lacks the root-only tools (`AskUserQuestion`, `ScheduleWakeup`, `Workflow`);
//! * the first user message ends with the `prompt` the parent gave the Agent tool, where the
//!   root's ends with the user's prompt.
//!
//! [`RecordedRequest::is_subagent`] uses the header, falling back to the system marker.
//!
//! Every request is recorded ([`MockMessages::requests`]) with the rule that answered it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Header the Claude CLI sets on a subagent's model requests (value: the agent id).
pub const AGENT_ID_HEADER: &str = "x-claude-code-agent-id";

/// Marker in the subagent's first system block.
pub const SUBAGENT_SYSTEM_MARKER: &str = "cc_is_subagent=true";

/// Who sent a model request: the root conversation or a subagent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Root,
    Subagent,
}

/// One HTTP request the mock received.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    /// 0-based arrival order.
    pub seq: usize,
    pub method: String,
    /// The path without the query string, e.g. `/v1/messages`.
    pub path: String,
    /// The query string without `?` (`beta=true`), empty when none.
    pub query: String,
    /// Header names are lower-cased.
    pub headers: Vec<(String, String)>,
    /// The JSON body, `Value::Null` when empty or not JSON.
    pub body: Value,
    /// Name of the script rule that answered, `None` for the fallback or non-message endpoints.
    pub rule: Option<String>,
    /// Time since the server started.
    pub at: Duration,
    /// The client hung up while the reply was still delayed (e.g. a stopped subagent).
    pub aborted: bool,
}

impl RecordedRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// `POST /v1/messages` (with any query).
    pub fn is_messages(&self) -> bool {
        self.method == "POST" && self.path == "/v1/messages"
    }

    /// The `x-claude-code-agent-id` header: set on a subagent's requests.
    pub fn agent_id(&self) -> Option<&str> {
        self.header(AGENT_ID_HEADER)
    }

    /// All `system` text (string or blocks), blocks joined by newlines.
    pub fn system_text(&self) -> String {
        match self.body.get("system") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(blocks)) => blocks
                .iter()
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        }
    }

    /// A request the CLI makes beside its agent loop rather than as a step of it: the
    /// session-title generation (system text "You are naming a coding session") and the prompt
    /// suggestion (last message starting "[SUGGESTION MODE:"). Claude Code 2.1.318 under
    /// `claude-agent-acp` 0.101.0 makes both; their messages quote the user's prompt, so rules
    /// meant for the conversation must not answer them (see [`Match::side`]).
    pub fn is_side_request(&self) -> bool {
        self.system_text()
            .contains("You are naming a coding session")
            || self.last_message_text().contains("[SUGGESTION MODE:")
    }

    pub fn is_subagent(&self) -> bool {
        self.agent_id().is_some() || self.system_text().contains(SUBAGENT_SYSTEM_MARKER)
    }

    pub fn role(&self) -> Role {
        if self.is_subagent() {
            Role::Subagent
        } else {
            Role::Root
        }
    }

    pub fn model(&self) -> Option<&str> {
        self.body.get("model").and_then(Value::as_str)
    }

    pub fn stream(&self) -> bool {
        self.body.get("stream").and_then(Value::as_bool) == Some(true)
    }

    pub fn messages(&self) -> &[Value] {
        self.body
            .get("messages")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Text of the first message (all its text blocks, newline-joined).
    pub fn first_user_text(&self) -> String {
        self.messages()
            .first()
            .map(|m| content_text(m.get("content")))
            .unwrap_or_default()
    }

    /// Text of the last message.
    pub fn last_message_text(&self) -> String {
        self.messages()
            .last()
            .map(|m| content_text(m.get("content")))
            .unwrap_or_default()
    }

    /// Text of the last message whose role is `user`. Claude Code 2.1.318 (under
    /// `claude-agent-acp` 0.101.0) ends a session's first request with a `system`-role message
    /// (the environment), so the newest user input is not always the last message.
    pub fn last_user_text(&self) -> String {
        self.messages()
            .iter()
            .rev()
            .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
            .map(|m| content_text(m.get("content")))
            .unwrap_or_default()
    }

    /// Text of the whole conversation, including `tool_result` contents.
    pub fn all_text(&self) -> String {
        self.messages()
            .iter()
            .map(|m| content_text(m.get("content")))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Number of `tool_result` blocks in the conversation.
    pub fn tool_result_count(&self) -> usize {
        self.content_blocks()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
            .count()
    }

    /// The `tool_use_id`s of the conversation's `tool_result` blocks, in order.
    pub fn tool_result_ids(&self) -> Vec<String> {
        self.content_blocks()
            .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
            .filter_map(|b| b.get("tool_use_id").and_then(Value::as_str))
            .map(str::to_owned)
            .collect()
    }

    /// Names of the tools offered to the model.
    pub fn tool_names(&self) -> Vec<String> {
        self.body
            .get("tools")
            .and_then(Value::as_array)
            .map(|tools| {
                tools
                    .iter()
                    .filter_map(|t| t.get("name").and_then(Value::as_str))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }

    fn content_blocks(&self) -> impl Iterator<Item = &Value> {
        self.messages()
            .iter()
            .filter_map(|m| m.get("content").and_then(Value::as_array))
            .flatten()
    }
}

fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|b| match b.get("type").and_then(Value::as_str) {
                Some("text") => b.get("text").and_then(Value::as_str).map(str::to_owned),
                Some("tool_result") => Some(content_text(b.get("content"))),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

type Predicate = Arc<dyn Fn(&RecordedRequest) -> bool + Send + Sync>;

/// Conditions on a `POST /v1/messages` request; all set conditions must hold.
#[derive(Clone, Default)]
pub struct Match {
    role: Option<Role>,
    agent_id: Option<String>,
    first_user_contains: Vec<String>,
    text_contains: Vec<String>,
    text_lacks: Vec<String>,
    last_contains: Vec<String>,
    last_user_contains: Vec<String>,
    tool_results: Option<(usize, usize)>,
    has_tool: Vec<String>,
    side: Option<bool>,
    custom: Option<Predicate>,
}

impl Match {
    /// Matches every messages request.
    pub fn any() -> Self {
        Self::default()
    }

    /// The root conversation's requests.
    pub fn root() -> Self {
        Self {
            role: Some(Role::Root),
            ..Self::default()
        }
    }

    /// Any subagent's requests.
    pub fn subagent() -> Self {
        Self {
            role: Some(Role::Subagent),
            ..Self::default()
        }
    }

    /// Only side requests ([`RecordedRequest::is_side_request`]).
    pub fn side() -> Self {
        Self {
            side: Some(true),
            ..Self::default()
        }
    }

    /// Only the subagent with this agent id (`x-claude-code-agent-id`).
    pub fn agent_id(mut self, id: &str) -> Self {
        self.agent_id = Some(id.to_owned());
        self
    }

    /// The first message's text contains `s` (root: the user's prompt; subagent: the Agent
    /// tool's `prompt`).
    pub fn first_user_contains(mut self, s: &str) -> Self {
        self.first_user_contains.push(s.to_owned());
        self
    }

    /// Some message's text (tool results included) contains `s`, e.g. `<task-notification>`.
    pub fn text_contains(mut self, s: &str) -> Self {
        self.text_contains.push(s.to_owned());
        self
    }

    /// No message's text contains `s`.
    pub fn text_lacks(mut self, s: &str) -> Self {
        self.text_lacks.push(s.to_owned());
        self
    }

    /// The last message's text contains `s` (e.g. the newest user input of a multi-turn run).
    pub fn last_message_contains(mut self, s: &str) -> Self {
        self.last_contains.push(s.to_owned());
        self
    }

    /// The last `user`-role message's text contains `s` ([`RecordedRequest::last_user_text`]).
    pub fn last_user_contains(mut self, s: &str) -> Self {
        self.last_user_contains.push(s.to_owned());
        self
    }

    /// Exactly `n` `tool_result` blocks in the conversation.
    pub fn tool_results(mut self, n: usize) -> Self {
        self.tool_results = Some((n, n));
        self
    }

    /// At least `n` `tool_result` blocks in the conversation.
    pub fn min_tool_results(mut self, n: usize) -> Self {
        self.tool_results = Some((n, usize::MAX));
        self
    }

    /// The request offers a tool with this name.
    pub fn has_tool(mut self, name: &str) -> Self {
        self.has_tool.push(name.to_owned());
        self
    }

    /// An arbitrary extra condition.
    pub fn when(mut self, f: impl Fn(&RecordedRequest) -> bool + Send + Sync + 'static) -> Self {
        self.custom = Some(Arc::new(f));
        self
    }

    pub fn matches(&self, r: &RecordedRequest) -> bool {
        if let Some(side) = self.side {
            if r.is_side_request() != side {
                return false;
            }
        }
        if let Some(role) = self.role {
            if r.role() != role {
                return false;
            }
        }
        if let Some(id) = &self.agent_id {
            if r.agent_id() != Some(id.as_str()) {
                return false;
            }
        }
        if !self.first_user_contains.is_empty() {
            let first = r.first_user_text();
            if !self.first_user_contains.iter().all(|s| first.contains(s)) {
                return false;
            }
        }
        if !self.text_contains.is_empty() || !self.text_lacks.is_empty() {
            let all = r.all_text();
            if !self.text_contains.iter().all(|s| all.contains(s)) {
                return false;
            }
            if self.text_lacks.iter().any(|s| all.contains(s)) {
                return false;
            }
        }
        if !self.last_contains.is_empty() {
            let last = r.last_message_text();
            if !self.last_contains.iter().all(|s| last.contains(s)) {
                return false;
            }
        }
        if !self.last_user_contains.is_empty() {
            let last = r.last_user_text();
            if !self.last_user_contains.iter().all(|s| last.contains(s)) {
                return false;
            }
        }
        if let Some((lo, hi)) = self.tool_results {
            let n = r.tool_result_count();
            if n < lo || n > hi {
                return false;
            }
        }
        if !self.has_tool.is_empty() {
            let tools = r.tool_names();
            if !self.has_tool.iter().all(|t| tools.contains(t)) {
                return false;
            }
        }
        if let Some(f) = &self.custom {
            if !f(r) {
                return false;
            }
        }
        true
    }
}

/// One content block of a scripted reply.
#[derive(Clone, Debug)]
pub enum Block {
    Text(String),
    /// `id` empty: a unique `toolu_mock_...` id is generated.
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
}

impl Block {
    /// A use of the Claude CLI's delegation tool `Agent` (subagent type `general-purpose`), with
    /// a generated id; `background` sets `run_in_background`.
    pub fn agent(description: &str, prompt: &str, background: bool) -> Block {
        Block::ToolUse {
            id: String::new(),
            name: "Agent".into(),
            input: json!({"description": description, "prompt": prompt,
                          "subagent_type": "general-purpose", "run_in_background": background}),
        }
    }
}

/// What a reply sends.
#[derive(Clone, Debug)]
pub enum ReplyKind {
    /// A message with these blocks; `stop_reason` defaults to `tool_use` when a block is a
    /// tool use, else `end_turn`.
    Content {
        blocks: Vec<Block>,
        stop_reason: Option<String>,
    },
    /// A stream that starts a text block with `text`, then (when `tool` is set) starts a
    /// `tool_use` block of that tool, and then never finishes: the connection is held until the
    /// client hangs up (e.g. a cancel) or the server stops. Models a reply cut off mid-stream.
    Stall { text: String, tool: Option<String> },
    /// An HTTP error with an Anthropic error body (`x-should-retry: false` is set so the client
    /// does not retry).
    Error {
        status: u16,
        error_type: String,
        message: String,
    },
}

/// A scripted reply, sent after `delay` and once `gate` (if any) is open.
#[derive(Clone, Debug)]
pub struct Reply {
    pub delay: Duration,
    pub kind: ReplyKind,
    /// Held until this gate opens (the request is recorded at once).
    pub gate: Option<crate::mock_responses::Gate>,
}

impl Reply {
    pub fn blocks(blocks: Vec<Block>) -> Self {
        Self {
            delay: Duration::ZERO,
            kind: ReplyKind::Content {
                blocks,
                stop_reason: None,
            },
            gate: None,
        }
    }

    /// See [`ReplyKind::Stall`].
    pub fn stall(text: &str, tool: Option<&str>) -> Self {
        Self {
            delay: Duration::ZERO,
            kind: ReplyKind::Stall {
                text: text.to_owned(),
                tool: tool.map(str::to_owned),
            },
            gate: None,
        }
    }

    /// Holds the reply until `gate` opens (a deterministic alternative to [`Reply::after`]).
    pub fn until(mut self, gate: &crate::mock_responses::Gate) -> Self {
        self.gate = Some(gate.clone());
        self
    }

    pub fn text(text: &str) -> Self {
        Self::blocks(vec![Block::Text(text.to_owned())])
    }

    /// A tool use with a generated id.
    pub fn tool_use(name: &str, input: Value) -> Self {
        Self::tool_use_with_id("", name, input)
    }

    pub fn tool_use_with_id(id: &str, name: &str, input: Value) -> Self {
        Self::blocks(vec![Block::ToolUse {
            id: id.to_owned(),
            name: name.to_owned(),
            input,
        }])
    }

    /// The delegation tool (`Agent`; listed as `Task` in the SDK's init message).
    pub fn agent(
        description: &str,
        prompt: &str,
        subagent_type: Option<&str>,
        run_in_background: bool,
    ) -> Self {
        let mut input = json!({
            "description": description,
            "prompt": prompt,
            "run_in_background": run_in_background,
        });
        if let Some(t) = subagent_type {
            input["subagent_type"] = json!(t);
        }
        Self::tool_use("Agent", input)
    }

    /// The `Bash` tool.
    pub fn bash(command: &str, run_in_background: bool) -> Self {
        let mut input = json!({"command": command, "description": "mock command"});
        if run_in_background {
            input["run_in_background"] = json!(true);
        }
        Self::tool_use("Bash", input)
    }

    /// The `Write` tool, which asks for permission in `permissionMode: "default"`.
    pub fn write_file(file_path: &str, content: &str) -> Self {
        Self::tool_use("Write", json!({"file_path": file_path, "content": content}))
    }

    pub fn error(status: u16, error_type: &str, message: &str) -> Self {
        Self {
            delay: Duration::ZERO,
            kind: ReplyKind::Error {
                status,
                error_type: error_type.to_owned(),
                message: message.to_owned(),
            },
            gate: None,
        }
    }

    /// Sends the reply only after `delay` (the request is recorded at once). If the client
    /// hangs up meanwhile (e.g. the SDK stopped the task), nothing is sent.
    pub fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    pub fn with_stop_reason(mut self, reason: &str) -> Self {
        if let ReplyKind::Content { stop_reason, .. } = &mut self.kind {
            *stop_reason = Some(reason.to_owned());
        }
        self
    }
}

/// A named rule: the first rule (in order) whose [`Match`] holds and whose use count is not
/// exhausted answers.
#[derive(Clone)]
pub struct Rule {
    pub name: String,
    pub when: Match,
    pub reply: Reply,
    pub times: Option<usize>,
}

impl Rule {
    pub fn new(name: &str, when: Match, reply: Reply) -> Self {
        Self {
            name: name.to_owned(),
            when,
            reply,
            times: None,
        }
    }

    /// Answer at most `n` requests.
    pub fn times(mut self, n: usize) -> Self {
        self.times = Some(n);
        self
    }
}

/// The ordered rules plus the reply used when none matches.
#[derive(Clone)]
pub struct Script {
    rules: Vec<Rule>,
    fallback: Reply,
}

impl Default for Script {
    fn default() -> Self {
        Self::new()
    }
}

impl Script {
    /// No rules; the fallback answers "Hello from the mock server.".
    pub fn new() -> Self {
        Self {
            rules: Vec::new(),
            fallback: Reply::text("Hello from the mock server."),
        }
    }

    pub fn rule(mut self, rule: Rule) -> Self {
        self.rules.push(rule);
        self
    }

    /// Puts `rule` before every rule added so far.
    pub fn first(mut self, rule: Rule) -> Self {
        self.rules.insert(0, rule);
        self
    }

    /// Answers every side request ([`Match::side`]) with a short text before any other rule
    /// sees it.
    pub fn answering_side_requests(self) -> Self {
        self.first(Rule::new(
            "side request",
            Match::side(),
            Reply::text("Side answer."),
        ))
    }

    /// Shorthand for `rule(Rule::new(name, when, reply))`.
    pub fn on(self, name: &str, when: Match, reply: Reply) -> Self {
        self.rule(Rule::new(name, when, reply))
    }

    pub fn fallback(mut self, reply: Reply) -> Self {
        self.fallback = reply;
        self
    }
}

struct Shared {
    started: Instant,
    script: Mutex<(Script, HashMap<String, usize>)>,
    requests: Mutex<Vec<RecordedRequest>>,
    next_seq: AtomicUsize,
    next_id: AtomicU64,
    id_base: u64,
}

impl Shared {
    fn decide(&self, req: &RecordedRequest) -> (Option<String>, Reply) {
        let mut guard = self.script.lock().unwrap_or_else(|e| e.into_inner());
        let (script, used) = &mut *guard;
        for rule in &script.rules {
            let count = used.get(&rule.name).copied().unwrap_or(0);
            if rule.times.is_some_and(|t| count >= t) {
                continue;
            }
            if rule.when.matches(req) {
                used.insert(rule.name.clone(), count + 1);
                return (Some(rule.name.clone()), rule.reply.clone());
            }
        }
        (None, script.fallback.clone())
    }

    fn fresh_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!(
            "{prefix}{:012x}",
            (self.id_base.wrapping_add(n)) & 0xffff_ffff_ffff
        )
    }
}

/// A running mock server; stops when dropped.
pub struct MockMessages {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MockMessages {
    /// Binds 127.0.0.1:0 and serves `script` from a background thread (with its own Tokio
    /// runtime, so it works from sync and async tests alike).
    pub fn start(script: Script) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let id_base = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            .wrapping_mul(0x9e37_79b9);
        let shared = Arc::new(Shared {
            started: Instant::now(),
            script: Mutex::new((script, HashMap::new())),
            requests: Mutex::new(Vec::new()),
            next_seq: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            id_base,
        });
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let server_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("mock-messages".into())
            .spawn(move || {
                rt.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            eprintln!("mock-messages: cannot listen: {e}");
                            return;
                        }
                    };
                    tokio::pin!(rx);
                    loop {
                        tokio::select! {
                            _ = &mut rx => break,
                            accepted = listener.accept() => {
                                if let Ok((stream, _)) = accepted {
                                    let _ = stream.set_nodelay(true);
                                    tokio::spawn(serve_connection(stream, server_shared.clone()));
                                }
                            }
                        }
                    }
                });
                // Dropping the runtime here cancels every open connection.
            })?;
        Ok(Self {
            addr,
            shared,
            shutdown: Some(tx),
            thread: Some(thread),
        })
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `http://127.0.0.1:PORT`, the value for `ANTHROPIC_BASE_URL`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Replaces the script (rule use counts restart).
    pub fn set_script(&self, script: Script) {
        *self.shared.script.lock().unwrap_or_else(|e| e.into_inner()) = (script, HashMap::new());
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        let mut all = self
            .shared
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        all.sort_by_key(|r| r.seq);
        all
    }

    /// The `POST /v1/messages` requests so far.
    pub fn message_requests(&self) -> Vec<RecordedRequest> {
        self.requests()
            .into_iter()
            .filter(RecordedRequest::is_messages)
            .collect()
    }

    /// Waits until a recorded request satisfies `pred`.
    pub async fn wait_for_request(
        &self,
        timeout: Duration,
        pred: impl Fn(&RecordedRequest) -> bool,
    ) -> Result<RecordedRequest, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self.requests().into_iter().find(|r| pred(r)) {
                return Ok(r);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "no matching model request within {timeout:?}; got: {}",
                    self.describe_requests()
                ));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// A one-line summary per request (role, agent id, tool results, rule) for failure messages.
    pub fn describe_requests(&self) -> String {
        self.requests()
            .iter()
            .map(|r| {
                format!(
                    "#{} {} {}{} role={:?} agent={} tool_results={} rule={}{}",
                    r.seq,
                    r.method,
                    r.path,
                    if r.query.is_empty() {
                        String::new()
                    } else {
                        format!("?{}", r.query)
                    },
                    r.role(),
                    r.agent_id().unwrap_or("-"),
                    r.tool_result_count(),
                    r.rule.as_deref().unwrap_or("-"),
                    if r.aborted {
                        " (aborted by client)"
                    } else {
                        ""
                    }
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

impl Drop for MockMessages {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const MAX_HEAD: usize = 1 << 20;
const MAX_BODY: usize = 64 << 20;

struct Head {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

async fn serve_connection(mut stream: TcpStream, shared: Arc<Shared>) {
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let head = match read_head(&mut stream, &mut buf).await {
            Ok(Some(h)) => h,
            _ => return,
        };
        if head
            .header("expect")
            .is_some_and(|v| v.eq_ignore_ascii_case("100-continue"))
            && stream
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .await
                .is_err()
        {
            return;
        }
        let body = match read_body(&mut stream, &mut buf, &head).await {
            Ok(b) => b,
            Err(_) => return,
        };
        let keep_alive = !head
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"));
        if handle_request(&mut stream, &mut buf, &shared, head, body)
            .await
            .is_err()
            || !keep_alive
        {
            return;
        }
    }
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    let mut chunk = [0u8; 16 * 1024];
    let n = stream.read(&mut chunk).await?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

async fn read_head(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<Option<Head>> {
    loop {
        if let Some(end) = find(buf, b"\r\n\r\n") {
            let text = String::from_utf8_lossy(&buf[..end]).into_owned();
            buf.drain(..end + 4);
            let mut lines = text.split("\r\n");
            let request_line = lines.next().unwrap_or("");
            let mut parts = request_line.split_whitespace();
            let method = parts.next().unwrap_or("").to_owned();
            let target = parts.next().unwrap_or("/").to_owned();
            let headers = lines
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
                .collect();
            return Ok(Some(Head {
                method,
                target,
                headers,
            }));
        }
        if buf.len() > MAX_HEAD {
            return Err(std::io::Error::other("request head too large"));
        }
        if read_more(stream, buf).await? == 0 {
            return Ok(None);
        }
    }
}

async fn read_body(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    head: &Head,
) -> std::io::Result<Vec<u8>> {
    let chunked = head
        .header("transfer-encoding")
        .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"));
    if chunked {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(i) = find(buf, b"\r\n") {
                    break i;
                }
                if read_more(stream, buf).await? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
            };
            let size_text = String::from_utf8_lossy(&buf[..line_end]).into_owned();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| std::io::Error::other("bad chunk size"))?;
            buf.drain(..line_end + 2);
            if size == 0 {
                // Trailers, up to the empty line.
                loop {
                    if let Some(i) = find(buf, b"\r\n") {
                        let empty = i == 0;
                        buf.drain(..i + 2);
                        if empty {
                            return Ok(body);
                        }
                    } else if read_more(stream, buf).await? == 0 {
                        return Ok(body);
                    }
                }
            }
            if body.len() + size > MAX_BODY {
                return Err(std::io::Error::other("request body too large"));
            }
            while buf.len() < size + 2 {
                if read_more(stream, buf).await? == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
            }
            body.extend_from_slice(&buf[..size]);
            buf.drain(..size + 2);
        }
    }
    let len: usize = head
        .header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if len > MAX_BODY {
        return Err(std::io::Error::other("request body too large"));
    }
    while buf.len() < len {
        if read_more(stream, buf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(buf.drain(..len).collect())
}

async fn handle_request(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    shared: &Shared,
    head: Head,
    body: Vec<u8>,
) -> std::io::Result<()> {
    let (path, query) = match head.target.split_once('?') {
        Some((p, q)) => (p.to_owned(), q.to_owned()),
        None => (head.target.clone(), String::new()),
    };
    let mut rec = RecordedRequest {
        seq: shared.next_seq.fetch_add(1, Ordering::SeqCst),
        method: head.method.clone(),
        path,
        query,
        headers: head.headers,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
        rule: None,
        at: shared.started.elapsed(),
        aborted: false,
    };
    let seq = rec.seq;
    let reply = if rec.is_messages() {
        let (rule, reply) = shared.decide(&rec);
        rec.rule = rule;
        Some(reply)
    } else {
        None
    };
    let model = rec.model().unwrap_or("claude-mock").to_owned();
    let stream_reply = rec.stream();
    let method = rec.method.clone();
    let path = rec.path.clone();
    shared
        .requests
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(rec);

    let Some(reply) = reply else {
        return match (method.as_str(), path.as_str()) {
            ("HEAD", _) => write_response(stream, 200, "text/plain", &[], b"").await,
            ("POST", "/v1/messages/count_tokens") => {
                write_json(stream, 200, &json!({"input_tokens": 100})).await
            }
            _ => {
                let err = json!({"type": "error", "error": {"type": "not_found_error", "message": "mock: no such endpoint"}});
                write_json(stream, 404, &err).await
            }
        };
    };

    if !reply.delay.is_zero() || reply.gate.is_some() {
        // Wait, but notice when the client hangs up (an aborted request).
        let delay = reply.delay;
        let gate = reply.gate.clone();
        let sleep = async move {
            if let Some(g) = gate {
                g.opened().await;
            }
            tokio::time::sleep(delay).await;
        };
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => break,
                n = read_more(stream, buf) => {
                    match n {
                        Ok(0) | Err(_) => {
                            let mut all = shared.requests.lock().unwrap_or_else(|e| e.into_inner());
                            if let Some(r) = all.iter_mut().find(|r| r.seq == seq) {
                                r.aborted = true;
                            }
                            return Err(std::io::ErrorKind::ConnectionAborted.into());
                        }
                        Ok(_) => {}
                    }
                }
            }
        }
    }

    match reply.kind {
        ReplyKind::Error {
            status,
            error_type,
            message,
        } => {
            let err = json!({"type": "error", "error": {"type": error_type, "message": message}});
            write_response(
                stream,
                status,
                "application/json",
                &[("x-should-retry", "false")],
                err.to_string().as_bytes(),
            )
            .await
        }
        ReplyKind::Stall { text, tool } => {
            let message_id = shared.fresh_id("msg_mock_");
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n\
                 request-id: req_{message_id}\r\ntransfer-encoding: chunked\r\n\r\n"
            );
            stream.write_all(head.as_bytes()).await?;
            let mut events = sse_events(&message_id, &model, &[Block::Text(text)], "end_turn");
            // message_start, ping, the text block's start, delta and stop; no message end.
            events.truncate(5);
            if let Some(name) = tool {
                let id = shared.fresh_id("toolu_mock_");
                events.push((
                    "content_block_start".into(),
                    json!({"type": "content_block_start", "index": 1,
                           "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
                ));
            }
            for (name, data) in events {
                let event = format!("event: {name}\ndata: {data}\n\n");
                let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                stream.write_all(chunk.as_bytes()).await?;
            }
            stream.flush().await?;
            // Hold the response open until the client hangs up.
            loop {
                match read_more(stream, buf).await {
                    Ok(0) | Err(_) => {
                        let mut all = shared.requests.lock().unwrap_or_else(|e| e.into_inner());
                        if let Some(r) = all.iter_mut().find(|r| r.seq == seq) {
                            r.aborted = true;
                        }
                        return Err(std::io::ErrorKind::ConnectionAborted.into());
                    }
                    Ok(_) => {}
                }
            }
        }
        ReplyKind::Content {
            blocks,
            stop_reason,
        } => {
            let blocks: Vec<Block> = blocks
                .into_iter()
                .map(|b| match b {
                    Block::ToolUse { id, name, input } if id.is_empty() => Block::ToolUse {
                        id: shared.fresh_id("toolu_mock_"),
                        name,
                        input,
                    },
                    other => other,
                })
                .collect();
            let stop = stop_reason.unwrap_or_else(|| {
                if blocks.iter().any(|b| matches!(b, Block::ToolUse { .. })) {
                    "tool_use".to_owned()
                } else {
                    "end_turn".to_owned()
                }
            });
            let message_id = shared.fresh_id("msg_mock_");
            if stream_reply {
                write_sse(stream, &message_id, &model, &blocks, &stop).await
            } else {
                let content: Vec<Value> = blocks.iter().map(block_json).collect();
                let msg = json!({
                    "id": message_id, "type": "message", "role": "assistant", "model": model,
                    "content": content, "stop_reason": stop, "stop_sequence": null,
                    "usage": {"input_tokens": 10, "output_tokens": 12,
                              "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
                });
                write_json(stream, 200, &msg).await
            }
        }
    }
}

fn block_json(b: &Block) -> Value {
    match b {
        Block::Text(t) => json!({"type": "text", "text": t}),
        Block::ToolUse { id, name, input } => {
            json!({"type": "tool_use", "id": id, "name": name, "input": input})
        }
    }
}

/// The SSE events of one streamed message, in order.
pub fn sse_events(
    message_id: &str,
    model: &str,
    blocks: &[Block],
    stop_reason: &str,
) -> Vec<(String, Value)> {
    let mut ev = vec![
        (
            "message_start".to_owned(),
            json!({"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 10, "output_tokens": 1,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}}),
        ),
        ("ping".to_owned(), json!({"type": "ping"})),
    ];
    for (i, b) in blocks.iter().enumerate() {
        match b {
            Block::Text(text) => {
                ev.push((
                    "content_block_start".into(),
                    json!({"type": "content_block_start", "index": i,
                           "content_block": {"type": "text", "text": ""}}),
                ));
                ev.push((
                    "content_block_delta".into(),
                    json!({"type": "content_block_delta", "index": i,
                           "delta": {"type": "text_delta", "text": text}}),
                ));
            }
            Block::ToolUse { id, name, input } => {
                ev.push((
                    "content_block_start".into(),
                    json!({"type": "content_block_start", "index": i,
                           "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
                ));
                ev.push((
                    "content_block_delta".into(),
                    json!({"type": "content_block_delta", "index": i,
                           "delta": {"type": "input_json_delta", "partial_json": input.to_string()}}),
                ));
            }
        }
        ev.push((
            "content_block_stop".into(),
            json!({"type": "content_block_stop", "index": i}),
        ));
    }
    ev.push((
        "message_delta".into(),
        json!({"type": "message_delta",
               "delta": {"stop_reason": stop_reason, "stop_sequence": null},
               "usage": {"output_tokens": 12}}),
    ));
    ev.push(("message_stop".into(), json!({"type": "message_stop"})));
    ev
}

async fn write_sse(
    stream: &mut TcpStream,
    message_id: &str,
    model: &str,
    blocks: &[Block],
    stop_reason: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n\
         request-id: req_{message_id}\r\ntransfer-encoding: chunked\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await?;
    for (name, data) in sse_events(message_id, model, blocks, stop_reason) {
        let event = format!("event: {name}\ndata: {data}\n\n");
        let chunk = format!("{:x}\r\n{event}\r\n", event.len());
        stream.write_all(chunk.as_bytes()).await?;
    }
    stream.write_all(b"0\r\n\r\n").await?;
    stream.flush().await
}

async fn write_json(stream: &mut TcpStream, status: u16, body: &Value) -> std::io::Result<()> {
    write_response(
        stream,
        status,
        "application/json",
        &[],
        body.to_string().as_bytes(),
    )
    .await
}

async fn write_response(
    stream: &mut TcpStream,
    status: u16,
    content_type: &str,
    extra: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        529 => "Overloaded",
        _ => "Status",
    };
    let mut head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\
         request-id: req_mock\r\n",
        body.len()
    );
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    stream.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn roundtrip(port: u16, raw: &str) -> String {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(raw.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    fn post(path: &str, body: &Value, extra_headers: &str) -> String {
        let body = body.to_string();
        format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra_headers}\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    }

    #[test]
    fn streams_scripted_replies_and_records_requests() {
        let mock = MockMessages::start(
            Script::new()
                .on("child", Match::subagent(), Reply::text("child text"))
                .on(
                    "spawn",
                    Match::root().tool_results(0),
                    Reply::agent("d", "CHILD", Some("general-purpose"), true),
                ),
        )
        .unwrap();
        let root = json!({"model": "m", "stream": true,
                          "messages": [{"role": "user", "content": "hi"}]});
        let out = roundtrip(mock.port(), &post("/v1/messages?beta=true", &root, ""));
        assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        assert!(out.contains("event: message_start"));
        assert!(out.contains("\"name\":\"Agent\""));
        assert!(out.contains("\"stop_reason\":\"tool_use\""));
        assert!(out.contains("event: message_stop"));

        let child = json!({"model": "m", "stream": false,
                           "messages": [{"role": "user", "content": [{"type": "text", "text": "CHILD"}]}]});
        let out = roundtrip(
            mock.port(),
            &post(
                "/v1/messages?beta=true",
                &child,
                "x-claude-code-agent-id: a1\r\n",
            ),
        );
        assert!(out.contains("\"text\":\"child text\""), "{out}");

        let out = roundtrip(
            mock.port(),
            &post("/v1/messages/count_tokens", &json!({}), ""),
        );
        assert!(out.contains("input_tokens"), "{out}");

        let reqs = mock.requests();
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0].rule.as_deref(), Some("spawn"));
        assert_eq!(reqs[0].query, "beta=true");
        assert_eq!(reqs[1].role(), Role::Subagent);
        assert_eq!(reqs[1].agent_id(), Some("a1"));
        assert_eq!(reqs[1].rule.as_deref(), Some("child"));
        assert!(!reqs[2].is_messages());
    }

    #[test]
    fn chunked_request_bodies_and_errors() {
        let mock = MockMessages::start(Script::new().on(
            "boom",
            Match::any(),
            Reply::error(400, "invalid_request_error", "no"),
        ))
        .unwrap();
        let body = json!({"messages": [{"role": "user", "content": "x"}]}).to_string();
        let (a, b) = body.split_at(5);
        let raw = format!(
            "POST /v1/messages HTTP/1.1\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
             {:x}\r\n{a}\r\n{:x}\r\n{b}\r\n0\r\n\r\n",
            a.len(),
            b.len()
        );
        let out = roundtrip(mock.port(), &raw);
        assert!(out.starts_with("HTTP/1.1 400"), "{out}");
        assert!(out.contains("x-should-retry: false"));
        assert_eq!(mock.requests()[0].first_user_text(), "x");
    }
}
