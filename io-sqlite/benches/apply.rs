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

use rusqlite::{params, Connection};
use std::time::{Duration, Instant};
use tutti_core::step::{PersistBatch, Row};
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

/// One raw statement: which SQL, and its pre-computed parameters.
enum RawOp {
    Session {
        id: String,
        ws: String,
        kind: &'static str,
        root: Option<String>,
        active: Option<String>,
        created: i64,
        deleted: Option<i64>,
        version: i64,
        json: String,
    },
    Turn {
        id: String,
        session: String,
        closed: bool,
        created: i64,
        version: i64,
        json: String,
    },
    Interaction {
        turn: String,
        request: String,
        session: String,
        version: i64,
        json: String,
    },
    ToolCall {
        session: String,
        call: String,
        version: i64,
        json: String,
    },
    Op {
        id: String,
        root: String,
        state: &'static str,
        version: i64,
        json: String,
    },
    Message {
        session: String,
        seq: i64,
        id: String,
        json: String,
        outbox_seq: Option<i64>,
    },
    Purge(String),
    /// An outbox row; a message's references the message just inserted (payload empty).
    Outbox {
        seq: i64,
        kind: &'static str,
        root: String,
        ws: String,
        json: String,
        message: bool,
    },
}

/// The rows the store writes for one batch: each row, followed by its outbox row if published
/// (the engine publishes in row order), a message's outbox row referencing the message.
fn raw_ops(batch: &PersistBatch, seq: &mut i64) -> Vec<RawOp> {
    let mut out = Vec::new();
    let target = batch
        .root_agent_session_id
        .as_ref()
        .zip(batch.workspace_id.as_ref());
    for (i, row) in batch.rows.iter().enumerate() {
        let json = match row {
            Row::PurgeSession { agent_session_id } => {
                serde_json::json!({ "agentSessionId": agent_session_id }).to_string()
            }
            Row::Session(x) => serde_json::to_string(x).unwrap_or_default(),
            Row::Turn(x) => serde_json::to_string(x).unwrap_or_default(),
            Row::Interaction(x) => serde_json::to_string(x).unwrap_or_default(),
            Row::ToolCall(x) => serde_json::to_string(x).unwrap_or_default(),
            Row::CancelOperation(x) => serde_json::to_string(x).unwrap_or_default(),
            Row::Message(x) => serde_json::to_string(x).unwrap_or_default(),
        };
        let published = target.is_some() && batch.outbox.contains(&(i as u32));
        let message = published && matches!(row, Row::Message(_));
        let outbox_json = if message { String::new() } else { json.clone() };
        out.push(match row {
            Row::Session(s) => RawOp::Session {
                id: s.id.to_string(),
                ws: s.workspace_id.to_string(),
                kind: if s.is_child() { "child" } else { "root" },
                root: s.root_agent_session_id().map(|r| r.to_string()),
                active: s.active_turn_id.as_deref().map(String::from),
                created: s.created_at,
                deleted: s.deleted_at,
                version: s.version as i64,
                json,
            },
            Row::Turn(t) => RawOp::Turn {
                id: t.id.to_string(),
                session: t.agent_session_id.to_string(),
                closed: t.child_creation_closed,
                created: t.created_at,
                version: t.version as i64,
                json,
            },
            Row::Interaction(i) => RawOp::Interaction {
                turn: i.turn_id.to_string(),
                request: i.request_id.to_string(),
                session: i.agent_session_id.to_string(),
                version: i.version as i64,
                json,
            },
            Row::ToolCall(c) => RawOp::ToolCall {
                session: c.agent_session_id.to_string(),
                call: c.tool_call_id.to_string(),
                version: c.version as i64,
                json,
            },
            Row::CancelOperation(o) => RawOp::Op {
                id: o.id.to_string(),
                root: o.root_agent_session_id.to_string(),
                state: match o.state {
                    tutti_core::model::CancelState::Prepared => "prepared",
                    tutti_core::model::CancelState::Completed => "completed",
                    tutti_core::model::CancelState::Failed => "failed",
                },
                version: o.version as i64,
                json,
            },
            Row::Message(m) => RawOp::Message {
                session: m.agent_session_id.to_string(),
                seq: m.seq as i64,
                id: m.message_id.to_string(),
                json,
                outbox_seq: message.then_some(*seq + 1),
            },
            Row::PurgeSession { agent_session_id } => RawOp::Purge(agent_session_id.to_string()),
        });
        if let (Some((root, ws)), true) = (target, published) {
            *seq += 1;
            out.push(RawOp::Outbox {
                seq: *seq,
                kind: row.kind(),
                root: root.to_string(),
                ws: ws.to_string(),
                json: outbox_json,
                message,
            });
        }
    }
    out
}

fn raw_apply(conn: &Connection, op: &RawOp) -> rusqlite::Result<()> {
    match op {
        RawOp::Session {
            id,
            ws,
            kind,
            root,
            active,
            created,
            deleted,
            version,
            json,
        } => {
            conn.prepare_cached(
                "INSERT INTO sessions (id, workspace_id, kind, root_agent_session_id, \
                 active_turn_id, created_at, deleted_at, version, json) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) ON CONFLICT (id) DO UPDATE SET \
                 active_turn_id = excluded.active_turn_id, \
                 deleted_at = excluded.deleted_at, version = excluded.version, json = excluded.json",
            )?
            .execute(params![id, ws, kind, root, active, created, deleted, version, json])?;
        }
        RawOp::Turn {
            id,
            session,
            closed,
            created,
            version,
            json,
        } => {
            conn.prepare_cached(
                "INSERT INTO turns (id, agent_session_id, child_creation_closed, created_at, \
                 version, json) VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (id) DO UPDATE SET \
                 child_creation_closed = excluded.child_creation_closed, \
                 version = excluded.version, json = excluded.json",
            )?
            .execute(params![id, session, closed, created, version, json])?;
        }
        RawOp::Interaction {
            turn,
            request,
            session,
            version,
            json,
        } => {
            conn.prepare_cached(
                "INSERT INTO interactions (turn_id, request_id, agent_session_id, version, json) \
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (turn_id, request_id) DO UPDATE SET \
                 version = excluded.version, json = excluded.json",
            )?
            .execute(params![turn, request, session, version, json])?;
        }
        RawOp::ToolCall {
            session,
            call,
            version,
            json,
        } => {
            conn.prepare_cached(
                "INSERT INTO tool_calls (agent_session_id, tool_call_id, version, json) \
                 VALUES (?1, ?2, ?3, ?4) ON CONFLICT (agent_session_id, tool_call_id) DO UPDATE \
                 SET version = excluded.version, json = excluded.json",
            )?
            .execute(params![session, call, version, json])?;
        }
        RawOp::Op {
            id,
            root,
            state,
            version,
            json,
        } => {
            conn.prepare_cached(
                "INSERT INTO cancel_operations (id, root_agent_session_id, state, version, json) \
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (id) DO UPDATE SET \
                 state = excluded.state, version = excluded.version, json = excluded.json",
            )?
            .execute(params![id, root, state, version, json])?;
        }
        RawOp::Message {
            session,
            seq,
            id,
            json,
            outbox_seq,
        } => {
            conn.prepare_cached(
                "INSERT INTO messages (agent_session_id, seq, message_id, json, outbox_seq) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![session, seq, id, json, outbox_seq])?;
        }
        RawOp::Purge(s) => {
            for sql in [
                "UPDATE outbox SET payload = (SELECT json FROM messages AS m \
                 WHERE m.rowid = outbox.message_rowid), message_rowid = NULL \
                 WHERE seq IN (SELECT outbox_seq FROM messages WHERE agent_session_id = ?1 \
                 AND outbox_seq IS NOT NULL) AND message_rowid IS NOT NULL",
                "DELETE FROM turns WHERE agent_session_id = ?1",
                "DELETE FROM interactions WHERE agent_session_id = ?1",
                "DELETE FROM messages WHERE agent_session_id = ?1",
                "DELETE FROM tool_calls WHERE agent_session_id = ?1",
            ] {
                conn.prepare_cached(sql)?.execute([s])?;
            }
        }
        RawOp::Outbox {
            seq,
            kind,
            root,
            ws,
            json,
            message,
        } => {
            let message = message.then(|| conn.last_insert_rowid());
            conn.prepare_cached(
                "INSERT INTO outbox (seq, kind, root_agent_session_id, workspace_id, payload, \
                 message_rowid) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )?
            .execute(params![seq, kind, root, ws, json, message])?;
        }
    }
    Ok(())
}

/// Time this thread has spent on a CPU (Linux `schedstat`), so that figures can be compared on a
/// busy machine; `None` elsewhere.
fn cpu_time() -> Option<Duration> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = s.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// Wall and CPU time of one run.
#[derive(Clone, Copy)]
struct Took {
    wall: f64,
    cpu: Option<f64>,
}

fn timed<E>(f: impl FnOnce() -> Result<(), E>) -> Result<Took, E> {
    let (t, c) = (Instant::now(), cpu_time());
    f()?;
    let wall = t.elapsed().as_secs_f64();
    let cpu = match (c, cpu_time()) {
        (Some(a), Some(b)) => Some((b - a).as_secs_f64()),
        _ => None,
    };
    Ok(Took { wall, cpu })
}

/// Where checkpoints run: on a thread of their own (the daemon's way), or in the commits that
/// cross SQLite's automatic threshold.
#[derive(Clone, Copy, PartialEq)]
enum Checkpoints {
    Thread,
    OnCommit,
}

fn raw_run(
    path: &std::path::Path,
    groups: &[Vec<RawOp>],
    how: Checkpoints,
) -> Result<Took, Box<dyn std::error::Error>> {
    let mut conn = Connection::open(path)?;
    conn.pragma_update(None, "page_size", tutti_sqlite::schema::PAGE_SIZE)?;
    conn.pragma_update_and_check(None, "journal_mode", "WAL", |_| Ok(()))?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.pragma_update(None, "foreign_keys", true)?;
    conn.execute_batch(&tutti_sqlite::schema::ddl())?;
    conn.set_prepared_statement_cache_capacity(64);
    let thread = match how {
        Checkpoints::Thread => {
            conn.pragma_update(None, "wal_autocheckpoint", 0)?;
            Some(Checkpointer::start(
                path,
                CheckpointPolicy::default(),
                |_| {},
            )?)
        }
        Checkpoints::OnCommit => None,
    };
    Ok(timed(|| {
        for g in groups {
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            for op in g {
                raw_apply(&tx, op)?;
            }
            tx.commit()?;
            if let Some(t) = &thread {
                t.committed();
                if t.restart_wanted() {
                    // What `SqliteStore::checkpoint(RestartNoWait)` runs.
                    conn.busy_timeout(Duration::ZERO)?;
                    conn.query_row("PRAGMA wal_checkpoint(RESTART)", [], |_| Ok(()))?;
                    conn.busy_timeout(Duration::from_secs(5))?;
                    t.restarted();
                }
            }
        }
        Ok::<(), rusqlite::Error>(())
    })?)
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
