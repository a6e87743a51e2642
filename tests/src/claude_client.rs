//! Spawns the Claude sidecar (`node sidecar.mjs`, see `io-tokio/sidecar/claude`) and talks to it in
//! JSON lines, for tests that drive the real Claude Agent SDK offline.
//!
//! Commands (stdin): `start`, `input`, `interrupt`, `stopTask`, `permission`, `endInput`, `close`.
//! Lines (stdout): `ready`, `message` (an SDKMessage verbatim), `canUseTool`,
//! `canUseToolCancelled`, `hook`, `ack`, `exited`. Every line received is kept in order
//! ([`ClaudeSidecar::seen`]) so tests can assert on sequences after the fact.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

/// The model name the tests ask for (the mock echoes whatever it is sent).
pub const TEST_MODEL: &str = "claude-sonnet-4-5";

/// The environment that keeps the CLI offline and pointed at `base_url` (`options.env` replaces
/// the CLI's whole environment, so `PATH` is carried over).
pub fn offline_env(home: &Path, base_url: &str) -> Map<String, Value> {
    let mut env = Map::new();
    if let Some(path) = std::env::var_os("PATH") {
        env.insert("PATH".into(), json!(path.to_string_lossy()));
    }
    for (k, v) in [
        ("HOME", home.to_string_lossy().into_owned()),
        ("ANTHROPIC_BASE_URL", base_url.to_owned()),
        ("ANTHROPIC_API_KEY", "dummy".to_owned()),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_owned()),
        ("DISABLE_TELEMETRY", "1".to_owned()),
        ("DISABLE_ERROR_REPORTING", "1".to_owned()),
        ("DISABLE_AUTOUPDATER", "1".to_owned()),
        ("NO_PROXY", "127.0.0.1".to_owned()),
    ] {
        env.insert(k.into(), json!(v));
    }
    env
}

/// `start` options for an offline run: `cwd`, `model`, the [`offline_env`], `settingSources: []`,
/// `persistSession: false`, `permissionMode: "default"` (the sidecar adds `canUseTool`).
pub fn offline_options(cwd: &Path, home: &Path, base_url: &str) -> Value {
    json!({
        "cwd": cwd.to_string_lossy(),
        "model": TEST_MODEL,
        "env": offline_env(home, base_url),
        "settingSources": [],
        "persistSession": false,
        "permissionMode": "default",
    })
}

/// A temporary `HOME` and working directory for one run.
pub struct OfflineDirs {
    pub home: tempfile::TempDir,
    pub cwd: tempfile::TempDir,
}

impl OfflineDirs {
    pub fn new() -> Result<Self, String> {
        let home = tempfile::Builder::new()
            .prefix("tutti-claude-home-")
            .tempdir()
            .map_err(|e| format!("temp HOME: {e}"))?;
        let cwd = tempfile::Builder::new()
            .prefix("tutti-claude-cwd-")
            .tempdir()
            .map_err(|e| format!("temp cwd: {e}"))?;
        Ok(Self { home, cwd })
    }

    pub fn options(&self, base_url: &str) -> Value {
        offline_options(self.cwd.path(), self.home.path(), base_url)
    }
}

/// A running sidecar process.
pub struct ClaudeSidecar {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::UnboundedReceiver<Value>,
    seen: Vec<Value>,
    stderr: Arc<Mutex<Vec<String>>>,
    /// The SDK version the sidecar reported in its `ready` line.
    pub sdk_version: Option<String>,
    started: Instant,
}

impl ClaudeSidecar {
    /// Runs `node <script>` and waits for its `ready` line.
    pub async fn spawn(script: &Path) -> Result<Self, String> {
        let dir: PathBuf = script
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let mut child = Command::new("node")
            .arg(script)
            .current_dir(&dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot run node {}: {e}", script.display()))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().ok_or("no sidecar stdout")?;
        let stderr = child.stderr.take().ok_or("no sidecar stderr")?;

        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if line.trim().is_empty() {
                    continue;
                }
                let value = serde_json::from_str(&line)
                    .unwrap_or_else(|_| json!({"kind": "nonjson", "length": line.len()}));
                if tx.send(value).is_err() {
                    break;
                }
            }
        });
        let err_lines = Arc::new(Mutex::new(Vec::new()));
        let sink = err_lines.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(line);
            }
        });

        let mut me = Self {
            child,
            stdin,
            lines: rx,
            seen: Vec::new(),
            stderr: err_lines,
            sdk_version: None,
            started: Instant::now(),
        };
        let ready = me
            .wait_for(Duration::from_secs(20), "the ready line", |l| {
                l["kind"] == "ready"
            })
            .await?;
        me.sdk_version = ready["sdkVersion"].as_str().map(str::to_owned);
        Ok(me)
    }

    /// Writes one raw line (a newline is added).
    pub async fn send_raw(&mut self, line: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("sidecar stdin already closed")?;
        let mut bytes = line.as_bytes().to_vec();
        bytes.push(b'\n');
        stdin
            .write_all(&bytes)
            .await
            .map_err(|e| format!("write to sidecar: {e}"))?;
        stdin
            .flush()
            .await
            .map_err(|e| format!("flush sidecar stdin: {e}"))
    }

    pub async fn send(&mut self, cmd: &Value) -> Result<(), String> {
        self.send_raw(&cmd.to_string()).await
    }

    pub async fn start(
        &mut self,
        request_id: &str,
        prompt: &str,
        options: Value,
    ) -> Result<(), String> {
        self.send(
            &json!({"op": "start", "requestId": request_id, "prompt": prompt, "options": options}),
        )
        .await
    }

    pub async fn input(&mut self, text: &str) -> Result<(), String> {
        self.send(&json!({"op": "input", "text": text})).await
    }

    pub async fn interrupt(&mut self) -> Result<(), String> {
        self.send(&json!({"op": "interrupt"})).await
    }

    pub async fn stop_task(&mut self, task_id: &str) -> Result<(), String> {
        self.send(&json!({"op": "stopTask", "taskId": task_id}))
            .await
    }

    pub async fn allow(&mut self, request_id: &str) -> Result<(), String> {
        self.send(&json!({"op": "permission", "requestId": request_id, "behavior": "allow"}))
            .await
    }

    pub async fn deny(&mut self, request_id: &str, message: &str) -> Result<(), String> {
        self.send(&json!({"op": "permission", "requestId": request_id, "behavior": "deny", "message": message}))
            .await
    }

    /// The next line from the sidecar (also kept in [`Self::seen`]).
    pub async fn next(&mut self, timeout: Duration) -> Result<Value, String> {
        match tokio::time::timeout(timeout, self.lines.recv()).await {
            Ok(Some(v)) => {
                self.seen.push(v.clone());
                Ok(v)
            }
            Ok(None) => Err(format!("sidecar stdout closed\n{}", self.diagnostics())),
            Err(_) => Err(format!(
                "no sidecar line within {timeout:?}\n{}",
                self.diagnostics()
            )),
        }
    }

    /// Reads lines until one satisfies `pred`, which it returns. `what` names it in errors.
    pub async fn wait_for(
        &mut self,
        timeout: Duration,
        what: &str,
        mut pred: impl FnMut(&Value) -> bool,
    ) -> Result<Value, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .next(left)
                .await
                .map_err(|e| format!("waiting for {what}: {e}"))?;
            if pred(&line) {
                return Ok(line);
            }
        }
    }

    /// Waits for an SDK message satisfying `pred` and returns the message itself.
    pub async fn wait_message(
        &mut self,
        timeout: Duration,
        what: &str,
        mut pred: impl FnMut(&Value) -> bool,
    ) -> Result<Value, String> {
        let line = self
            .wait_for(timeout, what, |l| {
                l["kind"] == "message" && pred(&l["message"])
            })
            .await?;
        Ok(line["message"].clone())
    }

    /// Waits for the ack of `op` and returns it (whether `ok` or not).
    pub async fn wait_ack(&mut self, op: &str, timeout: Duration) -> Result<Value, String> {
        self.wait_for(timeout, &format!("the ack of {op}"), |l| {
            l["kind"] == "ack" && l["op"] == op
        })
        .await
    }

    /// Sends `close` and waits (up to 10 s) for the process to exit; kills it otherwise.
    pub async fn close(&mut self) -> Result<ExitStatus, String> {
        let _ = self.send(&json!({"op": "close"})).await;
        self.stdin = None;
        match tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await {
            Ok(status) => status.map_err(|e| e.to_string()),
            Err(_) => {
                let _ = self.child.kill().await;
                Err("sidecar did not exit within 10 s of close".into())
            }
        }
    }

    /// Every line received so far, in order.
    pub fn seen(&self) -> &[Value] {
        &self.seen
    }

    /// The SDK messages received so far, in order.
    pub fn messages(&self) -> Vec<&Value> {
        self.seen
            .iter()
            .filter(|l| l["kind"] == "message")
            .map(|l| &l["message"])
            .collect()
    }

    /// Index in [`Self::seen`] of the first line satisfying `pred`.
    pub fn position(&self, pred: impl Fn(&Value) -> bool) -> Option<usize> {
        self.seen.iter().position(pred)
    }

    /// Index in [`Self::seen`] of the first SDK message satisfying `pred`.
    pub fn message_position(&self, pred: impl Fn(&Value) -> bool) -> Option<usize> {
        self.seen
            .iter()
            .position(|l| l["kind"] == "message" && pred(&l["message"]))
    }

    /// The sidecar's stderr so far (ids and lengths only, by design).
    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// One short label per line seen (see [`brief`]).
    pub fn transcript(&self) -> Vec<String> {
        self.seen.iter().map(brief).collect()
    }

    /// Labels of the SDK messages only (see [`message_label`]).
    pub fn message_sequence(&self) -> Vec<String> {
        self.messages().into_iter().map(message_label).collect()
    }

    /// Transcript and stderr tail, for failure messages.
    pub fn diagnostics(&self) -> String {
        let err = self.stderr_lines();
        let tail = &err[err.len().saturating_sub(20)..];
        format!(
            "after {:?}; lines seen:\n  {}\nsidecar stderr (tail):\n  {}",
            self.started.elapsed(),
            self.transcript().join("\n  "),
            tail.join("\n  ")
        )
    }
}

impl Drop for ClaudeSidecar {
    fn drop(&mut self) {
        // Closing stdin makes the sidecar close its query (which ends the CLI) and exit; SIGTERM
        // does the same; a watchdog SIGKILLs it if it lingers.
        self.stdin = None;
        if let Ok(None) = self.child.try_wait() {
            if let Some(pid) = self.child.id() {
                // SAFETY: signalling our own child process by pid.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGTERM);
                }
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_secs(5));
                    // SAFETY: as above; harmless if it already exited (and was not yet reaped).
                    unsafe {
                        libc::kill(pid as libc::pid_t, libc::SIGKILL);
                    }
                });
            }
        }
    }
}

/// A short label for one sidecar line: `message:<label>`, `canUseTool:<tool>@<agent>`,
/// `hook:<event>`, `ack:<op>:ok|err`, `exited`.
pub fn brief(line: &Value) -> String {
    match line["kind"].as_str().unwrap_or("?") {
        "message" => format!("message:{}", message_label(&line["message"])),
        "canUseTool" => format!(
            "canUseTool:{}@{}",
            line["toolName"].as_str().unwrap_or("?"),
            line["agentID"].as_str().unwrap_or("root")
        ),
        "hook" => format!("hook:{}", line["event"].as_str().unwrap_or("?")),
        "ack" => format!(
            "ack:{}:{}",
            line["op"].as_str().unwrap_or("?"),
            if line["ok"] == true { "ok" } else { "err" }
        ),
        other => other.to_owned(),
    }
}

/// A short label for one SDK message: `type[/subtype]`, plus `[status]` for task messages,
/// `(ptu)` when it carries a `parent_tool_use_id`, and the content block kinds of
/// assistant/user messages.
pub fn message_label(m: &Value) -> String {
    let mut s = m["type"].as_str().unwrap_or("?").to_owned();
    if let Some(sub) = m["subtype"].as_str() {
        s.push('/');
        s.push_str(sub);
    }
    if let Some(status) = m["status"].as_str().or(m["patch"]["status"].as_str()) {
        s.push_str(&format!("[{status}]"));
    }
    if matches!(m["type"].as_str(), Some("assistant" | "user")) {
        let kinds: Vec<String> = match &m["message"]["content"] {
            Value::String(_) => vec!["text".into()],
            Value::Array(blocks) => blocks
                .iter()
                .map(|b| {
                    let t = b["type"].as_str().unwrap_or("?");
                    match b["name"].as_str() {
                        Some(n) => format!("{t}:{n}"),
                        None => t.to_owned(),
                    }
                })
                .collect(),
            _ => vec![],
        };
        s.push_str(&format!("{{{}}}", kinds.join(",")));
    }
    if m["parent_tool_use_id"].is_string() {
        s.push_str("(ptu)");
    }
    s
}
