//! Applying persist batches: guards, idempotent upserts, outbox rows, all inside one transaction.

use crate::codec::{decode, Decode};
use crate::error::{to_i64, SqliteError};
use crate::open::ReplayRule;
use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{params, CachedStatement, Connection, OptionalExtension, ToSql};
use serde::Serialize;
use std::ops::Range;
use tutti_core::model::{CancelState, SessionKind};
use tutti_core::step::{Guard, PersistBatch, Row};

// The upserts of versioned entities, without their `WHERE` clause. An update sets only the
// columns that can change (an entity's id, owner, kind and creation time never do), so SQLite
// leaves the index entries on the others alone.
macro_rules! upsert_session {
    () => {
        "INSERT INTO sessions (id, workspace_id, kind, root_agent_session_id, \
         active_turn_id, created_at, deleted_at, version, json) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) \
         ON CONFLICT (id) DO UPDATE SET active_turn_id = excluded.active_turn_id, \
         deleted_at = excluded.deleted_at, version = excluded.version, json = excluded.json "
    };
}
macro_rules! upsert_turn {
    () => {
        "INSERT INTO turns (id, agent_session_id, child_creation_closed, created_at, \
         version, json) VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
         ON CONFLICT (id) DO UPDATE SET \
         child_creation_closed = excluded.child_creation_closed, \
         version = excluded.version, json = excluded.json "
    };
}
macro_rules! upsert_op {
    () => {
        "INSERT INTO cancel_operations (id, root_agent_session_id, state, version, json) \
         VALUES (?1, ?2, ?3, ?4, ?5) \
         ON CONFLICT (id) DO UPDATE SET \
         state = excluded.state, version = excluded.version, json = excluded.json "
    };
}

/// The statements a writer uses (prepared once per connection, fetched once per transaction).
#[derive(Clone, Copy)]
enum Sql {
    SessionVersion,
    TurnVersion,
    OpVersion,
    SessionJson,
    TurnJson,
    OpJson,
    SessionExists,
    TurnClosed,
    UpsertSession,
    InsertSessionNew,
    UpdateSessionAt,
    UpsertTurn,
    InsertTurnNew,
    UpdateTurnAt,
    UpsertInteraction,
    UpsertToolCall,
    UpsertOp,
    InsertOpNew,
    UpdateOpAt,
    InsertMessage,
    RedactMessageOutbox,
    RedactTreeOutbox,
    PurgeTurns,
    PurgeInteractions,
    PurgeMessages,
    PurgeToolCalls,
    InsertOutbox,
    NextSeq,
}

const N_SQL: usize = Sql::NextSeq as usize + 1;

impl Sql {
    fn text(self) -> &'static str {
        match self {
            Sql::InsertSessionNew => INSERT_SESSION_NEW,
            Sql::UpdateSessionAt => UPDATE_SESSION_AT,
            Sql::InsertTurnNew => INSERT_TURN_NEW,
            Sql::UpdateTurnAt => UPDATE_TURN_AT,
            Sql::InsertOpNew => INSERT_OP_NEW,
            Sql::UpdateOpAt => UPDATE_OP_AT,
            Sql::SessionVersion => "SELECT version FROM sessions WHERE id = ?1",
            Sql::TurnVersion => "SELECT version FROM turns WHERE id = ?1",
            Sql::OpVersion => "SELECT version FROM cancel_operations WHERE id = ?1",
            Sql::SessionJson => "SELECT json FROM sessions WHERE id = ?1",
            Sql::TurnJson => "SELECT json FROM turns WHERE id = ?1",
            Sql::OpJson => "SELECT json FROM cancel_operations WHERE id = ?1",
            Sql::SessionExists => "SELECT 1 FROM sessions WHERE id = ?1",
            Sql::TurnClosed => "SELECT child_creation_closed FROM turns WHERE id = ?1",
            Sql::UpsertSession => concat!(
                upsert_session!(),
                "WHERE excluded.version > sessions.version"
            ),
            Sql::UpsertTurn => concat!(upsert_turn!(), "WHERE excluded.version > turns.version"),
            Sql::UpsertInteraction => {
                "INSERT INTO interactions (turn_id, request_id, agent_session_id, version, json) \
                 VALUES (?1, ?2, ?3, ?4, ?5) \
                 ON CONFLICT (turn_id, request_id) DO UPDATE SET version = excluded.version, \
                 json = excluded.json WHERE excluded.version > interactions.version"
            }
            Sql::UpsertToolCall => {
                "INSERT INTO tool_calls (agent_session_id, tool_call_id, version, json) \
                 VALUES (?1, ?2, ?3, ?4) \
                 ON CONFLICT (agent_session_id, tool_call_id) DO UPDATE SET \
                 version = excluded.version, json = excluded.json \
                 WHERE excluded.version > tool_calls.version"
            }
            Sql::UpsertOp => concat!(
                upsert_op!(),
                "WHERE excluded.version > cancel_operations.version"
            ),
            Sql::InsertMessage => {
                "INSERT INTO messages (agent_session_id, seq, message_id, json, outbox_seq) \
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (agent_session_id, seq) DO NOTHING"
            }
            Sql::RedactMessageOutbox => REDACT_MESSAGE_OUTBOX,
            Sql::RedactTreeOutbox => REDACT_TREE_OUTBOX,
            Sql::PurgeTurns => "DELETE FROM turns WHERE agent_session_id = ?1",
            Sql::PurgeInteractions => "DELETE FROM interactions WHERE agent_session_id = ?1",
            Sql::PurgeMessages => "DELETE FROM messages WHERE agent_session_id = ?1",
            Sql::PurgeToolCalls => "DELETE FROM tool_calls WHERE agent_session_id = ?1",
            Sql::InsertOutbox => {
                "INSERT INTO outbox (seq, kind, root_agent_session_id, workspace_id, payload, \
                 message_rowid) VALUES (?1, ?2, ?3, ?4, ?5, ?6)"
            }
            Sql::NextSeq => NEXT_SEQ,
        }
    }
}

// A version guard folded into its row's write. At version 0 the row must be absent: it is only
// inserted. At a later version the row must be stored at exactly that version: it is only
// updated (never inserted, so a row someone else removed is not brought back); the last
// parameter is the version. (The updates keep the upserts' parameter numbers; the ones they do
// not use are bound and ignored.)
const INSERT_SESSION_NEW: &str = concat!(upsert_session!(), "WHERE 0");
const UPDATE_SESSION_AT: &str = "UPDATE sessions SET active_turn_id = ?5, deleted_at = ?7, \
     version = ?8, json = ?9 WHERE id = ?1 AND version = ?10";
const INSERT_TURN_NEW: &str = concat!(upsert_turn!(), "WHERE 0");
const UPDATE_TURN_AT: &str = "UPDATE turns SET child_creation_closed = ?3, version = ?5, \
     json = ?6 WHERE id = ?1 AND version = ?7";
const INSERT_OP_NEW: &str = concat!(upsert_op!(), "WHERE 0");
const UPDATE_OP_AT: &str = "UPDATE cancel_operations SET state = ?3, version = ?4, json = ?5 \
     WHERE id = ?1 AND version = ?6";

/// Before a session's messages are purged: the outbox rows that reference them become redacted
/// rows (ids only, see [`tutti_core::step::Row::PurgeSession`]), so no outbox row points at a
/// missing message and none keeps its text.
pub(crate) const REDACT_MESSAGE_OUTBOX: &str =
    "UPDATE outbox SET kind = 'redacted', payload = json_object('agentSessionId', ?1, 'kind', kind), \
     message_rowid = NULL \
     WHERE seq IN (SELECT outbox_seq FROM messages WHERE agent_session_id = ?1 \
     AND outbox_seq IS NOT NULL) AND message_rowid IS NOT NULL";

/// The session an outbox row with a payload of its own belongs to (`NULL`: a row that is never
/// redacted, or a message by reference, see [`REDACT_MESSAGE_OUTBOX`]).
macro_rules! row_owner {
    () => {
        "(CASE WHEN message_rowid IS NOT NULL \
          OR kind IN ('sessionDeleted', 'sessionPurged', 'redacted') \
          OR NOT json_valid(payload) THEN NULL \
          WHEN kind = 'session' THEN json_extract(payload, '$.id') \
          ELSE json_extract(payload, '$.agentSessionId') END)"
    };
}

/// After a batch purged sessions of tree `?1`: every kept outbox row of those sessions (`?2`, a
/// JSON array of ids) becomes a redacted row. It finds the tree's kept rows through
/// `outbox_roots` (schema version 5; brought up to date first, see `outbox_roots.rs`), not by
/// a scan of the whole outbox.
pub(crate) const REDACT_TREE_OUTBOX: &str = concat!(
    "UPDATE outbox SET kind = 'redacted', payload = json_object('agentSessionId', ",
    row_owner!(),
    ", 'kind', kind) WHERE seq IN (SELECT j.value FROM outbox_roots AS e, \
     json_each('[' || e.seqs || ']') AS j WHERE e.root_agent_session_id = ?1) AND ",
    row_owner!(),
    " IN (SELECT value FROM json_each(?2))"
);

/// The next outbox seq: one past the highest ever assigned. `outbox_pruned_through` remembers the
/// highest pruned seq, so pruning every row never makes a number come back.
pub(crate) const NEXT_SEQ: &str = "SELECT max(coalesce((SELECT max(seq) FROM outbox), 0), \
     coalesce((SELECT value FROM meta WHERE key = 'outbox_pruned_through'), 0)) + 1";

/// Runs a write of a versioned entity, with the folded guard's version as its last parameter
/// when it updates a stored version.
fn execute_at(
    stmt: &mut CachedStatement<'_>,
    at: Option<&i64>,
    base: &[&dyn ToSql],
) -> rusqlite::Result<usize> {
    let Some(v) = at.filter(|&&v| v > 0) else {
        return stmt.execute(base);
    };
    const MAX: usize = 10;
    let mut all: [&dyn ToSql; MAX] = [&rusqlite::types::Null; MAX];
    let n = base.len().min(MAX - 1);
    all[..n].copy_from_slice(&base[..n]);
    all[n] = v;
    stmt.execute(&all[..=n])
}

/// The index in `rows` of the first row a version guard can be folded into: the same entity at
/// the guard's `next` version, one past its `version`.
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

/// The stored version a version guard expects.
fn guarded_version(g: &Guard) -> u64 {
    match g {
        Guard::SessionVersion { version, .. }
        | Guard::TurnVersion { version, .. }
        | Guard::CancelVersion { version, .. } => *version,
        Guard::ChildCreationOpen { .. } => 0,
    }
}

/// JSON text bound without a second UTF-8 check (serde_json only writes UTF-8).
struct Text<'a>(&'a [u8]);

impl ToSql for Text<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(ValueRef::Text(self.0)))
    }
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

/// Applies batches inside one open transaction.
pub(crate) struct Writer<'c> {
    conn: &'c Connection,
    stmts: [Option<CachedStatement<'c>>; N_SQL],
    rule: ReplayRule,
    /// Serialized rows of the current batch.
    arena: &'c mut Vec<u8>,
    /// Per row of the current batch: its JSON in `arena` if it was written.
    written: Vec<Option<Range<usize>>>,
    next_seq: Option<u64>,
    /// Whether [`Writer::apply`] also hands back each outbox row's payload.
    capture: bool,
    /// While writing a published message: the seq its outbox row will get (the message row
    /// records it, the outbox row references the message instead of copying its JSON).
    by_reference: Option<u64>,
    /// While writing a row whose version guard is folded into the write: the guard's version.
    at_version: Option<i64>,
    /// Per row of the current batch: the index of its folded version guard.
    folded: Vec<Option<usize>>,
}

pub use tutti_core::store::Published;

impl<'c> Writer<'c> {
    pub(crate) fn new(conn: &'c Connection, rule: ReplayRule, arena: &'c mut Vec<u8>) -> Self {
        Writer {
            conn,
            stmts: Default::default(),
            rule,
            arena,
            written: Vec::new(),
            next_seq: None,
            capture: false,
            by_reference: None,
            at_version: None,
            folded: Vec::new(),
        }
    }

    /// Also return each outbox row's payload from [`Writer::apply`].
    pub(crate) fn capture(mut self) -> Self {
        self.capture = true;
        self
    }

    fn stmt(&mut self, sql: Sql) -> Result<&mut CachedStatement<'c>, SqliteError> {
        let slot = &mut self.stmts[sql as usize];
        if slot.is_none() {
            *slot = Some(self.conn.prepare_cached(sql.text())?);
        }
        match slot {
            Some(s) => Ok(s),
            None => Err(SqliteError::Sqlite(rusqlite::Error::InvalidQuery)),
        }
    }

    fn version_of(&mut self, sql: Sql, id: &str) -> Result<u64, SqliteError> {
        let v: Option<i64> = self.stmt(sql)?.query_row([id], |r| r.get(0)).optional()?;
        crate::error::to_u64("version", v.unwrap_or(0))
    }

    fn stored<T: Decode>(
        &mut self,
        sql: Sql,
        table: &'static str,
        id: &str,
    ) -> Result<Option<T>, SqliteError> {
        let json: Option<String> = self.stmt(sql)?.query_row([id], |r| r.get(0)).optional()?;
        json.map(|j| decode(table, &j)).transpose()
    }

    /// Whether a version guard holds: "the row is at `version` (0: absent) or already at `next`".
    fn version_guard(&mut self, batch: &PersistBatch, g: &Guard) -> Result<bool, SqliteError> {
        let (sql, id, version, next) = match g {
            Guard::SessionVersion { id, version, next } => {
                (Sql::SessionVersion, id, *version, *next)
            }
            Guard::TurnVersion { id, version, next } => (Sql::TurnVersion, id, *version, *next),
            Guard::CancelVersion { id, version, next } => (Sql::OpVersion, id, *version, *next),
            Guard::ChildCreationOpen { .. } => return Ok(false),
        };
        let stored = self.version_of(sql, id)?;
        if stored == version {
            return Ok(true);
        }
        match self.rule {
            ReplayRule::AtOrPastNext => Ok(stored >= next),
            ReplayRule::SameRowAtNext => {
                if stored != next {
                    return Ok(false);
                }
                // "Already at next" only if it holds exactly this batch's row.
                Ok(match g {
                    Guard::SessionVersion { .. } => {
                        let mine = batch.rows.iter().find_map(|r| match r {
                            Row::Session(s) if s.id == *id && s.version == next => Some(s),
                            _ => None,
                        });
                        match mine {
                            Some(m) => self
                                .stored(Sql::SessionJson, "sessions", id)?
                                .is_some_and(|s: tutti_core::model::Session| s == **m),
                            None => false,
                        }
                    }
                    Guard::TurnVersion { .. } => {
                        let mine = batch.rows.iter().find_map(|r| match r {
                            Row::Turn(t) if t.id == *id && t.version == next => Some(t),
                            _ => None,
                        });
                        match mine {
                            Some(m) => self
                                .stored(Sql::TurnJson, "turns", id)?
                                .is_some_and(|t: tutti_core::model::Turn| t == **m),
                            None => false,
                        }
                    }
                    Guard::CancelVersion { .. } => {
                        let mine = batch.rows.iter().find_map(|r| match r {
                            Row::CancelOperation(o) if o.id == *id && o.version == next => Some(o),
                            _ => None,
                        });
                        match mine {
                            Some(m) => self
                                .stored(Sql::OpJson, "cancel_operations", id)?
                                .is_some_and(|o: tutti_core::model::CancelOperation| o == **m),
                            None => false,
                        }
                    }
                    Guard::ChildCreationOpen { .. } => false,
                })
            }
        }
    }

    fn check(&mut self, batch: &PersistBatch, g: &Guard) -> Result<bool, SqliteError> {
        match g {
            Guard::ChildCreationOpen {
                root_turn_id,
                child_agent_session_id,
            } => {
                let exists = self
                    .stmt(Sql::SessionExists)?
                    .exists([&**child_agent_session_id])?;
                if exists {
                    return Ok(true);
                }
                let closed: Option<bool> = self
                    .stmt(Sql::TurnClosed)?
                    .query_row([&**root_turn_id], |r| r.get(0))
                    .optional()?;
                Ok(closed == Some(false))
            }
            _ => self.version_guard(batch, g),
        }
    }

    fn encode<T: Serialize>(&mut self, v: &T) -> Result<Range<usize>, SqliteError> {
        let start = self.arena.len();
        serde_json::to_writer(&mut *self.arena, v).map_err(SqliteError::Encode)?;
        Ok(start..self.arena.len())
    }

    /// Writes one row; returns its JSON span when something was written.
    fn write(&mut self, row: &Row) -> Result<Option<Range<usize>>, SqliteError> {
        let at = self.at_version;
        let (span, changed) = match row {
            Row::Session(s) => {
                let span = self.encode(s)?;
                let version = to_i64("version", s.version)?;
                let json = span.clone();
                let (conn_arena, stmt) = self.split(match at {
                    None => Sql::UpsertSession,
                    Some(0) => Sql::InsertSessionNew,
                    Some(_) => Sql::UpdateSessionAt,
                })?;
                let n = execute_at(
                    stmt,
                    at.as_ref(),
                    params![
                        &*s.id,
                        &*s.workspace_id,
                        kind_str(s.kind()),
                        s.root_agent_session_id().map(|r| &**r),
                        s.active_turn_id.as_deref(),
                        s.created_at,
                        s.deleted_at,
                        version,
                        Text(&conn_arena[json]),
                    ],
                )?;
                (span, n > 0)
            }
            Row::Turn(t) => {
                let span = self.encode(t)?;
                let version = to_i64("version", t.version)?;
                let json = span.clone();
                let (arena, stmt) = self.split(match at {
                    None => Sql::UpsertTurn,
                    Some(0) => Sql::InsertTurnNew,
                    Some(_) => Sql::UpdateTurnAt,
                })?;
                let n = execute_at(
                    stmt,
                    at.as_ref(),
                    params![
                        &*t.id,
                        &*t.agent_session_id,
                        t.child_creation_closed(),
                        t.created_at,
                        version,
                        Text(&arena[json]),
                    ],
                )?;
                (span, n > 0)
            }
            Row::Interaction(i) => {
                let span = self.encode(i)?;
                let version = to_i64("version", i.version)?;
                let json = span.clone();
                let (arena, stmt) = self.split(Sql::UpsertInteraction)?;
                let n = stmt.execute(params![
                    &*i.turn_id,
                    &*i.request_id,
                    &*i.agent_session_id,
                    version,
                    Text(&arena[json]),
                ])?;
                (span, n > 0)
            }
            Row::ToolCall(c) => {
                let span = self.encode(c)?;
                let version = to_i64("version", c.version)?;
                let json = span.clone();
                let (arena, stmt) = self.split(Sql::UpsertToolCall)?;
                let n = stmt.execute(params![
                    &*c.agent_session_id,
                    &*c.tool_call_id,
                    version,
                    Text(&arena[json]),
                ])?;
                (span, n > 0)
            }
            Row::CancelOperation(o) => {
                let span = self.encode(o)?;
                let version = to_i64("version", o.version)?;
                let json = span.clone();
                let (arena, stmt) = self.split(match at {
                    None => Sql::UpsertOp,
                    Some(0) => Sql::InsertOpNew,
                    Some(_) => Sql::UpdateOpAt,
                })?;
                let n = execute_at(
                    stmt,
                    at.as_ref(),
                    params![
                        &*o.id,
                        &*o.root_agent_session_id,
                        state_str(o.state),
                        version,
                        Text(&arena[json]),
                    ],
                )?;
                (span, n > 0)
            }
            Row::Message(m) => {
                let span = self.encode(m)?;
                let seq = to_i64("message seq", m.seq)?;
                let outbox_seq = match self.by_reference {
                    Some(s) => Some(to_i64("outbox seq", s)?),
                    None => None,
                };
                let json = span.clone();
                let (arena, stmt) = self.split(Sql::InsertMessage)?;
                let n = stmt.execute(params![
                    &*m.agent_session_id,
                    seq,
                    &*m.message_id,
                    Text(&arena[json]),
                    outbox_seq,
                ])?;
                (span, n > 0)
            }
            Row::PurgeSession { agent_session_id } => {
                let s: &str = agent_session_id;
                for sql in [
                    Sql::RedactMessageOutbox,
                    Sql::PurgeTurns,
                    Sql::PurgeInteractions,
                    Sql::PurgeMessages,
                    Sql::PurgeToolCalls,
                ] {
                    self.stmt(sql)?.execute([s])?;
                }
                let span = self.encode(&serde_json::json!({ "agentSessionId": s }))?;
                (span, true)
            }
        };
        Ok(changed.then_some(span))
    }

    /// The arena and one statement, borrowed together.
    fn split(&mut self, sql: Sql) -> Result<(&Vec<u8>, &mut CachedStatement<'c>), SqliteError> {
        self.stmt(sql)?;
        let arena: &Vec<u8> = self.arena;
        match &mut self.stmts[sql as usize] {
            Some(s) => Ok((arena, s)),
            None => Err(SqliteError::Sqlite(rusqlite::Error::InvalidQuery)),
        }
    }

    /// After the transaction's last batch: adds the `outbox_roots` entries in arrears once
    /// [`crate::outbox_roots::LAG`] rows wait for them (nothing if no row was published).
    pub(crate) fn finish(&mut self) -> Result<(), SqliteError> {
        if let Some(next) = self.next_seq {
            crate::outbox_roots::catch_up(
                self.conn,
                next.saturating_sub(1),
                crate::outbox_roots::LAG,
            )?;
        }
        Ok(())
    }

    fn next_seq(&mut self) -> Result<u64, SqliteError> {
        if let Some(n) = self.next_seq {
            return Ok(n);
        }
        let n: i64 = self.stmt(Sql::NextSeq)?.query_row([], |r| r.get(0))?;
        let n = crate::error::to_u64("outbox seq", n)?;
        self.next_seq = Some(n);
        Ok(n)
    }

    /// Applies one batch: every guard is checked and every row written, each row followed by
    /// its outbox row if it is published and was actually written. If a guard fails, the error
    /// names it and the caller rolls the transaction back, so nothing of the batch remains.
    ///
    /// A version guard on a row the batch writes (the engine writes one row per versioned entity,
    /// in guard order) is folded into that row's write: the row is inserted only if the guard
    /// expects it absent, or updated only over exactly the guarded version, and only when that
    /// writes nothing is the guard checked on its own (a replay of this batch passes, anything
    /// else fails). One statement instead of two per entity.
    ///
    /// A published message's outbox row references the message (see [`crate::schema`]). That
    /// needs the outbox rows in row order, which is how the engine builds batches; a batch whose
    /// `outbox` is not strictly increasing gets its outbox rows after all its rows, in its own
    /// order, each with a copy of its payload.
    pub(crate) fn apply(&mut self, batch: &PersistBatch) -> Result<Vec<Published>, SqliteError> {
        let out = self.apply_rows(batch)?;
        self.redact_purged(batch)?;
        Ok(out)
    }

    /// Redacts the kept outbox rows of the sessions `batch` purged (see
    /// [`REDACT_TREE_OUTBOX`]).
    fn redact_purged(&mut self, batch: &PersistBatch) -> Result<(), SqliteError> {
        let purged: Vec<&str> = batch
            .rows
            .iter()
            .filter_map(|r| match r {
                Row::PurgeSession { agent_session_id } => Some(&**agent_session_id),
                _ => None,
            })
            .collect();
        let Some(root) = batch.root_agent_session_id.as_deref() else {
            return Ok(());
        };
        if purged.is_empty() {
            return Ok(());
        }
        let ids = serde_json::to_string(&purged).map_err(SqliteError::Encode)?;
        crate::outbox_roots::catch_up_all(self.conn)?;
        self.stmt(Sql::RedactTreeOutbox)?
            .execute(params![root, ids])?;
        Ok(())
    }

    fn apply_rows(&mut self, batch: &PersistBatch) -> Result<Vec<Published>, SqliteError> {
        self.fold_guards(batch)?;
        self.arena.clear();
        self.written.clear();
        let mut out = Vec::new();
        let target = match (&batch.root_agent_session_id, &batch.workspace_id) {
            (Some(root), Some(ws)) => Some((&**root, &**ws)),
            _ => None,
        };
        let in_order = batch.outbox.windows(2).all(|w| w[0] < w[1]);
        if let (Some(target), true) = (target, in_order) {
            let mut next = batch.outbox.iter().map(|&i| i as usize).peekable();
            for (i, row) in batch.rows.iter().enumerate() {
                let published = next.next_if_eq(&i).is_some();
                let by_reference = published && matches!(row, Row::Message(_));
                let reference = if by_reference {
                    Some(self.next_seq()?)
                } else {
                    None
                };
                if let (Some(span), true) = (self.write_row(batch, i, row, reference)?, published) {
                    let message = by_reference.then(|| self.conn.last_insert_rowid());
                    out.push(self.publish(target, i, row, span, message)?);
                }
            }
            return Ok(out);
        }
        for (i, row) in batch.rows.iter().enumerate() {
            let w = self.write_row(batch, i, row, None)?;
            self.written.push(w);
        }
        let Some(target) = target else {
            return Ok(out);
        };
        for &i in &batch.outbox {
            let i = i as usize;
            let (Some(Some(span)), Some(row)) = (self.written.get(i).cloned(), batch.rows.get(i))
            else {
                continue;
            };
            out.push(self.publish(target, i, row, span, None)?);
        }
        Ok(out)
    }

    /// Checks every guard that is not folded into a row's write; records the folded ones.
    fn fold_guards(&mut self, batch: &PersistBatch) -> Result<(), SqliteError> {
        self.folded.clear();
        self.folded.resize(batch.rows.len(), None);
        // Rows and their guards come in the same order: one forward scan pairs them.
        let mut from = 0;
        for (gi, g) in batch.guards.iter().enumerate() {
            if let Some(ri) = guarded_row(&batch.rows[from..], g).map(|r| r + from) {
                self.folded[ri] = Some(gi);
                from = ri + 1;
                continue;
            }
            if !self.check(batch, g)? {
                return Err(SqliteError::GuardFailed(g.clone()));
            }
        }
        Ok(())
    }

    /// Writes row `i`, with its folded guard if it has one (a guard that fails is an error);
    /// `reference`: the seq of the published message's outbox row. Returns the row's JSON span
    /// when it was written.
    fn write_row(
        &mut self,
        batch: &PersistBatch,
        i: usize,
        row: &Row,
        reference: Option<u64>,
    ) -> Result<Option<Range<usize>>, SqliteError> {
        let guard = self
            .folded
            .get(i)
            .copied()
            .flatten()
            .and_then(|gi| batch.guards.get(gi));
        self.at_version = match guard {
            Some(g) => Some(to_i64("version", guarded_version(g))?),
            None => None,
        };
        self.by_reference = reference;
        let written = self.write(row);
        self.at_version = None;
        self.by_reference = None;
        let written = written?;
        if let (None, Some(g)) = (&written, guard) {
            // Not stored at the guarded version: only a replay of this batch may pass.
            if !self.check(batch, g)? {
                return Err(SqliteError::GuardFailed(g.clone()));
            }
        }
        Ok(written)
    }

    /// Appends the outbox row of row `i` (written as `span` of the arena): with its payload, or
    /// with a reference to the message row `message` and no payload.
    fn publish(
        &mut self,
        (root, ws): (&str, &str),
        i: usize,
        row: &Row,
        span: Range<usize>,
        message: Option<i64>,
    ) -> Result<Published, SqliteError> {
        let seq = self.next_seq()?;
        let seq_i = to_i64("outbox seq", seq)?;
        let (arena, stmt) = self.split(Sql::InsertOutbox)?;
        let payload = match message {
            Some(_) => Text(b""),
            None => Text(&arena[span.clone()]),
        };
        stmt.execute(params![seq_i, row.kind(), root, ws, payload, message])?;
        self.next_seq = Some(seq + 1);
        let payload = if self.capture {
            // serde_json writes UTF-8, so the strict check passes; it is faster than the lossy
            // decoder, which stays as the fallback.
            String::from_utf8(self.arena[span].to_vec())
                .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
        } else {
            String::new()
        };
        Ok(Published {
            seq,
            row: i as u32,
            payload,
        })
    }
}
