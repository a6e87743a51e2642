//! Files that are not (or no longer) good tutti databases give a typed error, never a panic; a
//! new file is created owner-only, in WAL mode, with our application id and schema version.

mod support;

use rusqlite::Connection;
use support::workload::{Mix, Stream};
use tutti_core::store::Store;
use tutti_sqlite::schema::{APPLICATION_ID, SCHEMA_VERSION};
use tutti_sqlite::{OpenOptions, SqliteError, SqliteStore, Synchronous};

/// A database with some real content, cleanly closed (the WAL is merged back and removed).
fn filled(path: &std::path::Path) {
    let mut db = SqliteStore::open(path).expect("create");
    let mut s = Stream::new(3, Mix::ALL);
    for _ in 0..300 {
        db.apply(&s.next_step().persist).expect("apply");
    }
}

#[test]
fn garbage_bytes_are_not_a_database() {
    let (_dir, path) = support::temp_db();
    let mut x = 0x1234_5678_u32;
    let bytes: Vec<u8> = (0..8192)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    std::fs::write(&path, &bytes).expect("write");
    let err = SqliteStore::open(&path).expect_err("garbage");
    assert!(matches!(err, SqliteError::NotADatabase { .. }), "{err}");
    assert_eq!(std::fs::read(&path).expect("read"), bytes, "left untouched");

    std::fs::write(&path, b"hello").expect("write");
    let err = SqliteStore::open(&path).expect_err("short garbage");
    assert!(matches!(err, SqliteError::NotADatabase { .. }), "{err}");
}

#[test]
fn a_truncated_file_is_corrupt() {
    let (_dir, path) = support::temp_db();
    filled(&path);
    let mut wal = path.clone().into_os_string();
    wal.push("-wal");
    assert!(
        std::fs::metadata(&wal).map_or(true, |m| m.len() == 0),
        "clean close merges the WAL"
    );
    let len = std::fs::metadata(&path).expect("stat").len();
    assert!(len > 4 * 4096, "a database of several pages ({len} bytes)");
    for cut in [len / 2, len - 100, 4096] {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("open for truncation");
        f.set_len(cut).expect("truncate");
        drop(f);
        let err = SqliteStore::open(&path).expect_err("truncated");
        assert!(
            matches!(err, SqliteError::Corrupt { .. }),
            "cut at {cut}: {err}"
        );
    }
}

#[test]
fn damaged_pages_give_typed_errors_not_panics() {
    let (_dir, path) = support::temp_db();
    filled(&path);
    let mut bytes = std::fs::read(&path).expect("read");
    for b in bytes.iter_mut().skip(4096).take(3 * 4096) {
        *b = 0xA5;
    }
    std::fs::write(&path, &bytes).expect("write");
    match SqliteStore::open(&path) {
        Err(e) => assert!(
            matches!(
                e,
                SqliteError::Corrupt { .. } | SqliteError::NotADatabase { .. }
            ),
            "{e}"
        ),
        Ok(db) => {
            let problems = db.integrity_check();
            let reads = db.snapshot_all();
            assert!(
                matches!(problems, Ok(ref p) if !p.is_empty())
                    || matches!(problems, Err(SqliteError::Corrupt { .. }))
                    || matches!(reads, Err(SqliteError::Corrupt { .. })),
                "damage must be reported: {problems:?}"
            );
        }
    }
}

#[test]
fn a_newer_schema_is_refused() {
    let (_dir, path) = support::temp_db();
    filled(&path);
    {
        let c = Connection::open(&path).expect("raw open");
        c.pragma_update(None, "user_version", SCHEMA_VERSION + 7)
            .expect("bump");
    }
    let err = SqliteStore::open(&path).expect_err("too new");
    match err {
        SqliteError::TooNew { found, supported } => {
            assert_eq!((found, supported), (SCHEMA_VERSION + 7, SCHEMA_VERSION));
        }
        e => panic!("want TooNew, got {e}"),
    }
}

#[test]
fn someone_elses_sqlite_file_is_refused_and_left_alone() {
    let (_dir, path) = support::temp_db();
    {
        let c = Connection::open(&path).expect("raw create");
        c.pragma_update(None, "application_id", 0x0bad_cafe_i32)
            .expect("app id");
        c.execute_batch("CREATE TABLE notes (body TEXT); INSERT INTO notes VALUES ('hi');")
            .expect("their schema");
    }
    let before = std::fs::read(&path).expect("read");
    let err = SqliteStore::open(&path).expect_err("not ours");
    assert!(
        matches!(
            err,
            SqliteError::NotOurs {
                application_id: 0x0bad_cafe,
                tables: 1
            }
        ),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&path).expect("read"),
        before,
        "not converted, not migrated"
    );

    // Without an application id but with tables of its own: not ours either.
    let (_dir2, path2) = support::temp_db();
    {
        let c = Connection::open(&path2).expect("raw create");
        c.execute_batch("CREATE TABLE t (x)").expect("table");
    }
    let err = SqliteStore::open(&path2).expect_err("not ours");
    assert!(
        matches!(
            err,
            SqliteError::NotOurs {
                application_id: 0,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn paths_that_are_not_files() {
    let dir = tempfile::tempdir().expect("dir");
    let err = SqliteStore::open(dir.path()).expect_err("a directory");
    assert!(matches!(err, SqliteError::NotADatabase { .. }), "{err}");
    let missing = dir.path().join("missing.db");
    let err = SqliteStore::open_with(&missing, &OpenOptions::new().create(false))
        .expect_err("missing without create");
    assert!(matches!(err, SqliteError::Io { .. }), "{err}");
    assert!(!missing.exists());
}

#[test]
fn a_new_file_is_owner_only_wal_and_ours() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open_with(&path, &OpenOptions::new().synchronous(Synchronous::Full))
        .expect("create");
    let mut s = Stream::new(5, Mix::ALL);
    db.apply(&s.next_step().persist).expect("apply");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "database file mode");
        let mut wal = path.clone().into_os_string();
        wal.push("-wal");
        let mode = std::fs::metadata(&wal).expect("wal").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "WAL file mode");
    }
    let c = Connection::open(&path).expect("raw open");
    let mode: String = c
        .pragma_query_value(None, "journal_mode", |r| r.get(0))
        .expect("journal_mode");
    assert_eq!(mode, "wal");
    let app: i32 = c
        .pragma_query_value(None, "application_id", |r| r.get(0))
        .expect("application_id");
    assert_eq!(app, APPLICATION_ID);
    let v: i64 = c
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .expect("user_version");
    assert_eq!(v, SCHEMA_VERSION);
    drop(c);
    drop(db);

    // An empty file (created, never initialized) is a new database.
    let (_dir2, path2) = support::temp_db();
    std::fs::write(&path2, b"").expect("empty");
    let db = SqliteStore::open(&path2).expect("empty file is new");
    assert_eq!(db.load_live_trees().expect("read"), Vec::new());
}

/// Issue 36 item 13 ("durability the operator chooses"): the durability a store was opened with
/// is the one SQLite has in effect on its connection, read back with `PRAGMA synchronous`.
#[test]
fn the_chosen_durability_is_the_synchronous_mode_in_effect() {
    let (_dir, path) = support::temp_db();
    for want in [Synchronous::Full, Synchronous::Normal, Synchronous::Full] {
        let db =
            SqliteStore::open_with(&path, &OpenOptions::new().synchronous(want)).expect("open");
        assert_eq!(db.synchronous().expect("pragma"), Some(want));
    }
}

/// Issue 33: a store's page cache is as large as it was opened with (the default holds the
/// per-session index leaves of many active sessions between group commits), read back from
/// SQLite.
#[test]
fn the_page_cache_size_is_the_one_asked_for() {
    let (_dir, path) = support::temp_db();
    let db = SqliteStore::open(&path).expect("open");
    assert_eq!(
        db.cache_kib().expect("pragma"),
        u64::from(tutti_sqlite::DEFAULT_CACHE_KIB)
    );
    // SQLite's own default, on a plain connection to the same file (negative: KiB).
    let plain = rusqlite::Connection::open(&path).expect("plain");
    let theirs: i64 = plain
        .pragma_query_value(None, "cache_size", |r| r.get(0))
        .expect("pragma");
    assert!(
        theirs < 0 && u64::from(tutti_sqlite::DEFAULT_CACHE_KIB) > theirs.unsigned_abs(),
        "larger than SQLite's own default ({theirs})"
    );
    let db = SqliteStore::open_with(&path, &OpenOptions::new().cache_kib(4096)).expect("open");
    assert_eq!(db.cache_kib().expect("pragma"), 4096);
    let db = SqliteStore::open_with(&path, &OpenOptions::new().cache_kib(1)).expect("open");
    assert_eq!(db.cache_kib().expect("pragma"), 64, "at least 64 KiB");
}
