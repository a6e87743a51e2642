//! Reads: tree loads for recovery, and the API's queries. Multi-query reads run in one
//! `REPEATABLE READ` read-only transaction, so they see one committed state while other
//! connections write.

use crate::apply::prep;
use crate::codec::{decode, Decode};
use crate::error::{to_i64, to_u64, PgError};
use crate::PostgresStore;
use postgres::types::ToSql;
use tutti_core::model::{
    CancelOperation, Id, Interaction, Message, Session, SessionKind, ToolCall, Turn,
};
use tutti_core::projection::SessionDetail;
use tutti_core::store::OutboxRow;
use tutti_core::TreeSnapshot;

pub(crate) const SESSION: &str = "SELECT json FROM sessions WHERE id = $1 AND deleted_at IS NULL";
pub(crate) const TURN: &str = "SELECT json FROM turns WHERE id = $1";
pub(crate) const INTERACTION: &str =
    "SELECT json FROM interactions WHERE turn_id = $1 AND request_id = $2";
pub(crate) const CANCEL_OPERATION: &str = "SELECT json FROM cancel_operations WHERE id = $1";
const ANY_SESSION: &str = "SELECT json FROM sessions WHERE id = $1";
const TREE_SESSIONS: &str = "SELECT json FROM sessions WHERE id = $1 OR root_agent_session_id = $1";
const TREE_TURNS: &str = "SELECT json FROM turns WHERE agent_session_id = ANY($1)";
const TREE_INTERACTIONS: &str = "SELECT json FROM interactions WHERE agent_session_id = ANY($1)";
const TREE_TOOL_CALLS: &str = "SELECT json FROM tool_calls WHERE agent_session_id = ANY($1)";
const TREE_OPS: &str = "SELECT json FROM cancel_operations WHERE root_agent_session_id = $1";
const TREE_MESSAGES: &str =
    "SELECT agent_session_id, message_id FROM messages WHERE agent_session_id = ANY($1)";
const TREE_CHILDREN: &str = "SELECT json FROM sessions WHERE root_agent_session_id = $1";
const LIVE_ROOTS: &str = "SELECT id FROM sessions WHERE kind = 'root' \
     AND active_turn_id IS NOT NULL \
     UNION SELECT root_agent_session_id FROM cancel_operations WHERE state = 'prepared'";
const MESSAGES: &str = "SELECT json FROM messages WHERE agent_session_id = $1 AND seq >= $2 \
     ORDER BY seq LIMIT $3";
const OUTBOX_AFTER: &str = "SELECT seq, kind, root_agent_session_id, workspace_id, payload \
     FROM outbox WHERE seq > $1 ORDER BY seq LIMIT $2";
const ROOT_OF: &str = "SELECT kind, root_agent_session_id FROM sessions WHERE id = $1";
const ROOT_OF_OP: &str = "SELECT root_agent_session_id FROM cancel_operations WHERE id = $1";
const ROOTS_FIRST: &str = "SELECT json FROM sessions WHERE workspace_id = $1 AND kind = 'root' \
     AND deleted_at IS NULL ORDER BY created_at DESC, id DESC LIMIT $2";
const ROOTS_AFTER: &str = "SELECT json FROM sessions WHERE workspace_id = $1 AND kind = 'root' \
     AND deleted_at IS NULL AND (created_at, id) < ($2, $3) \
     ORDER BY created_at DESC, id DESC LIMIT $4";

fn limit_arg(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

impl PostgresStore {
    /// Runs one query.
    pub(crate) fn query(
        &self,
        sql: &'static str,
        p: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<postgres::Row>, PgError> {
        self.with_client(|c, cache| {
            let s = prep(cache, c, sql)?;
            Ok(c.query(&s, p)?)
        })
    }

    fn query_json<T: Decode>(
        &self,
        table: &'static str,
        sql: &'static str,
        p: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<T>, PgError> {
        self.query(sql, p)?
            .iter()
            .map(|r| decode(table, r.get::<_, &str>(0)))
            .collect()
    }

    pub(crate) fn one_json<T: Decode>(
        &self,
        table: &'static str,
        sql: &'static str,
        p: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<T>, PgError> {
        Ok(self.query_json(table, sql, p)?.pop())
    }

    /// Runs `f` inside one read transaction (`REPEATABLE READ`, read-only), unless one is open
    /// already (nested calls join it): every read `f` makes sees one committed state.
    pub fn read_consistent<T>(&self, f: impl FnOnce(&PostgresStore) -> T) -> Result<T, PgError> {
        if self.in_read.get() {
            return Ok(f(self));
        }
        self.with_client(|c, _| {
            Ok(c.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")?)
        })?;
        self.in_read.set(true);
        struct End<'a>(&'a PostgresStore);
        impl Drop for End<'_> {
            fn drop(&mut self) {
                self.0.in_read.set(false);
                if let Ok(mut c) = self.0.conn.try_borrow_mut() {
                    // A read-only transaction: ending it cannot lose anything; an error here
                    // surfaces on the next statement. A broken connection is not reconnected
                    // for this (its transaction ended with it).
                    if let Some(c) = c.current() {
                        let _ = c.batch_execute("COMMIT");
                    }
                }
            }
        }
        let end = End(self);
        let out = f(self);
        drop(end);
        Ok(out)
    }

    /// The tree of one root (tombstones included), as the reference store defines it.
    pub(crate) fn tree(&self, root: &str) -> Result<Option<TreeSnapshot>, PgError> {
        let Some(r) = self.one_json::<Session>("sessions", ANY_SESSION, &[&root])? else {
            return Ok(None);
        };
        if r.kind() != SessionKind::Root {
            return Ok(None);
        }
        let sessions: Vec<Session> = self.query_json("sessions", TREE_SESSIONS, &[&root])?;
        let ids: Vec<&str> = sessions.iter().map(|s| &*s.id).collect();
        let turns: Vec<Turn> = self.query_json("turns", TREE_TURNS, &[&ids])?;
        let interactions: Vec<Interaction> =
            self.query_json("interactions", TREE_INTERACTIONS, &[&ids])?;
        let tool_calls: Vec<ToolCall> = self.query_json("tool_calls", TREE_TOOL_CALLS, &[&ids])?;
        let cancel_operations: Vec<CancelOperation> =
            self.query_json("cancel_operations", TREE_OPS, &[&root])?;
        let message_ids = self
            .query(TREE_MESSAGES, &[&ids])?
            .iter()
            .map(|r| (Id::from(r.get::<_, &str>(0)), Id::from(r.get::<_, &str>(1))))
            .collect();
        let mut snap = TreeSnapshot {
            sessions: sessions.clone(),
            turns,
            interactions,
            tool_calls,
            cancel_operations,
            message_ids,
        };
        snap.canonicalize();
        Ok(Some(snap))
    }

    pub(crate) fn live_trees(&self) -> Result<Vec<TreeSnapshot>, PgError> {
        let mut roots: Vec<String> = self
            .query(LIVE_ROOTS, &[])?
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect();
        roots.sort();
        roots.dedup();
        let mut out = Vec::with_capacity(roots.len());
        for r in roots {
            if let Some(t) = self.tree(&r)? {
                out.push(t);
            }
        }
        Ok(out)
    }

    pub(crate) fn detail(&self, id: &str) -> Result<Option<SessionDetail>, PgError> {
        let Some(session) = self.one_json::<Session>("sessions", SESSION, &[&id])? else {
            return Ok(None);
        };
        let root = session
            .root_agent_session_id()
            .cloned()
            .unwrap_or_else(|| session.id.clone());
        let tree: Vec<Session> = self.query_json("sessions", TREE_CHILDREN, &[&&*root])?;
        Ok(Some(SessionDetail::build(session, tree)))
    }

    pub(crate) fn read_messages(
        &self,
        session: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Message>, PgError> {
        let from = match after {
            None => 0,
            Some(a) => match a.checked_add(1).map(i64::try_from) {
                Some(Ok(v)) => v,
                _ => return Ok(Vec::new()),
            },
        };
        self.query_json("messages", MESSAGES, &[&session, &from, &limit_arg(limit)])
    }

    pub(crate) fn read_outbox_after(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<OutboxRow>, PgError> {
        let Ok(after) = i64::try_from(after) else {
            return Ok(Vec::new());
        };
        let rows = self.query(OUTBOX_AFTER, &[&after, &limit_arg(limit)])?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let seq: i64 = r.get(0);
            let payload =
                serde_json::from_str(r.get::<_, &str>(4)).map_err(|source| PgError::BadRow {
                    table: "outbox",
                    key: seq.to_string(),
                    source,
                })?;
            out.push(OutboxRow {
                seq: to_u64("outbox seq", seq)?,
                kind: r.get(1),
                root_agent_session_id: Id::from(r.get::<_, &str>(2)),
                workspace_id: Id::from(r.get::<_, &str>(3)),
                payload,
            });
        }
        Ok(out)
    }

    /// The root session id of a session's tree (itself for a root; tombstones included).
    pub fn root_of(&self, session: &str) -> Result<Option<Id>, PgError> {
        let rows = self.query(ROOT_OF, &[&session])?;
        Ok(rows.first().and_then(|r| {
            let kind: &str = r.get(0);
            let root: Option<&str> = r.get(1);
            if kind == "root" {
                Some(Id::from(session))
            } else {
                root.map(Id::from)
            }
        }))
    }

    /// The root session id of a cancel operation's tree.
    pub fn root_of_cancel_operation(&self, operation: &str) -> Result<Option<Id>, PgError> {
        let rows = self.query(ROOT_OF_OP, &[&operation])?;
        Ok(rows.first().map(|r| Id::from(r.get::<_, &str>(0))))
    }

    /// Root sessions of a workspace, newest first; the cursor is `{createdAt}:{id}` of the last
    /// session of the previous page (the format of the other stores).
    pub fn roots(
        &self,
        workspace: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<(Vec<Session>, Option<String>), PgError> {
        let limit = limit.max(1);
        let fetch = to_i64("limit", limit as u64)?.saturating_add(1);
        let mut page: Vec<Session> = match cursor {
            None => self.query_json("sessions", ROOTS_FIRST, &[&workspace, &fetch])?,
            Some(c) => {
                let (at, id) = c.split_once(':').ok_or(PgError::BadCursor)?;
                let at: i64 = at.parse().map_err(|_| PgError::BadCursor)?;
                self.query_json("sessions", ROOTS_AFTER, &[&workspace, &at, &id, &fetch])?
            }
        };
        let next = if page.len() > limit {
            page.truncate(limit);
            page.last().map(|s| format!("{}:{}", s.created_at, s.id))
        } else {
            None
        };
        Ok((page, next))
    }
}
