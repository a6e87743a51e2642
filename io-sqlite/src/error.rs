//! Typed errors of the SQLite store.

use rusqlite::ffi::ErrorCode;
use thiserror::Error;
use tutti_core::step::Guard;

/// Everything that can go wrong opening, writing or reading a tutti database. A failed
/// [`SqliteStore::apply`](crate::SqliteStore) or [`SqliteStore::apply_many`](crate::SqliteStore::apply_many)
/// wrote nothing.
#[derive(Debug, Error)]
pub enum SqliteError {
    /// A guard failed inside the transaction: the batch was decided under a state that no longer
    /// holds ("rejected by persistence"). Nothing of the batch was written; the driver drops the
    /// tree and reloads it.
    #[error("guard failed: {0:?}")]
    GuardFailed(Guard),
    /// One batch of an [`apply_many`](crate::SqliteStore::apply_many) group failed; the whole group
    /// was rolled back (nothing of any batch was written).
    #[error("batch {index} of the group failed ({source}); nothing of the group was written")]
    BatchFailed {
        /// Index of the failing batch in the slice given to `apply_many`.
        index: usize,
        /// Why it failed.
        #[source]
        source: Box<SqliteError>,
    },
    /// The file is not an SQLite database at all (garbage bytes, another file format).
    #[error("not an SQLite database: {detail}")]
    NotADatabase {
        /// What was found.
        detail: String,
    },
    /// The file is an SQLite database but damaged (truncated, malformed pages).
    #[error("database file is corrupt or truncated: {detail}")]
    Corrupt {
        /// What was found.
        detail: String,
    },
    /// The file is an SQLite database of some other application.
    #[error("not a tutti database (application_id {application_id:#x}, {tables} table(s))")]
    NotOurs {
        /// The file's `PRAGMA application_id`.
        application_id: i32,
        /// How many tables it has.
        tables: i64,
    },
    /// The file was written by a newer tutti whose schema this build does not know.
    #[error("database schema version {found} is newer than this build supports ({supported}); upgrade tutti")]
    TooNew {
        /// The file's `PRAGMA user_version`.
        found: i64,
        /// The newest schema version this build knows.
        supported: i64,
    },
    /// The database could not be switched to write-ahead logging.
    #[error("database refused journal_mode=WAL (got {0})")]
    NoWal(String),
    /// A file-system error (creating the file, reading its header).
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A stored row whose JSON does not decode (the file was edited by hand or damaged).
    #[error("stored {table} row {key} does not decode: {source}")]
    BadRow {
        /// Table.
        table: &'static str,
        /// Row key.
        key: String,
        /// Decoder error.
        #[source]
        source: serde_json::Error,
    },
    /// A row that cannot be serialized (never happens for the core's entities).
    #[error("cannot encode a row: {0}")]
    Encode(serde_json::Error),
    /// A number that SQLite's signed 64-bit integers cannot hold.
    #[error("{what} {value} is out of range for the database")]
    OutOfRange {
        /// Which number.
        what: &'static str,
        /// Its value.
        value: u64,
    },
    /// A pagination cursor that this store did not produce.
    #[error("invalid cursor {0:?}")]
    BadCursor(String),
    /// An outbox acknowledgement beyond the last assigned sequence number.
    #[error("consumer {consumer} acknowledged seq {seq}, but the outbox ends at {last}")]
    AckBeyondEnd {
        /// Consumer.
        consumer: String,
        /// Acknowledged seq.
        seq: u64,
        /// Last assigned seq.
        last: u64,
    },
    /// Any other SQLite error (busy past the timeout, disk full, I/O).
    #[error("sqlite: {0}")]
    Sqlite(rusqlite::Error),
}

impl SqliteError {
    /// Whether this is the file being unavailable for now rather than the request being wrong
    /// (issue 34: "a transient `SQLITE_BUSY`/I/O error gets the same typed treatment" as an
    /// unreachable database server): busy past the busy timeout (another process holds the
    /// write lock), a locked table, an I/O error or a full disk. The host answers 503
    /// `unavailable` with `Retry-After`; nothing of the batch was written.
    pub fn is_unavailable(&self) -> bool {
        use rusqlite::ErrorCode;
        match self {
            SqliteError::BatchFailed { source, .. } => source.is_unavailable(),
            SqliteError::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => matches!(
                e.code,
                ErrorCode::DatabaseBusy
                    | ErrorCode::DatabaseLocked
                    | ErrorCode::SystemIoFailure
                    | ErrorCode::DiskFull
            ),
            _ => false,
        }
    }

    /// Whether this is a guard failure (directly or inside a failed group): the batch was decided
    /// under a stale state, so the driver should evict the tree and reload it.
    pub fn is_guard_failure(&self) -> bool {
        match self {
            SqliteError::GuardFailed(_) => true,
            SqliteError::BatchFailed { source, .. } => source.is_guard_failure(),
            _ => false,
        }
    }

    /// The failing guard, if any.
    pub fn guard(&self) -> Option<&Guard> {
        match self {
            SqliteError::GuardFailed(g) => Some(g),
            SqliteError::BatchFailed { source, .. } => source.guard(),
            _ => None,
        }
    }

    /// For a failed `apply_many` group: the index of the batch that failed.
    pub fn failed_batch(&self) -> Option<usize> {
        match self {
            SqliteError::BatchFailed { index, .. } => Some(*index),
            _ => None,
        }
    }
}

impl From<rusqlite::Error> for SqliteError {
    fn from(e: rusqlite::Error) -> Self {
        match e.sqlite_error_code() {
            Some(ErrorCode::NotADatabase) => SqliteError::NotADatabase {
                detail: e.to_string(),
            },
            Some(ErrorCode::DatabaseCorrupt) => SqliteError::Corrupt {
                detail: e.to_string(),
            },
            _ => SqliteError::Sqlite(e),
        }
    }
}

/// Converts a `u64` for SQLite.
pub(crate) fn to_i64(what: &'static str, value: u64) -> Result<i64, SqliteError> {
    i64::try_from(value).map_err(|_| SqliteError::OutOfRange { what, value })
}

/// Converts a stored integer back (negative values are damage).
pub(crate) fn to_u64(what: &'static str, value: i64) -> Result<u64, SqliteError> {
    u64::try_from(value).map_err(|_| SqliteError::Corrupt {
        detail: format!("negative {what} {value}"),
    })
}
