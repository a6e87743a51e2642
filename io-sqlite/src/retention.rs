//! Outbox retention: old outbox rows are deleted so that the file does not grow with every
//! session ever created, without ever taking a row from someone still reading it.
//!
//! Issue 17: "an outbox retention policy (by age and/or count, configurable) whose pruning never
//! removes a row a live follower has not been sent, and a follower that asks for a pruned
//! position gets an explicit reset event (documented) instead of a silent gap."
//!
//! A row is *expired* when it is not among the newest [`RetentionPolicy::keep_rows`] rows **or**
//! it is older than [`RetentionPolicy::max_age_ms`] (either limit alone expires it; `None`
//! disables that limit). An expired row is deleted only if it is also at or below `protect` (the
//! lowest position of the live followers, given by the caller) and at or below every durable
//! consumer's acknowledged seq (`outbox_consumers`). Sequence numbers are never reused:
//! `meta.outbox_pruned_through` remembers the highest deleted seq, and readers compare a position
//! with it ([`SqliteStore::outbox_pruned_through`]) to tell a pruned position from an empty one.
//!
//! Outbox rows carry no time. Each pass records a mark "every row up to seq S existed at time T"
//! (`outbox_marks`); a row's age is judged by the newest mark at or before `now - max_age`, so a
//! row is deleted at most one pass interval after it expires, never before.
//!
//! Tombstones go too (issue 36: "retention eventually removes tombstones too"): a pass that
//! deleted rows also removes the trees whose root is deleted and of which no outbox row is
//! left (at most [`TOMBSTONES_PER_PASS`] a pass): their session tombstones, cancel operations
//! and recorded `cwd` (their turns, messages, tool calls and interactions went at the deletion).
//! The tree then reads as unknown, as if it never existed. A deleted child of a live tree keeps
//! its tombstone (ids only) as long as its tree exists.

use crate::error::{to_i64, to_u64, SqliteError};
use crate::SqliteStore;
use rusqlite::{params, OptionalExtension, TransactionBehavior};

/// How long outbox rows are kept.
pub use tutti_core::store::{PruneOutcome, RetentionPolicy};

impl SqliteStore {
    /// The highest outbox seq ever pruned (0: none). A position `p` with `0 < p < this` asks for
    /// rows that no longer exist.
    pub fn outbox_pruned_through(&self) -> Result<u64, SqliteError> {
        let v: Option<i64> = self
            .conn
            .prepare_cached("SELECT value FROM meta WHERE key = 'outbox_pruned_through'")?
            .query_row([], |r| r.get(0))
            .optional()?;
        to_u64("outbox seq", v.unwrap_or(0))
    }

    /// One retention pass at time `now_ms` (one write transaction): records the age mark, then
    /// deletes at most `max_rows` of the oldest expired rows at or below `protect` (the lowest
    /// position a live reader has been sent; `None`: no live reader) and at or below every
    /// durable consumer's acknowledgement.
    pub fn prune_outbox(
        &mut self,
        policy: &RetentionPolicy,
        now_ms: i64,
        protect: Option<u64>,
        max_rows: usize,
    ) -> Result<PruneOutcome, SqliteError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let next: i64 = tx.query_row(crate::apply::NEXT_SEQ, [], |r| r.get(0))?;
        let last = next.saturating_sub(1).max(0);
        let pruned: i64 = tx
            .query_row(
                "SELECT value FROM meta WHERE key = 'outbox_pruned_through'",
                [],
                |r| r.get(0),
            )
            .optional()?
            .unwrap_or(0);
        if last > pruned {
            tx.execute(
                "INSERT OR IGNORE INTO outbox_marks (seq, at_ms) VALUES (?1, ?2)",
                params![last, now_ms],
            )?;
        }
        // The highest expired seq.
        let by_count = policy
            .keep_rows
            .map(|k| last.saturating_sub(i64::try_from(k).unwrap_or(i64::MAX)));
        let by_age = match policy.max_age_ms {
            Some(age) => Some(tx.query_row(
                "SELECT coalesce(max(seq), 0) FROM outbox_marks WHERE at_ms <= ?1",
                [now_ms.saturating_sub(age)],
                |r| r.get::<_, i64>(0),
            )?),
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
        let acked: Option<i64> =
            tx.query_row("SELECT min(acked_seq) FROM outbox_consumers", [], |r| {
                r.get(0)
            })?;
        if let Some(a) = acked {
            cutoff = cutoff.min(a);
        }
        if cutoff <= pruned {
            tx.commit()?;
            return Ok(PruneOutcome {
                deleted: 0,
                pruned_through: to_u64("outbox seq", pruned)?,
                more: false,
            });
        }
        // The oldest `max_rows` expired rows: the pass is bounded, the rest is for the next one.
        let limit = i64::try_from(max_rows.max(1)).unwrap_or(i64::MAX);
        let upto: i64 = tx.query_row(
            "SELECT coalesce(max(seq), ?1) FROM \
             (SELECT seq FROM outbox WHERE seq > ?2 AND seq <= ?1 ORDER BY seq LIMIT ?3)",
            params![cutoff, pruned, limit],
            |r| r.get(0),
        )?;
        let more: bool = tx.query_row(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE seq > ?1 AND seq <= ?2)",
            params![upto, cutoff],
            |r| r.get(0),
        )?;
        crate::outbox_roots::forget(&tx, upto)?;
        let deleted = tx.execute(
            "DELETE FROM outbox WHERE seq > ?1 AND seq <= ?2",
            params![pruned, upto],
        )?;
        tx.execute(
            "UPDATE meta SET value = max(value, ?1) WHERE key = 'outbox_pruned_through'",
            [upto],
        )?;
        // Marks at or below what is gone judge nothing any more (keep the newest of them).
        tx.execute(
            "DELETE FROM outbox_marks WHERE seq < (SELECT max(seq) FROM outbox_marks WHERE seq <= ?1)",
            [upto],
        )?;
        remove_tombstones(&tx)?;
        tx.commit()?;
        Ok(PruneOutcome {
            deleted,
            pruned_through: to_u64("outbox seq", upto)?,
            more,
        })
    }
}

/// The most deleted trees one retention pass removes.
pub const TOMBSTONES_PER_PASS: usize = 1000;

/// Removes deleted trees of which no outbox row is left (one pass over the trees listed in
/// `outbox_roots`, once its entries are up to date: a root's deletion already listed every row
/// of its tree, and a deleted tree gets no new rows, but the pass does not rely on either).
fn remove_tombstones(tx: &rusqlite::Transaction<'_>) -> Result<usize, SqliteError> {
    crate::outbox_roots::catch_up_all(tx)?;
    let roots: Vec<String> = {
        let mut stmt = tx.prepare_cached(
            "SELECT id FROM sessions WHERE kind = 'root' AND deleted_at IS NOT NULL \
             AND id NOT IN (SELECT root_agent_session_id FROM outbox_roots) LIMIT ?1",
        )?;
        let rows = stmt.query_map([TOMBSTONES_PER_PASS as i64], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    for root in &roots {
        tx.prepare_cached("DELETE FROM sessions WHERE root_agent_session_id = ?1 OR id = ?1")?
            .execute([root])?;
        tx.prepare_cached("DELETE FROM cancel_operations WHERE root_agent_session_id = ?1")?
            .execute([root])?;
        tx.prepare_cached("DELETE FROM session_cwd WHERE root_agent_session_id = ?1")?
            .execute([root])?;
    }
    Ok(roots.len())
}
