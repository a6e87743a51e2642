//! The outbox by root, kept in arrears (schema version 5): which outbox rows belong to which
//! tree, for the redaction of a deleted session's kept rows and for removing a deleted tree
//! once none of its rows is left.
//!
//! Until version 4 an index on `outbox (root_agent_session_id)` answered that. It was written
//! with every outbox row, and since each tree's entries sit in their own part of the index, a
//! group commit rewrote the last leaf page of every tree it touched: in the knee benchmark
//! (100 trees, about 22-25 batches a group) a third of the pages a group commit wrote (11-16 of
//! 34-45), and about 3 us of the commit thread's 15-16 us per line (issue 33).
//!
//! The table `outbox_roots` lists the same rows, in arrears: a commit leaves its rows out until
//! [`LAG`] rows wait after `meta.outbox_roots_through`; the commit that finds that many then
//! lists them all (`catch_up`), one entry per tree among them (the tree, its seqs in that
//! stretch comma-separated, the first and the last). The table is keyed by the first seq, so a
//! catch-up appends its entries at the table's end and pruning takes a prefix of it
//! (`forget`); its own index by tree (`outbox_roots_by_root`) gets one entry per tree and
//! catch-up: a leaf per tree every [`LAG`] rows, where the outbox's index rewrote a leaf per
//! tree at every commit.
//!
//! Invariants (each kept by the transaction that changes the outbox):
//! - every outbox row with `seq <= outbox_roots_through` is listed in an entry of its tree;
//! - an entry's last row is kept (pruning deletes from the oldest row up, and deletes an entry
//!   with its last row); seqs an entry lists below the oldest kept row name nothing any more;
//! - whoever needs a tree's rows brings the list up to date first in its own write transaction
//!   (`catch_up_all`), so it never misses the rows of the last commits.
//!
//! Choices: the lag is counted in rows, not time: a daemon at rest leaves up to [`LAG`] rows
//! unlisted, which costs a deletion or a retention pass one catch-up of at most that many. A
//! catch-up lists a tree's rows in one entry, not one entry per row: measured with the knee
//! benchmark, entries per row in tree order (the index's layout, kept in arrears) made a
//! catch-up of 4,096 rows take milliseconds, which raised the p99 past 5 ms.

use crate::error::{to_i64, SqliteError};
use rusqlite::{params, Connection, OptionalExtension};
use std::collections::HashMap;

/// How many outbox rows may be without their `outbox_roots` entry before a commit adds them.
pub const LAG: u64 = 4096;

/// The highest seq whose entry is in `outbox_roots`.
fn through(conn: &Connection) -> Result<i64, SqliteError> {
    let v: Option<i64> = conn
        .prepare_cached("SELECT value FROM meta WHERE key = 'outbox_roots_through'")?
        .query_row([], |r| r.get(0))
        .optional()?;
    Ok(v.unwrap_or(0))
}

/// Adds the entries of the outbox rows after `outbox_roots_through` if at least `lag` rows are
/// waiting (0: whatever is waiting), up to `last` (the highest seq written so far). Inside the
/// caller's write transaction. Returns how many entries it added.
pub(crate) fn catch_up(conn: &Connection, last: u64, lag: u64) -> Result<usize, SqliteError> {
    let last = to_i64("outbox seq", last)?;
    let from = through(conn)?;
    let waiting = u64::try_from(last.saturating_sub(from)).unwrap_or(0);
    if waiting == 0 || waiting < lag {
        return Ok(0);
    }
    // One entry per root for all its waiting rows, grouped here from one scan in seq order
    // (SQLite's GROUP BY would sort the rows first).
    let mut by_root: HashMap<String, Entry> = HashMap::new();
    {
        let mut scan = conn.prepare_cached(
            "SELECT root_agent_session_id, seq FROM outbox WHERE seq > ?1 AND seq <= ?2",
        )?;
        let mut rows = scan.query(params![from, last])?;
        while let Some(r) = rows.next()? {
            let root = r.get_ref(0)?.as_str().map_err(rusqlite::Error::from)?;
            let seq: i64 = r.get(1)?;
            match by_root.get_mut(root) {
                Some(e) => e.push(seq),
                None => {
                    by_root.insert(root.to_string(), Entry::new(seq));
                }
            }
        }
    }
    // In the order of their first seqs, which continues the table's: every entry is appended.
    let mut entries: Vec<(&String, &Entry)> = by_root.iter().collect();
    entries.sort_unstable_by_key(|(_, e)| e.first);
    let mut insert = conn.prepare_cached(
        "INSERT INTO outbox_roots (first_seq, last_seq, root_agent_session_id, seqs) \
         VALUES (?1, ?2, ?3, ?4)",
    )?;
    for (root, e) in entries {
        insert.execute(params![e.first, e.last, root, e.seqs])?;
    }
    conn.prepare_cached(
        "INSERT INTO meta (key, value) VALUES ('outbox_roots_through', ?1) \
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
    )?
    .execute([last])?;
    Ok(by_root.len())
}

/// One root's rows among those one catch-up lists, in seq order.
struct Entry {
    first: i64,
    last: i64,
    /// The seqs, comma-separated.
    seqs: String,
}

impl Entry {
    fn new(seq: i64) -> Entry {
        Entry {
            first: seq,
            last: seq,
            seqs: seq.to_string(),
        }
    }

    fn push(&mut self, seq: i64) {
        use std::fmt::Write;
        self.last = seq;
        let _ = write!(self.seqs, ",{seq}");
    }
}

/// [`catch_up`] with every waiting row, up to the outbox's highest seq.
pub(crate) fn catch_up_all(conn: &Connection) -> Result<usize, SqliteError> {
    let last: i64 = conn
        .prepare_cached("SELECT coalesce(max(seq), 0) FROM outbox")?
        .query_row([], |r| r.get(0))?;
    catch_up(conn, crate::error::to_u64("outbox seq", last)?, 0)
}

/// Before the outbox rows with `seq <= high` are deleted (pruning deletes from the oldest row
/// up): deletes the entries whose rows are all among them, a prefix of the table. An entry with
/// rows on both sides stays until its last row goes; its deleted rows name nothing any more (a
/// redaction's update finds no row under them).
pub(crate) fn forget(conn: &Connection, high: i64) -> Result<(), SqliteError> {
    conn.prepare_cached("DELETE FROM outbox_roots WHERE first_seq <= ?1 AND last_seq <= ?1")?
        .execute([high])?;
    Ok(())
}
