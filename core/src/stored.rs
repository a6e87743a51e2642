//! An entity decoded back from its stored wire form (the `json` column of the SQL stores),
//! exactly as it was stored.
//!
//! One wrinkle: the core's optional opaque fields (`Option<serde_json::Value>`, e.g. an
//! interaction's `response`) serialize `Some(Value::Null)` as `"response":null` and `None` as no
//! key at all, but serde decodes both as `None`. [`decode_stored`] restores `Some(Value::Null)`
//! when the key is present with `null`, so a stored row compares equal to what the engine holds.
//! Every store that keeps the wire form decodes it with this one function.

use crate::model::{CancelOperation, Interaction, Message, Session, ToolCall, Turn};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use std::sync::Arc;

/// Decodes one entity from its stored wire form.
pub fn decode_stored<T: StoredEntity>(json: &str) -> Result<T, serde_json::Error> {
    let mut v: T = serde_json::from_str(json)?;
    v.restore_nulls(json)?;
    Ok(v)
}

/// Entities stored in a `json` column.
pub trait StoredEntity: DeserializeOwned {
    /// Restores `Some(Value::Null)` for optional opaque fields present as `null` in `json`.
    fn restore_nulls(&mut self, _json: &str) -> Result<(), serde_json::Error> {
        Ok(())
    }
}

fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// Whether a compact serde_json text may hold `"key":null` (a cheap prefilter; the probe decides).
fn may_hold_null(json: &str, key: &str) -> bool {
    let needle_len = key.len() + 7;
    json.len() >= needle_len
        && json
            .match_indices(key)
            .any(|(i, _)| json[..i].ends_with('"') && json[i + key.len()..].starts_with("\":null"))
}

#[derive(Deserialize)]
struct SessionProbe {
    #[serde(default, deserialize_with = "present")]
    goal: Option<Value>,
}

#[derive(Deserialize)]
struct InteractionProbe {
    #[serde(default, deserialize_with = "present")]
    response: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    resolution: Option<Value>,
}

#[derive(Deserialize)]
struct ToolCallProbe {
    #[serde(default, deserialize_with = "present")]
    kind: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    payload: Option<Value>,
}

impl StoredEntity for Session {
    fn restore_nulls(&mut self, json: &str) -> Result<(), serde_json::Error> {
        if self.goal.is_none() && may_hold_null(json, "goal") {
            let p: SessionProbe = serde_json::from_str(json)?;
            self.goal = p.goal;
        }
        Ok(())
    }
}

impl StoredEntity for Interaction {
    fn restore_nulls(&mut self, json: &str) -> Result<(), serde_json::Error> {
        let check = (self.response.is_none() && may_hold_null(json, "response"))
            || (self.resolution.is_none() && may_hold_null(json, "resolution"));
        if check {
            let p: InteractionProbe = serde_json::from_str(json)?;
            if self.response.is_none() {
                self.response = p.response;
            }
            if self.resolution.is_none() {
                self.resolution = p.resolution;
            }
        }
        Ok(())
    }
}

impl StoredEntity for ToolCall {
    fn restore_nulls(&mut self, json: &str) -> Result<(), serde_json::Error> {
        let check = (self.kind.is_none() && may_hold_null(json, "kind"))
            || (self.payload.is_none() && may_hold_null(json, "payload"));
        if check {
            let p: ToolCallProbe = serde_json::from_str(json)?;
            if self.kind.is_none() {
                self.kind = p.kind;
            }
            if self.payload.is_none() {
                self.payload = p.payload.map(Arc::new);
            }
        }
        Ok(())
    }
}

impl StoredEntity for Turn {}
impl StoredEntity for Message {}
impl StoredEntity for CancelOperation {}
impl StoredEntity for Value {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn some_null_round_trips() {
        let json = r#"{"agentSessionId":"s","turnId":"t","requestId":"r","kind":null,"payload":{"response":null},"status":"answered","response":null,"createdAt":1,"updatedAt":2,"version":3}"#;
        let i: Interaction = decode_stored(json).expect("decodes");
        assert_eq!(i.response, Some(Value::Null));
        assert_eq!(i.resolution, None);
        let back = serde_json::to_string(&i).expect("encodes");
        let again: Interaction = decode_stored(&back).expect("decodes");
        assert_eq!(i, again);
    }

    #[test]
    fn nested_null_is_not_top_level() {
        let json = r#"{"agentSessionId":"s","turnId":"t","requestId":"r","payload":{"resolution":null},"status":"pending","createdAt":1,"updatedAt":2,"version":3}"#;
        let i: Interaction = decode_stored(json).expect("decodes");
        assert_eq!(i.resolution, None);
    }
}
