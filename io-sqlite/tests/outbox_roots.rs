//! Schema version 5: the outbox by root (`outbox_roots`), kept in arrears, on a real file. Its
//! entries are added once `LAG` rows wait for them; below its mark every outbox row has its
//! entry and every entry names a row; a deletion redacts a tree's kept rows on both sides of the
//! mark; pruning takes the entries of the rows it deletes; retention removes a deleted tree once
//! none of its rows is left; a version 4 file is migrated in place.

mod support;

use rusqlite::Connection;
use serde_json::json;
use std::path::Path;
use tutti_core::store::{RetentionPolicy, Store};

use tutti_core::{Engine, Input};
use tutti_sqlite::outbox_roots::LAG;
use tutti_sqlite::schema::SCHEMA_VERSION;
use tutti_sqlite::SqliteStore;

/// A store on a temp file and the engine that decides its batches.
struct Fixture {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    db: SqliteStore,
    engine: Engine,
    /// The next `R{n}` root to create, and the engine's clock.
    next: usize,
}

impl Fixture {
    fn new() -> Fixture {
        let (dir, path) = support::temp_db();
        let db = SqliteStore::open(&path).expect("open");
        Fixture {
            _dir: dir,
            path,
            db,
            engine: Engine::new(),
            next: 0,
        }
    }

    fn create_root(&mut self, id: &str) {
        self.feed(
            json!({"type":"createSession", "agentSessionId": id, "workspaceId":"W",
            "provider":"test"}),
        );
    }

    fn feed(&mut self, input: serde_json::Value) {
        let input: Input = serde_json::from_value(input).expect("input");
        self.next += 1;
        let step = self
            .engine
            .handle(self.next as i64, &input)
            .expect("accepted");
        self.db.apply(&step.persist).expect("commit");
    }

    /// Creates roots `R{next}`.. until the outbox's last seq is at least `upto`, in groups.
    fn create_roots_until(&mut self, upto: u64) {
        while self.last() < upto {
            let mut steps = Vec::new();
            for _ in 0..64 {
                self.next += 1;
                let input: Input = serde_json::from_value(json!({"type":"createSession",
                    "agentSessionId": format!("R{}", self.next), "workspaceId":"W",
                    "provider":"test"}))
                .expect("input");
                steps.push(
                    self.engine
                        .handle(self.next as i64, &input)
                        .expect("accepted"),
                );
            }
            self.db
                .apply_many(steps.iter().map(|s| &s.persist))
                .expect("group");
        }
    }

    fn last(&self) -> u64 {
        self.db.last_outbox_seq().expect("last seq")
    }

    fn checked(&self) -> (i64, i64) {
        checked(&self.path)
    }
}

/// `(mark, rows listed)`, after checking the invariants: every seq an entry lists at or above
/// the oldest kept row is an outbox row of the entry's root, every entry's last row is kept,
/// and every outbox row at or below the mark is listed.
fn checked(path: &Path) -> (i64, i64) {
    let c = Connection::open(path).expect("raw");
    let mark: i64 = c
        .query_row(
            "SELECT value FROM meta WHERE key = 'outbox_roots_through'",
            [],
            |r| r.get(0),
        )
        .expect("the mark");
    let listed: Vec<(String, i64, i64, i64)> = c
        .prepare(
            "SELECT e.root_agent_session_id, e.first_seq, e.last_seq, j.value \
             FROM outbox_roots AS e, json_each('[' || e.seqs || ']') AS j",
        )
        .expect("prepare")
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("entries");
    let oldest: i64 = c
        .query_row("SELECT coalesce(min(seq), 0) FROM outbox", [], |r| r.get(0))
        .expect("oldest");
    let root_of = |seq: i64| -> Option<String> {
        c.query_row(
            "SELECT root_agent_session_id FROM outbox WHERE seq = ?1",
            [seq],
            |r| r.get(0),
        )
        .ok()
    };
    for (root, first, last, seq) in &listed {
        assert!(
            first <= seq && seq <= last,
            "{seq} outside {first}..={last}"
        );
        assert!(*last <= mark, "an entry above the mark");
        assert_eq!(
            root_of(*last).as_deref(),
            Some(root.as_str()),
            "an entry's last row is kept"
        );
        if *seq >= oldest {
            assert_eq!(
                root_of(*seq).as_deref(),
                Some(root.as_str()),
                "seq {seq} of {root}"
            );
        }
    }
    let missing: i64 = c
        .query_row(
            "SELECT count(*) FROM outbox AS o WHERE o.seq <= ?1 AND NOT EXISTS \
             (SELECT 1 FROM outbox_roots AS e, json_each('[' || e.seqs || ']') AS j \
             WHERE e.root_agent_session_id = o.root_agent_session_id AND j.value = o.seq)",
            [mark],
            |r| r.get(0),
        )
        .expect("missing");
    assert_eq!(
        missing, 0,
        "an outbox row at or below the mark is not listed"
    );
    let kept = listed
        .iter()
        .filter(|(_, _, _, seq)| *seq >= oldest)
        .count();
    (mark, kept as i64)
}

#[test]
fn entries_are_added_in_arrears_and_complete_below_the_mark() {
    let mut f = Fixture::new();
    f.create_roots_until(LAG / 2);
    assert_eq!(
        f.checked(),
        (0, 0),
        "fewer than LAG rows wait: no entry yet"
    );
    f.create_roots_until(LAG);
    let last = f.last() as i64;
    let (mark, entries) = f.checked();
    assert!(
        mark >= LAG as i64 && mark <= last,
        "mark {mark}, last {last}"
    );
    assert_eq!(entries, mark, "one entry per row up to the mark");
    // Another LAG rows move the mark again.
    f.create_roots_until(mark as u64 + LAG);
    let (later, _) = f.checked();
    assert!(later >= mark + LAG as i64, "mark {mark} then {later}");
}

#[test]
fn a_deletion_redacts_the_trees_rows_on_both_sides_of_the_mark() {
    let mut f = Fixture::new();
    f.create_root("D");
    f.feed(
        json!({"type": "sessionMetadataUpdated", "agentSessionId": "D",
        "title": "secret-before-the-mark"}),
    );
    f.create_roots_until(LAG + 10);
    let (mark, _) = f.checked();
    assert!(mark > 2, "D's first rows are below the mark ({mark})");
    f.feed(
        json!({"type": "sessionMetadataUpdated", "agentSessionId": "D",
        "title": "secret-after-the-mark"}),
    );
    assert!(f.last() as i64 > mark, "D's last row is above the mark");
    f.feed(json!({"type": "deleteSession", "agentSessionId": "D"}));
    let rows = f.db.outbox_after(0, usize::MAX).expect("read");
    for secret in ["secret-before-the-mark", "secret-after-the-mark"] {
        assert!(
            !rows.iter().any(|r| r.payload.to_string().contains(secret)),
            "{secret} left in the outbox"
        );
    }
    assert!(
        rows.iter()
            .any(|r| r.kind == "redacted" && r.payload["agentSessionId"] == "D"),
        "D's rows are kept as redacted rows"
    );
    f.checked();
}

#[test]
fn pruning_takes_the_entries_of_the_rows_it_deletes_and_retention_removes_the_tombstone() {
    let mut f = Fixture::new();
    f.create_root("D");
    f.create_roots_until(2 * LAG);
    f.feed(json!({"type": "deleteSession", "agentSessionId": "D"}));
    let (_, before) = f.checked();
    // Keep the newest 100 rows: D's rows (its creation, and the deletion's at the end) are
    // split; the tombstone stays while its deletion's row is kept.
    let prune = |f: &mut Fixture, keep_rows| {
        let policy = RetentionPolicy {
            keep_rows: Some(keep_rows),
            max_age_ms: None,
        };
        while f
            .db
            .prune_outbox(&policy, 0, None, 1000)
            .expect("prune")
            .more
        {}
    };
    prune(&mut f, 100);
    let (_, after) = f.checked();
    assert!(after < before, "entries {before} -> {after}");
    assert!(
        f.db.root_of("D").expect("read").is_some(),
        "the tombstone stays while D has rows"
    );
    // Keep nothing: D's last rows go, and with them (at the next pass) its tombstone.
    prune(&mut f, 0);
    prune(&mut f, 0);
    assert_eq!(f.checked().1, 0, "no entry outlives its row");
    assert_eq!(
        f.db.root_of("D").expect("read"),
        None,
        "the deleted tree is gone"
    );
    // The acknowledged rows' way of pruning takes entries too.
    f.create_roots_until(f.last() + LAG);
    let last = f.last();
    f.db.ack("c", last).expect("ack");
    f.db.prune_acked().expect("prune acked");
    assert_eq!(f.checked().1, 0, "no entry outlives its row");
}

#[test]
fn a_version_4_file_gets_its_entries_from_the_old_index() {
    let (_dir, path) = support::temp_db();
    support::old_version_file(&path, 4, |c| {
        for (seq, root) in [(1, "R0"), (2, "R1"), (3, "R0")] {
            c.execute(
                "INSERT INTO outbox (seq, kind, root_agent_session_id, workspace_id, payload) \
                 VALUES (?1, 'session', ?2, 'W', '{}')",
                rusqlite::params![seq, root],
            )
            .expect("v4 outbox row");
        }
    });
    let db = SqliteStore::open(&path).expect("open migrates");
    drop(db);
    let raw = Connection::open(&path).expect("raw");
    let v: i64 = raw
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .expect("user_version");
    assert_eq!((v, SCHEMA_VERSION), (5, 5));
    let exists = |name: &str| -> bool {
        raw.query_row(
            "SELECT count(*) FROM sqlite_master WHERE name = ?1",
            [name],
            |r| r.get::<_, i64>(0),
        )
        .expect("sqlite_master")
            > 0
    };
    assert!(!exists("outbox_by_root"), "the index is dropped");
    assert!(exists("outbox_roots_by_root"), "the entries' index by root");
    let entries: Vec<(String, i64, i64, String)> = raw
        .prepare(
            "SELECT root_agent_session_id, first_seq, last_seq, seqs FROM outbox_roots ORDER BY 1",
        )
        .expect("prepare")
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .expect("query")
        .collect::<Result<_, _>>()
        .expect("rows");
    let entries: Vec<(&str, i64, i64, Vec<i64>)> = entries
        .iter()
        .map(|(r, f, l, s)| {
            let mut seqs: Vec<i64> = s.split(',').map(|x| x.parse().expect("a seq")).collect();
            seqs.sort();
            (r.as_str(), *f, *l, seqs)
        })
        .collect();
    assert_eq!(entries, [("R0", 1, 3, vec![1, 3]), ("R1", 2, 2, vec![2])]);
    assert_eq!(checked(&path), (3, 3));
}
