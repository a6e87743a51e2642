//! The outbox: published changes in commit order, per-consumer cursors, pruning.
//!
//! Sequence numbers are assigned inside the transaction that writes the rows they describe:
//! monotonic, gap-free, from 1. A consumer reads [`SqliteStore::outbox_after`] its cursor,
//! publishes, then [`SqliteStore::ack`]s. [`SqliteStore::prune_acked`] deletes the rows every
//! registered consumer has acknowledged; numbers are never reused after pruning.

use crate::error::{to_i64, to_u64, SqliteError};
use crate::SqliteStore;
use rusqlite::{params, OptionalExtension, TransactionBehavior};
use tutti_core::model::Id;
use tutti_core::store::OutboxRow;

impl SqliteStore {
    pub(crate) fn read_outbox_after(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<OutboxRow>, SqliteError> {
        let Some(after) = SqliteStore::seq_arg(after) else {
            return Ok(Vec::new());
        };
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut stmt = self.conn.prepare_cached(crate::read::OUTBOX_AFTER)?;
        let mut rows = stmt.query(params![after, limit])?;
        let mut out = Vec::new();
        while let Some(r) = rows.next()? {
            let seq: i64 = r.get(0)?;
            let kind: String = r.get(1)?;
            let root: String = r.get(2)?;
            let ws: String = r.get(3)?;
            let payload: String = r.get(4)?;
            let payload = serde_json::from_str(&payload).map_err(|source| SqliteError::BadRow {
                table: "outbox",
                key: seq.to_string(),
                source,
            })?;
            out.push(OutboxRow {
                seq: to_u64("outbox seq", seq)?,
                kind,
                root_agent_session_id: Id::from(root),
                workspace_id: Id::from(ws),
                payload,
            });
        }
        Ok(out)
    }

    /// Records that `consumer` has published every row up to `seq`. Cursors only move forward
    /// (acknowledging less than before changes nothing). Acknowledging beyond the last assigned
    /// seq is refused ([`SqliteError::AckBeyondEnd`]).
    pub fn ack(&mut self, consumer: &str, seq: u64) -> Result<(), SqliteError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let next: i64 = tx.query_row(crate::apply::NEXT_SEQ, [], |r| r.get(0))?;
        let last = to_u64("outbox seq", next)?.saturating_sub(1);
        if seq > last {
            return Err(SqliteError::AckBeyondEnd {
                consumer: consumer.to_string(),
                seq,
                last,
            });
        }
        tx.execute(
            "INSERT INTO outbox_consumers (consumer, acked_seq) VALUES (?1, ?2) \
             ON CONFLICT (consumer) DO UPDATE SET acked_seq = max(acked_seq, excluded.acked_seq)",
            params![consumer, to_i64("outbox seq", seq)?],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// The last seq `consumer` acknowledged (`None`: never acknowledged anything).
    pub fn consumer_cursor(&self, consumer: &str) -> Result<Option<u64>, SqliteError> {
        let v: Option<i64> = self
            .conn
            .prepare_cached("SELECT acked_seq FROM outbox_consumers WHERE consumer = ?1")?
            .query_row([consumer], |r| r.get(0))
            .optional()?;
        v.map(|v| to_u64("outbox seq", v)).transpose()
    }

    /// Stops tracking a consumer (so that it no longer holds back pruning). Returns whether it
    /// was known.
    pub fn forget_consumer(&mut self, consumer: &str) -> Result<bool, SqliteError> {
        let n = self.conn.execute(
            "DELETE FROM outbox_consumers WHERE consumer = ?1",
            [consumer],
        )?;
        Ok(n > 0)
    }

    /// Deletes the outbox rows that every registered consumer has acknowledged; returns how many.
    /// With no registered consumer nothing is deleted (nobody has read anything).
    pub fn prune_acked(&mut self) -> Result<usize, SqliteError> {
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let low: Option<i64> =
            tx.query_row("SELECT min(acked_seq) FROM outbox_consumers", [], |r| {
                r.get(0)
            })?;
        let Some(low) = low else {
            return Ok(0);
        };
        crate::outbox_roots::forget(&tx, low)?;
        let n = tx.execute("DELETE FROM outbox WHERE seq <= ?1", [low])?;
        tx.execute(
            "UPDATE meta SET value = max(value, ?1) WHERE key = 'outbox_pruned_through'",
            [low],
        )?;
        tx.commit()?;
        Ok(n)
    }
}
