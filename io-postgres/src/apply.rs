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
use tutti_core::model::{CancelState, Id, Message, SessionKind};
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
macro_rules! upsert_tool_call {
    () => {
        "INSERT INTO tool_calls (agent_session_id, tool_call_id, version, json) \
         VALUES ($1, $2, $3, $4) \
         ON CONFLICT (agent_session_id, tool_call_id) DO UPDATE SET version = excluded.version, \
         json = excluded.json WHERE excluded.version > tool_calls.version"
    };
}
macro_rules! insert_message {
    () => {
        "INSERT INTO messages (agent_session_id, seq, message_id, json) \
         VALUES ($1, $2, $3, $4) ON CONFLICT (agent_session_id, seq) DO NOTHING"
    };
}
/// The outbox row of a row written by the statement `w` of a `WITH w AS (... RETURNING 1)`
/// whose own parameters are `$1`-`$4`: inserted only when `w` wrote its row (see
/// [`Writer::apply`]).
macro_rules! outbox_of_w {
    () => {
        " RETURNING 1) INSERT INTO outbox (seq, kind, root_agent_session_id, workspace_id, \
         payload) SELECT $5::bigint, $6::text, $7::text, $8::text, $4 FROM w"
    };
}
/// [`outbox_of_w`] for the transaction's first outbox row: the seq is the counter's, read from
/// the counter row `c`, which the statement locks `FOR UPDATE` as [`NEXT_SEQ_LOCK`] does
/// (`$5`-`$7`: kind, tree, workspace); returns the seq, or no row when `w` wrote nothing (then
/// the counter may not have been read, and the next published row locks it again).
macro_rules! first_outbox_of_w {
    () => {
        " RETURNING 1) INSERT INTO outbox (seq, kind, root_agent_session_id, workspace_id, \
         payload) SELECT c.value, $5::text, $6::text, $7::text, $4 FROM w, c RETURNING seq"
    };
}
macro_rules! with_counter {
    () => {
        "WITH c AS (SELECT value FROM meta WHERE key = 'outbox_next_seq' FOR UPDATE), w AS ("
    };
}
const UPSERT_TOOL_CALL: &str = upsert_tool_call!();
const INSERT_MESSAGE: &str = insert_message!();
/// [`UPSERT_TOOL_CALL`] and, when it wrote, its outbox row: one round trip.
const UPSERT_TOOL_CALL_PUBLISHED: &str =
    concat!("WITH w AS (", upsert_tool_call!(), outbox_of_w!());
/// [`INSERT_MESSAGE`] and, when it wrote, its outbox row: one round trip.
const INSERT_MESSAGE_PUBLISHED: &str = concat!("WITH w AS (", insert_message!(), outbox_of_w!());
/// [`UPSERT_TOOL_CALL_PUBLISHED`] that also locks and reads the outbox counter.
const UPSERT_TOOL_CALL_FIRST_PUBLISHED: &str =
    concat!(with_counter!(), upsert_tool_call!(), first_outbox_of_w!());
/// [`INSERT_MESSAGE_PUBLISHED`] that also locks and reads the outbox counter.
const INSERT_MESSAGE_FIRST_PUBLISHED: &str =
    concat!(with_counter!(), insert_message!(), first_outbox_of_w!());
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

const LEASE_EPOCHS: &str = "SELECT root_agent_session_id, epoch FROM tree_leases \
     WHERE root_agent_session_id = ANY($1) FOR SHARE";

const SET_MARK: &str = "INSERT INTO commit_marks (writer, n) VALUES ($1, $2) \
     ON CONFLICT (writer) DO UPDATE SET n = excluded.n";

/// Locks the outbox counter row until the transaction ends and reads the next seq.
pub(crate) const NEXT_SEQ_LOCK: &str =
    "SELECT value FROM meta WHERE key = 'outbox_next_seq' FOR UPDATE";
/// The end of a transaction that published rows, in one round trip (issue 33: each round trip
/// costs the engine thread tens of microseconds): the advanced counter (`$1`), the writer's
/// commit mark (`$3`, `$4`, as [`SET_MARK`]) and the notification of the last published seq
/// (`$2`) that tells every listener (see [`crate::notify`]); PostgreSQL delivers it when, and
/// only if, the transaction commits. The statements of a `WITH` run once each whether or not
/// the query reads them.
/// The payload names the schema: the channel is per database, and stores in several schemas of
/// one database must not wake each other's followers with foreign seqs.
const FINISH_MARKED: &str = "WITH next_seq AS (UPDATE meta SET value = $1 \
     WHERE key = 'outbox_next_seq'), \
     mark AS (INSERT INTO commit_marks (writer, n) VALUES ($3, $4) \
     ON CONFLICT (writer) DO UPDATE SET n = excluded.n) \
     SELECT pg_notify('tutti_outbox', current_schema() || ':' || $2)";

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

    /// Ends the transaction's writes; call once, after the last batch, before committing:
    /// writes the advanced counter back and notifies the listeners when rows were published,
    /// and stores `mark` as `writer`'s last commit (see
    /// [`crate::PostgresStore::read_back_commit`]), in one round trip ([`FINISH_MARKED`]) when
    /// there is a counter to write.
    pub(crate) fn finish(&mut self, writer: &str, mark: u64) -> Result<(), PgError> {
        let mark = to_i64("commit mark", mark)?;
        match (self.next_seq, self.first_seq) {
            (Some(n), Some(first)) if n != first => {
                let v = to_i64("outbox seq", n)?;
                let last = (n - 1).to_string();
                let s = self.stmt(FINISH_MARKED)?;
                self.tx.query(&s, &[&v, &last, &writer, &mark])?;
            }
            _ => {
                self.exec(SET_MARK, &[&writer, &mark])?;
            }
        }
        Ok(())
    }

    /// The fencing checks of a group (see [`crate::lease`]), in one round trip: `fenced` holds
    /// (batch index, tree, epoch) for each fenced batch, in order; each tree's lease row, read
    /// `FOR SHARE` so that no claim changes it before this transaction ends, must still hold
    /// the epoch the batch was decided under. `Err` names the first batch whose fence does not
    /// hold.
    pub(crate) fn check_fences(
        &mut self,
        fenced: &[(usize, &Id, u64)],
    ) -> Result<(), (usize, PgError)> {
        let Some(&(first, ..)) = fenced.first() else {
            return Ok(());
        };
        let mut roots: Vec<&str> = fenced.iter().map(|(_, r, _)| &***r).collect();
        roots.sort_unstable();
        roots.dedup();
        let stored: std::collections::HashMap<String, i64> = self
            .stmt(LEASE_EPOCHS)
            .and_then(|s| Ok(self.tx.query(&s, &[&roots])?))
            .map_err(|e| (first, e))?
            .into_iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        for &(index, root, epoch) in fenced {
            let current = stored
                .get(&**root)
                .map(|v| to_u64("lease epoch", *v))
                .transpose()
                .map_err(|e| (index, e))?;
            if current != Some(epoch) {
                return Err((
                    index,
                    PgError::Fenced {
                        root: root.to_string(),
                        epoch,
                        current,
                    },
                ));
            }
        }
        Ok(())
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
        // Issue 33: the outbox row of each published row is written right after its row (for
        // a message or a tool call, by the same statement: one round trip instead of two),
        // unless the batch purges sessions (their kept outbox rows are redacted first, before
        // the batch's own are written) or lists its published rows out of order. The outbox
        // rows are numbered in the same order either way. (The outbox counter row is then
        // locked at the batch's first published row rather than after its last row: the rows
        // in between are its own tree's, which one daemon writes at a time under its lease.)
        let interleave = match (&batch.root_agent_session_id, &batch.workspace_id) {
            (Some(root), Some(ws))
                if batch.outbox.windows(2).all(|p| p[0] < p[1])
                    && !batch
                        .rows
                        .iter()
                        .any(|r| matches!(r, Row::PurgeSession { .. })) =>
            {
                Some((&**root, &**ws))
            }
            _ => None,
        };
        let mut to_publish = batch.outbox.iter().peekable();
        let mut out = Vec::new();
        // The rows' JSON, for the outbox rows written after all rows (not interleaved).
        let mut written: Vec<Option<String>> = Vec::new();
        for (i, (row, guard)) in batch.rows.iter().zip(&folded).enumerate() {
            let at = guard.map(|g| match g {
                Guard::SessionVersion { version, .. }
                | Guard::TurnVersion { version, .. }
                | Guard::CancelVersion { version, .. } => *version,
                Guard::ChildCreationOpen { .. } => 0,
            });
            let publish = interleave.filter(|_| to_publish.next_if_eq(&&(i as u32)).is_some());
            let w = match publish {
                Some((root, ws)) => self.write_published(row, at, i as u32, root, ws, &mut out)?,
                None => self.write(row, at)?,
            };
            if let (None, Some(g)) = (&w, guard) {
                // Not stored at the guarded version: only a replay of this batch may pass.
                if !self.check(batch, g)? {
                    return Err(PgError::GuardFailed((*g).clone()));
                }
            }
            if interleave.is_none() {
                written.push(w);
            }
        }
        if interleave.is_some() {
            return Ok(out);
        }
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
            let published = self.publish(row, i, root, ws, json)?;
            out.push(published);
        }
        Ok(out)
    }

    /// Writes the outbox row of row `i` of a batch (written as `json`), numbered next.
    fn publish(
        &mut self,
        row: &Row,
        i: u32,
        root: &str,
        ws: &str,
        json: &str,
    ) -> Result<Published, PgError> {
        let seq = self.next_seq()?;
        let seq_i = to_i64("outbox seq", seq)?;
        let s = self.stmt(INSERT_OUTBOX)?;
        self.tx
            .execute(&s, &[&seq_i, &row.kind(), &root, &ws, &json])?;
        self.next_seq = Some(seq + 1);
        Ok(self.published(seq, i, json))
    }

    fn published(&self, seq: u64, row: u32, json: &str) -> Published {
        Published {
            seq,
            row,
            payload: if self.capture {
                json.to_string()
            } else {
                String::new()
            },
        }
    }

    /// [`Writer::write`] for row `i` of a batch that is published, with its outbox row (pushed
    /// to `out`) when it wrote: a message or a tool call and its outbox row in one statement
    /// ([`INSERT_MESSAGE_PUBLISHED`], [`UPSERT_TOOL_CALL_PUBLISHED`]), the other rows with a
    /// second one.
    fn write_published(
        &mut self,
        row: &Row,
        at: Option<u64>,
        i: u32,
        root: &str,
        ws: &str,
        out: &mut Vec<Published>,
    ) -> Result<Option<String>, PgError> {
        let kind = row.kind();
        let (json, seq) = match row {
            Row::ToolCall(c) => {
                let json = encode(&**c)?;
                let v = to_i64("version", c.version)?;
                let seq = self.exec_published(
                    [UPSERT_TOOL_CALL_PUBLISHED, UPSERT_TOOL_CALL_FIRST_PUBLISHED],
                    [&&*c.agent_session_id, &&*c.tool_call_id, &v, &json],
                    kind,
                    root,
                    ws,
                )?;
                (json, seq)
            }
            Row::Message(m) => {
                let json = encode(m)?;
                let at_seq = to_i64("message seq", m.seq)?;
                let seq = self.exec_published(
                    [INSERT_MESSAGE_PUBLISHED, INSERT_MESSAGE_FIRST_PUBLISHED],
                    [&&*m.agent_session_id, &at_seq, &&*m.message_id, &json],
                    kind,
                    root,
                    ws,
                )?;
                if seq.is_none() {
                    self.message_replayed(m, at_seq, &json)?;
                }
                (json, seq)
            }
            _ => {
                let Some(json) = self.write(row, at)? else {
                    return Ok(None);
                };
                out.push(self.publish(row, i, root, ws, &json)?);
                return Ok(Some(json));
            }
        };
        let Some(seq) = seq else {
            return Ok(None);
        };
        out.push(self.published(seq, i, &json));
        Ok(Some(json))
    }

    /// Runs a row's statement together with its outbox row (`sql[0]`, see [`outbox_of_w`];
    /// `row`: the statement's own parameters, `$1`-`$4`): the seq of the outbox row written, or
    /// `None` when the row was not written (nothing published). Until the transaction has
    /// locked the outbox counter, the statement locks and reads it too (`sql[1]`, see
    /// [`first_outbox_of_w`]): one round trip less per transaction.
    fn exec_published(
        &mut self,
        sql: [&'static str; 2],
        row: [&(dyn ToSql + Sync); 4],
        kind: &str,
        root: &str,
        ws: &str,
    ) -> Result<Option<u64>, PgError> {
        let [a, b, c, d] = row;
        if let Some(seq) = self.next_seq {
            let seq_i = to_i64("outbox seq", seq)?;
            let n = self.exec(sql[0], &[a, b, c, d, &seq_i, &kind, &root, &ws])?;
            if n == 0 {
                return Ok(None);
            }
            self.next_seq = Some(seq + 1);
            return Ok(Some(seq));
        }
        let s = self.stmt(sql[1])?;
        let rows = self.tx.query(&s, &[a, b, c, d, &kind, &root, &ws])?;
        let Some(r) = rows.first() else {
            return Ok(None);
        };
        let seq = to_u64("outbox seq", r.get::<_, i64>(0))?;
        self.first_seq = Some(seq);
        self.next_seq = Some(seq + 1);
        Ok(Some(seq))
    }

    /// Issue 34: a message at a taken (session, seq) is never dropped silently inside a batch
    /// that otherwise commits: only a replay of this very row (stored as `json`) passes;
    /// another message there refuses the whole batch.
    fn message_replayed(&mut self, m: &Message, seq: i64, json: &str) -> Result<(), PgError> {
        let s = self.stmt(MESSAGE_AT)?;
        let stored: Option<String> = self
            .tx
            .query_opt(&s, &[&&*m.agent_session_id, &seq])?
            .map(|r| r.get(0));
        if stored.as_deref() != Some(json) {
            return Err(PgError::RowConflict {
                table: "messages",
                key: format!("{} seq {}", m.agent_session_id, m.seq),
            });
        }
        Ok(())
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
                    self.message_replayed(m, seq, &json)?;
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
