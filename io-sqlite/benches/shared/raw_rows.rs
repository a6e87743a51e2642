//! Raw rusqlite writing the rows the store writes (no guards, no version checks, no
//! serialization): the store's raw ceiling. Shared by `cargo bench -p tutti-sqlite` and
//! `cargo bench -p tutti-tokio --bench knee` (included by path).

#![allow(dead_code)]

use rusqlite::{params, Connection};
use std::time::{Duration, Instant};
use tutti_core::step::{PersistBatch, Row};
use tutti_sqlite::{CheckpointPolicy, Checkpointer};

/// One raw statement: which SQL, and its pre-computed parameters.
pub enum RawOp {
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
pub fn raw_ops(batch: &PersistBatch, seq: &mut i64) -> Vec<RawOp> {
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
                closed: t.child_creation_closed(),
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

pub fn raw_apply(conn: &Connection, op: &RawOp) -> rusqlite::Result<()> {
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
pub fn cpu_time() -> Option<Duration> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = s.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// Wall and CPU time of one run.
#[derive(Clone, Copy)]
pub struct Took {
    pub wall: f64,
    pub cpu: Option<f64>,
}

pub fn timed<E>(f: impl FnOnce() -> Result<(), E>) -> Result<Took, E> {
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
pub enum Checkpoints {
    Thread,
    OnCommit,
}

pub fn raw_run(
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
    // The outbox by root in arrears, as the store keeps it (`tutti_sqlite::outbox_roots`).
    let mut through = 0i64;
    Ok(timed(|| {
        for g in groups {
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let mut last = through;
            for op in g {
                raw_apply(&tx, op)?;
                if let RawOp::Outbox { seq, .. } = op {
                    last = last.max(*seq);
                }
            }
            if last - through >= tutti_sqlite::outbox_roots::LAG as i64 {
                tx.prepare_cached(
                    "INSERT INTO outbox_roots (first_seq, last_seq, root_agent_session_id, seqs) \
                     SELECT min(seq), max(seq), root_agent_session_id, group_concat(seq) FROM \
                     (SELECT seq, root_agent_session_id FROM outbox \
                     WHERE seq > ?1 AND seq <= ?2 ORDER BY seq) \
                     GROUP BY root_agent_session_id ORDER BY min(seq)",
                )?
                .execute(params![through, last])?;
                tx.prepare_cached("UPDATE meta SET value = ?1 WHERE key = 'outbox_roots_through'")?
                    .execute([last])?;
                through = last;
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
