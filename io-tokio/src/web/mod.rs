//! The web view: `tuttid` serves a page of agent trees at `/` on the API's listener, from
//! assets compiled into the binary (`io-tokio/web/`, plain HTML, CSS and JavaScript: no build
//! step, no external fonts, scripts or CDNs). The page uses only the HTTP API and the
//! `/v1/events` stream.
//!
//! Issue 20: "Child-session rows are lanes or nested progress sections under the spawn/delegate
//! card. Nested child sessions follow recorded parent/root fields rather than being flattened
//! into the root transcript." The page builds its lanes from the parent fields of the flat
//! `childSessions` list, and a lane's state comes from the child's own turn, never from the
//! spawn tool call's status ("Spawn tool success means delegation was accepted, not that the
//! child completed").
//!
//! # Login
//!
//! Issue 20: "the bearer token never appears in a URL after the first load: `tuttid` prints a
//! one-time login link; the page exchanges it for an `HttpOnly`, `SameSite=Strict` cookie;
//! state-changing requests with the cookie are protected against cross-site requests (check
//! `Origin`); the API keeps accepting the bearer header."
//!
//! - The link is `http://ADDR/#login=CODE` (plus `&ws=WORKSPACE`). The code is one-time (a
//!   random 128-bit value, [`WebAuth::issue_code`]); it is not the token, and it travels in the
//!   fragment, which browsers never send to the server, so it is in no request line or log.
//! - The page posts it to `POST /login` `{"code"}`; a known code is consumed and answered with
//!   `Set-Cookie: tutti_token_PORT=TOKEN; HttpOnly; SameSite=Strict; Path=/`. The page then
//!   replaces its URL with one without the code.
//! - Choices: the cookie's value is the bearer token itself (HttpOnly: page scripts cannot read
//!   it), so a cookie stays valid across daemon restarts exactly as long as the token file does;
//!   a per-start cookie secret would log every open page out at each restart, which breaks
//!   "a reconnect after the daemon restarts catches up without a reload". Cookies do not
//!   separate ports, so the cookie's name carries the port of the `Host` it was set for; any
//!   `tutti_token*` cookie holding the token is accepted. Codes do not expire but at most
//!   [`MAX_CODES`] are outstanding (the oldest is dropped), and a daemon restart forgets them.
//! - A `/v1` request authenticated by the cookie (no bearer header) that is not `GET`/`HEAD`
//!   must carry an `Origin` equal to `http://` + its `Host`; anything else is 403 `forbidden`
//!   ([`same_origin`]). `POST /login` itself refuses a foreign `Origin` the same way.
//! - `POST /v1/login-links` (authenticated) issues another code and answers
//!   `{"path": "/#login=CODE"}`, for a daemon whose printed link was already used.

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use std::sync::{Arc, Mutex, PoisonError};

/// Most one-time login codes outstanding at once.
pub const MAX_CODES: usize = 16;

/// Prefix of the login cookie's name (the port of the `Host` follows).
pub const COOKIE_PREFIX: &str = "tutti_token";

const INDEX_HTML: &str = include_str!("../../web/index.html");
const APP_JS: &str = include_str!("../../web/app.js");
const APP_CSS: &str = include_str!("../../web/app.css");

/// The web view's login state: the token the cookie carries and the outstanding one-time codes.
pub struct WebAuth {
    token: String,
    codes: Mutex<Vec<String>>,
}

impl WebAuth {
    /// Login state for `token` with no code issued yet.
    pub fn new(token: String) -> Arc<WebAuth> {
        Arc::new(WebAuth {
            token,
            codes: Mutex::new(Vec::new()),
        })
    }

    /// Issues a fresh one-time login code (random, 32 hex characters).
    pub fn issue_code(&self) -> std::io::Result<String> {
        let code = crate::clock::random_hex(16)?;
        let mut codes = self.codes.lock().unwrap_or_else(PoisonError::into_inner);
        if codes.len() >= MAX_CODES {
            codes.remove(0);
        }
        codes.push(code.clone());
        Ok(code)
    }

    /// Consumes `code` if it was issued and not used yet.
    pub fn redeem(&self, code: &str) -> bool {
        let mut codes = self.codes.lock().unwrap_or_else(PoisonError::into_inner);
        let found = codes
            .iter()
            .position(|c| crate::auth::constant_time_eq(c.as_bytes(), code.as_bytes()));
        match found {
            Some(i) => {
                codes.remove(i);
                true
            }
            None => false,
        }
    }

    /// Whether the request carries a login cookie holding the token.
    pub fn cookie_ok(&self, headers: &HeaderMap) -> bool {
        cookies(headers).any(|(name, value)| {
            name.starts_with(COOKIE_PREFIX)
                && crate::auth::constant_time_eq(value.as_bytes(), self.token.as_bytes())
        })
    }
}

/// The `(name, value)` pairs of every `Cookie` header.
fn cookies(headers: &HeaderMap) -> impl Iterator<Item = (&str, &str)> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| {
            let (n, v) = pair.trim().split_once('=')?;
            Some((n.trim(), v.trim()))
        })
}

/// The login link's path for `code`, opening workspace `ws` when given.
pub fn login_path(code: &str, ws: Option<&str>) -> String {
    match ws {
        Some(ws) => format!("/#login={code}&ws={ws}"),
        None => format!("/#login={code}"),
    }
}

/// Whether a request is same-origin: its `Origin` is `http://` followed by its `Host`.
/// A request without `Origin` is not (browsers send it on every cross-origin request and on
/// every same-origin `POST`, `PUT`, `PATCH` and `DELETE` from `fetch`).
pub fn same_origin(headers: &HeaderMap) -> bool {
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let origin = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok());
    match (host, origin) {
        (Some(host), Some(origin)) => origin
            .strip_prefix("http://")
            .is_some_and(|o| o.eq_ignore_ascii_case(host)),
        _ => false,
    }
}

/// Whether a method changes state (needs the `Origin` check when authenticated by cookie).
pub fn changes_state(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// The port of the request's `Host` (80 when it names none).
fn host_port(headers: &HeaderMap) -> u16 {
    headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .and_then(|h| h.rsplit_once(':'))
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(80)
}

/// The page routes (`/`, its assets, `POST /login`), their state applied.
pub fn router<S: Clone + Send + Sync + 'static>(web: Arc<WebAuth>) -> Router<S> {
    Router::new()
        .route("/", get(|| asset(INDEX_HTML, "text/html; charset=utf-8")))
        .route(
            "/assets/app.js",
            get(|| asset(APP_JS, "text/javascript; charset=utf-8")),
        )
        .route(
            "/assets/app.css",
            get(|| asset(APP_CSS, "text/css; charset=utf-8")),
        )
        .route("/login", post(login))
        .with_state(web)
}

async fn asset(body: &'static str, kind: &'static str) -> Response {
    let mut r = Response::new(Body::from(body));
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // The page loads nothing from elsewhere, and may not be framed.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
        ),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    r
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoginBody {
    code: String,
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        Json(json!({"error": {"code": code, "message": message}})),
    )
        .into_response()
}

/// `POST /login {"code"}`: exchanges a one-time code for the login cookie.
async fn login(
    State(web): State<Arc<WebAuth>>,
    headers: HeaderMap,
    body: Result<Json<LoginBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    if headers.contains_key(header::ORIGIN) && !same_origin(&headers) {
        return error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "cross-origin login refused",
        );
    }
    let Ok(Json(b)) = body else {
        return error(StatusCode::BAD_REQUEST, "invalid", "expected {\"code\"}");
    };
    if b.code.len() > 200 || !web.redeem(&b.code) {
        tracing::info!(
            len = b.code.len(),
            "web login refused: unknown or used code"
        );
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "unknown or already used login code; ask tuttid for a new link",
        );
    }
    tracing::info!("web login: code redeemed");
    let cookie = format!(
        "{COOKIE_PREFIX}_{}={}; HttpOnly; SameSite=Strict; Path=/",
        host_port(&headers),
        web.token
    );
    let mut r = StatusCode::NO_CONTENT.into_response();
    match HeaderValue::from_str(&cookie) {
        Ok(v) => {
            r.headers_mut().insert(header::SET_COOKIE, v);
            r
        }
        Err(_) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "the token cannot be a cookie value",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn a_login_code_is_one_time() {
        let w = WebAuth::new("t".repeat(40));
        let c = w.issue_code().unwrap();
        assert!(w.redeem(&c));
        assert!(!w.redeem(&c), "a used code is refused");
        assert!(!w.redeem("nope"));
    }

    #[test]
    fn at_most_max_codes_are_outstanding() {
        let w = WebAuth::new("t".repeat(40));
        let first = w.issue_code().unwrap();
        for _ in 0..MAX_CODES {
            w.issue_code().unwrap();
        }
        assert!(!w.redeem(&first), "the oldest code was dropped");
    }

    #[test]
    fn the_cookie_must_hold_the_token() {
        let w = WebAuth::new("secret-token".into());
        assert!(w.cookie_ok(&headers(&[("cookie", "a=b; tutti_token_80=secret-token")])));
        assert!(!w.cookie_ok(&headers(&[("cookie", "tutti_token_80=other")])));
        assert!(!w.cookie_ok(&headers(&[("cookie", "other=secret-token")])));
        assert!(!w.cookie_ok(&HeaderMap::new()));
    }

    #[test]
    fn same_origin_needs_an_origin_matching_the_host() {
        let ok = headers(&[
            ("host", "127.0.0.1:7420"),
            ("origin", "http://127.0.0.1:7420"),
        ]);
        assert!(same_origin(&ok));
        let other = headers(&[("host", "127.0.0.1:7420"), ("origin", "http://evil.test")]);
        assert!(!same_origin(&other));
        let port = headers(&[
            ("host", "127.0.0.1:7420"),
            ("origin", "http://127.0.0.1:7421"),
        ]);
        assert!(!same_origin(&port));
        assert!(!same_origin(&headers(&[("host", "127.0.0.1:7420")])));
        assert!(!same_origin(&headers(&[
            ("host", "127.0.0.1:7420"),
            ("origin", "null")
        ])));
    }
}
