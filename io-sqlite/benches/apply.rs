//! Benchmark: durable events per second through `SqliteStore::apply_many`, against raw rusqlite
//! inserting the same rows.
//!
//! `cargo bench -p tutti-sqlite` (release). An event is one accepted engine input, i.e. one
//! persist batch. The batches come from the engine fed a mixed workload (sessions, submits,
//! provider lifecycle, child creation, child turns and terminals, messages, tool calls,
//! interactions, cancels, deletes). The store commits them as the daemon does: group commits of
//! up to [`tutti_sqlite::MAX_GROUP`] batches (the size every group commit has under a saturating
//! load), `synchronous=NORMAL` (WAL), no checkpoint on the commit path, and a
//! [`tutti_sqlite::Checkpointer`] thread copying the WAL into the main file behind the commits.
//! The raw baseline inserts exactly the rows the store ends up writing (same row count, same
//! transaction sizes, same JSON payloads, pre-serialized) into the same tables with plain
//! prepared upserts (no guards, no version checks, no serialization), with the same checkpoint
//! arrangement.
//!
//! It then prints, for reference, the store's figure with smaller and larger group commits, with
//! SQLite's automatic checkpoints on the commit path instead of the thread, and with
//! `synchronous=FULL`.
//!
//! Environment: `TUTTI_BENCH_EVENTS` (default 200000), `TUTTI_BENCH_GROUP` (default
//! [`tutti_sqlite::MAX_GROUP`]),
//! `TUTTI_BENCH_TEXT` (message texts are 0..N bytes, default 600), `TUTTI_BENCH_DIR` (where the
//! database files go; default the system temporary directory).

#[path = "shared/raw_rows.rs"]
mod raw_rows;

use raw_rows::{raw_ops, raw_run, timed, Checkpoints, RawOp, Took};
use std::time::Instant;
use tutti_core::step::PersistBatch;
use tutti_sqlite::{
    CheckpointMode, CheckpointPolicy, Checkpointer, OpenOptions, SqliteStore, Synchronous,
};
use tutti_testkit::workload::{Mix, Stream};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn store_run(
    path: &std::path::Path,
    groups: &[&[PersistBatch]],
    sync: Synchronous,
    how: Checkpoints,
) -> Result<Took, tutti_sqlite::SqliteError> {
    let opts = OpenOptions::new()
        .synchronous(sync)
        .auto_checkpoint(how == Checkpoints::OnCommit);
    let mut store = SqliteStore::open_with(path, &opts)?;
    let thread = match how {
        Checkpoints::Thread => Some(Checkpointer::start(
            path,
            CheckpointPolicy::default(),
            |_| {},
        )?),
        Checkpoints::OnCommit => None,
    };
    timed(|| {
        for g in groups {
            store.apply_many(*g)?;
            if let Some(t) = &thread {
                t.committed();
                if t.restart_wanted() {
                    store.checkpoint(CheckpointMode::RestartNoWait)?;
                    t.restarted();
                }
            }
        }
        Ok(())
    })
}

fn main() {
    let events = env("TUTTI_BENCH_EVENTS", 200_000);
    let group = env("TUTTI_BENCH_GROUP", tutti_sqlite::MAX_GROUP).max(1);
    let t = Instant::now();
    let mut stream = Stream::windowed(42, Mix::BENCH, 16);
    stream.driver.text_max = env("TUTTI_BENCH_TEXT", 600).clamp(1, 60_000) as u16;
    let batches: Vec<PersistBatch> = (0..events).map(|_| stream.next_step().persist).collect();
    let rows: usize = batches.iter().map(|b| b.rows.len()).sum();
    let guards: usize = batches.iter().map(|b| b.guards.len()).sum();
    let mut seq = 0i64;
    let raw: Vec<Vec<RawOp>> = batches
        .chunks(group)
        .map(|c| c.iter().flat_map(|b| raw_ops(b, &mut seq)).collect())
        .collect();
    let json_bytes: usize = raw
        .iter()
        .flatten()
        .map(|op| match op {
            RawOp::Session { json, .. }
            | RawOp::Turn { json, .. }
            | RawOp::Interaction { json, .. }
            | RawOp::ToolCall { json, .. }
            | RawOp::Op { json, .. }
            | RawOp::Message { json, .. }
            | RawOp::Outbox { json, .. } => json.len(),
            RawOp::Purge(_) => 0,
        })
        .sum();
    println!(
        "workload: {events} events ({rows} rows, {seq} outbox rows, {guards} guards, {:.1} MB JSON) \
         generated in {:.2} s; {group} events per transaction",
        json_bytes as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );

    let dir = match std::env::var_os("TUTTI_BENCH_DIR")
        .map(tempfile::tempdir_in)
        .unwrap_or_else(tempfile::tempdir)
    {
        Ok(d) => d,
        Err(e) => {
            eprintln!("no temporary directory: {e}");
            return;
        }
    };
    let groups: Vec<&[PersistBatch]> = batches.chunks(group).collect();
    let rounds = env("TUTTI_BENCH_ROUNDS", 3).max(1);
    let mut store_t: Vec<Took> = Vec::new();
    let mut raw_t: Vec<Took> = Vec::new();
    for round in 0..rounds {
        let p = dir.path().join(format!("store{round}.db"));
        match store_run(&p, &groups, Synchronous::Normal, Checkpoints::Thread) {
            Ok(t) => store_t.push(t),
            Err(e) => {
                eprintln!("store run failed: {e}");
                return;
            }
        }
        let p = dir.path().join(format!("raw{round}.db"));
        match raw_run(&p, &raw, Checkpoints::Thread) {
            Ok(t) => raw_t.push(t),
            Err(e) => {
                eprintln!("raw run failed: {e}");
                return;
            }
        }
    }
    let best = |v: &[Took]| v.iter().map(|t| t.wall).fold(f64::MAX, f64::min);
    let best_cpu = |v: &[Took]| {
        v.iter()
            .filter_map(|t| t.cpu)
            .fold(None, |m: Option<f64>, c| Some(m.map_or(c, |m| m.min(c))))
    };
    let (sw, rw) = (best(&store_t), best(&raw_t));
    let store_eps = events as f64 / sw;
    let raw_eps = events as f64 / rw;
    println!(
        "tutti-sqlite apply_many (synchronous=NORMAL, checkpoint thread): {store_eps:>10.0} events/s ({:.0} rows/s), best of {rounds}",
        rows as f64 / sw
    );
    println!(
        "raw rusqlite, same rows, transactions and checkpoints:        {raw_eps:>10.0} events/s ({:.0} rows/s), best of {rounds}",
        rows as f64 / rw
    );
    println!(
        "ratio: {:.0} % of raw (goal >= 50 %); goal >= 150000 events/s: {}",
        100.0 * store_eps / raw_eps,
        if store_eps >= 150_000.0 {
            "met"
        } else {
            "NOT met"
        }
    );
    if let (Some(sc), Some(rc)) = (best_cpu(&store_t), best_cpu(&raw_t)) {
        println!(
            "per CPU second of the committing thread (the checkpoint thread not counted): store {:.0} events/s, raw {:.0} events/s, ratio {:.0} %",
            events as f64 / sc,
            events as f64 / rc,
            100.0 * rc / sc
        );
    }
    let p = dir.path().join("full.db");
    let small: Vec<&[PersistBatch]> = groups.iter().take(200).copied().collect();
    let n: usize = small.iter().map(|g| g.len()).sum();
    if let Ok(t) = store_run(&p, &small, Synchronous::Full, Checkpoints::Thread) {
        println!(
            "for reference, synchronous=FULL: {:.0} events/s ({n} events)",
            n as f64 / t.wall
        );
    }
    // The setup before the checkpoint thread: SQLite's own checkpoints inside the commits.
    let p = dir.path().join("oncommit.db");
    if let Ok(t) = store_run(&p, &groups, Synchronous::Normal, Checkpoints::OnCommit) {
        println!(
            "for reference, SQLite's automatic checkpoints in the commits instead of the thread: {:.0} events/s (1 round)",
            events as f64 / t.wall
        );
    }
    // How the figure depends on the group size (the daemon commits whatever is queued, up to
    // `MAX_GROUP`, so its groups grow with the load). One round each, the same batches.
    let mut line = String::from("for reference, events per group commit (store, 1 round):");
    for size in [32, 256, 1024, 4096] {
        let p = dir.path().join(format!("group{size}.db"));
        let gs: Vec<&[PersistBatch]> = batches.chunks(size).collect();
        if let Ok(t) = store_run(&p, &gs, Synchronous::Normal, Checkpoints::Thread) {
            line.push_str(&format!(" {size}: {:.0} events/s;", events as f64 / t.wall));
        }
    }
    println!("{}", line.trim_end_matches(';'));
}
