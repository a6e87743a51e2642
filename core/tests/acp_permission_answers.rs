//! Issue 23 item 1 / issue 17 item 5, at the ACP adapter: the `"allow"` shortcut selects the
//! agent's `allow_once` option even when the agent lists `allow_always` first (as
//! `@zed-industries/claude-code-acp` does), `"deny"` selects `reject_once`, an "always" option
//! is chosen only by its id, and an answer that fits no offered option is sent as `cancelled`.

use serde_json::{json, Value};
use tutti_core::adapters::acp::{AcpAdapter, AcpConfig};
use tutti_core::adapters::Adapter;
use tutti_core::input::NormalizedEvent;
use tutti_core::step::ProviderRequest;

/// An adapter with a running root prompt and one pending permission request `perm-1` whose
/// options list `allow_always` first. Returns the adapter and the interaction's (session, turn).
fn with_pending_permission() -> AcpAdapter {
    let mut a = AcpAdapter::new("R".into(), AcpConfig::default());
    let out = a.open(0);
    let init = out.native[0]["id"].clone();
    let out = a
        .on_native(1, &json!({"jsonrpc": "2.0", "id": init, "result": {"protocolVersion": 1, "agentCapabilities": {}}}))
        .expect("initialize answer");
    let new = out
        .native
        .iter()
        .find(|m| m["method"] == "session/new")
        .expect("session/new")["id"]
        .clone();
    a.on_native(
        2,
        &json!({"jsonrpc": "2.0", "id": new, "result": {"sessionId": "S"}}),
    )
    .expect("session/new answer");
    let out = a.on_request(
        3,
        &ProviderRequest::Start {
            root_agent_session_id: "R".into(),
            agent_session_id: "R".into(),
            turn_id: "T".into(),
            text: "go".into(),
        },
    );
    assert!(
        out.native.iter().any(|m| m["method"] == "session/prompt"),
        "{out:?}"
    );
    let out = a
        .on_native(
            4,
            &json!({"jsonrpc": "2.0", "id": "perm-1", "method": "session/request_permission",
                "params": {"sessionId": "S", "toolCall": {"toolCallId": "tc1"}, "options": [
                    {"optionId": "allow_always", "name": "Always Allow", "kind": "allow_always"},
                    {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
                    {"optionId": "reject", "name": "Reject", "kind": "reject_once"}]}}),
        )
        .expect("permission request");
    assert!(
        out.events
            .iter()
            .any(|e| matches!(e, NormalizedEvent::InteractionRequested { .. })),
        "{out:?}"
    );
    a
}

fn answer(response: Value) -> Value {
    let mut a = with_pending_permission();
    let out = a.on_request(
        5,
        &ProviderRequest::RespondInteraction {
            root_agent_session_id: "R".into(),
            agent_session_id: "R".into(),
            turn_id: "T".into(),
            request_id: "perm-1".into(),
            provider_turn_id: None,
            response,
        },
    );
    let msg = out
        .native
        .iter()
        .find(|m| m["id"] == "perm-1")
        .cloned()
        .expect("an answer to the agent");
    msg["result"]["outcome"].clone()
}

#[test]
fn allow_shortcut_selects_allow_once_not_allow_always() {
    assert_eq!(
        answer(json!("allow")),
        json!({"outcome": "selected", "optionId": "allow"})
    );
    assert_eq!(
        answer(json!("deny")),
        json!({"outcome": "selected", "optionId": "reject"})
    );
    assert_eq!(
        answer(json!({"optionId": "allow_always"})),
        json!({"outcome": "selected", "optionId": "allow_always"})
    );
    assert_eq!(
        answer(json!("allow_always")),
        json!({"outcome": "selected", "optionId": "allow_always"})
    );
    for bad in [json!(42), json!("bogus"), Value::Null, json!({})] {
        assert_eq!(
            answer(bad.clone()),
            json!({"outcome": "cancelled"}),
            "{bad}"
        );
    }
}
