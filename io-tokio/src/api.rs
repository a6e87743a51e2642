//! The HTTP API (JSON in camelCase) and the event stream (Server-Sent Events of outbox rows).
//!
//! Every `/v1` route needs `Authorization: Bearer <token>` (the scheme matched
//! case-insensitively, RFC 9110 11.1). Every error, including the router's own (unknown route,
//! 405, a malformed query string or path) and the size limits, is the JSON envelope
//! `{"error": {"code", "message"}}`: 400 `invalid`, 401 `unauthorized`, 404 `not_found`,
//! 405 `method_not_allowed`, 408 `timeout` (a body slower than the connection's body timeout, see
//! [`crate::connections`]), 409 `conflict` (or the engine's rejection code), 413 `too_large`
//! (body over [`MAX_BODY`] bytes), 414 `uri_too_long` (over [`MAX_URI`]), 415
//! `unsupported_media_type`, 431 `headers_too_large` (over [`MAX_HEADER_BYTES`] or
//! [`MAX_HEADERS`]), 5xx `internal` / `unavailable`. A head hyper cannot parse, or beyond its own
//! limits (far above these), is answered by hyper before any of this runs; the connection's
//! writer gives that answer the envelope too (see [`crate::connections`]).
//!
//! Several daemons on one PostgreSQL database (issue 21): a command on a tree another daemon
//! owns is forwarded there (see [`crate::forward`]); `409 owned_elsewhere` when it cannot be
//! forwarded again, `503 owner_unreachable` (with `Retry-After`) when the owner does not
//! answer, `409 commit_conflict` when the store refused the command's batch (another writer
//! changed the tree first, or this daemon lost the tree's lease).
//!
//! Identifiers in paths are checked the same way on every route ([`check_id`]). An interaction
//! response is checked against what the interaction offered before it reaches the engine
//! (shapes: [`tutti_core::adapters::response`]); a refused answer is 400 naming the offered
//! options and leaves the interaction pending.

use crate::auth::constant_time_eq;
use crate::clock::new_id;
use crate::daemon::{Daemon, DaemonError};
use crate::follow::{sse_frame, Follower, Streamed};
use crate::forward::forward_commands;
use crate::http::{
    code_of, ApiError, OwnedElsewhere, RequestId, MAX_BODY, MAX_HEADERS, MAX_HEADER_BYTES, MAX_ID,
    MAX_TEXT, MAX_URI, REQUEST_ID, STORE_RETRY_AFTER_SECS,
};
use crate::openapi::{
    CancelResponse, CreateBody, CreateSessionResponse, DeleteResponse, HealthResponse,
    ListSessionsResponse, LoginLinkResponse, MessagesResponse, OkResponse, Op, ProvidersResponse,
    RespondBody, SessionDetailResponse, SubmitBody, SubmitReply, SubmitResponse,
    TreeMessagesResponse, TreeMessagesSession,
};
use crate::reads::ReadError;
use crate::web::WebAuth;
use axum::body::{Body, Bytes};
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, on, MethodFilter, MethodRouter};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::watch;
use tutti_core::model::{Id, InteractionStatus};
use tutti_core::{Command, Input, Reply};

#[derive(Clone)]
struct AppState {
    daemon: Daemon,
    token: Arc<String>,
    /// The web view's login state (one-time codes, the cookie).
    web: Arc<WebAuth>,
    /// Becomes `true` when the daemon stops: open event streams end.
    stop: watch::Receiver<bool>,
}

impl From<DaemonError> for ApiError {
    fn from(e: DaemonError) -> ApiError {
        match e {
            DaemonError::Rejected(r) if r.is_internal() => {
                // The engine's own inconsistency, not the caller's fault: logged (ids only, as
                // the error's text is) and answered 500.
                tracing::error!(error = %r, "engine internal inconsistency");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, r.code(), r.to_string())
            }
            DaemonError::Rejected(r) => {
                let status = match r.code() {
                    "not_found" => StatusCode::NOT_FOUND,
                    "invalid" => StatusCode::BAD_REQUEST,
                    _ => StatusCode::CONFLICT,
                };
                ApiError::new(status, r.code(), r.to_string())
            }
            DaemonError::Storage(m) => ApiError::new(StatusCode::CONFLICT, "conflict", m),
            e @ DaemonError::Unavailable(_) => ApiError::store_unavailable(e.to_string()),
            DaemonError::Stopped => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "daemon stopping",
            ),
            DaemonError::OwnedElsewhere {
                ref owner_address,
                expires_at_ms,
            } => {
                let owner = OwnedElsewhere {
                    owner_address: owner_address.clone(),
                    expires_at_ms,
                };
                ApiError::new(StatusCode::CONFLICT, "owned_elsewhere", e.to_string())
                    .with_owner(owner)
            }
            e @ DaemonError::OutcomeUnknown => ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "outcome_unknown",
                e.to_string(),
            ),
            e @ DaemonError::Conflict => {
                ApiError::new(StatusCode::CONFLICT, "commit_conflict", e.to_string())
            }
            e @ DaemonError::ProviderLimit { .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "provider_limit",
                e.to_string(),
            ),
            DaemonError::Internal(m) => {
                tracing::error!("driver internal failure");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", m)
            }
        }
    }
}

impl From<ReadError> for ApiError {
    fn from(e: ReadError) -> ApiError {
        if e.is_unavailable() {
            ApiError::store_unavailable(e.to_string())
        } else {
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
        }
    }
}

/// Gives every error response the JSON envelope: responses of our handlers already have it;
/// the router's and extractors' own (405, path and query rejections, body limits) come as
/// plain text or empty and are wrapped here, their text kept as the message.
async fn envelope(resp: Response) -> Response {
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 4096)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    let mut out = ApiError::new(status, code_of(status), message).into_response();
    for name in [
        axum::http::header::ALLOW,
        axum::http::header::WWW_AUTHENTICATE,
    ] {
        if let Some(v) = parts.headers.get(&name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    out
}

/// 414 and 431 with the envelope, below hyper's own (much larger) limits.
async fn head_limits(req: Request, next: Next) -> Response {
    let uri = req.uri().path_and_query().map_or(0, |p| p.as_str().len());
    if uri > MAX_URI {
        return ApiError::new(
            StatusCode::URI_TOO_LONG,
            "uri_too_long",
            format!("request target is {uri} bytes; at most {MAX_URI}"),
        )
        .into_response();
    }
    let headers = req.headers();
    let bytes: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if headers.len() > MAX_HEADERS || bytes > MAX_HEADER_BYTES {
        return ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            format!(
                "{} headers of {bytes} bytes; at most {MAX_HEADERS} headers of {MAX_HEADER_BYTES} bytes",
                headers.len()
            ),
        )
        .into_response();
    }
    next.run(req).await
}

/// Builds the router (event streams end only when their client goes away).
pub fn router(daemon: Daemon, token: String) -> Router {
    router_with_shutdown(daemon, token, watch::channel(false).1)
}

/// Builds the router; when `stop` becomes `true` every open event stream ends (so a graceful
/// shutdown does not wait for SSE clients to disconnect).
pub fn router_with_shutdown(daemon: Daemon, token: String, stop: watch::Receiver<bool>) -> Router {
    let web = WebAuth::new(token.clone());
    router_with_web(daemon, token, stop, web)
}

/// Builds the router with the web view ([`crate::web`]) at `/`, whose one-time login codes
/// `web` issues.
pub fn router_with_web(
    daemon: Daemon,
    token: String,
    stop: watch::Receiver<bool>,
    web: Arc<WebAuth>,
) -> Router {
    let state = AppState {
        daemon,
        token: Arc::new(token),
        web: web.clone(),
        stop,
    };
    // Issue 21: the commands of existing trees are forwarded to the tree's owner (see
    // [`crate::forward`]).
    let fwd = middleware::from_fn_with_state(state.daemon.clone(), forward_commands);
    // Every API route comes from the one route table the OpenAPI document is built from.
    let mut v1 = Router::new();
    let mut open = Router::new();
    for r in crate::openapi::ROUTES {
        let mut m = handler(r.op, r.method);
        if r.forwarded {
            m = m.layer(fwd.clone());
        }
        if r.auth {
            v1 = v1.route(r.path, m);
        } else {
            open = open.route(r.path, m);
        }
    }
    let v1 = v1.route_layer(middleware::from_fn_with_state(state.clone(), auth));
    open.merge(v1)
        .merge(crate::web::router(web))
        .fallback(|| async { ApiError::not_found("route") })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn(head_limits))
        .layer(middleware::map_response(envelope))
        .layer(middleware::from_fn(request_span))
        .with_state(state)
}

/// The handler of one operation of the route table, for the table's method.
fn handler(op: Op, method: crate::openapi::Method) -> MethodRouter<AppState> {
    let filter = match method {
        crate::openapi::Method::Get => MethodFilter::GET,
        crate::openapi::Method::Post => MethodFilter::POST,
        crate::openapi::Method::Delete => MethodFilter::DELETE,
    };
    match op {
        Op::CreateSession => on(filter, create),
        Op::ListSessions => on(filter, list),
        Op::GetSession => on(filter, detail),
        Op::DeleteSession => on(filter, remove),
        Op::ListMessages => on(filter, messages),
        Op::TreeMessages => on(filter, tree_messages),
        Op::Submit => on(filter, submit),
        Op::CancelTurn => on(filter, cancel),
        Op::RespondInteraction => on(filter, respond),
        Op::Events => on(filter, events),
        Op::Providers => on(filter, providers),
        Op::LoginLink => on(filter, login_link),
        Op::OpenApi => on(filter, openapi),
        Op::Metrics => on(filter, metrics),
        Op::Healthz | Op::Readyz => on(filter, healthz),
        Op::Livez => on(filter, livez),
    }
}

/// `GET /v1/openapi.json`: the OpenAPI 3.1 document ([`crate::openapi::document`]).
async fn openapi() -> Json<Value> {
    Json(crate::openapi::document())
}

/// `GET /metrics` on its own listener (`tuttid serve --metrics-listen ADDR`, loopback unless
/// `--allow-non-loopback`): no auth there, nothing else served.
pub fn metrics_router(daemon: Daemon) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(d): State<Daemon>| async move { metrics_response(&d).await }),
        )
        .layer(middleware::from_fn(request_span))
        .with_state(daemon)
}

/// `GET /healthz` (no auth): liveness, the version and the uptime (for `tutti status`).
///
/// Issue 34: while the store's database is unreachable it answers `503` with `"ok": false`,
/// `"reason": "database"` and `Retry-After` (the daemon cannot serve commands or reads then).
/// `/readyz` is the same answer (readiness: the daemon can serve); `/livez` answers `200`
/// while the process runs, whatever the database (liveness: restarting the daemon would not
/// help).
async fn healthz(State(s): State<AppState>) -> Response {
    let down = s.daemon.store_health().is_some_and(|h| !h.is_up());
    let body = HealthResponse {
        ok: !down,
        version: env!("CARGO_PKG_VERSION").to_string(),
        uptime_seconds: s.daemon.metrics().uptime().as_secs(),
        reason: down.then(|| "database".to_string()),
    };
    if !down {
        return Json(body).into_response();
    }
    let mut resp = (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    resp.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from(STORE_RETRY_AFTER_SECS),
    );
    resp
}

/// `GET /livez` (no auth): `200` while the process runs (see [`healthz`]).
async fn livez(State(s): State<AppState>) -> Json<HealthResponse> {
    Json(HealthResponse {
        ok: true,
        version: env!("CARGO_PKG_VERSION").to_string(),
        uptime_seconds: s.daemon.metrics().uptime().as_secs(),
        reason: None,
    })
}

/// `GET /metrics` (behind the API's auth): the Prometheus exposition (see [`crate::metrics`]).
async fn metrics(State(s): State<AppState>) -> Response {
    metrics_response(&s.daemon).await
}

/// The exposition in the OpenMetrics text format, which `prometheus-client` writes and
/// Prometheus scrapes (a superset of the classic text format, ended by `# EOF`).
async fn metrics_response(d: &Daemon) -> Response {
    match d.metrics_text().await {
        Ok(text) => (
            [(
                axum::http::header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// A client's request id is kept when it is 1..=[`MAX_ID`] visible ASCII characters;
/// otherwise (absent or not usable) one is generated: the process's start time and a counter,
/// in hex, unique within the host.
fn request_id(headers: &HeaderMap) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    if let Some(v) = headers.get(REQUEST_ID).and_then(|v| v.to_str().ok()) {
        if !v.is_empty() && v.len() <= MAX_ID && v.bytes().all(|b| b.is_ascii_graphic()) {
            return v.to_string();
        }
    }
    static EPOCH: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let epoch = *EPOCH.get_or_init(|| crate::clock::now_ms().max(0) as u64);
    format!("{epoch:x}-{:x}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// One span per API request carrying its id, method and path (paths hold ids only, never
/// content; the query is left out), so `RUST_LOG=debug` tells a request's story; the id is
/// echoed in `X-Request-Id`.
async fn request_span(mut req: Request, next: Next) -> Response {
    use tracing::Instrument;
    let id = request_id(req.headers());
    req.extensions_mut().insert(RequestId(id.clone()));
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        method = %req.method(),
        path = %req.uri().path()
    );
    let mut resp = next.run(req).instrument(span.clone()).await;
    span.in_scope(|| tracing::debug!(status = resp.status().as_u16(), "request done"));
    if let Ok(v) = axum::http::HeaderValue::from_str(&id) {
        resp.headers_mut().insert(REQUEST_ID, v);
    }
    resp
}

/// The bearer header, or (for the web view) the login cookie; a state-changing request
/// authenticated by the cookie alone must come from the same origin (issue 20: "state-changing
/// requests with the cookie are protected against cross-site requests (check `Origin`)").
async fn auth(State(s): State<AppState>, headers: HeaderMap, req: Request, next: Next) -> Response {
    // Issue 21: a command forwarded by another daemon on the same database is authenticated by
    // the cluster secret alone (see [`crate::forward`]).
    if crate::forward::is_forwarded(&headers) {
        if s.daemon.cluster().is_some_and(|c| c.accepts(&headers)) {
            return next.run(req).await;
        }
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a forwarded request needs this database's cluster secret",
        )
        .into_response();
    }
    let by_bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(bearer)
        .is_some_and(|t| constant_time_eq(t.as_bytes(), s.token.as_bytes()));
    let by_cookie = !by_bearer && s.web.cookie_ok(&headers);
    if by_cookie && crate::web::changes_state(req.method()) && !crate::web::same_origin(&headers) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "a state-changing request with the login cookie needs an Origin of this daemon",
        )
        .into_response();
    }
    if !(by_bearer || by_cookie) {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token",
        )
        .into_response();
    }
    next.run(req).await
}

/// The token of an `Authorization: Bearer <token>` value; the scheme is case-insensitive
/// (RFC 9110 11.1: "It uses a case-insensitive token").
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start())
}

/// Bidirectional-text controls (embeddings, overrides, isolates, marks): they make an id
/// display as something else.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{061C}' | '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// The one identifier check of every route and body (workspace, session, turn, request ids):
/// 1 to [`MAX_ID`] bytes; no `/` or `\\`; not `.` or `..`; no control characters; no
/// bidirectional-text controls and no other invisible format characters (zero-width space,
/// joiners, byte-order mark).
pub fn check_id(what: &str, id: &str) -> Result<Id, ApiError> {
    let why = if id.is_empty() {
        Some("is empty".to_string())
    } else if id.len() > MAX_ID {
        Some(format!("is {} bytes; at most {MAX_ID}", id.len()))
    } else if id == "." || id == ".." {
        Some("may not be . or ..".into())
    } else if id.contains(['/', '\\']) {
        Some("may not contain / or \\".into())
    } else if id.chars().any(|c| {
        c.is_control()
            || is_bidi_control(c)
            || matches!(c, '\u{200B}'..='\u{200D}' | '\u{2060}' | '\u{FEFF}')
    }) {
        Some("may not contain control, bidirectional or invisible format characters".into())
    } else {
        None
    };
    match why {
        Some(why) => Err(ApiError::invalid(format!("invalid {what}: it {why}"))),
        None => Ok(Id::from(id)),
    }
}

async fn read<T: Send + 'static>(
    d: &Daemon,
    f: impl FnOnce(&dyn crate::reads::Reads) -> T + Send + 'static,
) -> Result<T, ApiError> {
    let d = d.clone();
    // Issue 34: a read of a store that does not answer (a frozen connection) is answered 503
    // at the deadline; the blocked read itself ends with the connection's own timeouts.
    match tokio::time::timeout(
        READ_DEADLINE,
        tokio::task::spawn_blocking(move || d.read(f)),
    )
    .await
    {
        Ok(r) => r
            .map_err(|e| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            })?
            .map_err(ApiError::from),
        Err(_) => {
            tracing::warn!("store read did not finish within its deadline");
            Err(ApiError::store_unavailable(format!(
                "the store did not answer within {} s",
                READ_DEADLINE.as_secs()
            )))
        }
    }
}

/// How long an API read of the store may take before it is answered `503 unavailable`.
pub const READ_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// The session must exist and belong to the workspace.
async fn session_in(
    d: &Daemon,
    ws: &str,
    id: &str,
) -> Result<tutti_core::model::Session, ApiError> {
    check_id("workspace id", ws)?;
    let id = check_id("session id", id)?.to_string();
    let s = read(d, move |r| r.session(&id))
        .await?
        .map_err(ApiError::from)?
        .ok_or_else(|| ApiError::not_found("session"))?;
    if &*s.workspace_id != ws {
        return Err(ApiError::not_found("session"));
    }
    Ok(s)
}

async fn create(
    State(s): State<AppState>,
    Path(ws): Path<String>,
    body: Result<Json<CreateBody>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(b) = body?;
    let ws = check_id("workspace id", &ws)?;
    let caps = s
        .daemon
        .providers()
        .capabilities(&b.provider)
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "unknown provider (known: {})",
                s.daemon.providers().names().join(", ")
            ))
        })?;
    if b.title.as_ref().is_some_and(|t| t.len() > 1000) {
        return Err(ApiError::invalid("title too long"));
    }
    if let Some(cwd) = &b.cwd {
        // Refused at create rather than at the first submit, where the provider would fail to
        // start. Choice: it must be an existing directory (relative paths are taken relative to
        // the daemon's working directory, as the provider process would).
        if !std::path::Path::new(cwd).is_dir() {
            return Err(ApiError::invalid(
                "cwd does not exist or is not a directory",
            ));
        }
    }
    let id: Id = new_id("s").into();
    if let Some(cwd) = b.cwd {
        s.daemon.set_cwd(id.clone(), cwd);
    }
    s.daemon
        .call(Input::Command(Command::CreateSession {
            agent_session_id: id.clone(),
            workspace_id: ws,
            provider: b.provider.into(),
            title: b.title,
            capabilities: Some(caps),
        }))
        .await?;
    let d = s.daemon.clone();
    let session = read(&d, move |r| r.session(&id)).await?.ok().flatten();
    Ok((StatusCode::CREATED, Json(CreateSessionResponse { session })).into_response())
}

#[derive(Deserialize)]
struct ListQuery {
    limit: Option<usize>,
    cursor: Option<String>,
}

async fn list(
    State(s): State<AppState>,
    Path(ws): Path<String>,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<ListSessionsResponse>, ApiError> {
    let Query(q) = q?;
    check_id("workspace id", &ws)?;
    let limit = q.limit.unwrap_or(50).clamp(1, 500);
    // `eventSeq` is read first: every change after it comes on `/v1/events?after=eventSeq`.
    let (seq, page) = read(&s.daemon, move |r| {
        (
            r.last_outbox_seq().ok(),
            r.roots(&ws, limit, q.cursor.as_deref()),
        )
    })
    .await?;
    let page = page.map_err(|e| {
        if e.is_unavailable() {
            ApiError::from(e)
        } else {
            ApiError::invalid(e.to_string())
        }
    })?;
    Ok(Json(ListSessionsResponse {
        sessions: page.sessions,
        next_cursor: page.next,
        event_seq: seq,
    }))
}

async fn detail(
    State(s): State<AppState>,
    Path((ws, id)): Path<(String, String)>,
) -> Result<Json<SessionDetailResponse>, ApiError> {
    check_id("workspace id", &ws)?;
    check_id("session id", &id)?;
    // One read transaction: the session, its nested children, their turns and interactions are
    // one durable snapshot (never half of a step).
    let out = read(
        &s.daemon,
        move |r| -> Result<Option<SessionDetailResponse>, ReadError> {
            // Read first: every change after it comes on `/v1/events?after=eventSeq`.
            let seq = r.last_outbox_seq()?;
            let Some(d) = r.session_detail(&id)? else {
                return Ok(None);
            };
            if *d.session.workspace_id != *ws {
                return Ok(None);
            }
            let turns: Vec<_> = std::iter::once(&d.session)
                .chain(d.child_sessions.iter())
                .filter_map(|s| s.last_turn_id.as_ref())
                .filter_map(|t| r.turn(t).ok().flatten())
                .collect();
            let root = d.session.tree_root_id().clone();
            let members: std::collections::BTreeSet<&Id> = std::iter::once(&d.session)
                .chain(d.child_sessions.iter())
                .map(|s| &s.id)
                .collect();
            let tree = r.load_tree(&root)?;
            let (interactions, tool_calls) = tree
                .map(|t| (t.interactions, t.tool_calls))
                .unwrap_or_default();
            let interactions: Vec<_> = interactions
                .into_iter()
                .filter(|i| members.contains(&i.agent_session_id))
                .collect();
            let tool_calls: Vec<_> = tool_calls
                .into_iter()
                .filter(|c| members.contains(&c.agent_session_id))
                .collect();
            Ok(Some(SessionDetailResponse {
                session: d.session,
                child_sessions: d.child_sessions,
                turns,
                interactions,
                tool_calls,
                event_seq: seq,
            }))
        },
    )
    .await?
    .map_err(ApiError::from)?
    .ok_or_else(|| ApiError::not_found("session"))?;
    Ok(Json(out))
}

/// `GET /v1/providers`: the configured provider names (the web view's create form offers them).
async fn providers(State(s): State<AppState>) -> Json<ProvidersResponse> {
    Json(ProvidersResponse {
        providers: s
            .daemon
            .providers()
            .names()
            .into_iter()
            .map(|n| n.to_string())
            .collect(),
    })
}

/// `POST /v1/login-links`: a new one-time login link path for the web view.
async fn login_link(State(s): State<AppState>) -> Result<Json<LoginLinkResponse>, ApiError> {
    let code = s
        .web
        .issue_code()
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    Ok(Json(LoginLinkResponse {
        path: crate::web::login_path(&code, None),
    }))
}

#[derive(Deserialize)]
struct MessagesQuery {
    after: Option<u64>,
    limit: Option<usize>,
}

async fn messages(
    State(s): State<AppState>,
    Path((ws, id)): Path<(String, String)>,
    q: Result<Query<MessagesQuery>, QueryRejection>,
) -> Result<Json<MessagesResponse>, ApiError> {
    let Query(q) = q?;
    session_in(&s.daemon, &ws, &id).await?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let msgs = read(&s.daemon, move |r| r.messages(&id, q.after, limit))
        .await?
        .map_err(ApiError::from)?;
    Ok(Json(MessagesResponse { messages: msgs }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TreeMessagesQuery {
    limit: Option<usize>,
}

/// `GET .../agent-sessions/{id}/tree-messages?limit=N`: the first `N` messages (default 100,
/// 1 to 1000) of the session and of each of its nested children, in one read transaction with
/// the event-stream position it reflects: `{"eventSeq", "sessions": [{"agentSessionId",
/// "messages", "more"}]}` (`more`: the session has messages beyond these; page on with
/// `.../{that session}/messages?after=<last seq>`). With the detail, what a view of a tree
/// needs in two requests, however many lanes it has; every later change comes on
/// `/v1/events?after=eventSeq` as rows that carry the whole entity (issue 32: "one read per
/// change, bounded").
async fn tree_messages(
    State(s): State<AppState>,
    Path((ws, id)): Path<(String, String)>,
    q: Result<Query<TreeMessagesQuery>, QueryRejection>,
) -> Result<Json<TreeMessagesResponse>, ApiError> {
    let Query(q) = q?;
    check_id("workspace id", &ws)?;
    check_id("session id", &id)?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let out = read(
        &s.daemon,
        move |r| -> Result<Option<TreeMessagesResponse>, ReadError> {
            let seq = r.last_outbox_seq()?;
            let Some(d) = r.session_detail(&id)? else {
                return Ok(None);
            };
            if *d.session.workspace_id != *ws {
                return Ok(None);
            }
            let mut sessions = Vec::new();
            for x in std::iter::once(&d.session).chain(d.child_sessions.iter()) {
                let mut msgs = r.messages(&x.id, None, limit + 1)?;
                let more = msgs.len() > limit;
                msgs.truncate(limit);
                sessions.push(TreeMessagesSession {
                    agent_session_id: x.id.clone(),
                    messages: msgs,
                    more,
                });
            }
            Ok(Some(TreeMessagesResponse {
                event_seq: seq,
                sessions,
            }))
        },
    )
    .await?
    .map_err(ApiError::from)?
    .ok_or_else(|| ApiError::not_found("session"))?;
    Ok(Json(out))
}

async fn submit(
    State(s): State<AppState>,
    Path((ws, id)): Path<(String, String)>,
    body: Result<Json<SubmitBody>, JsonRejection>,
) -> Result<Json<SubmitResponse>, ApiError> {
    let Json(b) = body?;
    if b.text.is_empty() || b.text.len() > MAX_TEXT {
        return Err(ApiError::invalid("text must be 1..=131072 bytes"));
    }
    session_in(&s.daemon, &ws, &id).await?;
    let step = s
        .daemon
        .call(Input::Command(Command::Submit {
            agent_session_id: check_id("session id", &id)?,
            turn_id: new_id("t").into(),
            text: b.text,
        }))
        .await?;
    let (reply, turn) = match step.reply {
        Some(Reply::Started { turn_id }) => (SubmitReply::Started, turn_id),
        Some(Reply::Appended { turn_id }) => (SubmitReply::Appended, turn_id),
        Some(Reply::PendingUnsupported { turn_id }) => (SubmitReply::PendingUnsupported, turn_id),
        _ => {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "unexpected reply",
            ))
        }
    };
    Ok(Json(SubmitResponse {
        reply,
        turn_id: turn,
    }))
}

async fn cancel(
    State(s): State<AppState>,
    Path((ws, id, turn)): Path<(String, String, String)>,
) -> Result<Response, ApiError> {
    session_in(&s.daemon, &ws, &id).await?;
    // Text the provider streamed before the cancel is recorded first, on the still-active turn:
    // the driver flushes the root adapter's buffered text right before it decides the cancel.
    let step = s
        .daemon
        .call(Input::Command(Command::CancelTurn {
            operation_id: new_id("op").into(),
            agent_session_id: check_id("session id", &id)?,
            turn_id: check_id("turn id", &turn)?,
        }))
        .await?;
    match step.reply {
        Some(Reply::CancelAccepted { operation_id }) => {
            Ok((StatusCode::ACCEPTED, Json(CancelResponse { operation_id })).into_response())
        }
        _ => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "unexpected reply",
        )),
    }
}

async fn respond(
    State(s): State<AppState>,
    Path((ws, id, turn, request)): Path<(String, String, String, String)>,
    body: Result<Json<RespondBody>, JsonRejection>,
) -> Result<Json<OkResponse>, ApiError> {
    let Json(b) = body?;
    session_in(&s.daemon, &ws, &id).await?;
    let turn_id = check_id("turn id", &turn)?;
    let request_id = check_id("request id", &request)?;
    let (t, r) = (turn_id.to_string(), request_id.to_string());
    let found = read(&s.daemon, move |st| st.interaction(&t, &r))
        .await?
        .map_err(ApiError::from)?;
    // Only a pending interaction of this session is checked here; anything else is the
    // engine's to refuse (not found, already answered, ...), as before.
    if let Some(i) =
        found.filter(|i| i.status == InteractionStatus::Pending && *i.agent_session_id == *id)
    {
        tutti_core::adapters::response::check_response(&i.kind, &i.payload, &b.response)
            .map_err(|e| ApiError::invalid(format!("response refused: {e}")))?;
    }
    s.daemon
        .call(Input::Command(Command::RespondInteraction {
            agent_session_id: check_id("session id", &id)?,
            turn_id,
            request_id,
            response: b.response,
        }))
        .await?;
    Ok(Json(OkResponse { ok: true }))
}

async fn remove(
    State(s): State<AppState>,
    Path((ws, id)): Path<(String, String)>,
) -> Result<Json<DeleteResponse>, ApiError> {
    session_in(&s.daemon, &ws, &id).await?;
    let step = s
        .daemon
        .call(Input::Command(Command::DeleteSession {
            agent_session_id: check_id("session id", &id)?,
        }))
        .await?;
    let n = match step.reply {
        Some(Reply::Deleted { sessions }) => sessions,
        _ => 0,
    };
    Ok(Json(DeleteResponse {
        deleted_sessions: n,
    }))
}

#[derive(Deserialize)]
struct EventsQuery {
    after: Option<u64>,
}

/// `GET /v1/events`: outbox rows as SSE; `id:` is the outbox sequence; resume with
/// `Last-Event-ID` or `?after=`. Each client follows the outbox at its own pace (see
/// [`Follower`]: from the file while behind, from each commit's rows once caught up), so a slow
/// client never blocks the engine.
///
/// A position whose next rows retention already deleted (`0 < position < prunedThrough`) gets
/// one `event: reset` first, with `id:` = `prunedThrough` (so a reconnect resumes after it) and
/// data `{"requestedAfter": N, "prunedThrough": M, "oldestSeq": M + 1}`; the stream then goes on
/// with the oldest kept row (seq above `prunedThrough`). The client should reload what it shows
/// from the API: the rows in between are gone. A position beyond the newest row gets the same
/// reset with `prunedThrough` = the newest seq (see [`Follower`]).
async fn events(
    State(s): State<AppState>,
    headers: HeaderMap,
    q: Result<Query<EventsQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q?;
    // An unparseable position is refused: replaying from row 1 instead would hand the client
    // every row again as if new.
    let header_after = match headers.get("last-event-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    ApiError::invalid("Last-Event-ID must be an outbox sequence number")
                })?,
        ),
    };
    let cursor = header_after.or(q.after).unwrap_or(0);
    let follower = Follower::new(&s.daemon, cursor);
    let stop = s.stop.clone();
    // A comment line every `KEEP_ALIVE` whether rows flow or not (choice: no timer to reset per
    // write), so proxies and clients see a live connection.
    let mut keep_alive =
        tokio::time::interval_at(tokio::time::Instant::now() + KEEP_ALIVE, KEEP_ALIVE);
    keep_alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Issue 33: the response's body polls the follower itself (no task and channel of its own
    // per follower: one wake-up per follower and commit), and writes the events of one read or
    // commit as one buffer: a live row's event is rendered once for all followers and a
    // one-row commit's bytes go out as they are (`LiveRow::sse_frame`). Interrupting a wait
    // for rows (keep-alive, stop) loses none: the follower's position moves only when it
    // returns rows. The stop signal's wait is made once and kept (not a new one per write).
    let stop: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(async move {
        let mut stop = stop;
        stopped(&mut stop).await
    });
    let stream = futures::stream::unfold(
        (follower, stop, keep_alive),
        |(mut follower, mut stop, mut keep_alive)| async move {
            let frame = tokio::select! {
                biased;
                _ = &mut stop => return None,
                r = follower.next_stream() => match r.ok()? {
                    Streamed::Events(events) => events,
                    Streamed::Reset {
                        requested_after,
                        pruned_through,
                    } => {
                        let data = json!({
                            "requestedAfter": requested_after,
                            "prunedThrough": pruned_through,
                            "oldestSeq": pruned_through + 1,
                        });
                        sse_frame(pruned_through, "reset", &data.to_string()).ok()?
                    }
                },
                _ = keep_alive.tick() => Bytes::from_static(b":\n\n"),
            };
            Some((Ok::<_, Infallible>(frame), (follower, stop, keep_alive)))
        },
    );
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// How often an idle or busy event stream writes a comment line.
const KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(15);

/// Resolves when the daemon stops; never when there is no stop signal (its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    if stop.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}
