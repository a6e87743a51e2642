//! A small JSON-RPC client for `codex app-server` over stdio, for tests (and as a worked example
//! for the daemon's Codex adapter).
//!
//! Wire format (codex 0.171): one JSON object per line on stdin/stdout, JSON-RPC 2.0 shapes but
//! **without** the `"jsonrpc"` field:
//! - client request `{"id": 1, "method": "thread/start", "params": {...}}` ->
//!   response `{"id": 1, "result": {...}}` or `{"id": 1, "error": {"code": .., "message": ..}}`;
//! - client notification `{"method": "initialized"}`;
//! - server notification `{"method": "turn/started", "params": {...}, "emittedAtMs": ..}`;
//! - server request `{"id": 0, "method": "item/commandExecution/requestApproval", "params": {...}}`
//!   which the client answers with `{"id": 0, "result": {"decision": "accept"}}`. Server request
//!   ids are the server's own counter (they start at 0) and are independent of client ids.
//!
//! The reader task routes responses to the waiting [`CodexAppServer::request`] and queues every
//! notification and server request; tests pull them with [`CodexAppServer::next`] /
//! [`CodexAppServer::wait_for`], which also keep the full history for ordering assertions.
//!
//! ```no_run
//! # async fn demo(base_url: String) -> Result<(), String> {
//! use serde_json::json;
//! use std::time::Duration;
//! use tutti_tests::codex_client::{CodexAppServer, CodexConfig, SpawnOptions};
//! let home = tempfile::tempdir().unwrap();
//! CodexConfig::new(base_url).write(home.path()).unwrap();
//! let mut codex = CodexAppServer::spawn(SpawnOptions {
//!     bin: tutti_tests::providers::ensure_codex()?,
//!     codex_home: home.path().into(),
//!     cwd: home.path().into(),
//!     args: vec![],
//!     env: vec![],
//! })
//! .await?;
//! codex.initialize("tutti").await?;
//! let root = codex
//!     .thread_start(json!({
//!         "cwd": home.path(),
//!         "approvalPolicy": "never",
//!         "sandbox": "read-only",
//!         // Dotted config overrides; max_depth 2 lets children spawn grandchildren.
//!         "config": { "features.multi_agent": true, "agents.max_depth": 2 },
//!     }))
//!     .await?;
//! codex.turn_start(&root, "hello").await?;
//! let done = codex
//!     .wait_for(Duration::from_secs(20), "root turn/completed", |m| {
//!         m.is("turn/completed", &root)
//!     })
//!     .await?;
//! assert_eq!(done.turn_status(), Some("completed"));
//! codex.shutdown().await;
//! # Ok(())
//! # }
//! ```

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::{mpsc, oneshot};

/// Default time to wait for a response to a client request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);

/// The `config.toml` written into a test's `CODEX_HOME` so that codex talks only to a local
/// scripted model server.
#[derive(Clone, Debug)]
pub struct CodexConfig {
    /// `base_url` of the model provider, e.g. `http://127.0.0.1:PORT/v1`.
    pub base_url: String,
    /// `approval_policy`: `never`, `on-request`, `on-failure`, `untrusted`.
    pub approval_policy: String,
    /// `sandbox_mode`: `read-only`, `workspace-write`, `danger-full-access`.
    pub sandbox_mode: String,
    /// `[features] multi_agent_v2 = true` (v2 collaboration tools, `subAgentActivity` items).
    pub multi_agent_v2: bool,
    /// `[agents] max_depth` (children may spawn only when this is >= 2).
    pub max_depth: Option<u32>,
    /// Extra TOML inserted after the top-level keys and before `[model_providers.mock_provider]`:
    /// top-level keys first, then any tables (e.g. `"[features]\nrequest_permissions_tool = true\n"`).
    /// Do not repeat a table that [`Self::multi_agent_v2`] / [`Self::max_depth`] also write.
    pub extra_toml: String,
}

impl CodexConfig {
    /// Defaults: `approval_policy = "never"`, `sandbox_mode = "read-only"`, v1 agents.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            approval_policy: "never".into(),
            sandbox_mode: "read-only".into(),
            multi_agent_v2: false,
            max_depth: None,
            extra_toml: String::new(),
        }
    }

    pub fn approval_policy(mut self, policy: &str) -> Self {
        self.approval_policy = policy.into();
        self
    }

    pub fn sandbox_mode(mut self, mode: &str) -> Self {
        self.sandbox_mode = mode.into();
        self
    }

    pub fn multi_agent_v2(mut self, on: bool) -> Self {
        self.multi_agent_v2 = on;
        self
    }

    pub fn max_depth(mut self, depth: u32) -> Self {
        self.max_depth = Some(depth);
        self
    }

    /// See [`Self::extra_toml`].
    pub fn extra_toml(mut self, toml: &str) -> Self {
        self.extra_toml.push_str(toml);
        if !self.extra_toml.ends_with('\n') {
            self.extra_toml.push('\n');
        }
        self
    }

    /// The TOML text.
    pub fn to_toml(&self) -> String {
        let mut s = format!(
            "model = \"mock-model\"\n\
             model_provider = \"mock_provider\"\n\
             approval_policy = \"{}\"\n\
             sandbox_mode = \"{}\"\n\
             {}\n\
             [model_providers.mock_provider]\n\
             name = \"Scripted mock model server\"\n\
             base_url = \"{}\"\n\
             wire_api = \"responses\"\n\
             request_max_retries = 0\n\
             stream_max_retries = 0\n",
            self.approval_policy, self.sandbox_mode, self.extra_toml, self.base_url
        );
        if self.multi_agent_v2 {
            s.push_str("\n[features]\nmulti_agent_v2 = true\n");
        }
        if let Some(depth) = self.max_depth {
            s.push_str(&format!("\n[agents]\nmax_depth = {depth}\n"));
        }
        s
    }

    /// Writes `<codex_home>/config.toml`.
    pub fn write(&self, codex_home: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(codex_home)?;
        std::fs::write(codex_home.join("config.toml"), self.to_toml())
    }
}

/// A notification or a server request received from codex.
#[derive(Clone, Debug)]
pub struct Incoming {
    pub method: String,
    /// `Some` for a server request (answer it with [`CodexAppServer::respond`]).
    pub id: Option<Value>,
    pub params: Value,
    /// The whole message as received.
    pub raw: Value,
}

impl Incoming {
    pub fn is_request(&self) -> bool {
        self.id.is_some()
    }

    /// The owning thread: `params.threadId`, else `params.thread.id`.
    pub fn thread_id(&self) -> Option<&str> {
        self.params
            .get("threadId")
            .and_then(Value::as_str)
            .or_else(|| self.params.pointer("/thread/id").and_then(Value::as_str))
    }

    /// The turn: `params.turnId`, else `params.turn.id`.
    pub fn turn_id(&self) -> Option<&str> {
        self.params
            .get("turnId")
            .and_then(Value::as_str)
            .or_else(|| self.params.pointer("/turn/id").and_then(Value::as_str))
    }

    /// `params.item` of `item/started` / `item/completed`.
    pub fn item(&self) -> Option<&Value> {
        self.params.get("item")
    }

    /// `params.item.type`.
    pub fn item_type(&self) -> Option<&str> {
        self.item()
            .and_then(|i| i.get("type"))
            .and_then(Value::as_str)
    }

    /// `params.turn.status` of `turn/started` / `turn/completed`.
    pub fn turn_status(&self) -> Option<&str> {
        self.params.pointer("/turn/status").and_then(Value::as_str)
    }

    /// True for this method on this thread.
    pub fn is(&self, method: &str, thread_id: &str) -> bool {
        self.method == method && self.thread_id() == Some(thread_id)
    }
}

/// A JSON-RPC error answer.
#[derive(Clone, Debug)]
pub struct RpcError {
    pub code: i64,
    pub message: String,
    pub data: Option<Value>,
}

type Pending = Arc<Mutex<HashMap<i64, oneshot::Sender<Result<Value, RpcError>>>>>;

/// How to start `codex app-server`.
#[derive(Clone, Debug)]
pub struct SpawnOptions {
    pub bin: PathBuf,
    /// `CODEX_HOME` (holds `config.toml`, sessions, logs). Also used as `HOME`.
    pub codex_home: PathBuf,
    /// Working directory of the app-server (the default `cwd` of new threads).
    pub cwd: PathBuf,
    /// Extra arguments after `app-server` (e.g. `-c agents.max_depth=2`).
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

/// A running `codex app-server` child process and its JSON-RPC connection.
pub struct CodexAppServer {
    child: Child,
    stdin: Arc<tokio::sync::Mutex<Option<ChildStdin>>>,
    pending: Pending,
    incoming: mpsc::UnboundedReceiver<Incoming>,
    history: Vec<Incoming>,
    transcript: Arc<Mutex<Vec<String>>>,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    next_id: AtomicI64,
}

impl CodexAppServer {
    /// Starts `codex app-server` with piped stdio.
    pub async fn spawn(opts: SpawnOptions) -> Result<Self, String> {
        let mut cmd = Command::new(&opts.bin);
        cmd.arg("app-server")
            .args(&opts.args)
            .current_dir(&opts.cwd)
            .env("CODEX_HOME", &opts.codex_home)
            .env("HOME", &opts.codex_home)
            .env_remove("OPENAI_API_KEY")
            .env_remove("OPENAI_BASE_URL")
            .env("NO_PROXY", "127.0.0.1,localhost")
            .envs(opts.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start {} app-server: {e}", opts.bin.display()))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let stderr = child.stderr.take().ok_or("no stderr")?;

        let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
        let transcript = Arc::new(Mutex::new(Vec::new()));
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, incoming) = mpsc::unbounded_channel();

        {
            let pending = pending.clone();
            let transcript = transcript.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    lock(&transcript).push(format!("<< {line}"));
                    let Ok(msg) = serde_json::from_str::<Value>(&line) else {
                        continue;
                    };
                    dispatch(msg, &pending, &tx);
                }
                // EOF: fail every outstanding request.
                for (_, waiter) in lock(&pending).drain() {
                    let _ = waiter.send(Err(RpcError {
                        code: -1,
                        message: "codex app-server closed its stdout".into(),
                        data: None,
                    }));
                }
            });
        }
        {
            let stderr_tail = stderr_tail.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let mut tail = lock(&stderr_tail);
                    tail.push_back(line);
                    if tail.len() > 200 {
                        tail.pop_front();
                    }
                }
            });
        }
        Ok(Self {
            child,
            stdin: Arc::new(tokio::sync::Mutex::new(Some(stdin))),
            pending,
            incoming,
            history: Vec::new(),
            transcript,
            stderr_tail,
            next_id: AtomicI64::new(1),
        })
    }

    async fn send(&self, msg: &Value) -> Result<(), String> {
        let line = msg.to_string();
        lock(&self.transcript).push(format!(">> {line}"));
        let mut guard = self.stdin.lock().await;
        let stdin = guard.as_mut().ok_or("stdin already closed")?;
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .map_err(|e| format!("write to codex app-server: {e}"))?;
        stdin
            .flush()
            .await
            .map_err(|e| format!("flush to codex app-server: {e}"))
    }

    /// Sends a request and waits (up to [`REQUEST_TIMEOUT`]) for its result.
    pub async fn request(&self, method: &str, params: Value) -> Result<Value, String> {
        self.request_with_timeout(method, params, REQUEST_TIMEOUT)
            .await
    }

    /// Sends a request and waits up to `timeout` for its result. A JSON-RPC error becomes `Err`.
    pub async fn request_with_timeout(
        &self,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<Value, String> {
        match self.call(method, params, timeout).await? {
            Ok(v) => Ok(v),
            Err(e) => Err(format!(
                "{method} failed: code {} {}{}",
                e.code,
                e.message,
                e.data.map(|d| format!(" data {d}")).unwrap_or_default()
            )),
        }
    }

    /// Sends a request; the outer `Err` is a transport problem or timeout, the inner one the
    /// JSON-RPC error answer.
    pub async fn call(
        &self,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<Result<Value, RpcError>, String> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        self.send(&json!({ "id": id, "method": method, "params": params }))
            .await?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(_)) => Err(format!("{method}: connection dropped")),
            Err(_) => {
                lock(&self.pending).remove(&id);
                Err(format!(
                    "{method}: no response within {timeout:?}\n{}",
                    self.diagnostics()
                ))
            }
        }
    }

    /// Sends a notification.
    pub async fn notify(&self, method: &str, params: Option<Value>) -> Result<(), String> {
        let msg = match params {
            Some(p) => json!({ "method": method, "params": p }),
            None => json!({ "method": method }),
        };
        self.send(&msg).await
    }

    /// Answers a server request.
    pub async fn respond(&self, id: &Value, result: Value) -> Result<(), String> {
        self.send(&json!({ "id": id, "result": result })).await
    }

    /// Answers a server request with an error.
    pub async fn respond_error(&self, id: &Value, code: i64, message: &str) -> Result<(), String> {
        self.send(&json!({ "id": id, "error": { "code": code, "message": message } }))
            .await
    }

    /// The next notification or server request (recorded in [`Self::history`]).
    pub async fn next(&mut self, timeout: Duration) -> Result<Incoming, String> {
        match tokio::time::timeout(timeout, self.incoming.recv()).await {
            Ok(Some(msg)) => {
                self.history.push(msg.clone());
                Ok(msg)
            }
            Ok(None) => Err(format!(
                "codex app-server closed its output\n{}",
                self.diagnostics()
            )),
            Err(_) => Err(format!(
                "no message from codex app-server within {timeout:?}\n{}",
                self.diagnostics()
            )),
        }
    }

    /// Reads messages until one satisfies `pred`, within `timeout` overall. Skipped messages stay
    /// in [`Self::history`].
    pub async fn wait_for(
        &mut self,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&Incoming) -> bool,
    ) -> Result<Incoming, String> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next(left).await {
                Ok(msg) if pred(&msg) => return Ok(msg),
                Ok(_) => {}
                Err(e) => return Err(format!("waiting for {what}: {e}")),
            }
        }
    }

    /// Everything received so far through [`Self::next`], in order.
    pub fn history(&self) -> &[Incoming] {
        &self.history
    }

    /// The raw wire lines (`>> sent`, `<< received`) so far.
    pub fn transcript(&self) -> Vec<String> {
        lock(&self.transcript).clone()
    }

    /// The last lines of the wire transcript and of stderr, for failure messages.
    pub fn diagnostics(&self) -> String {
        let transcript = lock(&self.transcript);
        let start = transcript.len().saturating_sub(40);
        let wire: Vec<String> = transcript[start..]
            .iter()
            .map(|l| l.chars().take(400).collect())
            .collect();
        let stderr: Vec<String> = lock(&self.stderr_tail).iter().cloned().collect();
        let stderr_start = stderr.len().saturating_sub(20);
        format!(
            "--- last wire lines ---\n{}\n--- codex stderr tail ---\n{}",
            wire.join("\n"),
            stderr[stderr_start..].join("\n")
        )
    }

    /// `initialize` (with `experimentalApi`), then the `initialized` notification. Returns the
    /// initialize result (`userAgent`, `codexHome`, `platformFamily`, `platformOs`).
    pub async fn initialize(&self, client_name: &str) -> Result<Value, String> {
        let result = self
            .request(
                "initialize",
                json!({
                    "clientInfo": { "name": client_name, "title": null, "version": "0.0.1" },
                    "capabilities": { "experimentalApi": true, "requestAttestation": false },
                }),
            )
            .await?;
        self.notify("initialized", None).await?;
        Ok(result)
    }

    /// `thread/start`; returns the new thread id (`result.thread.id`).
    pub async fn thread_start(&self, params: Value) -> Result<String, String> {
        let result = self.request("thread/start", params).await?;
        result
            .pointer("/thread/id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| format!("thread/start result without thread.id: {result}"))
    }

    /// `turn/start` with one text input; returns the turn id (`result.turn.id`).
    pub async fn turn_start(&self, thread_id: &str, text: &str) -> Result<String, String> {
        let result = self
            .request(
                "turn/start",
                json!({ "threadId": thread_id, "input": [text_input(text)] }),
            )
            .await?;
        result
            .pointer("/turn/id")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| format!("turn/start result without turn.id: {result}"))
    }

    /// `turn/steer` into the active turn (fails if `expected_turn_id` is not the active turn).
    pub async fn turn_steer(
        &self,
        thread_id: &str,
        expected_turn_id: &str,
        text: &str,
    ) -> Result<Value, String> {
        self.request(
            "turn/steer",
            json!({
                "threadId": thread_id,
                "expectedTurnId": expected_turn_id,
                "input": [text_input(text)],
            }),
        )
        .await
    }

    /// `turn/interrupt`; the turn then completes with `status: "interrupted"`.
    pub async fn turn_interrupt(&self, thread_id: &str, turn_id: &str) -> Result<Value, String> {
        self.request(
            "turn/interrupt",
            json!({ "threadId": thread_id, "turnId": turn_id }),
        )
        .await
    }

    /// Closes stdin (codex exits on EOF) and waits up to 5 s, then kills.
    pub async fn shutdown(mut self) {
        self.stdin.lock().await.take();
        if tokio::time::timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// A `text` user input item as `turn/start` / `turn/steer` expect it.
pub fn text_input(text: &str) -> Value {
    json!({ "type": "text", "text": text, "text_elements": [] })
}

fn dispatch(msg: Value, pending: &Pending, tx: &mpsc::UnboundedSender<Incoming>) {
    let method = msg
        .get("method")
        .and_then(Value::as_str)
        .map(str::to_string);
    let id = msg.get("id").cloned();
    match (method, id) {
        (None, Some(id)) => {
            let Some(id) = id.as_i64() else { return };
            let Some(waiter) = lock(pending).remove(&id) else {
                return;
            };
            let answer = if let Some(err) = msg.get("error") {
                Err(RpcError {
                    code: err.get("code").and_then(Value::as_i64).unwrap_or(0),
                    message: err
                        .get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                    data: err.get("data").cloned(),
                })
            } else {
                Ok(msg.get("result").cloned().unwrap_or(Value::Null))
            };
            let _ = waiter.send(answer);
        }
        (Some(method), id) => {
            let params = msg.get("params").cloned().unwrap_or(Value::Null);
            let _ = tx.send(Incoming {
                method,
                id,
                params,
                raw: msg,
            });
        }
        (None, None) => {}
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
