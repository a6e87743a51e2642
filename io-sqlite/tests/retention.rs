//! Schema version 3 and outbox retention on a real file: the session `cwd` is durable, old files
//! (version 2) are migrated in place and stay readable, and retention prunes by count and by age,
//! never above the protected position or a durable consumer's acknowledgement, in bounded
//! transactions, without ever reusing a sequence number.

mod support;

use rusqlite::Connection;
use serde_json::{json, Value};
use tutti_core::store::Store;
use tutti_core::{Engine, Input};
use tutti_sqlite::schema::SCHEMA_VERSION;
use tutti_sqlite::{RetentionPolicy, SqliteStore};

/// Commits `n` root session creations (one outbox row each); returns the last seq.
fn create_roots(db: &mut SqliteStore, engine: &mut Engine, from: usize, n: usize) -> u64 {
    for i in from..from + n {
        let input: Input = serde_json::from_value(json!({"type":"createSession",
            "agentSessionId": format!("R{i}"), "workspaceId":"W","provider":"test"}))
        .expect("input");
        let step = engine.handle(i as i64, &input).expect("accepted");
        db.apply(&step.persist).expect("commit");
    }
    db.last_outbox_seq().expect("last seq")
}

fn seqs(db: &SqliteStore) -> Vec<u64> {
    db.outbox_after(0, 1_000_000)
        .expect("read")
        .iter()
        .map(|r| r.seq)
        .collect()
}

const COUNT_5: RetentionPolicy = RetentionPolicy {
    keep_rows: Some(5),
    max_age_ms: None,
};

#[test]
fn retention_by_count_keeps_the_newest_rows_and_never_reuses_numbers() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut engine = Engine::new();
    let last = create_roots(&mut db, &mut engine, 0, 20);
    let o = db.prune_outbox(&COUNT_5, 1_000, None, 100).expect("prune");
    assert_eq!((o.deleted, o.pruned_through, o.more), (15, last - 5, false));
    assert_eq!(seqs(&db), (last - 4..=last).collect::<Vec<_>>());
    assert_eq!(db.outbox_pruned_through().expect("mark"), last - 5);
    // A second pass has nothing to do.
    let o = db.prune_outbox(&COUNT_5, 2_000, None, 100).expect("prune");
    assert_eq!(o.deleted, 0);
    drop(db);
    // Reopened: the mark holds, numbering goes on after the highest ever assigned.
    let mut db = SqliteStore::open(&path).expect("reopen");
    assert_eq!(db.outbox_pruned_through().expect("mark"), last - 5);
    let next = create_roots(&mut db, &mut engine, 20, 1);
    assert_eq!(next, last + 1);
}

#[test]
fn retention_never_prunes_above_the_protected_position_or_a_consumer_ack() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut engine = Engine::new();
    let last = create_roots(&mut db, &mut engine, 0, 20);
    let o = db
        .prune_outbox(&COUNT_5, 1_000, Some(3), 100)
        .expect("prune");
    assert_eq!((o.deleted, o.pruned_through), (3, 3), "a live reader at 3");
    db.ack("mirror", 7).expect("ack");
    let o = db.prune_outbox(&COUNT_5, 2_000, None, 100).expect("prune");
    assert_eq!(o.pruned_through, 7, "a durable consumer at 7");
    db.ack("mirror", last).expect("ack");
    let o = db
        .prune_outbox(&COUNT_5, 3_000, Some(0), 100)
        .expect("prune");
    assert_eq!(o.deleted, 0, "a live reader at 0 protects everything");
    let o = db.prune_outbox(&COUNT_5, 4_000, None, 100).expect("prune");
    assert_eq!(o.pruned_through, last - 5);
}

#[test]
fn retention_by_age_prunes_rows_older_than_the_limit_only() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut engine = Engine::new();
    let policy = RetentionPolicy {
        keep_rows: None,
        max_age_ms: Some(60_000),
    };
    let first = create_roots(&mut db, &mut engine, 0, 10);
    // The pass at t=0 marks rows 1..=first as existing at 0; nothing is older than a minute.
    assert_eq!(
        db.prune_outbox(&policy, 0, None, 100).expect("p").deleted,
        0
    );
    let second = create_roots(&mut db, &mut engine, 10, 10);
    assert_eq!(
        db.prune_outbox(&policy, 30_000, None, 100)
            .expect("p")
            .deleted,
        0
    );
    // At t=60s the rows marked at t=0 are a minute old; the ones marked at 30s are not.
    let o = db.prune_outbox(&policy, 60_000, None, 100).expect("p");
    assert_eq!((o.deleted as u64, o.pruned_through), (first, first));
    assert_eq!(seqs(&db), (first + 1..=second).collect::<Vec<_>>());
    let o = db.prune_outbox(&policy, 90_000, None, 100).expect("p");
    assert_eq!(o.pruned_through, second);
    assert!(seqs(&db).is_empty());
}

#[test]
fn a_retention_pass_deletes_at_most_its_batch_and_says_more_remain() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut engine = Engine::new();
    let last = create_roots(&mut db, &mut engine, 0, 30);
    let o = db.prune_outbox(&COUNT_5, 0, None, 10).expect("prune");
    assert_eq!((o.deleted, o.pruned_through, o.more), (10, 10, true));
    let o = db.prune_outbox(&COUNT_5, 0, None, 10).expect("prune");
    assert_eq!((o.deleted, o.pruned_through, o.more), (10, 20, true));
    let o = db.prune_outbox(&COUNT_5, 0, None, 10).expect("prune");
    assert_eq!(
        (o.deleted as u64, o.pruned_through, o.more),
        (last - 25, last - 5, false)
    );
}

#[test]
fn the_session_cwd_is_durable() {
    let (_dir, path) = support::temp_db();
    {
        let mut db = SqliteStore::open(&path).expect("open");
        assert_eq!(db.session_cwd("R").expect("read"), None);
        db.set_session_cwd("R", "/srv/work tree/ü").expect("write");
    }
    let db = SqliteStore::open(&path).expect("reopen");
    assert_eq!(
        db.session_cwd("R").expect("read").as_deref(),
        Some("/srv/work tree/ü")
    );
}

#[test]
fn a_version_2_file_is_migrated_to_the_current_version_in_place() {
    let (_dir, path) = support::temp_db();
    support::old_version_file(&path, 2, |c| {
        c.execute(
            "INSERT INTO outbox (seq, kind, root_agent_session_id, workspace_id, payload) \
             VALUES (1, 'session', 'R0', 'W', '{\"id\":\"R0\"}')",
            [],
        )
        .expect("v2 outbox row");
    });
    let mut db = SqliteStore::open(&path).expect("open migrates");
    let raw = Connection::open(&path).expect("raw");
    let v: i64 = raw
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .expect("user_version");
    assert_eq!((v, SCHEMA_VERSION), (5, 5));
    // Version 5: the outbox by root (the redaction of a deleted session's rows reads it).
    let entries: i64 = raw
        .query_row(
            "SELECT count(*) FROM outbox_roots WHERE root_agent_session_id = 'R0' \
             AND first_seq = 1 AND last_seq = 1 AND seqs = '1'",
            [],
            |r| r.get(0),
        )
        .expect("outbox_roots");
    assert_eq!(entries, 1, "outbox_roots filled by the migration");
    let rows = db.outbox_after(0, 10).expect("read");
    let payloads: Vec<&Value> = rows.iter().map(|r| &r.payload).collect();
    assert_eq!(payloads, vec![&json!({"id": "R0"})], "old rows kept");
    db.set_session_cwd("R0", "/tmp")
        .expect("the new table exists");
    let o = db
        .prune_outbox(&COUNT_5, 0, None, 10)
        .expect("retention works");
    assert_eq!(o.deleted, 0);
}
