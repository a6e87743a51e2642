//! The storage contract and its in-memory reference implementation.
//!
//! [`MemoryStore`] applies a [`PersistBatch`] exactly as the SQLite driver must: guards first,
//! the whole batch or nothing, idempotent upserts by version, outbox rows with gap-free sequence
//! numbers. Tests compare the SQLite driver against it.

use crate::model::{
    CancelOperation, CancelState, Id, Interaction, Message, Session, ToolCall, Turn,
};
use crate::projection::SessionDetail;
use crate::snapshot::TreeSnapshot;
use crate::step::{redacted_payload, redacts, Guard, PersistBatch, Row, REDACTED};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use thiserror::Error;

mod host_store;
pub use crate::stored::{decode_stored, StoredEntity};
pub use host_store::{GroupError, HostStore, PruneOutcome, Published, RetentionPolicy, RootsPage};

/// One published change, in the order of its sequence number.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct OutboxRow {
    /// Monotonic, gap-free sequence number, from 1.
    pub seq: u64,
    /// Entity kind (`session`, `turn`, `message`, `interaction`, `toolCall`, `cancelOperation`,
    /// `sessionDeleted`).
    pub kind: String,
    /// The tree.
    pub root_agent_session_id: Id,
    /// The workspace.
    pub workspace_id: Id,
    /// The entity in its wire form.
    pub payload: Value,
}

/// Why a batch was refused by the store. Nothing of the batch was written.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StoreError {
    /// A guard failed: the batch was decided under a state that no longer holds.
    #[error("guard failed: {0}")]
    GuardFailed(String),
}

/// What every store offers the engine's drivers and the scenario runner.
pub trait Store {
    /// The store's error type.
    type Error: std::error::Error + Send + Sync + 'static;
    /// Applies one batch atomically; returns the outbox sequence numbers it assigned.
    fn apply(&mut self, batch: &PersistBatch) -> Result<Vec<u64>, Self::Error>;
    /// The tree of one root session (tombstones included), if it exists.
    fn load_tree(&self, root: &str) -> Result<Option<TreeSnapshot>, Self::Error>;
    /// Trees with an active root turn or a prepared cancel operation.
    fn load_live_trees(&self) -> Result<Vec<TreeSnapshot>, Self::Error>;
    /// One session, unless deleted.
    fn session(&self, id: &str) -> Result<Option<Session>, Self::Error>;
    /// One turn.
    fn turn(&self, id: &str) -> Result<Option<Turn>, Self::Error>;
    /// The session and every nested child session, flat.
    fn session_detail(&self, id: &str) -> Result<Option<SessionDetail>, Self::Error>;
    /// Messages of one session with `seq > after` (all when `None`), in order, at most `limit`.
    fn messages(
        &self,
        session: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Message>, Self::Error>;
    /// One interaction by its (turn, request) key.
    fn interaction(&self, turn: &str, request: &str) -> Result<Option<Interaction>, Self::Error>;
    /// One cancel operation.
    fn cancel_operation(&self, id: &str) -> Result<Option<CancelOperation>, Self::Error>;
    /// Outbox rows with `seq > after`, at most `limit`.
    fn outbox_after(&self, after: u64, limit: usize) -> Result<Vec<OutboxRow>, Self::Error>;
}

/// The in-memory reference store.
#[derive(Debug, Default, Clone)]
pub struct MemoryStore {
    sessions: BTreeMap<Id, Session>,
    turns: BTreeMap<Id, Turn>,
    interactions: BTreeMap<(Id, Id), Interaction>,
    messages: BTreeMap<(Id, u64), Message>,
    tool_calls: BTreeMap<(Id, Id), ToolCall>,
    ops: BTreeMap<Id, CancelOperation>,
    outbox: Vec<OutboxRow>,
    cwd: BTreeMap<Id, String>,
}

/// A version guard passes when the stored row is at the version the batch was decided on, or
/// when this very batch was already applied (stored at `next` with exactly the batch's row): a
/// replay is a no-op, while a competing batch that reached `next` first (for example a child
/// creation racing a cancel preparation) fails the guard.
fn version_ok(
    stored: Option<u64>,
    version: u64,
    next: u64,
    same_row: impl FnOnce() -> bool,
) -> bool {
    let v = stored.unwrap_or(0);
    v == version || (v == next && same_row())
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// [`Store::apply`], returning each outbox seq with the index of its row in the batch.
    fn apply_published(&mut self, batch: &PersistBatch) -> Result<Vec<(u64, u32)>, StoreError> {
        for g in &batch.guards {
            self.check(g, batch)?;
        }
        let mut written = vec![false; batch.rows.len()];
        for (i, row) in batch.rows.iter().enumerate() {
            written[i] = self.write(row);
        }
        let mut seqs = Vec::new();
        let (Some(root), Some(ws)) = (&batch.root_agent_session_id, &batch.workspace_id) else {
            return Ok(seqs);
        };
        let purged: Vec<&Id> = batch
            .rows
            .iter()
            .filter_map(|r| match r {
                Row::PurgeSession { agent_session_id } => Some(agent_session_id),
                _ => None,
            })
            .collect();
        if !purged.is_empty() {
            for r in self
                .outbox
                .iter_mut()
                .filter(|r| r.root_agent_session_id == *root)
            {
                if let Some(s) = purged.iter().find(|s| redacts(&r.kind, &r.payload, s)) {
                    r.payload = redacted_payload(s, &r.kind);
                    r.kind = REDACTED.to_string();
                }
            }
        }
        for &i in &batch.outbox {
            let Some(row) = batch.rows.get(i as usize) else {
                continue;
            };
            if !written.get(i as usize).copied().unwrap_or(false) {
                continue;
            }
            let seq = self.outbox.len() as u64 + 1;
            self.outbox.push(OutboxRow {
                seq,
                kind: row.kind().to_string(),
                root_agent_session_id: root.clone(),
                workspace_id: ws.clone(),
                payload: row.to_json(),
            });
            seqs.push((seq, i));
        }
        Ok(seqs)
    }

    fn check(&self, g: &Guard, batch: &PersistBatch) -> Result<(), StoreError> {
        let ok = match g {
            Guard::SessionVersion { id, version, next } => {
                let stored = self.sessions.get(id);
                version_ok(stored.map(|s| s.version), *version, *next, || {
                    batch
                        .rows
                        .iter()
                        .any(|r| matches!(r, Row::Session(s) if Some(&**s) == stored))
                })
            }
            Guard::TurnVersion { id, version, next } => {
                let stored = self.turns.get(id);
                version_ok(stored.map(|t| t.version), *version, *next, || {
                    batch
                        .rows
                        .iter()
                        .any(|r| matches!(r, Row::Turn(t) if Some(&**t) == stored))
                })
            }
            Guard::CancelVersion { id, version, next } => {
                let stored = self.ops.get(id);
                version_ok(stored.map(|o| o.version), *version, *next, || {
                    batch
                        .rows
                        .iter()
                        .any(|r| matches!(r, Row::CancelOperation(o) if Some(&**o) == stored))
                })
            }
            Guard::ChildCreationOpen {
                root_turn_id,
                child_agent_session_id,
            } => {
                self.sessions.contains_key(child_agent_session_id)
                    || self
                        .turns
                        .get(root_turn_id)
                        .is_some_and(|t| !t.child_creation_closed())
            }
        };
        if ok {
            Ok(())
        } else {
            Err(StoreError::GuardFailed(format!("{g:?}")))
        }
    }

    /// Writes one row; returns whether anything was written.
    fn write(&mut self, row: &Row) -> bool {
        fn upsert<K: Ord + Clone, V: Clone>(
            map: &mut BTreeMap<K, V>,
            key: K,
            v: &V,
            version: impl Fn(&V) -> u64,
        ) -> bool {
            match map.get(&key) {
                Some(old) if version(old) >= version(v) => false,
                _ => {
                    map.insert(key, v.clone());
                    true
                }
            }
        }
        match row {
            Row::Session(s) => upsert(&mut self.sessions, s.id.clone(), s, |s| s.version),
            Row::Turn(t) => upsert(&mut self.turns, t.id.clone(), t, |t| t.version),
            Row::Interaction(i) => upsert(
                &mut self.interactions,
                (i.turn_id.clone(), i.request_id.clone()),
                i,
                |i| i.version,
            ),
            Row::ToolCall(c) => upsert(
                &mut self.tool_calls,
                (c.agent_session_id.clone(), c.tool_call_id.clone()),
                c,
                |c| c.version,
            ),
            Row::CancelOperation(o) => upsert(&mut self.ops, o.id.clone(), o, |o| o.version),
            Row::Message(m) => {
                let key = (m.agent_session_id.clone(), m.seq);
                match self.messages.entry(key) {
                    std::collections::btree_map::Entry::Occupied(_) => false,
                    std::collections::btree_map::Entry::Vacant(v) => {
                        v.insert(m.clone());
                        true
                    }
                }
            }
            Row::PurgeSession { agent_session_id } => {
                let s = agent_session_id;
                self.turns.retain(|_, t| t.agent_session_id != *s);
                self.interactions.retain(|_, i| i.agent_session_id != *s);
                self.tool_calls.retain(|(sid, _), _| sid != s);
                self.messages.retain(|(sid, _), _| sid != s);
                true
            }
        }
    }

    /// Every outbox row so far.
    pub fn outbox(&self) -> &[OutboxRow] {
        &self.outbox
    }

    /// Root sessions of a workspace, newest first (tombstones excluded).
    pub fn roots(&self, workspace: &str) -> Vec<Session> {
        let mut v: Vec<Session> = self
            .sessions
            .values()
            .filter(|s| s.is_root() && s.deleted_at.is_none() && &*s.workspace_id == workspace)
            .cloned()
            .collect();
        v.sort_by(|a, b| (b.created_at, &b.id).cmp(&(a.created_at, &a.id)));
        v
    }

    /// Ids of every root session stored (tombstones included).
    pub fn root_ids(&self) -> Vec<Id> {
        self.sessions
            .values()
            .filter(|s| s.is_root())
            .map(|s| s.id.clone())
            .collect()
    }

    fn tree(&self, root: &str) -> Option<TreeSnapshot> {
        let r = self.sessions.get(root)?;
        if !r.is_root() {
            return None;
        }
        let in_tree = |s: &Session| &**s.tree_root_id() == root;
        let sessions: Vec<Session> = self
            .sessions
            .values()
            .filter(|s| in_tree(s))
            .cloned()
            .collect();
        let ids: std::collections::BTreeSet<&Id> = sessions.iter().map(|s| &s.id).collect();
        let mut snap = TreeSnapshot {
            turns: self
                .turns
                .values()
                .filter(|t| ids.contains(&t.agent_session_id))
                .cloned()
                .collect(),
            interactions: self
                .interactions
                .values()
                .filter(|i| ids.contains(&i.agent_session_id))
                .cloned()
                .collect(),
            tool_calls: self
                .tool_calls
                .values()
                .filter(|c| ids.contains(&c.agent_session_id))
                .cloned()
                .collect(),
            cancel_operations: self
                .ops
                .values()
                .filter(|o| &*o.root_agent_session_id == root)
                .cloned()
                .collect(),
            message_ids: self
                .messages
                .values()
                .filter(|m| ids.contains(&m.agent_session_id))
                .map(|m| (m.agent_session_id.clone(), m.message_id.clone()))
                .collect(),
            sessions,
        };
        snap.canonicalize();
        Some(snap)
    }
}

impl Store for MemoryStore {
    type Error = StoreError;

    fn apply(&mut self, batch: &PersistBatch) -> Result<Vec<u64>, StoreError> {
        Ok(self
            .apply_published(batch)?
            .into_iter()
            .map(|(seq, _)| seq)
            .collect())
    }

    fn load_tree(&self, root: &str) -> Result<Option<TreeSnapshot>, StoreError> {
        Ok(self.tree(root))
    }

    fn load_live_trees(&self) -> Result<Vec<TreeSnapshot>, StoreError> {
        let mut live: std::collections::BTreeSet<Id> = self
            .sessions
            .values()
            .filter(|s| s.is_root() && s.active_turn_id.is_some())
            .map(|s| s.id.clone())
            .collect();
        live.extend(
            self.ops
                .values()
                .filter(|o| o.state == CancelState::Prepared)
                .map(|o| o.root_agent_session_id.clone()),
        );
        Ok(live.iter().filter_map(|r| self.tree(r)).collect())
    }

    fn session(&self, id: &str) -> Result<Option<Session>, StoreError> {
        Ok(self
            .sessions
            .get(id)
            .filter(|s| s.deleted_at.is_none())
            .cloned())
    }

    fn turn(&self, id: &str) -> Result<Option<Turn>, StoreError> {
        Ok(self.turns.get(id).cloned())
    }

    fn session_detail(&self, id: &str) -> Result<Option<SessionDetail>, StoreError> {
        let Some(session) = self.sessions.get(id).filter(|s| s.deleted_at.is_none()) else {
            return Ok(None);
        };
        let root = session.tree_root_id();
        let tree: Vec<Session> = self
            .sessions
            .values()
            .filter(|s| s.root_agent_session_id() == Some(root))
            .cloned()
            .collect();
        Ok(Some(SessionDetail::build(session.clone(), tree)))
    }

    fn messages(
        &self,
        session: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Message>, StoreError> {
        let start = after.map_or(0, |a| a + 1);
        Ok(self
            .messages
            .range((Id::from(session), start)..)
            .take_while(|((s, _), _)| &**s == session)
            .take(limit)
            .map(|(_, m)| m.clone())
            .collect())
    }

    fn interaction(&self, turn: &str, request: &str) -> Result<Option<Interaction>, StoreError> {
        Ok(self
            .interactions
            .get(&(Id::from(turn), Id::from(request)))
            .cloned())
    }

    fn cancel_operation(&self, id: &str) -> Result<Option<CancelOperation>, StoreError> {
        Ok(self.ops.get(id).cloned())
    }

    fn outbox_after(&self, after: u64, limit: usize) -> Result<Vec<OutboxRow>, StoreError> {
        Ok(self
            .outbox
            .iter()
            .skip(after as usize)
            .take(limit)
            .cloned()
            .collect())
    }
}

impl HostStore for MemoryStore {
    /// Applies the group to a copy and keeps the copy only when every batch passed.
    fn apply_group(
        &mut self,
        batches: &[&PersistBatch],
        payloads: bool,
    ) -> Result<Vec<Vec<Published>>, GroupError<StoreError>> {
        let mut next = self.clone();
        let mut out = Vec::with_capacity(batches.len());
        for (index, batch) in batches.iter().enumerate() {
            let seqs = next
                .apply_published(batch)
                .map_err(|source| GroupError::Batch { index, source })?;
            let published = seqs
                .into_iter()
                .map(|(seq, row)| Published {
                    seq,
                    row,
                    payload: if payloads {
                        next.outbox
                            .get((seq - 1) as usize)
                            .map(|o| o.payload.to_string())
                            .unwrap_or_default()
                    } else {
                        String::new()
                    },
                })
                .collect();
            out.push(published);
        }
        *self = next;
        Ok(out)
    }

    fn is_guard_failure(error: &StoreError) -> bool {
        matches!(error, StoreError::GuardFailed(_))
    }

    /// Memory is never unreachable.
    fn is_unavailable(_error: &StoreError) -> bool {
        false
    }

    /// The memory store keeps every row (it lives as long as its process): nothing is pruned.
    fn prune_outbox(
        &mut self,
        _policy: &RetentionPolicy,
        _now_ms: i64,
        _protect: Option<u64>,
        _max_rows: usize,
    ) -> Result<PruneOutcome, StoreError> {
        Ok(PruneOutcome {
            pruned_through: self.outbox_pruned_through()?,
            ..PruneOutcome::default()
        })
    }

    /// One owner, no concurrent writer: every read sees one committed state.
    fn read_consistent<T>(&self, f: impl FnOnce(&Self) -> T) -> Result<T, StoreError> {
        Ok(f(self))
    }

    fn root_of(&self, session: &str) -> Result<Option<Id>, StoreError> {
        Ok(self.sessions.get(session).map(|s| s.tree_root_id().clone()))
    }

    fn root_of_cancel_operation(&self, operation: &str) -> Result<Option<Id>, StoreError> {
        Ok(self
            .ops
            .get(operation)
            .map(|o| o.root_agent_session_id.clone()))
    }

    /// Cursor: `{createdAt}:{id}` of the last session of the previous page.
    fn roots(
        &self,
        workspace: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage, StoreError> {
        let limit = limit.max(1);
        let after = cursor.and_then(|c| {
            let (at, id) = c.split_once(':')?;
            Some((at.parse::<i64>().ok()?, id.to_string()))
        });
        let mut sessions: Vec<Session> = self
            .roots(workspace)
            .into_iter()
            .filter(|s| match &after {
                None => true,
                Some((at, id)) => (s.created_at, &*s.id) < (*at, id.as_str()),
            })
            .take(limit + 1)
            .collect();
        let next = if sessions.len() > limit {
            sessions.truncate(limit);
            sessions
                .last()
                .map(|s| format!("{}:{}", s.created_at, s.id))
        } else {
            None
        };
        Ok(RootsPage { sessions, next })
    }

    fn last_outbox_seq(&self) -> Result<u64, StoreError> {
        Ok(self.outbox.len() as u64)
    }

    fn set_session_cwd(&mut self, root: &str, cwd: &str) -> Result<(), StoreError> {
        self.cwd.insert(Id::from(root), cwd.to_string());
        Ok(())
    }

    fn session_cwd(&self, root: &str) -> Result<Option<String>, StoreError> {
        Ok(self.cwd.get(root).cloned())
    }
}
