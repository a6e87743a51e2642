//! The codex app-server wire protocol (0.171): JSON-RPC objects without the `"jsonrpc"` field,
//! one per line. This module only *parses* (into typed values, validating everything the adapter
//! relies on before any state changes) and *builds* native messages; it holds no state.
//!
//! - client request `{"id": 1, "method": "thread/start", "params": {...}}`, answered by
//!   `{"id": 1, "result": {...}}` or `{"id": 1, "error": {"code": .., "message": ..}}`;
//! - server notification `{"method": "turn/started", "params": {...}}`;
//! - server request `{"id": 0, "method": "item/commandExecution/requestApproval", "params": {...}}`
//!   (server request ids are the server's own counter, independent of client ids).

use crate::adapters::AdapterError;
use crate::model::Outcome;
use serde_json::{json, Map, Value};

/// A JSON-RPC error answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RpcError {
    pub code: i64,
    pub message: String,
}

/// One parsed message from the app-server.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Incoming {
    /// The answer to one of the adapter's own requests.
    Response {
        id: Value,
        answer: Result<Value, RpcError>,
    },
    /// A server request the client must answer.
    Request(ServerRequest),
    /// A notification.
    Note(Note),
}

/// A server request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ServerRequest {
    /// The original JSON-RPC id (number or string), echoed in the answer.
    pub id: Value,
    /// The id as the canonical `requestId` string.
    pub key: String,
    pub method: String,
    pub params: Value,
    /// `params.threadId` (or the legacy `params.conversationId`).
    pub thread: Option<String>,
    /// `params.turnId`.
    pub turn: Option<String>,
}

/// A notification the adapter understands (anything else is [`Note::Other`]).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Note {
    ThreadStarted {
        thread: String,
        parent: Option<String>,
    },
    TurnStarted {
        thread: String,
        turn: String,
    },
    TurnCompleted {
        thread: String,
        turn: String,
        outcome: Outcome,
        error: Option<String>,
    },
    Item {
        thread: String,
        turn: Option<String>,
        /// `item/completed` (else `item/started`).
        done: bool,
        item: Item,
    },
    Resolved {
        thread: String,
        key: String,
    },
    Name {
        thread: String,
        name: Option<String>,
    },
    Status {
        thread: String,
        /// `Some(waiting)` while the thread is active (waiting on an approval or on user
        /// input, or not); `None` for idle and every other status.
        waiting: Option<bool>,
    },
    /// `thread/tokenUsage/updated`: the thread's token use (fields it lacks or that are not
    /// counts are left out).
    Usage {
        thread: String,
        usage: crate::model::TokenUsage,
    },
    Other {
        thread: Option<String>,
    },
}

impl Note {
    /// The thread the notification is about, if any.
    pub fn thread(&self) -> Option<&str> {
        match self {
            Note::ThreadStarted { thread, .. }
            | Note::TurnStarted { thread, .. }
            | Note::TurnCompleted { thread, .. }
            | Note::Item { thread, .. }
            | Note::Resolved { thread, .. }
            | Note::Name { thread, .. }
            | Note::Usage { thread, .. }
            | Note::Status { thread, .. } => Some(thread),
            Note::Other { thread } => thread.as_deref(),
        }
    }
}

/// A thread item (`params.item` of `item/started` / `item/completed`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Item {
    AgentMessage {
        id: String,
        text: String,
    },
    UserMessage {
        id: String,
        text: String,
    },
    /// `collabAgentToolCall`: spawnAgent, wait, closeAgent, ...
    Collab {
        id: String,
        tool: String,
        status: Option<String>,
        receivers: Vec<String>,
        raw: Value,
    },
    /// `subAgentActivity` (multi-agent v2).
    SubAgent {
        id: String,
        kind: String,
        agent_thread: String,
        agent_path: Option<String>,
        raw: Value,
    },
    /// Any other tool-like item (commandExecution, fileChange, mcpToolCall, ...).
    Tool {
        id: String,
        item_type: String,
        name: Option<String>,
        status: Option<String>,
        raw: Value,
    },
    /// Reasoning, plans, review markers, compaction, ...: not projected.
    Other,
}

/// Item types projected as tool calls.
const TOOL_ITEMS: &[&str] = &[
    "commandExecution",
    "fileChange",
    "mcpToolCall",
    "dynamicToolCall",
    "webSearch",
    "imageView",
    "imageGeneration",
    "functionCallOutput",
    "sleep",
];

fn missing(method: &str, field: &'static str) -> AdapterError {
    AdapterError::MissingField {
        method: method.to_string(),
        field,
    }
}

fn opt_str(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_string)
}

fn req_str(
    v: &Value,
    key: &str,
    method: &str,
    field: &'static str,
) -> Result<String, AdapterError> {
    opt_str(v, key).ok_or_else(|| missing(method, field))
}

/// A JSON-RPC id as the canonical request id string; `None` if it is neither a string nor an
/// integer.
pub(crate) fn id_key(id: &Value) -> Option<String> {
    match id {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        _ => None,
    }
}

/// Parses one message. Errors leave nothing changed: the caller drops the message.
pub(crate) fn parse(msg: &Value) -> Result<Incoming, AdapterError> {
    let Some(obj) = msg.as_object() else {
        return Err(AdapterError::Malformed("not a JSON object".into()));
    };
    let id = obj.get("id").filter(|v| !v.is_null());
    match obj.get("method") {
        Some(Value::String(method)) => {
            let params = match obj.get("params") {
                None | Some(Value::Null) => Value::Object(Map::new()),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => {
                    return Err(AdapterError::Malformed(format!(
                        "{method}: params is not an object"
                    )))
                }
            };
            match id {
                Some(id) => {
                    let key = id_key(id).ok_or_else(|| {
                        AdapterError::Malformed(format!("{method}: request id is not an id"))
                    })?;
                    let thread =
                        opt_str(&params, "threadId").or_else(|| opt_str(&params, "conversationId"));
                    let turn = opt_str(&params, "turnId");
                    Ok(Incoming::Request(ServerRequest {
                        id: id.clone(),
                        key,
                        method: method.clone(),
                        params,
                        thread,
                        turn,
                    }))
                }
                None => parse_note(method, &params).map(Incoming::Note),
            }
        }
        Some(_) => Err(AdapterError::Malformed("method is not a string".into())),
        None => {
            let Some(id) = id else {
                return Err(AdapterError::Malformed(
                    "neither a request, a notification nor a response".into(),
                ));
            };
            let answer = if let Some(err) = obj.get("error").filter(|e| !e.is_null()) {
                Err(RpcError {
                    code: err.get("code").and_then(Value::as_i64).unwrap_or(0),
                    message: err
                        .get("message")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                })
            } else if let Some(result) = obj.get("result") {
                Ok(result.clone())
            } else {
                return Err(AdapterError::Malformed(
                    "response without result or error".into(),
                ));
            };
            Ok(Incoming::Response {
                id: id.clone(),
                answer,
            })
        }
    }
}

fn parse_note(method: &str, p: &Value) -> Result<Note, AdapterError> {
    let thread = || req_str(p, "threadId", method, "threadId");
    Ok(match method {
        "thread/started" => {
            let t = p.get("thread").ok_or_else(|| missing(method, "thread"))?;
            Note::ThreadStarted {
                thread: req_str(t, "id", method, "thread.id")?,
                parent: opt_str(t, "parentThreadId"),
            }
        }
        "turn/started" | "turn/completed" => {
            let thread = thread()?;
            let t = p
                .get("turn")
                .filter(|t| t.is_object())
                .ok_or_else(|| missing(method, "turn"))?;
            let turn = req_str(t, "id", method, "turn.id")?;
            if method == "turn/started" {
                Note::TurnStarted { thread, turn }
            } else {
                let status = req_str(t, "status", method, "turn.status")?;
                let outcome = match status.as_str() {
                    "completed" => Outcome::Completed,
                    "interrupted" => Outcome::Interrupted,
                    "failed" => Outcome::Failed,
                    _ => {
                        return Err(AdapterError::Malformed(format!(
                            "turn/completed with status {status:?}"
                        )))
                    }
                };
                let error = if outcome.allows_error() {
                    t.get("error")
                        .and_then(|e| e.get("message"))
                        .and_then(Value::as_str)
                        .map(str::to_string)
                } else {
                    None
                };
                Note::TurnCompleted {
                    thread,
                    turn,
                    outcome,
                    error,
                }
            }
        }
        "item/started" | "item/completed" => {
            let thread = thread()?;
            let raw = p
                .get("item")
                .filter(|i| i.is_object())
                .ok_or_else(|| missing(method, "item"))?;
            Note::Item {
                thread,
                turn: opt_str(p, "turnId"),
                done: method == "item/completed",
                item: parse_item(method, raw)?,
            }
        }
        "serverRequest/resolved" => {
            let thread = thread()?;
            let key = p
                .get("requestId")
                .and_then(id_key)
                .ok_or_else(|| missing(method, "requestId"))?;
            Note::Resolved { thread, key }
        }
        "thread/tokenUsage/updated" => Note::Usage {
            thread: thread()?,
            usage: crate::model::TokenUsage {
                total_tokens: p
                    .pointer("/tokenUsage/total/totalTokens")
                    .and_then(Value::as_u64),
                context_tokens: p
                    .pointer("/tokenUsage/last/totalTokens")
                    .and_then(Value::as_u64),
                context_window: p
                    .pointer("/tokenUsage/modelContextWindow")
                    .and_then(Value::as_u64),
                cost: None,
            },
        },
        "thread/name/updated" => Note::Name {
            thread: thread()?,
            name: opt_str(p, "threadName"),
        },
        "thread/status/changed" => {
            let thread = thread()?;
            let status = p.get("status");
            let ty = status.and_then(|s| s.get("type")).and_then(Value::as_str);
            let waiting = (ty == Some("active")).then(|| {
                status
                    .and_then(|s| s.get("activeFlags"))
                    .and_then(Value::as_array)
                    .is_some_and(|flags| {
                        flags.iter().any(|f| {
                            matches!(
                                f.as_str(),
                                Some("waitingOnApproval") | Some("waitingOnUserInput")
                            )
                        })
                    })
            });
            Note::Status { thread, waiting }
        }
        _ => Note::Other {
            thread: opt_str(p, "threadId"),
        },
    })
}

fn parse_item(method: &str, raw: &Value) -> Result<Item, AdapterError> {
    let ty = req_str(raw, "type", method, "item.type")?;
    let id = || req_str(raw, "id", method, "item.id");
    Ok(match ty.as_str() {
        "agentMessage" => Item::AgentMessage {
            id: id()?,
            text: opt_str(raw, "text").unwrap_or_default(),
        },
        "userMessage" => {
            let text = raw
                .get("content")
                .and_then(Value::as_array)
                .map(|parts| {
                    parts
                        .iter()
                        .filter_map(|c| c.get("text").and_then(Value::as_str))
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .unwrap_or_default();
            Item::UserMessage { id: id()?, text }
        }
        "collabAgentToolCall" => {
            let receivers = match raw.get("receiverThreadIds") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|r| r.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        AdapterError::Malformed(format!(
                            "{method}: receiverThreadIds holds a non-string"
                        ))
                    })?,
                Some(_) => {
                    return Err(AdapterError::Malformed(format!(
                        "{method}: receiverThreadIds is not an array"
                    )))
                }
            };
            Item::Collab {
                id: id()?,
                tool: req_str(raw, "tool", method, "item.tool")?,
                status: opt_str(raw, "status"),
                receivers,
                raw: raw.clone(),
            }
        }
        "subAgentActivity" => Item::SubAgent {
            id: id()?,
            kind: req_str(raw, "kind", method, "item.kind")?,
            agent_thread: req_str(raw, "agentThreadId", method, "item.agentThreadId")?,
            agent_path: opt_str(raw, "agentPath"),
            raw: raw.clone(),
        },
        t if TOOL_ITEMS.contains(&t) => {
            let name = match t {
                "mcpToolCall" => match (opt_str(raw, "server"), opt_str(raw, "tool")) {
                    (Some(s), Some(tool)) => Some(format!("{s}/{tool}")),
                    (_, tool) => tool,
                },
                "dynamicToolCall" | "functionCallOutput" => {
                    opt_str(raw, "tool").or_else(|| opt_str(raw, "name"))
                }
                _ => None,
            };
            Item::Tool {
                id: id()?,
                item_type: ty.clone(),
                name,
                status: opt_str(raw, "status"),
                raw: raw.clone(),
            }
        }
        _ => Item::Other,
    })
}

/// Normalized tool call status: `inProgress` becomes `started`; other native statuses
/// (`completed`, `failed`, `interrupted`, `declined`) pass through; without one, `item/started`
/// is `started` and `item/completed` is `completed`.
pub(crate) fn tool_status(status: Option<&str>, done: bool) -> String {
    match status {
        Some("inProgress") | Some("in_progress") | Some("pending") => "started".into(),
        Some(s) if !s.is_empty() => s.to_string(),
        _ if done => "completed".into(),
        _ => "started".into(),
    }
}

/// A client request.
pub(crate) fn request(id: i64, method: &str, params: Value) -> Value {
    json!({ "id": id, "method": method, "params": params })
}

/// A client notification.
pub(crate) fn notification(method: &str) -> Value {
    json!({ "method": method })
}

/// A successful answer to a server request.
pub(crate) fn result(id: &Value, result: Value) -> Value {
    json!({ "id": id, "result": result })
}

/// An error answer to a server request.
pub(crate) fn error(id: &Value, code: i64, message: &str) -> Value {
    json!({ "id": id, "error": { "code": code, "message": message } })
}

/// A `text` user input item as `turn/start` / `turn/steer` expect it.
pub(crate) fn text_input(text: &str) -> Value {
    json!([{ "type": "text", "text": text, "text_elements": [] }])
}

/// What a plain answer word means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Word {
    Accept,
    AcceptForSession,
    Decline,
    Cancel,
}

fn word(v: &Value) -> Option<Word> {
    match v {
        Value::Bool(true) => Some(Word::Accept),
        Value::Bool(false) | Value::Null => Some(Word::Decline),
        Value::String(s) => match s.as_str() {
            "allow" | "accept" | "approve" | "approved" | "yes" => Some(Word::Accept),
            "acceptForSession" | "allowForSession" | "approved_for_session" => {
                Some(Word::AcceptForSession)
            }
            "deny" | "decline" | "reject" | "denied" | "no" => Some(Word::Decline),
            "cancel" | "abort" => Some(Word::Cancel),
            _ => None,
        },
        _ => None,
    }
}

/// Server request methods whose native answer has a refusal shape (see [`decline`]).
pub(crate) const DECLINABLE: &[&str] = &[
    "item/commandExecution/requestApproval",
    "item/fileChange/requestApproval",
    "item/permissions/requestApproval",
    "item/tool/requestUserInput",
    "mcpServer/elicitation/request",
    "execCommandApproval",
    "applyPatchApproval",
];

/// The native refusal of a server request nobody will answer: `decline` for the v2 approvals,
/// `denied` for the legacy ones, an empty grant for permissions, no answers for user input, and
/// `decline` for MCP elicitations. `None` for a method without a known refusal shape (the caller
/// answers it with a JSON-RPC error instead).
pub(crate) fn decline(method: &str, params: &Value) -> Option<Value> {
    if !DECLINABLE.contains(&method) {
        return None;
    }
    // `false` is the plain "decline" word; unlike the string it is never taken as the text
    // answer of a single user-input question.
    answer(method, params, &Value::Bool(false)).ok()
}

/// The native `result` for the engine's opaque `response` to a server request of `method`.
///
/// An object is already the native shape and passes through unchanged. Otherwise the words
/// `allow`/`accept` (or `true`) and `deny`/`decline` (or `false`/`null`), plus `cancel` and
/// `acceptForSession`, map per method: `{"decision": ..}` for the v2 approvals, the legacy
/// `ReviewDecision` strings for `execCommandApproval`/`applyPatchApproval`, the requested
/// permission profile (or an empty grant) for `item/permissions/requestApproval`, an `action` for
/// MCP elicitations, and for `item/tool/requestUserInput` a plain string answers its only
/// question. Anything else cannot be expressed natively: `Err` (the adapter then answers the
/// server request with a JSON-RPC error so the provider never hangs).
pub(crate) fn answer(method: &str, params: &Value, response: &Value) -> Result<Value, String> {
    if response.is_object() {
        return Ok(response.clone());
    }
    match method {
        "item/tool/requestUserInput" => {
            let questions = params.get("questions").and_then(Value::as_array);
            match (questions.map(Vec::as_slice), response) {
                (Some([q]), Value::String(s)) => {
                    let qid = q
                        .get("id")
                        .and_then(Value::as_str)
                        .ok_or("question without id")?;
                    Ok(json!({ "answers": { qid: { "answers": [s] } } }))
                }
                _ if word(response) == Some(Word::Decline) => Ok(json!({ "answers": {} })),
                _ => Err("a plain answer needs exactly one question".into()),
            }
        }
        "item/permissions/requestApproval" => match word(response) {
            Some(Word::Accept) | Some(Word::AcceptForSession) => {
                let scope = if word(response) == Some(Word::AcceptForSession) {
                    "session"
                } else {
                    "turn"
                };
                let requested = params
                    .get("permissions")
                    .cloned()
                    .unwrap_or_else(|| json!({}));
                Ok(json!({ "permissions": requested, "scope": scope }))
            }
            Some(_) => Ok(json!({ "permissions": {} })),
            None => Err("not a permission decision".into()),
        },
        "execCommandApproval" | "applyPatchApproval" => {
            let d = match word(response).ok_or("not a review decision")? {
                Word::Accept => "approved",
                Word::AcceptForSession => "approved_for_session",
                Word::Decline => "denied",
                Word::Cancel => "abort",
            };
            Ok(json!({ "decision": d }))
        }
        "mcpServer/elicitation/request" => {
            let a = match word(response).ok_or("not an elicitation action")? {
                Word::Accept | Word::AcceptForSession => "accept",
                Word::Decline => "decline",
                Word::Cancel => "cancel",
            };
            Ok(json!({ "action": a, "content": null }))
        }
        _ => {
            let d = match word(response).ok_or("not an approval decision")? {
                Word::Accept => "accept",
                Word::AcceptForSession => "acceptForSession",
                Word::Decline => "decline",
                Word::Cancel => "cancel",
            };
            Ok(json!({ "decision": d }))
        }
    }
}
