//! `cargo bench -p tutti-tokio`: the daemon under load. 100 concurrent ACP agents (in-process
//! simulated agents speaking the ACP wire through the real adapter, runtime, engine thread,
//! SQLite file and HTTP event stream) each emit tool-call updates at a fixed rate. Every update
//! carries its send time; the SSE client measures provider line → committed → streamed latency.
//! Prints p50/p99/max latency and events/s, for a baseline rate and the target rate, in one run.

/// The daemon's allocator (see `src/bin/tuttid.rs`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
use tutti_core::adapters::Adapter;
use tutti_core::model::{Capabilities, Id};
use tutti_core::{Command, EngineConfig, Input};
use tutti_tokio::daemon::{Daemon, DaemonOptions, LaunchError, ProviderFactory};
use tutti_tokio::follow::Follower;
use tutti_tokio::runtime::{Native, NativeSink, Transport, WriteError};

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

struct Sim {
    epoch: Instant,
    per_agent_rate: f64,
    per_agent_events: usize,
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
        let (to_runtime, incoming) = mpsc::channel::<Native>(4096);
        let epoch = self.epoch;
        let gap = Duration::from_secs_f64(1.0 / self.per_agent_rate);
        let n = self.per_agent_events;
        tokio::spawn(async move {
            while let Some(msg) = agent_rx.recv().await {
                let id = msg.get("id").cloned();
                let reply = |result: Value| json!({"jsonrpc": "2.0", "id": id, "result": result});
                match msg.get("method").and_then(Value::as_str) {
                    Some("initialize") => {
                        let _ = to_runtime
                            .send(Native::Message(reply(
                                json!({"protocolVersion": 1, "agentCapabilities": {}}),
                            )))
                            .await;
                    }
                    Some("session/new") => {
                        let _ = to_runtime
                            .send(Native::Message(reply(json!({"sessionId": "sim"}))))
                            .await;
                    }
                    Some("session/prompt") => {
                        let tx = to_runtime.clone();
                        tokio::spawn(async move {
                            let mut tick = tokio::time::interval(gap);
                            for i in 0..n {
                                tick.tick().await;
                                let sent = epoch.elapsed().as_micros();

                                let line = json!({"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "sim",
                                    "update": {"sessionUpdate": "tool_call", "toolCallId": format!("c{i}"), "title": format!("t={sent}"), "status": "in_progress"}}});
                                if tx.send(Native::Message(line)).await.is_err() {
                                    return;
                                }
                            }
                            let _ = tx.send(Native::Message(json!({"jsonrpc": "2.0", "id": id, "result": {"stopReason": "end_turn"}}))).await;
                        });
                    }
                    _ => {}
                }
            }
        });
        let adapter = AcpAdapter::new(root.clone(), AcpConfig::default());
        Ok((
            Box::new(adapter),
            Transport {
                incoming,
                sink: Box::new(ChannelSink(to_agent)),
                child: None,
                parse: Default::default(),
            },
        ))
    }
}

async fn run(agents: usize, rate_total: f64, secs: f64) -> (f64, Vec<u128>) {
    let dir = tempfile_dir();
    let epoch = Instant::now();
    let per_agent_rate = rate_total / agents as f64;
    let per_agent_events = (per_agent_rate * secs) as usize;
    let daemon = Daemon::start(DaemonOptions {
        // The figures in the README are for `synchronous=NORMAL` (what the daemon used before
        // `durability` existed), so they stay comparable; the store bench prints FULL too.
        durability: tutti_tokio::config::Durability::Normal,
        // In-process simulated agents: no process cap (figures stay comparable).
        max_providers: Some(usize::MAX),
        db: dir.join("load.db"),
        providers: Arc::new(Sim {
            epoch,
            per_agent_rate,
            per_agent_events,
        }),
        engine: EngineConfig::default(),
        idle_timeout: None,
        retention: Default::default(),
    })
    .expect("daemon starts");
    // The stream consumer: follows the outbox exactly as the SSE endpoint does (`Follower`: from
    // the file while behind, from each commit's rows once caught up).
    let expected = agents * per_agent_events;
    let mut follower = Follower::new(&daemon, 0);
    let consumer = tokio::spawn(async move {
        let mut lat = Vec::with_capacity(expected);
        let start = Instant::now();
        let deadline = Duration::from_secs_f64(secs * 4.0 + 10.0);
        while lat.len() < expected && start.elapsed() < deadline {
            let rows = match tokio::time::timeout(Duration::from_millis(200), follower.next()).await
            {
                Ok(r) => r.expect("outbox rows"),
                Err(_) => continue,
            };
            let now = epoch.elapsed().as_micros();
            for row in rows {
                // A tool call still open when its turn ends is settled as `interrupted`: a
                // second row with the same name (send time), which is not a delivery of the
                // line and would count the whole turn as its latency.
                if row.kind == "toolCall" && row.payload["status"] != "interrupted" {
                    if let Some(t) = row.payload["name"]
                        .as_str()
                        .and_then(|n| n.strip_prefix("t="))
                    {
                        if let Ok(sent) = t.parse::<u128>() {
                            lat.push(now.saturating_sub(sent));
                        }
                    }
                }
            }
        }
        (start.elapsed().as_secs_f64(), lat)
    });
    for a in 0..agents {
        let id: Id = format!("s{a}").into();
        daemon
            .call(Input::Command(Command::CreateSession {
                agent_session_id: id.clone(),
                workspace_id: "w".into(),
                provider: "sim".into(),
                title: None,
                capabilities: None,
            }))
            .await
            .expect("create");
        daemon
            .call(Input::Command(Command::Submit {
                agent_session_id: id,
                turn_id: format!("t{a}").into(),
                text: "go".into(),
            }))
            .await
            .expect("submit");
    }
    let (elapsed, mut lat) = consumer.await.expect("consumer");
    daemon.shutdown().await;
    lat.sort_unstable();
    let _ = std::fs::remove_dir_all(&dir);
    (lat.len() as f64 / elapsed, lat)
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "tutti-load-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    ));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn pct(v: &[u128], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() as f64 - 1.0) * p) as usize] as f64 / 1000.0
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "tutti-tokio load benchmark: 100 concurrent agents, provider line -> committed -> streamed"
    );
    println!(
        "  database under {} (set TMPDIR to measure another file system)",
        std::env::temp_dir().display()
    );
    for (label, rate) in [
        ("baseline 1k events/s", 1_000.0),
        ("target  10k events/s", 10_000.0),
    ] {
        let (eps, lat) = rt.block_on(run(100, rate, 5.0));
        println!(
            "  {label}: delivered {:>6} events at {:>8.0} events/s; latency p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            lat.len(), eps, pct(&lat, 0.5), pct(&lat, 0.99), pct(&lat, 1.0)
        );
    }
}
