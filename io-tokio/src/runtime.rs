//! Provider runtimes: one live provider process per root session, driven by a pure adapter.
//!
//! The runtime task only moves native messages: what the provider writes goes to the daemon's
//! [`tutti_core::Driver`] (which owns the root's adapter and its timers), and what the driver
//! releases is written to the provider. It keeps no session state of its own.

use futures::future::BoxFuture;
use serde_json::Value;
use std::collections::BTreeMap;
use std::process::Stdio;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};
use tutti_core::adapters::parse_line;
use tutti_core::driver::WriteFailure;
use tutti_core::model::Id;

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

/// Why a native message could not be written to a provider.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The message could not be encoded.
    #[error("encode: {0}")]
    Encode(#[from] serde_json::Error),
    /// The pipe to the process failed.
    #[error("write: {0}")]
    Io(#[from] std::io::Error),
    /// The transport refused it (closed connection, unusable message); the text carries no
    /// message content.
    #[error("{0}")]
    Transport(String),
}

/// Writes native messages to a provider.
pub trait NativeSink: Send {
    /// Sends one native message.
    fn send<'a>(&'a mut self, message: &'a Value) -> BoxFuture<'a, Result<(), WriteError>>;
}

/// A provider transport: a stream of native messages and a sink.
pub struct Transport {
    /// Incoming native messages.
    pub incoming: mpsc::Receiver<Native>,
    /// Outgoing native messages.
    pub sink: Box<dyn NativeSink>,
    /// The process, if the transport owns one (killed when the runtime ends).
    pub child: Option<Child>,
    /// Where the transport's reader counts the time it spends parsing the provider's lines.
    pub parse: ParseClock,
}

/// The time a transport's reader spends parsing provider lines into native messages: the
/// `parse` stage of `tutti_stage_seconds_total` (see [`crate::metrics::Stage::Parse`]).
///
/// A transport's reader is started with the transport, before the daemon that will own it is
/// known, so the clock starts detached and the daemon attaches its counter when it starts the
/// transport's runtime; lines read before that (none, for a provider that speaks only when
/// spoken to) are not counted. Clones share the clock.
#[derive(Clone, Default)]
pub struct ParseClock(std::sync::Arc<std::sync::OnceLock<crate::metrics::StageCounter>>);

impl ParseClock {
    /// Runs `parse`, counting its time once a counter is attached.
    pub fn time<T>(&self, parse: impl FnOnce() -> T) -> T {
        match self.0.get() {
            Some(counter) => {
                let started = std::time::Instant::now();
                let out = parse();
                counter.add(started.elapsed());
                out
            }
            None => parse(),
        }
    }

    /// Counts into `counter` from now on (the first counter attached stays).
    pub fn attach(&self, counter: crate::metrics::StageCounter) {
        let _ = self.0.set(counter);
    }
}

impl std::fmt::Debug for ParseClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParseClock")
            .field("attached", &self.0.get().is_some())
            .finish()
    }
}

struct StdinSink(ChildStdin);

impl NativeSink for StdinSink {
    fn send<'a>(&'a mut self, message: &'a Value) -> BoxFuture<'a, Result<(), WriteError>> {
        Box::pin(async move {
            let mut line = serde_json::to_vec(message)?;
            line.push(b'\n');
            self.0.write_all(&line).await?;
            Ok(self.0.flush().await?)
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
///
/// On Linux the process also gets SIGTERM when the daemon dies without stopping it (a
/// `kill -9` of `tuttid`): an agent that does not exit when its stdin closes (codex-acp) would
/// otherwise run on. Only the process itself gets the signal; its own children are its to end.
/// The signal is tied to the thread that spawns the process: `tuttid` spawns providers on its
/// engine thread, which lives until the daemon stops; a host calling this from a thread that
/// ends early (a blocking-pool thread) would see its provider end with it.
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
    #[cfg(target_os = "linux")]
    {
        let parent = libc::pid_t::try_from(std::process::id()).unwrap_or(0);
        // SAFETY: between fork and exec the closure makes only async-signal-safe calls
        // (prctl, getppid, _exit) and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The daemon died between fork and prctl: the signal will never come.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
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
    let parse = ParseClock::default();
    let clock = parse.clone();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        loop {
            match lines.next_line().await {
                Ok(Some(line)) => {
                    if line.trim().is_empty() {
                        continue;
                    }
                    let msg = clock.time(|| match parse_line(&line) {
                        Ok(v) => Native::Message(v),
                        Err(e) => Native::Garbage(e.to_string()),
                    });
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
        parse,
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
    /// Native messages the driver released (see [`tutti_core::driver::Transmit`]), written in
    /// order; if a write fails, `on_failure` is reported and the runtime ends.
    Write(Vec<Value>, Option<WriteFailure>),
    /// Stop the provider (its tree is quiescent, deleted, or the daemon stops): the process group
    /// is ended and the runtime ends without reporting a provider exit. The sender, if any, is
    /// told once the processes are gone.
    Stop(Option<std::sync::mpsc::Sender<()>>),
}

/// What a runtime tells the daemon.
#[derive(Debug)]
pub enum FromRuntime {
    /// One native message from the provider.
    Native(Value),
    /// A write of a transmit that carried `failure` failed.
    WriteFailed(WriteFailure, String),
    /// The provider is gone (the runtime ended).
    Exited(String),
}

/// The daemon's side of a runtime.
#[derive(Debug, Clone)]
pub struct RuntimeHandle {
    requests: mpsc::UnboundedSender<RuntimeMsg>,
    /// Which launch of its root this runtime is (messages of an earlier one are stale).
    generation: u64,
}

impl RuntimeHandle {
    /// Queues native messages to write; false if the runtime is gone.
    pub fn write(&self, messages: Vec<Value>, on_failure: Option<WriteFailure>) -> bool {
        self.requests
            .send(RuntimeMsg::Write(messages, on_failure))
            .is_ok()
    }

    /// Which launch of its root this runtime is.
    pub fn generation(&self) -> u64 {
        self.generation
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

/// Where a runtime sends what its provider said: straight into the daemon's engine queue, without
/// a task in between.
#[derive(Clone)]
pub struct ToDaemon(std::sync::Arc<dyn Fn(FromRuntime) -> bool + Send + Sync>);

impl ToDaemon {
    /// Wraps the function that enqueues one message (returns false once the daemon is gone).
    pub fn new(f: impl Fn(FromRuntime) -> bool + Send + Sync + 'static) -> ToDaemon {
        ToDaemon(std::sync::Arc::new(f))
    }

    /// Enqueues one message; `false` if the daemon is gone.
    pub fn send(&self, m: FromRuntime) -> bool {
        (self.0)(m)
    }
}

impl std::fmt::Debug for ToDaemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ToDaemon")
    }
}

/// Starts the runtime task of one root session: it only moves native messages between the
/// provider's transport and the daemon (the adapter lives in the daemon's
/// [`tutti_core::Driver`]), and ends the provider's process group when it stops.
pub fn start_runtime(
    root: Id,
    generation: u64,
    mut transport: Transport,
    to_daemon: ToDaemon,
) -> RuntimeHandle {
    let (tx, mut requests) = mpsc::unbounded_channel::<RuntimeMsg>();
    // One span per provider runtime with its ids (issue 22), never content.
    let span = tracing::info_span!("provider_runtime", root = %root, generation);
    tokio::spawn(tracing::Instrument::instrument(
        async move {
            let mut garbage = 0u64;
            let mut exit_reason: Option<String> = None;
            while exit_reason.is_none() {
                tokio::select! {
                    msg = transport.incoming.recv() => match msg {
                        Some(Native::Message(v)) => {
                            if !to_daemon.send(FromRuntime::Native(v)) {
                                exit_reason = Some("the daemon is gone".into());
                            }
                        }
                        Some(Native::Garbage(e)) => {
                            garbage += 1;
                            warn!(root = %root, error = %e, garbage, "provider wrote a line that is not JSON");
                        }
                        Some(Native::Exited(why)) => exit_reason = Some(why),
                        None => exit_reason = Some("transport closed".into()),
                    },
                    req = requests.recv() => match req {
                        Some(RuntimeMsg::Write(messages, on_failure)) => {
                            debug!(root = %root, messages = messages.len(), "provider write");
                            for m in &messages {
                                if let Err(e) = transport.sink.send(m).await {
                                    // "A failed session/cancel transport write is an operation failure."
                                    if let Some(f) = on_failure.clone() {
                                        let _ = to_daemon.send(FromRuntime::WriteFailed(f, e.to_string()));
                                    }
                                    exit_reason = Some(format!("write failed: {e}"));
                                    break;
                                }
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
                }
            }
            let why = exit_reason.unwrap_or_default();
            let status = match transport.child.as_mut() {
                Some(c) => end_process_group(c).await,
                None => String::new(),
            };
            warn!(root = %root, reason = %why, status = %status, "provider runtime ended");
            let _ = to_daemon.send(FromRuntime::Exited(format!("{why} ({status})")));
        },
        span,
    ));
    RuntimeHandle {
        requests: tx,
        generation,
    }
}

#[cfg(test)]
mod tests {
    use super::ParseClock;
    use crate::metrics::{Metrics, Stage};

    fn parse_seconds(m: &Metrics) -> f64 {
        m.stage_seconds()
            .into_iter()
            .find(|(name, _)| *name == "parse")
            .map(|(_, s)| s)
            .expect("a parse stage")
    }

    fn busy() -> u64 {
        // Something that takes measurable time and cannot be folded away.
        (0..20_000u64).fold(0, |a, i| std::hint::black_box(a ^ i.wrapping_mul(31)))
    }

    /// Issue 33, "where the time goes": a transport's parsing counts into the daemon's `parse`
    /// stage once the daemon attached its counter, and every clone of the clock counts into it
    /// (the reader holds one, the transport another); before that, it runs uncounted.
    #[test]
    fn a_parse_clock_counts_into_the_stage_it_was_attached_to() {
        let m = Metrics::new("test.db");
        let clock = ParseClock::default();
        let reader = clock.clone();
        assert_eq!(reader.time(|| 7), 7);
        assert_eq!(parse_seconds(&m), 0.0);
        clock.attach(m.stage_counter(Stage::Parse));
        reader.time(busy);
        let once = parse_seconds(&m);
        assert!(once > 0.0);
        // A second attach keeps the first counter.
        let other = Metrics::new("other.db");
        clock.attach(other.stage_counter(Stage::Parse));
        reader.time(busy);
        assert!(parse_seconds(&m) > once);
        assert_eq!(parse_seconds(&other), 0.0);
        // The other stages are not touched.
        for (name, s) in m.stage_seconds() {
            if name != "parse" {
                assert_eq!(s, 0.0, "{name}");
            }
        }
    }
}
