//! The SQLite codec of sessions is unchanged by the relation enum: a root and a child are stored
//! as the same JSON text and the same `kind` / `root_agent_session_id` columns as before, read
//! back equal, and a stored child row that lacks a link is a typed `BadRow` error, not a half
//! child.

use rusqlite::Connection;
use std::sync::Arc;
use tutti_core::model::Session;
use tutti_core::store::Store;
use tutti_core::{PersistBatch, Row};
use tutti_sqlite::{SqliteError, SqliteStore};

/// Written by the earlier flat `Session` struct (see `core/tests/session_relation.rs`).
const ROOT: &str = r#"{"id":"R","workspaceId":"W","kind":"root","provider":"codex","providerAliases":{},"title":"hello","capabilities":{"guideWhileChildrenOnly":false},"createdAt":1,"updatedAt":2,"version":1}"#;
const CHILD: &str = r#"{"id":"C","workspaceId":"W","kind":"child","parentAgentSessionId":"R","parentTurnId":"T","parentToolCallId":"call-1","rootAgentSessionId":"R","rootTurnId":"T","provider":"codex","providerAliases":{},"capabilities":{"guideWhileChildrenOnly":true},"createdAt":4,"updatedAt":5,"version":1}"#;

fn session(json: &str) -> Session {
    serde_json::from_str(json).expect("a valid session")
}

fn batch(rows: &[&str]) -> PersistBatch {
    PersistBatch {
        root_agent_session_id: Some("R".into()),
        workspace_id: Some("W".into()),
        rows: rows
            .iter()
            .map(|j| Row::Session(Arc::new(session(j))))
            .collect(),
        ..PersistBatch::default()
    }
}

#[test]
fn sessions_are_stored_in_the_unchanged_wire_form() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("t.db");
    let mut db = SqliteStore::open(&path).expect("open");
    db.apply(&batch(&[ROOT, CHILD])).expect("apply");

    let raw = Connection::open(&path).expect("raw open");
    for (id, json, kind, root) in [("R", ROOT, "root", None), ("C", CHILD, "child", Some("R"))] {
        let (stored, k, r): (String, String, Option<String>) = raw
            .query_row(
                "SELECT json, kind, root_agent_session_id FROM sessions WHERE id = ?1",
                [id],
                |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
            )
            .expect("stored row");
        assert_eq!(stored, json, "stored JSON of {id}");
        assert_eq!(k, kind);
        assert_eq!(r.as_deref(), root);
        assert_eq!(db.session(id).expect("read"), Some(session(json)));
    }
    assert_eq!(db.root_of("C").expect("root_of").as_deref(), Some("R"));
}

#[test]
fn a_stored_child_without_its_root_turn_is_a_bad_row() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("t.db");
    let db = SqliteStore::open(&path).expect("open");
    let broken = CHILD.replace(r#""rootTurnId":"T","#, "");
    let raw = Connection::open(&path).expect("raw open");
    raw.execute(
        "INSERT INTO sessions (id, workspace_id, kind, root_agent_session_id, active_turn_id, \
         created_at, deleted_at, version, json) VALUES ('C', 'W', 'child', 'R', NULL, 4, NULL, 1, ?1)",
        [&broken],
    )
    .expect("raw insert");
    match db.session("C") {
        Err(SqliteError::BadRow { table, .. }) => assert_eq!(table, "sessions"),
        other => panic!("expected a bad row, got {other:?}"),
    }
}
