//! The daemon's HTTP/1.1 accept loop: bounded connections (issue 36 items 2 and 12).
//!
//! [`serve`] replaces `axum::serve` for the API's and the metrics' listeners. It accepts
//! connections and drives each with hyper's HTTP/1.1 server, adding what `axum::serve` lacks:
//!
//! - **A cap on concurrent connections** ([`HttpLimits::max_connections`], never more than
//!   [`fd_bounded_cap`] allows under the process's `RLIMIT_NOFILE`). A connection beyond the cap
//!   is accepted and answered at once `503` with the API's JSON envelope (`unavailable`),
//!   `Connection: close` and `Retry-After: 1`, then closed; at most [`MAX_REJECTING`] such
//!   answers wait for their client to read them (a little longer than [`REJECT_LINGER`]), the
//!   others are written without waiting and closed. Event-stream followers count towards the cap.
//! - **Accept errors never end the loop**: a connection error of one client (`ECONNABORTED`, ...)
//!   is skipped; running out of descriptors or memory (`EMFILE`, `ENFILE`, `ENOBUFS`, `ENOMEM`)
//!   backs off [`ACCEPT_BACKOFF`] and accepts again (logged at most once a second).
//! - **A header read timeout** ([`HttpLimits::header_timeout`]): a request head must be complete
//!   within it from its first byte, and the first head of a connection within it from the accept
//!   (choice: a connection that sends nothing at all is held no longer than a slow one), else the
//!   connection is closed without an answer (slowloris).
//! - **An idle keep-alive timeout** ([`HttpLimits::idle_timeout`]): a connection with no request
//!   in flight and no byte of a new head for that long is closed. A request is in flight from its
//!   head until its response body has been sent, so an event stream (`GET /v1/events`) is never
//!   idle while it runs. (There is no write timeout: a client that stops reading a response
//!   keeps its request in flight, as a follower that stops reading does; it holds one slot of
//!   the cap, never more.)
//! - **A body read timeout** ([`HttpLimits::body_timeout`]): a request's body is read in full
//!   (at most [`crate::http::MAX_BODY`] bytes, else `413 too_large`, sent once the rest of the
//!   body, up to [`DRAIN_MAX`], was read and thrown away) within it from the head,
//!   before the router sees the request, else `408 timeout` with the JSON envelope. Requests
//!   without a body (event streams included) are not concerned.
//! - **Malformed heads get the JSON envelope** (item 12). hyper answers a head it cannot parse
//!   (a control character in a header value, a garbage request line, a negative or invalid
//!   `Content-Length`, a head beyond its own limits) itself, with a bare status and no body,
//!   before any service runs, and offers no hook for it. Choice: rather than parse heads twice
//!   (a validating pre-reader in front of hyper would have to track request boundaries on
//!   keep-alive connections), the connection's writer recognises that answer on its way out (a
//!   response head with an error status, no `content-type` and nothing after it in the same
//!   write; every response of the router carries a `content-type`, errors included, and the
//!   writer is not vectored so hyper writes a head and its body in one buffer) and writes in its
//!   place the same status with the envelope (`invalid`, `uri_too_long`, `headers_too_large`)
//!   and `Connection: close`; hyper closes the connection after it.
//!
//! Only HTTP/1.1 (and 1.0) is served (choice: no HTTP/2 prior-knowledge over plain TCP, which no
//! browser speaks; `axum::serve` offered it). When `stop` becomes `true` the loop stops
//! accepting, every connection shuts down gracefully (idle ones at once, a request in flight
//! after its response; event streams end on the same signal in [`crate::api`]), and [`serve`]
//! returns once all are closed (the caller bounds that wait).

use crate::http::{ApiError, MAX_BODY};
use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Deserialize;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};

/// Default [`HttpLimits::header_timeout`].
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`HttpLimits::body_timeout`].
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Default [`HttpLimits::idle_timeout`].
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default [`HttpLimits::max_connections`] (before [`fd_bounded_cap`]).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// File descriptors kept out of the connection budget for everything else the daemon opens: the
/// database and its WAL and shared memory, read connections, provider processes' pipes, the
/// listeners, the runtime's own.
pub const FD_RESERVE: u64 = 128;
/// The cap never goes below this, whatever the fd limit says.
pub const MIN_CONNECTIONS: usize = 8;
/// Most refused connections (beyond the cap) kept open at once until their client read the 503.
pub const MAX_REJECTING: usize = 32;
/// How long a refused connection waits for its client to read the 503 and close.
pub const REJECT_LINGER: Duration = Duration::from_secs(1);
/// Pause after an accept error that is not one client's (descriptors or memory exhausted).
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The `[http]` table of the config file: connection limits (seconds; unset keys keep the
/// defaults; a timeout of 0 is taken as 1 s).
///
/// ```toml
/// [http]
/// header_timeout_secs = 10   # a request head must be complete within this
/// body_timeout_secs = 30     # a request body must be read within this from its head
/// idle_timeout_secs = 60     # a keep-alive connection with no request in flight is closed after this
/// max_connections = 1024     # concurrent connections (bounded by the fd limit, see below)
/// ```
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// [`HttpLimits::header_timeout`] in seconds.
    pub header_timeout_secs: Option<u64>,
    /// [`HttpLimits::body_timeout`] in seconds.
    pub body_timeout_secs: Option<u64>,
    /// [`HttpLimits::idle_timeout`] in seconds.
    pub idle_timeout_secs: Option<u64>,
    /// [`HttpLimits::max_connections`].
    pub max_connections: Option<usize>,
}

impl HttpConfig {
    /// The limits, defaults filled in (the connection cap not yet bounded by the fd limit).
    pub fn resolve(&self) -> HttpLimits {
        let secs = |v: Option<u64>, d: Duration| v.map_or(d, |s| Duration::from_secs(s.max(1)));
        HttpLimits {
            header_timeout: secs(self.header_timeout_secs, DEFAULT_HEADER_TIMEOUT),
            body_timeout: secs(self.body_timeout_secs, DEFAULT_BODY_TIMEOUT),
            idle_timeout: secs(self.idle_timeout_secs, DEFAULT_IDLE_TIMEOUT),
            max_connections: self
                .max_connections
                .unwrap_or(DEFAULT_MAX_CONNECTIONS)
                .max(1),
        }
    }
}

/// The connection limits of a listener (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// A request head must be complete within this from its first byte (the first head of a
    /// connection: from the accept).
    pub header_timeout: Duration,
    /// A request body must be read within this from its head.
    pub body_timeout: Duration,
    /// A connection with no request in flight is closed after this.
    pub idle_timeout: Duration,
    /// Concurrent connections (further bounded by [`fd_bounded_cap`] in [`serve`]).
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> HttpLimits {
        HttpConfig::default().resolve()
    }
}

/// The soft `RLIMIT_NOFILE` of the process (`None` when unlimited or unreadable).
fn nofile_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) writes the limit into the struct we pass.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    (r == 0 && lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// The connection cap under a descriptor limit `nofile`: `configured`, but at most half of
/// what is left of `nofile` after [`FD_RESERVE`] (choice: the other half covers the refused
/// connections being answered, the accept loop's headroom and descriptors of provider processes
/// beyond the reserve), and never below [`MIN_CONNECTIONS`].
pub fn fd_bounded_cap(configured: usize, nofile: Option<u64>) -> usize {
    match nofile {
        Some(n) => {
            let budget = usize::try_from(n.saturating_sub(FD_RESERVE) / 2).unwrap_or(usize::MAX);
            configured.min(budget.max(MIN_CONNECTIONS))
        }
        None => configured,
    }
}

/// Serves `app` on `listener` with `limits` until `stop` becomes `true` and every connection
/// closed (see the module documentation). Never fails on a connection's or an accept's error.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    mut stop: watch::Receiver<bool>,
) {
    let cap = fd_bounded_cap(limits.max_connections, nofile_limit());
    if cap < limits.max_connections {
        tracing::info!(
            configured = limits.max_connections,
            cap,
            "connection cap lowered to fit the open-file limit"
        );
    }
    let slots = Arc::new(Semaphore::new(cap));
    let rejecting = Arc::new(Semaphore::new(MAX_REJECTING));
    let mut last_warn: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.wait_for(|s| *s) => break,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(e) if is_client_error(&e) => continue,
            Err(e) => {
                if last_warn.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
                    tracing::warn!(error = %e, "accept failed; backing off");
                    last_warn = Some(Instant::now());
                }
                tokio::select! {
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                    _ = stop.wait_for(|s| *s) => break,
                }
            }
        };
        let _ = stream.set_nodelay(true);
        match slots.clone().try_acquire_owned() {
            Ok(slot) => {
                tokio::spawn(connection(stream, app.clone(), limits, stop.clone(), slot));
            }
            Err(_) => refuse(stream, &rejecting),
        }
    }
    drop(listener);
    // Every connection holds a slot until it closed.
    let all = u32::try_from(cap).unwrap_or(u32::MAX);
    let _ = slots.acquire_many(all).await;
}

/// An accept error that concerns one client only (the loop goes on at once).
fn is_client_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
    )
}

/// The `503` written to a connection beyond the cap.
fn busy_response() -> Vec<u8> {
    raw_response(
        503,
        "unavailable",
        "too many connections; retry later",
        "retry-after: 1\r\n",
    )
}

/// A complete HTTP/1.1 response with the JSON envelope and `Connection: close`.
fn raw_response(status: u16, code: &str, message: &str, extra: &str) -> Vec<u8> {
    let body = serde_json::json!({"error": {"code": code, "message": message}}).to_string();
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error");
    format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n{extra}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Answers a connection beyond the cap with [`busy_response`] and closes it: after its client
/// read it (up to [`REJECT_LINGER`], at most [`MAX_REJECTING`] at once), else at once.
fn refuse(stream: TcpStream, rejecting: &Arc<Semaphore>) {
    let busy = busy_response();
    match rejecting.clone().try_acquire_owned() {
        Ok(permit) => {
            tokio::spawn(async move {
                let _permit = permit;
                let mut stream = stream;
                let _ = tokio::time::timeout(REJECT_LINGER, async {
                    stream.write_all(&busy).await?;
                    stream.shutdown().await?;
                    // Read what the client sent until it closes, so the close is not a reset
                    // that could discard the answer before the client read it.
                    let mut sink = [0u8; 1024];
                    loop {
                        stream.readable().await?;
                        match stream.try_read(&mut sink) {
                            Ok(0) => return Ok::<(), io::Error>(()),
                            Ok(_) => {}
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                            Err(e) => return Err(e),
                        }
                    }
                })
                .await;
            });
        }
        Err(_) => {
            let _ = stream.try_write(&busy);
        }
    }
}

/// What the timers of one connection watch.
struct ConnState {
    /// When the connection was accepted.
    start: Instant,
    /// Requests whose response body has not been sent (or dropped) yet.
    in_flight: AtomicUsize,
    /// Requests dispatched so far.
    served: AtomicU64,
    /// Milliseconds since `start` at which the first byte of the next head arrived (`NONE`: no
    /// byte of a head pending).
    head_since: AtomicU64,
    /// Milliseconds since `start` at which the last request ended.
    idle_since: AtomicU64,
    /// Woken when any of the above changes in a way that moves a deadline.
    changed: Notify,
}

const NONE: u64 = u64::MAX;

impl ConnState {
    fn now(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(NONE - 1)
    }

    /// When the connection is to be closed, if nothing changes (`None`: a request in flight).
    fn deadline(&self, limits: &HttpLimits) -> Option<(Instant, &'static str)> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let at = |ms: u64, d: Duration| self.start + Duration::from_millis(ms) + d;
        let head = self.head_since.load(Ordering::Acquire);
        if head != NONE {
            return Some((at(head, limits.header_timeout), "header timeout"));
        }
        if self.served.load(Ordering::Acquire) == 0 {
            return Some((at(0, limits.header_timeout), "header timeout"));
        }
        let idle = self.idle_since.load(Ordering::Acquire);
        Some((at(idle, limits.idle_timeout), "idle timeout"))
    }
}

/// Drives one accepted connection until it closes, times out or the daemon stops.
async fn connection(
    stream: TcpStream,
    app: Router,
    limits: HttpLimits,
    mut stop: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    let state = Arc::new(ConnState {
        start: Instant::now(),
        in_flight: AtomicUsize::new(0),
        served: AtomicU64::new(0),
        head_since: AtomicU64::new(NONE),
        idle_since: AtomicU64::new(0),
        changed: Notify::new(),
    });
    let io = TokioIo::new(Watched {
        inner: stream,
        state: state.clone(),
        replacement: None,
    });
    let service = ConnService {
        app,
        state: state.clone(),
        body_timeout: limits.body_timeout,
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    // The head timeout is ours (hyper's would also close idle keep-alive connections).
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .keep_alive(true);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        let deadline = state.deadline(&limits);
        let sleep = async {
            match deadline {
                Some((at, _)) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = state.changed.notified() => {}
            _ = sleep => {
                if let Some((at, why)) = state.deadline(&limits) {
                    if at <= Instant::now() {
                        tracing::debug!(reason = why, "closing connection");
                        return;
                    }
                }
            }
        }
    }
}

/// Counts a request in flight until dropped (moved into its response body).
struct InFlight(Arc<ConnState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let s = &self.0;
        s.idle_since.store(s.now(), Ordering::Release);
        if s.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            s.changed.notify_one();
        }
    }
}

/// The per-connection service: in-flight accounting and the body read timeout around `app`.
#[derive(Clone)]
struct ConnService {
    app: Router,
    state: Arc<ConnState>,
    body_timeout: Duration,
}

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<Body>;
    type Error = std::convert::Infallible;
    type Future =
        Pin<Box<dyn Future<Output = Result<Response<Body>, std::convert::Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let s = &self.state;
        s.in_flight.fetch_add(1, Ordering::AcqRel);
        s.served.fetch_add(1, Ordering::AcqRel);
        s.head_since.store(NONE, Ordering::Release);
        s.changed.notify_one();
        let guard = InFlight(s.clone());
        let app = self.app.clone();
        let body_timeout = self.body_timeout;
        Box::pin(async move {
            let resp = match read_body(req, body_timeout).await {
                Ok(req) => {
                    use tower::ServiceExt;
                    match app.oneshot(req).await {
                        Ok(r) => r,
                        Err(never) => match never {},
                    }
                }
                Err(e) => e.into_response(),
            };
            // The request stays in flight until its body has been sent (or dropped).
            let (parts, body) = resp.into_parts();
            let body = Guarded {
                inner: body,
                _guard: guard,
            };
            Ok(Response::from_parts(parts, Body::new(body)))
        })
    }
}

/// A response body that keeps its request in flight until it is dropped (its size hint kept, so
/// a sized body keeps its `content-length`).
struct Guarded {
    inner: Body,
    _guard: InFlight,
}

impl http_body::Body for Guarded {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// How much of a body over [`MAX_BODY`] is read and thrown away before the `413` goes out.
///
/// Choice: a server that answers while the client is still sending and then closes makes the
/// kernel reset the connection, and the client loses the answer (it sees "broken pipe" or
/// "connection reset"). So the rest of an oversized body is read and discarded, up to this
/// bound and within the body timeout; only a body larger than that is answered early (and the
/// client may then miss the answer).
pub const DRAIN_MAX: usize = 4 * MAX_BODY;

/// Reads a request's body in full within `timeout` (at most [`MAX_BODY`] bytes): `408
/// timeout`, `413 too_large` or `400 invalid` (a broken body) otherwise. An oversized body is
/// read to its end (up to [`DRAIN_MAX`]) before it is refused, so the client reads the answer.
async fn read_body(req: Request<Incoming>, timeout: Duration) -> Result<Request<Body>, ApiError> {
    use http_body::Body as _;
    let (parts, mut body) = req.into_parts();
    if body.is_end_stream() {
        return Ok(Request::from_parts(parts, Body::empty()));
    }
    let read = async {
        let mut kept = Vec::new();
        let mut total = 0usize;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid",
                    format!("request body: {e}"),
                )
            })?;
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            total = total.saturating_add(data.len());
            if total <= MAX_BODY {
                kept.extend_from_slice(&data);
            } else if total > DRAIN_MAX {
                break;
            }
        }
        Ok::<_, ApiError>((kept, total))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(Ok((kept, total))) if total <= MAX_BODY => {
            Ok(Request::from_parts(parts, Body::from(kept)))
        }
        Ok(Ok(_)) => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("request body over {MAX_BODY} bytes"),
        )),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            format!("request body not received within {} s", timeout.as_secs()),
        )),
    }
}

/// The connection's socket as hyper sees it: reads mark the start of a head, and hyper's own
/// bare error answers are replaced by the JSON envelope on the way out.
struct Watched {
    inner: TcpStream,
    state: Arc<ConnState>,
    /// An answer written in place of hyper's, and how much of it is out.
    replacement: Option<(Vec<u8>, usize)>,
}

impl Watched {
    /// Writes what is left of the replacement answer.
    fn poll_replacement(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some((bytes, done)) = &mut self.replacement {
            if *done >= bytes.len() {
                self.replacement = None;
                break;
            }
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &bytes[*done..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            *done += n;
        }
        Poll::Ready(Ok(()))
    }
}

/// The envelope answer to write instead of `buf`, when `buf` is hyper's own answer to a head it
/// could not parse: a whole response head with an error status, no `content-type` and no body.
fn replace_bare_error(buf: &[u8]) -> Option<Vec<u8>> {
    let rest = buf.strip_prefix(b"HTTP/1.1 ")?;
    let status: u16 = std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()?;
    if !(400..=599).contains(&status) {
        return None;
    }
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    if end + 4 != buf.len() {
        return None;
    }
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    if head.contains("\r\ncontent-type:") {
        return None;
    }
    let (code, message) = match status {
        414 => ("uri_too_long", "request target too long"),
        431 => ("headers_too_large", "request head too large"),
        _ => (
            crate::http::code_of(StatusCode::from_u16(status).ok()?),
            "malformed request head (request line, header name or value, or Content-Length)",
        ),
    };
    Some(raw_response(status, code, message, ""))
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        let s = &this.state;
        if buf.filled().len() > before
            && s.in_flight.load(Ordering::Acquire) == 0
            && s.head_since.load(Ordering::Acquire) == NONE
        {
            s.head_since.store(s.now(), Ordering::Release);
            s.changed.notify_one();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        if let Some(answer) = replace_bare_error(buf) {
            this.replacement = Some((answer, 0));
            // Taken; the replacement goes out now or on the next write, flush or shutdown.
            if let Poll::Ready(Err(e)) = this.poll_replacement(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    /// Vectored, so that hyper queues a response's head and body chunks and writes them with
    /// one `writev` instead of copying every chunk into its own buffer first (it flattens for a
    /// socket that does not write vectored). An event stream's chunks are the same bytes for
    /// every follower, so that copy was paid once per follower per commit. hyper's bare error
    /// answer is a head without a body: one buffer, replaced as in `poll_write`.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut filled = bufs.iter().filter(|b| !b.is_empty());
        if let (Some(only), None) = (filled.next(), filled.next()) {
            return self.poll_write(cx, only);
        }
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_replacement(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_fits_the_open_file_limit() {
        assert_eq!(fd_bounded_cap(1024, None), 1024);
        assert_eq!(fd_bounded_cap(1024, Some(256)), 64);
        assert_eq!(fd_bounded_cap(1024, Some(1 << 20)), 1024);
        assert_eq!(fd_bounded_cap(1024, Some(10)), MIN_CONNECTIONS);
        assert_eq!(fd_bounded_cap(4, Some(256)), 4);
    }

    /// The socket hyper writes to is vectored (so hyper does not copy body chunks into a
    /// buffer of its own), passes several buffers through as they are, and still replaces a
    /// bare error answer that comes as the only buffer.
    #[tokio::test]
    async fn vectored_writes_pass_through_and_bare_errors_are_still_replaced() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr"));
        let (client, accepted) = tokio::join!(client, listener.accept());
        let (mut client, (server, _)) = (client.expect("connect"), accepted.expect("accept"));
        let mut w = Watched {
            inner: server,
            state: Arc::new(ConnState {
                start: Instant::now(),
                in_flight: AtomicUsize::new(0),
                served: AtomicU64::new(0),
                head_since: AtomicU64::new(NONE),
                idle_since: AtomicU64::new(0),
                changed: Notify::new(),
            }),
            replacement: None,
        };
        assert!(w.is_write_vectored());
        let parts: [&[u8]; 3] = [b"5\r\n", b"hello", b"\r\n"];
        let slices: Vec<io::IoSlice<'_>> = parts.iter().map(|p| io::IoSlice::new(p)).collect();
        // Ten bytes into an empty loopback socket's buffer go in one write.
        let n = std::future::poll_fn(|cx| Pin::new(&mut w).poll_write_vectored(cx, &slices))
            .await
            .expect("write");
        assert_eq!(n, 10, "all three buffers are written in one call");
        let bare = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\r\n";
        let one = [io::IoSlice::new(&[]), io::IoSlice::new(bare)];
        let n = std::future::poll_fn(|cx| Pin::new(&mut w).poll_write_vectored(cx, &one))
            .await
            .expect("write");
        assert_eq!(n, bare.len(), "the bare answer is taken whole");
        w.flush().await.expect("flush");
        w.shutdown().await.expect("shutdown");
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.expect("read");
        let got = String::from_utf8(got).expect("utf8");
        let (chunk, answer) = got.split_at(10);
        assert_eq!(chunk, "5\r\nhello\r\n");
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
        assert!(answer.contains("headers_too_large"), "{answer}");
    }

    #[test]
    fn only_hypers_bare_error_answers_are_replaced() {
        let bare = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let out = String::from_utf8(replace_bare_error(bare).expect("replaced")).expect("utf8");
        assert!(out.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{out}");
        let body = out.split_once("\r\n\r\n").expect("head").1;
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        assert_eq!(v["error"]["code"], "invalid");
        // The router's answers carry a content-type; success and bodies are left alone.
        let json = b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n\r\n";
        assert!(replace_bare_error(json).is_none());
        assert!(replace_bare_error(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(replace_bare_error(b"HTTP/1.1 400 Bad Request\r\n\r\n{}").is_none());
        assert!(replace_bare_error(b"data: {}\n\n").is_none());
    }
}
