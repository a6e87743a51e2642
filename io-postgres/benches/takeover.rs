//! `cargo bench -p tutti-postgres --bench takeover`: how long after a `kill -9` of the daemon
//! that owns live trees a survivor has claimed and settled them (issue 21: "takeover time after
//! a kill"; the failover test prints it too, without asserting it).
//!
//! The owner is a real process: this bench re-executes itself with `TUTTI_TAKEOVER_OWNER` set.
//! The owner creates `N` live trees on a real server started in a temporary directory (each
//! tree's lease claimed before its first batch, as the daemon does), renews the leases every
//! third of the lease time (the daemon's renewal tick), prints `ready`, and keeps renewing until
//! it is killed. The survivor runs the daemon's failover policy on the same store calls: a tick
//! every third of the lease time (started before the owner, so the kill falls at an arbitrary
//! phase of it); at each tick it claims every expired, unreleased lease
//! (`expired_leases` + `claim_lease`), reloads the tree from the store, settles it as a restart
//! does (the engine's `ProviderExited`: every active turn interrupted) in one fenced commit,
//! and releases the lease. The time is from the kill (SIGKILL sent) to the last tree settled.
//!
//! Figures are printed; nothing is asserted. The expected figure is the lease's remaining time
//! at the kill (at most the lease time, at least two thirds of it) plus up to one tick plus the
//! commits. `TUTTI_TAKEOVER_LEASE_MS` changes the lease (default 2000).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tutti_core::store::{HostStore, Store};
use tutti_core::{Engine, Input, PersistBatch, RuntimeAnswer};
use tutti_pg_server::Server;
use tutti_postgres::{Claim, PostgresStore};

const OWNER_ENV: &str = "TUTTI_TAKEOVER_OWNER";

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn lease_ms() -> i64 {
    std::env::var("TUTTI_TAKEOVER_LEASE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

/// The owner process: `N` live trees under its leases, renewed until it is killed.
fn owner(url: &str, trees: usize, run: usize) {
    let ttl = lease_ms();
    let mut store = PostgresStore::connect(url).expect("owner connects");
    let mut engine = Engine::new();
    let mut epochs = Vec::with_capacity(trees);
    for i in 0..trees {
        let root = format!("run{run}-root{i}");
        let claim = store
            .claim_lease(&root, "owner", "127.0.0.1:1", now_ms(), ttl)
            .expect("claim");
        let Claim::Owned(l) = claim else {
            panic!("a new tree's lease is free")
        };
        epochs.push((root.clone(), l.epoch));
        let inputs = [
            serde_json::json!({"type": "createSession", "agentSessionId": root, "workspaceId": "W", "provider": "demo"}),
            serde_json::json!({"type": "submit", "agentSessionId": root, "turnId": format!("{root}-t"), "text": "go"}),
            serde_json::json!({"type": "rootProviderTurnStarted", "agentSessionId": root, "providerTurnId": "p"}),
        ];
        let mut batches: Vec<PersistBatch> = Vec::new();
        for v in inputs {
            let input: Input = serde_json::from_value(v).expect("input");
            batches.push(engine.handle(now_ms(), &input).expect("step").persist);
        }
        let refs: Vec<&PersistBatch> = batches.iter().collect();
        store.apply_group(&refs, true).expect("owner commits");
    }
    println!("ready");
    std::io::stdout().flush().expect("stdout");
    loop {
        std::thread::sleep(Duration::from_millis((ttl / 3) as u64));
        for (root, epoch) in &epochs {
            let _ = store.renew_lease(root, "owner", *epoch, now_ms(), ttl);
        }
    }
}

/// One kill and takeover of `trees` trees; returns the time from the kill to the last settle.
fn takeover(server: &Server, trees: usize, run: usize) -> Duration {
    let url = server
        .create_database_named(&format!("takeover_{trees}_{run}"))
        .expect("database");
    let ttl = lease_ms();
    let tick = Duration::from_millis((ttl / 3) as u64);
    let mut survivor = PostgresStore::connect(&url).expect("survivor connects");
    let mut engine = Engine::new();
    let ticks_from = Instant::now();
    let mut child = Command::new(std::env::current_exe().expect("this bench"))
        .env(OWNER_ENV, &url)
        .env("TUTTI_TAKEOVER_TREES", trees.to_string())
        .env("TUTTI_TAKEOVER_RUN", run.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("owner process");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("owner ready");
    assert_eq!(line.trim(), "ready", "the owner started");
    // Kill at some point of the owner's renewal cycle.
    std::thread::sleep(Duration::from_millis(300 + (run as u64 * 137) % 400));
    child.kill().expect("kill -9");
    let killed = Instant::now();
    child.wait().expect("reaped");
    let mut settled = 0;
    let mut k = 1u32;
    while settled < trees {
        let next = ticks_from + tick * k;
        k += 1;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            continue;
        }
        let now = now_ms();
        for root in survivor
            .expired_leases("survivor", now, 100)
            .expect("expired leases")
        {
            let (Claim::Owned(l), _) = survivor
                .claim_lease_after(&root, "survivor", "127.0.0.1:2", now, ttl)
                .expect("claim")
            else {
                continue;
            };
            engine.evict(&root);
            let tree = survivor.load_tree(&root).expect("load").expect("tree");
            engine.restore(tree).expect("restore");
            let step = engine
                .handle(
                    now,
                    &Input::Runtime(RuntimeAnswer::ProviderExited {
                        root_agent_session_id: root.clone(),
                        error: "the daemon that ran the provider is gone".into(),
                    }),
                )
                .expect("settle");
            survivor
                .apply_group(&[&step.persist], true)
                .expect("fenced settle commit");
            survivor
                .release_lease(&root, "survivor", l.epoch)
                .expect("release");
            settled += 1;
        }
    }
    killed.elapsed()
}

fn main() {
    if let Ok(url) = std::env::var(OWNER_ENV) {
        let n = std::env::var("TUTTI_TAKEOVER_TREES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1);
        let run = std::env::var("TUTTI_TAKEOVER_RUN")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        owner(&url, n, run);
        return;
    }
    // `cargo bench` passes `--bench`; `cargo test --benches` runs one small round.
    let quick = !std::env::args().any(|a| a == "--bench");
    let server = match Server::start() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tutti-postgres takeover bench: no PostgreSQL server: {e}");
            return;
        }
    };
    let ttl = lease_ms();
    println!(
        "tutti-postgres takeover: lease {ttl} ms, survivor tick {} ms, owner killed with SIGKILL",
        ttl / 3
    );
    let sizes: &[usize] = if quick { &[1] } else { &[1, 100] };
    let runs = if quick { 1 } else { 5 };
    for &trees in sizes {
        let mut times = Vec::new();
        for run in 0..runs {
            times.push(takeover(&server, trees, run));
        }
        let ms: Vec<f64> = times.iter().map(|t| t.as_secs_f64() * 1000.0).collect();
        let max = ms.iter().cloned().fold(f64::MIN, f64::max);
        let min = ms.iter().cloned().fold(f64::MAX, f64::min);
        let mean = ms.iter().sum::<f64>() / ms.len() as f64;
        println!(
            "{trees:>4} live trees: kill -> all settled: min {min:.0} ms, mean {mean:.0} ms, max {max:.0} ms; \
             max minus lease {:.0} ms (runs: {})",
            max - ttl as f64,
            ms.iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join(", ")
        );
    }
}
