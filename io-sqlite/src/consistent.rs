//! Consistent reads: several reads in one read transaction see one committed state.

use crate::{SqliteError, SqliteStore};

impl SqliteStore {
    /// Runs `f` inside one read transaction, so every read it makes sees the same committed
    /// state ("restores its complete child-session tree in one durable snapshot"); a commit by
    /// another connection in between is not half-visible.
    /// Nested calls join the outer transaction; if `f` panics, the transaction is rolled back
    /// (nothing stays open on the connection).
    pub fn read_consistent<T>(&self, f: impl FnOnce(&SqliteStore) -> T) -> Result<T, SqliteError> {
        let tx = self.read_tx()?;
        let out = f(self);
        if let Some(tx) = tx {
            tx.commit()?;
        }
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
