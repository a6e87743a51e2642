//! `cargo bench -p tutti-tokio --bench retention`: does the daemon stay bounded (issue 17,
//! item 3)? Prints figures; asserts nothing about time.
//!
//! 1. Resident memory: sessions run one settled turn each through the real daemon core (engine
//!    thread, SQLite file, ACP adapter and runtime, with an in-process simulated ACP agent that
//!    answers every prompt with three messages and two tool calls, about a dozen outbox rows per
//!    session, then ends its process). Prints the RSS after 100 and after 10,000 settled sessions
//!    with the default retention (settled trees evicted), and the same with eviction off
//!    (`resident_trees = usize::MAX`) for comparison. Goal: the 10,000 figure within 10 % + 20 MB
//!    of the 100 figure.
//! 2. Start-up: a file with 1,000 live trees (each root turn still active, as after a crash) and
//!    1,000,000 stored messages (1,000 per tree), built through the engine and `apply_many`; the
//!    real `tuttid` binary is started on a copy of it three times, and the time from spawning the
//!    process to the first answered `GET /healthz` is printed (recovery of the 1,000 trees
//!    included). Goal: under 1 s.
//!
//! `TUTTI_BENCH_SESSIONS=N` changes 10,000; `TUTTI_BENCH_ONLY=rss-default|rss-off|startup` runs one part. The
//! files go under the system temporary directory (`TMPDIR`).

/// The daemon's allocator (see `src/bin/tuttid.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
use tutti_core::adapters::Adapter;
use tutti_core::model::{Capabilities, Id};
use tutti_core::store::Store;
use tutti_core::{Command, Engine, EngineConfig, Input};
use tutti_sqlite::{CheckpointMode, SqliteStore};
use tutti_tokio::daemon::{Daemon, DaemonOptions, LaunchError, ProviderFactory};
use tutti_tokio::retention::Retention;
use tutti_tokio::runtime::{Native, NativeSink, Transport, WriteError};

const TUTTID: &str = env!("CARGO_BIN_EXE_tuttid");

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

/// An ACP agent in the process: one prompt, a few updates, `end_turn`, then it exits.
struct Sim;

fn update(u: Value) -> Native {
    Native::Message(json!({"jsonrpc": "2.0", "method": "session/update",
        "params": {"sessionId": "sim", "update": u}}))
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
        let (to_agent, mut agent_rx) = mpsc::unbounded_channel::<Value>();
        let (to_runtime, incoming) = mpsc::channel::<Native>(64);
        tokio::spawn(async move {
            while let Some(msg) = agent_rx.recv().await {
                let id = msg.get("id").cloned();
                let reply = |result: Value| {
                    Native::Message(json!({"jsonrpc": "2.0", "id": id, "result": result}))
                };
                let out: Vec<Native> = match msg.get("method").and_then(Value::as_str) {
                    Some("initialize") => vec![reply(
                        json!({"protocolVersion": 1, "agentCapabilities": {}}),
                    )],
                    Some("session/new") => vec![reply(json!({"sessionId": "sim"}))],
                    Some("session/prompt") => {
                        let mut v = Vec::new();
                        for c in ["c1", "c2"] {
                            v.push(update(json!({"sessionUpdate": "agent_message_chunk",
                                "content": {"type": "text", "text": "working on it"}})));
                            v.push(update(json!({"sessionUpdate": "tool_call",
                                "toolCallId": c, "title": "read", "status": "in_progress"})));
                            v.push(update(json!({"sessionUpdate": "tool_call_update",
                                "toolCallId": c, "status": "completed"})));
                        }
                        v.push(update(json!({"sessionUpdate": "agent_message_chunk",
                            "content": {"type": "text", "text": "done"}})));
                        v.push(reply(json!({"stopReason": "end_turn"})));
                        v
                    }
                    _ => Vec::new(),
                };
                let last = msg.get("method").and_then(Value::as_str) == Some("session/prompt");
                for m in out {
                    if to_runtime.send(m).await.is_err() {
                        return;
                    }
                }
                if last {
                    // The agent exits after its turn (no idle processes pile up here; stopping
                    // idle providers is issue 17 item 2, measured elsewhere).
                    return;
                }
            }
        });
        Ok((
            Box::new(AcpAdapter::new(root.clone(), AcpConfig::default())),
            Transport {
                incoming,
                sink: Box::new(ChannelSink(to_agent)),
                child: None,
                parse: Default::default(),
            },
        ))
    }
}

fn rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tutti-bench-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

/// Runs sessions `from..to` to a settled turn, `parallel` at a time.
async fn settle_sessions(d: &Daemon, from: usize, to: usize, parallel: usize) {
    let mut i = from;
    while i < to {
        let end = (i + parallel).min(to);
        let mut tasks = Vec::new();
        for n in i..end {
            let d = d.clone();
            tasks.push(tokio::spawn(async move {
                let id: Id = format!("s{n}").into();
                d.call(Input::Command(Command::CreateSession {
                    agent_session_id: id.clone(),
                    workspace_id: "w".into(),
                    provider: "sim".into(),
                    title: Some("bench".into()),
                    capabilities: None,
                }))
                .await
                .expect("create");
                d.set_cwd(id.clone(), "/tmp".into());
                d.call(Input::Command(Command::Submit {
                    agent_session_id: id.clone(),
                    turn_id: format!("t{n}").into(),
                    text: "go".into(),
                }))
                .await
                .expect("submit");
                loop {
                    let id = id.clone();
                    let s = d
                        .read(move |r| r.session(&id))
                        .expect("read")
                        .expect("session")
                        .expect("exists");
                    if s.active_turn_id.is_none() && s.last_turn_id.is_some() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }));
        }
        for t in tasks {
            t.await.expect("session task");
        }
        i = end;
    }
}

fn rss_run(rt: &tokio::runtime::Runtime, label: &str, resident_trees: usize, total: usize) {
    let dir = temp_dir("rss");
    let d = rt.block_on(async {
        Daemon::start(DaemonOptions {
            // The figures in the README are for `synchronous=NORMAL` (what the daemon used before
            // `durability` existed), so they stay comparable; the store bench prints FULL too.
            durability: tutti_tokio::config::Durability::Normal,
            // In-process simulated agents: no process cap (figures stay comparable).
            max_providers: Some(usize::MAX),
            db: dir.join("rss.db"),
            providers: Arc::new(Sim),
            engine: EngineConfig::default(),
            idle_timeout: None,
            retention: Retention {
                resident_trees,
                ..Retention::default()
            },
        })
        .expect("daemon")
    });
    let t = Instant::now();
    rt.block_on(settle_sessions(&d, 0, 100, 50));
    let at_100 = rss_mb();
    rt.block_on(settle_sessions(&d, 100, total, 50));
    let at_total = rss_mb();
    let resident = rt.block_on(d.resident_trees()).map_or(0, |r| r.len());
    let rows = d
        .read(|r| r.last_outbox_seq())
        .expect("read")
        .unwrap_or_default();
    rt.block_on(d.shutdown());
    drop(d);
    println!(
        "  {label}: RSS {at_100:.1} MB after 100 settled sessions, {at_total:.1} MB after {total} \
         (+{:.1} MB, {:+.1} %; goal: within 10 % + 20 MB); {resident} trees resident; {rows} outbox \
         rows; {:.1} s",
        at_total - at_100,
        (at_total / at_100 - 1.0) * 100.0,
        t.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn input(v: Value) -> Input {
    serde_json::from_value(v).expect("input")
}

/// 1,000 roots with an active turn and 1,000 messages each.
fn build_fixture(path: &Path, trees: usize, per_tree: usize) -> Duration {
    let t = Instant::now();
    let mut db = SqliteStore::open(path).expect("fixture db");
    let mut engine = Engine::new();
    let mut batches = Vec::with_capacity(tutti_sqlite::MAX_GROUP);
    let mut now = 1_000_000i64;
    let flush = |db: &mut SqliteStore, b: &mut Vec<tutti_core::step::PersistBatch>| {
        db.apply_many(b.iter()).expect("fixture commit");
        b.clear();
    };
    for r in 0..trees {
        let root = format!("r{r}");
        let turn = format!("t{r}");
        let mut inputs = vec![
            input(
                json!({"type":"createSession","agentSessionId":root,"workspaceId":"w",
                "provider":"sim"}),
            ),
            input(json!({"type":"submit","agentSessionId":root,"turnId":turn,"text":"go"})),
            input(
                json!({"type":"rootProviderTurnStarted","agentSessionId":root,
                "providerTurnId":"p"}),
            ),
        ];
        // The user's message is one; the rest are the provider's.
        for m in 1..per_tree {
            inputs.push(input(
                json!({"type":"messageAppended","agentSessionId":root,
                "turnId":turn,"messageId":format!("m{m}"),"role":"assistant",
                "text":"a message of about sixty bytes of assistant text, stored"}),
            ));
        }
        for i in inputs {
            now += 1;
            let step = engine.handle(now, &i).expect("fixture input accepted");
            batches.push(step.persist);
            if batches.len() == tutti_sqlite::MAX_GROUP {
                flush(&mut db, &mut batches);
            }
        }
        engine.evict(&root);
    }
    flush(&mut db, &mut batches);
    db.checkpoint(CheckpointMode::Restart).expect("checkpoint");
    t.elapsed()
}

fn startup_run() {
    let (trees, per_tree) = (1_000, 1_000);
    let dir = temp_dir("startup");
    let fixture = dir.join("fixture.db");
    let built = build_fixture(&fixture, trees, per_tree);
    let size = std::fs::metadata(&fixture).map_or(0, |m| m.len());
    println!(
        "  fixture: {trees} live trees, {} messages, {:.0} MB file, built in {:.1} s",
        trees * per_tree,
        size as f64 / 1e6,
        built.as_secs_f64()
    );
    for run in 1..=3 {
        let db = dir.join(format!("run{run}.db"));
        std::fs::copy(&fixture, &db).expect("copy fixture");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("port");
        let token = dir.join("token");
        let t = Instant::now();
        let mut child = std::process::Command::new(TUTTID)
            .arg("serve")
            .arg("--db")
            .arg(&db)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--token-file")
            .arg(&token)
            .env("TUTTI_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start tuttid");
        let url = format!("http://127.0.0.1:{port}/healthz");
        let ready = loop {
            if ureq::get(&url)
                .timeout(Duration::from_millis(500))
                .call()
                .is_ok_and(|r| r.status() == 200)
            {
                break Some(t.elapsed());
            }
            if t.elapsed() > Duration::from_secs(120) {
                break None;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        let _ = child.kill();
        let _ = child.wait();
        let live = SqliteStore::open(&db)
            .and_then(|s| s.load_live_trees())
            .map_or(usize::MAX, |t| t.len());
        match ready {
            Some(d) => println!(
                "  start-up run {run}: process start -> ready API in {:.0} ms (goal: under 1000 ms); \
                 live trees left after recovery: {live}",
                d.as_secs_f64() * 1000.0
            ),
            None => println!("  start-up run {run}: the API never became ready"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn main() {
    let only = std::env::var("TUTTI_BENCH_ONLY").unwrap_or_default();
    let total: usize = std::env::var("TUTTI_BENCH_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    if std::env::var_os("TUTTI_BENCH_QUIET").is_none() {
        println!("tutti-tokio retention benchmark (issue 17, item 3)");
    }
    // Each memory run in a fresh process, so that neither inherits the other's heap.
    if only.is_empty() {
        for part in ["rss-default", "rss-off"] {
            let exe = std::env::current_exe().expect("own executable");
            let out = std::process::Command::new(exe)
                .env("TUTTI_BENCH_ONLY", part)
                .env("TUTTI_BENCH_QUIET", "1")
                .output()
                .expect("memory run");
            print!("{}", String::from_utf8_lossy(&out.stdout));
        }
    }
    if only.starts_with("rss") {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        if only == "rss-off" {
            rss_run(&rt, "eviction off     ", usize::MAX, total);
        } else {
            rss_run(
                &rt,
                "default retention",
                Retention::default().resident_trees,
                total,
            );
        }
    }
    if only.is_empty() || only == "startup" {
        startup_run();
    }
}
