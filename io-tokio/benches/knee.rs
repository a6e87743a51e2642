//! `cargo bench -p tutti-tokio --bench knee`: how far one daemon goes (issue 33).
//!
//! The whole daemon, end to end: 100 simulated ACP agents (in-process tasks writing ACP wire lines:
//! `agent_message_chunk`s, `tool_call`s and `tool_call_update`s, and a subagent's `subagent_update`
//! lifecycle every 40 lines) over OS pipes to the daemon's ACP transport (the one every ACP agent's
//! stdio gets, `tutti_tokio::acp_transport`; see [`Wire`]), decided by the real ACP adapter and
//! engine on the daemon's engine thread ([`Daemon`], the `Driver` path), group-committed to a real
//! store, and streamed by the real HTTP API (`GET /v1/events`, the outbox follower) to N real SSE
//! clients over TCP (on a tokio runtime of their own, see [`clients`]).
//!
//! Each agent writes its share of the offered rate on a grid of its period, agent `a` of `n` at
//! `a / n` of each period ([`Pace`]), so the agents' lines interleave evenly at every moment.
//!
//! The offered rate (provider lines per second, all agents together) ramps up by a factor of
//! `TUTTI_KNEE_STEP` (default 1.4) from `TUTTI_KNEE_START` (default 500) until the p99 of
//! provider line → committed → streamed (every `tool_call` line carries its send time in its
//! title; each client takes the time when it reads the row) crosses 5 ms, or fewer lines were
//! delivered than offered (a step's last row reached every client more than half a second after
//! its last line was sent; a failed step runs once more, see [`step_twice_if_failed`]). The
//! knee is the highest rate that passed; then `TUTTI_KNEE_REFINE` steps (default 2) bisect
//! between it and the first rate that failed, so that a cost smaller than a whole step (the
//! 100-follower goal is under 20 %, one step is 29 %) shows. Each step runs `TUTTI_KNEE_SECS`
//! seconds (default 4: with 2 s steps the launch of 100 providers leaves a ~1.2 s tail on
//! about one row in a hundred, which the warm-up does not cover) on a fresh database.
//!
//! Then, in the same run and on the same file system, the store's ceiling for the same rows:
//! the same lines decided by a standalone `Driver` (same adapter, same engine), and the batches
//! it decided committed in groups of `MAX_GROUP` by `SqliteStore` and by raw rusqlite (the rows
//! the store writes, plain prepared upserts: `cargo bench -p tutti-sqlite`'s baseline), both
//! with the daemon's checkpoint thread; printed as events (provider lines) per second, with
//! `knee / store ceiling` and `knee / raw ceiling`. After each SQLite knee, `SqliteStore` again
//! with the group size the daemon committed at that knee (`store in the knee's groups`): with
//! tens of batches per group, most from different agents, nearly every line dirties a leaf of
//! its own in each per-session index, which groups of `MAX_GROUP` share; the ratio to it shows
//! how much of the gap is the commits' size and how much the rest of the daemon. The captured
//! lines are 200 per agent (20,000 in all; `TUTTI_KNEE_CAPTURE_LINES` per agent changes it): a
//! fresh, small database, as `cargo bench -p tutti-sqlite` writes, where a knee step's database
//! holds about 100,000 lines, whose deeper b-trees make each commit dearer.
//!
//! Followers: 1, 10 and 100 (`TUTTI_KNEE_FOLLOWERS`, comma-separated). SQLite runs with
//! `synchronous=NORMAL` (as the other daemon benchmarks, so the figures compare with the raw
//! ceiling, which writes with NORMAL); PostgreSQL on a real server started by the bench in a
//! temporary directory, with its durable defaults (`fsync`, `synchronous_commit` on); set
//! `TUTTI_KNEE_PG=0` to skip it.
//!
//! At the knee, the per-stage time share: `parse` (the transport's line reader turning lines into
//! native messages on the runtime's workers: the ACP transport's, or with
//! `TUTTI_KNEE_TRANSPORT=lines` the simulated runtime's, timed as `spawn_line_process` times
//! its own), `decide` (adapter + engine on the engine thread), `commit` (the group commits),
//! `publish` (announcing each commit to the live followers), `stream` (all followers turning rows
//! into SSE events), from the daemon's own stage counters (`tutti_stage_seconds_total`).
//!
//! Each step also prints (with `TUTTI_KNEE_VERBOSE=1`) the CPU time per line of the whole process
//! (simulated agents and SSE clients included), of the engine thread, of the commit thread and of
//! the runtime's workers (transports, HTTP, followers, simulated agents); the rates that CPU time
//! allows whatever the latency (`CPU bounds`: the whole process on all cores, each of those threads
//! on one core; the knee line prints them too); the group commits with their mean size; and where
//! the tail is (`tails`: the share of group commits, and of lines from the engine taking them to
//! their commit, over 1.6 and 6.4 ms, from the daemon's histograms); and, on SQLite, the pages the
//! group commits wrote per b-tree (`pages per group commit`, read from the `-wal` file, see
//! [`wal_pages`]). `TUTTI_KNEE_STEPS` bounds the steps, `TUTTI_KNEE_ALL=1` runs the later steps
//! after the knee too, `TUTTI_KNEE_ONLY=daemon` skips the ceilings, `TUTTI_KNEE_ONLY=groups` prints
//! only `SqliteStore`'s rate for the captured batches by group size (1 to `MAX_GROUP` batches: how
//! the store's cost per line falls as a session's lines share their index leaves), and
//! `TUTTI_KNEE_ONLY=engine` runs only the engine thread's work without threads (see
//! [`engine_only`]: decide, commit and acknowledge per line; for profilers).
//!
//! Nothing is asserted: the bench prints figures. The machine is shared and has 2 cores: compare
//! figures within one run.

/// The daemon's allocator (see `src/bin/tuttid.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[path = "../../io-sqlite/benches/shared/raw_rows.rs"]
mod raw_rows;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
use tutti_core::adapters::{parse_line, Adapter};
use tutti_core::driver::{Driver, DriverInput, LaunchSpec, Output};
use tutti_core::model::{Capabilities, Id};
use tutti_core::store::HostStore;
use tutti_core::{Command, EngineConfig, Input, PersistBatch};
use tutti_sqlite::{CheckpointMode, CheckpointPolicy, Checkpointer, OpenOptions, SqliteStore};
use tutti_tokio::daemon::{Daemon, DaemonOptions, LaunchError, ProviderFactory};
use tutti_tokio::runtime::{Native, NativeSink, ParseClock, Transport, WriteError};

const SESSION: &str = "sim";
const TOKEN: &str = "knee-bench-token-0123456789abcdef0123456789";
const P99_LIMIT_US: u64 = 5_000;

/// The simulated agent's answer to one message the adapter wrote (`initialize`, `session/new`);
/// a `session/prompt` is kept in `prompts` (root, request id) to be answered when its turn's
/// lines are done, and gets no answer now.
fn sim_answer(m: &Value, root: &Id, prompts: &mut Vec<(Id, Value)>) -> Option<Value> {
    let id = m.get("id").cloned();
    let reply = match m.get("method").and_then(Value::as_str) {
        Some("initialize") => json!({"protocolVersion": 1, "agentCapabilities": {}}),
        Some("session/new") => json!({"sessionId": SESSION}),
        Some("session/prompt") => {
            prompts.push((root.clone(), id.unwrap_or(Value::Null)));
            return None;
        }
        _ => return None,
    };
    Some(json!({"jsonrpc": "2.0", "id": id, "result": reply}))
}

/// Attaches the real ACP adapter to a launched simulated agent (the standalone `Driver` runs of
/// the ceiling and of `TUTTI_KNEE_ONLY=engine`).
fn attach_sim(driver: &mut Driver, store: &SqliteStore, now: i64, spec: LaunchSpec) {
    let a = AcpAdapter::new(spec.root.clone(), AcpConfig::default());
    let _ = driver.handle(
        DriverInput::Attach {
            now,
            root: spec.root,
            adapter: Box::new(a),
        },
        store,
    );
}

/// The commands that create agent `a`'s session and start its turn (the standalone `Driver`
/// runs of the ceiling and of `TUTTI_KNEE_ONLY=engine`).
fn agent_start(a: usize) -> [Command; 2] {
    let id: Id = format!("s{a}").into();
    [
        Command::CreateSession {
            agent_session_id: id.clone(),
            workspace_id: "w".into(),
            provider: "sim".into(),
            title: None,
            capabilities: None,
        },
        Command::Submit {
            agent_session_id: id,
            turn_id: format!("t{a}").into(),
            text: "go".into(),
        },
    ]
}

fn env_f(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Where in every 40 lines of a turn the subagent starts and ends (positions of message chunks,
/// so that every `tool_call` keeps its `tool_call_update`).
const SUBAGENT_START: usize = 6;
const SUBAGENT_END: usize = 34;

/// The `i`-th line of an agent's turn; whether it carries a send time (a `tool_call` title).
/// Of every 40 lines: 10 `tool_call`s (positions 1, 5, .., 37), each completed by the
/// `tool_call_update` two lines later, 18 `agent_message_chunk`s, and a subagent started at
/// position 6 and ended at 34. Every tool call is completed: a tool call left open stays open
/// until the turn ends, and then all 100 agents' open calls are written again as `interrupted`
/// in the same few milliseconds (before this mix, one call in ten: 2,100 rows at once at the end
/// of every step, a burst no steady state has, and the rows of the last lines waited behind it).
/// Written from templates (the bytes `json!(..).to_string()` writes for the same objects;
/// `line_json` is that reference): the simulated agents stand for other processes, so the
/// cheaper their lines are to produce, the less of the shared cores the bench itself takes.
fn line(i: usize, sent_us: u64) -> (String, bool) {
    const HEAD: &str =
        r#"{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"sim","update":"#;
    let child = i / 40;
    match i % 40 {
        SUBAGENT_START => (
            format!(
                r#"{HEAD}{{"sessionUpdate":"subagent_update","sessionId":"sub{child}","title":"helper","state":{{"state":"running"}}}}}}}}"#
            ),
            false,
        ),
        SUBAGENT_END => (
            format!(
                r#"{HEAD}{{"sessionUpdate":"subagent_update","sessionId":"sub{child}","state":{{"state":"idle","stopReason":"end_turn"}}}}}}}}"#
            ),
            false,
        ),
        k if k % 4 == 1 => (
            format!(
                r#"{HEAD}{{"sessionUpdate":"tool_call","toolCallId":"c{i}","title":"t={sent_us}","kind":"search","status":"in_progress","rawInput":{{"pattern":"fn main","path":"src"}}}}}}}}"#
            ),
            true,
        ),
        k if k % 4 == 3 => (
            format!(
                r#"{HEAD}{{"sessionUpdate":"tool_call_update","toolCallId":"c{}","title":"t={sent_us}","status":"completed","rawOutput":{{"matches":3}}}}}}}}"#,
                i - 2
            ),
            true,
        ),
        _ => (
            format!(
                r#"{HEAD}{{"sessionUpdate":"agent_message_chunk","content":{{"type":"text","text":"a line of transcript of about sixty characters, as agents write "}}}}}}}}"#
            ),
            false,
        ),
    }
}

/// The reference for [`line`]: the same objects built as JSON values (checked once at start).
fn line_json(i: usize, sent_us: u64) -> String {
    let upd = |u: Value| {
        json!({"jsonrpc": "2.0", "method": "session/update",
            "params": {"sessionId": SESSION, "update": u}})
        .to_string()
    };
    let child = format!("sub{}", i / 40);
    match i % 40 {
        SUBAGENT_START => upd(
            json!({"sessionUpdate": "subagent_update", "sessionId": child,
            "title": "helper", "state": {"state": "running"}}),
        ),
        SUBAGENT_END => upd(
            json!({"sessionUpdate": "subagent_update", "sessionId": child,
            "state": {"state": "idle", "stopReason": "end_turn"}}),
        ),
        k if k % 4 == 1 => upd(
            json!({"sessionUpdate": "tool_call", "toolCallId": format!("c{i}"),
            "title": format!("t={sent_us}"), "kind": "search", "status": "in_progress",
            "rawInput": {"pattern": "fn main", "path": "src"}}),
        ),
        k if k % 4 == 3 => upd(json!({"sessionUpdate": "tool_call_update",
            "toolCallId": format!("c{}", i - 2), "title": format!("t={sent_us}"),
            "status": "completed", "rawOutput": {"matches": 3}})),
        _ => upd(
            json!({"sessionUpdate": "agent_message_chunk", "content": {"type": "text",
            "text": "a line of transcript of about sixty characters, as agents write "}}),
        ),
    }
}

/// How many of the first `n` lines carry a send time.
fn stamped(n: usize) -> usize {
    (0..n).filter(|&i| line(i, 0).1).count()
}

struct ChannelSink(mpsc::UnboundedSender<Value>);
impl NativeSink for ChannelSink {
    fn send<'a>(&'a mut self, m: &'a Value) -> BoxFuture<'a, Result<(), WriteError>> {
        let r = self
            .0
            .send(m.clone())
            .map_err(|_| WriteError::Transport("closed".into()));
        Box::pin(async move { r })
    }
}

/// How the simulated agents' lines reach the daemon (`TUTTI_KNEE_TRANSPORT`).
#[derive(Clone, Copy, PartialEq)]
enum Wire {
    /// `acp` (the default): over OS pipes, through the ACP transport the daemon puts on every
    /// ACP agent's stdio (`tutti_tokio::acp_transport`, the `agent-client-protocol` crate's
    /// client: line framing, JSON-RPC dispatch, the schema's types).
    Acp,
    /// `lines`: handed to the runtime's channel as `spawn_line_process` hands a line provider's
    /// stdout (`parse_line` on the runtime side, timed as the `parse` stage). No ACP agent
    /// reaches the daemon that way: this is the adapter and the engine without the ACP
    /// transport's cost (and how this bench measured until December 7).
    Lines,
}

fn wire() -> Wire {
    match std::env::var("TUTTI_KNEE_TRANSPORT").as_deref() {
        Ok("lines") => Wire::Lines,
        _ => Wire::Acp,
    }
}

/// Simulated ACP agents: each answers the handshake, then writes its turn's lines at its share
/// of the offered rate (see [`Wire`] for how they reach the daemon).
struct Sim {
    epoch: Instant,
    agents: usize,
    per_agent_rate: f64,
    per_agent_lines: usize,
    wire: Wire,
}

impl Sim {
    /// The pace of the agent whose root is `root` (`s{a}`, see [`step`]).
    fn pace(&self, root: &Id) -> Pace {
        let a = root
            .strip_prefix('s')
            .and_then(|a| a.parse::<usize>().ok())
            .unwrap_or(0);
        let agents = self.agents.max(1);
        Pace {
            epoch: self.epoch,
            rate: self.per_agent_rate,
            lines: self.per_agent_lines,
            slot: (a % agents) as f64 / agents as f64,
        }
    }
}

/// When one simulated agent writes its turn's lines: `lines` lines at `rate` lines/s, on a grid
/// of periods of `1 / rate` counted from the bench's `epoch`, this agent's lines at `slot`
/// (agent `a` of `n`: `a / n`) of each period. So the agents' lines interleave evenly, at the
/// offered rate at every moment, as independent agents' lines would.
///
/// Choice (December 8): before, each agent counted its lines from its own turn's start, and
/// the turns of a step start within tens of milliseconds of each other (one submit after the
/// other). With periods longer than that the agents wrote in bursts: at 500 events/s (a line
/// every 200 ms per agent) half of the 100 agents wrote theirs within the same 10 ms of each
/// period, about 5,000 lines/s for 10 ms and far less for the rest; the low rates offered bursts,
/// not their rate. At high rates (periods of a few milliseconds) the starts' spread already
/// mixed the agents, so the grid changes little there.
#[derive(Clone, Copy)]
struct Pace {
    epoch: Instant,
    rate: f64,
    lines: usize,
    slot: f64,
}

impl Pace {
    /// When the first line is due: the first instant from now on at this agent's slot of a
    /// period. Each later line `i` is due `i / rate` after it, so the last is due less than
    /// `lines / rate` (the step's length) after the turn started, as before.
    fn first(&self) -> Instant {
        let period = 1.0 / self.rate;
        let now = self.epoch.elapsed().as_secs_f64();
        let k = ((now / period) - self.slot).ceil().max(0.0);
        self.epoch + Duration::from_secs_f64((k + self.slot) * period)
    }

    /// This agent's ticks from its first line on.
    fn schedule(&self) -> Schedule {
        let start = self.first();
        // One wake-up per line, or every millisecond at the most (then the lines due by then).
        let gap = Duration::from_secs_f64((1.0 / self.rate).max(0.001));
        let mut tick = tokio::time::interval_at(start.into(), gap);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        Schedule {
            tick,
            start,
            pace: *self,
        }
    }
}

/// A [`Pace`] being followed: its ticks.
struct Schedule {
    tick: tokio::time::Interval,
    start: Instant,
    pace: Pace,
}

impl Schedule {
    /// Waits for the next tick; how many lines are due by then, counted from the first (at
    /// most the turn's `lines`).
    async fn due(&mut self) -> usize {
        self.tick.tick().await;
        let due = (self.start.elapsed().as_secs_f64() * self.pace.rate) as usize + 1;
        due.min(self.pace.lines)
    }
}

impl ProviderFactory for Sim {
    fn capabilities(&self, _: &str) -> Option<Capabilities> {
        Some(Capabilities::default())
    }
    fn names(&self) -> Vec<String> {
        vec!["sim".into()]
    }
    fn launch(
        &self,
        _: &str,
        root: &Id,
        _: Option<&str>,
        _: Option<&str>,
    ) -> Result<(Box<dyn Adapter>, Transport), LaunchError> {
        let adapter = AcpAdapter::new(root.clone(), AcpConfig::default());
        if self.wire == Wire::Acp {
            let spawn_error = |e: std::io::Error| LaunchError::Spawn {
                provider: "sim".into(),
                error: e.to_string(),
            };
            let (agent_out, from_agent) = tokio::net::unix::pipe::pipe().map_err(spawn_error)?;
            let (to_agent, agent_in) = tokio::net::unix::pipe::pipe().map_err(spawn_error)?;
            tokio::spawn(acp_agent(agent_in, agent_out, self.pace(root)));
            let transport = tutti_tokio::acp_transport::connect_acp(from_agent, to_agent);
            return Ok((Box::new(adapter), transport));
        }
        let (to_agent, mut agent_rx) = mpsc::unbounded_channel::<Value>();
        let (to_runtime, incoming) = mpsc::channel::<Native>(4096);
        let pace = self.pace(root);
        // Timed as `spawn_line_process` times its parsing: the daemon attaches its counter.
        let parse = ParseClock::default();
        let clock = parse.clone();
        tokio::spawn(async move {
            while let Some(msg) = agent_rx.recv().await {
                let id = msg.get("id").cloned();
                let reply = |result: Value| {
                    json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string()
                };
                let line = match msg.get("method").and_then(Value::as_str) {
                    Some("initialize") => {
                        reply(json!({"protocolVersion": 1, "agentCapabilities": {}}))
                    }
                    Some("session/new") => reply(json!({"sessionId": SESSION})),
                    Some("session/prompt") => {
                        tokio::spawn(turn(to_runtime.clone(), clock.clone(), pace, id));
                        continue;
                    }
                    _ => continue,
                };
                if send_line(&to_runtime, &clock, &line).await.is_err() {
                    return;
                }
            }
        });
        Ok((
            Box::new(adapter),
            Transport {
                incoming,
                sink: Box::new(ChannelSink(to_agent)),
                child: None,
                parse,
            },
        ))
    }
}

/// One line through the runtime side: parsed as `spawn_line_process` parses a provider's stdout.
async fn send_line(tx: &mpsc::Sender<Native>, clock: &ParseClock, line: &str) -> Result<(), ()> {
    let msg = clock.time(|| match parse_line(line) {
        Ok(v) => Native::Message(v),
        Err(e) => Native::Garbage(e.to_string()),
    });
    tx.send(msg).await.map_err(|_| ())
}

/// A simulated agent on the ACP wire ([`Wire::Acp`]): reads the client's requests from its
/// input pipe, answers the handshake, and for a prompt writes its turn's lines to its output
/// pipe, one `write` per line as an agent that flushes each message does.
async fn acp_agent(
    input: tokio::net::unix::pipe::Receiver,
    mut output: tokio::net::unix::pipe::Sender,
    pace: Pace,
) {
    use tokio::io::AsyncBufReadExt;
    let (tx, mut lines) = mpsc::unbounded_channel::<String>();
    // One writer: the handshake's answers and every turn's lines, each line whole.
    tokio::spawn(async move {
        while let Some(mut l) = lines.recv().await {
            l.push('\n');
            if output.write_all(l.as_bytes()).await.is_err() {
                return;
            }
        }
    });
    let mut requests = tokio::io::BufReader::new(input).lines();
    while let Ok(Some(request)) = requests.next_line().await {
        let Ok(msg) = serde_json::from_str::<Value>(&request) else {
            continue;
        };
        let id = msg.get("id").cloned();
        let reply =
            |result: Value| json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string();
        let line = match msg.get("method").and_then(Value::as_str) {
            Some("initialize") => reply(json!({"protocolVersion": 1, "agentCapabilities": {}})),
            Some("session/new") => reply(json!({"sessionId": SESSION})),
            Some("session/prompt") => {
                tokio::spawn(acp_turn(tx.clone(), pace, id));
                continue;
            }
            _ => continue,
        };
        if tx.send(line).is_err() {
            return;
        }
    }
}

/// [`turn`] on the ACP wire: the same lines at the same times, to the agent's writer.
async fn acp_turn(tx: mpsc::UnboundedSender<String>, pace: Pace, id: Option<Value>) {
    let mut schedule = pace.schedule();
    let mut i = 0;
    while i < pace.lines {
        let due = schedule.due().await;
        while i < due {
            let (l, _) = line(i, pace.epoch.elapsed().as_micros() as u64);
            if tx.send(l).is_err() {
                return;
            }
            i += 1;
        }
    }
    let end = json!({"jsonrpc": "2.0", "id": id, "result": {"stopReason": "end_turn"}});
    let _ = tx.send(end.to_string());
}

/// An agent's turn: its lines at its [`Pace`], then the prompt's answer.
async fn turn(tx: mpsc::Sender<Native>, clock: ParseClock, pace: Pace, id: Option<Value>) {
    let mut schedule = pace.schedule();
    let mut i = 0;
    while i < pace.lines {
        let due = schedule.due().await;
        while i < due {
            let (l, _) = line(i, pace.epoch.elapsed().as_micros() as u64);
            if send_line(&tx, &clock, &l).await.is_err() {
                return;
            }
            i += 1;
        }
    }
    let end = json!({"jsonrpc": "2.0", "id": id, "result": {"stopReason": "end_turn"}});
    let _ = send_line(&tx, &clock, &end.to_string()).await;
}

/// The runtime the SSE clients run on: threads of their own, as the processes they stand for
/// would have (sharing the daemon's runtime, 100 clients' reads would queue behind and between
/// the daemon's tasks, a scheduling no separate client process has; they still share the
/// machine's cores with it).
fn clients() -> &'static tokio::runtime::Handle {
    static CLIENTS: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    CLIENTS
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("knee-client")
                .enable_all()
                .build()
                .expect("client runtime")
        })
        .handle()
}

/// One SSE client: `GET /v1/events` over a real TCP connection; the latency of every stamped row
/// (microseconds), until `expected` rows or `deadline`.
///
/// A stamped row counts once: the row its line caused. A tool call still open when the turn
/// ends is written again as `interrupted`, still titled with the stamp of the line that opened
/// it seconds before; that row is the turn end's, not the line's, and is skipped. (Before every
/// tool call of [`line`]'s mix was completed, one in ten stayed open, and counting those rows
/// put about 150 latencies of 0.1-3 s into every step, half of the 1 % the p99 may spend, and
/// let them stand in for real rows in the count of `expected`.)
async fn sse_client(
    addr: SocketAddr,
    epoch: Instant,
    expected: usize,
    deadline: Instant,
    warm: Arc<AtomicU64>,
) -> (Vec<u32>, u64, usize) {
    let mut lat = Vec::with_capacity(expected);
    let mut last = 0u64;
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return (lat, last, 0);
    };
    let req = format!(
        "GET /v1/events HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\n\
         Accept: text/event-stream\r\n\r\n"
    );
    let _ = s.set_nodelay(true);
    if s.write_all(req.as_bytes()).await.is_err() {
        return (lat, last, 0);
    }
    // The stream is read in whole chunks and scanned for the stamps, not line by line: with 100
    // clients on the same two cores, a line-by-line read (four lines per event, each its own
    // poll) cost about as much CPU as the daemon's own work per row, and the clients stand in
    // for followers that run elsewhere.
    let mut buf: Vec<u8> = Vec::with_capacity(1 << 17);
    const NEEDLE: &[u8] = b"\"name\":\"t=";
    let needle = memchr::memmem::Finder::new(NEEDLE);
    let interrupted = memchr::memmem::Finder::new(b"\"status\":\"interrupted\"");
    let mut seen = 0;
    // One timer for the whole read (a timer per read would cost more than the read itself with
    // 100 clients).
    let deadline = tokio::time::sleep_until(deadline.into());
    tokio::pin!(deadline);
    while seen < expected {
        if buf.capacity() - buf.len() < 1 << 15 {
            buf.reserve(1 << 16);
        }
        tokio::select! {
            r = s.read_buf(&mut buf) => match r {
                Ok(n) if n > 0 => {}
                _ => break,
            },
            _ = &mut deadline => break,
        }
        // Whole lines only: what follows the last newline waits for the next read.
        let Some(end) = memchr::memrchr(b'\n', &buf) else {
            continue;
        };
        let now = epoch.elapsed().as_micros() as u64;
        let mut from = 0;
        while let Some(at) = needle.find(&buf[from..=end]) {
            let at = from + at;
            let line_start = memchr::memrchr(b'\n', &buf[..at]).map_or(0, |i| i + 1);
            let line_end = at + memchr::memchr(b'\n', &buf[at..=end]).unwrap_or(end - at);
            from = line_end + 1;
            if interrupted.find(&buf[line_start..line_end]).is_some() {
                continue;
            }
            let digits = &buf[at + NEEDLE.len()..line_end];
            let n = digits
                .iter()
                .position(|b| !b.is_ascii_digit())
                .unwrap_or(digits.len());
            let sent = std::str::from_utf8(&digits[..n])
                .ok()
                .and_then(|d| d.parse::<u64>().ok());
            if let Some(sent) = sent {
                // Every row counts towards delivery; latencies only after the warm-up.
                seen += 1;
                if sent >= warm.load(Ordering::Relaxed) {
                    lat.push(now.saturating_sub(sent).min(u32::MAX as u64) as u32);
                }
                last = now;
            }
        }
        buf.drain(..=end);
    }
    (lat, last, seen)
}

/// Which store a step runs on.
#[derive(Clone, Copy)]
enum Db<'a> {
    Sqlite(&'a std::path::Path),
    Postgres(&'a tutti_pg_server::Server),
}

/// CPU time (seconds) so far of this process, of its engine thread (`tutti-engine`), of its
/// commit thread (`tutti-commit`: SQLite only, PostgreSQL commits on the engine thread, so its
/// bound prints as `inf`) and of the runtime's workers (`tokio-rt-worker`: the provider
/// transports, the HTTP API with its followers, and the simulated agents), from `/proc` (clock
/// ticks: coarse, but a step runs seconds). Zeros where `/proc` is missing.
fn cpu_seconds() -> (f64, f64, f64, f64) {
    let ticks = |stat: &str| -> Option<f64> {
        // Fields after the command name (which ends with the last ')'): utime is the 12th, stime
        // the 13th.
        let rest = &stat[stat.rfind(')')? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        Some(f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?)
    };
    let hz = 100.0;
    let total = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| ticks(&s))
        .unwrap_or(0.0);
    let (mut engine, mut commit, mut workers) = (0.0, 0.0, 0.0);
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for t in tasks.flatten() {
            let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
                continue;
            };
            if stat.contains("(tutti-engine)") {
                engine += ticks(&stat).unwrap_or(0.0);
            } else if stat.contains("(tutti-commit)") {
                commit += ticks(&stat).unwrap_or(0.0);
            } else if stat.contains("(tokio-rt-worker)") {
                workers += ticks(&stat).unwrap_or(0.0);
            }
        }
    }
    (total / hz, engine / hz, commit / hz, workers / hz)
}

/// One step's figures.
struct StepResult {
    offered: f64,
    delivered: f64,
    p50_ms: f64,
    p99_ms: f64,
    complete: bool,
    stages: Vec<(&'static str, f64)>,
    /// Group commits in the step, and their mean size (batches), from the daemon's metrics.
    groups: (f64, f64),
    /// Where the tail is (`TUTTI_KNEE_VERBOSE=1`): the share of group commits, and of provider
    /// lines from the engine taking them to their commit, that took over 1.6 and over 6.4 ms
    /// (bucket bounds of the daemon's histograms).
    tails: [(f64, f64); 2],
    /// CPU microseconds per line: the whole process (simulated agents and clients included),
    /// the engine thread alone, the commit thread alone, and the runtime's workers.
    cpu_us: (f64, f64, f64, f64),
    /// SQLite only, with `TUTTI_KNEE_VERBOSE=1`: the pages group commits wrote, per b-tree
    /// (see [`wal_pages`]).
    wal: Option<String>,
}

impl StepResult {
    fn passed(&self) -> bool {
        self.complete && self.p99_ms * 1000.0 <= P99_LIMIT_US as f64
    }

    /// The rates (lines/s) this step's CPU time per line allows, whatever the latency: the whole
    /// process on all the machine's cores, the engine thread on one core, the commit thread on
    /// one core. A knee can be no higher than the lowest of them.
    fn bounds(&self) -> (f64, f64, f64) {
        let cores = cores();
        let rate = |us: f64| if us > 0.0 { 1e6 / us } else { f64::INFINITY };
        (
            cores * rate(self.cpu_us.0),
            rate(self.cpu_us.1),
            rate(self.cpu_us.2),
        )
    }

    /// `bounds` as printed.
    fn bounds_text(&self) -> String {
        let (process, engine, commit) = self.bounds();
        format!(
            "CPU bounds: process {process:.0}/s, engine thread {engine:.0}/s, commit thread {commit:.0}/s"
        )
    }
}

/// The most the knee could be against `store_ceiling` with the CPU per line the daemon spent at
/// the knee besides its commits (the whole process, simulated agents and clients included,
/// less the commit thread): if every commit cost what it costs per line in the ceiling's groups
/// and the machine's cores did nothing else, the rate that CPU allows, with no margin for the
/// p99. Returns that CPU per line (us) and the rate (lines/s). A ratio above this bound needs
/// the work besides the commits cut, not the commits.
fn ratio_bound(k: &StepResult, store_ceiling: f64) -> (f64, f64) {
    let rest = (k.cpu_us.0 - k.cpu_us.2).max(0.0);
    (rest, cores() * 1e6 / (rest + 1e6 / store_ceiling))
}

/// The machine's cores (1 when unknown).
fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1, |n| n.get()) as f64
}

fn pct(v: &[u32], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() as f64 - 1.0) * p) as usize] as f64 / 1000.0
}

async fn step(db: Db<'_>, agents: usize, followers: usize, rate: f64, secs: f64) -> StepResult {
    let epoch = Instant::now();
    let per_agent_rate = rate / agents as f64;
    let per_agent_lines = ((per_agent_rate * secs) as usize).max(4);
    let opts = |path: std::path::PathBuf| DaemonOptions {
        durability: tutti_tokio::config::Durability::Normal,
        max_providers: Some(usize::MAX),
        db: path,
        providers: Arc::new(Sim {
            epoch,
            agents,
            per_agent_rate,
            per_agent_lines,
            wire: wire(),
        }),
        engine: EngineConfig::default(),
        idle_timeout: None,
        retention: Default::default(),
    };
    let mut sqlite_path = None;
    let daemon = match db {
        Db::Sqlite(dir) => {
            // A new file per step (a name from the time since `epoch` could repeat, and a stale
            // `-wal` of an earlier step's file would then be read with the new one).
            static STEP: AtomicU64 = AtomicU64::new(0);
            let path = dir.join(format!("knee-{}.db", STEP.fetch_add(1, Ordering::Relaxed)));
            for ext in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{ext}", path.display()));
            }
            sqlite_path = Some(path.clone());
            Daemon::start(opts(path)).expect("daemon starts")
        }
        Db::Postgres(server) => {
            let url = tokio::task::block_in_place(|| server.create_database()).expect("database");
            let dir = std::env::temp_dir();
            tutti_tokio::postgres::start(
                &url,
                opts(dir.join("knee-pg")),
                tutti_tokio::postgres::Leases::new(
                    format!("knee-{}", std::process::id()),
                    "127.0.0.1:1".into(),
                    tutti_tokio::postgres::DEFAULT_LEASE,
                ),
            )
            .expect("daemon starts on PostgreSQL")
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("listen");
    let addr = listener.local_addr().expect("address");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let app = tutti_tokio::api::router_with_shutdown(daemon.clone(), TOKEN.into(), stop_rx.clone());
    // The daemon's own HTTP server (connection limits, `TCP_NODELAY`).
    let server = tokio::spawn(tutti_tokio::connections::serve(
        listener,
        app,
        tutti_tokio::connections::HttpLimits::default(),
        stop_rx,
    ));
    // Sessions first (their rows are not measured), then the clients, then the turns.
    for a in 0..agents {
        daemon
            .call(Input::Command(Command::CreateSession {
                agent_session_id: format!("s{a}").into(),
                workspace_id: "w".into(),
                provider: "sim".into(),
                title: None,
                capabilities: None,
            }))
            .await
            .expect("create");
    }
    let expected = agents * stamped(per_agent_lines);
    let deadline = Instant::now() + Duration::from_secs_f64(secs * 2.0 + 5.0);
    let warm = Arc::new(AtomicU64::new(u64::MAX));
    let clients: Vec<_> = (0..followers)
        .map(|_| clients().spawn(sse_client(addr, epoch, expected, deadline, warm.clone())))
        .collect();
    // Let every client's stream open before the load starts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stages_before = daemon.metrics().stage_seconds();
    let (cpu_before, _, _, workers_before) = cpu_seconds();
    for a in 0..agents {
        daemon
            .call(Input::Command(Command::Submit {
                agent_session_id: format!("s{a}").into(),
                turn_id: format!("t{a}").into(),
                text: "go".into(),
            }))
            .await
            .expect("submit");
    }
    // Each agent writes its lines over `secs` from its own turn's start, so the last line is
    // due `secs` after the last turn started: the step's time counts from there. (Counted from
    // the first submit, the turn starts themselves were charged to the step: on PostgreSQL 100
    // submits, each its own durable commit, can take over the half second of slack, and a step
    // whose rows all arrived in time was reported as falling behind.)
    let started = epoch.elapsed().as_micros() as u64;
    // Latencies count from a warm-up after the last turn started (the provider launches and
    // handshakes of all agents are not the steady state measured).
    let warm_up = (secs * 0.2).min(0.5);
    warm.store(
        epoch.elapsed().as_micros() as u64 + (warm_up * 1e6) as u64,
        Ordering::Relaxed,
    );
    let mut lat = Vec::with_capacity(expected * followers);
    let mut last = 0;
    let mut complete = true;
    for c in clients {
        let (l, t, seen) = c.await.expect("client");
        complete &= seen >= expected;
        last = last.max(t);
        lat.extend(l);
    }
    // The engine and commit threads started with this step's daemon: all their time is this
    // step's.
    let (cpu_after, engine_cpu, commit_cpu, workers_after) = cpu_seconds();
    let metric = |text: &str, name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let text = daemon.metrics_text().await.unwrap_or_default();
    let n = metric(&text, "tutti_group_commit_batches_count");
    let groups = (
        n,
        metric(&text, "tutti_group_commit_batches_sum") / n.max(1.0),
    );
    // The share of a seconds histogram's observations above the bucket bound `le`.
    let over = |name: &str, le: &str| -> f64 {
        let all = metric(&text, &format!("{name}_count"));
        let within = metric(&text, &format!("{name}_bucket{{le=\"{le}\"}}"));
        (all - within) / all.max(1.0)
    };
    let tails = [
        (
            over("tutti_group_commit_seconds", "0.0016"),
            over("tutti_group_commit_seconds", "0.0064"),
        ),
        (
            over("tutti_provider_line_to_commit_seconds", "0.0016"),
            over("tutti_provider_line_to_commit_seconds", "0.0064"),
        ),
    ];
    let after = daemon.metrics().stage_seconds();
    // Read while the daemon still runs: at its shutdown the WAL is checkpointed and starts over.
    let wal = sqlite_path
        .filter(|_| std::env::var_os("TUTTI_KNEE_VERBOSE").is_some())
        .map(|p| wal_pages(&p).unwrap_or_else(|e| format!("not read ({e})")));
    let _ = stop_tx.send(true);
    daemon.shutdown().await;
    server.abort();
    lat.sort_unstable();
    let lines = (agents * per_agent_lines) as f64;
    let took = last.saturating_sub(started) as f64 / 1e6;
    // Delivered below offered: the last row reached the clients well after the last line was
    // due (half a second of slack for the ramp of the agents' timers).
    let delivered = if took > 0.0 {
        lines / took.max(secs)
    } else {
        0.0
    };
    complete &= took <= secs + 0.5;
    let stages = stages_before
        .iter()
        .zip(after.iter())
        .map(|((name, b), (_, a))| (*name, a - b))
        .collect();
    StepResult {
        offered: lines / secs,
        delivered,
        p50_ms: pct(&lat, 0.5),
        p99_ms: pct(&lat, 0.99),
        complete,
        stages,
        groups,
        tails,
        cpu_us: (
            (cpu_after - cpu_before) * 1e6 / lines,
            engine_cpu * 1e6 / lines,
            commit_cpu * 1e6 / lines,
            (workers_after - workers_before) * 1e6 / lines,
        ),
        wal,
    }
}

/// The pages the group commits of a step wrote, per b-tree: what makes a small group commit
/// cost more per row than the store's ceiling (every commit writes each page it changed whole;
/// appends to one index in many places, one per session or tree, change many pages).
///
/// It reads the frames still in the database's `-wal` file (each names the page it holds, and
/// the last frame of a commit is marked; after the WAL started over, the file holds the newest
/// commits followed by older ones it has not overwritten yet, all of this step) and names each
/// page's b-tree from SQLite's `dbstat` table on the database as it is now.
fn wal_pages(db: &std::path::Path) -> Result<String, String> {
    let bytes = std::fs::read(format!("{}-wal", db.display())).map_err(|e| e.to_string())?;
    let word = |at: usize| -> Option<u32> {
        Some(u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
    };
    let page_size = word(8).ok_or("no WAL header")? as usize;
    let (mut at, mut commits, mut frames) = (32, 0usize, Vec::new());
    while at + 24 + page_size <= bytes.len() {
        let (Some(page), Some(commit)) = (word(at), word(at + 4)) else {
            break;
        };
        if page == 0 {
            break;
        }
        frames.push(page);
        commits += usize::from(commit != 0);
        at += 24 + page_size;
    }
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map_err(|e| e.to_string())?;
    let names: std::collections::HashMap<u32, String> = conn
        .prepare("SELECT pageno, name FROM dbstat")
        .and_then(|mut s| {
            s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<Result<_, _>>()
        })
        .map_err(|e| e.to_string())?;
    let mut by_tree: std::collections::HashMap<&str, usize> = Default::default();
    for page in &frames {
        *by_tree
            .entry(names.get(page).map_or("(freed)", |n| n.as_str()))
            .or_default() += 1;
    }
    let mut by_tree: Vec<_> = by_tree.into_iter().collect();
    by_tree.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let per = |n: usize| n as f64 / commits.max(1) as f64;
    let top: Vec<String> = by_tree
        .iter()
        .take(6)
        .map(|(name, n)| format!("{name} {:.1}", per(*n)))
        .collect();
    Ok(format!(
        "pages per group commit {:.1} ({commits} commits in the -wal): {}",
        per(frames.len()),
        top.join(", ")
    ))
}

/// Ramps the offered rate until a step fails; returns the last step that passed.
async fn ramp(db: Db<'_>, label: &str, followers: usize) -> Option<StepResult> {
    let agents = env_f("TUTTI_KNEE_AGENTS", 100.0).max(1.0) as usize;
    let secs = env_f("TUTTI_KNEE_SECS", 4.0).max(0.5);
    let factor = env_f("TUTTI_KNEE_STEP", 1.4).max(1.05);
    let mut rate = env_f("TUTTI_KNEE_START", 500.0).max(100.0);
    let mut knee: Option<StepResult> = None;
    // The first rate that failed after the last one that passed.
    let mut first_failed: Option<f64> = None;
    for _ in 0..env_f("TUTTI_KNEE_STEPS", 20.0) as usize {
        let r = step_twice_if_failed(db, agents, followers, rate, secs, label).await;
        rate *= factor;
        if r.passed() && first_failed.is_none() {
            knee = Some(r);
            continue;
        }
        first_failed.get_or_insert(r.offered);
        // `TUTTI_KNEE_ALL=1`: the later steps run too (figures past the knee).
        if std::env::var_os("TUTTI_KNEE_ALL").is_none() {
            break;
        }
    }
    // Refinement (`TUTTI_KNEE_REFINE` steps, default 2): bisect (geometrically) between the
    // knee and the first step that failed, so that the knee is known to a factor of
    // `TUTTI_KNEE_STEP^(1/2^n)` (1.09 by default) rather than to a whole step. A refinement
    // step that passes raises the knee; one that fails lowers the upper bound.
    if let (Some(mut failed), Some(mut passed)) = (first_failed, knee.as_ref().map(|k| k.offered)) {
        for _ in 0..env_f("TUTTI_KNEE_REFINE", 2.0) as usize {
            let mid = (passed * failed).sqrt();
            let r = step_twice_if_failed(db, agents, followers, mid, secs, label).await;
            if r.passed() {
                passed = mid;
                knee = Some(r);
            } else {
                failed = mid;
            }
        }
    }
    knee
}

/// One step of a ramp, run once more when it fails; it counts as failed only if it fails
/// again. A cost that is there at every run fails it twice; a single burst of the machine (a
/// core taken by another process for tens of milliseconds) does not set the knee, though a
/// noisy phase that outlasts both runs still does. Before, only the first step ran twice (it
/// had failed on single tails, p99 10.9 and 16.8 ms at p50 0.4-1.0 ms, that three reruns did
/// not show), and one burst anywhere else ended a ramp: in one full run the 10-follower ramp
/// failed at 20,225 events/s on p99 8.0 ms at p50 0.85 ms and reported 18,575, against
/// 30,800-39,675 in the day's other runs.
async fn step_twice_if_failed(
    db: Db<'_>,
    agents: usize,
    followers: usize,
    rate: f64,
    secs: f64,
    label: &str,
) -> StepResult {
    let r = step(db, agents, followers, rate, secs).await;
    report(label, followers, &r);
    if r.passed() {
        return r;
    }
    println!("    (the step failed; it runs once more)");
    let again = step(db, agents, followers, rate, secs).await;
    report(label, followers, &again);
    again
}

/// Prints one step's figures (`TUTTI_KNEE_VERBOSE=1`: with CPU, tails and pages).
fn report(label: &str, followers: usize, r: &StepResult) {
    println!(
        "  {label}, {followers:>3} follower(s): offered {:>7.0}/s delivered {:>7.0}/s p50 {:>6.2} ms p99 {:>7.2} ms{}",
        r.offered,
        r.delivered,
        r.p50_ms,
        r.p99_ms,
        if r.passed() { "" } else { "  <- past the knee" }
    );
    if std::env::var_os("TUTTI_KNEE_VERBOSE").is_none() {
        return;
    }
    println!(
        "    time: {}; CPU {:.1} us/line (engine thread {:.1}, commit thread {:.1}, runtime workers {:.1}); {:.0} group commits of {:.1} batches",
        shares(r),
        r.cpu_us.0,
        r.cpu_us.1,
        r.cpu_us.2,
        r.cpu_us.3,
        r.groups.0,
        r.groups.1
    );
    println!("    {}", r.bounds_text());
    println!(
        "    tails: commits over 1.6 / 6.4 ms {:.2} / {:.2} %; line to commit over 1.6 / 6.4 ms {:.2} / {:.2} %",
        r.tails[0].0 * 100.0,
        r.tails[0].1 * 100.0,
        r.tails[1].0 * 100.0,
        r.tails[1].1 * 100.0
    );
    if let Some(wal) = &r.wal {
        println!("    {wal}");
    }
}

/// Each stage's share of the time of a step, and its seconds.
fn shares(k: &StepResult) -> String {
    let total: f64 = k.stages.iter().map(|(_, s)| s).sum();
    k.stages
        .iter()
        .map(|(n, s)| format!("{n} {:.0} % ({s:.2} s)", 100.0 * s / total.max(1e-9)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn print_knee(label: &str, followers: usize, knee: &Option<StepResult>) -> f64 {
    let Some(k) = knee else {
        println!("knee ({label}, {followers} followers): below the first step");
        return 0.0;
    };
    println!(
        "knee ({label}, {followers} followers): {:.0} events/s (p99 {:.2} ms); time at the knee: {}; CPU {:.1} us/line (engine thread {:.1}, commit thread {:.1}, runtime workers {:.1}); {}",
        k.offered,
        k.p99_ms,
        shares(k),
        k.cpu_us.0,
        k.cpu_us.1,
        k.cpu_us.2,
        k.cpu_us.3,
        k.bounds_text()
    );
    k.offered
}

/// The batches a standalone driver (same adapter, same engine) decides for the same lines, and
/// how many lines that was.
fn capture(agents: usize, lines: usize, dir: &std::path::Path) -> (Vec<PersistBatch>, usize) {
    let path = dir.join("capture.db");
    let mut store = SqliteStore::open(&path).expect("capture store");
    let mut driver = Driver::new();
    let mut batches = Vec::new();
    let mut now = 1;
    let mut prompts: Vec<(Id, Value)> = Vec::new();
    let commit = |driver: &mut Driver,
                  store: &mut SqliteStore,
                  batches: &mut Vec<PersistBatch>,
                  prompts: &mut Vec<(Id, Value)>,
                  now: i64| loop {
        let mut any = false;
        while let Some(out) = driver.poll_output() {
            any = true;
            match out {
                Output::Persist(id) => {
                    let Some(b) = driver.batch(id).cloned() else {
                        continue;
                    };
                    let p = store.apply_group(&[&b], true).expect("capture commit");
                    batches.push(b);
                    let committed = DriverInput::Committed {
                        batch: id,
                        published: p.into_iter().next().unwrap_or_default(),
                    };
                    let _ = driver.handle(committed, &*store);
                }
                Output::Launch(spec) => attach_sim(driver, store, now, spec),
                Output::Transmit(t) => {
                    for m in t.messages {
                        let Some(l) = sim_answer(&m, &t.root, prompts) else {
                            continue;
                        };
                        let l = l.to_string();
                        let _ = driver.handle(
                            DriverInput::Line {
                                now,
                                root: &t.root,
                                line: &l,
                            },
                            &*store,
                        );
                    }
                }
                _ => {}
            }
        }
        if !any {
            break;
        }
    };
    for a in 0..agents {
        for input in agent_start(a) {
            let _ = driver.handle(
                DriverInput::Host {
                    now,
                    input: Input::Command(input),
                    reply: None,
                },
                &store,
            );
            commit(&mut driver, &mut store, &mut batches, &mut prompts, now);
        }
    }
    // The daemon steps' order: the agents' lines interleaved.
    let mut sent = 0;
    for i in 0..lines {
        now += 1;
        for a in 0..agents {
            let (l, _) = line(i, now as u64);
            let _ = driver.handle(
                DriverInput::Line {
                    now,
                    root: &format!("s{a}"),
                    line: &l,
                },
                &store,
            );
            sent += 1;
            commit(&mut driver, &mut store, &mut batches, &mut prompts, now);
        }
    }
    for (root, id) in std::mem::take(&mut prompts) {
        let l = json!({"jsonrpc": "2.0", "id": id, "result": {"stopReason": "end_turn"}});
        let _ = driver.handle(
            DriverInput::Line {
                now,
                root: &root,
                line: &l.to_string(),
            },
            &store,
        );
        sent += 1;
        commit(&mut driver, &mut store, &mut batches, &mut prompts, now);
    }
    (batches, sent)
}

/// The engine thread's own work for the same lines, without threads (`TUTTI_KNEE_ONLY=engine`):
/// a standalone `Driver` decides the lines already parsed (one per agent per round, as the
/// daemon's rounds take them), commits each round's batches in one group, acknowledges them and
/// takes what they released. Prints microseconds per line per part; for profilers,
/// `measured_decide` and `measured_commit` are the parts (`callgrind --toggle-collect`).
fn engine_only(agents: usize, lines: usize, dir: &std::path::Path) {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let path = dir.join(format!("engine-{}.db", RUN.fetch_add(1, Ordering::Relaxed)));
    let mut store = SqliteStore::open_with(
        &path,
        &OpenOptions::new().synchronous(tutti_sqlite::Synchronous::Normal),
    )
    .expect("engine store");
    let mut driver = Driver::new();
    let mut prompts: Vec<(Id, Value)> = Vec::new();
    let mut decide = Duration::ZERO;
    let (mut commit, mut ack) = (Duration::ZERO, Duration::ZERO);
    let mut groups = 0usize;
    // Settles the driver as the daemon's `settle` does: the batches first, one group, then what
    // committing them released.
    let settle = |driver: &mut Driver,
                  store: &mut SqliteStore,
                  prompts: &mut Vec<(Id, Value)>,
                  now: i64,
                  commit: &mut Duration,
                  ack: &mut Duration| loop {
        let t = Instant::now();
        let mut ids = Vec::new();
        let mut any = false;
        while let Some(out) = driver.poll_output() {
            match out {
                Output::Persist(id) => ids.push(id),
                Output::Launch(spec) => {
                    any = true;
                    attach_sim(driver, store, now, spec);
                }
                Output::Transmit(t) => {
                    any = true;
                    for m in t.messages {
                        let Some(l) = sim_answer(&m, &t.root, prompts) else {
                            continue;
                        };
                        let _ = driver.handle(
                            DriverInput::Native {
                                now,
                                root: &t.root,
                                message: &l,
                            },
                            &*store,
                        );
                    }
                }
                _ => any = true,
            }
        }
        *ack += t.elapsed();
        if ids.is_empty() && !any {
            break;
        }
        if ids.is_empty() {
            continue;
        }
        let t = Instant::now();
        let published = measured_commit(driver, store, &ids);
        *commit += t.elapsed();
        let t = Instant::now();
        for (id, p) in ids.iter().zip(published) {
            let _ = driver.handle(
                DriverInput::Committed {
                    batch: *id,
                    published: p,
                },
                &*store,
            );
        }
        *ack += t.elapsed();
    };
    let mut now = 1;
    for a in 0..agents {
        for input in agent_start(a) {
            let _ = driver.handle(
                DriverInput::Host {
                    now,
                    input: Input::Command(input),
                    reply: None,
                },
                &store,
            );
            settle(
                &mut driver,
                &mut store,
                &mut prompts,
                now,
                &mut commit,
                &mut ack,
            );
        }
    }
    commit = Duration::ZERO;
    ack = Duration::ZERO;
    let roots: Vec<String> = (0..agents).map(|a| format!("s{a}")).collect();
    let mut sent = 0;
    for i in 0..lines {
        now += 1;
        // One round: a line of every agent, parsed before the engine thread sees it.
        let round: Vec<Value> = (0..agents)
            .map(|_| parse_line(&line(i, now as u64).0).expect("line"))
            .collect();
        let t = Instant::now();
        measured_decide(&mut driver, &store, now, &roots, &round);
        decide += t.elapsed();
        sent += agents;
        settle(
            &mut driver,
            &mut store,
            &mut prompts,
            now,
            &mut commit,
            &mut ack,
        );
        groups += 1;
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / sent as f64;
    println!(
        "engine thread alone ({agents} agents x {lines} lines, one group per round of {agents}): \
         decide {:.2} us/line, commit {:.2} us/line, ack+release {:.2} us/line, total {:.2} us/line \
         ({:.0} lines/s); {groups} groups",
        per(decide),
        per(commit),
        per(ack),
        per(decide + commit + ack),
        sent as f64 / (decide + commit + ack).as_secs_f64()
    );
}

#[inline(never)]
fn measured_decide(
    driver: &mut Driver,
    store: &SqliteStore,
    now: i64,
    roots: &[String],
    round: &[Value],
) {
    for (root, m) in roots.iter().zip(round) {
        let _ = driver.handle(
            DriverInput::Native {
                now,
                root,
                message: m,
            },
            store,
        );
    }
}

#[inline(never)]
fn measured_commit(
    driver: &Driver,
    store: &mut SqliteStore,
    ids: &[tutti_core::driver::BatchId],
) -> Vec<Vec<tutti_core::store::Published>> {
    let batches: Vec<&PersistBatch> = ids.iter().filter_map(|id| driver.batch(*id)).collect();
    store.apply_group(&batches, true).expect("engine commit")
}

/// The store's ceiling for the captured batches: `SqliteStore` and raw rusqlite, events (lines)
/// per second, best of three, in groups of `MAX_GROUP`.
fn ceilings(dir: &std::path::Path, batches: &[PersistBatch], lines: usize) -> (f64, f64) {
    let group = tutti_sqlite::MAX_GROUP;
    let mut seq = 0i64;
    let raw: Vec<Vec<raw_rows::RawOp>> = batches
        .chunks(group)
        .map(|c| {
            c.iter()
                .flat_map(|b| raw_rows::raw_ops(b, &mut seq))
                .collect()
        })
        .collect();
    let mut raw_best = f64::MAX;
    for round in 0..3 {
        let p = dir.join(format!("ceiling-raw-{round}.db"));
        if let Ok(t) = raw_rows::raw_run(&p, &raw, raw_rows::Checkpoints::Thread) {
            raw_best = raw_best.min(t.wall);
        }
    }
    (
        store_rate(dir, batches, lines, group),
        lines as f64 / raw_best,
    )
}

/// `SqliteStore` committing the captured batches in groups of `group`, with the daemon's
/// checkpoint thread: events (lines) per second, best of three. With the daemon's group size at
/// a knee (tens of batches, most of them from different agents) nearly every line dirties its
/// own leaf in each per-session index; with `MAX_GROUP` a session's lines share their leaves.
fn store_rate(dir: &std::path::Path, batches: &[PersistBatch], lines: usize, group: usize) -> f64 {
    let mut best = f64::MAX;
    for round in 0..3 {
        let p = dir.join(format!("ceiling-store-{group}-{round}.db"));
        let mut store = SqliteStore::open_with(
            &p,
            &OpenOptions::new()
                .auto_checkpoint(false)
                .synchronous(tutti_sqlite::Synchronous::Normal),
        )
        .expect("store");
        let thread =
            Checkpointer::start(&p, CheckpointPolicy::default(), |_| {}).expect("checkpointer");
        let t = Instant::now();
        for g in batches.chunks(group.max(1)) {
            let refs: Vec<&PersistBatch> = g.iter().collect();
            store.apply_group(&refs, true).expect("ceiling commit");
            thread.committed();
            if thread.restart_wanted() {
                let _ = store.checkpoint(CheckpointMode::RestartNoWait);
                thread.restarted();
            }
        }
        best = best.min(t.elapsed().as_secs_f64());
        drop(thread);
        drop(store);
        for ext in ["", "-wal", "-shm"] {
            let _ =
                std::fs::remove_file(dir.join(format!("ceiling-store-{group}-{round}.db{ext}")));
        }
    }
    lines as f64 / best
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let followers: Vec<usize> = std::env::var("TUTTI_KNEE_FOLLOWERS")
        .ok()
        .map(|v| v.split(',').filter_map(|f| f.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 10, 100]);
    let dir = std::env::var_os("TUTTI_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("tutti-knee-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("bench directory");
    for i in 0..80 {
        assert_eq!(line(i, 1234567).0, line_json(i, 1234567), "line {i}");
    }
    if std::env::var("TUTTI_KNEE_ONLY").as_deref() == Ok("engine") {
        let lines = env_f("TUTTI_KNEE_LINES", 400.0) as usize;
        for _ in 0..env_f("TUTTI_KNEE_REPEAT", 3.0) as usize {
            engine_only(100, lines, &dir);
        }
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    println!(
        "tutti-tokio knee benchmark: provider line -> committed -> streamed, p99 limit {} ms",
        P99_LIMIT_US / 1000
    );
    println!(
        "  database under {} (TUTTI_BENCH_DIR to measure another file system); {} cores; load average {}",
        dir.display(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    // `TUTTI_KNEE_ONLY=daemon`: the ramp alone (for profilers; the ratios print as NaN).
    let only_daemon = std::env::var("TUTTI_KNEE_ONLY").as_deref() == Ok("daemon");
    let (batches, lines) = if only_daemon {
        (Vec::new(), 0)
    } else {
        capture(100, env_f("TUTTI_KNEE_CAPTURE_LINES", 200.0) as usize, &dir)
    };
    if std::env::var("TUTTI_KNEE_ONLY").as_deref() == Ok("groups") {
        for g in [1, 4, 10, 21, 50, 100, 300, 1000, tutti_sqlite::MAX_GROUP] {
            let r = store_rate(&dir, &batches, lines, g);
            println!(
                "SqliteStore in groups of {g:>4} batches: {r:>7.0} events/s, {:.2} us/line",
                1e6 / r
            );
        }
        return;
    }
    let (store_ceiling, raw_ceiling) = if only_daemon {
        (f64::NAN, f64::NAN)
    } else {
        ceilings(&dir, &batches, lines)
    };
    println!(
        "store ceiling (same lines, {} batches, groups of {}): SqliteStore {store_ceiling:.0} events/s, raw rusqlite {raw_ceiling:.0} events/s",
        batches.len(),
        tutti_sqlite::MAX_GROUP
    );
    let mut knees = Vec::new();
    for &f in &followers {
        let k = rt.block_on(ramp(Db::Sqlite(&dir), "SQLite", f));
        let eps = print_knee("SQLite", f, &k);
        println!(
            "knee: {eps:.0} events/s; knee / store ceiling: {:.2}; knee / raw ceiling: {:.2}",
            eps / store_ceiling,
            eps / raw_ceiling
        );
        // The same store with the group size the daemon committed at its knee: what the
        // commits alone allow at the latency the knee keeps.
        if let Some(k) = k.as_ref().filter(|_| !only_daemon) {
            let group = k.groups.1.round().max(1.0) as usize;
            let at = store_rate(&dir, &batches, lines, group);
            println!(
                "store in the knee's groups ({group} batches): SqliteStore {at:.0} events/s; knee / that: {:.2}",
                eps / at
            );
            let (rest, bound) = ratio_bound(k, store_ceiling);
            println!(
                "ratio bound: the process besides its commit thread spends {rest:.1} us/line at the knee; \
                 with commits as cheap as at the ceiling its CPU allows {bound:.0} events/s, {:.2} of the store ceiling",
                bound / store_ceiling
            );
        }
        knees.push((f, eps));
    }
    if let (Some((1, one)), Some(&(n, many))) = (knees.first().copied(), knees.last()) {
        if n > 1 && one > 0.0 {
            println!(
                "{n} followers cost {:.0} % of the 1-follower knee",
                100.0 * (1.0 - many / one)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if std::env::var("TUTTI_KNEE_PG").as_deref() == Ok("0") {
        return;
    }
    let server = match tutti_pg_server::Server::start() {
        Ok(s) => s,
        Err(e) => {
            println!("PostgreSQL skipped: no server ({e})");
            return;
        }
    };
    for &f in &followers {
        let k = rt.block_on(ramp(Db::Postgres(&server), "PostgreSQL", f));
        let eps = print_knee("PostgreSQL", f, &k);
        println!("knee: {eps:.0} events/s (PostgreSQL, durable defaults)");
    }
}
