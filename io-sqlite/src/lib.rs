//! # tutti-sqlite
//!
//! The durable store of tutti: a single SQLite file that holds what the engine decided. The
//! database is the truth; the engine is a cache of it ("crash-only").
//!
//! - [`SqliteStore::open`] opens or creates a file (mode 0600, WAL, `synchronous=NORMAL` unless
//!   [`Synchronous::Full`] is chosen, foreign keys on, a busy timeout), checks that it is a tutti
//!   database ([`schema::APPLICATION_ID`]) of a schema version this build knows
//!   ([`schema::SCHEMA_VERSION`], `PRAGMA user_version`), and migrates older ones. Garbage, a
//!   truncated file, someone else's database and a newer schema each give their own
//!   [`SqliteError`].
//! - [`SqliteStore`] implements [`tutti_core::store::Store`] with the reference semantics of
//!   [`MemoryStore`](tutti_core::store::MemoryStore): [`Store::apply`] commits one
//!   [`PersistBatch`] as one `BEGIN IMMEDIATE` transaction: every guard is checked inside it and
//!   a failing guard rolls the whole batch back ([`SqliteError::GuardFailed`]); upserts skip rows
//!   stored at the same or a newer version (replays are harmless); messages are inserted once per
//!   (session, seq); `PurgeSession` removes a session's turns, interactions, messages and tool
//!   calls; one outbox row is appended per published row that was actually written, numbered by a
//!   gap-free counter in the same transaction. The one deliberate difference is the version
//!   guards' replay rule, see [`ReplayRule`].
//! - [`SqliteStore::apply_many`] is group commit: several batches, one transaction, one sync.
//! - [`Checkpointer`]: WAL checkpoints on a thread of their own, so that a writer opened without
//!   automatic checkpoints never copies or syncs the WAL on its commit path.
//! - The outbox: [`SqliteStore::outbox_after`], [`SqliteStore::ack`],
//!   [`SqliteStore::consumer_cursor`], [`SqliteStore::prune_acked`].
//! - Recovery: [`Store::load_live_trees`] (every tree with an active root turn or a prepared
//!   cancel operation, whose exact target set is in the snapshot), [`Store::load_tree`],
//!   [`SqliteStore::root_of`] to load an evicted tree on demand, [`SqliteStore::snapshot_all`].
//! - Reads for the API: [`SqliteStore::roots`] (paginated, newest first), [`Store::session`],
//!   [`Store::session_detail`], [`Store::messages`], [`Store::turn`], [`Store::interaction`],
//!   [`Store::cancel_operation`].
//!
//! ## Schema
//!
//! One table per entity (`sessions`, `turns`, `interactions`, `messages`, `tool_calls`,
//! `cancel_operations`) with the columns that queries filter or sort on and a `json` column with
//! the entity's wire form, which is what reads decode; plus `outbox`, `outbox_roots` (which
//! outbox rows each tree has, listed in arrears, see [`outbox_roots`]), `outbox_consumers` and
//! `meta`. A message's outbox row refers to the message instead of copying its JSON (messages
//! never change); readers of the outbox never see the difference. See [`schema`] for the DDL,
//! its indexes and its versions.
//!
//! ```no_run
//! use tutti_core::{Engine, Input, store::Store};
//! use tutti_sqlite::SqliteStore;
//! # fn inputs() -> Vec<(i64, Input)> { Vec::new() }
//! let mut store = SqliteStore::open("tutti.db")?;
//! let mut engine = Engine::new();
//! for tree in store.load_live_trees()? {
//!     engine.restore(tree).ok();
//! }
//! for (now, input) in inputs() {
//!     let Ok(step) = engine.handle(now, &input) else { continue };
//!     if let Err(e) = store.apply(&step.persist) {
//!         // Rejected by persistence (or an I/O error): drop the tree and reload it.
//!         let root = step.persist.root_agent_session_id.clone().unwrap_or_default();
//!         engine.evict(&root);
//!         if let Some(t) = store.load_tree(&root)? {
//!             engine.restore(t).ok();
//!         }
//!         let _ = e;
//!     }
//! }
//! # Ok::<(), tutti_sqlite::SqliteError>(())
//! ```

#![warn(missing_docs)]

mod apply;
mod checkpointer;
mod codec;
mod consistent;
mod cwd;
mod error;
mod host;
mod open;
mod outbox;
pub mod outbox_roots;
mod read;
mod retention;
pub mod schema;

pub use apply::Published;
pub use checkpointer::{CheckpointEvent, CheckpointPolicy, Checkpointer, CHECKPOINT_NICE};
pub use error::SqliteError;
pub use open::{OpenOptions, ReplayRule, Synchronous, DEFAULT_CACHE_KIB};
pub use retention::{PruneOutcome, RetentionPolicy};

/// The most batches a driver should put in one group commit ([`SqliteStore::apply_many`]): the
/// reference daemon commits whatever inputs are queued, up to this many, so under a saturating
/// load every group commit has this size.
///
/// Below saturation the cap is never reached (at 10k events/s a group holds a few inputs), so it
/// does not change latency there. At saturation the queue is longer than any group: a larger cap
/// commits more events per second (fewer commits rewrite the same b-tree pages into the WAL), so
/// the queue drains sooner, at the price of each commit taking longer (15–20 ms for 2048 events
/// on this project's VM disk). 2048 was chosen from `cargo bench -p tutti-sqlite`, which prints
/// the figure for other sizes: in the same runs, groups of 256 committed 10–25 % fewer events
/// per second than groups of 2048, and groups of 4096 gained little and not consistently.
pub const MAX_GROUP: usize = 2048;

use rusqlite::{Connection, TransactionBehavior};
use std::path::{Path, PathBuf};
use tutti_core::model::{CancelOperation, Interaction, Message, Session, Turn};
use tutti_core::projection::SessionDetail;
use tutti_core::step::PersistBatch;
use tutti_core::store::{OutboxRow, Store};
use tutti_core::TreeSnapshot;

/// A tutti database file. One connection; open several on the same file for several writers
/// (each write is a `BEGIN IMMEDIATE` transaction, so writers serialize and wait up to the busy
/// timeout).
#[derive(Debug)]
pub struct SqliteStore {
    conn: Connection,
    path: PathBuf,
    replay_rule: ReplayRule,
    busy_timeout: std::time::Duration,
    /// Reused buffer for serialized rows.
    arena: Vec<u8>,
}

impl SqliteStore {
    /// Opens (or creates) a database file with the default [`OpenOptions`].
    pub fn open(path: impl AsRef<Path>) -> Result<SqliteStore, SqliteError> {
        SqliteStore::open_with(path, &OpenOptions::default())
    }

    /// Opens (or, unless disabled, creates) a database file.
    pub fn open_with(
        path: impl AsRef<Path>,
        options: &OpenOptions,
    ) -> Result<SqliteStore, SqliteError> {
        let path = path.as_ref();
        let conn = open::open(path, options)?;
        Ok(SqliteStore {
            conn,
            path: path.to_path_buf(),
            replay_rule: options.replay_rule,
            busy_timeout: options.busy_timeout,
            arena: Vec::with_capacity(4096),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The commit durability in effect on this connection, read back from SQLite
    /// (`PRAGMA synchronous`), not from the options it was opened with. `None` for a mode this
    /// crate never sets.
    pub fn synchronous(&self) -> Result<Option<Synchronous>, SqliteError> {
        let v: i64 = self
            .conn
            .pragma_query_value(None, "synchronous", |r| r.get(0))?;
        Ok(Synchronous::from_pragma_value(v))
    }

    /// Group commit: applies several batches, in order, in ONE transaction (one commit, one sync).
    ///
    /// Each batch's guards are checked against the state left by the batches before it in the
    /// group, exactly as if the batches were applied one by one. Returns the outbox sequence
    /// numbers of each batch, in order.
    ///
    /// All or nothing: if any batch fails (a guard, or an SQLite error while writing it), the
    /// whole group is rolled back, **nothing** of any batch is written, and the error is
    /// [`SqliteError::BatchFailed`] with the failing batch's `index`. The caller can then go on
    /// batch by batch with [`Store::apply`]: batches before `index` will pass as they did (unless
    /// another writer changed their state meanwhile), the batch at `index` fails again (drop its
    /// tree and reload it), and each later batch either passes or fails on its own (a later batch
    /// of the same tree, decided on top of the failed one, normally fails its version guard; drop
    /// and reload that tree as for any failed batch). Errors outside any batch (beginning or
    /// committing the transaction, or listing the outbox by root, see [`outbox_roots`]) are
    /// returned as they are; nothing was written then either.
    pub fn apply_many<'a>(
        &mut self,
        batches: impl IntoIterator<Item = &'a PersistBatch>,
    ) -> Result<Vec<Vec<u64>>, SqliteError> {
        let out = self.group(batches, false)?;
        Ok(out
            .into_iter()
            .map(|p| p.into_iter().map(|p| p.seq).collect())
            .collect())
    }

    /// [`SqliteStore::apply_many`], returning for each batch the outbox rows it wrote with the
    /// index of their row and their payload exactly as stored (for a live event stream that
    /// does not read them back from the file).
    pub fn apply_many_published<'a>(
        &mut self,
        batches: impl IntoIterator<Item = &'a PersistBatch>,
    ) -> Result<Vec<Vec<Published>>, SqliteError> {
        self.group(batches, true)
    }

    fn group<'a>(
        &mut self,
        batches: impl IntoIterator<Item = &'a PersistBatch>,
        capture: bool,
    ) -> Result<Vec<Vec<Published>>, SqliteError> {
        let batches: Vec<&PersistBatch> = batches.into_iter().collect();
        if batches
            .iter()
            .all(|b| b.rows.is_empty() && b.guards.is_empty())
        {
            return Ok(vec![Vec::new(); batches.len()]);
        }
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let mut out = Vec::with_capacity(batches.len());
        {
            let mut w = apply::Writer::new(&tx, self.replay_rule, &mut self.arena);
            if capture {
                w = w.capture();
            }
            for (index, b) in batches.iter().enumerate() {
                match w.apply(b) {
                    Ok(seqs) => out.push(seqs),
                    Err(e) => {
                        return Err(SqliteError::BatchFailed {
                            index,
                            source: Box::new(e),
                        })
                    }
                }
            }
            w.finish()?;
        }
        tx.commit()?;
        Ok(out)
    }

    fn apply_one(&mut self, batch: &PersistBatch) -> Result<Vec<u64>, SqliteError> {
        if batch.rows.is_empty() && batch.guards.is_empty() {
            return Ok(Vec::new());
        }
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)?;
        let seqs = {
            let mut w = apply::Writer::new(&tx, self.replay_rule, &mut self.arena);
            let seqs = w.apply(batch)?;
            w.finish()?;
            seqs
        };
        tx.commit()?;
        Ok(seqs.into_iter().map(|p| p.seq).collect())
    }

    /// A WAL checkpoint: copies committed WAL frames into the main file, then syncs it (with
    /// `synchronous=NORMAL`, the only sync of a WAL database). Returns the WAL's size in frames
    /// and how many of them are now in the main file. Meant for a connection of its own on a
    /// thread of its own, beside a writer opened with `auto_checkpoint(false)`.
    ///
    /// [`CheckpointMode::Passive`] never waits for (or blocks) the writer or readers.
    /// [`CheckpointMode::Restart`] also makes the next commit write the WAL from its start (so
    /// the file stops growing); it waits for the writer and readers up to this connection's busy
    /// timeout, and reports `busy` if it could not finish. [`CheckpointMode::RestartNoWait`] is
    /// the same without any waiting: if another connection is reading or checkpointing, it
    /// reports `busy` at once (for a writer that must not stall). The truncating modes also cut
    /// the `-wal` file to zero bytes.
    pub fn checkpoint(&self, mode: CheckpointMode) -> Result<Checkpoint, SqliteError> {
        if matches!(
            mode,
            CheckpointMode::RestartNoWait | CheckpointMode::TruncateNoWait
        ) {
            self.conn.busy_timeout(std::time::Duration::ZERO)?;
            let r = checkpointer::checkpoint_on(&self.conn, mode);
            self.conn.busy_timeout(self.busy_timeout)?;
            return r;
        }
        checkpointer::checkpoint_on(&self.conn, mode)
    }

    /// The file's page size in bytes (a WAL frame holds one page).
    pub fn page_size(&self) -> Result<u64, SqliteError> {
        let n: i64 = self
            .conn
            .pragma_query_value(None, "page_size", |r| r.get(0))?;
        crate::error::to_u64("page size", n)
    }

    /// The most this connection's page cache holds, in KiB, as SQLite has it in effect
    /// (`PRAGMA cache_size`; see [`OpenOptions::cache_kib`]).
    pub fn cache_kib(&self) -> Result<u64, SqliteError> {
        let n: i64 = self
            .conn
            .pragma_query_value(None, "cache_size", |r| r.get(0))?;
        if n >= 0 {
            // A size in pages.
            return crate::error::to_u64(
                "cache size",
                n.saturating_mul(self.page_size()? as i64) / 1024,
            );
        }
        crate::error::to_u64("cache size", n.saturating_neg())
    }

    /// `PRAGMA integrity_check`: the problems found (empty when the file is sound).
    pub fn integrity_check(&self) -> Result<Vec<String>, SqliteError> {
        let mut stmt = self.conn.prepare("PRAGMA integrity_check")?;
        let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
        let mut out = Vec::new();
        for r in rows {
            let r = r?;
            if r != "ok" {
                out.push(r);
            }
        }
        Ok(out)
    }
}

/// How [`SqliteStore::checkpoint`] goes about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointMode {
    /// Copy what can be copied without waiting for anyone.
    Passive,
    /// Copy everything and make the next writer start the WAL over (bounded by the busy timeout).
    Restart,
    /// [`CheckpointMode::Restart`], but give up at once rather than wait for anyone.
    RestartNoWait,
    /// [`CheckpointMode::Restart`], then truncate the `-wal` file to zero bytes
    /// (`wal_checkpoint(TRUNCATE)`).
    Truncate,
    /// [`CheckpointMode::Truncate`], but give up at once rather than wait for anyone.
    TruncateNoWait,
}

/// What one [`SqliteStore::checkpoint`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checkpoint {
    /// Another checkpoint was running; this one did nothing.
    pub busy: bool,
    /// Frames in the WAL.
    pub wal_frames: u64,
    /// Frames of the WAL now in the main file.
    pub checkpointed_frames: u64,
}

impl Store for SqliteStore {
    type Error = SqliteError;

    fn apply(&mut self, batch: &PersistBatch) -> Result<Vec<u64>, SqliteError> {
        self.apply_one(batch)
    }

    fn load_tree(&self, root: &str) -> Result<Option<TreeSnapshot>, SqliteError> {
        let mut trees = self.load_trees_of(&[root])?;
        Ok(trees.pop())
    }

    fn load_live_trees(&self) -> Result<Vec<TreeSnapshot>, SqliteError> {
        self.live_trees()
    }

    fn session(&self, id: &str) -> Result<Option<Session>, SqliteError> {
        self.read_session(id)
    }

    fn turn(&self, id: &str) -> Result<Option<Turn>, SqliteError> {
        self.read_turn(id)
    }

    fn session_detail(&self, id: &str) -> Result<Option<SessionDetail>, SqliteError> {
        self.read_session_detail(id)
    }

    fn messages(
        &self,
        session: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Message>, SqliteError> {
        self.read_messages(session, after, limit)
    }

    fn interaction(&self, turn: &str, request: &str) -> Result<Option<Interaction>, SqliteError> {
        self.read_interaction(turn, request)
    }

    fn cancel_operation(&self, id: &str) -> Result<Option<CancelOperation>, SqliteError> {
        self.read_cancel_operation(id)
    }

    fn outbox_after(&self, after: u64, limit: usize) -> Result<Vec<OutboxRow>, SqliteError> {
        self.read_outbox_after(after, limit)
    }
}
