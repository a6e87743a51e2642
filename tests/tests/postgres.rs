//! PostgreSQL: the store conformance suite against a real server (started in a temporary
//! directory by [`tutti_tests::postgres::Server`]), and several writers on one database.

use tutti_postgres::PostgresStore;
use tutti_tests::postgres::Server;

#[test]
fn postgres_store_conforms() {
    let server = Server::fast().expect("postgres server");
    tutti_tests::conformance::run(
        || PostgresStore::connect(&server.create_database().expect("db")).expect("connect"),
        |s| {
            // The URL is not kept by the store: reopen by the database's name.
            let url = current_url(&server, &s);
            drop(s);
            PostgresStore::connect(&url).expect("reconnect")
        },
    );
}

fn current_url(server: &Server, s: &PostgresStore) -> String {
    server.url(&s.database_name().expect("database name"))
}

/// Issue 21: "the scenario files give identical snapshots through it (`tutti replay --db
/// postgres://...`)": every scenario file, replayed by the real CLI into a new PostgreSQL
/// database and into a new SQLite file, prints the same trees read back from each store.
#[test]
fn every_scenario_gives_identical_snapshots_through_postgres_and_sqlite() {
    const TUTTI: &str = env!("CARGO_BIN_EXE_tutti-test");
    let server = Server::fast().expect("postgres server");
    let dir = tempfile::tempdir().expect("dir");
    let scenarios = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut files: Vec<_> = std::fs::read_dir(&scenarios)
        .expect("scenarios")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    assert!(files.len() > 50, "the scenario files are there");
    let replay = |db: &str, file: &std::path::Path| -> serde_json::Value {
        let out = std::process::Command::new(TUTTI)
            .args(["replay", "--db", db])
            .arg(file)
            .output()
            .expect("tutti replay");
        assert!(
            out.status.success(),
            "replay {} --db {db}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("JSON snapshot")
    };
    for (i, file) in files.iter().enumerate() {
        let sqlite = dir.path().join(format!("s{i}.db"));
        let sqlite = replay(sqlite.to_str().expect("utf-8"), file);
        let pg = replay(&server.create_database().expect("db"), file);
        assert!(
            sqlite.as_array().is_some_and(|a| !a.is_empty()),
            "{}: some tree",
            file.display()
        );
        assert_eq!(
            pg,
            sqlite,
            "{}: PostgreSQL and SQLite differ",
            file.display()
        );
    }
}
