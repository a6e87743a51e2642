//! The working directory of a root session's provider.
//!
//! Issue 17: "keep the session `cwd` in the database, not only in memory, so it survives
//! restarts". It is written when the API creates the root session (before the session's own
//! commit, so a committed session never lacks it) and read whenever its provider is launched.

use crate::error::SqliteError;
use crate::SqliteStore;
use rusqlite::{params, OptionalExtension};

impl SqliteStore {
    /// Records the working directory of a root session's provider (replacing an earlier one).
    pub fn set_session_cwd(&mut self, root: &str, cwd: &str) -> Result<(), SqliteError> {
        self.conn
            .prepare_cached(
                "INSERT INTO session_cwd (root_agent_session_id, cwd) VALUES (?1, ?2) \
                 ON CONFLICT (root_agent_session_id) DO UPDATE SET cwd = excluded.cwd",
            )?
            .execute(params![root, cwd])?;
        Ok(())
    }

    /// The working directory recorded for a root session's provider, if any.
    pub fn session_cwd(&self, root: &str) -> Result<Option<String>, SqliteError> {
        Ok(self
            .conn
            .prepare_cached("SELECT cwd FROM session_cwd WHERE root_agent_session_id = ?1")?
            .query_row([root], |r| r.get(0))
            .optional()?)
    }
}
