//! Captured Claude rows as the sidecar lines the adapter reads (for replays and tests).

use serde_json::{json, Value};

/// Turns one captured row into the sidecar line the adapter reads: a raw SDKMessage becomes
/// `{"kind":"message","message":...}`, a `__hook` row a `hook` line, a `__canUseTool` row a
/// `canUseTool` line (its request id is `opts.requestId`, else `replay-perm-<seq>`). A row that is
/// already a sidecar line (it has `kind`) is returned as is. `None` for anything else.
pub fn sidecar_line(captured: &Value, seq: usize) -> Option<Value> {
    let o = captured.as_object()?;
    if o.contains_key("kind") {
        return Some(captured.clone());
    }
    if let Some(event) = o.get("__hook") {
        let input = o.get("input").cloned().unwrap_or(Value::Null);
        let tool_use = input.get("tool_use_id").cloned().unwrap_or(Value::Null);
        return Some(
            json!({"kind": "hook", "event": event, "input": input, "toolUseID": tool_use}),
        );
    }
    if let Some(tool) = o.get("__canUseTool") {
        let opts = o.get("opts").cloned().unwrap_or_else(|| json!({}));
        let request = opts
            .get("requestId")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| format!("replay-perm-{seq}"));
        return Some(json!({
            "kind": "canUseTool",
            "requestId": request,
            "toolName": tool,
            "input": o.get("input").cloned().unwrap_or(Value::Null),
            "toolUseID": opts.get("toolUseID").cloned().unwrap_or(Value::Null),
            "agentID": opts.get("agentID").cloned().unwrap_or(Value::Null),
            "options": opts,
        }));
    }
    if o.contains_key("type") {
        let mut m = o.clone();
        m.remove("__t");
        return Some(json!({"kind": "message", "message": Value::Object(m)}));
    }
    None
}
