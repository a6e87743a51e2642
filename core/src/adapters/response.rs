//! Interaction responses: the shapes a user's answer may take, checked against what the
//! interaction offered before the answer reaches the engine.
//!
//! Issue 17: "An interaction response is validated against what the interaction offered (for a
//! permission: one of its option ids, in the documented response shape); anything else is 400
//! with the offered options named, and the interaction stays pending." Issue 23: "The shortcut
//! must pick `allow_once` (and `deny` → `reject_once`); 'always' only when asked for by its
//! option id."
//!
//! Accepted shapes (the value of `{"response": ...}` in the API):
//!
//! | interaction | accepted |
//! |---|---|
//! | ACP permission (`kind: "permission"`, `payload.options`) | `"allow"` (the option of kind `allow_once`), `"deny"` (kind `reject_once`), an offered option id as a string, `{"optionId": ID}`, or the native outcome `{"outcome": {"outcome": "selected", "optionId": ID}}` / `{"outcome": {"outcome": "cancelled"}}` |
//! | Claude permission (`kind: "permission"`, no options) | `"allow"` / `"deny"` (and the synonyms the adapter knows), `true` / `false`, `{"behavior": "allow" \| "deny", "message"?, "updatedInput"?, "updatedPermissions"?, "interrupt"?}` |
//! | Codex server request (`kind` = its method) | `"allow"` / `"deny"` / `"cancel"` (and synonyms, `"acceptForSession"`), `true` / `false`, a plain string for a single-question user input, or the native result object |
//!
//! `null` is refused for every kind. Choice: a shortcut whose `_once` option the agent did not
//! offer is refused (answer by option id instead) rather than falling back to an "always"
//! option.

use serde_json::Value;
use thiserror::Error;

/// Why a response does not fit its interaction.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ResponseError {
    /// Not one of the offered options (or not a shape this interaction accepts).
    #[error("{reason}; offered options: {}", offered.join(", "))]
    NotOffered {
        /// What was wrong.
        reason: String,
        /// The offered option ids, with their kinds (`id (kind)`).
        offered: Vec<String>,
    },
    /// Not a response shape this kind of interaction accepts.
    #[error("{reason}; accepted: {accepted}")]
    Unrecognized {
        /// What was wrong.
        reason: String,
        /// The accepted shapes.
        accepted: &'static str,
    },
}

/// What an ACP permission answer selects.
#[derive(Debug, Clone, PartialEq)]
pub enum AcpChoice {
    /// The offered option with this `optionId`.
    Option(Value),
    /// A native outcome, checked against the offered options, sent as it is.
    Native(Value),
}

fn option_id(o: &Value) -> Option<&Value> {
    o.get("optionId")
}

fn offered(options: &[Value]) -> Vec<String> {
    options
        .iter()
        .map(|o| {
            let id = match option_id(o) {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => "?".into(),
            };
            match o.get("kind").and_then(Value::as_str) {
                Some(k) => format!("{id} ({k})"),
                None => id,
            }
        })
        .collect()
}

/// Picks the ACP permission option `response` asks for (see the module table).
pub fn acp_permission_choice(
    options: &[Value],
    response: &Value,
) -> Result<AcpChoice, ResponseError> {
    let not_offered = |reason: String| ResponseError::NotOffered {
        reason,
        offered: offered(options),
    };
    let is_offered = |id: &Value| options.iter().any(|o| option_id(o) == Some(id));
    let by_kind = |kind: &str| {
        options
            .iter()
            .find(|o| o.get("kind").and_then(Value::as_str) == Some(kind))
            .and_then(option_id)
            .cloned()
    };
    match response {
        Value::String(s) if s == "allow" || s == "deny" => {
            let kind = if s == "allow" {
                "allow_once"
            } else {
                "reject_once"
            };
            by_kind(kind).map(AcpChoice::Option).ok_or_else(|| {
                not_offered(format!(
                    "\"{s}\" selects the option of kind {kind}, which this request does not offer; answer with an option id"
                ))
            })
        }
        Value::String(_) if is_offered(response) => Ok(AcpChoice::Option(response.clone())),
        Value::Object(o) if o.contains_key("outcome") => {
            let outcome = &o["outcome"];
            match outcome.get("outcome").and_then(Value::as_str) {
                Some("cancelled") => Ok(AcpChoice::Native(response.clone())),
                Some("selected") => match outcome.get("optionId") {
                    Some(id) if is_offered(id) => Ok(AcpChoice::Native(response.clone())),
                    _ => Err(not_offered(
                        "the selected optionId is not one of the offered options".into(),
                    )),
                },
                _ => Err(not_offered(
                    "outcome must be {\"outcome\":\"selected\",\"optionId\":ID} or {\"outcome\":\"cancelled\"}".into(),
                )),
            }
        }
        Value::Object(o) if o.contains_key("optionId") && o.len() == 1 => match o.get("optionId") {
            Some(id) if is_offered(id) => Ok(AcpChoice::Option(id.clone())),
            _ => Err(not_offered(
                "optionId is not one of the offered options".into(),
            )),
        },
        _ => Err(not_offered(
            "a permission answer is \"allow\", \"deny\", an option id, or {\"optionId\": ID}"
                .into(),
        )),
    }
}

/// Checks `response` against an interaction of this `kind` and `payload` (see the module
/// table). Kinds this module does not know are accepted as they are, except `null`.
pub fn check_response(
    kind: &Value,
    payload: &Value,
    response: &Value,
) -> Result<(), ResponseError> {
    if response.is_null() {
        return Err(ResponseError::Unrecognized {
            reason: "a response is required (got null)".into(),
            accepted: "see the documented response shapes",
        });
    }
    match kind.as_str() {
        // ACP's options are an array of `{optionId, name, kind}`; Claude's `options` (the SDK's
        // `canUseTool` options) is an object.
        Some("permission") => match payload
            .get("options")
            .and_then(Value::as_array)
            .filter(|o| o.iter().any(|o| o.get("optionId").is_some()))
        {
            Some(options) => acp_permission_choice(options, response).map(|_| ()),
            None => match super::claude::permission_decision(response).0 {
                Some(_) => Ok(()),
                None => Err(ResponseError::Unrecognized {
                    reason: "not a permission decision".into(),
                    accepted: "\"allow\", \"deny\", true, false, {\"behavior\": \"allow\"|\"deny\", ...}",
                }),
            },
        },
        Some(method) if method.contains('/') || method.ends_with("Approval") => {
            super::codex::answer(method, payload, response)
                .map(|_| ())
                .map_err(|reason| ResponseError::Unrecognized {
                    reason,
                    accepted: "\"allow\", \"deny\", \"cancel\", \"acceptForSession\", true, false, a text answer to a single question, or the native result object",
                })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn opts() -> Vec<Value> {
        vec![
            json!({"optionId": "allow_always", "name": "Always Allow", "kind": "allow_always"}),
            json!({"optionId": "allow", "name": "Allow", "kind": "allow_once"}),
            json!({"optionId": "reject", "name": "Reject", "kind": "reject_once"}),
        ]
    }

    #[test]
    fn allow_picks_allow_once_even_when_always_is_listed_first() {
        assert_eq!(
            acp_permission_choice(&opts(), &json!("allow")),
            Ok(AcpChoice::Option(json!("allow")))
        );
        assert_eq!(
            acp_permission_choice(&opts(), &json!("deny")),
            Ok(AcpChoice::Option(json!("reject")))
        );
        assert_eq!(
            acp_permission_choice(&opts(), &json!({"optionId": "allow_always"})),
            Ok(AcpChoice::Option(json!("allow_always")))
        );
    }

    #[test]
    fn anything_not_offered_is_refused_naming_the_options() {
        for bad in [
            json!(42),
            json!("bogus"),
            json!({}),
            json!({"optionId": "nope"}),
            json!(true),
        ] {
            let e = acp_permission_choice(&opts(), &bad).unwrap_err();
            assert!(e.to_string().contains("allow_always (allow_always)"), "{e}");
        }
        let only_always = [json!({"optionId": "a", "kind": "allow_always"})];
        assert!(acp_permission_choice(&only_always, &json!("allow")).is_err());
        let e = check_response(
            &json!("permission"),
            &json!({"options": opts()}),
            &Value::Null,
        );
        assert!(e.is_err());
    }
}
