//! The HTTP layer's leaves: the error envelope every answer uses (see [`crate::api`] for the
//! codes), the request limits, the request-id header and the response extension that tells
//! the forwarding layer where a tree's owner is. Nothing here knows the daemon: the routes
//! ([`crate::api`], [`crate::forward`], [`crate::web`]) and the connection layer
//! ([`crate::connections`]) build on it.

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// Largest accepted request body.
pub const MAX_BODY: usize = 256 * 1024;
/// Largest accepted message text.
pub const MAX_TEXT: usize = 128 * 1024;
/// Longest accepted request target (path and query), in bytes.
pub const MAX_URI: usize = 8 * 1024;
/// Largest accepted total size of the request's header names and values, in bytes.
pub const MAX_HEADER_BYTES: usize = 32 * 1024;
/// Most request headers accepted.
pub const MAX_HEADERS: usize = 64;
/// Longest identifier (workspace, session, turn, request id) in bytes.
pub const MAX_ID: usize = 200;

/// The request id header (issue 22: "request ids echoed in an `X-Request-Id` header").
pub const REQUEST_ID: &str = "x-request-id";

/// Set by the API on a `409 owned_elsewhere` response (a response extension, not sent): where
/// the tree's owner is, for `crate::forward::forward_commands`.
#[derive(Debug, Clone)]
pub struct OwnedElsewhere {
    /// The owner's listen address.
    pub owner_address: String,
    /// When its lease expires (wall-clock milliseconds).
    pub expires_at_ms: i64,
}

/// The request's id (a request extension set by the API's request span), sent on with a
/// forwarded request.
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// An API error.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
    /// For `owned_elsewhere`: where the owner is (a response extension for
    /// `crate::forward::forward_commands`).
    owner: Option<OwnedElsewhere>,
    /// The `Retry-After` header, in seconds.
    retry_after: Option<u64>,
}

/// `Retry-After` of a `503 unavailable` answered while the store is unreachable (issue 34):
/// one second, the order of the store's longest reconnect backoff.
pub const STORE_RETRY_AFTER_SECS: u64 = 1;

impl ApiError {
    pub(crate) fn new(
        status: StatusCode,
        code: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            owner: None,
            retry_after: None,
        }
    }

    /// The same error, carrying where the tree's owner is (for `owned_elsewhere`).
    pub(crate) fn with_owner(mut self, owner: OwnedElsewhere) -> ApiError {
        self.owner = Some(owner);
        self
    }

    /// `503 unavailable` with `Retry-After`: the store cannot be reached (issue 34).
    pub(crate) fn store_unavailable(message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message);
        e.retry_after = Some(STORE_RETRY_AFTER_SECS);
        e
    }
    pub(crate) fn not_found(what: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{what} not found"),
        )
    }
    pub(crate) fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (
            self.status,
            Json(json!({"error": {"code": self.code, "message": self.message}})),
        )
            .into_response();
        if let Some(owner) = self.owner {
            resp.extensions_mut().insert(owner);
        }
        if let Some(secs) = self.retry_after {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(secs),
            );
        }
        resp
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> ApiError {
        // A body that is too large or not JSON keeps its status (413, 415); malformed JSON and
        // JSON of the wrong shape are both 400 `invalid` (not axum's 422).
        let status = match e.status() {
            s @ (StatusCode::PAYLOAD_TOO_LARGE | StatusCode::UNSUPPORTED_MEDIA_TYPE) => s,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError::new(
            status,
            code_of(status),
            format!("malformed request body: {}", e.body_text()),
        )
    }
}

impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> ApiError {
        ApiError::invalid(format!("malformed query string: {}", e.body_text()))
    }
}

/// The envelope's `code` for an error status.
pub(crate) fn code_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "invalid",
        401 => "unauthorized",
        404 => "not_found",
        405 => "method_not_allowed",
        408 => "timeout",
        403 => "forbidden",
        409 => "conflict",
        413 => "too_large",
        414 => "uri_too_long",
        415 => "unsupported_media_type",
        431 => "headers_too_large",
        503 => "unavailable",
        s if s >= 500 => "internal",
        _ => "invalid",
    }
}
