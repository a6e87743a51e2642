//! A recording ACP client for driving a real ACP agent directly over its stdio (no daemon), used
//! to capture the agent's wire shapes as golden transcripts and to check that the pinned agent
//! still speaks them.
//!
//! Every line is recorded in the transcript format `tutti replay-native` reads: `>> {json}` for a
//! message sent to the agent, `<< {json}` for one received from it, one message a line, in the
//! order they passed (a single lock orders both directions).
//!
//! The client answers nothing by itself: the test decides every response (permission answers,
//! `fs/*` requests the agent should not send since the client advertises no `fs`/`terminal`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Messages received so far plus the full transcript, guarded together.
#[derive(Default)]
struct Log {
    /// Every message received from the agent, in order.
    received: Vec<Value>,
    /// The transcript lines (`>> ...` / `<< ...`).
    lines: Vec<String>,
    /// The agent closed its stdout.
    closed: bool,
}

/// One agent process and the record of what passed over its stdio.
pub struct WireClient {
    child: Child,
    stdin: Option<ChildStdin>,
    log: Arc<(Mutex<Log>, Condvar)>,
    next_id: u64,
}

impl WireClient {
    /// Starts `program args...` in `cwd` with exactly `env` added to the inherited environment
    /// (an empty value removes that variable).
    pub fn spawn(
        program: &str,
        args: &[String],
        env: &[(String, String)],
        cwd: &Path,
    ) -> std::io::Result<WireClient> {
        let mut cmd = Command::new(program);
        // Its own process group, so a stop ends the agent's whole tree (node and the CLI).
        cmd.process_group(0);
        cmd.args(args)
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, v) in env {
            if v.is_empty() {
                cmd.env_remove(k);
            } else {
                cmd.env(k, v);
            }
        }
        let mut child = cmd.spawn()?;
        let stdout = child.stdout.take().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the agent has no stdout")
        })?;
        let stdin = child.stdin.take();
        let log: Arc<(Mutex<Log>, Condvar)> = Arc::default();
        let reader_log = log.clone();
        std::thread::Builder::new()
            .name("acp-wire-reader".into())
            .spawn(move || {
                let reader = BufReader::new(stdout);
                for line in reader.lines() {
                    let Ok(line) = line else { break };
                    let line = line.trim().to_string();
                    if line.is_empty() {
                        continue;
                    }
                    let (lock, cv) = &*reader_log;
                    let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
                    if let Ok(v) = serde_json::from_str::<Value>(&line) {
                        g.lines.push(format!("<< {v}"));
                        g.received.push(v);
                    } else {
                        // Not JSON: kept in the transcript as a received line (the replay
                        // reports it as a diagnostic), never as a message.
                        g.lines.push(format!("<< {line}"));
                    }
                    cv.notify_all();
                }
                let (lock, cv) = &*reader_log;
                lock.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
                cv.notify_all();
            })?;
        Ok(WireClient {
            child,
            stdin,
            log,
            next_id: 0,
        })
    }

    /// The agent's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one JSON-RPC message (recorded as `>> `).
    pub fn send(&mut self, msg: Value) {
        let line = msg.to_string();
        let (lock, _) = &*self.log;
        let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
        g.lines.push(format!(">> {line}"));
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{line}");
            let _ = stdin.flush();
        }
    }

    /// Sends a request; returns its id.
    pub fn request(&mut self, method: &str, params: Value) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        id
    }

    /// Sends a notification.
    pub fn notify(&mut self, method: &str, params: Value) {
        self.send(json!({"jsonrpc": "2.0", "method": method, "params": params}));
    }

    /// Answers the agent's request `id` with `result`.
    pub fn respond(&mut self, id: &Value, result: Value) {
        self.send(json!({"jsonrpc": "2.0", "id": id, "result": result}));
    }

    /// How many messages were received so far (a cursor for [`WireClient::wait_from`]).
    pub fn mark(&self) -> usize {
        let (lock, _) = &*self.log;
        lock.lock()
            .unwrap_or_else(|e| e.into_inner())
            .received
            .len()
    }

    /// Every message received so far.
    pub fn received(&self) -> Vec<Value> {
        let (lock, _) = &*self.log;
        lock.lock()
            .unwrap_or_else(|e| e.into_inner())
            .received
            .clone()
    }

    /// Waits up to `bound` for a received message at index `>= from` matching `pred`; returns
    /// it, or `None` when the bound passed or the agent closed its output first.
    pub fn wait_from(
        &self,
        from: usize,
        bound: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Option<Value> {
        let deadline = Instant::now() + bound;
        let (lock, cv) = &*self.log;
        let mut g = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(v) = g.received.iter().skip(from).find(|v| pred(v)) {
                return Some(v.clone());
            }
            let now = Instant::now();
            if g.closed || now >= deadline {
                return None;
            }
            g = cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits for the response to request `id`.
    pub fn wait_response(&self, id: u64, bound: Duration) -> Option<Value> {
        self.wait_from(0, bound, |v| {
            v.get("id") == Some(&json!(id)) && v.get("method").is_none()
        })
    }

    /// The transcript so far, one line each, ending with a newline.
    pub fn transcript(&self) -> String {
        let (lock, _) = &*self.log;
        let g = lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = g.lines.join("\n");
        out.push('\n');
        out
    }

    /// Writes the transcript to `path` (creating its folder).
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, self.transcript())
    }

    /// Closes the agent's input, then kills its process group if it did not exit within
    /// `grace`.
    pub fn stop(&mut self, grace: Duration) {
        self.stdin.take();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill_group();
    }

    /// SIGKILLs the agent's process group and reaps the agent.
    fn kill_group(&mut self) {
        // SAFETY: kill(2) of the process group this client started (its leader is the agent).
        unsafe { libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

impl Drop for WireClient {
    fn drop(&mut self) {
        self.kill_group();
    }
}

/// The `sessionUpdate` kind of a `session/update` notification, if `v` is one.
pub fn update_kind(v: &Value) -> Option<&str> {
    (v.get("method")? == "session/update")
        .then(|| v["params"]["update"]["sessionUpdate"].as_str())
        .flatten()
}

/// Whether `v` is a `session/update` of kind `kind`.
pub fn is_update(v: &Value, kind: &str) -> bool {
    update_kind(v) == Some(kind)
}
