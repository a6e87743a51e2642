//! # tutti-postgres
//!
//! The durable store of tutti on PostgreSQL, for several daemons sharing one database (issue 21:
//! "a PostgreSQL store ... the same rows, guards checked inside the transaction, the whole batch
//! or nothing, idempotent replay of a committed batch, a gap-free outbox sequence that every
//! daemon shares, group commit, schema migrations with a version table").
//!
//! [`PostgresStore`] implements [`Store`] and [`HostStore`] with the semantics of the reference
//! [`MemoryStore`](tutti_core::store::MemoryStore) and of `tutti_sqlite::SqliteStore` (its
//! `ReplayRule::SameRowAtNext`), and passes the store conformance suite
//! (`tutti_tests::conformance`) unchanged:
//!
//! - [`Store::apply`] commits one [`PersistBatch`] as one transaction; [`HostStore::apply_group`]
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
mod error;
mod host;
pub mod lease;
pub mod notify;
mod read;
pub mod schema;

pub use error::PgError;
pub use lease::{Claim, Lease};
pub use notify::{OutboxListener, Wake};

use postgres::{Client, NoTls, Statement};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
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
    client: RefCell<Client>,
    cache: RefCell<Cache>,
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
        let mut client = Client::connect(url, NoTls)?;
        schema::migrate(&mut client)?;
        Ok(PostgresStore {
            client: RefCell::new(client),
            cache: RefCell::new(Cache::new()),
            in_read: Cell::new(false),
            fences: HashMap::new(),
        })
    }

    /// The name of the database this store is connected to.
    pub fn database_name(&self) -> Result<String, PgError> {
        Ok(self
            .client
            .borrow_mut()
            .query_one("SELECT current_database()::text", &[])?
            .get(0))
    }

    /// Whether `url` names a PostgreSQL database (`postgres://` or `postgresql://`).
    pub fn is_url(url: &str) -> bool {
        url.starts_with("postgres://") || url.starts_with("postgresql://")
    }

    /// Group commit: applies `batches` in order in one transaction. All or nothing: on an error
    /// the transaction is rolled back; `Err((Some(index), e))` names the failing batch.
    pub(crate) fn group(
        &mut self,
        batches: &[&PersistBatch],
        capture: bool,
    ) -> Result<Vec<Vec<Published>>, (Option<usize>, PgError)> {
        if batches
            .iter()
            .all(|b| b.rows.is_empty() && b.guards.is_empty())
        {
            return Ok(vec![Vec::new(); batches.len()]);
        }
        let client = self.client.get_mut();
        let cache = self.cache.get_mut();
        let mut tx = client.transaction().map_err(|e| (None, e.into()))?;
        let mut out = Vec::with_capacity(batches.len());
        {
            let mut w = apply::Writer::new(&mut tx, cache, capture);
            for (index, b) in batches.iter().enumerate() {
                let fence = b
                    .root_agent_session_id
                    .as_ref()
                    .and_then(|r| self.fences.get(r).map(|&e| (r, e)));
                if let Some((root, epoch)) = fence {
                    w.check_fence(root, epoch).map_err(|e| (Some(index), e))?;
                }
                out.push(w.apply(b).map_err(|e| (Some(index), e))?);
            }
            w.finish().map_err(|e| (None, e))?;
        }
        tx.commit().map_err(|e| (None, e.into()))?;
        Ok(out)
    }
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
