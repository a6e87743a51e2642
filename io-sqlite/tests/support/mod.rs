//! Shared test support: the workload generator and the store comparisons live in the
//! `tutti-testkit` crate (test tooling stays out of the library).
#![allow(unused_imports)]

pub use tutti_testkit::{compare, temp_db, workload};

/// Writes a database file at an old schema `version` (the migrations up to it, marked as ours
/// and at that version), with the rows `rows` inserts through the raw connection, as a daemon
/// of that version left it. (Not every test file that includes this module calls it.)
#[allow(dead_code)]
pub fn old_version_file(
    path: &std::path::Path,
    version: u32,
    rows: impl FnOnce(&rusqlite::Connection),
) {
    use tutti_sqlite::schema::{self, APPLICATION_ID};
    let c = rusqlite::Connection::open(path).expect("raw create");
    for v in 0..version as usize {
        c.execute_batch(schema::migration(v).expect("old ddl"))
            .expect("old schema");
    }
    rows(&c);
    c.pragma_update(None, "application_id", APPLICATION_ID)
        .expect("app id");
    c.pragma_update(None, "user_version", version)
        .expect("version");
}
