//! Typed errors of the PostgreSQL store.

use thiserror::Error;
use tutti_core::step::Guard;

/// Everything that can go wrong connecting to, writing or reading a tutti database on
/// PostgreSQL. A failed apply wrote nothing (its transaction was rolled back).
#[derive(Debug, Error)]
pub enum PgError {
    /// A guard failed inside the transaction: the batch was decided under a state that no longer
    /// holds ("rejected by persistence"). Nothing of the batch was written; the driver drops the
    /// tree and reloads it.
    #[error("guard failed: {0:?}")]
    GuardFailed(Guard),
    /// A row of the batch collides with a different stored row at the same key (a message at a
    /// (session, seq) another writer took): the batch was decided under a state that no
    /// longer holds. Nothing of the batch was written; like [`PgError::GuardFailed`], the host
    /// reloads the tree (issue 34: "a row that conflicts with an existing one is never dropped
    /// silently inside a batch that otherwise commits").
    #[error("row conflict in {table}: {key}")]
    RowConflict {
        /// Table.
        table: &'static str,
        /// The row's key (ids and numbers only).
        key: String,
    },
    /// The batch is for a tree this handle fenced at `epoch`, and the stored lease epoch is now
    /// `current` (another daemon took the tree over, or the lease was removed): this handle no
    /// longer owns the tree and must never commit for it again (see [`crate::lease`]). Nothing
    /// was written. Not a guard failure: reloading the tree does not help.
    #[error("fenced: tree {root} is no longer owned at lease epoch {epoch} (now {current:?})")]
    Fenced {
        /// The tree.
        root: String,
        /// The epoch this handle holds.
        epoch: u64,
        /// The stored epoch.
        current: Option<u64>,
    },
    /// A statement failed on a working connection (a constraint, a type, a timeout of this
    /// statement's own lock wait is [`PgError::Unavailable`] instead): retrying the same thing
    /// does not help.
    #[error("postgres: {0}")]
    Postgres(#[source] postgres::Error),
    /// The database cannot be reached or the connection broke (server restarting or shut down,
    /// network, a lock or statement timeout, too many connections): a failure of the store's
    /// infrastructure, not of the request. Nothing was written (a commit whose outcome the
    /// broken connection hid is resolved by reading back, see [`PgError::OutcomeUnknown`]); the
    /// handle reconnects on its next use, with backoff (see [`crate::conn`]). Retry later.
    #[error("database unavailable: {reason}")]
    Unavailable {
        /// What the driver or the server said (no content).
        reason: String,
        /// The connection itself is gone (closed, I/O, shutdown), as opposed to a server that
        /// refused this statement for now on a working connection (a lock or statement
        /// timeout, a serialization failure): a transaction that failed this way before its
        /// `COMMIT` left nothing, and may be retried at once on a new connection.
        lost: bool,
    },
    /// The connection broke after `COMMIT` was sent and the database stayed unreachable long
    /// enough that reading back could not tell whether the transaction committed. The store
    /// never guesses: the caller must treat the outcome as unknown (reload its state from the
    /// store once it is reachable again).
    #[error("database unavailable; the outcome of the last commit is unknown until it is read back: {0}")]
    OutcomeUnknown(String),
    /// The database was migrated by a newer tutti whose schema this build does not know.
    #[error("database schema version {found} is newer than this build supports ({supported}); upgrade tutti")]
    TooNew {
        /// The database's schema version.
        found: i64,
        /// The newest schema version this build knows.
        supported: i64,
    },
    /// A stored row does not decode (someone else wrote it, or it is damaged). The key says which
    /// row; never its content.
    #[error("undecodable row in {table} {key}: {source}")]
    BadRow {
        /// Table.
        table: &'static str,
        /// A content-free hint (the row's key or length).
        key: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// An entity could not be encoded.
    #[error("encoding a row: {0}")]
    Encode(#[source] serde_json::Error),
    /// A number does not fit the column (a version, seq or count beyond `i64`).
    #[error("{what} out of range: {value}")]
    OutOfRange {
        /// Which number.
        what: &'static str,
        /// Its value.
        value: String,
    },
    /// A roots cursor that no call returned.
    #[error("bad roots cursor")]
    BadCursor,
}

impl PgError {
    /// Whether this is a failed guard (the host reloads that tree) rather than a failure of the
    /// store itself.
    pub fn is_guard_failure(&self) -> bool {
        matches!(self, PgError::GuardFailed(_) | PgError::RowConflict { .. })
    }

    /// Whether the database could not be reached, or answered that it cannot serve now
    /// ([`PgError::Unavailable`], [`PgError::OutcomeUnknown`]): retry later, nothing about the
    /// request itself is wrong.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            PgError::Unavailable { .. } | PgError::OutcomeUnknown(_)
        )
    }
}

/// SQLSTATEs that say "the server cannot serve this now" rather than "this statement is wrong":
/// connection exceptions (class 08), insufficient resources (class 53), operator intervention
/// (class 57: shutdown, crash, starting up, statement timeout or cancel), lock not available
/// (55P03, `lock_timeout`), idle-in-transaction timeout (25P03), serialization failure and
/// deadlock (class 40).
fn transient_state(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("53")
        || code.starts_with("57")
        || code.starts_with("40")
        || code == "55P03"
        || code == "25P03"
}

/// SQLSTATEs after which the server closes the connection: connection exceptions, shutdown,
/// crash, starting up, terminated for being idle in a transaction.
fn fatal_state(code: &str) -> bool {
    code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "57P05" | "25P03")
}

/// Whether the connection behind a driver error is gone (see [`PgError::Unavailable`]'s
/// `lost`).
pub(crate) fn is_connection_lost(e: &postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    if let Some(db) = e.as_db_error() {
        return fatal_state(db.code().code());
    }
    is_connection_error(e)
}

/// Whether a driver error is connection-level (the connection is broken or the server cannot
/// serve now) rather than an error of the statement on a working connection.
pub(crate) fn is_connection_error(e: &postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    if let Some(db) = e.as_db_error() {
        return transient_state(db.code().code());
    }
    if std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>()) {
        return true;
    }
    // The driver's kinds for I/O, connecting and timeouts (their text is the driver's own).
    let text = e.to_string();
    text.starts_with("error communicating with the server")
        || text.starts_with("error connecting to server")
        || text.starts_with("timeout waiting for server")
}

impl From<postgres::Error> for PgError {
    fn from(e: postgres::Error) -> PgError {
        if is_connection_error(&e) {
            PgError::Unavailable {
                reason: match e.as_db_error() {
                    Some(db) => format!("{} ({})", db.message(), db.code().code()),
                    None => e.to_string(),
                },
                lost: is_connection_lost(&e),
            }
        } else {
            PgError::Postgres(e)
        }
    }
}

pub(crate) fn to_i64(what: &'static str, v: u64) -> Result<i64, PgError> {
    i64::try_from(v).map_err(|_| PgError::OutOfRange {
        what,
        value: v.to_string(),
    })
}

pub(crate) fn to_u64(what: &'static str, v: i64) -> Result<u64, PgError> {
    u64::try_from(v).map_err(|_| PgError::OutOfRange {
        what,
        value: v.to_string(),
    })
}
