//! What a long-running host needs from a store beyond [`Store`]: grouped commits that return the
//! rows to publish, listing roots, the root of a session, the outbox tail and its retention, the
//! provider's working directory, and a checkpoint hook.
//!
//! The daemon (`tutti-tokio`) uses only [`Store`] and [`HostStore`], so any store that passes the
//! store conformance suite (`tutti_tests::conformance`) can run it. [`MemoryStore`],
//! `tutti_sqlite::SqliteStore` and `tutti_postgres::PostgresStore` implement both.
//!
//! [`MemoryStore`]: crate::store::MemoryStore

use super::Store;
use crate::model::{Id, Session};
use crate::step::PersistBatch;
use thiserror::Error;

/// One outbox row written by a batch: its sequence number, the index of the published row in
/// the batch's `rows`, and the payload exactly as stored (the entity's wire JSON), so that a
/// live event stream need not read it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// Outbox sequence number.
    pub seq: u64,
    /// Index into the batch's `rows`.
    pub row: u32,
    /// The stored payload (the entity's wire JSON); empty when the store was not asked for it.
    pub payload: String,
}

/// A group of batches that was not committed. Nothing of any batch in the group was written.
#[derive(Debug, Error)]
pub enum GroupError<E: std::error::Error + 'static> {
    /// The batch at `index` failed (a guard, or a write error): apply the batches one by one to
    /// find which still pass (see [`HostStore::apply_group`]).
    #[error("batch {index} of the group failed ({source}); nothing of the group was written")]
    Batch {
        /// Index of the failing batch in the group.
        index: usize,
        /// Why it failed.
        #[source]
        source: E,
    },
    /// The group failed outside any batch (beginning or committing the transaction).
    #[error("group commit failed: {0}")]
    Commit(#[source] E),
}

impl<E: std::error::Error + 'static> GroupError<E> {
    /// The underlying store error.
    pub fn source_error(&self) -> &E {
        match self {
            GroupError::Batch { source, .. } => source,
            GroupError::Commit(e) => e,
        }
    }
}

/// One page of root sessions, newest first.
#[derive(Debug, Clone, PartialEq)]
pub struct RootsPage {
    /// Root sessions (tombstones excluded), newest first (`createdAt`, then id, descending).
    pub sessions: Vec<Session>,
    /// The cursor of the next page, when there may be more. Opaque: pass it back as it is.
    pub next: Option<String>,
}

/// How long outbox rows are kept (issue 17: "an outbox retention policy by age and/or count").
///
/// A row is *expired* when it is not among the newest [`RetentionPolicy::keep_rows`] rows **or**
/// it is older than [`RetentionPolicy::max_age_ms`] (either limit alone expires it; `None`
/// disables that limit). An expired row is deleted only at or below the `protect` position a
/// caller gives (the lowest position a live follower has been sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// Keep at most this many of the newest rows (`None`: no count limit).
    pub keep_rows: Option<u64>,
    /// Keep rows younger than this (ms; `None`: no age limit).
    pub max_age_ms: Option<i64>,
}

impl Default for RetentionPolicy {
    /// 100,000 rows (about 8,000 settled demo sessions) and 7 days.
    fn default() -> Self {
        RetentionPolicy {
            keep_rows: Some(100_000),
            max_age_ms: Some(7 * 24 * 3600 * 1000),
        }
    }
}

/// What one retention pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PruneOutcome {
    /// Rows deleted.
    pub deleted: usize,
    /// `outbox_pruned_through` afterwards (every seq at or below it is gone).
    pub pruned_through: u64,
    /// Whether expired rows remain that this pass left for the next (`max_rows` reached).
    pub more: bool,
}

/// What a long-running host needs from a store beyond [`Store`].
///
/// Every method has the all-or-nothing and read-your-writes semantics of [`Store`]; the
/// conformance suite checks them.
pub trait HostStore: Store {
    /// Applies `batches` in one transaction, exactly as if they were applied one by one, and
    /// returns for each batch the outbox rows it wrote (payloads included when `payloads`).
    ///
    /// All or nothing: if any batch fails, nothing of any batch is written, and the error names
    /// the failing batch. The caller can then apply the batches one by one: batches before
    /// `index` pass as they did (unless another writer changed their state meanwhile), the batch
    /// at `index` fails again (drop its tree and reload it), and each later batch passes or fails
    /// on its own.
    fn apply_group(
        &mut self,
        batches: &[&PersistBatch],
        payloads: bool,
    ) -> Result<Vec<Vec<Published>>, GroupError<Self::Error>>;

    /// Whether an error is a failed guard: the batch was decided on a state that no longer
    /// holds (the host reloads that tree), as opposed to a failure of the store itself.
    fn is_guard_failure(error: &Self::Error) -> bool;

    /// Whether an error is the store refusing a batch of a tree whose ownership this handle lost
    /// (issue 21: "a daemon that lost its lease (paused, partitioned) can never commit for that
    /// tree again"). Stores without tree ownership never fence.
    fn is_fenced(_error: &Self::Error) -> bool {
        false
    }

    /// Whether an error is the store being unreachable (a broken connection, a server shutting
    /// down or restarting, a lock or statement timeout), as opposed to a refused or malformed
    /// request: the host answers "unavailable, retry later" (issue 34) instead of a conflict.
    /// No default: a store says which of its errors are transient (a file store's busy lock or
    /// I/O error is; an in-memory store has none).
    fn is_unavailable(error: &Self::Error) -> bool;

    /// The root session id of the tree a session belongs to (itself for a root; tombstones
    /// included), to load an evicted tree on demand.
    fn root_of(&self, session: &str) -> Result<Option<Id>, Self::Error>;

    /// The root session id of the tree a cancel operation belongs to.
    fn root_of_cancel_operation(&self, operation: &str) -> Result<Option<Id>, Self::Error>;

    /// Root sessions of a workspace, newest first, tombstones excluded: at most `limit` (at
    /// least 1) after `cursor`.
    fn roots(
        &self,
        workspace: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage, Self::Error>;

    /// The last assigned outbox seq (0 when none was ever assigned), pruned rows included.
    fn last_outbox_seq(&self) -> Result<u64, Self::Error>;

    /// The highest outbox seq ever pruned (0: none). A position `p` with `0 < p < this` asks for
    /// rows that no longer exist.
    fn outbox_pruned_through(&self) -> Result<u64, Self::Error> {
        Ok(0)
    }

    /// One retention pass at `now_ms`: deletes at most `max_rows` of the oldest expired rows at
    /// or below `protect` (`None`: no live reader). Required (issue 30: no silent default): a
    /// store that keeps every row says so in its own implementation.
    fn prune_outbox(
        &mut self,
        policy: &RetentionPolicy,
        now_ms: i64,
        protect: Option<u64>,
        max_rows: usize,
    ) -> Result<PruneOutcome, Self::Error>;

    /// Records the working directory of a root session's provider (replacing an earlier one).
    fn set_session_cwd(&mut self, root: &str, cwd: &str) -> Result<(), Self::Error>;

    /// The working directory recorded for a root session's provider, if any.
    fn session_cwd(&self, root: &str) -> Result<Option<String>, Self::Error>;

    /// Runs `f` so that every read it makes sees one committed state. Required (issue 30: a
    /// store that forgot it would let a detail read see half of a step).
    fn read_consistent<T>(&self, f: impl FnOnce(&Self) -> T) -> Result<T, Self::Error>;

    /// [`Store::load_live_trees`] for crash recovery at start-up: a store may leave out the
    /// trees' messages (and their ids), because the host only settles these trees and then
    /// drops them from memory (the next input loads the whole tree). Default: every message.
    fn load_live_trees_without_messages(
        &self,
    ) -> Result<Vec<crate::snapshot::TreeSnapshot>, Self::Error> {
        self.load_live_trees()
    }

    /// Called by the host when it is idle after commits; a store that needs housekeeping (a WAL
    /// checkpoint) does it here. The default does nothing.
    fn checkpoint(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }
}
