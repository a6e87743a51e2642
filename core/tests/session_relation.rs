//! A session's relation (root or child, with the child's immutable links) in its wire form.
//!
//! The wire form (camelCase JSON, as stored by every store, published in the outbox and written
//! in scenario files) is the same as before the relation became one enum: these golden strings
//! were produced by the earlier struct with flat optional fields.

use tutti_core::model::Session;

/// A root session as it has always been written.
const ROOT: &str = r#"{"id":"R","workspaceId":"W","kind":"root","provider":"codex","providerSessionId":"thr-1","providerAliases":{"threadId":"thr-1"},"title":"hello","activeTurnId":"T2","lastTurnId":"T2","capabilities":{"guideWhileChildrenOnly":false},"goal":{"objective":"x"},"createdAt":1,"updatedAt":2,"version":3}"#;

/// A child session as it has always been written (the capabilities are the default).
const CHILD: &str = r#"{"id":"C","workspaceId":"W","kind":"child","parentAgentSessionId":"P","parentTurnId":"PT","parentToolCallId":"call-1","rootAgentSessionId":"R","rootTurnId":"T","provider":"claude","providerAliases":{},"deletedAt":9,"capabilities":{"guideWhileChildrenOnly":true},"createdAt":4,"updatedAt":5,"version":6}"#;

/// A child without a known delegation tool call.
const CHILD_NO_CALL: &str = r#"{"id":"C2","workspaceId":"W","kind":"child","parentAgentSessionId":"R","parentTurnId":"T","rootAgentSessionId":"R","rootTurnId":"T","provider":"acp","providerAliases":{},"capabilities":{"guideWhileChildrenOnly":true},"createdAt":4,"updatedAt":4,"version":0}"#;

fn round_trip(json: &str) -> Session {
    let s: Session = serde_json::from_str(json).expect("a valid session");
    assert_eq!(serde_json::to_string(&s).expect("serializes"), json);
    s
}

#[test]
fn session_wire_form_is_unchanged_by_the_relation_enum() {
    let root = round_trip(ROOT);
    assert!(!root.is_child());
    let child = round_trip(CHILD);
    assert!(child.is_child());
    let bare = round_trip(CHILD_NO_CALL);
    assert!(bare.is_child());
}

/// "Child sessions are immutable in their relation": a child row missing any required link, or
/// a root row carrying a child's link, is a decode error (a typed error for every store and
/// snapshot reader), never a half child.
#[test]
fn a_session_with_a_wrong_relation_does_not_decode() {
    for field in [
        r#""parentAgentSessionId":"P","#,
        r#""parentTurnId":"PT","#,
        r#""rootAgentSessionId":"R","#,
        r#""rootTurnId":"T","#,
    ] {
        let broken = CHILD.replace(field, "");
        let err = serde_json::from_str::<Session>(&broken).expect_err("child without a link");
        assert!(err.to_string().contains("child session C has no"), "{err}");
    }
    let root_with_parent =
        ROOT.replace(r#""kind":"root","#, r#""kind":"root","parentTurnId":"X","#);
    let err = serde_json::from_str::<Session>(&root_with_parent).expect_err("root with a parent");
    assert!(
        err.to_string().contains("child-only field parentTurnId"),
        "{err}"
    );
}

/// A root keeps its capabilities; a child has none (its wire field is the default, ignored
/// when read).
#[test]
fn capabilities_are_root_only() {
    let root: Session = serde_json::from_str(ROOT).expect("root");
    assert_eq!(
        root.capabilities().map(|c| c.guide_while_children_only),
        Some(false)
    );
    let odd = CHILD.replace(
        r#""guideWhileChildrenOnly":true"#,
        r#""guideWhileChildrenOnly":false"#,
    );
    let child: Session = serde_json::from_str(&odd).expect("child");
    assert!(child.capabilities().is_none());
    assert_eq!(child.root_turn_id().map(|t| &**t), Some("T"));
    assert_eq!(child.tree_root_id().as_ref(), "R");
    assert_eq!(root.tree_root_id().as_ref(), "R");
    assert_eq!(serde_json::to_string(&child).expect("serializes"), CHILD);
}
