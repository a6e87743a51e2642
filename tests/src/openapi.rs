//! Checking recorded API answers against tuttid's OpenAPI document (issue 31): each answer's
//! body is validated with a JSON Schema validator (`jsonschema`, draft 2020-12, which OpenAPI
//! 3.1 uses) against the schema the document gives for its route, method and status; SSE rows
//! against the schema of their row kind.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::time::Duration;

/// The document, with helpers to validate values against its schemas.
pub struct Doc {
    /// The document.
    pub doc: Value,
}

impl Doc {
    /// Wraps a document.
    pub fn new(doc: Value) -> Doc {
        Doc { doc }
    }

    /// Validates `value` against `schema` (a schema that may `$ref` the document's components).
    pub fn validate_against(&self, schema: &Value, value: &Value) -> Result<(), String> {
        let mut root = json!({"components": self.doc["components"].clone()});
        if let (Some(r), Some(s)) = (root.as_object_mut(), schema.as_object()) {
            for (k, v) in s {
                r.insert(k.clone(), v.clone());
            }
        }
        let v = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft202012)
            .build(&root)
            .map_err(|e| format!("schema does not compile: {e}"))?;
        let errors: Vec<String> = v
            .iter_errors(value)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }

    /// Validates `value` against the component schema `name`.
    pub fn validate_component(&self, name: &str, value: &Value) -> Result<(), String> {
        if self.doc["components"]["schemas"].get(name).is_none() {
            return Err(format!("no component schema {name}"));
        }
        self.validate_against(
            &json!({"$ref": format!("#/components/schemas/{name}")}),
            value,
        )
    }

    /// Validates a JSON answer of `method path` (a template of the document) with `status`.
    pub fn validate_answer(
        &self,
        method: &str,
        path: &str,
        status: u16,
        body: &Value,
    ) -> Result<(), String> {
        let op = &self.doc["paths"][path][method.to_ascii_lowercase()];
        if op.is_null() {
            return Err(format!("{method} {path} is not in the document"));
        }
        let resp = &op["responses"][status.to_string()];
        if resp.is_null() {
            return Err(format!(
                "{method} {path}: status {status} is not documented"
            ));
        }
        let schema = &resp["content"]["application/json"]["schema"];
        if schema.is_null() {
            return Err(format!("{method} {path} {status}: no JSON schema"));
        }
        self.validate_against(schema, body)
            .map_err(|e| format!("{method} {path} {status}: {e}; body {body}"))
    }
}

/// One Server-Sent Event as read from the stream.
#[derive(Debug, Clone)]
pub struct SseEvent {
    /// `event:`.
    pub event: String,
    /// `id:`.
    pub id: String,
    /// `data:` parsed as JSON.
    pub data: Value,
}

/// Reads events of `GET /v1/events{query}` until `n` arrived or `secs` passed.
pub fn read_events(addr: &str, token: &str, query: &str, n: usize, secs: u64) -> Vec<SseEvent> {
    let url = format!("http://{addr}/v1/events{query}");
    let req = ureq::get(&url)
        .set("authorization", &format!("Bearer {token}"))
        .timeout(Duration::from_secs(secs));
    let mut out = Vec::new();
    let Ok(resp) = req.call() else {
        return out;
    };
    let (mut event, mut id) = (String::from("message"), String::new());
    for line in BufReader::new(resp.into_reader()).lines() {
        let Ok(line) = line else { break };
        if let Some(v) = line.strip_prefix("event:") {
            event = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("id:") {
            id = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("data:") {
            if let Ok(data) = serde_json::from_str::<Value>(v.trim()) {
                out.push(SseEvent {
                    event: std::mem::replace(&mut event, "message".into()),
                    id: std::mem::take(&mut id),
                    data,
                });
                if out.len() >= n {
                    break;
                }
            }
        }
    }
    out
}
