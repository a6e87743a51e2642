//! The cluster secret: how daemons sharing one database prove themselves to each other when one
//! forwards a command to the owner of a tree (issue 21: "A command (submit, cancel, answer,
//! delete) that reaches a daemon which does not own the tree is forwarded to the owner").
//!
//! Choice: one random secret per database, in the one-row table `cluster_secret` (schema
//! version 3). The first daemon that starts on the database stores its candidate; every later
//! one reads the stored value, so all daemons on a database share it without configuration.
//! Keeping it in the database gives nobody anything new: whoever can read the database can
//! already change every tree in it.

use crate::error::PgError;
use crate::PostgresStore;

impl PostgresStore {
    /// The database's cluster secret: `candidate` when none was stored yet (it is stored now),
    /// else the stored one. Concurrent first starts agree (the first insert wins).
    pub fn cluster_secret(&mut self, candidate: &str) -> Result<String, PgError> {
        self.with_client(|c, _| {
            c.execute(
                "INSERT INTO cluster_secret (id, secret) VALUES (1, $1) \
                 ON CONFLICT (id) DO NOTHING",
                &[&candidate],
            )?;
            Ok(
                c.query_one("SELECT secret FROM cluster_secret WHERE id = 1", &[])?
                    .get(0),
            )
        })
    }
}
