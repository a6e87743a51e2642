//! Consistent reads: several reads in one read transaction see one committed state.

use crate::{SqliteError, SqliteStore};

impl SqliteStore {
    /// Runs `f` inside one read transaction, so every read it makes sees the same committed
    /// state ("restores its complete child-session tree in one durable snapshot"); a commit by
    /// another connection in between is not half-visible.
    pub fn read_consistent<T>(&self, f: impl FnOnce(&SqliteStore) -> T) -> Result<T, SqliteError> {
        self.conn.execute_batch("BEGIN DEFERRED")?;
        let out = f(self);
        self.conn.execute_batch("COMMIT")?;
        Ok(out)
    }

    /// A read transaction, unless one is already open (inside [`SqliteStore::read_consistent`]).
    pub(crate) fn read_tx(&self) -> Result<Option<rusqlite::Transaction<'_>>, SqliteError> {
        if self.conn.is_autocommit() {
            Ok(Some(self.conn.unchecked_transaction()?))
        } else {
            Ok(None)
        }
    }
}
