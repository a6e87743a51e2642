//! # tutti-postgres
//!
//! The durable store of tutti on PostgreSQL, for several daemons sharing one database (issue 21:
//! "a PostgreSQL store ... the same rows, guards checked inside the transaction, the whole batch
//! or nothing, idempotent replay of a committed batch, a gap-free outbox sequence that every
//! daemon shares, group commit, schema migrations with a version table").
//!
//! [`PostgresStore`] implements [`Store`] and [`HostStore`](tutti_core::store::HostStore) with the semantics of the reference
//! [`MemoryStore`](tutti_core::store::MemoryStore) and of `tutti_sqlite::SqliteStore` (its
//! `ReplayRule::SameRowAtNext`), and passes the store conformance suite
//! (`tutti_tests::conformance`) unchanged:
//!
//! - [`Store::apply`] commits one [`PersistBatch`] as one transaction; [`HostStore::apply_group`](tutti_core::store::HostStore::apply_group)
//!   commits several in one transaction (group commit: one commit, one WAL flush). Every guard is
//!   checked inside the transaction; a failing guard rolls everything back
//!   ([`PgError::GuardFailed`], [`tutti_core::store::GroupError::Batch`] naming the batch).
//! - A replay of a committed batch passes and writes nothing: a version guard passes when the
//!   stored row is at the batch's `next` version and equals the batch's row.
//! - The outbox seq is gap-free and shared by every writer: one counter row, locked by the
//!   transaction that publishes (see [`schema`]), so seqs commit in order.
//! - Migrations are recorded in `tutti_schema_version`; a database of a newer schema is refused
//!   ([`PgError::TooNew`]).
//!
//! ## Why the synchronous `postgres` crate
//!
//! The engine runs on one blocking thread in the daemon (and in plain loops in tools and tests),
//! and the [`Store`] trait is synchronous: the store is called between engine steps and nothing
//! else happens on that thread meanwhile. The `postgres` crate is `tokio-postgres` driven on a
//! private runtime behind a blocking API, which is exactly that shape; `tokio-postgres` would
//! need `block_on` around every call for the same result. A host that wants pipelining can
//! still use `apply_group`, which sends a whole group in one transaction.
//!
//! Reads take `&self` (as the trait wants) while a `postgres::Client` needs `&mut`: the client is
//! kept in a `RefCell`, so a `PostgresStore` is `Send` but not `Sync` (one per thread, like
//! `SqliteStore`'s connection).
//!
//! ```no_run
//! use tutti_core::store::Store;
//! use tutti_postgres::PostgresStore;
//! let store = PostgresStore::connect("postgres://tutti@127.0.0.1:5432/tutti")?;
//! let live = store.load_live_trees()?;
//! # let _ = live;
//! # Ok::<(), tutti_postgres::PgError>(())
//! ```

#![warn(missing_docs)]

mod apply;
pub mod cluster;
mod codec;
pub mod conn;
mod error;
mod host;
pub mod lease;
pub mod notify;
mod read;
pub mod schema;

pub use conn::Health;
pub use error::PgError;
pub use lease::{Claim, Lease};
pub use notify::{OutboxListener, Wake};

use conn::Conn;
use postgres::{Client, Statement};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;
use tutti_core::model::{CancelOperation, Id, Interaction, Message, Session, Turn};
use tutti_core::projection::SessionDetail;
use tutti_core::step::PersistBatch;
use tutti_core::store::{OutboxRow, Published, Store};
use tutti_core::TreeSnapshot;

// The daemon runs on any `S: HostStore + Send + 'static` (its engine thread owns the store).
const _: fn() = || {
    fn send<T: Send + 'static>() {}
    send::<PostgresStore>();
};

/// Prepared statements of one connection, by their text.
pub(crate) type Cache = HashMap<&'static str, Statement>;

/// A tutti database on a PostgreSQL server: one connection. Open one per writer; any number of
/// writers (in one process or in several daemons) may share the database.
pub struct PostgresStore {
    /// The connection, replaced when it breaks (see [`conn`]).
    conn: RefCell<Conn>,
    /// This handle's name in `commit_marks` (random, made by the server at the first
    /// connect): how an unknown commit outcome is read back (see [`PostgresStore::commit_outcome`]).
    writer: String,
    /// The mark of this handle's last commit known to be committed.
    commits: u64,
    /// Whether a read transaction opened by [`PostgresStore::read_consistent`] is open.
    in_read: Cell<bool>,
    /// Trees fenced on this handle, with the lease epoch their batches must find.
    fences: HashMap<Id, u64>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore").finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Connects (`postgres://user@host:port/db`, or the `key=value` form) and migrates the
    /// database to [`schema::SCHEMA_VERSION`].
    pub fn connect(url: &str) -> Result<PostgresStore, PgError> {
        PostgresStore::connect_with(url, Health::new())
    }

    /// [`PostgresStore::connect`], reporting reachability to `health` (shared with the other
    /// connections of a daemon). Only this first connect fails for an unreachable database;
    /// later, a broken connection is replaced on the next use (see [`conn`]).
    pub fn connect_with(url: &str, health: Arc<Health>) -> Result<PostgresStore, PgError> {
        let mut conn = Conn::open(conn::config(url)?, health)?;
        let writer = {
            let (client, _) = conn.parts()?;
            // Migrations may wait for another daemon's (advisory lock): no statement limits.
            client.batch_execute("SET lock_timeout = 0; SET statement_timeout = 0")?;
            schema::migrate(client)?;
            client.batch_execute(&conn::limits_sql())?;
            client
                .query_one("SELECT gen_random_uuid()::text", &[])?
                .get(0)
        };
        Ok(PostgresStore {
            conn: RefCell::new(conn),
            writer,
            commits: 0,
            in_read: Cell::new(false),
            fences: HashMap::new(),
        })
    }

    /// The reachability this store reports to (see [`PostgresStore::connect_with`]).
    pub fn health(&self) -> Arc<Health> {
        self.conn.borrow().health().clone()
    }

    /// How many times this handle's connection broke and was replaced by a working one (the
    /// daemon re-checks its leases after each, see `tutti_tokio::postgres`).
    pub fn reconnects(&self) -> u64 {
        self.conn.borrow().reconnects()
    }

    /// The process id of the server backend serving this handle now (`None` while
    /// disconnected): for operators and tests (`pg_terminate_backend`).
    pub fn backend_pid(&self) -> Option<i32> {
        self.conn.borrow().backend().map(|b| b.0)
    }

    /// Runs `f` on the working connection (reconnecting first when it broke, backoff
    /// permitting). `f` runs again once, on a new connection, when the connection was lost
    /// under it: every caller's `f` is one statement or one transaction, which either
    /// committed (and is idempotent: running it again changes nothing) or left nothing.
    pub(crate) fn with_client<T>(
        &self,
        mut f: impl FnMut(&mut Client, &mut Cache) -> Result<T, PgError>,
    ) -> Result<T, PgError> {
        let mut conn = self.conn.borrow_mut();
        let mut tries = 0;
        loop {
            tries += 1;
            let r = match conn.parts() {
                Ok((c, cache)) => f(c, cache),
                Err(e) => Err(e),
            };
            match &r {
                Ok(_) => conn.saw_ok(),
                Err(e) => conn.saw_err(e),
            }
            match r {
                Err(PgError::Unavailable { lost: true, .. }) if tries < 2 => continue,
                r => return r,
            }
        }
    }

    /// [`PostgresStore::backend_pid`] as a shared value kept current across reconnects (0
    /// while disconnected). The notifications of this handle's commits carry it (see
    /// [`OutboxListener::skipping`]).
    pub fn backend_pid_watch(&self) -> Arc<std::sync::atomic::AtomicI32> {
        self.conn.borrow().backend_pid()
    }

    /// The name of the database this store is connected to.
    pub fn database_name(&self) -> Result<String, PgError> {
        self.with_client(|c, _| Ok(c.query_one("SELECT current_database()::text", &[])?.get(0)))
    }

    /// Whether `url` names a PostgreSQL database (`postgres://` or `postgresql://`).
    pub fn is_url(url: &str) -> bool {
        url.starts_with("postgres://") || url.starts_with("postgresql://")
    }

    /// Group commit: applies `batches` in order in one transaction. All or nothing: on an error
    /// the transaction is rolled back; `Err((Some(index), e))` names the failing batch.
    ///
    /// Issue 34: a transaction that failed before its `COMMIT` because the connection broke
    /// left nothing and runs again on a new connection (at most three attempts). When the
    /// connection breaks after `COMMIT` was sent, the outcome is read back
    /// ([`PostgresStore::read_back_commit`]): committed, the results stand; not committed, the
    /// transaction runs again; still unknown after [`conn::RESOLVE_WAIT`],
    /// [`PgError::OutcomeUnknown`] (never a guess).
    pub(crate) fn group(
        &mut self,
        batches: &[&PersistBatch],
        capture: bool,
    ) -> Result<Vec<Vec<Published>>, (Option<usize>, PgError)> {
        self.group_decided(batches, &[], capture)
    }

    /// `PostgresStore::group` with the lease epoch each batch was decided under (issue 34,
    /// per-batch fencing): batch `i` of a fenced tree commits only while the stored lease epoch
    /// is `decided[i]`, not the epoch this handle holds at commit time, so a batch decided under
    /// a lease that was lost since is refused ([`PgError::Fenced`]) even when this handle has
    /// re-claimed the tree (a new epoch) meanwhile. A batch without an entry (`decided` shorter
    /// than `batches`, or `None`) is fenced by the handle's current epoch of its tree, as
    /// `PostgresStore::group` does. Choice: an epoch given for a tree this handle does not
    /// fence is still checked (the caller says it decided under a lease).
    pub fn group_decided(
        &mut self,
        batches: &[&PersistBatch],
        decided: &[Option<u64>],
        capture: bool,
    ) -> Result<Vec<Vec<Published>>, (Option<usize>, PgError)> {
        if batches
            .iter()
            .all(|b| b.rows.is_empty() && b.guards.is_empty())
        {
            return Ok(vec![Vec::new(); batches.len()]);
        }
        let mut tries = 0;
        loop {
            tries += 1;
            let mark = self.commits + 1;
            let conn = self.conn.get_mut();
            match transact(
                conn,
                &self.fences,
                &self.writer,
                mark,
                batches,
                decided,
                capture,
            ) {
                Ok(out) => {
                    conn.saw_ok();
                    self.commits = mark;
                    return Ok(out);
                }
                Err(Attempt::Failed(index, e)) => {
                    conn.saw_err(&e);
                    if matches!(e, PgError::Unavailable { lost: true, .. }) && tries < 3 {
                        continue;
                    }
                    return Err((index, e));
                }
                Err(Attempt::AfterCommit(out, e)) => {
                    let old = conn.backend().cloned();
                    conn.drop_connection();
                    match self.resolve_commit(mark, old) {
                        Ok(true) => {
                            self.commits = mark;
                            return Ok(out);
                        }
                        Ok(false) if tries < 3 => continue,
                        Ok(false) => return Err((None, e)),
                        Err(unknown) => {
                            // The mark may be stored: the next commit uses a higher one.
                            self.commits = mark;
                            return Err((None, unknown));
                        }
                    }
                }
            }
        }
    }

    /// The mark of this handle's last commit known to be committed (see
    /// [`PostgresStore::read_back_commit`]).
    pub fn last_commit_mark(&self) -> u64 {
        self.commits
    }

    /// Whether this handle's commit with `mark` committed, read back from the database (issue
    /// 34: "a commit whose outcome is unknown ... is resolved by reading back, never
    /// guessed"). Every group transaction stores its handle's mark (one row per handle in
    /// `commit_marks`, schema version 4) inside itself, so the mark is stored if and only if the
    /// transaction committed. Reconnects first when needed (backoff permitting).
    pub fn read_back_commit(&mut self, mark: u64) -> Result<bool, PgError> {
        let writer = self.writer.clone();
        self.with_client(|c, _| read_mark(c, &writer, mark))
    }

    /// Resolves an unknown outcome: on a new connection, ends the backend that ran the
    /// transaction (`old`: a partitioned backend may still be alive and commit later) and waits
    /// until it is gone, then reads the mark back. Keeps trying for [`conn::RESOLVE_WAIT`].
    fn resolve_commit(&mut self, mark: u64, old: Option<conn::Backend>) -> Result<bool, PgError> {
        let deadline = std::time::Instant::now() + conn::RESOLVE_WAIT;
        loop {
            let conn = self.conn.get_mut();
            let r = match conn.parts() {
                Ok((c, _)) => read_back(c, &self.writer, mark, old.as_ref(), deadline),
                Err(e) => Err(e),
            };
            match r {
                Ok(v) => {
                    conn.saw_ok();
                    return Ok(v);
                }
                Err(e) if e.is_unavailable() => {
                    conn.saw_err(&e);
                    let now = std::time::Instant::now();
                    if now >= deadline {
                        return Err(PgError::OutcomeUnknown(e.to_string()));
                    }
                    let wait = conn
                        .retry_at()
                        .map_or(conn::BACKOFF_MIN, |at| at.saturating_duration_since(now))
                        .max(std::time::Duration::from_millis(10))
                        .min(deadline - now);
                    std::thread::sleep(wait);
                }
                Err(e) => return Err(PgError::OutcomeUnknown(e.to_string())),
            }
        }
    }
}

/// How one attempt of a group transaction failed.
enum Attempt {
    /// Before `COMMIT` was sent (nothing written); the failing batch when one failed.
    Failed(Option<usize>, PgError),
    /// The connection broke after `COMMIT` was sent: the outcome is unknown. The results the
    /// transaction decided, valid if it committed.
    AfterCommit(Vec<Vec<Published>>, PgError),
}

/// One attempt of a group transaction (see [`PostgresStore::group`]).
fn transact(
    conn: &mut Conn,
    fences: &HashMap<Id, u64>,
    writer: &str,
    mark: u64,
    batches: &[&PersistBatch],
    decided: &[Option<u64>],
    capture: bool,
) -> Result<Vec<Vec<Published>>, Attempt> {
    let (client, cache) = conn.parts().map_err(|e| Attempt::Failed(None, e))?;
    let mut tx = client
        .transaction()
        .map_err(|e| Attempt::Failed(None, e.into()))?;
    let mut out = Vec::with_capacity(batches.len());
    {
        let mut w = apply::Writer::new(&mut tx, cache, capture);
        let fenced: Vec<(usize, &Id, u64)> = batches
            .iter()
            .enumerate()
            .filter_map(|(index, b)| {
                b.root_agent_session_id.as_ref().and_then(|r| {
                    decided
                        .get(index)
                        .copied()
                        .flatten()
                        .or_else(|| fences.get(r).copied())
                        .map(|e| (index, r, e))
                })
            })
            .collect();
        // Every fence of the group in one round trip, before any batch is applied; the
        // first batch whose fence does not hold fails the transaction (as it would have when
        // checked just before it: nothing of the group commits either way).
        w.check_fences(&fenced)
            .map_err(|(index, e)| Attempt::Failed(Some(index), e))?;
        for (index, b) in batches.iter().enumerate() {
            out.push(w.apply(b).map_err(|e| Attempt::Failed(Some(index), e))?);
        }
        w.finish(writer, mark)
            .map_err(|e| Attempt::Failed(None, e))?;
    }
    match tx.commit() {
        Ok(()) => Ok(out),
        Err(e) if error::is_connection_lost(&e) => Err(Attempt::AfterCommit(out, e.into())),
        Err(e) => Err(Attempt::Failed(None, e.into())),
    }
}

/// Whether `writer`'s stored mark is at least `mark`.
fn read_mark(c: &mut Client, writer: &str, mark: u64) -> Result<bool, PgError> {
    let stored: Option<i64> = c
        .query_opt("SELECT n FROM commit_marks WHERE writer = $1", &[&writer])?
        .map(|r| r.get(0));
    Ok(stored.is_some_and(|n| u64::try_from(n).is_ok_and(|n| n >= mark)))
}

/// [`read_mark`] once the backend `old` is gone (terminated here; see
/// [`PostgresStore::resolve_commit`]).
fn read_back(
    c: &mut Client,
    writer: &str,
    mark: u64,
    old: Option<&conn::Backend>,
    deadline: std::time::Instant,
) -> Result<bool, PgError> {
    if let Some((pid, start)) = old {
        // Refused when not permitted (another role's backend): then it is waited for (its
        // idle-in-transaction timeout ends it).
        let _ = c.query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity              WHERE pid = $1 AND backend_start::text = $2",
            &[pid, start],
        );
        loop {
            let alive: bool = c
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity                      WHERE pid = $1 AND backend_start::text = $2)",
                    &[pid, start],
                )?
                .get(0);
            if !alive {
                break;
            }
            if std::time::Instant::now() >= deadline {
                return Err(PgError::Unavailable {
                    reason: "the backend of the interrupted commit is still running".into(),
                    lost: false,
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    read_mark(c, writer, mark)
}

impl Store for PostgresStore {
    type Error = PgError;

    fn apply(&mut self, batch: &PersistBatch) -> Result<Vec<u64>, PgError> {
        match self.group(&[batch], false) {
            Ok(mut p) => Ok(p
                .pop()
                .unwrap_or_default()
                .into_iter()
                .map(|p| p.seq)
                .collect()),
            Err((_, e)) => Err(e),
        }
    }

    fn load_tree(&self, root: &str) -> Result<Option<TreeSnapshot>, PgError> {
        self.read_consistent(|s| s.tree(root))?
    }

    fn load_live_trees(&self) -> Result<Vec<TreeSnapshot>, PgError> {
        self.read_consistent(|s| s.live_trees())?
    }

    fn session(&self, id: &str) -> Result<Option<Session>, PgError> {
        self.one_json("sessions", read::SESSION, &[&id])
    }

    fn turn(&self, id: &str) -> Result<Option<Turn>, PgError> {
        self.one_json("turns", read::TURN, &[&id])
    }

    fn session_detail(&self, id: &str) -> Result<Option<SessionDetail>, PgError> {
        self.read_consistent(|s| s.detail(id))?
    }

    fn messages(
        &self,
        session: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Message>, PgError> {
        self.read_messages(session, after, limit)
    }

    fn interaction(&self, turn: &str, request: &str) -> Result<Option<Interaction>, PgError> {
        self.one_json("interactions", read::INTERACTION, &[&turn, &request])
    }

    fn cancel_operation(&self, id: &str) -> Result<Option<CancelOperation>, PgError> {
        self.one_json("cancel_operations", read::CANCEL_OPERATION, &[&id])
    }

    fn outbox_after(&self, after: u64, limit: usize) -> Result<Vec<OutboxRow>, PgError> {
        self.read_outbox_after(after, limit)
    }
}
