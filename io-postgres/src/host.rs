//! [`HostStore`] for [`PostgresStore`]: grouped commits, roots, the outbox tail and its
//! retention, the provider's working directory.

use crate::error::{to_i64, to_u64, PgError};
use crate::PostgresStore;
use tutti_core::model::Id;
use tutti_core::step::PersistBatch;
use tutti_core::store::{
    GroupError, HostStore, PruneOutcome, Published, RetentionPolicy, RootsPage,
};

const NEXT_SEQ: &str = "SELECT value FROM meta WHERE key = 'outbox_next_seq'";
const PRUNED: &str = "SELECT value FROM meta WHERE key = 'outbox_pruned_through'";
const SET_CWD: &str = "INSERT INTO session_cwd (root_agent_session_id, cwd) VALUES ($1, $2) \
     ON CONFLICT (root_agent_session_id) DO UPDATE SET cwd = excluded.cwd";
/// Removes at most 1,000 deleted trees of which no outbox row is left: their session
/// tombstones, cancel operations and recorded `cwd`.
const REMOVE_TOMBSTONES: &str = "WITH gone AS (SELECT id FROM sessions WHERE kind = 'root' \
     AND deleted_at IS NOT NULL AND NOT EXISTS (SELECT 1 FROM outbox AS o \
     WHERE o.root_agent_session_id = sessions.id) LIMIT 1000), \
     s AS (DELETE FROM sessions WHERE id IN (SELECT id FROM gone) \
     OR root_agent_session_id IN (SELECT id FROM gone)), \
     c AS (DELETE FROM cancel_operations WHERE root_agent_session_id IN (SELECT id FROM gone)) \
     DELETE FROM session_cwd WHERE root_agent_session_id IN (SELECT id FROM gone)";
const CWD: &str = "SELECT cwd FROM session_cwd WHERE root_agent_session_id = $1";

impl PostgresStore {
    fn meta(&self, sql: &'static str) -> Result<u64, PgError> {
        let rows = self.query(sql, &[])?;
        let v: i64 = rows.first().map(|r| r.get(0)).unwrap_or(0);
        to_u64("meta value", v)
    }

    /// One retention pass (the rules of `tutti_sqlite`'s retention; there are no durable outbox
    /// consumers here): records the age mark, then deletes at most `max_rows` of the oldest
    /// expired rows at or below `protect`, in one transaction.
    fn prune(
        &mut self,
        policy: &RetentionPolicy,
        now_ms: i64,
        protect: Option<u64>,
        max_rows: usize,
    ) -> Result<PruneOutcome, PgError> {
        self.with_client(|c, _| prune_in(c, policy, now_ms, protect, max_rows))
    }
}

/// [`PostgresStore::prune`]'s transaction.
fn prune_in(
    c: &mut postgres::Client,
    policy: &RetentionPolicy,
    now_ms: i64,
    protect: Option<u64>,
    max_rows: usize,
) -> Result<PruneOutcome, PgError> {
    {
        let mut tx = c.transaction()?;
        let next: i64 = tx.query_one(NEXT_SEQ, &[])?.get(0);
        let last = next.saturating_sub(1).max(0);
        let pruned: i64 = tx.query_one(PRUNED, &[])?.get(0);
        if last > pruned {
            tx.execute(
                "INSERT INTO outbox_marks (seq, at_ms) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                &[&last, &now_ms],
            )?;
        }
        let by_count = policy
            .keep_rows
            .map(|k| last.saturating_sub(i64::try_from(k).unwrap_or(i64::MAX)));
        let by_age = match policy.max_age_ms {
            Some(age) => Some(
                tx.query_one(
                    "SELECT coalesce(max(seq), 0) FROM outbox_marks WHERE at_ms <= $1",
                    &[&now_ms.saturating_sub(age)],
                )?
                .get::<_, i64>(0),
            ),
            None => None,
        };
        let mut cutoff = match (by_count, by_age) {
            (Some(a), Some(b)) => a.max(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => 0,
        };
        if let Some(p) = protect {
            cutoff = cutoff.min(to_i64("outbox seq", p)?);
        }
        if cutoff <= pruned {
            tx.commit()?;
            return Ok(PruneOutcome {
                deleted: 0,
                pruned_through: to_u64("outbox seq", pruned)?,
                more: false,
            });
        }
        let limit = i64::try_from(max_rows.max(1)).unwrap_or(i64::MAX);
        let upto: i64 = tx
            .query_one(
                "SELECT coalesce(max(seq), $1) FROM \
                 (SELECT seq FROM outbox WHERE seq > $2 AND seq <= $1 ORDER BY seq LIMIT $3) AS o",
                &[&cutoff, &pruned, &limit],
            )?
            .get(0);
        let more: bool = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM outbox WHERE seq > $1 AND seq <= $2)",
                &[&upto, &cutoff],
            )?
            .get(0);
        let deleted = tx.execute(
            "DELETE FROM outbox WHERE seq > $1 AND seq <= $2",
            &[&pruned, &upto],
        )?;
        tx.execute(
            "UPDATE meta SET value = greatest(value, $1) WHERE key = 'outbox_pruned_through'",
            &[&upto],
        )?;
        tx.execute(
            "DELETE FROM outbox_marks WHERE seq < \
             (SELECT max(seq) FROM outbox_marks WHERE seq <= $1)",
            &[&upto],
        )?;
        // Tombstones go too: deleted trees of which no outbox row is left (as in
        // `tutti_sqlite`'s retention).
        tx.execute(REMOVE_TOMBSTONES, &[])?;
        tx.commit()?;
        Ok(PruneOutcome {
            deleted: usize::try_from(deleted).unwrap_or(usize::MAX),
            pruned_through: to_u64("outbox seq", upto)?,
            more,
        })
    }
}

impl HostStore for PostgresStore {
    fn apply_group(
        &mut self,
        batches: &[&PersistBatch],
        payloads: bool,
    ) -> Result<Vec<Vec<Published>>, GroupError<PgError>> {
        self.group(batches, payloads)
            .map_err(|(index, e)| match index {
                Some(index) => GroupError::Batch { index, source: e },
                None => GroupError::Commit(e),
            })
    }

    fn is_guard_failure(error: &PgError) -> bool {
        error.is_guard_failure()
    }

    fn is_fenced(error: &PgError) -> bool {
        matches!(error, PgError::Fenced { .. })
    }

    fn is_unavailable(error: &PgError) -> bool {
        error.is_unavailable()
    }

    fn root_of(&self, session: &str) -> Result<Option<Id>, PgError> {
        PostgresStore::root_of(self, session)
    }

    fn root_of_cancel_operation(&self, operation: &str) -> Result<Option<Id>, PgError> {
        PostgresStore::root_of_cancel_operation(self, operation)
    }

    fn roots(
        &self,
        workspace: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage, PgError> {
        let (sessions, next) = PostgresStore::roots(self, workspace, limit, cursor)?;
        Ok(RootsPage { sessions, next })
    }

    fn last_outbox_seq(&self) -> Result<u64, PgError> {
        Ok(self.meta(NEXT_SEQ)?.saturating_sub(1))
    }

    fn outbox_pruned_through(&self) -> Result<u64, PgError> {
        self.meta(PRUNED)
    }

    fn prune_outbox(
        &mut self,
        policy: &RetentionPolicy,
        now_ms: i64,
        protect: Option<u64>,
        max_rows: usize,
    ) -> Result<PruneOutcome, PgError> {
        self.prune(policy, now_ms, protect, max_rows)
    }

    fn set_session_cwd(&mut self, root: &str, cwd: &str) -> Result<(), PgError> {
        self.query(SET_CWD, &[&root, &cwd])?;
        Ok(())
    }

    fn session_cwd(&self, root: &str) -> Result<Option<String>, PgError> {
        Ok(self.query(CWD, &[&root])?.first().map(|r| r.get(0)))
    }

    fn read_consistent<T>(&self, f: impl FnOnce(&Self) -> T) -> Result<T, PgError> {
        PostgresStore::read_consistent(self, f)
    }
}
