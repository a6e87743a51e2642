//! The store conformance suite ([`tutti_tests::conformance::run`]) against every store: the
//! in-memory reference store and SQLite (a real file in a temporary directory).

use tutti_core::store::MemoryStore;
use tutti_sqlite::SqliteStore;

#[test]
fn memory_store_conforms() {
    tutti_tests::conformance::run(MemoryStore::new, |s| s);
}

#[test]
fn sqlite_store_conforms() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut n = 0;
    tutti_tests::conformance::run(
        || {
            n += 1;
            SqliteStore::open(dir.path().join(format!("conformance-{n}.db"))).expect("open")
        },
        |s| {
            let path = s.path().to_path_buf();
            drop(s);
            SqliteStore::open(path).expect("reopen")
        },
    );
}
