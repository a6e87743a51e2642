//! A real `tuttid` process for end-to-end tests: its own temp dir, SQLite file, token file and
//! loopback port; a small blocking HTTP client; an SSE reader.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running daemon.
pub struct TestDaemon {
    child: Option<Child>,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// Bearer token.
    pub token: String,
    /// Temp dir holding the database, token and config.
    pub dir: tempfile::TempDir,
    exe: PathBuf,
    env: Vec<(String, String)>,
    config: Option<PathBuf>,
    /// `--db` when not the SQLite file in `dir` (e.g. a `postgres://` URL).
    db_arg: Option<String>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl TestDaemon {
    /// Starts `exe serve` with an optional TOML config and extra environment.
    pub fn start(exe: &str, config_toml: Option<&str>, env: &[(&str, &str)]) -> TestDaemon {
        TestDaemon::start_with_db(exe, None, config_toml, env)
    }

    /// [`TestDaemon::start`] with `--db db` (e.g. a `postgres://` URL) instead of the SQLite
    /// file in its temp dir.
    pub fn start_with_db(
        exe: &str,
        db: Option<&str>,
        config_toml: Option<&str>,
        env: &[(&str, &str)],
    ) -> TestDaemon {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = config_toml.map(|t| {
            let p = dir.path().join("config.toml");
            std::fs::write(&p, t).expect("write config");
            p
        });
        let mut d = TestDaemon {
            child: None,
            addr: String::new(),
            token: String::new(),
            dir,
            exe: PathBuf::from(exe),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            config,
            db_arg: db.map(str::to_string),
        };
        d.spawn();
        d
    }

    /// The database file.
    pub fn db(&self) -> PathBuf {
        self.dir.path().join("tutti.db")
    }

    /// Starts the daemon on a free port. A port found free can be taken by another test's
    /// daemon before this one binds it (tests run in parallel): then this daemon exits and the
    /// other one answers, refusing this daemon's token (a flaky 401 seen in a full run). Such a
    /// start is retried on another port.
    fn spawn(&mut self) {
        for _ in 0..5 {
            self.addr = format!("127.0.0.1:{}", free_port());
            if self.try_spawn_at() {
                return;
            }
            eprintln!(
                "tuttid: {} answered by another process; another port",
                self.addr
            );
            self.kill9();
        }
        panic!("tuttid did not come up on five ports (it exited, or another process answered)");
    }

    fn spawn_at(&mut self) {
        assert!(
            self.try_spawn_at(),
            "tuttid on {} exited, or another process answers there",
            self.addr
        );
    }

    /// Starts the daemon on `self.addr` and waits until it answers; `false` when what answers
    /// is not this daemon (it exited, or the answer refuses its token).
    fn try_spawn_at(&mut self) -> bool {
        let token_file = self.dir.path().join("token");
        let mut cmd = Command::new(&self.exe);
        let db = match &self.db_arg {
            Some(a) => a.into(),
            None => self.db().into_os_string(),
        };
        cmd.arg("serve")
            .arg("--db")
            .arg(db)
            .arg("--listen")
            .arg(&self.addr)
            .arg("--token-file")
            .arg(&token_file)
            .env("TUTTI_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        if let Some(c) = &self.config {
            cmd.arg("--config").arg(c);
        }
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().expect("start tuttid"));
        let start = Instant::now();
        loop {
            if let Some(Ok(Some(_))) = self.child.as_mut().map(|c| c.try_wait()) {
                return false;
            }
            if let Ok(r) = ureq::get(&format!("http://{}/healthz", self.addr)).call() {
                if r.status() == 200 {
                    break;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "tuttid did not come up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let Ok(token) = std::fs::read_to_string(&token_file) else {
            return false;
        };
        self.token = token.trim().to_string();
        self.call("GET", "/v1/providers", None).0 != 401
    }

    /// SIGKILLs the daemon (its provider processes die with their pipes).
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The daemon's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`) to the daemon and waits up to `secs` for it to
    /// exit; returns its exit status (`None` if it did not exit in time, or was not running).
    pub fn signal_and_wait(&mut self, signal: i32, secs: u64) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let pid = libc::pid_t::try_from(child.id()).ok()?;
        // SAFETY: kill(2) on our own child process.
        unsafe { libc::kill(pid, signal) };
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some(status);
            }
            if start.elapsed() > Duration::from_secs(secs) {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the daemon again on the same files.
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// SIGKILLs the daemon and starts it again on the same files and the same address (a
    /// browser page keeps its origin across the restart).
    pub fn restart_same_port(&mut self) {
        self.kill9();
        self.spawn_at();
    }

    /// A request; returns (status, JSON body).
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        call(&self.addr, &self.token, method, path, body)
    }

    /// A raw request with a string body (for malformed-body tests).
    pub fn raw(&self, method: &str, path: &str, body: &str, auth: bool) -> (u16, Value) {
        let url = format!("http://{}{}", self.addr, path);
        let mut req = ureq::request(method, &url).set("content-type", "application/json");
        if auth {
            req = req.set("authorization", &format!("Bearer {}", self.token));
        }
        match req.send_string(body) {
            Ok(r) => (r.status(), r.into_json().unwrap_or(Value::Null)),
            Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap_or(Value::Null)),
            Err(e) => panic!("{method} {path}: {e}"),
        }
    }

    /// `POST .../agent-sessions` in workspace `ws`; returns the session id.
    pub fn create(&self, ws: &str, provider: &str) -> String {
        let (st, v) = self.call(
            "POST",
            &format!("/v1/workspaces/{ws}/agent-sessions"),
            Some(json!({"provider": provider, "title": "e2e"})),
        );
        assert_eq!(st, 201, "create: {v}");
        v["session"]["id"].as_str().expect("session id").to_string()
    }

    /// Submits text; returns (reply, turnId).
    pub fn submit(&self, ws: &str, id: &str, text: &str) -> (String, String) {
        let (st, v) = self.call(
            "POST",
            &format!("/v1/workspaces/{ws}/agent-sessions/{id}/submit"),
            Some(json!({ "text": text })),
        );
        assert_eq!(st, 200, "submit: {v}");
        (
            v["reply"].as_str().unwrap_or_default().to_string(),
            v["turnId"].as_str().unwrap_or_default().to_string(),
        )
    }

    /// The session detail.
    pub fn detail(&self, ws: &str, id: &str) -> Value {
        let (st, v) = self.call(
            "GET",
            &format!("/v1/workspaces/{ws}/agent-sessions/{id}"),
            None,
        );
        assert_eq!(st, 200, "detail: {v}");
        v
    }

    /// Polls the detail until `pred` holds (panics with the last detail after `secs`).
    pub fn wait_for(
        &self,
        ws: &str,
        id: &str,
        secs: u64,
        what: &str,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = Instant::now();
        loop {
            let d = self.detail(ws, id);
            if pred(&d) {
                return d;
            }
            if start.elapsed() > Duration::from_secs(secs) {
                panic!("timed out waiting for {what}; last detail: {d:#}");
            }
            std::thread::sleep(Duration::from_millis(40));
        }
    }

    /// Reads SSE events from `after` until `n` events arrived or `secs` passed.
    pub fn events(
        &self,
        after: Option<u64>,
        last_event_id: Option<u64>,
        n: usize,
        secs: u64,
    ) -> Vec<Value> {
        let mut url = format!("http://{}/v1/events", self.addr);
        if let Some(a) = after {
            url.push_str(&format!("?after={a}"));
        }
        let mut req = ureq::get(&url)
            .set("authorization", &format!("Bearer {}", self.token))
            .timeout(Duration::from_secs(secs));
        if let Some(l) = last_event_id {
            req = req.set("last-event-id", &l.to_string());
        }
        let mut out = Vec::new();
        let Ok(resp) = req.call() else {
            return out;
        };
        let reader = BufReader::new(resp.into_reader());
        for line in reader.lines() {
            let Ok(line) = line else { break };
            if let Some(data) = line.strip_prefix("data:") {
                if let Ok(v) = serde_json::from_str::<Value>(data.trim()) {
                    out.push(v);
                    if out.len() >= n {
                        break;
                    }
                }
            }
        }
        out
    }
}

/// One authorized API request to the daemon at `addr`; returns (status, JSON body). A
/// transport error (no answer at all) fails the test.
pub fn call(
    addr: &str,
    token: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let url = format!("http://{addr}{path}");
    let req = ureq::request(method, &url)
        .set("authorization", &format!("Bearer {token}"))
        .timeout(Duration::from_secs(20));
    let r = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    match r {
        Ok(r) => (r.status(), r.into_json().unwrap_or(Value::Null)),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap_or(Value::Null)),
        Err(e) => panic!("{method} {path}: {e}"),
    }
}

impl Drop for TestDaemon {
    /// SIGKILLs the daemon, then the process groups of the providers it still ran. A test that
    /// failed halfway leaves nothing behind: a provider's own child (such as the demo agent's
    /// `TUTTI_DEMO_GRANDCHILD`) would otherwise outlive the test and hold its output pipe open.
    fn drop(&mut self) {
        let providers = self
            .pid()
            .map(crate::procs::children_of)
            .unwrap_or_default();
        self.kill9();
        for p in providers {
            if let Ok(group) = libc::pid_t::try_from(p) {
                // SAFETY: kill(2) of the process group a provider of this test's daemon led
                // (each provider leads its own group); a pid that leads no group gets ESRCH.
                unsafe { libc::kill(-group, libc::SIGKILL) };
            }
        }
    }
}

/// The turn of `session` in a detail response (its latest turn).
pub fn turn_of<'a>(detail: &'a Value, session: &str) -> Option<&'a Value> {
    let sessions = std::iter::once(&detail["session"])
        .chain(detail["childSessions"].as_array().into_iter().flatten());
    let last = sessions
        .into_iter()
        .find(|s| s["id"] == session)?
        .get("lastTurnId")?
        .clone();
    detail["turns"].as_array()?.iter().find(|t| t["id"] == last)
}

/// Every child session in a detail response.
pub fn children(detail: &Value) -> Vec<Value> {
    detail["childSessions"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The `seq` of each event.
pub fn seqs(events: &[Value]) -> Vec<u64> {
    events
        .iter()
        .map(|e| e["seq"].as_u64().expect("seq"))
        .collect()
}

/// A session detail without `eventSeq` (the outbox position at the time of the read).
pub fn tree(mut detail: Value) -> Value {
    if let Some(o) = detail.as_object_mut() {
        o.remove("eventSeq");
    }
    detail
}

/// One request to the daemon at `addr` with extra headers (no bearer token unless given),
/// waiting at most `timeout`; returns (status, `Retry-After`, JSON body), or the transport
/// error (no answer at all) as text.
pub fn try_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
    timeout: Duration,
) -> Result<(u16, Option<String>, Value), String> {
    let mut req = ureq::request(method, &format!("http://{addr}{path}")).timeout(timeout);
    for (k, v) in headers {
        req = req.set(k, v);
    }
    let r = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    let r = match r {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => return Err(e.to_string()),
    };
    let retry = r.header("retry-after").map(str::to_string);
    Ok((r.status(), retry, r.into_json().unwrap_or(Value::Null)))
}

/// [`try_request`] with a 60 s bound; a transport error fails the test.
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (u16, Option<String>, Value) {
    try_request(addr, method, path, headers, body, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// The provider processes (children) of a running daemon.
pub fn providers_of(d: &TestDaemon) -> Vec<u32> {
    crate::procs::children_of(d.pid().expect("daemon running"))
}

/// Sends `sig` (e.g. `libc::SIGSTOP`) to a running daemon.
pub fn signal(d: &TestDaemon, sig: i32) {
    let pid = libc::pid_t::try_from(d.pid().expect("daemon running")).expect("pid");
    // SAFETY: kill(2) on the test's own child process.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "signal {sig}");
}
