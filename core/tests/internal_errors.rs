//! Issue 19: "An internal inconsistency is not `Rejected::Invalid` answered to an API caller as
//! 400: it is a distinct internal error". A tree restored from storage that breaks an invariant
//! the engine relies on makes the engine answer `Rejected::Internal` (code `internal`) and change
//! nothing, where the input itself would have been fine.

use serde_json::json;
use tutti_core::{Engine, Input, Rejected, TreeSnapshot};

fn input(v: serde_json::Value) -> Input {
    serde_json::from_value(v).expect("valid input")
}

/// Root `R` with the active root turn `T`, and its snapshot.
fn active_root() -> (Engine, TreeSnapshot) {
    let mut e = Engine::new();
    for (now, v) in [
        (
            1,
            json!({"type": "createSession", "agentSessionId": "R", "workspaceId": "W", "provider": "codex"}),
        ),
        (
            2,
            json!({"type": "submit", "agentSessionId": "R", "turnId": "T", "text": "go"}),
        ),
    ] {
        e.handle(now, &input(v)).expect("accepted");
    }
    let snap = e.snapshot("R").expect("loaded");
    (e, snap)
}

/// A stored root whose `activeTurnId` names a turn the tree does not hold (its row lost):
/// a submit would append the user's message to that missing turn and ask the provider to guide
/// it. The engine refuses with an internal error instead, records nothing, and a caller is told
/// `internal`, not `invalid`.
#[test]
fn submit_to_a_root_whose_active_turn_is_missing_is_an_internal_error() {
    let (_, mut snap) = active_root();
    snap.turns.retain(|t| &*t.id != "T");
    let mut e = Engine::new();
    e.restore(snap)
        .expect("restore does not check activeTurnId");
    let before = e.snapshot("R");

    let err = e
        .handle(
            3,
            &input(
                json!({"type": "submit", "agentSessionId": "R", "turnId": "T2", "text": "more"}),
            ),
        )
        .expect_err("an inconsistent tree");
    assert!(err.is_internal(), "{err:?}");
    assert_eq!(err.code(), "internal");
    assert!(
        matches!(&err, Rejected::Internal { id, .. } if &**id == "T"),
        "names the missing turn: {err:?}"
    );
    assert_eq!(e.snapshot("R"), before, "nothing changed");
}

/// The same submit on the intact tree is accepted (the input was never at fault).
#[test]
fn the_same_submit_on_the_intact_tree_is_accepted() {
    let (mut e, _) = active_root();
    let step = e
        .handle(
            3,
            &input(
                json!({"type": "submit", "agentSessionId": "R", "turnId": "T2", "text": "more"}),
            ),
        )
        .expect("accepted");
    assert!(!step.persist.is_empty());
}

/// Refusals of the input keep their codes: only the engine's own inconsistency is `internal`.
#[test]
fn refusals_of_the_input_are_not_internal() {
    let (mut e, _) = active_root();
    let err = e
        .handle(
            3,
            &input(
                json!({"type": "submit", "agentSessionId": "nope", "turnId": "T2", "text": "x"}),
            ),
        )
        .expect_err("unknown session");
    assert!(!err.is_internal());
    assert_eq!(err.code(), "not_found");
}
