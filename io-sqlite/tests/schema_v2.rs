//! Schema version 2: a published message's outbox row references the message instead of copying
//! its JSON. Readers of the outbox get every payload; when the message's session is deleted its
//! rows become redacted rows (ids only, issue 36) and no reference dangles; a version 1 file is
//! migrated in place.

mod support;

use rusqlite::Connection;
use serde_json::{json, Value};
use tutti_core::step::{PersistBatch, Row};
use tutti_core::store::Store;
use tutti_core::{Engine, Input};
use tutti_sqlite::schema::{self, SCHEMA_VERSION};
use tutti_sqlite::SqliteStore;

fn input(v: Value) -> Input {
    serde_json::from_value(v).expect("valid input")
}

/// A settled root turn with three messages; returns the batches in order.
fn settled_root_with_messages(engine: &mut Engine) -> Vec<PersistBatch> {
    let inputs = [
        json!({"type":"createSession","agentSessionId":"R","workspaceId":"W","provider":"test"}),
        json!({"type":"submit","agentSessionId":"R","turnId":"T","text":"secret prompt"}),
        json!({"type":"rootProviderTurnStarted","agentSessionId":"R","providerTurnId":"p"}),
        json!({"type":"messageAppended","agentSessionId":"R","turnId":"T","messageId":"m1",
               "role":"assistant","text":"first"}),
        json!({"type":"messageAppended","agentSessionId":"R","turnId":"T","messageId":"m2",
               "role":"assistant","text":"second \"quoted\" ünïcode"}),
        json!({"type":"rootProviderTurnCompleted","agentSessionId":"R","providerTurnId":"p",
               "outcome":"completed"}),
    ];
    inputs
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            engine
                .handle(i as i64 + 1, &input(v))
                .expect("accepted")
                .persist
        })
        .collect()
}

/// (seq, message_rowid, payload) of every outbox row, straight from the file.
fn raw_outbox(path: &std::path::Path) -> Vec<(i64, Option<i64>, String)> {
    let c = Connection::open(path).expect("raw open");
    let mut st = c
        .prepare("SELECT seq, message_rowid, payload FROM outbox ORDER BY seq")
        .expect("prepare");
    let rows = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .expect("query")
        .map(|r| r.expect("row"))
        .collect();
    rows
}

#[test]
fn message_outbox_rows_reference_the_message_and_survive_its_purge() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut engine = Engine::new();
    let batches = settled_root_with_messages(&mut engine);
    db.apply_many(batches.iter()).expect("group commit");

    // What the engine published, in order: each outbox row must read back as this.
    let published: Vec<(&'static str, Value)> = batches
        .iter()
        .flat_map(|b| b.published())
        .map(|r| (r.kind(), r.to_json()))
        .collect();
    let before = db.outbox_after(0, 1000).expect("read");
    let read: Vec<(&str, Value)> = before
        .iter()
        .map(|o| (o.kind.as_str(), o.payload.clone()))
        .collect();
    assert_eq!(read, published);

    // In the file, the message rows (the user's and the two assistant messages) are references.
    let raw = raw_outbox(&path);
    let refs: Vec<_> = raw.iter().filter(|r| r.1.is_some()).collect();
    let messages = published.iter().filter(|p| p.0 == "message").count();
    assert_eq!(messages, 3);
    assert_eq!(
        refs.len(),
        messages,
        "every message outbox row is a reference"
    );
    assert!(refs.iter().all(|r| r.2.is_empty()), "no copied payload");
    assert!(raw
        .iter()
        .filter(|r| r.1.is_none())
        .all(|r| !r.2.is_empty()));

    // Deleting the tree purges the messages; their outbox rows are redacted first.
    let del = engine
        .handle(
            100,
            &input(json!({"type":"deleteSession","agentSessionId":"R"})),
        )
        .expect("delete");
    assert!(del
        .persist
        .rows
        .iter()
        .any(|r| matches!(r, Row::PurgeSession { .. })));
    db.apply(&del.persist).expect("apply delete");
    let c = Connection::open(&path).expect("raw open");
    let left: i64 = c
        .query_row("SELECT count(*) FROM messages", [], |r| r.get(0))
        .expect("count");
    assert_eq!(left, 0, "messages purged");
    let raw = raw_outbox(&path);
    assert!(raw.iter().all(|r| r.1.is_none()), "no reference dangles");
    let after = db.outbox_after(0, 1000).expect("read");
    assert_eq!(
        after.len(),
        before.len() + 1,
        "the same rows and the deletion"
    );
    for (a, b) in after.iter().zip(&before) {
        let owner = match b.kind.as_str() {
            "session" => b.payload["id"].as_str(),
            _ => b.payload["agentSessionId"].as_str(),
        };
        assert_eq!(owner, Some("R"));
        assert_eq!(
            (a.seq, a.kind.as_str(), &a.payload),
            (
                b.seq,
                tutti_core::step::REDACTED,
                &tutti_core::step::redacted_payload("R", &b.kind)
            ),
            "same seq, ids only"
        );
    }
}

#[test]
fn an_outbox_out_of_row_order_copies_payloads_in_its_own_order() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut engine = Engine::new();
    let mut batches = settled_root_with_messages(&mut engine);
    // The submit batch publishes several rows (session, turn, user message): reverse them.
    let submit = &mut batches[1];
    assert!(submit.outbox.len() >= 2);
    submit.outbox.reverse();
    db.apply_many(batches.iter()).expect("group commit");
    let expected: Vec<(&'static str, Value)> = batches
        .iter()
        .flat_map(|b| b.published())
        .map(|r| (r.kind(), r.to_json()))
        .collect();
    let read: Vec<(String, Value)> = db
        .outbox_after(0, 1000)
        .expect("read")
        .into_iter()
        .map(|o| (o.kind, o.payload))
        .collect();
    let read: Vec<(&str, Value)> = read.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    assert_eq!(read, expected);
    // The reversed batch's message row was copied, the later ones referenced.
    let raw = raw_outbox(&path);
    assert_eq!(raw.iter().filter(|r| r.1.is_some()).count(), 2);
}

#[test]
fn a_version_1_file_is_migrated_in_place() {
    let (_dir, path) = support::temp_db();
    support::old_version_file(&path, 1, |c| {
        c.execute(
            "INSERT INTO outbox (seq, kind, root_agent_session_id, workspace_id, payload) \
             VALUES (1, 'message', 'R0', 'W', ?1)",
            [r#"{"agentSessionId":"R0","turnId":"T0","messageId":"old","seq":0,"role":"user","text":"v1","createdAt":1}"#],
        )
        .expect("v1 outbox row");
    });
    let mut db = SqliteStore::open(&path).expect("open migrates");
    let c = Connection::open(&path).expect("raw open");
    let v: i64 = c
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .expect("user_version");
    assert_eq!(v, SCHEMA_VERSION);
    let old = db.outbox_after(0, 10).expect("read");
    assert_eq!(old.len(), 1);
    assert_eq!(old[0].payload["messageId"], "old");

    let mut engine = Engine::new();
    let batches = settled_root_with_messages(&mut engine);
    db.apply_many(batches.iter())
        .expect("group commit after migration");
    let all = db.outbox_after(0, 1000).expect("read");
    let published: Vec<Value> = batches
        .iter()
        .flat_map(|b| b.published())
        .map(|r| r.to_json())
        .collect();
    let read: Vec<Value> = all[1..].iter().map(|o| o.payload.clone()).collect();
    assert_eq!(read, published);
    assert_eq!(all[1].seq, 2, "numbering goes on after the v1 rows");
}

#[test]
fn a_new_file_uses_the_larger_page_size() {
    let (_dir, path) = support::temp_db();
    let db = SqliteStore::open(&path).expect("create");
    assert_eq!(db.page_size().expect("page size"), schema::PAGE_SIZE as u64);
    drop(db);
    let c = Connection::open(&path).expect("raw open");
    let size: i64 = c
        .pragma_query_value(None, "page_size", |r| r.get(0))
        .expect("page_size");
    assert_eq!(size, schema::PAGE_SIZE);
}
