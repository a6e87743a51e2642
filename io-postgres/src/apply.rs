//! Applying persist batches: guards, idempotent upserts and outbox rows, inside one transaction.
//!
//! The same rules as `MemoryStore` and the SQLite store: guards first (a version guard on a row
//! the batch writes is folded into that row's write, as in SQLite), the whole batch or nothing,
//! upserts that skip rows stored at the same or a newer version, messages inserted once per
//! (session, seq), one outbox row per published row that was actually written, numbered from the
//! shared counter row.
//!
//! Concurrency (several daemons on one database, `READ COMMITTED`): a folded guard is an
//! `UPDATE ... WHERE version = $expected` or an `INSERT ... ON CONFLICT DO NOTHING`; PostgreSQL
//! re-evaluates the `WHERE` on the newest committed row after waiting for a concurrent writer of
//! that row, so of two writers that decided on the same version exactly one writes. A guard
//! checked on its own reads its row `FOR SHARE`, so the row cannot change until this transaction
//! ends.

use crate::error::{to_i64, to_u64, PgError};
use crate::Cache;
use postgres::types::ToSql;
use postgres::{GenericClient, Statement, Transaction};
use serde::Serialize;
use tutti_core::model::{CancelState, SessionKind};
use tutti_core::step::{Guard, PersistBatch, Row};
use tutti_core::store::Published;

const UPSERT_SESSION: &str = "INSERT INTO sessions (id, workspace_id, kind, \
     root_agent_session_id, active_turn_id, created_at, deleted_at, version, json) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
     ON CONFLICT (id) DO UPDATE SET active_turn_id = excluded.active_turn_id, \
     deleted_at = excluded.deleted_at, version = excluded.version, json = excluded.json \
     WHERE excluded.version > sessions.version";
const INSERT_SESSION_NEW: &str = "INSERT INTO sessions (id, workspace_id, kind, \
     root_agent_session_id, active_turn_id, created_at, deleted_at, version, json) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (id) DO NOTHING";
const UPDATE_SESSION_AT: &str = "UPDATE sessions SET active_turn_id = $2, deleted_at = $3, \
     version = $4, json = $5 WHERE id = $1 AND version = $6";

const UPSERT_TURN: &str = "INSERT INTO turns (id, agent_session_id, child_creation_closed, \
     created_at, version, json) VALUES ($1, $2, $3, $4, $5, $6) \
     ON CONFLICT (id) DO UPDATE SET child_creation_closed = excluded.child_creation_closed, \
     version = excluded.version, json = excluded.json WHERE excluded.version > turns.version";
const INSERT_TURN_NEW: &str = "INSERT INTO turns (id, agent_session_id, \
     child_creation_closed, created_at, version, json) VALUES ($1, $2, $3, $4, $5, $6) \
     ON CONFLICT (id) DO NOTHING";
const UPDATE_TURN_AT: &str = "UPDATE turns SET child_creation_closed = $2, version = $3, \
     json = $4 WHERE id = $1 AND version = $5";

const UPSERT_OP: &str = "INSERT INTO cancel_operations (id, root_agent_session_id, state, \
     version, json) VALUES ($1, $2, $3, $4, $5) \
     ON CONFLICT (id) DO UPDATE SET state = excluded.state, version = excluded.version, \
     json = excluded.json WHERE excluded.version > cancel_operations.version";
const INSERT_OP_NEW: &str = "INSERT INTO cancel_operations (id, root_agent_session_id, state, \
     version, json) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (id) DO NOTHING";
const UPDATE_OP_AT: &str = "UPDATE cancel_operations SET state = $2, version = $3, json = $4 \
     WHERE id = $1 AND version = $5";

const UPSERT_INTERACTION: &str = "INSERT INTO interactions (turn_id, request_id, \
     agent_session_id, version, json) VALUES ($1, $2, $3, $4, $5) \
     ON CONFLICT (turn_id, request_id) DO UPDATE SET version = excluded.version, \
     json = excluded.json WHERE excluded.version > interactions.version";
const UPSERT_TOOL_CALL: &str = "INSERT INTO tool_calls (agent_session_id, tool_call_id, \
     version, json) VALUES ($1, $2, $3, $4) \
     ON CONFLICT (agent_session_id, tool_call_id) DO UPDATE SET version = excluded.version, \
     json = excluded.json WHERE excluded.version > tool_calls.version";
const INSERT_MESSAGE: &str = "INSERT INTO messages (agent_session_id, seq, message_id, json) \
     VALUES ($1, $2, $3, $4) ON CONFLICT (agent_session_id, seq) DO NOTHING";
const MESSAGE_AT: &str = "SELECT json FROM messages WHERE agent_session_id = $1 AND seq = $2";
const PURGE: [&str; 4] = [
    "DELETE FROM turns WHERE agent_session_id = $1",
    "DELETE FROM interactions WHERE agent_session_id = $1",
    "DELETE FROM messages WHERE agent_session_id = $1",
    "DELETE FROM tool_calls WHERE agent_session_id = $1",
];
/// The session a kept outbox row belongs to (`NULL`: a row that is never redacted).
macro_rules! row_owner {
    () => {
        "(CASE WHEN kind IN ('sessionDeleted', 'sessionPurged', 'redacted') THEN NULL \
          WHEN kind = 'session' THEN payload::jsonb ->> 'id' \
          ELSE payload::jsonb ->> 'agentSessionId' END)"
    };
}
/// After a batch purged sessions `$2` of tree `$1`: their kept outbox rows become redacted rows
/// with ids only (see [`tutti_core::step::Row::PurgeSession`]); run before the batch's own
/// outbox rows are written.
const REDACT_TREE_OUTBOX: &str = concat!(
    "UPDATE outbox SET kind = 'redacted', payload = json_build_object('agentSessionId', ",
    row_owner!(),
    ", 'kind', kind)::text WHERE root_agent_session_id = $1 AND ",
    row_owner!(),
    " = ANY($2)"
);
const INSERT_OUTBOX: &str = "INSERT INTO outbox (seq, kind, root_agent_session_id, \
     workspace_id, payload) VALUES ($1, $2, $3, $4, $5)";

const SESSION_GUARD: &str = "SELECT version, json FROM sessions WHERE id = $1 FOR SHARE";
const TURN_GUARD: &str = "SELECT version, json FROM turns WHERE id = $1 FOR SHARE";
const OP_GUARD: &str = "SELECT version, json FROM cancel_operations WHERE id = $1 FOR SHARE";
const SESSION_EXISTS: &str = "SELECT 1 FROM sessions WHERE id = $1";
const TURN_CLOSED: &str = "SELECT child_creation_closed FROM turns WHERE id = $1 FOR SHARE";

const LEASE_EPOCH: &str =
    "SELECT epoch FROM tree_leases WHERE root_agent_session_id = $1 FOR SHARE";

const SET_MARK: &str = "INSERT INTO commit_marks (writer, n) VALUES ($1, $2) \
     ON CONFLICT (writer) DO UPDATE SET n = excluded.n";

/// Locks the outbox counter row until the transaction ends and reads the next seq.
pub(crate) const NEXT_SEQ_LOCK: &str =
    "SELECT value FROM meta WHERE key = 'outbox_next_seq' FOR UPDATE";
const SET_NEXT_SEQ: &str = "UPDATE meta SET value = $1 WHERE key = 'outbox_next_seq'";
/// Tells every listener the last published seq (see [`crate::notify`]); PostgreSQL delivers it
/// when, and only if, the transaction commits.
/// The payload names the schema: the channel is per database, and stores in several schemas of
/// one database must not wake each other's followers with foreign seqs.
const NOTIFY_SEQ: &str = "SELECT pg_notify('tutti_outbox', current_schema() || ':' || $1)";

/// Prepares a statement once per connection.
pub(crate) fn prep(
    cache: &mut Cache,
    c: &mut impl GenericClient,
    sql: &'static str,
) -> Result<Statement, PgError> {
    if let Some(s) = cache.get(sql) {
        return Ok(s.clone());
    }
    let s = c.prepare(sql)?;
    cache.insert(sql, s.clone());
    Ok(s)
}

fn kind_str(k: SessionKind) -> &'static str {
    match k {
        SessionKind::Root => "root",
        SessionKind::Child => "child",
    }
}

pub(crate) fn state_str(s: CancelState) -> &'static str {
    match s {
        CancelState::Prepared => "prepared",
        CancelState::Completed => "completed",
        CancelState::Failed => "failed",
    }
}

fn encode<T: Serialize>(v: &T) -> Result<String, PgError> {
    serde_json::to_string(v).map_err(PgError::Encode)
}

/// The index in `rows` of the row a version guard folds into: the same entity at the guard's
/// `next` version, one past its `version`.
fn guarded_row(rows: &[Row], g: &Guard) -> Option<usize> {
    let (id, version, next) = match g {
        Guard::SessionVersion { id, version, next }
        | Guard::TurnVersion { id, version, next }
        | Guard::CancelVersion { id, version, next } => (id, *version, *next),
        Guard::ChildCreationOpen { .. } => return None,
    };
    if version.checked_add(1) != Some(next) {
        return None;
    }
    rows.iter().position(|r| match (g, r) {
        (Guard::SessionVersion { .. }, Row::Session(s)) => s.id == *id && s.version == next,
        (Guard::TurnVersion { .. }, Row::Turn(t)) => t.id == *id && t.version == next,
        (Guard::CancelVersion { .. }, Row::CancelOperation(o)) => o.id == *id && o.version == next,
        _ => false,
    })
}

/// Applies batches inside one open transaction.
pub(crate) struct Writer<'a, 't> {
    tx: &'a mut Transaction<'t>,
    cache: &'a mut Cache,
    /// The next outbox seq, once the counter row is locked.
    next_seq: Option<u64>,
    /// The counter's value when it was locked.
    first_seq: Option<u64>,
    capture: bool,
}

impl<'a, 't> Writer<'a, 't> {
    pub(crate) fn new(tx: &'a mut Transaction<'t>, cache: &'a mut Cache, capture: bool) -> Self {
        Writer {
            tx,
            cache,
            next_seq: None,
            first_seq: None,
            capture,
        }
    }

    fn stmt(&mut self, sql: &'static str) -> Result<Statement, PgError> {
        prep(self.cache, self.tx, sql)
    }

    fn exec(&mut self, sql: &'static str, p: &[&(dyn ToSql + Sync)]) -> Result<u64, PgError> {
        let s = self.stmt(sql)?;
        Ok(self.tx.execute(&s, p)?)
    }

    fn next_seq(&mut self) -> Result<u64, PgError> {
        if let Some(n) = self.next_seq {
            return Ok(n);
        }
        let s = self.stmt(NEXT_SEQ_LOCK)?;
        let v: i64 = self.tx.query_one(&s, &[])?.get(0);
        let n = to_u64("outbox seq", v)?;
        self.next_seq = Some(n);
        self.first_seq = Some(n);
        Ok(n)
    }

    /// Writes the advanced counter back; call once, after the last batch, before committing.
    pub(crate) fn finish(&mut self) -> Result<(), PgError> {
        if let (Some(n), Some(first)) = (self.next_seq, self.first_seq) {
            if n != first {
                let v = to_i64("outbox seq", n)?;
                self.exec(SET_NEXT_SEQ, &[&v])?;
                let last = (n - 1).to_string();
                self.exec(NOTIFY_SEQ, &[&last])?;
            }
        }
        Ok(())
    }

    /// Stores `mark` as `writer`'s last commit inside this transaction (see
    /// [`crate::PostgresStore::read_back_commit`]).
    pub(crate) fn mark(&mut self, writer: &str, mark: u64) -> Result<(), PgError> {
        let n = to_i64("commit mark", mark)?;
        self.exec(SET_MARK, &[&writer, &n])?;
        Ok(())
    }

    /// The fencing check of a tree fenced at `epoch` on this handle (see [`crate::lease`]): the
    /// lease row, read `FOR SHARE` so that no claim changes it before this transaction ends,
    /// must still hold `epoch`.
    pub(crate) fn check_fence(&mut self, root: &str, epoch: u64) -> Result<(), PgError> {
        let s = self.stmt(LEASE_EPOCH)?;
        let stored: Option<i64> = self.tx.query_opt(&s, &[&root])?.map(|r| r.get(0));
        let current = stored.map(|v| to_u64("lease epoch", v)).transpose()?;
        if current == Some(epoch) {
            Ok(())
        } else {
            Err(PgError::Fenced {
                root: root.to_string(),
                epoch,
                current,
            })
        }
    }

    /// Applies one batch. On an error the caller rolls the transaction back.
    pub(crate) fn apply(&mut self, batch: &PersistBatch) -> Result<Vec<Published>, PgError> {
        // Fold each version guard into its row's write, check the others now.
        let mut folded: Vec<Option<&Guard>> = vec![None; batch.rows.len()];
        let mut from = 0;
        for g in &batch.guards {
            if let Some(ri) = guarded_row(&batch.rows[from..], g).map(|r| r + from) {
                folded[ri] = Some(g);
                from = ri + 1;
                continue;
            }
            if !self.check(batch, g)? {
                return Err(PgError::GuardFailed(g.clone()));
            }
        }
        let mut written: Vec<Option<String>> = Vec::with_capacity(batch.rows.len());
        for (row, guard) in batch.rows.iter().zip(&folded) {
            let at = guard.map(|g| match g {
                Guard::SessionVersion { version, .. }
                | Guard::TurnVersion { version, .. }
                | Guard::CancelVersion { version, .. } => *version,
                Guard::ChildCreationOpen { .. } => 0,
            });
            let w = self.write(row, at)?;
            if let (None, Some(g)) = (&w, guard) {
                // Not stored at the guarded version: only a replay of this batch may pass.
                if !self.check(batch, g)? {
                    return Err(PgError::GuardFailed((*g).clone()));
                }
            }
            written.push(w);
        }
        let mut out = Vec::new();
        let (Some(root), Some(ws)) = (&batch.root_agent_session_id, &batch.workspace_id) else {
            return Ok(out);
        };
        let purged: Vec<&str> = batch
            .rows
            .iter()
            .filter_map(|r| match r {
                Row::PurgeSession { agent_session_id } => Some(&**agent_session_id),
                _ => None,
            })
            .collect();
        if !purged.is_empty() {
            self.exec(REDACT_TREE_OUTBOX, &[&&**root, &purged])?;
        }
        for &i in &batch.outbox {
            let (Some(Some(json)), Some(row)) =
                (written.get(i as usize), batch.rows.get(i as usize))
            else {
                continue;
            };
            let seq = self.next_seq()?;
            let seq_i = to_i64("outbox seq", seq)?;
            let s = self.stmt(INSERT_OUTBOX)?;
            self.tx
                .execute(&s, &[&seq_i, &row.kind(), &&**root, &&**ws, json])?;
            self.next_seq = Some(seq + 1);
            out.push(Published {
                seq,
                row: i,
                payload: if self.capture {
                    json.clone()
                } else {
                    String::new()
                },
            });
        }
        Ok(out)
    }

    /// Writes one row (with its folded guard's expected version `at`); returns its JSON when
    /// something was written.
    fn write(&mut self, row: &Row, at: Option<u64>) -> Result<Option<String>, PgError> {
        let (json, n) = match row {
            Row::Session(s) => {
                let json = encode(&**s)?;
                let v = to_i64("version", s.version)?;
                let n = match at {
                    None | Some(0) => self.exec(
                        if at.is_none() {
                            UPSERT_SESSION
                        } else {
                            INSERT_SESSION_NEW
                        },
                        &[
                            &&*s.id,
                            &&*s.workspace_id,
                            &kind_str(s.kind()),
                            &s.root_agent_session_id().map(|r| &**r),
                            &s.active_turn_id.as_deref(),
                            &s.created_at,
                            &s.deleted_at,
                            &v,
                            &json,
                        ],
                    )?,
                    Some(old) => {
                        let old = to_i64("version", old)?;
                        self.exec(
                            UPDATE_SESSION_AT,
                            &[
                                &&*s.id,
                                &s.active_turn_id.as_deref(),
                                &s.deleted_at,
                                &v,
                                &json,
                                &old,
                            ],
                        )?
                    }
                };
                (json, n)
            }
            Row::Turn(t) => {
                let json = encode(&**t)?;
                let v = to_i64("version", t.version)?;
                let n = match at {
                    None | Some(0) => self.exec(
                        if at.is_none() {
                            UPSERT_TURN
                        } else {
                            INSERT_TURN_NEW
                        },
                        &[
                            &&*t.id,
                            &&*t.agent_session_id,
                            &t.child_creation_closed(),
                            &t.created_at,
                            &v,
                            &json,
                        ],
                    )?,
                    Some(old) => {
                        let old = to_i64("version", old)?;
                        self.exec(
                            UPDATE_TURN_AT,
                            &[&&*t.id, &t.child_creation_closed(), &v, &json, &old],
                        )?
                    }
                };
                (json, n)
            }
            Row::CancelOperation(o) => {
                let json = encode(&**o)?;
                let v = to_i64("version", o.version)?;
                let state = state_str(o.state);
                let n = match at {
                    None | Some(0) => self.exec(
                        if at.is_none() {
                            UPSERT_OP
                        } else {
                            INSERT_OP_NEW
                        },
                        &[&&*o.id, &&*o.root_agent_session_id, &state, &v, &json],
                    )?,
                    Some(old) => {
                        let old = to_i64("version", old)?;
                        self.exec(UPDATE_OP_AT, &[&&*o.id, &state, &v, &json, &old])?
                    }
                };
                (json, n)
            }
            Row::Interaction(i) => {
                let json = encode(&**i)?;
                let v = to_i64("version", i.version)?;
                let n = self.exec(
                    UPSERT_INTERACTION,
                    &[
                        &&*i.turn_id,
                        &&*i.request_id,
                        &&*i.agent_session_id,
                        &v,
                        &json,
                    ],
                )?;
                (json, n)
            }
            Row::ToolCall(c) => {
                let json = encode(&**c)?;
                let v = to_i64("version", c.version)?;
                let n = self.exec(
                    UPSERT_TOOL_CALL,
                    &[&&*c.agent_session_id, &&*c.tool_call_id, &v, &json],
                )?;
                (json, n)
            }
            Row::Message(m) => {
                let json = encode(m)?;
                let seq = to_i64("message seq", m.seq)?;
                let n = self.exec(
                    INSERT_MESSAGE,
                    &[&&*m.agent_session_id, &seq, &&*m.message_id, &json],
                )?;
                if n == 0 {
                    // Issue 34: a message at a taken (session, seq) is never dropped silently
                    // inside a batch that otherwise commits: only a replay of this very row
                    // passes; another message there refuses the whole batch.
                    let s = self.stmt(MESSAGE_AT)?;
                    let stored: Option<String> = self
                        .tx
                        .query_opt(&s, &[&&*m.agent_session_id, &seq])?
                        .map(|r| r.get(0));
                    if stored.as_deref() != Some(json.as_str()) {
                        return Err(PgError::RowConflict {
                            table: "messages",
                            key: format!("{} seq {}", m.agent_session_id, m.seq),
                        });
                    }
                }
                (json, n)
            }
            Row::PurgeSession { agent_session_id } => {
                let s: &str = agent_session_id;
                for sql in PURGE {
                    self.exec(sql, &[&s])?;
                }
                (encode(&serde_json::json!({ "agentSessionId": s }))?, 1)
            }
        };
        Ok((n > 0).then_some(json))
    }

    /// Whether a guard holds: "the row is at `version` (0: absent) or already at `next` holding
    /// exactly this batch's row" (a replay of this batch); for `ChildCreationOpen`, "the root turn
    /// is stored with child creation open, unless the child already exists".
    fn check(&mut self, batch: &PersistBatch, g: &Guard) -> Result<bool, PgError> {
        let (sql, id, version, next) = match g {
            Guard::SessionVersion { id, version, next } => (SESSION_GUARD, id, *version, *next),
            Guard::TurnVersion { id, version, next } => (TURN_GUARD, id, *version, *next),
            Guard::CancelVersion { id, version, next } => (OP_GUARD, id, *version, *next),
            Guard::ChildCreationOpen {
                root_turn_id,
                child_agent_session_id,
            } => {
                let s = self.stmt(SESSION_EXISTS)?;
                if self
                    .tx
                    .query_opt(&s, &[&&**child_agent_session_id])?
                    .is_some()
                {
                    return Ok(true);
                }
                let s = self.stmt(TURN_CLOSED)?;
                let closed: Option<bool> = self
                    .tx
                    .query_opt(&s, &[&&**root_turn_id])?
                    .map(|r| r.get(0));
                return Ok(closed == Some(false));
            }
        };
        let s = self.stmt(sql)?;
        let stored = self.tx.query_opt(&s, &[&&**id])?;
        let (v, json): (i64, Option<String>) = match stored {
            Some(r) => (r.get(0), Some(r.get(1))),
            None => (0, None),
        };
        let v = to_u64("version", v)?;
        if v == version {
            return Ok(true);
        }
        if v != next {
            return Ok(false);
        }
        let mine = batch.rows.iter().find_map(|r| match (g, r) {
            (Guard::SessionVersion { .. }, Row::Session(s)) if s.id == *id && s.version == next => {
                Some(encode(&**s))
            }
            (Guard::TurnVersion { .. }, Row::Turn(t)) if t.id == *id && t.version == next => {
                Some(encode(&**t))
            }
            (Guard::CancelVersion { .. }, Row::CancelOperation(o))
                if o.id == *id && o.version == next =>
            {
                Some(encode(&**o))
            }
            _ => None,
        });
        match (mine, json) {
            (Some(mine), Some(stored)) => Ok(mine? == stored),
            _ => Ok(false),
        }
    }
}
