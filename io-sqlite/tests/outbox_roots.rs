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
use tutti_sqlite::schema::{self, APPLICATION_ID, SCHEMA_VERSION};
use tutti_sqlite::SqliteStore;

fn feed(db: &mut SqliteStore, engine: &mut Engine, now: i64, input: serde_json::Value) {
    let input: Input = serde_json::from_value(input).expect("input");
    let step = engine.handle(now, &input).expect("accepted");
    db.apply(&step.persist).expect("commit");
}

/// Creates roots `R{from}`.. until the outbox's last seq is at least `upto`, in groups.
fn create_roots_until(db: &mut SqliteStore, engine: &mut Engine, from: &mut usize, upto: u64) {
    while db.last_outbox_seq().expect("last seq") < upto {
        let mut steps = Vec::new();
        for _ in 0..64 {
            let input: Input = serde_json::from_value(json!({"type":"createSession",
                "agentSessionId": format!("R{from}"), "workspaceId":"W","provider":"test"}))
            .expect("input");
            steps.push(engine.handle(*from as i64, &input).expect("accepted"));
            *from += 1;
        }
        db.apply_many(steps.iter().map(|s| &s.persist))
            .expect("group");
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
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut engine = Engine::new();
    let mut next = 0;
    create_roots_until(&mut db, &mut engine, &mut next, LAG / 2);
    assert_eq!(
        checked(&path),
        (0, 0),
        "fewer than LAG rows wait: no entry yet"
    );
    create_roots_until(&mut db, &mut engine, &mut next, LAG);
    let last = db.last_outbox_seq().expect("last") as i64;
    let (mark, entries) = checked(&path);
    assert!(
        mark >= LAG as i64 && mark <= last,
        "mark {mark}, last {last}"
    );
    assert_eq!(entries, mark, "one entry per row up to the mark");
    // Another LAG rows move the mark again.
    create_roots_until(&mut db, &mut engine, &mut next, mark as u64 + LAG);
    let (later, _) = checked(&path);
    assert!(later >= mark + LAG as i64, "mark {mark} then {later}");
}

#[test]
fn a_deletion_redacts_the_trees_rows_on_both_sides_of_the_mark() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut engine = Engine::new();
    let mut next = 0;
    feed(
        &mut db,
        &mut engine,
        0,
        json!({"type":"createSession",
        "agentSessionId": "D", "workspaceId":"W","provider":"test"}),
    );
    feed(
        &mut db,
        &mut engine,
        1,
        json!({"type": "sessionMetadataUpdated",
        "agentSessionId": "D", "title": "secret-before-the-mark"}),
    );
    create_roots_until(&mut db, &mut engine, &mut next, LAG + 10);
    let (mark, _) = checked(&path);
    assert!(mark > 2, "D's first rows are below the mark ({mark})");
    feed(
        &mut db,
        &mut engine,
        2,
        json!({"type": "sessionMetadataUpdated",
        "agentSessionId": "D", "title": "secret-after-the-mark"}),
    );
    let last = db.last_outbox_seq().expect("last") as i64;
    assert!(last > mark, "D's last row is above the mark");
    feed(
        &mut db,
        &mut engine,
        3,
        json!({"type": "deleteSession", "agentSessionId": "D"}),
    );
    let rows = db.outbox_after(0, usize::MAX).expect("read");
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
    checked(&path);
}

#[test]
fn pruning_takes_the_entries_of_the_rows_it_deletes_and_retention_removes_the_tombstone() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut engine = Engine::new();
    let mut next = 0;
    feed(
        &mut db,
        &mut engine,
        0,
        json!({"type":"createSession",
        "agentSessionId": "D", "workspaceId":"W","provider":"test"}),
    );
    create_roots_until(&mut db, &mut engine, &mut next, 2 * LAG);
    feed(
        &mut db,
        &mut engine,
        1,
        json!({"type": "deleteSession", "agentSessionId": "D"}),
    );
    let (_, before) = checked(&path);
    // Keep the newest 100 rows: D's rows (its creation, and the deletion's at the end) are
    // split; the tombstone stays while its deletion's row is kept.
    let keep = RetentionPolicy {
        keep_rows: Some(100),
        max_age_ms: None,
    };
    while db.prune_outbox(&keep, 0, None, 1000).expect("prune").more {}
    let (_, after) = checked(&path);
    assert!(after < before, "entries {before} -> {after}");
    assert!(
        db.root_of("D").expect("read").is_some(),
        "the tombstone stays while D has rows"
    );
    // Keep nothing: D's last rows go, and with them its tombstone.
    let none = RetentionPolicy {
        keep_rows: Some(0),
        max_age_ms: None,
    };
    while db
        .prune_outbox(&none, 0, None, 100_000)
        .expect("prune")
        .more
    {}
    db.prune_outbox(&none, 0, None, 100_000).expect("prune");
    assert_eq!(checked(&path).1, 0, "no entry outlives its row");
    assert_eq!(
        db.root_of("D").expect("read"),
        None,
        "the deleted tree is gone"
    );
    // The acknowledged rows' way of pruning takes entries too.
    let upto = db.last_outbox_seq().expect("last") + LAG;
    create_roots_until(&mut db, &mut engine, &mut next, upto);
    let last = db.last_outbox_seq().expect("last");
    db.ack("c", last).expect("ack");
    db.prune_acked().expect("prune acked");
    assert_eq!(checked(&path).1, 0, "no entry outlives its row");
}

#[test]
fn a_version_4_file_gets_its_entries_from_the_old_index() {
    let (_dir, path) = support::temp_db();
    {
        let c = Connection::open(&path).expect("raw create");
        for v in 0..4 {
            c.execute_batch(schema::migration(v).expect("old ddl"))
                .expect("old schema");
        }
        for (seq, root) in [(1, "R0"), (2, "R1"), (3, "R0")] {
            c.execute(
                "INSERT INTO outbox (seq, kind, root_agent_session_id, workspace_id, payload) \
                 VALUES (?1, 'session', ?2, 'W', '{}')",
                rusqlite::params![seq, root],
            )
            .expect("v4 outbox row");
        }
        c.pragma_update(None, "application_id", APPLICATION_ID)
            .expect("app id");
        c.pragma_update(None, "user_version", 4).expect("version");
    }
    let db = SqliteStore::open(&path).expect("open migrates");
    drop(db);
    let raw = Connection::open(&path).expect("raw");
    let v: i64 = raw
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .expect("user_version");
    assert_eq!((v, SCHEMA_VERSION), (5, 5));
    let index: i64 = raw
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE name = 'outbox_by_root'",
            [],
            |r| r.get(0),
        )
        .expect("index");
    assert_eq!(index, 0, "the index is dropped");
    let by_root: i64 = raw
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE name = 'outbox_roots_by_root'",
            [],
            |r| r.get(0),
        )
        .expect("index");
    assert_eq!(by_root, 1, "the entries' index by root");
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
