//! [`HostStore`] for [`SqliteStore`]: what the daemon needs beyond [`tutti_core::store::Store`].

use crate::CheckpointMode;
use crate::{SqliteError, SqliteStore};
use tutti_core::model::Id;
use tutti_core::step::PersistBatch;
use tutti_core::store::{
    GroupError, HostStore, PruneOutcome, Published, RetentionPolicy, RootsPage,
};

impl HostStore for SqliteStore {
    fn apply_group(
        &mut self,
        batches: &[&PersistBatch],
        payloads: bool,
    ) -> Result<Vec<Vec<Published>>, GroupError<SqliteError>> {
        match self.group(batches.iter().copied(), payloads) {
            Ok(p) => Ok(p),
            Err(SqliteError::BatchFailed { index, source }) => Err(GroupError::Batch {
                index,
                source: *source,
            }),
            Err(e) => Err(GroupError::Commit(e)),
        }
    }

    fn is_guard_failure(error: &SqliteError) -> bool {
        error.is_guard_failure()
    }

    fn is_unavailable(error: &SqliteError) -> bool {
        error.is_unavailable()
    }

    fn root_of(&self, session: &str) -> Result<Option<Id>, SqliteError> {
        SqliteStore::root_of(self, session)
    }

    fn root_of_cancel_operation(&self, operation: &str) -> Result<Option<Id>, SqliteError> {
        SqliteStore::root_of_cancel_operation(self, operation)
    }

    fn roots(
        &self,
        workspace: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage, SqliteError> {
        let (sessions, next) = SqliteStore::roots(self, workspace, limit, cursor)?;
        Ok(RootsPage { sessions, next })
    }

    fn last_outbox_seq(&self) -> Result<u64, SqliteError> {
        SqliteStore::last_outbox_seq(self)
    }

    fn outbox_pruned_through(&self) -> Result<u64, SqliteError> {
        SqliteStore::outbox_pruned_through(self)
    }

    fn prune_outbox(
        &mut self,
        policy: &RetentionPolicy,
        now_ms: i64,
        protect: Option<u64>,
        max_rows: usize,
    ) -> Result<PruneOutcome, SqliteError> {
        SqliteStore::prune_outbox(self, policy, now_ms, protect, max_rows)
    }

    fn set_session_cwd(&mut self, root: &str, cwd: &str) -> Result<(), SqliteError> {
        SqliteStore::set_session_cwd(self, root, cwd)
    }

    fn session_cwd(&self, root: &str) -> Result<Option<String>, SqliteError> {
        SqliteStore::session_cwd(self, root)
    }

    fn read_consistent<T>(&self, f: impl FnOnce(&Self) -> T) -> Result<T, SqliteError> {
        SqliteStore::read_consistent(self, f)
    }

    fn load_live_trees_without_messages(
        &self,
    ) -> Result<Vec<tutti_core::snapshot::TreeSnapshot>, SqliteError> {
        SqliteStore::load_live_trees_without_messages(self)
    }

    /// A WAL restart checkpoint that never waits ([`CheckpointMode::RestartNoWait`]): a reader
    /// in the way makes it a no-op until the next call.
    fn checkpoint(&mut self) -> Result<(), SqliteError> {
        SqliteStore::checkpoint(self, CheckpointMode::RestartNoWait).map(|_| ())
    }
}
