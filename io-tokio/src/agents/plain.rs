//! `tutti-plain-agent`: a plain, root-only ACP (v1) agent over stdio, built with the
//! `agent-client-protocol` crate. It advertises no subagent capability and never sends
//! `subagent_update`, whatever the client advertises.
//!
//! A prompt streams a few `agent_message_chunk` updates and one ordinary tool call titled
//! `Task` (shaped like a delegation: `kind` `other`, which the wire omits as the default, and
//! `rawInput: {"description": ..., "subagent_type": "general-purpose"}`), then answers
//! `{"stopReason":"end_turn"}`. (Session ids are `plain-session-<start time and pid, hex>-<n>`;
//! the examples below shorten them to `plain-session-1`.) The spec's rule this agent exists to prove: "a tool named
//! Task, Agent, or similar is not enough" to create a child session.
//!
//! ```json
//! {"sessionId":"plain-session-1","update":{"sessionUpdate":"tool_call",
//!   "toolCallId":"plain-session-1-t1-task","title":"Task","status":"in_progress",
//!   "rawInput":{"description":"Look around the workspace","subagent_type":"general-purpose"}}}
//! ```
//!
//! `session/cancel` on the session answers the pending prompt with
//! `{"stopReason":"cancelled"}`.
//!
//! # Directives
//!
//! Whitespace-separated tokens in the prompt text (surrounding punctuation ignored):
//!
//! * `late=1`: about 200 ms after answering the prompt, send one more `session/update`
//!   (an `agent_message_chunk` on the root session), to prove that late updates are
//!   dropped. The delay does not depend on `TUTTI_DEMO_SPEED`.
//! * `hang=1`: after the `Task` tool call (left `in_progress`), stream one more
//!   `agent_message_chunk` ("Still looking around.") and work until cancelled.
//!
//! # Environment
//!
//! * `TUTTI_DEMO_SPEED`: time divisor for the pauses between updates (default `1`, about
//!   1.2 s per prompt).
//! * `TUTTI_DEMO_GARBAGE=1`: write one non-JSON line to stdout before the first real message.
//! * `TUTTI_PLAIN_LATE_SENT=PATH`: after a `late=1` update was written, the agent sends the
//!   client one `fs/read_text_file` request (which a client without file-system capabilities
//!   answers with an error) and, once any answer came back, writes `PATH`. The client read its
//!   input in order, so when `PATH` exists the client has certainly read the late update: a
//!   test waits for the file instead of sleeping.
//! * `TUTTI_PLAIN_HANG_SENT=PATH`: the same round trip and report file after the last chunk of a
//!   `hang=1` prompt, so a test knows the client read that chunk before it cancels.
//! * `TUTTI_PLAIN_FAIL_NEW_SESSIONS=N`: the first `N` `session/new` requests are answered with
//!   an internal error (as `claude-code-acp` does when its Claude CLI refuses to start), the
//!   later ones normally.
//!
//! Logs go to stderr and carry identifiers, counts and lengths only, never prompt text.

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use agent_client_protocol::schema::ProtocolVersion;
use agent_client_protocol::v1::schema::{
    AgentCapabilities, CancelNotification, ContentBlock, ContentChunk, Implementation,
    InitializeRequest, InitializeResponse, NewSessionRequest, NewSessionResponse, PromptRequest,
    PromptResponse, ReadTextFileRequest, SessionNotification, SessionUpdate, StopReason,
    TextContent, ToolCall, ToolCallContent, ToolCallStatus, ToolCallUpdate, ToolCallUpdateFields,
    ToolKind,
};
use agent_client_protocol::v1::{ConnectionTo, Responder};
use agent_client_protocol::{Agent, ByteStreams, Client, Error};
use serde_json::json;
use tokio_util::compat::{TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};
use tokio_util::sync::CancellationToken;

/// Delay of the `late=1` update after the prompt answer.
const LATE_UPDATE_DELAY: Duration = Duration::from_millis(200);

/// Writes one line to stderr, ignoring a closed stderr.
macro_rules! log {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr(), "tutti-plain-agent: {}", format_args!($($arg)*));
    }};
}

/// What a prompt asks for.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Script {
    late: bool,
    hang: bool,
}

fn parse_flag(value: &str) -> Option<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

fn parse_script(text: &str) -> Script {
    let mut script = Script::default();
    let trim = |c: char| {
        matches!(
            c,
            '.' | ',' | ';' | ':' | '!' | '?' | '(' | ')' | '[' | ']' | '"' | '\'' | '`'
        )
    };
    for token in text.split_whitespace() {
        let Some((key, value)) = token.trim_matches(trim).split_once('=') else {
            continue;
        };
        let flag = parse_flag(value);
        match (key.to_ascii_lowercase().as_str(), flag) {
            ("late", Some(flag)) => script.late = flag,
            ("hang", Some(flag)) => script.hang = flag,
            ("late" | "hang", None) => {
                log!("ignored directive {key} (value of {} bytes)", value.len());
            }
            _ => {}
        }
    }
    script
}

#[derive(Default)]
struct Session {
    turns: u64,
    /// Cancellation token of the running prompt, if any.
    active: Option<CancellationToken>,
}

struct Shared {
    speed: f64,
    /// Start time and process id (hex): session ids are unique across agent processes, so a
    /// relaunched agent's new session is told apart from the one before.
    id_prefix: String,
    next_session: Mutex<u64>,
    sessions: Mutex<HashMap<String, Session>>,
}

impl Shared {
    fn sessions(&self) -> MutexGuard<'_, HashMap<String, Session>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct Plain {
    cx: ConnectionTo<Client>,
    shared: Arc<Shared>,
}

impl Plain {
    async fn pause(&self, millis: u64) {
        let secs = millis as f64 / 1000.0 / self.shared.speed;
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    }

    fn update(&self, session: &str, update: SessionUpdate) -> Result<(), Error> {
        self.cx
            .send_notification(SessionNotification::new(session.to_owned(), update))
    }

    /// `TUTTI_PLAIN_LATE_SENT`: a round trip behind the late update, then the report file.
    async fn report_late_update_read(&self, session: &str) {
        self.report_read(session, "TUTTI_PLAIN_LATE_SENT").await;
    }

    /// A round trip behind what was sent so far, then the report file named by `var`.
    async fn report_read(&self, session: &str, var: &str) {
        let Some(path) = std::env::var_os(var) else {
            return;
        };
        let request = ReadTextFileRequest::new(session.to_owned(), "/tutti-plain/update-sent");
        // Any answer, an error included, means the client read past what was sent before.
        let answered = self.cx.send_request(request).block_task().await;
        log!("{var} round trip answered (ok: {})", answered.is_ok());
        if let Err(error) = std::fs::write(&path, b"update sent\n") {
            log!("{var} report not written: {:?}", error.kind());
        }
    }

    fn say(&self, session: &str, text: impl Into<String>) -> Result<(), Error> {
        self.update(
            session,
            SessionUpdate::AgentMessageChunk(ContentChunk::new(ContentBlock::Text(
                TextContent::new(text.into()),
            ))),
        )
    }

    async fn work(
        &self,
        session: &str,
        turn: u64,
        script: Script,
        text_len: usize,
    ) -> Result<(), Error> {
        self.say(
            session,
            format!("Working on the request ({text_len} characters). "),
        )?;
        self.pause(300).await;
        let task = format!("{session}-t{turn}-task");
        self.update(
            session,
            SessionUpdate::ToolCall(
                ToolCall::new(task.clone(), "Task")
                    .kind(ToolKind::Other)
                    .status(ToolCallStatus::InProgress)
                    .raw_input(json!({
                        "description": "Look around the workspace",
                        "subagent_type": "general-purpose",
                    })),
            ),
        )?;
        if script.hang {
            self.say(session, "Still looking around.")?;
            self.report_read(session, "TUTTI_PLAIN_HANG_SENT").await;
            log!("session {session} turn {turn} hangs until cancelled");
            std::future::pending::<()>().await;
        }
        self.pause(600).await;
        self.update(
            session,
            SessionUpdate::ToolCallUpdate(ToolCallUpdate::new(
                task,
                ToolCallUpdateFields::new()
                    .status(ToolCallStatus::Completed)
                    .content(vec![ToolCallContent::from(ContentBlock::Text(
                        TextContent::new("looked around".to_owned()),
                    ))]),
            )),
        )?;
        self.say(session, "The task is done. ")?;
        self.pause(300).await;
        self.say(session, "All done.")?;
        Ok(())
    }

    async fn run_prompt(
        self,
        session: String,
        turn: u64,
        token: CancellationToken,
        script: Script,
        text_len: usize,
        responder: Responder<PromptResponse>,
    ) {
        let result = tokio::select! {
            biased;
            () = token.cancelled() => Ok(StopReason::Cancelled),
            result = self.work(&session, turn, script, text_len) => result.map(|()| StopReason::EndTurn),
        };
        if let Some(entry) = self.shared.sessions().get_mut(&session) {
            entry.active = None;
        }
        let answered = match result {
            Ok(stop_reason) => {
                log!("session {session} turn {turn} answers {stop_reason:?}");
                responder.respond(PromptResponse::new(stop_reason))
            }
            Err(error) => {
                log!(
                    "session {session} turn {turn} failed: transport error {}",
                    error.code
                );
                responder.respond_with_error(error)
            }
        };
        if let Err(error) = answered {
            log!("prompt answer not sent: {}", error.code);
            return;
        }
        if script.late {
            tokio::time::sleep(LATE_UPDATE_DELAY).await;
            log!("session {session} turn {turn} sends a late update");
            match self.say(&session, "(late) One more thing.") {
                Err(error) => log!("late update not sent: {}", error.code),
                Ok(()) => self.report_late_update_read(&session).await,
            }
        }
    }
}

fn prompt_text(prompt: &[ContentBlock]) -> String {
    let mut text = String::new();
    for block in prompt {
        if let ContentBlock::Text(block) = block {
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(&block.text);
        }
    }
    text
}

fn handle_initialize(
    request: InitializeRequest,
    responder: Responder<InitializeResponse>,
) -> Result<(), Error> {
    log!("initialize (client protocol {})", request.protocol_version);
    responder.respond(
        InitializeResponse::new(ProtocolVersion::V1)
            .agent_capabilities(AgentCapabilities::new())
            .agent_info(Implementation::new(
                "tutti-plain-agent",
                env!("CARGO_PKG_VERSION"),
            )),
    )
}

fn handle_new_session(
    shared: &Shared,
    _request: NewSessionRequest,
    responder: Responder<NewSessionResponse>,
) -> Result<(), Error> {
    let number = {
        let mut next = shared
            .next_session
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *next += 1;
        *next
    };
    let failing = std::env::var("TUTTI_PLAIN_FAIL_NEW_SESSIONS")
        .ok()
        .and_then(|n| n.trim().parse::<u64>().ok())
        .unwrap_or(0);
    if number <= failing {
        log!("session/new #{number} refused (TUTTI_PLAIN_FAIL_NEW_SESSIONS)");
        return responder.respond_with_error(
            Error::internal_error()
                .data(json!({"details": "Query closed before response received"})),
        );
    }
    let id = format!("plain-session-{}-{number}", shared.id_prefix);
    shared.sessions().insert(id.clone(), Session::default());
    log!("session/new -> {id}");
    responder.respond(NewSessionResponse::new(id))
}

fn handle_prompt(
    plain: Plain,
    request: PromptRequest,
    responder: Responder<PromptResponse>,
) -> Result<(), Error> {
    let session = request.session_id.0.to_string();
    let text = prompt_text(&request.prompt);
    let script = parse_script(&text);
    let started = {
        let mut sessions = plain.shared.sessions();
        match sessions.get_mut(&session) {
            None => Err(Error::invalid_params().data(json!({"reason": "unknown session"}))),
            Some(entry) if entry.active.is_some() => Err(Error::invalid_request()
                .data(json!({"reason": "a prompt is already running in this session"}))),
            Some(entry) => {
                entry.turns += 1;
                let token = CancellationToken::new();
                entry.active = Some(token.clone());
                Ok((entry.turns, token))
            }
        }
    };
    let (turn, token) = match started {
        Ok(started) => started,
        Err(error) => {
            log!("session/prompt rejected for session {session}");
            return responder.respond_with_error(error);
        }
    };
    let text_len = text.chars().count();
    log!("session {session} turn {turn} prompt ({text_len} characters): {script:?}");
    tokio::spawn(plain.run_prompt(session, turn, token, script, text_len, responder));
    Ok(())
}

fn handle_cancel(shared: &Shared, notification: CancelNotification) {
    let id = notification.session_id.0.to_string();
    match shared.sessions().get(&id) {
        Some(Session {
            active: Some(token),
            ..
        }) => {
            log!("session/cancel {id}");
            token.cancel();
        }
        Some(_) => log!("session/cancel {id}: no prompt running"),
        None => log!("session/cancel for unknown session {id} ignored"),
    }
}

fn speed_from_env() -> f64 {
    std::env::var("TUTTI_DEMO_SPEED")
        .ok()
        .and_then(|value| value.trim().parse::<f64>().ok())
        .filter(|speed| speed.is_finite() && *speed > 0.0)
        .map_or(1.0, |speed| speed.clamp(0.01, 1000.0))
}

fn write_garbage_if_asked() {
    if std::env::var("TUTTI_DEMO_GARBAGE").is_ok_and(|value| value.trim() == "1") {
        let mut stdout = std::io::stdout().lock();
        let written = stdout
            .write_all(b"tutti-plain-agent: this line is not JSON\n")
            .and_then(|()| stdout.flush());
        if written.is_err() {
            log!("garbage line not written");
        }
    }
}

/// Serves the agent on stdio until the client disconnects.
pub async fn serve() -> std::process::ExitCode {
    let shared = Arc::new(Shared {
        speed: speed_from_env(),
        id_prefix: format!(
            "{:x}{:x}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or_default(),
            std::process::id()
        ),
        next_session: Mutex::new(0),
        sessions: Mutex::new(HashMap::new()),
    });
    log!("starting (speed {})", shared.speed);
    write_garbage_if_asked();
    let result = Agent
        .v1()
        .name("tutti-plain-agent")
        .on_receive_request(
            async move |request: InitializeRequest, responder, _cx| {
                handle_initialize(request, responder)
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            {
                let shared = Arc::clone(&shared);
                async move |request: NewSessionRequest, responder, _cx| {
                    handle_new_session(&shared, request, responder)
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_request(
            {
                let shared = Arc::clone(&shared);
                async move |request: PromptRequest, responder, cx: ConnectionTo<Client>| {
                    let plain = Plain {
                        cx,
                        shared: Arc::clone(&shared),
                    };
                    handle_prompt(plain, request, responder)
                }
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_notification(
            {
                let shared = Arc::clone(&shared);
                async move |notification: CancelNotification, _cx| {
                    handle_cancel(&shared, notification);
                    Ok(())
                }
            },
            agent_client_protocol::on_receive_notification!(),
        )
        .connect_to(ByteStreams::new(
            tokio::io::stdout().compat_write(),
            tokio::io::stdin().compat(),
        ))
        .await;
    match result {
        Ok(()) => {
            log!("client closed the connection");
            std::process::ExitCode::SUCCESS
        }
        Err(error) => {
            log!("connection ended with error {}", error.code);
            std::process::ExitCode::FAILURE
        }
    }
}
