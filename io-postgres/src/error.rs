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
    /// The server, the connection or a statement failed.
    #[error("postgres: {0}")]
    Postgres(#[from] postgres::Error),
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
        matches!(self, PgError::GuardFailed(_))
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
