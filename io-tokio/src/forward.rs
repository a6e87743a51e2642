//! Forwarding commands to the daemon that owns the tree (issue 21: "A command (submit, cancel,
//! answer, delete) that reaches a daemon which does not own the tree is forwarded to the owner
//! (its address is in the lease) or, if the lease expired, claimed").
//!
//! Several daemons share one PostgreSQL database; each tree's provider runs on the daemon that
//! holds the tree's lease. A command route for an existing tree (`submit`, `cancel`, an
//! interaction's answer, `DELETE`) reaching another daemon is handled so:
//!
//! - The engine thread finds the lease held, unexpired, by another daemon and answers
//!   [`DaemonError::OwnedElsewhere`](crate::daemon::DaemonError::OwnedElsewhere) (nothing
//!   changed). [`forward_commands`] (a layer on those routes only) then sends the same request
//!   (method, path, query, body, `Content-Type`, `X-Request-Id`) to the owner's address in one
//!   HTTP hop and returns the owner's answer (status, `Content-Type` and body) unchanged.
//! - An expired (or released) lease is claimed by the receiving daemon, which handles the
//!   command itself (see `Housekeeping::acquire`); nothing is forwarded.
//! - Owner unreachable (connection refused, or no answer within its lease's remaining time
//!   ([`answer_wait`]): it died or is paused, and its lease had not expired yet): `503` with
//!   code `owner_unreachable` and `Retry-After` = the lease's
//!   remaining time in whole seconds (at least 1); nothing changed here. After the lease
//!   expires the same command is claimed and handled by the receiving daemon.
//!
//! Authentication between daemons. Choice: each daemon's bearer token is its own (token files
//! differ), so a forwarding daemon proves itself with the database's cluster secret
//! (`tutti_postgres::cluster`: one random secret per database, stored by the first daemon that
//! starts) in [`CLUSTER_SECRET`], together with [`FORWARDED_BY`] (the forwarder's address).
//! A request carrying [`FORWARDED_BY`] is authenticated by the cluster secret only (compared in
//! constant time; missing or wrong: `401 unauthorized`, whatever bearer token it carries), and
//! is never forwarded again: an owner that no longer owns the tree answers `409
//! owned_elsewhere` itself, so there is no loop and at most one hop. A daemon on SQLite has no
//! cluster: a request with [`FORWARDED_BY`] is refused there.

pub use crate::auth::{is_forwarded, Cluster, CLUSTER_SECRET, FORWARDED_BY};
use crate::daemon::Daemon;
use crate::http::{ApiError, OwnedElsewhere, RequestId, MAX_BODY, REQUEST_ID};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::io::Read;
use std::time::Duration;
use tracing::{debug, warn};

/// How long a forwarder waits to connect to the owner.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest a forwarder waits for the owner's whole answer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// The shortest: a live owner renews its lease well before it expires, so a slow answer from a
/// live owner is not cut off just before its renewal.
pub const MIN_ANSWER_WAIT: Duration = Duration::from_secs(2);

/// How long a forwarder waits for the owner's answer (issue 34: "forwarding waits at most the
/// lease's remaining time (then 503)"): the owner's lease time left as the receiver read it,
/// within [`MIN_ANSWER_WAIT`]..=[`ANSWER_TIMEOUT`]. A paused or partitioned owner's lease
/// expires by then, so the client's retry (after `Retry-After`) is claimed and handled here
/// instead of waiting out a fixed timeout.
pub fn answer_wait(expires_at_ms: i64, now_ms: i64) -> Duration {
    let left = u64::try_from(expires_at_ms.saturating_sub(now_ms)).unwrap_or(0);
    Duration::from_millis(left).clamp(MIN_ANSWER_WAIT, ANSWER_TIMEOUT)
}
/// The largest owner answer passed back (a command's answer is a few hundred bytes).
const MAX_ANSWER: u64 = 1 << 20;

/// The layer on the command routes of existing trees: runs the route; when it answers
/// [`OwnedElsewhere`] and the request was not itself forwarded, sends the request to the owner
/// and returns its answer (see the module docs).
pub async fn forward_commands(State(d): State<Daemon>, req: Request, next: Next) -> Response {
    let Some(cluster) = d.cluster().cloned() else {
        return next.run(req).await;
    };
    if is_forwarded(req.headers()) {
        return next.run(req).await;
    }
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("request body over {MAX_BODY} bytes"),
            )
            .into_response()
        }
    };
    let method = parts.method.clone();
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_string(), |p| p.as_str().to_string());
    let content_type = parts
        .headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let request_id = parts.extensions.get::<RequestId>().map(|r| r.0.clone());
    let resp = next
        .run(Request::from_parts(parts, Body::from(body.clone())))
        .await;
    let Some(owner) = resp.extensions().get::<OwnedElsewhere>().cloned() else {
        return resp;
    };
    let out = Forward {
        owner: owner.owner_address.clone(),
        method: method.as_str().to_string(),
        target,
        content_type,
        request_id,
        body: body.to_vec(),
        wait: answer_wait(owner.expires_at_ms, crate::clock::now_ms()),
    };
    let secret = cluster.secret.clone();
    let from = cluster.address.clone();
    let sent = tokio::task::spawn_blocking(move || out.send(&secret, &from)).await;
    match sent {
        Ok(Ok(answer)) => {
            debug!(owner = %owner.owner_address, status = answer.status, "command forwarded to the tree's owner");
            answer.into_response()
        }
        Ok(Err(e)) => {
            warn!(owner = %owner.owner_address, error = %e, "the tree's owner did not answer a forwarded command");
            unreachable_owner(&owner)
        }
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("forwarding failed: {e}"),
        )
        .into_response(),
    }
}

/// `503 owner_unreachable`, `Retry-After` the owner's remaining lease time.
fn unreachable_owner(owner: &OwnedElsewhere) -> Response {
    let left_ms = owner
        .expires_at_ms
        .saturating_sub(crate::clock::now_ms())
        .max(0);
    let secs = (left_ms.saturating_add(999) / 1000).max(1);
    let mut resp = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "owner_unreachable",
        format!(
            "the daemon at {} owns the tree and does not answer; retry after its lease expires",
            owner.owner_address
        ),
    )
    .into_response();
    if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
        resp.headers_mut()
            .insert(axum::http::header::RETRY_AFTER, v);
    }
    resp
}

/// One forwarded request.
struct Forward {
    owner: String,
    method: String,
    target: String,
    content_type: Option<String>,
    request_id: Option<String>,
    body: Vec<u8>,
    /// How long to wait for the answer ([`answer_wait`]).
    wait: Duration,
}

/// The owner's answer.
struct Answer {
    status: u16,
    content_type: Option<String>,
    body: Vec<u8>,
}

/// Why the owner gave no answer.
#[derive(Debug, thiserror::Error)]
enum ForwardError {
    /// Connecting, sending or receiving failed (refused, timed out, reset).
    #[error("transport: {0}")]
    Transport(String),
    /// The answer could not be read.
    #[error("reading the answer: {0}")]
    Read(#[from] std::io::Error),
}

impl Forward {
    /// Sends the request (blocking: on a blocking thread, never on the engine thread).
    fn send(self, secret: &str, from: &str) -> Result<Answer, ForwardError> {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(CONNECT_TIMEOUT)
            .timeout(self.wait)
            .redirects(0)
            .build();
        let url = format!("http://{}{}", self.owner, self.target);
        let mut req = agent
            .request(&self.method, &url)
            .set(CLUSTER_SECRET, secret)
            .set(FORWARDED_BY, from);
        if let Some(ct) = &self.content_type {
            req = req.set("content-type", ct);
        }
        if let Some(id) = &self.request_id {
            req = req.set(REQUEST_ID, id);
        }
        let resp = match req.send_bytes(&self.body) {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(ureq::Error::Transport(t)) => return Err(ForwardError::Transport(t.to_string())),
        };
        let status = resp.status();
        let content_type = resp.header("content-type").map(str::to_string);
        let mut body = Vec::new();
        resp.into_reader().take(MAX_ANSWER).read_to_end(&mut body)?;
        Ok(Answer {
            status,
            content_type,
            body,
        })
    }
}

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_GATEWAY);
        let mut resp = (status, self.body).into_response();
        resp.headers_mut().remove(axum::http::header::CONTENT_TYPE);
        if let Some(v) = self
            .content_type
            .as_deref()
            .and_then(|ct| HeaderValue::from_str(ct).ok())
        {
            resp.headers_mut()
                .insert(axum::http::header::CONTENT_TYPE, v);
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderMap;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("header value"));
        }
        h
    }

    /// A forwarded request is accepted only with the database's cluster secret.
    /// Issue 34: "a command forwarded to a stopped owner waits the 30 s answer timeout although
    /// the lease expires within 3 s". The wait is the lease's remaining time, bounded.
    #[test]
    fn the_answer_wait_is_the_owners_remaining_lease_within_bounds() {
        assert_eq!(answer_wait(10_000, 7_000), Duration::from_secs(3));
        assert_eq!(answer_wait(10_000, 9_500), MIN_ANSWER_WAIT);
        assert_eq!(
            answer_wait(10_000, 20_000),
            MIN_ANSWER_WAIT,
            "already expired"
        );
        assert_eq!(answer_wait(i64::MAX, 0), ANSWER_TIMEOUT);
        assert_eq!(answer_wait(i64::MIN, i64::MAX), MIN_ANSWER_WAIT);
    }

    #[test]
    fn only_the_cluster_secret_authenticates_a_forwarded_request() {
        let c = Cluster::new("s3cret".into(), "127.0.0.1:1".into());
        assert!(c.accepts(&headers(&[(CLUSTER_SECRET, "s3cret")])));
        assert!(!c.accepts(&headers(&[(CLUSTER_SECRET, "s3cre")])));
        assert!(!c.accepts(&headers(&[(CLUSTER_SECRET, "s3cret2")])));
        assert!(!c.accepts(&headers(&[])));
        assert!(is_forwarded(&headers(&[(FORWARDED_BY, "127.0.0.1:2")])));
        assert!(!is_forwarded(&headers(&[(CLUSTER_SECRET, "s3cret")])));
    }

    /// `503 owner_unreachable` retries after the owner's lease, in whole seconds, at least 1.
    #[test]
    fn an_unreachable_owner_is_retried_after_its_lease() {
        let retry = |left_ms: i64| {
            let resp = unreachable_owner(&OwnedElsewhere {
                owner_address: "127.0.0.1:1".into(),
                expires_at_ms: crate::clock::now_ms() + left_ms,
            });
            assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
            resp.headers()[axum::http::header::RETRY_AFTER]
                .to_str()
                .expect("ascii")
                .parse::<i64>()
                .expect("seconds")
        };
        // The clock moves between the two reads: at most one second less.
        assert!((9..=10).contains(&retry(10_000)));
        assert_eq!(retry(-5_000), 1, "an expired lease: retry at once");
        assert!((1..=3).contains(&retry(2_500)));
    }
}
