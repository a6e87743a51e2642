//! The machine-readable API (issue 31): the OpenAPI 3.1 document of `tuttid`'s HTTP API,
//! generated from the Rust types that serialize its requests and responses.
//!
//! One route table ([`ROUTES`]) is the source of both the router (see
//! [`crate::api::router_with_web`], which mounts every route of the table and nothing else of the
//! API) and the document's `paths` ([`document`]), so the two cannot drift. Schemas come from
//! `schemars` derives: the wire entities of `tutti-core` (feature `schema`), the request bodies of
//! [`crate::api`] and the response bodies below, which the handlers serialize. Served at
//! `GET /v1/openapi.json` (same auth as the rest of `/v1`) and printed offline by
//! `tutti openapi`.
//!
//! Choices: the document describes the API (`/v1/...`, `/healthz`, `/metrics`); the web view's
//! pages (`/`, its assets, `POST /login`) are not part of it. `info.version` is the crate
//! version. Every status a route can answer is listed; each error answer is the envelope
//! [`ErrorEnvelope`] whose `code` is one of [`ErrorCode`].

use schemars::{JsonSchema, SchemaGenerator};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tutti_core::model::{CancelOperation, Id, Interaction, Message, Session, ToolCall, Turn};
use tutti_core::store::OutboxRow;

/// An HTTP method of a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `GET`.
    Get,
    /// `POST`.
    Post,
    /// `DELETE`.
    Delete,
}

impl Method {
    /// The lower-case name (the key of an OpenAPI path item).
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "get",
            Method::Post => "post",
            Method::Delete => "delete",
        }
    }
}

/// The operations of the API (one per route; the OpenAPI `operationId` is [`Op::id`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `POST /v1/workspaces/{ws}/agent-sessions`.
    CreateSession,
    /// `GET /v1/workspaces/{ws}/agent-sessions`.
    ListSessions,
    /// `GET /v1/workspaces/{ws}/agent-sessions/{id}`.
    GetSession,
    /// `DELETE /v1/workspaces/{ws}/agent-sessions/{id}`.
    DeleteSession,
    /// `GET .../{id}/messages`.
    ListMessages,
    /// `GET .../{id}/tree-messages`.
    TreeMessages,
    /// `POST .../{id}/submit`.
    Submit,
    /// `POST .../{id}/turns/{turn}/cancel`.
    CancelTurn,
    /// `POST .../{id}/turns/{turn}/interactions/{request}`.
    RespondInteraction,
    /// `GET /v1/events`.
    Events,
    /// `GET /v1/providers`.
    Providers,
    /// `POST /v1/login-links`.
    LoginLink,
    /// `GET /v1/openapi.json`.
    OpenApi,
    /// `GET /metrics`.
    Metrics,
    /// `GET /healthz`.
    Healthz,
    /// `GET /readyz`.
    Readyz,
    /// `GET /livez`.
    Livez,
}

impl Op {
    /// The OpenAPI `operationId`.
    pub fn id(self) -> &'static str {
        match self {
            Op::CreateSession => "createSession",
            Op::ListSessions => "listSessions",
            Op::GetSession => "getSession",
            Op::DeleteSession => "deleteSession",
            Op::ListMessages => "listMessages",
            Op::TreeMessages => "listTreeMessages",
            Op::Submit => "submit",
            Op::CancelTurn => "cancelTurn",
            Op::RespondInteraction => "respondInteraction",
            Op::Events => "events",
            Op::Providers => "listProviders",
            Op::LoginLink => "createLoginLink",
            Op::OpenApi => "openapi",
            Op::Metrics => "metrics",
            Op::Healthz => "healthz",
            Op::Readyz => "readyz",
            Op::Livez => "livez",
        }
    }
}

/// One route of the API.
#[derive(Debug, Clone, Copy)]
pub struct Route {
    /// Method.
    pub method: Method,
    /// Path template (axum and OpenAPI share the `{name}` syntax).
    pub path: &'static str,
    /// The operation.
    pub op: Op,
    /// Behind the bearer token / login cookie (every route but `/healthz`).
    pub auth: bool,
    /// A command on an existing tree, forwarded to the tree's owning daemon (issue 21).
    pub forwarded: bool,
}

const fn route(method: Method, path: &'static str, op: Op, auth: bool, forwarded: bool) -> Route {
    Route {
        method,
        path,
        op,
        auth,
        forwarded,
    }
}

const SESSIONS: &str = "/v1/workspaces/{ws}/agent-sessions";
const SESSION: &str = "/v1/workspaces/{ws}/agent-sessions/{id}";

/// Every route of the API: the router mounts exactly these; the document lists exactly these.
pub const ROUTES: &[Route] = &[
    route(Method::Post, SESSIONS, Op::CreateSession, true, false),
    route(Method::Get, SESSIONS, Op::ListSessions, true, false),
    route(Method::Get, SESSION, Op::GetSession, true, false),
    route(Method::Delete, SESSION, Op::DeleteSession, true, true),
    route(
        Method::Get,
        "/v1/workspaces/{ws}/agent-sessions/{id}/messages",
        Op::ListMessages,
        true,
        false,
    ),
    route(
        Method::Get,
        "/v1/workspaces/{ws}/agent-sessions/{id}/tree-messages",
        Op::TreeMessages,
        true,
        false,
    ),
    route(
        Method::Post,
        "/v1/workspaces/{ws}/agent-sessions/{id}/submit",
        Op::Submit,
        true,
        true,
    ),
    route(
        Method::Post,
        "/v1/workspaces/{ws}/agent-sessions/{id}/turns/{turn}/cancel",
        Op::CancelTurn,
        true,
        true,
    ),
    route(
        Method::Post,
        "/v1/workspaces/{ws}/agent-sessions/{id}/turns/{turn}/interactions/{request}",
        Op::RespondInteraction,
        true,
        true,
    ),
    route(Method::Get, "/v1/events", Op::Events, true, false),
    route(Method::Get, "/v1/providers", Op::Providers, true, false),
    route(Method::Post, "/v1/login-links", Op::LoginLink, true, false),
    route(Method::Get, "/v1/openapi.json", Op::OpenApi, true, false),
    route(Method::Get, "/metrics", Op::Metrics, true, false),
    route(Method::Get, "/healthz", Op::Healthz, false, false),
    route(Method::Get, "/readyz", Op::Readyz, false, false),
    route(Method::Get, "/livez", Op::Livez, false, false),
];

/// The error envelope of every error answer.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ErrorEnvelope {
    /// The error.
    pub error: ErrorBody,
}

/// The error of [`ErrorEnvelope`].
#[derive(Debug, Serialize, JsonSchema)]
pub struct ErrorBody {
    /// Stable code.
    pub code: ErrorCode,
    /// Human-readable text (never provider content).
    pub message: String,
}

/// Every `code` of an error answer (stable; see the README's API section for each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: malformed or refused input (nothing changed).
    Invalid,
    /// 401: missing or wrong token / cluster secret.
    Unauthorized,
    /// 403: a state-changing request authenticated by the cookie alone without this origin.
    Forbidden,
    /// 404: no such route, session, turn, interaction.
    NotFound,
    /// 405: the route exists, not with this method.
    MethodNotAllowed,
    /// 409: the engine refused the command in the current state.
    Conflict,
    /// 409: another daemon owns the tree and the request cannot be forwarded again.
    OwnedElsewhere,
    /// 409: the store refused the command's batch (another writer was first).
    CommitConflict,
    /// 410: the rows asked for were deleted by retention.
    Pruned,
    /// 408: the request body did not arrive within the body timeout.
    Timeout,
    /// 413: body over the limit.
    TooLarge,
    /// 414: request target over the limit.
    UriTooLong,
    /// 415: the body is not `application/json`.
    UnsupportedMediaType,
    /// 431: too many or too large headers.
    HeadersTooLarge,
    /// 500: the daemon's own fault.
    Internal,
    /// 503: the daemon is stopping or its store is unreachable.
    Unavailable,
    /// 503: the owning daemon does not answer (`Retry-After` says when to retry).
    OwnerUnreachable,
    /// 503: every provider process the daemon may run (`max_providers`) is busy.
    ProviderLimit,
    /// 504: the daemon took the command but could not finish its commit within the command
    /// deadline (its store hangs); the command may still take effect: read the session.
    OutcomeUnknown,
}

impl ErrorCode {
    /// Every code.
    pub const ALL: [ErrorCode; 19] = [
        ErrorCode::Invalid,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::Conflict,
        ErrorCode::OwnedElsewhere,
        ErrorCode::CommitConflict,
        ErrorCode::Pruned,
        ErrorCode::Timeout,
        ErrorCode::TooLarge,
        ErrorCode::UriTooLong,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::HeadersTooLarge,
        ErrorCode::Internal,
        ErrorCode::Unavailable,
        ErrorCode::OwnerUnreachable,
        ErrorCode::ProviderLimit,
        ErrorCode::OutcomeUnknown,
    ];

    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Invalid => "invalid",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::Conflict => "conflict",
            ErrorCode::OwnedElsewhere => "owned_elsewhere",
            ErrorCode::CommitConflict => "commit_conflict",
            ErrorCode::Pruned => "pruned",
            ErrorCode::Timeout => "timeout",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::UriTooLong => "uri_too_long",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::HeadersTooLarge => "headers_too_large",
            ErrorCode::Internal => "internal",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::OwnerUnreachable => "owner_unreachable",
            ErrorCode::ProviderLimit => "provider_limit",
            ErrorCode::OutcomeUnknown => "outcome_unknown",
        }
    }
}

/// `201` of `createSession`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct CreateSessionResponse {
    /// The new root session.
    pub session: Option<Session>,
}

/// `200` of `listSessions`: one page of root sessions, newest first.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ListSessionsResponse {
    /// Root sessions (tombstones excluded).
    pub sessions: Vec<Session>,
    /// The next page's cursor (opaque), when there may be more.
    pub next_cursor: Option<String>,
    /// The outbox position read before the page: follow `/v1/events?after=eventSeq`.
    pub event_seq: Option<u64>,
}

/// `200` of `getSession`: one durable snapshot of the session and its nested children.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionDetailResponse {
    /// The session.
    pub session: Session,
    /// Every nested child session, flat.
    pub child_sessions: Vec<Session>,
    /// The last turn of the session and of each child.
    pub turns: Vec<Turn>,
    /// Interactions of these sessions.
    pub interactions: Vec<Interaction>,
    /// Tool calls of these sessions.
    pub tool_calls: Vec<ToolCall>,
    /// The outbox position read first: follow `/v1/events?after=eventSeq`.
    pub event_seq: u64,
}

/// `200` of `listMessages`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct MessagesResponse {
    /// Messages with `seq > after`, in order.
    pub messages: Vec<Message>,
}

/// `200` of `listTreeMessages`.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TreeMessagesResponse {
    /// The outbox position read first: follow `/v1/events?after=eventSeq`.
    pub event_seq: u64,
    /// The session and each of its nested children.
    pub sessions: Vec<TreeMessagesSession>,
}

/// One session of [`TreeMessagesResponse`].
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TreeMessagesSession {
    /// The session.
    pub agent_session_id: Id,
    /// Its first messages, in order.
    pub messages: Vec<Message>,
    /// Whether it has more (page on with `.../messages?after=<last seq>`).
    pub more: bool,
}

/// What a submission did.
#[derive(Debug, Clone, Copy, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum SubmitReply {
    /// A new root turn started.
    Started,
    /// Appended to the active turn as guidance.
    Appended,
    /// Kept pending: the provider cannot take guidance while only children run.
    PendingUnsupported,
}

/// `200` of `submit`.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SubmitResponse {
    /// What happened.
    pub reply: SubmitReply,
    /// The turn the text went to.
    pub turn_id: Id,
}

/// `202` of `cancelTurn`.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CancelResponse {
    /// The durable cancel operation (its rows come on the event stream).
    pub operation_id: Id,
}

/// `200` of `respondInteraction`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct OkResponse {
    /// Always `true`.
    pub ok: bool,
}

/// `200` of `deleteSession`.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeleteResponse {
    /// How many sessions (the root and its children) were deleted.
    pub deleted_sessions: u32,
}

/// `200` of `listProviders`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ProvidersResponse {
    /// Configured provider names.
    pub providers: Vec<String>,
}

/// `200` of `createLoginLink`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct LoginLinkResponse {
    /// The one-time login link's path (append to the daemon's base URL).
    pub path: String,
}

/// `200` of `healthz`.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthResponse {
    /// `false` (with a 503) while the store's database is unreachable.
    pub ok: bool,
    /// The daemon's version.
    pub version: String,
    /// Seconds since start.
    pub uptime_seconds: u64,
    /// Why it is not ok (`database`), only then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The data of the event stream's `reset` event.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResetEvent {
    /// The position the client asked for.
    pub requested_after: u64,
    /// Rows up to here are gone; the event's `id:` is this.
    pub pruned_through: u64,
    /// The oldest row that follows.
    pub oldest_seq: u64,
}

/// The payload of a `sessionPurged` row.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionPurged {
    /// The purged session.
    pub agent_session_id: Id,
}

/// The payload of a `redacted` row: a kept row of a session that was deleted, rewritten in
/// place to ids only (issue 36: "deleted means gone").
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Redacted {
    /// The deleted session.
    pub agent_session_id: Id,
    /// The row's kind before it was redacted.
    pub kind: String,
}

/// The outbox row kinds (the SSE `event:` name) and the schema name of each payload.
pub const ROW_KINDS: &[(&str, &str)] = &[
    ("session", "WorkspaceAgentSession"),
    ("sessionDeleted", "WorkspaceAgentSession"),
    ("sessionPurged", "SessionPurged"),
    ("turn", "WorkspaceAgentTurn"),
    ("message", "Message"),
    ("interaction", "Interaction"),
    ("toolCall", "ToolCall"),
    ("cancelOperation", "CancelOperation"),
    ("redacted", "Redacted"),
];

fn schema_ref(g: &mut SchemaGenerator, f: fn(&mut SchemaGenerator) -> schemars::Schema) -> Value {
    f(g).to_value()
}

fn sub<T: JsonSchema>(g: &mut SchemaGenerator) -> schemars::Schema {
    g.subschema_for::<T>()
}

fn error_response(description: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}}
    })
}

fn json_response(description: &str, schema: Value) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": schema}}})
}

fn id_param(name: &str, description: &str) -> Value {
    json!({
        "name": name, "in": "path", "required": true, "description": description,
        "schema": {"type": "string", "minLength": 1, "maxLength": crate::http::MAX_ID,
            "pattern": "^[^/\\\\\\x00-\\x1f\\x7f-\\x9f]+$"}
    })
}

fn query_param(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "query", "required": false, "description": description, "schema": schema})
}

fn path_params(path: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for (name, d) in [
        ("ws", "Workspace id."),
        ("id", "Session id (root or child)."),
        ("turn", "Turn id."),
        ("request", "Interaction request id."),
    ] {
        if path.contains(&format!("{{{name}}}")) {
            out.push(id_param(name, d));
        }
    }
    out
}

fn json_body(schema: Value) -> Value {
    json!({"required": true, "content": {"application/json": {"schema": schema}}})
}

/// One operation object: response schemas from `g` (serialize mode), request bodies from `de`
/// (deserialize mode: a `#[serde(default)]` field is optional in a request).
fn operation(r: &Route, g: &mut SchemaGenerator, de: &mut SchemaGenerator) -> Value {
    let mut responses = Map::new();
    let mut params = path_params(r.path);
    let mut body = None;
    let (summary, ok_status, ok) = match r.op {
        Op::CreateSession => {
            body = Some(json_body(schema_ref(de, sub::<CreateBody>)));
            (
                "Create a root session.",
                "201",
                json_response("Created.", schema_ref(g, sub::<CreateSessionResponse>)),
            )
        }
        Op::ListSessions => {
            params.push(query_param(
                "limit",
                "Page size (clamped to 1..=500; default 50).",
                json!({"type": "integer", "minimum": 0}),
            ));
            params.push(query_param(
                "cursor",
                "The `nextCursor` of the previous page.",
                json!({"type": "string"}),
            ));
            (
                "List root sessions, newest first.",
                "200",
                json_response("One page.", schema_ref(g, sub::<ListSessionsResponse>)),
            )
        }
        Op::GetSession => (
            "A session with its nested children, their last turns, interactions and tool calls.",
            "200",
            json_response("The detail.", schema_ref(g, sub::<SessionDetailResponse>)),
        ),
        Op::DeleteSession => (
            "Delete a root session's tree (a child: that child and its descendants).",
            "200",
            json_response("Deleted.", schema_ref(g, sub::<DeleteResponse>)),
        ),
        Op::ListMessages => {
            params.push(query_param(
                "after",
                "Only messages with `seq` above this.",
                json!({"type": "integer", "minimum": 0}),
            ));
            params.push(query_param(
                "limit",
                "Most messages (clamped to 1..=1000; default 100).",
                json!({"type": "integer", "minimum": 0}),
            ));
            (
                "A session's messages in order.",
                "200",
                json_response("Messages.", schema_ref(g, sub::<MessagesResponse>)),
            )
        }
        Op::TreeMessages => {
            params.push(query_param(
                "limit",
                "Most messages per session (clamped to 1..=1000; default 100).",
                json!({"type": "integer", "minimum": 0}),
            ));
            (
                "The first messages of a session and of each of its nested children, in one read.",
                "200",
                json_response(
                    "Messages per session.",
                    schema_ref(g, sub::<TreeMessagesResponse>),
                ),
            )
        }
        Op::Submit => {
            body = Some(json_body(schema_ref(de, sub::<SubmitBody>)));
            (
                "Send a message to a root session (starts a turn or guides the active one).",
                "200",
                json_response("Accepted.", schema_ref(g, sub::<SubmitResponse>)),
            )
        }
        Op::CancelTurn => (
            "Cancel a turn: a root turn cancels the whole tree, a child turn only that child.",
            "202",
            json_response(
                "The cancel operation was recorded.",
                schema_ref(g, sub::<CancelResponse>),
            ),
        ),
        Op::RespondInteraction => {
            body = Some(json_body(schema_ref(de, sub::<RespondBody>)));
            (
                "Answer a pending interaction (approval, prompt) with one of the offered options.",
                "200",
                json_response("Answered.", schema_ref(g, sub::<OkResponse>)),
            )
        }
        Op::Events => {
            params.push(query_param(
                "after",
                "Start after this outbox sequence (`Last-Event-ID` wins).",
                json!({"type": "integer", "minimum": 0}),
            ));
            params.push(json!({
                "name": "Last-Event-ID", "in": "header", "required": false,
                "description": "Resume after this outbox sequence.",
                "schema": {"type": "string", "pattern": "^[0-9]+$"}
            }));
            let mut variants = Vec::new();
            for (kind, _) in ROW_KINDS {
                variants.push(json!({"$ref": format!("#/components/schemas/Event_{kind}")}));
            }
            variants.push(json!({"$ref": "#/components/schemas/Event_reset"}));
            (
                "Server-Sent Events: one event per outbox row (`event:` = the row's kind, `id:` = \
                 its seq, `data:` = the row as JSON); a `reset` event when the position's next rows \
                 are gone. `x-itemSchema` (OpenAPI 3.2's `itemSchema`, an extension in 3.1) is one event's fields; each row kind's `data` schema \
                 is `OutboxRow_<kind>`.",
                "200",
                json!({
                    "description": "The stream (never ends while the client stays).",
                    "content": {"text/event-stream": {
                        "schema": {"type": "string"},
                        "x-itemSchema": {"oneOf": variants}
                    }}
                }),
            )
        }
        Op::Providers => (
            "The configured provider names.",
            "200",
            json_response("Names.", schema_ref(g, sub::<ProvidersResponse>)),
        ),
        Op::LoginLink => (
            "A one-time login link for the web view.",
            "200",
            json_response("The link.", schema_ref(g, sub::<LoginLinkResponse>)),
        ),
        Op::OpenApi => (
            "This document.",
            "200",
            json_response("OpenAPI 3.1.", json!({"type": "object"})),
        ),
        Op::Metrics => (
            "Prometheus metrics (OpenMetrics text).",
            "200",
            json!({"description": "The exposition.", "content": {
                "application/openmetrics-text": {"schema": {"type": "string"}}}}),
        ),
        Op::Healthz | Op::Readyz => (
            "Ready: version and uptime (no auth); 503 with `ok: false` and `reason: \"database\"` \
             while the store's database is unreachable.",
            "200",
            json_response("Ready.", schema_ref(g, sub::<HealthResponse>)),
        ),
        Op::Livez => (
            "Alive: 200 while the process runs, whatever the database (no auth).",
            "200",
            json_response("Alive.", schema_ref(g, sub::<HealthResponse>)),
        ),
    };
    responses.insert(ok_status.into(), ok);
    let has_ids = !path_params(r.path).is_empty();
    let mut errors: Vec<(&str, &str)> = vec![
        (
            "400",
            "Malformed or refused input (`invalid`); nothing changed.",
        ),
        ("414", "Request target too long (`uri_too_long`)."),
        (
            "431",
            "Too many or too large headers (`headers_too_large`).",
        ),
        ("500", "The daemon's own fault (`internal`)."),
        (
            "503",
            "Stopping, store unreachable or the connection cap reached (`unavailable`); \
             `owner_unreachable`; every provider process busy (`provider_limit`).",
        ),
    ];
    if r.auth {
        errors.push(("401", "Missing or wrong token (`unauthorized`)."));
        errors.push((
            "403",
            "Cookie-only state change without this daemon's Origin (`forbidden`).",
        ));
    }
    if has_ids {
        errors.push(("404", "No such session, turn or interaction (`not_found`)."));
    }
    if body.is_some() {
        errors.push((
            "408",
            "The body did not arrive within the body timeout (`timeout`).",
        ));
        errors.push(("413", "Body too large (`too_large`)."));
        errors.push((
            "415",
            "Body not `application/json` (`unsupported_media_type`).",
        ));
    }
    if matches!(
        r.op,
        Op::CreateSession
            | Op::DeleteSession
            | Op::Submit
            | Op::CancelTurn
            | Op::RespondInteraction
    ) {
        errors.push((
            "409",
            "Refused in this state (`conflict`, `owned_elsewhere`, `commit_conflict`).",
        ));
        errors.push((
            "504",
            "Taken, but its commit did not finish within the command deadline \
             (`outcome_unknown`): read the session to see whether it took effect.",
        ));
    }
    if matches!(r.op, Op::Events | Op::ListMessages | Op::GetSession) {
        errors.push(("410", "Rows already deleted by retention (`pruned`)."));
    }
    for (status, d) in errors {
        let mut resp = error_response(d);
        if status == "503" && matches!(r.op, Op::Healthz | Op::Readyz) {
            resp = json_response(
                "Not ready: the store's database is unreachable (`Retry-After`).",
                schema_ref(g, sub::<HealthResponse>),
            );
        }
        if status == "503" {
            resp["headers"] = json!({"Retry-After": {
                "description": "`owner_unreachable`: seconds until the owner's lease expires.",
                "schema": {"type": "integer"}}});
        }
        responses.insert(status.into(), resp);
    }
    let mut op = json!({
        "operationId": r.op.id(),
        "summary": summary,
        "parameters": params,
        "responses": responses,
    });
    if let Some(b) = body {
        op["requestBody"] = b;
    }
    op["security"] = if r.auth {
        json!([{"bearer": []}, {"cookie": []}, {"clusterSecret": [], "forwardedBy": []}])
    } else {
        json!([])
    };
    if r.forwarded {
        op["description"] = json!(
            "A command on an existing tree: when another daemon on the same PostgreSQL database \
             owns the tree, the request is forwarded to it (one hop, its answer returned \
             unchanged); `X-Tutti-Forwarded-By` with `X-Tutti-Cluster-Secret` marks a forwarded \
             request, which is never forwarded again."
        );
    }
    op
}

fn generator(settings: schemars::generate::SchemaSettings) -> SchemaGenerator {
    settings
        .with(|s| {
            s.definitions_path = "/components/schemas/".into();
            s.meta_schema = None;
        })
        .into_generator()
}

/// The OpenAPI 3.1 document.
///
/// Response and event schemas describe what the server writes (serialize mode: a field that
/// is always written is required, `null` included); request body schemas describe what it
/// reads (deserialize mode: a field with a default is optional).
pub fn document() -> Value {
    let mut g = generator(schemars::generate::SchemaSettings::draft2020_12().for_serialize());
    let mut de = generator(schemars::generate::SchemaSettings::draft2020_12().for_deserialize());
    let mut paths = Map::new();
    for r in ROUTES {
        let item = paths.entry(r.path.to_string()).or_insert_with(|| json!({}));
        item[r.method.as_str()] = operation(r, &mut g, &mut de);
    }
    for f in [
        sub::<ErrorEnvelope>,
        sub::<ResetEvent>,
        sub::<OutboxRow>,
        sub::<Session>,
        sub::<Turn>,
        sub::<Message>,
        sub::<Interaction>,
        sub::<ToolCall>,
        sub::<CancelOperation>,
        sub::<SessionPurged>,
        sub::<Redacted>,
    ] {
        f(&mut g);
    }
    let mut schemas = g.take_definitions(true);
    // The request bodies (their names are theirs alone: no response schema is overwritten).
    for (name, schema) in de.take_definitions(true) {
        schemas.entry(name).or_insert(schema);
    }
    for (kind, payload) in ROW_KINDS {
        schemas.insert(
            format!("OutboxRow_{kind}"),
            json!({
                "description": format!("An outbox row of kind `{kind}`: the SSE data of `event: {kind}`."),
                "allOf": [
                    {"$ref": "#/components/schemas/OutboxRow"},
                    {"type": "object", "properties": {
                        "kind": {"const": kind},
                        "payload": {"$ref": format!("#/components/schemas/{payload}")}
                    }}
                ]
            }),
        );
        schemas.insert(
            format!("Event_{kind}"),
            sse_event(kind, &format!("OutboxRow_{kind}")),
        );
    }
    schemas.insert("Event_reset".into(), sse_event("reset", "ResetEvent"));
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "tuttid",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The HTTP API and event stream of tuttid: provider-native subagents as \
                durable child sessions. JSON is camelCase; every error is the `ErrorEnvelope`.",
            "license": {"name": "MIT OR Apache-2.0", "identifier": "MIT OR Apache-2.0"}
        },
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                    "description": "The daemon's token (`tuttid` prints where it is)."},
                "cookie": {"type": "apiKey", "in": "cookie", "name": "tutti_<port>",
                    "description": "The web view's login cookie (`POST /login` with a one-time \
                        code); a state-changing request needs this daemon's `Origin`."},
                "clusterSecret": {"type": "apiKey", "in": "header",
                    "name": "X-Tutti-Cluster-Secret",
                    "description": "Between daemons on one PostgreSQL database: the database's \
                        cluster secret, on a forwarded request only."},
                "forwardedBy": {"type": "apiKey", "in": "header", "name": "X-Tutti-Forwarded-By",
                    "description": "The forwarding daemon's address (marks a forwarded request)."}
            }
        }
    })
}

/// One SSE event's fields (`event`, `id`, `data` as JSON of `data_schema`).
fn sse_event(kind: &str, data_schema: &str) -> Value {
    json!({
        "description": format!("`event: {kind}`"),
        "type": "object",
        "required": ["event", "id", "data"],
        "properties": {
            "event": {"const": kind},
            "id": {"type": "string", "pattern": "^[0-9]+$"},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"$ref": format!("#/components/schemas/{data_schema}")}
            }
        }
    })
}

// ---- request bodies (the handlers in `crate::api` read them) ----

/// The body of `POST /v1/workspaces/{ws}/agent-sessions`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(crate) struct CreateBody {
    /// A configured provider name (`GET /v1/providers`).
    #[schemars(example = &"demo")]
    pub(crate) provider: String,
    /// Display title (at most 1000 bytes).
    #[serde(default)]
    #[schemars(length(max = 1000))]
    pub(crate) title: Option<String>,
    /// The provider's working directory: an existing directory.
    #[serde(default)]
    pub(crate) cwd: Option<String>,
}

/// The body of `POST .../submit`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct SubmitBody {
    /// The message (1..=131072 bytes).
    #[schemars(length(min = 1, max = 131072), example = &"hello")]
    pub(crate) text: String,
}

/// The body of `POST .../interactions/{request}`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RespondBody {
    /// The answer: one of the options the interaction offered (its shape depends on the
    /// interaction's kind; a refused answer is 400 and leaves the interaction pending).
    pub(crate) response: Value,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_is_in_the_document_once_and_nothing_else() {
        let doc = document();
        let paths = doc["paths"].as_object().expect("paths");
        let mut listed = Vec::new();
        for (path, item) in paths {
            for (method, _) in item.as_object().expect("path item") {
                listed.push((method.clone(), path.clone()));
            }
        }
        let mut routes: Vec<_> = ROUTES
            .iter()
            .map(|r| (r.method.as_str().to_string(), r.path.to_string()))
            .collect();
        listed.sort();
        routes.sort();
        assert_eq!(listed, routes);
        assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn request_fields_with_a_default_are_optional_and_answer_fields_always_written_are_required() {
        let doc = document();
        let s = &doc["components"]["schemas"];
        assert_eq!(s["CreateBody"]["required"], json!(["provider"]));
        let list = s["ListSessionsResponse"]["required"].to_string();
        assert!(
            list.contains("nextCursor") && list.contains("eventSeq"),
            "{list}"
        );
    }

    #[test]
    fn every_reference_resolves_and_every_engine_code_is_documented() {
        let doc = document();
        let text = doc.to_string();
        let schemas = doc["components"]["schemas"].as_object().expect("schemas");
        for part in text.split("\"$ref\":\"#/components/schemas/").skip(1) {
            let name = part.split('"').next().unwrap_or_default();
            assert!(schemas.contains_key(name), "dangling $ref {name}");
        }
        let codes = &schemas["ErrorCode"];
        let listed: Vec<String> = serde_json::to_string(codes)
            .unwrap_or_default()
            .split('"')
            .map(str::to_string)
            .collect();
        for c in ErrorCode::ALL {
            assert!(listed.iter().any(|l| l == c.as_str()), "{c:?}");
        }
        for wire in [
            "WorkspaceAgentSession",
            "WorkspaceAgentTurn",
            "Interaction",
            "ToolCall",
            "Message",
            "CancelOperation",
            "Phase",
            "Outcome",
            "InteractionStatus",
            "CancelState",
        ] {
            assert!(schemas.contains_key(wire), "{wire}");
        }
    }
}
