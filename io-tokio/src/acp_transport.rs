//! The ACP transport: an agent process driven through the client side of the
//! `agent-client-protocol` crate, exposed to the runtime as a [`Transport`].
//!
//! The ACP adapter (`tutti_core::adapters::acp`) stays pure: it consumes and produces raw
//! JSON-RPC 2.0 objects as [`serde_json::Value`]. This module translates between those objects
//! and the crate's typed client API, so the crate owns the wire: line framing, request ids, the
//! response bookkeeping, the v1 protocol guard and `$/cancel_request`. One exception, for
//! speed: the agent's `session/update` notifications are read here (see "Updates as written").
//!
//! # Agent → adapter ([`Native`] items, in wire order)
//!
//! Every crate callback runs in the connection's dispatch loop and awaits the hand-over to the
//! runtime's channel before it returns, so the channel keeps the wire order (an update the agent
//! sent before a prompt answer is always received before it), and a slow runtime slows the
//! dispatch loop down instead of buffering without bound. `session/update`s skip the crate and
//! keep that order through markers (see "Updates as written" below).
//!
//! - `session/update` (a notification with object params and no other members) → the line's
//!   JSON object itself, `{"jsonrpc":"2.0","method":"session/update","params":…}`, as the agent
//!   wrote it, sent by the line reader (`agent_lines`).
//! - `session/request_permission` (typed [`RequestPermissionRequest`]) →
//!   `{"jsonrpc":"2.0","id":"perm-N","method":"session/request_permission","params":…}`; the
//!   crate's [`Responder`] is kept under `perm-N` until the adapter answers.
//! - Any other agent request (the adapter answers it `method not found`) → the same shape with
//!   id `req-N` and the raw params (the crate's [`UntypedMessage`]); any other notification →
//!   raw, except the crate's own protocol notifications (`$/cancel_request`), which it handles.
//! - The answer to an adapter request → `{"jsonrpc":"2.0","id":<the adapter's id>,"result":…}` or
//!   `…,"error":{"code","message"[,"data"]}` (the adapter's ids never reach the wire: the crate
//!   allocates its own and the answer is tagged back).
//! - A line that is not a JSON object → [`Native::Garbage`] (length and parse error only); it is
//!   filtered out before the crate sees it, exactly as the line transport counted and dropped it.
//!   (It is reported from the line reader, so it may overtake a message the crate is still
//!   dispatching; garbage is only counted, so its position does not matter.)
//! - End of the agent's output, or the connection failing → one [`Native::Exited`]. Requests the
//!   agent never answered fail locally in the crate at that point ("incoming transport
//!   closed" / "connection terminated"); those local failures are *not* forwarded as JSON-RPC
//!   errors: the exit is the fact, as with the line transport.
//!
//! # Adapter → agent ([`NativeSink::send`])
//!
//! - Request (`id` and `method`): `initialize`, `session/new`, `session/load`, `session/prompt`
//!   are parsed into the typed [`InitializeRequest`], [`NewSessionRequest`],
//!   [`LoadSessionRequest`], [`PromptRequest`] (any other
//!   method goes out as an [`UntypedMessage`]) and published with
//!   `prepare_request(..).on_receiving_result(..)`: nothing blocks, and the answer joins the
//!   ordered dispatch loop. Params that don't fit the schema are answered locally with
//!   `-32602` (invalid params) under the adapter's id, and nothing is sent.
//! - Notification (`method`, no `id`): `session/cancel` is parsed into [`CancelNotification`]
//!   and sent with `send_notification`; others go out untyped. A notification that can't be
//!   parsed or enqueued is an `Err` (the runtime turns a failed cancel into `cancelFailed`).
//! - Response (`id`, no `method`): answers the stored responder; a permission answer is parsed
//!   into [`RequestPermissionResponse`]. An unknown id is an `Err`. An answer that doesn't fit the
//!   schema (the adapter passes a client-supplied `outcome` object through) is sent as the
//!   `cancelled` outcome, so the agent is never left waiting.
//! - Every send checks first that the connection is still up, so a send after the agent exited
//!   is an `Err` at once. The crate writes asynchronously: a later write failure terminates the
//!   connection, which is reported as [`Native::Exited`].
//!
//! # Updates as written
//!
//! `session/update`s, by far most of what an agent writes, are parsed once by the transport's
//! line reader (a task of its own; the time it spends reading lines into JSON is the daemon's
//! `parse` stage, [`ParseClock`]) and reach the adapter as the agent wrote them, without the
//! crate: fields outside the schema
//! stay, and an update the schema would refuse is the adapter's to refuse (it refuses one
//! without its `sessionUpdate` tag with a typed error and changes nothing; anything else it
//! reads defensively, as it must for any provider output). Every other line goes to the crate,
//! followed by a numbered marker notification (`MARKER`, dispatched in order by the crate to
//! this module's handler, never forwarded or written); an update waits until the marker of
//! the last line handed to the crate has been dispatched, so whatever that line became is in
//! the runtime's channel ahead of it (`agent_lines`). Choice (issue 33), measured with the knee
//! benchmark (1 follower): through the crate an update was parsed into the schema's typed
//! `SessionNotification` and serialized back into JSON, and the crate builds a message's params
//! about four times (a `Value`, again for its raw message, twice for its untyped message); at
//! 14,450 lines/s the runtime's workers spent 40-43 us of CPU per line, 36 us once updates went
//! untyped and messages were wrapped by moving (`rpc`; `json!` copies what it interpolates), and
//! at 20,225 lines/s 32-34 us through the crate against 18-22 us with the reader's own path,
//! and 15-16 us once the reader ran in a task of its own instead of inside the crate's input
//! stream (there each line woke the crate's connection and actors); about 14 us for the same
//! lines without the ACP transport at all.
//!
//! # Fidelity of the typed round trip
//!
//! Other incoming messages are parsed by the crate into the schema types and serialized back
//! with serde. What the adapter reads survives that round trip (see the tests below): the
//! `subagent_update` fields (the child's `sessionId`, `title`, `description`, the per-child
//! `capabilities.cancel`, the v1 `state` snapshots with their error objects), `session_message`
//! (`messageId`, sender, recipient, content), the `session` tool-call content, tool call ids,
//! titles, statuses and kinds, permission options, `agentCapabilities.loadSession`; defaults
//! the wire omits stay omitted. What
//! doesn't map 1:1, accepted as is: fields the schema does not define (outside `_meta`) are
//! dropped, and a permission request that does not parse is answered with a JSON-RPC error by
//! the crate.
//!
//! Logs carry ids, methods and lengths only.

use crate::runtime::{Native, NativeSink, ParseClock, ProcessSpec, Transport, WriteError};
use agent_client_protocol::v1::schema::{
    CancelNotification, InitializeRequest, LoadSessionRequest, NewSessionRequest, PromptRequest,
    RequestPermissionOutcome, RequestPermissionRequest, RequestPermissionResponse,
};
use agent_client_protocol::v1::{ConnectionTo, Responder};
use agent_client_protocol::{
    is_cancel_request_notification, is_connection_terminated, is_incoming_transport_closed, Agent,
    Client, Error, JsonRpcMessage, JsonRpcRequest, JsonRpcResponse, Lines, UntypedMessage,
};
use futures::future::BoxFuture;
use futures::Stream;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, warn};
use tutti_core::adapters::parse_line;

/// Method of the permission request, the one agent request the adapter answers.
const PERMISSION: &str = "session/request_permission";

/// Spawns an ACP agent process and connects to it over its stdio with the client side of the
/// `agent-client-protocol` crate.
pub fn spawn_acp_process(spec: &ProcessSpec) -> std::io::Result<Transport> {
    let (child, stdin, stdout) = crate::runtime::spawn_piped(spec)?;
    let parse = ParseClock::default();
    let (incoming, sink) = connect(stdout, stdin, parse.clone());
    Ok(Transport {
        incoming,
        sink: Box::new(sink),
        child: Some(child),
        parse,
    })
}

/// Connects to an ACP agent over any pair of byte streams (its output, its input), with the
/// transport [`spawn_acp_process`] puts on a child's stdio: for an agent reached another way (a
/// socket, a pipe of a process started elsewhere; the knee benchmark's simulated agents). The
/// transport has no child: the agent's end of the streams is the caller's to close.
pub fn connect_acp<R, W>(from_agent: R, to_agent: W) -> Transport
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    let parse = ParseClock::default();
    let (incoming, sink) = connect(from_agent, to_agent, parse.clone());
    Transport {
        incoming,
        sink: Box::new(sink),
        child: None,
        parse,
    }
}

/// An agent request waiting for the adapter's answer.
enum Waiting {
    Permission(Responder<RequestPermissionResponse>),
    Other(Responder<Value>),
}

/// Agent requests by the id the adapter sees.
#[derive(Default)]
struct Waiters {
    next: u64,
    by_id: HashMap<String, Waiting>,
}

type Shared = Arc<Mutex<Waiters>>;

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, Waiters> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Waiters {
    fn insert(&mut self, prefix: &str, waiting: Waiting) -> String {
        let id = format!("{prefix}-{}", self.next);
        self.next += 1;
        self.by_id.insert(id.clone(), waiting);
        id
    }
}

/// Connects the client side of the crate to an agent's output and input.
fn connect<R, W>(from_agent: R, to_agent: W, parse: ParseClock) -> (mpsc::Receiver<Native>, AcpSink)
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    let (tx, rx) = mpsc::channel(1024);
    let shared: Shared = Arc::default();
    let (cx_tx, cx_rx) = oneshot::channel::<ConnectionTo<Agent>>();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let (stop_reader, reader_stopped) = oneshot::channel::<()>();

    // The markers the crate has dispatched (see `agent_lines`).
    let (reached, reached_rx) = watch::channel(0u64);
    let transport = Lines::new(
        line_sink(to_agent),
        agent_lines(from_agent, tx.clone(), reached_rx, reader_stopped, parse),
    );

    let (permissions, permission_waiters) = (tx.clone(), shared.clone());
    let (requests, request_waiters) = (tx.clone(), shared.clone());
    let notifications = tx.clone();
    let connection = Client
        .v1()
        .name("tuttid-acp")
        .on_receive_request(
            async move |request: RequestPermissionRequest,
                        responder: Responder<RequestPermissionResponse>,
                        _cx| {
                let params = match serde_json::to_value(&request) {
                    Ok(p) => p,
                    Err(e) => return responder.respond_with_error(e.into()),
                };
                let id = lock(&permission_waiters).insert("perm", Waiting::Permission(responder));
                debug!(id = %id, "acp: permission request from the agent");
                let msg = rpc([
                    ("id", Value::from(id.as_str())),
                    ("method", Value::from(PERMISSION)),
                    ("params", params),
                ]);
                if permissions.send(Native::Message(msg)).await.is_err() {
                    // Nobody will answer: don't leave the agent waiting.
                    if let Some(Waiting::Permission(r)) =
                        lock(&permission_waiters).by_id.remove(&id)
                    {
                        return r.respond(RequestPermissionResponse::new(
                            RequestPermissionOutcome::Cancelled,
                        ));
                    }
                }
                Ok(())
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            async move |request: UntypedMessage, responder: Responder<Value>, _cx| {
                let (method, params) = request.into_parts();
                let id = lock(&request_waiters).insert("req", Waiting::Other(responder));
                debug!(id = %id, method = %method, "acp: request from the agent");
                let msg = rpc([
                    ("id", Value::from(id.as_str())),
                    ("method", Value::String(method)),
                    ("params", params),
                ]);
                if requests.send(Native::Message(msg)).await.is_err() {
                    if let Some(Waiting::Other(r)) = lock(&request_waiters).by_id.remove(&id) {
                        return r.respond_with_error(Error::internal_error());
                    }
                }
                Ok(())
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_notification(
            async move |notification: UntypedMessage, _cx| {
                if is_cancel_request_notification(&notification) {
                    // The crate marks the request's responder; nothing for the adapter.
                    return Ok(());
                }
                if notification.method() == MARKER {
                    // Everything the agent wrote before this marker has been dispatched.
                    if let Some(n) = notification.params().get("n").and_then(Value::as_u64) {
                        reached.send_if_modified(|r| {
                            let later = n > *r;
                            *r = (*r).max(n);
                            later
                        });
                    }
                    return Ok(());
                }
                let (method, params) = notification.into_parts();
                let msg = rpc([("method", Value::String(method)), ("params", params)]);
                let _ = notifications.send(Native::Message(msg)).await;
                Ok(())
            },
            agent_client_protocol::on_receive_notification!(),
        )
        .connect_with(transport, async move |cx: ConnectionTo<Agent>| {
            let _ = cx_tx.send(cx.clone());
            // Until the runtime drops its sink, or the agent's output ends.
            tokio::select! {
                _ = stop_rx => {}
                _ = cx.incoming_closed() => {}
            }
            Ok(())
        });

    let exited = tx.clone();
    tokio::spawn(async move {
        let why = match connection.await {
            Ok(()) => "agent output closed".to_string(),
            Err(e) => format!(
                "ACP connection failed: {} (code {})",
                e.message,
                i32::from(e.code)
            ),
        };
        debug!(reason = %why, "acp: connection ended");
        let _ = exited.send(Native::Exited(why)).await;
    });

    let sink = AcpSink {
        connection: Connection::Starting(cx_rx),
        tx,
        shared,
        _stop: stop_tx,
        _stop_reader: stop_reader,
    };
    (rx, sink)
}

/// The method of the transport's own marker notifications: written into the crate's input
/// after each line the crate gets, answered by nobody, and never on the wire or passed to the
/// adapter (the `_` prefix is ACP's for extensions).
const MARKER: &str = "_tutti/transport_marker";

/// What the reader does with one line of the agent's output.
enum Line {
    /// Not a JSON object: counted as garbage.
    Garbage(String),
    /// A well-formed `session/update` notification: to the adapter as it is.
    Update(Value),
    /// Anything else: to the crate.
    Crate,
}

fn classify(line: &str) -> Line {
    let value = match parse_line(line) {
        Ok(v) => v,
        Err(e) => return Line::Garbage(e.to_string()),
    };
    let update = value.as_object().is_some_and(|m| {
        m.get("method").and_then(Value::as_str) == Some("session/update")
            && m.get("jsonrpc").and_then(Value::as_str) == Some("2.0")
            && !m.contains_key("id")
            && m.get("params").is_some_and(Value::is_object)
            && m.len() == 3
    });
    if update {
        Line::Update(value)
    } else {
        Line::Crate
    }
}

/// The agent's output: `session/update` notifications straight to the runtime's channel, every
/// other line to the crate, garbage counted ([`Native::Garbage`]), blank lines skipped.
///
/// The updates, by far most of what an agent writes, skip the crate (see "Updates as written"
/// in the module docs): the lines are read by a task of their own, and only the lines for the
/// crate go into the stream it reads, so an update wakes neither the crate's connection nor its
/// actors. The order stays the wire order: after each line it hands to the crate the reader
/// writes a marker notification ([`MARKER`], numbered) into the crate's input, and before it
/// sends an update it waits until the crate has dispatched the marker of the last line it
/// handed over. The crate dispatches in wire order and each callback awaits its hand-over to the
/// runtime's channel, so by then whatever that line became (a prompt's answer, a permission
/// request) is in the channel ahead of the update. Only the lines handed to the crate cost a
/// marker, and the reader waits only if an update follows one closely.
///
/// The reader ends at the end of the agent's output (then the crate's stream ends after the
/// last line it handed over, and the connection's end is reported after every update), when
/// `stopped` resolves (the sink was dropped: the connection ends, as it did when the crate
/// itself read the lines), or when the runtime's channel, the crate's stream or the crate's
/// handler is gone.
fn agent_lines<R>(
    from_agent: R,
    tx: mpsc::Sender<Native>,
    mut reached: watch::Receiver<u64>,
    stopped: oneshot::Receiver<()>,
    parse: ParseClock,
) -> std::pin::Pin<Box<dyn Stream<Item = std::io::Result<String>> + Send>>
where
    R: AsyncRead + Send + Unpin + 'static,
{
    let (to_crate, for_crate) = mpsc::channel::<std::io::Result<String>>(64);
    let read = async move {
        let mut lines = BufReader::new(from_agent).lines();
        // Markers handed to the crate.
        let mut sent = 0u64;
        loop {
            let line = match lines.next_line().await {
                Ok(Some(line)) => line,
                Ok(None) => return,
                Err(e) => {
                    let _ = to_crate.send(Err(e)).await;
                    return;
                }
            };
            if line.trim().is_empty() {
                continue;
            }
            let delivered = match parse.time(|| classify(&line)) {
                Line::Garbage(e) => tx.send(Native::Garbage(e)).await.is_ok(),
                Line::Update(msg) => {
                    // An error: the connection is gone, its end is reported, nothing after.
                    reached.wait_for(|&n| n >= sent).await.is_ok()
                        && tx.send(Native::Message(msg)).await.is_ok()
                }
                Line::Crate => {
                    sent += 1;
                    let marker = format!(
                        r#"{{"jsonrpc":"2.0","method":"{MARKER}","params":{{"n":{sent}}}}}"#
                    );
                    to_crate.send(Ok(line)).await.is_ok() && to_crate.send(Ok(marker)).await.is_ok()
                }
            };
            if !delivered {
                return;
            }
        }
    };
    tokio::spawn(async move {
        tokio::select! {
            () = read => {}
            _ = stopped => {}
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(for_crate))
}

/// The agent's input as a sink of lines (the crate adds no newline).
fn line_sink<W>(
    to_agent: W,
) -> std::pin::Pin<Box<dyn futures::Sink<String, Error = std::io::Error> + Send>>
where
    W: AsyncWrite + Send + Unpin + 'static,
{
    Box::pin(futures::sink::unfold(
        to_agent,
        |mut w, line: String| async move {
            let mut bytes = line.into_bytes();
            bytes.push(b'\n');
            w.write_all(&bytes).await?;
            w.flush().await?;
            Ok::<_, std::io::Error>(w)
        },
    ))
}

enum Connection {
    /// The connection's context is handed over once the crate serves the connection.
    Starting(oneshot::Receiver<ConnectionTo<Agent>>),
    Ready(ConnectionTo<Agent>),
    Failed,
}

/// The adapter's output → crate calls.
struct AcpSink {
    connection: Connection,
    tx: mpsc::Sender<Native>,
    shared: Shared,
    /// Dropped with the sink: ends the connection (the agent sees EOF on its input).
    _stop: oneshot::Sender<()>,
    /// Dropped with the sink: ends the line reader (see `agent_lines`).
    _stop_reader: oneshot::Sender<()>,
}

/// A JSON-RPC 2.0 message of the given members (after `"jsonrpc"`, in this order), each moved in:
/// `json!` copies every value it interpolates (it serializes it into a new tree), and a
/// `session/update`'s params are the bulk of every line an agent writes.
fn rpc<const N: usize>(members: [(&str, Value); N]) -> Value {
    let mut m = serde_json::Map::with_capacity(N + 1);
    m.insert("jsonrpc".into(), Value::from("2.0"));
    for (k, v) in members {
        m.insert(k.into(), v);
    }
    Value::Object(m)
}

fn error_json(e: &Error) -> Value {
    let mut error = json!({"code": i32::from(e.code), "message": e.message});
    if let (Some(data), Some(obj)) = (&e.data, error.as_object_mut()) {
        obj.insert("data".into(), data.clone());
    }
    error
}

/// A JSON-RPC error object from the adapter → the crate's error.
fn error_from_json(v: &Value) -> Error {
    let code = v
        .get("code")
        .and_then(Value::as_i64)
        .and_then(|c| i32::try_from(c).ok())
        .unwrap_or(-32603);
    let message = v
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("error")
        .to_string();
    let error = Error::new(code, message);
    match v.get("data") {
        Some(data) => error.data(data.clone()),
        None => error,
    }
}

fn id_key(id: &Value) -> String {
    match id {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl AcpSink {
    async fn connection(&mut self) -> Result<ConnectionTo<Agent>, String> {
        if let Connection::Starting(rx) = &mut self.connection {
            self.connection = match rx.await {
                Ok(cx) => Connection::Ready(cx),
                Err(_) => Connection::Failed,
            };
        }
        match &self.connection {
            Connection::Ready(cx) => {
                if cx.termination().is_some() || cx.is_incoming_closed() {
                    Err("the ACP connection is closed".into())
                } else {
                    Ok(cx.clone())
                }
            }
            _ => Err("the ACP connection did not start".into()),
        }
    }

    /// Hands a locally made message to the runtime without waiting on it (the runtime is the
    /// caller of `send`, so awaiting room in its channel here could deadlock).
    fn local(&self, msg: Value) {
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(Native::Message(msg)).await;
        });
    }

    /// Publishes a typed request; its answer comes back tagged with the adapter's id.
    fn request<Req: JsonRpcRequest>(
        &self,
        cx: &ConnectionTo<Agent>,
        id: Value,
        method: &str,
        params: &Value,
    ) -> Result<(), String> {
        let request = match Req::parse_message(method, params) {
            Ok(r) => r,
            Err(e) => {
                warn!(id = %id, method, code = i32::from(e.code), "acp: request does not fit the schema; answered locally");
                let error = Error::invalid_params().data(json!({"method": method}));
                self.local(json!({"jsonrpc": "2.0", "id": id, "error": error_json(&error)}));
                return Ok(());
            }
        };
        debug!(id = %id, method, "acp: request to the agent");
        let tx = self.tx.clone();
        let owned_method = method.to_string();
        cx.prepare_request(request)
            .on_receiving_result(move |result| async move {
                let msg = match result {
                    Ok(response) => match response.into_json(&owned_method) {
                        Ok(v) => rpc([("id", id), ("result", v)]),
                        Err(e) => json!({"jsonrpc": "2.0", "id": id, "error": error_json(&e)}),
                    },
                    Err(e) if is_incoming_transport_closed(&e) || is_connection_terminated(&e) => {
                        // The exit is reported once, by the connection's end.
                        debug!(id = %id, method = %owned_method, "acp: request unanswered at exit");
                        return Ok(());
                    }
                    Err(e) => {
                        debug!(id = %id, method = %owned_method, code = i32::from(e.code), "acp: request failed");
                        json!({"jsonrpc": "2.0", "id": id, "error": error_json(&e)})
                    }
                };
                let _ = tx.send(Native::Message(msg)).await;
                Ok(())
            })
            .map_err(|e| format!("{method} not sent: {}", e.message))
    }

    fn notify(&self, cx: &ConnectionTo<Agent>, method: &str, params: &Value) -> Result<(), String> {
        let sent = match method {
            "session/cancel" => {
                let notification = CancelNotification::parse_message(method, params)
                    .map_err(|e| format!("{method} does not fit the schema: {}", e.message))?;
                cx.send_notification(notification)
            }
            _ => {
                let notification = UntypedMessage::new(method, params)
                    .map_err(|e| format!("{method} not sent: {}", e.message))?;
                cx.send_notification(notification)
            }
        };
        debug!(method, ok = sent.is_ok(), "acp: notification to the agent");
        sent.map_err(|e| format!("{method} not sent: {}", e.message))
    }

    fn respond(&self, id: &Value, message: &Value) -> Result<(), String> {
        let key = id_key(id);
        let waiting = lock(&self.shared)
            .by_id
            .remove(&key)
            .ok_or_else(|| format!("no agent request {key} is waiting for an answer"))?;
        let error = message.get("error").map(error_from_json);
        let result = message.get("result").cloned().unwrap_or(Value::Null);
        debug!(id = %key, error = error.is_some(), "acp: answer to the agent");
        let sent = match (waiting, error) {
            (Waiting::Permission(r), Some(e)) => r.respond_with_error(e),
            (Waiting::Permission(r), None) => {
                let response = match RequestPermissionResponse::from_json(PERMISSION, result) {
                    Ok(response) => response,
                    Err(_) => {
                        warn!(id = %key, "acp: permission answer does not fit the schema; sent as cancelled");
                        RequestPermissionResponse::new(RequestPermissionOutcome::Cancelled)
                    }
                };
                r.respond(response)
            }
            (Waiting::Other(r), Some(e)) => r.respond_with_error(e),
            (Waiting::Other(r), None) => r.respond(result),
        };
        sent.map_err(|e| format!("answer to {key} not sent: {}", e.message))
    }
}

impl NativeSink for AcpSink {
    fn send<'a>(&'a mut self, message: &'a Value) -> BoxFuture<'a, Result<(), WriteError>> {
        Box::pin(async move {
            self.send_native(message)
                .await
                .map_err(WriteError::Transport)
        })
    }
}

impl AcpSink {
    async fn send_native(&mut self, message: &Value) -> Result<(), String> {
        {
            let cx = self.connection().await?;
            let method = message.get("method").and_then(Value::as_str);
            let id = message.get("id").filter(|id| !id.is_null());
            let params = message.get("params").cloned().unwrap_or(Value::Null);
            match (method, id) {
                (Some(method), Some(id)) => {
                    let id = id.clone();
                    match method {
                        "initialize" => self.request::<InitializeRequest>(&cx, id, method, &params),
                        "session/new" => {
                            self.request::<NewSessionRequest>(&cx, id, method, &params)
                        }
                        "session/load" => {
                            self.request::<LoadSessionRequest>(&cx, id, method, &params)
                        }
                        "session/prompt" => self.request::<PromptRequest>(&cx, id, method, &params),
                        _ => self.request::<UntypedMessage>(&cx, id, method, &params),
                    }
                }
                (Some(method), None) => self.notify(&cx, method, &params),
                (None, Some(id)) => self.respond(id, message),
                (None, None) => Err("neither a request, a notification nor a response".into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

    const WAIT: Duration = Duration::from_secs(10);

    /// The agent's end of an in-memory stdio pair.
    struct FakeAgent {
        lines: tokio::io::Lines<BufReader<tokio::io::ReadHalf<tokio::io::DuplexStream>>>,
        out: tokio::io::WriteHalf<tokio::io::DuplexStream>,
    }

    impl FakeAgent {
        async fn recv(&mut self) -> Value {
            let line = tokio::time::timeout(WAIT, self.lines.next_line())
                .await
                .expect("the client writes in time")
                .expect("read")
                .expect("a line");
            serde_json::from_str(&line).expect("the client writes JSON")
        }

        async fn write(&mut self, line: &str) {
            self.out.write_all(line.as_bytes()).await.expect("write");
            self.out.write_all(b"\n").await.expect("write");
            self.out.flush().await.expect("flush");
        }

        async fn send(&mut self, v: Value) {
            self.write(&v.to_string()).await;
        }
    }

    fn start() -> (mpsc::Receiver<Native>, AcpSink, FakeAgent) {
        let (client, agent) = tokio::io::duplex(1 << 16);
        let (client_read, client_write) = tokio::io::split(client);
        let (agent_read, agent_write) = tokio::io::split(agent);
        let (rx, sink) = connect(client_read, client_write, ParseClock::default());
        let agent = FakeAgent {
            lines: BufReader::new(agent_read).lines(),
            out: agent_write,
        };
        (rx, sink, agent)
    }

    async fn next(rx: &mut mpsc::Receiver<Native>) -> Native {
        tokio::time::timeout(WAIT, rx.recv())
            .await
            .expect("the transport delivers in time")
            .expect("the channel is open")
    }

    async fn next_message(rx: &mut mpsc::Receiver<Native>) -> Value {
        match next(rx).await {
            Native::Message(v) => v,
            other => panic!("expected a message, got {other:?}"),
        }
    }

    /// What the adapter sends first (`AcpAdapter::open`).
    fn adapter_initialize() -> Value {
        json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": 1, "clientCapabilities": {
                "fs": {"readTextFile": false, "writeTextFile": false}, "terminal": false,
                "subagents": {}}}})
    }

    /// The demo agent's `initialize` answer (agents/demo.rs header).
    fn demo_initialize_result() -> Value {
        json!({"protocolVersion": 1,
               "agentCapabilities": {"loadSession": true},
               "authMethods": [],
               "agentInfo": {"name": "tutti-demo-agent", "version": "0.1.0"}})
    }

    /// Runs the handshake; returns the agent's id of the adapter's request 0.
    async fn initialize(
        rx: &mut mpsc::Receiver<Native>,
        sink: &mut AcpSink,
        agent: &mut FakeAgent,
    ) -> Value {
        sink.send(&adapter_initialize()).await.expect("sent");
        let req = agent.recv().await;
        assert_eq!(req["method"], "initialize");
        assert_eq!(req["params"]["clientCapabilities"]["subagents"], json!({}));
        agent
            .send(json!({"jsonrpc": "2.0", "id": req["id"], "result": demo_initialize_result()}))
            .await;
        let answer = next_message(rx).await;
        assert_eq!(answer["id"], 0, "tagged with the adapter's id: {answer}");
        answer["result"].clone()
    }

    #[tokio::test]
    async fn requests_answers_updates_and_garbage_keep_their_shapes_and_order() {
        let (mut rx, mut sink, mut agent) = start();
        let init = initialize(&mut rx, &mut sink, &mut agent).await;
        assert_eq!(
            init.pointer("/agentCapabilities/loadSession"),
            Some(&json!(true)),
            "the capability survives: {init}"
        );

        sink.send(&json!({"jsonrpc": "2.0", "id": 1, "method": "session/new",
                          "params": {"cwd": "/tmp", "mcpServers": []}}))
            .await
            .expect("sent");
        let req = agent.recv().await;
        assert_eq!(req["method"], "session/new");
        assert_eq!(req["params"]["cwd"], "/tmp");
        agent
            .send(json!({"jsonrpc": "2.0", "id": req["id"], "result": {"sessionId": "s1"}}))
            .await;
        let answer = next_message(&mut rx).await;
        assert_eq!(answer["id"], 1);
        assert_eq!(answer["result"]["sessionId"], "s1");

        sink.send(&json!({"jsonrpc": "2.0", "id": 2, "method": "session/prompt",
                          "params": {"sessionId": "s1", "prompt": [{"type": "text", "text": "hi"}]}}))
            .await
            .expect("sent");
        let prompt = agent.recv().await;
        assert_eq!(prompt["method"], "session/prompt");
        assert_eq!(prompt["params"]["prompt"][0]["text"], "hi");

        agent.write("this line is not JSON").await;
        agent.write("").await;
        let updates = [
            json!({"sessionUpdate": "tool_call", "toolCallId": "s1-delegate-1",
                   "title": "Delegate to explorer", "status": "in_progress",
                   "rawInput": {"agent": "explorer", "background": false}}),
            json!({"sessionUpdate": "subagent_update", "sessionId": "s1-child-1",
                   "title": "explorer", "description": "subtask 1 of 1",
                   "capabilities": {"cancel": {}}}),
            json!({"sessionUpdate": "tool_call_update", "toolCallId": "s1-delegate-1",
                   "content": [{"type": "session", "sessionId": "s1-child-1"}]}),
            json!({"sessionUpdate": "session_message", "messageId": "toolu_1",
                   "senderSessionId": "s1", "recipientSessionId": "s1-child-1",
                   "recipientMessageId": "toolu_1",
                   "content": [{"type": "text", "text": "go"}]}),
            json!({"sessionUpdate": "subagent_update", "sessionId": "s1-child-1",
                   "state": {"state": "running"}}),
            json!({"sessionUpdate": "subagent_update", "sessionId": "s1-child-1",
                   "state": {"state": "idle", "stopReason": "error",
                             "error": {"code": -32603, "message": "subagent failed"}}}),
            json!({"sessionUpdate": "tool_call", "toolCallId": "s1-read", "title": "Read",
                   "kind": "read"}),
            json!({"sessionUpdate": "agent_message_chunk",
                   "content": {"type": "text", "text": "done"}}),
        ];
        for u in &updates {
            agent
                .send(json!({"jsonrpc": "2.0", "method": "session/update",
                             "params": {"sessionId": "s1", "update": u}}))
                .await;
        }
        agent
            .send(
                json!({"jsonrpc": "2.0", "id": prompt["id"], "result": {"stopReason": "end_turn"}}),
            )
            .await;

        match next(&mut rx).await {
            Native::Garbage(e) => assert!(e.contains("21 bytes"), "{e}"),
            other => panic!("expected garbage, got {other:?}"),
        }
        for u in &updates {
            let msg = next_message(&mut rx).await;
            assert_eq!(msg["method"], "session/update");
            assert_eq!(msg["params"]["sessionId"], "s1");
            let got = &msg["params"]["update"];
            for key in [
                "sessionUpdate",
                "toolCallId",
                "title",
                "status",
                "sessionId",
                "capabilities",
                "_meta",
                "state",
                "content",
                "kind",
                "rawInput",
                "messageId",
                "senderSessionId",
                "recipientSessionId",
                "recipientMessageId",
            ] {
                assert_eq!(got.get(key), u.get(key), "{key} of {u} came back as {got}");
            }
        }
        let answer = next_message(&mut rx).await;
        assert_eq!(
            answer,
            json!({"jsonrpc": "2.0", "id": 2, "result": {"stopReason": "end_turn"}})
        );

        // An error answer keeps the adapter's id, code and message.
        sink.send(
            &json!({"jsonrpc": "2.0", "id": 3, "method": "session/prompt",
                          "params": {"sessionId": "nope", "prompt": []}}),
        )
        .await
        .expect("sent");
        let req = agent.recv().await;
        agent
            .send(json!({"jsonrpc": "2.0", "id": req["id"],
                         "error": {"code": -32602, "message": "unknown session"}}))
            .await;
        let answer = next_message(&mut rx).await;
        assert_eq!(answer["id"], 3);
        assert_eq!(answer["error"]["code"], -32602);
        assert_eq!(answer["error"]["message"], "unknown session");

        // Params that don't fit the schema: answered locally, nothing on the wire.
        sink.send(
            &json!({"jsonrpc": "2.0", "id": 4, "method": "session/prompt",
                          "params": {"prompt": 7}}),
        )
        .await
        .expect("answered locally");
        let answer = next_message(&mut rx).await;
        assert_eq!(answer["id"], 4);
        assert_eq!(answer["error"]["code"], -32602);
    }

    /// `session/update`s are forwarded as the agent wrote them, without a round trip through the
    /// schema's types: fields outside the schema stay, and an update the schema would refuse
    /// reaches the adapter, which refuses it with a typed error (see the adapter's test
    /// `acp_an_update_without_its_tag_is_refused_and_changes_nothing`). Order is kept.
    #[tokio::test]
    async fn updates_are_forwarded_as_the_agent_wrote_them() {
        let (mut rx, mut sink, mut agent) = start();
        initialize(&mut rx, &mut sink, &mut agent).await;
        let malformed = json!({"sessionId": "s1", "update": 5});
        agent
            .send(json!({"jsonrpc": "2.0", "method": "session/update", "params": malformed}))
            .await;
        let unknown = json!({"sessionId": "s1", "update": {
            "sessionUpdate": "agent_message_chunk", "notInTheSchema": 1,
            "content": {"type": "text", "text": "ok", "alsoNot": [1, 2]}}});
        agent
            .send(json!({"jsonrpc": "2.0", "method": "session/update", "params": unknown}))
            .await;
        for params in [malformed, unknown] {
            let msg = next_message(&mut rx).await;
            assert_eq!(
                msg,
                json!({"jsonrpc": "2.0", "method": "session/update", "params": params})
            );
        }
    }

    /// The reader hands updates to the runtime itself and every other line to the crate; the
    /// runtime still gets everything in wire order, also when an update follows a crate-handled
    /// line at once (the late update after a prompt's answer, an update after a permission
    /// request), in one burst of the agent's output. Markers reach neither the adapter nor the
    /// agent.
    #[tokio::test]
    async fn updates_keep_their_wire_order_with_what_the_crate_dispatches() {
        let (mut rx, mut sink, mut agent) = start();
        initialize(&mut rx, &mut sink, &mut agent).await;
        let update = |n: u32| {
            json!({"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "s1",
                "update": {"sessionUpdate": "agent_message_chunk",
                           "content": {"type": "text", "text": format!("u{n}")}}}})
        };
        for round in 0..20u32 {
            let prompt_id = 100 + round;
            sink.send(
                &json!({"jsonrpc": "2.0", "id": prompt_id, "method": "session/prompt",
                              "params": {"sessionId": "s1", "prompt": []}}),
            )
            .await
            .expect("sent");
            let prompt = agent.recv().await;
            let answer =
                json!({"jsonrpc": "2.0", "id": prompt["id"], "result": {"stopReason": "end_turn"}});
            let permission = json!({"jsonrpc": "2.0", "id": format!("p{round}"), "method": PERMISSION,
                "params": {"sessionId": "s1", "toolCall": {"toolCallId": "t"},
                           "options": [{"optionId": "a", "name": "A", "kind": "allow_once"}]}});
            let other = json!({"jsonrpc": "2.0", "method": "_vendor/note", "params": {"n": round}});
            let burst = [
                update(1),
                answer,
                update(2),
                permission,
                update(3),
                other,
                update(4),
            ];
            let text: String = burst.iter().map(|m| format!("{m}\n")).collect();
            agent.out.write_all(text.as_bytes()).await.expect("write");
            agent.out.flush().await.expect("flush");
            let mut got = Vec::new();
            for _ in 0..burst.len() {
                let m = next_message(&mut rx).await;
                got.push(
                    m.get("method")
                        .and_then(Value::as_str)
                        .map(|method| match method {
                            "session/update" => m["params"]["update"]["content"]["text"]
                                .as_str()
                                .unwrap_or("?")
                                .to_string(),
                            other => other.to_string(),
                        })
                        .unwrap_or_else(|| format!("answer {}", m["id"])),
                );
            }
            assert_eq!(
                got,
                [
                    "u1".to_string(),
                    format!("answer {prompt_id}"),
                    "u2".into(),
                    PERMISSION.into(),
                    "u3".into(),
                    "_vendor/note".into(),
                    "u4".into()
                ],
                "round {round}"
            );
            let perm_id = format!("perm-{round}");
            sink.send(&json!({"jsonrpc": "2.0", "id": perm_id,
                              "result": {"outcome": {"outcome": "cancelled"}}}))
                .await
                .expect("answered");
            let answered = agent.recv().await;
            assert_eq!(
                answered["id"],
                format!("p{round}"),
                "no marker reached the agent"
            );
        }
        assert!(rx.try_recv().is_err(), "no marker reached the adapter");
    }

    #[tokio::test]
    async fn agent_requests_are_answered_through_their_responders() {
        let (mut rx, mut sink, mut agent) = start();
        initialize(&mut rx, &mut sink, &mut agent).await;
        let params = json!({"sessionId": "s1-child-1",
            "toolCall": {"toolCallId": "s1-child-1-edit", "title": "Edit src/lib.rs", "kind": "edit"},
            "options": [{"optionId": "allow", "name": "Allow", "kind": "allow_once"},
                        {"optionId": "reject", "name": "Reject", "kind": "reject_once"}]});
        agent
            .send(json!({"jsonrpc": "2.0", "id": "d4e6", "method": PERMISSION, "params": params}))
            .await;
        let req = next_message(&mut rx).await;
        assert_eq!(req["method"], PERMISSION);
        assert_eq!(req["id"], "perm-0");
        assert_eq!(req["params"]["sessionId"], "s1-child-1");
        assert_eq!(req["params"]["options"], params["options"]);
        assert_eq!(req["params"]["toolCall"]["toolCallId"], "s1-child-1-edit");

        // An unknown id is an error, and the waiting request is untouched.
        let unknown = json!({"jsonrpc": "2.0", "id": "perm-9",
                             "result": {"outcome": {"outcome": "cancelled"}}});
        assert!(sink.send(&unknown).await.is_err());
        sink.send(&json!({"jsonrpc": "2.0", "id": "perm-0",
                          "result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}))
            .await
            .expect("answered");
        let answer = agent.recv().await;
        assert_eq!(answer["id"], "d4e6");
        assert_eq!(
            answer["result"]["outcome"],
            json!({"outcome": "selected", "optionId": "allow"})
        );
        // Answered once: the id is gone.
        assert!(sink
            .send(&json!({"jsonrpc": "2.0", "id": "perm-0", "result": {"outcome": {"outcome": "cancelled"}}}))
            .await
            .is_err());

        // A permission request outside the schema is answered by the crate, not forwarded.
        agent
            .send(json!({"jsonrpc": "2.0", "id": "bad", "method": PERMISSION,
                         "params": {"sessionId": 3}}))
            .await;
        let answer = agent.recv().await;
        assert_eq!(answer["id"], "bad");
        assert!(answer["error"]["code"].is_i64(), "{answer}");

        // A request the adapter doesn't serve: forwarded raw, its error answer goes back.
        agent
            .send(
                json!({"jsonrpc": "2.0", "id": 7, "method": "fs/read_text_file",
                         "params": {"sessionId": "s1", "path": "/etc/hosts"}}),
            )
            .await;
        let req = next_message(&mut rx).await;
        assert_eq!(req["method"], "fs/read_text_file");
        assert_eq!(req["params"]["path"], "/etc/hosts");
        let id = req["id"].clone();
        sink.send(&json!({"jsonrpc": "2.0", "id": id,
                          "error": {"code": -32601, "message": "method not found"}}))
            .await
            .expect("answered");
        let answer = agent.recv().await;
        assert_eq!(answer["id"], 7);
        assert_eq!(answer["error"]["code"], -32601);
    }

    #[tokio::test]
    async fn cancel_goes_out_and_agent_exit_is_one_exited_without_a_fake_answer() {
        let (mut rx, mut sink, mut agent) = start();
        initialize(&mut rx, &mut sink, &mut agent).await;
        sink.send(&json!({"jsonrpc": "2.0", "id": 1, "method": "session/prompt",
                          "params": {"sessionId": "s1", "prompt": [{"type": "text", "text": "x"}]}}))
            .await
            .expect("sent");
        assert_eq!(agent.recv().await["method"], "session/prompt");
        sink.send(&json!({"jsonrpc": "2.0", "method": "session/cancel",
                          "params": {"sessionId": "s1"}}))
            .await
            .expect("sent");
        let cancel = agent.recv().await;
        assert_eq!(cancel["method"], "session/cancel");
        assert_eq!(cancel["params"]["sessionId"], "s1");
        assert!(cancel.get("id").is_none());

        drop(agent);
        match next(&mut rx).await {
            Native::Exited(_) => {}
            other => panic!("expected the exit, got {other:?}"),
        }
        let cancel = json!({"jsonrpc": "2.0", "method": "session/cancel",
                            "params": {"sessionId": "s1"}});
        assert!(
            sink.send(&cancel).await.is_err(),
            "a cancel after the exit fails"
        );
        // One exit and nothing after it: no made-up answer to the open prompt (id 1), no
        // second exit. The channel closes once the transport's tasks end.
        drop(sink);
        let mut after = Vec::new();
        while let Some(item) = tokio::time::timeout(WAIT, rx.recv())
            .await
            .expect("the transport's channel closes after the exit")
        {
            after.push(item);
        }
        assert!(after.is_empty(), "items after the exit: {after:?}");
    }

    #[tokio::test]
    async fn dropping_the_sink_closes_the_agents_input() {
        let (mut rx, mut sink, mut agent) = start();
        initialize(&mut rx, &mut sink, &mut agent).await;
        drop(sink);
        let eof = tokio::time::timeout(WAIT, agent.lines.next_line())
            .await
            .expect("EOF in time")
            .expect("read");
        assert!(eof.is_none(), "the agent sees EOF");
    }
}
