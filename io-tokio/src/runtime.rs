//! Provider runtimes: one live provider process per root session, driven by a pure adapter.
//!
//! The runtime task loops over three sources: native messages from the provider, requests the
//! engine decided, and the adapter's timers. It writes the adapter's native output to the
//! provider and sends normalized events and runtime answers back to the daemon as [`Input`]s.
//! It keeps no session state of its own: child targets are routed through the root's adapter.

use crate::clock::now_ms;
use futures::future::BoxFuture;
use serde_json::Value;
use std::collections::BTreeMap;
use std::process::Stdio;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};
use tutti_core::adapters::{parse_line, Adapter, AdapterOutput};
use tutti_core::model::Id;
use tutti_core::{Input, NormalizedEvent, ProviderRequest, RuntimeAnswer};

/// What comes out of a provider transport.
#[derive(Debug)]
pub enum Native {
    /// One native message.
    Message(Value),
    /// A line that could not be parsed (counted; never forwarded).
    Garbage(String),
    /// The provider is gone.
    Exited(String),
}

/// Writes native messages to a provider.
pub trait NativeSink: Send {
    /// Sends one native message.
    fn send<'a>(&'a mut self, message: &'a Value) -> BoxFuture<'a, Result<(), String>>;
}

/// A provider transport: a stream of native messages and a sink.
pub struct Transport {
    /// Incoming native messages.
    pub incoming: mpsc::Receiver<Native>,
    /// Outgoing native messages.
    pub sink: Box<dyn NativeSink>,
    /// The process, if the transport owns one (killed when the runtime ends).
    pub child: Option<Child>,
}

struct StdinSink(ChildStdin);

impl NativeSink for StdinSink {
    fn send<'a>(&'a mut self, message: &'a Value) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let mut line = serde_json::to_vec(message).map_err(|e| e.to_string())?;
            line.push(b'\n');
            self.0.write_all(&line).await.map_err(|e| e.to_string())?;
            self.0.flush().await.map_err(|e| e.to_string())
        })
    }
}

/// How to start a provider process.
#[derive(Debug, Clone, Default)]
pub struct ProcessSpec {
    /// Program and arguments.
    pub command: Vec<String>,
    /// Extra environment.
    pub env: BTreeMap<String, String>,
    /// Working directory.
    pub cwd: Option<String>,
}

/// Spawns a provider process with piped stdin/stdout (stderr inherited; killed on drop).
///
/// "Start each provider in its own process group and end the whole group when the runtime
/// stops" (issue 23): the process leads a new process group (its id is the process id), so
/// whatever it starts (the Claude CLI under the sidecar, a shell's children) is ended with it by
/// [`end_process_group`], and a Ctrl-C in the daemon's terminal reaches only the daemon, which
/// stops its runtimes itself.
pub fn spawn_piped(spec: &ProcessSpec) -> std::io::Result<(Child, ChildStdin, ChildStdout)> {
    let (program, args) = spec
        .command
        .split_first()
        .ok_or_else(|| std::io::Error::other("empty provider command"))?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(&spec.env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0)
        .kill_on_drop(true);
    if let Some(cwd) = &spec.cwd {
        cmd.current_dir(cwd);
    }
    let mut child = cmd.spawn()?;
    let stdin = child
        .stdin
        .take()
        .ok_or_else(|| std::io::Error::other("no stdin"))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| std::io::Error::other("no stdout"))?;
    Ok((child, stdin, stdout))
}

/// Spawns a process that speaks one JSON object per line on stdio.
pub fn spawn_line_process(spec: &ProcessSpec) -> std::io::Result<Transport> {
    let (child, stdin, stdout) = spawn_piped(spec)?;
    let (tx, rx) = mpsc::channel(1024);
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        loop {
            match lines.next_line().await {
                Ok(Some(line)) => {
                    if line.trim().is_empty() {
                        continue;
                    }
                    let msg = match parse_line(&line) {
                        Ok(v) => Native::Message(v),
                        Err(e) => Native::Garbage(e.to_string()),
                    };
                    if tx.send(msg).await.is_err() {
                        return;
                    }
                }
                Ok(None) => {
                    let _ = tx.send(Native::Exited("stdout closed".into())).await;
                    return;
                }
                Err(e) => {
                    let _ = tx.send(Native::Exited(format!("read error: {e}"))).await;
                    return;
                }
            }
        }
    });
    Ok(Transport {
        incoming: rx,
        sink: Box::new(StdinSink(stdin)),
        child: Some(child),
    })
}

/// How long a stopped provider's process group gets between `SIGTERM` and `SIGKILL`.
pub const STOP_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// Sends `signal` to every process of the group led by `pgid` (a no-op for a group that no
/// longer exists). Returns whether some process received it.
fn signal_group(pgid: u32, signal: libc::c_int) -> bool {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return false;
    };
    if pgid <= 1 {
        return false;
    }
    // SAFETY: kill(2) with a negative pid only sends a signal to that process group.
    unsafe { libc::kill(-pgid, signal) == 0 }
}

/// Ends a provider process and its whole process group: `SIGTERM` to the group, up to
/// [`STOP_GRACE`] for the leader to exit, then `SIGKILL` to whatever of the group is left
/// (the leader's own children included, which a leader that exited at once leaves behind).
/// Returns the leader's exit status as text.
pub async fn end_process_group(child: &mut Child) -> String {
    let pgid = child.id();
    if let Some(pgid) = pgid {
        signal_group(pgid, libc::SIGTERM);
    }
    let status = match tokio::time::timeout(STOP_GRACE, child.wait()).await {
        Ok(Ok(s)) => format!("{s}"),
        Ok(Err(e)) => format!("wait failed: {e}"),
        Err(_) => "did not exit after SIGTERM".to_string(),
    };
    if let Some(pgid) = pgid {
        signal_group(pgid, libc::SIGKILL);
    }
    let _ = child.start_kill();
    let _ = tokio::time::timeout(STOP_GRACE, child.wait()).await;
    status
}

/// What the daemon sends a runtime.
#[derive(Debug, Clone)]
pub enum RuntimeMsg {
    /// A request the engine decided.
    Request(ProviderRequest),
    /// An event of this runtime's adapter that the engine did not accept.
    Dropped(NormalizedEvent),
    /// Stop the provider (its tree is quiescent, deleted, or the daemon stops): the process group
    /// is ended and the runtime ends without reporting a provider exit. The sender, if any, is
    /// told once the processes are gone.
    Stop(Option<std::sync::mpsc::Sender<()>>),
    /// Emit the adapter's buffered text now ([`Adapter::flush_text`]); the sender is told once
    /// those events are in the daemon's queue (before a `cancelTurn` is queued behind them).
    Flush(mpsc::UnboundedSender<()>),
}

/// The daemon's side of a runtime.
#[derive(Debug, Clone)]
pub struct RuntimeHandle {
    requests: mpsc::UnboundedSender<RuntimeMsg>,
}

impl RuntimeHandle {
    /// Queues a request; false if the runtime is gone.
    pub fn send(&self, request: ProviderRequest) -> bool {
        self.requests.send(RuntimeMsg::Request(request)).is_ok()
    }

    /// Tells the adapter that the engine dropped one of its events.
    pub fn dropped(&self, event: NormalizedEvent) -> bool {
        self.requests.send(RuntimeMsg::Dropped(event)).is_ok()
    }

    /// Asks the adapter to emit its buffered text ([`RuntimeMsg::Flush`]); `done` is told when
    /// the events are queued for the engine (dropped at once if the runtime is gone).
    pub fn flush(&self, done: mpsc::UnboundedSender<()>) {
        let _ = self.requests.send(RuntimeMsg::Flush(done));
    }

    /// Whether the runtime task is still running.
    pub fn is_alive(&self) -> bool {
        !self.requests.is_closed()
    }

    /// Stops the provider: its process group is ended (see [`end_process_group`]); `done` is
    /// told when that happened (at once if the runtime is already gone). The runtime reports
    /// no provider exit for a stop.
    pub fn stop(&self, done: Option<std::sync::mpsc::Sender<()>>) {
        if let Err(mpsc::error::SendError(RuntimeMsg::Stop(Some(done)))) =
            self.requests.send(RuntimeMsg::Stop(done))
        {
            let _ = done.send(());
        }
    }
}

/// Where a runtime sends what its provider said (normalized inputs and runtime answers): straight
/// into the daemon's engine queue, without a task in between.
#[derive(Clone)]
pub struct ToDaemon(std::sync::Arc<dyn Fn(Input) -> bool + Send + Sync>);

impl ToDaemon {
    /// Wraps the function that enqueues one input (returns false once the daemon is gone).
    pub fn new(f: impl Fn(Input) -> bool + Send + Sync + 'static) -> ToDaemon {
        ToDaemon(std::sync::Arc::new(f))
    }

    /// Enqueues one input; `false` if the daemon is gone.
    pub fn send(&self, input: Input) -> bool {
        (self.0)(input)
    }
}

impl std::fmt::Debug for ToDaemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ToDaemon")
    }
}

/// Starts the runtime task of one root session.
pub fn start_runtime(
    root: Id,
    mut adapter: Box<dyn Adapter>,
    mut transport: Transport,
    to_daemon: ToDaemon,
) -> RuntimeHandle {
    let (tx, mut requests) = mpsc::unbounded_channel::<RuntimeMsg>();
    tokio::spawn(async move {
        let mut timers: BTreeMap<(i64, String), ()> = BTreeMap::new();
        let mut garbage = 0u64;
        let out = adapter.open(now_ms());
        let mut exit_reason: Option<String> = None;
        if let Err(e) = deliver(&root, out, None, &mut transport, &to_daemon, &mut timers).await {
            exit_reason = Some(format!("handshake write failed: {e}"));
        }
        while exit_reason.is_none() {
            let next_timer = timers.keys().next().map(|(at, _)| *at);
            let sleep = async {
                match next_timer {
                    Some(at) => {
                        let wait = (at - now_ms()).max(0) as u64;
                        tokio::time::sleep(std::time::Duration::from_millis(wait)).await
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                msg = transport.incoming.recv() => match msg {
                    Some(Native::Message(v)) => match adapter.on_native(now_ms(), &v) {
                        Ok(out) => {
                            if let Err(e) = deliver(&root, out, None, &mut transport, &to_daemon, &mut timers).await {
                                exit_reason = Some(format!("write failed: {e}"));
                            }
                        }
                        Err(e) => {
                            garbage += 1;
                            warn!(root = %root, error = %e, garbage, "dropped a native message");
                        }
                    },
                    Some(Native::Garbage(e)) => {
                        garbage += 1;
                        warn!(root = %root, error = %e, garbage, "provider wrote a line that is not JSON");
                    }
                    Some(Native::Exited(why)) => exit_reason = Some(why),
                    None => exit_reason = Some("transport closed".into()),
                },
                req = requests.recv() => match req {
                    Some(RuntimeMsg::Dropped(event)) => {
                        let out = adapter.on_dropped(now_ms(), &event);
                        if let Err(e) = deliver(&root, out, None, &mut transport, &to_daemon, &mut timers).await {
                            exit_reason = Some(format!("write failed: {e}"));
                        }
                    }
                    Some(RuntimeMsg::Flush(done)) => {
                        let out = adapter.flush_text(now_ms());
                        debug!(root = %root, events = out.events.len(), "buffered text flushed");
                        if let Err(e) = deliver(&root, out, None, &mut transport, &to_daemon, &mut timers).await {
                            exit_reason = Some(format!("write failed: {e}"));
                        }
                        let _ = done.send(());
                    }
                    Some(RuntimeMsg::Request(req)) => {
                        debug!(root = %root, kind = request_kind(&req), "provider request");
                        let failed_op = match &req {
                            ProviderRequest::Cancel { operation_id, .. } => Some(operation_id.clone()),
                            _ => None,
                        };
                        let guide = match &req {
                            ProviderRequest::Guide { agent_session_id, turn_id, .. } => Some((agent_session_id.clone(), turn_id.clone())),
                            _ => None,
                        };
                        let out = adapter.on_request(now_ms(), &req);
                        if let Err(e) = deliver(&root, out, failed_op.clone(), &mut transport, &to_daemon, &mut timers).await {
                            // "A failed session/cancel transport write is an operation failure."
                            if let Some((s, t)) = guide {
                                let _ = to_daemon.send(Input::Runtime(RuntimeAnswer::GuideFailed { agent_session_id: s, turn_id: t, error: e.clone() }));
                            }
                            exit_reason = Some(format!("write failed: {e}"));
                        }
                    }
                    Some(RuntimeMsg::Stop(done)) => {
                        let status = match transport.child.as_mut() {
                            Some(c) => end_process_group(c).await,
                            None => String::new(),
                        };
                        info!(root = %root, status = %status, "provider runtime stopped");
                        if let Some(done) = done {
                            let _ = done.send(());
                        }
                        return;
                    }
                    None => {
                        if let Some(c) = transport.child.as_mut() {
                            end_process_group(c).await;
                        }
                        info!(root = %root, "runtime closed by the daemon");
                        return;
                    }
                },
                _ = sleep => {
                    let now = now_ms();
                    let due: Vec<(i64, String)> = timers.range(..=(now, String::from("\u{10ffff}"))).map(|(k, _)| k.clone()).collect();
                    for key in due {
                        timers.remove(&key);
                        let out = adapter.on_timer(now, &key.1);
                        if let Err(e) = deliver(&root, out, None, &mut transport, &to_daemon, &mut timers).await {
                            exit_reason = Some(format!("write failed: {e}"));
                        }
                    }
                }
            }
        }
        let why = exit_reason.unwrap_or_default();
        let status = match transport.child.as_mut() {
            Some(c) => end_process_group(c).await,
            None => String::new(),
        };
        warn!(root = %root, reason = %why, status = %status, "provider runtime ended");
        let _ = to_daemon.send(Input::Runtime(RuntimeAnswer::ProviderExited {
            root_agent_session_id: root.clone(),
            error: format!("{why} ({status})"),
        }));
    });
    RuntimeHandle { requests: tx }
}

fn request_kind(r: &ProviderRequest) -> &'static str {
    match r {
        ProviderRequest::Start { .. } => "start",
        ProviderRequest::Guide { .. } => "guide",
        ProviderRequest::Cancel { .. } => "cancel",
        ProviderRequest::RespondInteraction { .. } => "respondInteraction",
    }
}

/// Carries out one adapter output: native writes first (a failed write of a cancel becomes
/// `cancelFailed`), then events and answers to the daemon, then timers.
async fn deliver(
    root: &Id,
    out: AdapterOutput,
    cancel_op: Option<Id>,
    transport: &mut Transport,
    to_daemon: &ToDaemon,
    timers: &mut BTreeMap<(i64, String), ()>,
) -> Result<(), String> {
    for d in &out.diagnostics {
        debug!(root = %root, diagnostic = %d, "adapter");
    }
    let mut write_error = None;
    for m in &out.native {
        if let Err(e) = transport.sink.send(m).await {
            write_error = Some(e);
            break;
        }
    }
    for e in out.events {
        let _ = to_daemon.send(Input::Event(e));
    }
    if let (Some(op), Some(e)) = (&cancel_op, &write_error) {
        let _ = to_daemon.send(Input::Runtime(RuntimeAnswer::CancelFailed {
            operation_id: op.clone(),
            error: format!("cancel write failed: {e}"),
        }));
    } else {
        for a in out.answers {
            let _ = to_daemon.send(Input::Runtime(a));
        }
    }
    for t in out.timers {
        timers.insert((t.at, t.id), ());
    }
    match write_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
