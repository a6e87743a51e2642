//! Reads: tree loads for recovery, and the API's queries. Multi-query reads run inside one read
//! transaction, so they see one consistent snapshot even while another connection writes.

use crate::codec::{decode, Decode};
use crate::error::{to_i64, to_u64, SqliteError};
use crate::SqliteStore;
use rusqlite::{params, OptionalExtension};
use std::collections::BTreeMap;
use tutti_core::model::{CancelOperation, Id, Interaction, Message, Session, ToolCall, Turn};
use tutti_core::projection::SessionDetail;
use tutti_core::TreeSnapshot;

/// The root sessions named by the JSON array `?1` (only those that exist and are roots), and
/// every session of their trees with its root: `id == root` or `root_agent_session_id == root`,
/// as the reference store defines a tree.
const TREE_CTE: &str = "WITH r(id) AS (SELECT s.id FROM json_each(?1) AS j \
     JOIN sessions AS s ON s.id = j.value WHERE s.kind = 'root'), \
     ts(id, root) AS (SELECT id, id FROM r UNION ALL \
     SELECT s.id, r.id FROM r JOIN sessions AS s ON s.root_agent_session_id = r.id \
     AND s.id <> r.id) ";

const TREE_SESSIONS: &str = "SELECT ts.root, s.json FROM ts JOIN sessions AS s ON s.id = ts.id";
const TREE_TURNS: &str =
    "SELECT ts.root, t.json FROM ts JOIN turns AS t ON t.agent_session_id = ts.id";
const TREE_INTERACTIONS: &str =
    "SELECT ts.root, i.json FROM ts JOIN interactions AS i ON i.agent_session_id = ts.id";
const TREE_TOOL_CALLS: &str =
    "SELECT ts.root, c.json FROM ts JOIN tool_calls AS c ON c.agent_session_id = ts.id";
const TREE_OPS: &str = "SELECT r.id, o.json FROM r \
     JOIN cancel_operations AS o ON o.root_agent_session_id = r.id";
const TREE_MESSAGES: &str = "SELECT ts.root, m.agent_session_id, m.message_id FROM ts \
     JOIN messages AS m ON m.agent_session_id = ts.id";
const LIVE_ROOTS: &str = "SELECT id FROM sessions WHERE kind = 'root' \
     AND active_turn_id IS NOT NULL \
     UNION SELECT root_agent_session_id FROM cancel_operations WHERE state = 'prepared'";
const ALL_ROOTS: &str = "SELECT id FROM sessions WHERE kind = 'root'";
const ROOT_OF: &str = "SELECT kind, root_agent_session_id FROM sessions WHERE id = ?1";
const ROOT_OF_OP: &str = "SELECT root_agent_session_id FROM cancel_operations WHERE id = ?1";
const ROOTS_FIRST: &str = "SELECT json FROM sessions WHERE workspace_id = ?1 AND kind = 'root' \
     AND deleted_at IS NULL ORDER BY created_at DESC, id DESC LIMIT ?2";
const ROOTS_AFTER: &str = "SELECT json FROM sessions WHERE workspace_id = ?1 AND kind = 'root' \
     AND deleted_at IS NULL AND (created_at, id) < (?2, ?3) \
     ORDER BY created_at DESC, id DESC LIMIT ?4";
const SESSION: &str = "SELECT json FROM sessions WHERE id = ?1 AND deleted_at IS NULL";
const TURN: &str = "SELECT json FROM turns WHERE id = ?1";
const TREE_CHILDREN: &str = "SELECT json FROM sessions WHERE root_agent_session_id = ?1";
const MESSAGES: &str = "SELECT json FROM messages WHERE agent_session_id = ?1 AND seq >= ?2 \
     ORDER BY seq LIMIT ?3";
const INTERACTION: &str = "SELECT json FROM interactions WHERE turn_id = ?1 AND request_id = ?2";
const CANCEL_OPERATION: &str = "SELECT json FROM cancel_operations WHERE id = ?1";
/// A message's outbox row takes its payload from the message (schema version 2).
pub(crate) const OUTBOX_AFTER: &str = "SELECT o.seq, o.kind, o.root_agent_session_id, \
     o.workspace_id, coalesce(m.json, o.payload) FROM outbox AS o \
     LEFT JOIN messages AS m ON m.rowid = o.message_rowid \
     WHERE o.seq > ?1 ORDER BY o.seq LIMIT ?2";

fn tree_sql(select: &str) -> String {
    format!("{TREE_CTE}{select}")
}

fn text<'a>(r: &'a rusqlite::Row<'_>, i: usize) -> rusqlite::Result<&'a str> {
    r.get_ref(i)?.as_str().map_err(|e| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, Box::new(e))
    })
}

impl SqliteStore {
    /// Runs `sql` with `p` and decodes column 0 (`json`) of each row.
    fn query_json<T: Decode, P: rusqlite::Params>(
        &self,
        table: &'static str,
        sql: &str,
        p: P,
    ) -> Result<Vec<T>, SqliteError> {
        let mut stmt = self.conn.prepare_cached(sql)?;
        let mut rows = stmt.query(p)?;
        let mut out = Vec::new();
        while let Some(r) = rows.next()? {
            out.push(decode(table, text(r, 0)?)?);
        }
        Ok(out)
    }

    fn one_json<T: Decode, P: rusqlite::Params>(
        &self,
        table: &'static str,
        sql: &str,
        p: P,
    ) -> Result<Option<T>, SqliteError> {
        let mut stmt = self.conn.prepare_cached(sql)?;
        let json: Option<String> = stmt.query_row(p, |r| r.get(0)).optional()?;
        json.map(|j| decode(table, &j)).transpose()
    }

    /// Runs a tree query whose rows are (root, json) and adds each decoded entity to its tree.
    fn tree_rows<T: Decode>(
        &self,
        table: &'static str,
        sql: &str,
        roots: &str,
        trees: &mut BTreeMap<String, TreeSnapshot>,
        mut put: impl FnMut(&mut TreeSnapshot, T),
    ) -> Result<(), SqliteError> {
        let mut stmt = self.conn.prepare_cached(sql)?;
        let mut rows = stmt.query([roots])?;
        while let Some(r) = rows.next()? {
            let root = text(r, 0)?;
            let v: T = decode(table, text(r, 1)?)?;
            if let Some(t) = trees.get_mut(root) {
                put(t, v);
            }
        }
        Ok(())
    }

    /// Loads the trees of these root ids (ids that are not stored roots are skipped), sorted by
    /// root id. Seven indexed queries whatever the number of trees.
    pub(crate) fn load_trees_of(&self, roots: &[&str]) -> Result<Vec<TreeSnapshot>, SqliteError> {
        let tx = self.read_tx()?;
        let out = self.load_trees_in_tx(roots, true)?;
        if let Some(tx) = tx {
            tx.commit()?;
        }
        Ok(out)
    }

    fn load_trees_in_tx(
        &self,
        roots: &[&str],
        with_messages: bool,
    ) -> Result<Vec<TreeSnapshot>, SqliteError> {
        if roots.is_empty() {
            return Ok(Vec::new());
        }
        let mut roots = roots.to_vec();
        roots.sort_unstable();
        roots.dedup();
        let arg = serde_json::to_string(&roots).map_err(SqliteError::Encode)?;
        let mut trees: BTreeMap<String, TreeSnapshot> = BTreeMap::new();
        {
            let mut stmt = self.conn.prepare_cached(&tree_sql(TREE_SESSIONS))?;
            let mut rows = stmt.query([&arg])?;
            while let Some(r) = rows.next()? {
                let root = text(r, 0)?;
                let s: Session = decode("sessions", text(r, 1)?)?;
                trees.entry(root.to_string()).or_default().sessions.push(s);
            }
        }
        self.tree_rows::<Turn>("turns", &tree_sql(TREE_TURNS), &arg, &mut trees, |t, v| {
            t.turns.push(v)
        })?;
        self.tree_rows::<Interaction>(
            "interactions",
            &tree_sql(TREE_INTERACTIONS),
            &arg,
            &mut trees,
            |t, v| t.interactions.push(v),
        )?;
        self.tree_rows::<ToolCall>(
            "tool_calls",
            &tree_sql(TREE_TOOL_CALLS),
            &arg,
            &mut trees,
            |t, v| t.tool_calls.push(v),
        )?;
        self.tree_rows::<CancelOperation>(
            "cancel_operations",
            &tree_sql(TREE_OPS),
            &arg,
            &mut trees,
            |t, v| t.cancel_operations.push(v),
        )?;
        if with_messages {
            let mut stmt = self.conn.prepare_cached(&tree_sql(TREE_MESSAGES))?;
            let mut rows = stmt.query([&arg])?;
            while let Some(r) = rows.next()? {
                let root = text(r, 0)?;
                if let Some(t) = trees.get_mut(root) {
                    t.message_ids
                        .push((Id::from(text(r, 1)?), Id::from(text(r, 2)?)));
                }
            }
        }
        Ok(trees
            .into_values()
            .map(|mut t| {
                t.canonicalize();
                t
            })
            .collect())
    }

    fn root_ids(&self, sql: &str) -> Result<Vec<String>, SqliteError> {
        let mut stmt = self.conn.prepare_cached(sql)?;
        let ids = stmt.query_map([], |r| r.get::<_, String>(0))?;
        let mut out = Vec::new();
        for id in ids {
            out.push(id?);
        }
        Ok(out)
    }

    /// The live trees (as [`Store::load_live_trees`](tutti_core::store::Store::load_live_trees)
    /// reads them) without their message ids: for a daemon's start-up recovery, whose settle
    /// step (`providerExited`) appends no message. Such a tree numbers new messages wrongly, so
    /// it must be evicted right after that step (the next input then loads the whole tree). With a million stored messages this saves reading and
    /// indexing every message id at start-up.
    pub fn load_live_trees_without_messages(&self) -> Result<Vec<TreeSnapshot>, SqliteError> {
        let tx = self.read_tx()?;
        let ids = self.root_ids(LIVE_ROOTS)?;
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let out = self.load_trees_in_tx(&refs, false)?;
        if let Some(tx) = tx {
            tx.commit()?;
        }
        Ok(out)
    }

    /// Trees with an active root turn or a prepared cancel operation (and only those).
    pub(crate) fn live_trees(&self) -> Result<Vec<TreeSnapshot>, SqliteError> {
        let tx = self.read_tx()?;
        let ids = self.root_ids(LIVE_ROOTS)?;
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let out = self.load_trees_in_tx(&refs, true)?;
        if let Some(tx) = tx {
            tx.commit()?;
        }
        Ok(out)
    }

    /// Every root tree (tombstones included), sorted by root id: the whole database as the
    /// engine sees it (`tutti snapshot --db FILE`).
    pub fn snapshot_all(&self) -> Result<Vec<TreeSnapshot>, SqliteError> {
        let tx = self.read_tx()?;
        let ids = self.root_ids(ALL_ROOTS)?;
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let out = self.load_trees_in_tx(&refs, true)?;
        if let Some(tx) = tx {
            tx.commit()?;
        }
        Ok(out)
    }

    /// The root session id of the tree a session belongs to (itself for a root; tombstones
    /// included), to load an evicted tree on demand.
    pub fn root_of(&self, session_id: &str) -> Result<Option<Id>, SqliteError> {
        let mut stmt = self.conn.prepare_cached(ROOT_OF)?;
        let row: Option<(String, Option<String>)> = stmt
            .query_row([session_id], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        Ok(match row {
            Some((kind, _)) if kind == "root" => Some(Id::from(session_id)),
            Some((_, root)) => root.map(Id::from),
            None => None,
        })
    }

    /// The root session id of the tree a cancel operation belongs to (runtime answers name only
    /// the operation).
    pub fn root_of_cancel_operation(&self, operation_id: &str) -> Result<Option<Id>, SqliteError> {
        let mut stmt = self.conn.prepare_cached(ROOT_OF_OP)?;
        let root: Option<String> = stmt.query_row([operation_id], |r| r.get(0)).optional()?;
        Ok(root.map(Id::from))
    }

    /// Root sessions of a workspace, newest first (`createdAt`, then id, descending), tombstones
    /// excluded: at most `limit` (at least 1) after `cursor`, and the cursor of the next page
    /// when there may be more. Cursors are opaque; pass back what a previous call returned.
    pub fn roots(
        &self,
        workspace: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<(Vec<Session>, Option<String>), SqliteError> {
        let limit = limit.max(1);
        let fetch = i64::try_from(limit)
            .unwrap_or(i64::MAX - 1)
            .saturating_add(1);
        let mut page: Vec<Session> = match cursor {
            None => self.query_json("sessions", ROOTS_FIRST, params![workspace, fetch])?,
            Some(c) => {
                let (at, id) = parse_cursor(c)?;
                self.query_json("sessions", ROOTS_AFTER, params![workspace, at, id, fetch])?
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

    pub(crate) fn read_session(&self, id: &str) -> Result<Option<Session>, SqliteError> {
        self.one_json("sessions", SESSION, [id])
    }

    pub(crate) fn read_turn(&self, id: &str) -> Result<Option<Turn>, SqliteError> {
        self.one_json("turns", TURN, [id])
    }

    /// The session and every nested child below it, flat (built by
    /// [`SessionDetail::build`] from the tree's sessions, one indexed query).
    pub(crate) fn read_session_detail(
        &self,
        id: &str,
    ) -> Result<Option<SessionDetail>, SqliteError> {
        let tx = self.read_tx()?;
        let Some(session) = self.read_session(id)? else {
            return Ok(None);
        };
        let root = session.tree_root_id();
        let tree: Vec<Session> = self.query_json("sessions", TREE_CHILDREN, [&**root])?;
        if let Some(tx) = tx {
            tx.commit()?;
        }
        Ok(Some(SessionDetail::build(session, tree)))
    }

    pub(crate) fn read_messages(
        &self,
        session: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Message>, SqliteError> {
        let start = match after {
            None => 0,
            Some(a) => match a.checked_add(1).and_then(|s| i64::try_from(s).ok()) {
                Some(s) => s,
                None => return Ok(Vec::new()),
            },
        };
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.query_json("messages", MESSAGES, params![session, start, limit])
    }

    pub(crate) fn read_interaction(
        &self,
        turn: &str,
        request: &str,
    ) -> Result<Option<Interaction>, SqliteError> {
        self.one_json("interactions", INTERACTION, [turn, request])
    }

    pub(crate) fn read_cancel_operation(
        &self,
        id: &str,
    ) -> Result<Option<CancelOperation>, SqliteError> {
        self.one_json("cancel_operations", CANCEL_OPERATION, [id])
    }

    /// The last assigned outbox seq (0 when none was ever assigned), pruned rows included.
    pub fn last_outbox_seq(&self) -> Result<u64, SqliteError> {
        let n: i64 = self
            .conn
            .prepare_cached(crate::apply::NEXT_SEQ)?
            .query_row([], |r| r.get(0))?;
        Ok(to_u64("outbox seq", n)?.saturating_sub(1))
    }

    pub(crate) fn seq_arg(after: u64) -> Option<i64> {
        to_i64("outbox seq", after).ok()
    }
}

fn parse_cursor(c: &str) -> Result<(i64, &str), SqliteError> {
    let bad = || SqliteError::BadCursor(c.to_string());
    let (at, id) = c.split_once(':').ok_or_else(bad)?;
    let at: i64 = at.parse().map_err(|_| bad())?;
    Ok((at, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// "Each read is one or two indexed queries, never a query per row": no read scans a table
    /// except the two that read every root on purpose (`snapshot_all`) or every row they return.
    #[test]
    fn every_read_uses_an_index() {
        let dir = tempfile::tempdir().expect("dir");
        let db = SqliteStore::open(dir.path().join("t.db")).expect("open");
        let mut reads: Vec<String> = [
            LIVE_ROOTS,
            ROOT_OF,
            ROOT_OF_OP,
            ROOTS_FIRST,
            ROOTS_AFTER,
            SESSION,
            TURN,
            TREE_CHILDREN,
            MESSAGES,
            INTERACTION,
            CANCEL_OPERATION,
            OUTBOX_AFTER,
            crate::apply::REDACT_MESSAGE_OUTBOX,
            crate::apply::REDACT_TREE_OUTBOX,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for t in [
            TREE_SESSIONS,
            TREE_TURNS,
            TREE_INTERACTIONS,
            TREE_TOOL_CALLS,
            TREE_OPS,
            TREE_MESSAGES,
        ] {
            reads.push(tree_sql(t));
        }
        for sql in &reads {
            let mut stmt = db
                .conn
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .expect("plan");
            let plan: Vec<String> = stmt
                .query_map(
                    rusqlite::params_from_iter(std::iter::repeat_n("x", stmt.parameter_count())),
                    |r| r.get::<_, String>(3),
                )
                .expect("query")
                .map(|r| r.expect("row"))
                .collect();
            for step in &plan {
                let scan = step.starts_with("SCAN ")
                    && !step.contains("USING")
                    && !step.starts_with("SCAN j")
                    && !step.starts_with("SCAN r")
                    && !step.starts_with("SCAN ts");
                assert!(!scan, "{sql}\n uses a full scan: {plan:?}");
                assert!(
                    !step.contains("TEMP B-TREE FOR ORDER BY"),
                    "{sql}\n sorts: {plan:?}"
                );
            }
        }
    }
}
