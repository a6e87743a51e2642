//! Smoke tests for the two ACP agent binaries of this crate (`tutti-demo-agent`,
//! `tutti-plain-agent`): each test launches a binary as a child process and speaks ACP v1
//! to it over the child's stdio pipes, using the client side of `agent-client-protocol`.
//!
//! The [`AcpClient`] harness below is also the reference for the daemon's ACP transport:
//!
//! * the connection driver (`Client.v1()...connect_with`) runs in its own task and lends a
//!   cloneable `ConnectionTo<Agent>` out, so any task can send requests and notifications;
//! * every message from the agent (session updates, permission requests with their
//!   responders, prompt answers) is pushed into ONE channel from the connection's dispatch
//!   loop, which keeps the wire order: an update sent before the prompt answer is always
//!   received before it;
//! * the prompt is sent with `prepare_request(..).on_receiving_result(..)` so its answer
//!   joins that same ordered channel instead of racing it from another task.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use agent_client_protocol::schema::ProtocolVersion;
use agent_client_protocol::v1::schema::{
    CancelNotification, ClientCapabilities, ContentBlock, Implementation, InitializeRequest,
    InitializeResponse, NewSessionRequest, PromptRequest, PromptResponse, RequestPermissionOutcome,
    RequestPermissionRequest, RequestPermissionResponse, SelectedPermissionOutcome, SessionId,
    SessionNotification, SessionUpdate, StateUpdate, StopReason, SubagentCapabilities,
    SubagentUpdate, TextContent, ToolCallContent,
};
use agent_client_protocol::v1::{ConnectionTo, Responder};
use agent_client_protocol::{Agent, ByteStreams, Client, Error};
use serde_json::Value;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::compat::{TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};

const DEMO: &str = env!("CARGO_BIN_EXE_tutti-demo-agent");
const PLAIN: &str = env!("CARGO_BIN_EXE_tutti-plain-agent");
/// Upper bound for any single wait in these tests.
const WAIT: Duration = Duration::from_secs(20);
/// Time divisor handed to the agents so a scenario takes a fraction of a second.
const FAST: &str = "10";

/// One message from the agent, in wire order.
enum Event {
    /// A `session/update` notification (root or child session).
    Update(SessionNotification),
    /// A `session/request_permission` request; answer it through the responder.
    Permission(
        RequestPermissionRequest,
        Responder<RequestPermissionResponse>,
    ),
    /// The answer to the `session/prompt` request.
    PromptAnswered(Result<PromptResponse, Error>),
}

/// A client connection to an agent child process.
struct AcpClient {
    cx: ConnectionTo<Agent>,
    events: mpsc::UnboundedReceiver<Event>,
    events_tx: mpsc::UnboundedSender<Event>,
    stop: Option<oneshot::Sender<()>>,
    driver: JoinHandle<Result<(), Error>>,
    child: Child,
}

impl AcpClient {
    /// Launches `binary` with `env` and connects to it over its stdio.
    async fn launch(binary: &str, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(binary);
        command
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = command.spawn().expect("agent binary starts");
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        // Outgoing bytes go to the child's stdin, incoming bytes come from its stdout.
        let transport = ByteStreams::new(stdin.compat_write(), stdout.compat());

        let (events_tx, events) = mpsc::unbounded_channel();
        let (cx_tx, cx_rx) = oneshot::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let updates = events_tx.clone();
        let permissions = events_tx.clone();
        let connection = Client
            .v1()
            .name("tutti-acp-smoke")
            // Handlers run inside the dispatch loop, one message at a time: hand the
            // message over and return at once.
            .on_receive_notification(
                async move |notification: SessionNotification, _cx| {
                    let _ = updates.send(Event::Update(notification));
                    Ok(())
                },
                agent_client_protocol::on_receive_notification!(),
            )
            .on_receive_request(
                async move |request: RequestPermissionRequest, responder, _cx| {
                    // Keep the responder: the request is answered later, from elsewhere.
                    let _ = permissions.send(Event::Permission(request, responder));
                    Ok(())
                },
                agent_client_protocol::on_receive_request!(),
            )
            .connect_with(transport, async move |cx: ConnectionTo<Agent>| {
                let _ = cx_tx.send(cx);
                // The connection lives until `stop` fires (or is dropped).
                let _ = stopped.await;
                Ok(())
            });
        let driver = tokio::spawn(connection);
        let cx = tokio::time::timeout(WAIT, cx_rx)
            .await
            .expect("connection starts in time")
            .expect("connection context");
        Self {
            cx,
            events,
            events_tx,
            stop: Some(stop),
            driver,
            child,
        }
    }

    /// `initialize`, with or without the (unstable) client `subagents` capability.
    async fn initialize(&self, subagents: bool) -> InitializeResponse {
        let capabilities = if subagents {
            ClientCapabilities::new().subagents(SubagentCapabilities::new())
        } else {
            ClientCapabilities::new()
        };
        let request = InitializeRequest::new(ProtocolVersion::V1)
            .client_capabilities(capabilities)
            .client_info(Implementation::new("tutti-acp-smoke", "0.0.0"));
        // `block_task` is fine here: this task is not the dispatch loop.
        tokio::time::timeout(WAIT, self.cx.send_request(request).block_task())
            .await
            .expect("initialize answers in time")
            .expect("initialize succeeds")
    }

    async fn new_session(&self) -> SessionId {
        let request = NewSessionRequest::new(PathBuf::from("/"));
        let response = tokio::time::timeout(WAIT, self.cx.send_request(request).block_task())
            .await
            .expect("session/new answers in time")
            .expect("session/new succeeds");
        response.session_id
    }

    /// Sends `session/prompt`; its answer arrives as [`Event::PromptAnswered`], ordered with
    /// the updates.
    fn prompt(&self, session: &SessionId, text: &str) {
        let request = PromptRequest::new(
            session.clone(),
            vec![ContentBlock::Text(TextContent::new(text.to_owned()))],
        );
        let answers = self.events_tx.clone();
        self.cx
            .prepare_request(request)
            .on_receiving_result(async move |result| {
                let _ = answers.send(Event::PromptAnswered(result));
                Ok(())
            })
            .expect("prompt is sent");
    }

    /// Sends `session/cancel` for a root or child session id.
    fn cancel(&self, session: &SessionId) {
        self.cx
            .send_notification(CancelNotification::new(session.clone()))
            .expect("session/cancel is sent");
    }

    async fn next_event(&mut self) -> Event {
        tokio::time::timeout(WAIT, self.events.recv())
            .await
            .expect("the agent sends something in time")
            .expect("the connection is open")
    }

    /// Waits until nothing arrives for `quiet`; returns what arrived meanwhile.
    async fn drain(&mut self, quiet: Duration) -> Vec<Event> {
        let mut events = Vec::new();
        while let Ok(Some(event)) = tokio::time::timeout(quiet, self.events.recv()).await {
            events.push(event);
        }
        events
    }

    /// Closes the connection (the agent sees EOF on stdin) and waits for the process.
    async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let driven = tokio::time::timeout(WAIT, &mut self.driver).await;
        assert!(
            matches!(driven, Ok(Ok(Ok(())))),
            "connection driver ends cleanly"
        );
        let status = tokio::time::timeout(WAIT, self.child.wait())
            .await
            .expect("agent exits after EOF")
            .expect("agent status");
        assert!(status.success(), "agent exits successfully: {status}");
    }
}

fn allow() -> RequestPermissionResponse {
    RequestPermissionResponse::new(RequestPermissionOutcome::Selected(
        SelectedPermissionOutcome::new("allow"),
    ))
}

fn subagent(notification: &SessionNotification) -> Option<&SubagentUpdate> {
    match &notification.update {
        SessionUpdate::SubagentUpdate(update) => Some(update),
        _ => None,
    }
}

fn id(session: &SessionId) -> &str {
    &session.0
}

/// What a test learned about one child session from the wire.
#[derive(Debug, Default, Clone)]
struct ChildFacts {
    parent: String,
    parent_tool_call: String,
    background: bool,
    states: Vec<Value>,
    messages: usize,
    /// Event index of the terminal `idle` snapshot.
    terminal_at: Option<usize>,
}

/// A recorded scenario: events in wire order, child facts, the prompt answer's position.
#[derive(Debug, Default)]
struct Transcript {
    root: String,
    children: Vec<(String, ChildFacts)>,
    root_tool_calls: Vec<String>,
    root_tool_titles: Vec<String>,
    /// (tool call id, background) of every delegation tool call.
    delegations: Vec<(String, bool)>,
    root_messages: usize,
    permissions: Vec<String>,
    answered_at: Option<usize>,
    stop_reason: Option<StopReason>,
    late_root_updates: usize,
    events: usize,
}

impl Transcript {
    fn new(root: &SessionId) -> Self {
        Self {
            root: id(root).to_owned(),
            ..Self::default()
        }
    }

    fn child(&self, child: &str) -> Option<&ChildFacts> {
        self.children
            .iter()
            .find(|(id, _)| id == child)
            .map(|(_, f)| f)
    }

    fn child_mut(&mut self, child: &str) -> Option<&mut ChildFacts> {
        self.children
            .iter_mut()
            .find(|(id, _)| id == child)
            .map(|(_, f)| f)
    }

    fn open_children(&self) -> usize {
        self.children
            .iter()
            .filter(|(_, f)| f.terminal_at.is_none())
            .count()
    }

    /// Records one update and checks the ordering rules that hold for every scenario.
    fn record_update(&mut self, notification: &SessionNotification) {
        let at = self.events;
        self.events += 1;
        let session = id(&notification.session_id).to_owned();
        if let Some(update) = subagent(notification) {
            let child = id(&update.session_id).to_owned();
            let wire = serde_json::to_value(update).expect("subagent_update serializes");
            if self.child(&child).is_none() {
                // The announcement: parent on the outer id; the standard shape has no
                // extension `_meta`.
                assert!(
                    wire.get("_meta").is_none(),
                    "no extension on the announcement: {wire}"
                );
                assert!(
                    session == self.root || self.child(&session).is_some(),
                    "a child is announced on a known parent stream"
                );
                let facts = ChildFacts {
                    parent: session.clone(),
                    ..ChildFacts::default()
                };
                assert!(
                    self.answered_at.is_none(),
                    "children are announced before the prompt answers"
                );
                self.children.push((child.clone(), facts));
            }
            let facts = self.child_mut(&child).expect("known child");
            assert_eq!(facts.parent, session, "state goes to the immediate parent");
            assert!(
                facts.terminal_at.is_none(),
                "nothing follows a terminal snapshot"
            );
            if let Some(state) = update.state.value() {
                if matches!(state, StateUpdate::Idle(_)) {
                    facts.terminal_at = Some(at);
                }
                facts.states.push(wire["state"].clone());
            }
            return;
        }
        // Delegations on any stream: the tool call names its background flag; the standard
        // `session` content links it to the child it delegated to.
        match &notification.update {
            SessionUpdate::ToolCall(call) => {
                let background = call
                    .raw_input
                    .as_ref()
                    .and_then(|i| i.get("background"))
                    .and_then(Value::as_bool);
                if let Some(background) = background {
                    self.delegations
                        .push((call.tool_call_id.0.to_string(), background));
                }
            }
            SessionUpdate::ToolCallUpdate(update) => {
                for content in update.fields.content.iter().flatten() {
                    if let ToolCallContent::Session(reference) = content {
                        let call = update.tool_call_id.0.to_string();
                        let background = self
                            .delegations
                            .iter()
                            .find(|(c, _)| *c == call)
                            .map(|(_, b)| *b)
                            .expect("the session reference is on a delegation tool call");
                        let facts = self
                            .child_mut(id(&reference.session_id))
                            .expect("a session reference names an announced child");
                        assert_eq!(facts.parent, session, "linked on the parent's stream");
                        facts.parent_tool_call = call;
                        facts.background = background;
                    }
                }
            }
            _ => {}
        }
        if session == self.root {
            if self.answered_at.is_some() {
                self.late_root_updates += 1;
            }
            match &notification.update {
                SessionUpdate::AgentMessageChunk(_) => self.root_messages += 1,
                SessionUpdate::ToolCall(call) => {
                    self.root_tool_calls.push(call.tool_call_id.0.to_string());
                    self.root_tool_titles.push(call.title.clone());
                }
                _ => {}
            }
            return;
        }
        let facts = self
            .child_mut(&session)
            .expect("child traffic follows the child's announcement");
        assert!(
            facts.terminal_at.is_none(),
            "no child traffic after its terminal snapshot"
        );
        if matches!(notification.update, SessionUpdate::AgentMessageChunk(_)) {
            facts.messages += 1;
        }
    }

    fn record_answer(&mut self, answer: Result<PromptResponse, Error>) {
        let answer = answer.expect("the prompt succeeds");
        self.answered_at = Some(self.events);
        self.events += 1;
        self.stop_reason = Some(answer.stop_reason);
    }

    fn stop_reason(&self) -> StopReason {
        self.stop_reason.expect("the prompt answered")
    }

    /// The `stopReason` of a child's terminal snapshot (`end_turn`, `error`, `cancelled`).
    fn terminal(&self, child: &str) -> &Value {
        let facts = self.child(child).expect("child announced");
        assert!(facts.terminal_at.is_some(), "child {child} is terminal");
        let last = facts.states.last().expect("a state");
        assert_eq!(last["state"], "idle");
        &last["stopReason"]
    }
}

/// Runs one prompt to the end: until it answered and every announced child is terminal.
/// `permission` decides each permission request (by child session id).
async fn run_prompt(
    client: &mut AcpClient,
    session: &SessionId,
    text: &str,
    mut permission: impl FnMut(&RequestPermissionRequest) -> RequestPermissionResponse,
) -> Transcript {
    let mut transcript = Transcript::new(session);
    client.prompt(session, text);
    while transcript.answered_at.is_none() || transcript.open_children() > 0 {
        match client.next_event().await {
            Event::Update(notification) => transcript.record_update(&notification),
            Event::Permission(request, responder) => {
                let child = id(&request.session_id).to_owned();
                assert!(
                    transcript.child(&child).is_some(),
                    "a permission request names an announced child session"
                );
                transcript.permissions.push(child);
                responder
                    .respond(permission(&request))
                    .expect("permission answer is sent");
            }
            Event::PromptAnswered(answer) => transcript.record_answer(answer),
        }
    }
    transcript
}

fn child_id(root: &SessionId, turn: u32, path: &str) -> String {
    format!("{}-t{turn}-{path}", id(root))
}

/// ACP v1 has no agent capability for subagents (the client opts in): neither bundled agent
/// advertises the retired `tutti.dev/subagents` extension.
#[tokio::test]
async fn the_bundled_agents_advertise_no_subagent_extension() {
    for agent in [DEMO, PLAIN] {
        let client = AcpClient::launch(agent, &[("TUTTI_DEMO_SPEED", FAST)]).await;
        let init = client.initialize(true).await;
        assert_eq!(init.protocol_version, ProtocolVersion::V1);
        let meta = init.agent_capabilities.meta.unwrap_or_default();
        assert!(
            !meta.keys().any(|k| k.starts_with("tutti.dev")),
            "{agent}: {meta:?}"
        );
        client.shutdown().await;
    }
}

/// Default scenario: 3 children; child 1 asks a permission, child 2 fails, child 3 runs in
/// the background and finishes after the prompt answered `end_turn`.
#[tokio::test]
async fn demo_prompt_spawns_children_that_settle_around_the_root_answer() {
    let mut client = AcpClient::launch(DEMO, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(true).await;
    let root = client.new_session().await;
    let t = run_prompt(&mut client, &root, "Please fix the build.", |_| allow()).await;

    assert_eq!(t.stop_reason(), StopReason::EndTurn);
    assert_eq!(t.children.len(), 3);
    assert!(t.root_messages > 0, "the root streams messages");
    let (c1, c2, c3) = (
        child_id(&root, 1, "child-1"),
        child_id(&root, 1, "child-2"),
        child_id(&root, 1, "child-3"),
    );
    for (child, facts) in &t.children {
        assert_eq!(facts.parent, t.root, "{child} is a root child");
        assert!(
            t.root_tool_calls.contains(&facts.parent_tool_call),
            "{child}'s parent tool call was opened on the root before the announcement"
        );
        assert!(facts.messages > 0, "{child} streams its own messages");
        assert_eq!(facts.states.first().expect("a state")["state"], "running");
    }
    assert_eq!(t.permissions, vec![c1.clone()]);
    let c1_states: Vec<&Value> = t
        .child(&c1)
        .expect("child 1")
        .states
        .iter()
        .map(|s| &s["state"])
        .collect();
    assert_eq!(c1_states, ["running", "requires_action", "running", "idle"]);
    assert_eq!(t.terminal(&c1), "end_turn");
    assert_eq!(t.terminal(&c2), "error");
    let failure = &t.child(&c2).expect("child 2").states.last().expect("state")["error"];
    assert!(failure["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert_eq!(t.terminal(&c3), "end_turn");

    let answered = t.answered_at.expect("answered");
    let late = t.child(&c3).expect("child 3");
    assert!(late.background && !t.child(&c1).expect("child 1").background);
    assert!(
        late.terminal_at.expect("terminal") > answered,
        "the background child outlives the prompt"
    );
    for child in [&c1, &c2] {
        assert!(
            t.child(child)
                .and_then(|f| f.terminal_at)
                .expect("terminal")
                < answered
        );
    }
    assert_eq!(
        t.late_root_updates, 0,
        "nothing root-scoped follows the answer"
    );
    client.shutdown().await;
}

#[tokio::test]
async fn demo_nested_child_is_announced_on_its_parent_child() {
    let mut client = AcpClient::launch(DEMO, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(true).await;
    let root = client.new_session().await;
    let t = run_prompt(
        &mut client,
        &root,
        "nested work: children=1 permission=0 fail=0 late=0",
        |_| allow(),
    )
    .await;
    assert_eq!(t.stop_reason(), StopReason::EndTurn);
    let child = child_id(&root, 1, "child-1");
    let grandchild = format!("{child}-child-1");
    let nested = t.child(&grandchild).expect("grandchild announced");
    assert_eq!(nested.parent, child, "announced on the child's stream");
    assert_eq!(nested.parent_tool_call, format!("{child}-delegate-1"));
    assert!(nested.messages > 0);
    assert_eq!(t.terminal(&grandchild), "end_turn");
    assert!(
        nested.terminal_at < t.child(&child).and_then(|f| f.terminal_at),
        "the grandchild settles before its parent"
    );
    client.shutdown().await;
}

#[tokio::test]
async fn demo_cancel_settles_children_cancelled_before_the_prompt_answers() {
    let mut client = AcpClient::launch(DEMO, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(true).await;
    let root = client.new_session().await;
    let mut t = Transcript::new(&root);
    client.prompt(
        &root,
        "children=2 hang=1,2 permission=0 fail=0 late=2 nested=1",
    );
    // Cancel once both children (and child 1's grandchild) run.
    while t.children.len() < 3 || t.children.iter().any(|(_, f)| f.states.is_empty()) {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            Event::Permission(..) => panic!("no permission in this scenario"),
            Event::PromptAnswered(_) => panic!("the prompt hangs until cancelled"),
        }
    }
    client.cancel(&root);
    while t.answered_at.is_none() {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            Event::Permission(..) => panic!("no permission in this scenario"),
            Event::PromptAnswered(answer) => t.record_answer(answer),
        }
    }
    assert_eq!(t.stop_reason(), StopReason::Cancelled);
    assert_eq!(
        t.open_children(),
        0,
        "every child settled before the answer"
    );
    for (child, _) in &t.children {
        assert_eq!(t.terminal(child), "cancelled", "{child}");
    }
    let c1 = child_id(&root, 1, "child-1");
    assert!(
        t.child(&format!("{c1}-child-1"))
            .and_then(|f| f.terminal_at)
            < t.child(&c1).and_then(|f| f.terminal_at),
        "descendants settle before their parent"
    );
    assert!(client.drain(Duration::from_millis(300)).await.is_empty());
    client.shutdown().await;
}

#[tokio::test]
async fn demo_cancel_of_one_child_leaves_the_rest_running() {
    let mut client = AcpClient::launch(DEMO, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(true).await;
    let root = client.new_session().await;
    let c1 = child_id(&root, 1, "child-1");
    let mut t = Transcript::new(&root);
    client.prompt(&root, "children=2 hang=1 permission=0 fail=0 late=0");
    while t.child(&c1).is_none_or(|f| f.states.is_empty()) {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            _ => panic!("only updates before the child runs"),
        }
    }
    client.cancel(&SessionId::new(c1.clone()));
    while t.answered_at.is_none() || t.open_children() > 0 {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            Event::Permission(..) => panic!("no permission in this scenario"),
            Event::PromptAnswered(answer) => t.record_answer(answer),
        }
    }
    assert_eq!(t.terminal(&c1), "cancelled");
    assert_eq!(t.terminal(&child_id(&root, 1, "child-2")), "end_turn");
    assert_eq!(t.stop_reason(), StopReason::EndTurn);
    client.shutdown().await;
}

/// A background child that works until cancelled outlives the prompt; cancelling the root
/// session afterwards settles it, with no prompt left to answer.
#[tokio::test]
async fn demo_cancel_after_the_answer_settles_background_children() {
    let mut client = AcpClient::launch(DEMO, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(true).await;
    let root = client.new_session().await;
    let c1 = child_id(&root, 1, "child-1");
    let mut t = Transcript::new(&root);
    client.prompt(&root, "children=1 late=1 hang=1 permission=0 fail=0");
    while t.answered_at.is_none() {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            Event::Permission(..) => panic!("no permission in this scenario"),
            Event::PromptAnswered(answer) => t.record_answer(answer),
        }
    }
    assert_eq!(t.stop_reason(), StopReason::EndTurn);
    assert_eq!(t.open_children(), 1, "the background child still runs");
    client.cancel(&root);
    while t.open_children() > 0 {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            _ => panic!("only updates after the answer"),
        }
    }
    assert_eq!(t.terminal(&c1), "cancelled");
    client.shutdown().await;
}

/// The RFD's v1 rule: without `clientCapabilities.subagents` nothing child-scoped is sent.
#[tokio::test]
async fn demo_agent_stays_root_only_without_the_client_capability() {
    let mut client = AcpClient::launch(DEMO, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(false).await;
    let root = client.new_session().await;
    let t = run_prompt(&mut client, &root, "Please fix the build.", |_| allow()).await;
    assert_eq!(t.stop_reason(), StopReason::EndTurn);
    assert!(t.children.is_empty());
    assert!(t.permissions.is_empty());
    assert!(t
        .root_tool_titles
        .iter()
        .any(|title| title.starts_with("Delegate to")));
    assert!(client.drain(Duration::from_millis(500)).await.is_empty());
    client.shutdown().await;
}

#[tokio::test]
async fn demo_agent_survives_a_garbage_line_before_its_first_message() {
    let mut client = AcpClient::launch(
        DEMO,
        &[("TUTTI_DEMO_SPEED", FAST), ("TUTTI_DEMO_GARBAGE", "1")],
    )
    .await;
    client.initialize(true).await;
    let root = client.new_session().await;
    let t = run_prompt(
        &mut client,
        &root,
        "children=1 permission=0 fail=0 late=0",
        |_| allow(),
    )
    .await;
    assert_eq!(t.stop_reason(), StopReason::EndTurn);
    assert_eq!(t.children.len(), 1);
    client.shutdown().await;
}

#[tokio::test]
async fn plain_agent_task_tool_call_is_no_child_and_late_update_follows_the_answer() {
    let mut client = AcpClient::launch(PLAIN, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(true).await;
    let root = client.new_session().await;
    let t = run_prompt(&mut client, &root, "Look around. late=1", |_| allow()).await;
    assert_eq!(t.stop_reason(), StopReason::EndTurn);
    assert!(
        t.children.is_empty(),
        "no subagent_update from a plain agent"
    );
    assert_eq!(t.root_tool_titles, ["Task"]);
    assert!(t.root_messages >= 2);
    // Exactly one update arrives after the answer (about 200 ms later).
    let late = client.drain(Duration::from_millis(800)).await;
    assert_eq!(late.len(), 1);
    assert!(matches!(
        &late[0],
        Event::Update(n) if n.session_id == root
            && matches!(n.update, SessionUpdate::AgentMessageChunk(_))
    ));
    client.shutdown().await;
}

#[tokio::test]
async fn plain_agent_cancel_answers_cancelled() {
    let mut client = AcpClient::launch(PLAIN, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(false).await;
    let root = client.new_session().await;
    let mut t = Transcript::new(&root);
    client.prompt(&root, "hang=1");
    while t.root_tool_calls.is_empty() {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            _ => panic!("only updates before the Task tool call"),
        }
    }
    client.cancel(&root);
    loop {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            Event::Permission(..) => panic!("the plain agent asks nothing"),
            Event::PromptAnswered(answer) => {
                t.record_answer(answer);
                break;
            }
        }
    }
    assert_eq!(t.stop_reason(), StopReason::Cancelled);
    client.shutdown().await;
}

/// Bad input is a typed JSON-RPC error, and the agent keeps serving.
#[tokio::test]
async fn demo_agent_rejects_a_prompt_for_an_unknown_session() {
    let mut client = AcpClient::launch(DEMO, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(true).await;
    client.prompt(&SessionId::new("no-such-session"), "hello");
    match client.next_event().await {
        Event::PromptAnswered(Err(error)) => {
            assert_eq!(error.code, agent_client_protocol::ErrorCode::INVALID_PARAMS);
        }
        _ => panic!("expected an error answer"),
    }
    let root = client.new_session().await;
    let t = run_prompt(&mut client, &root, "children=0", |_| allow()).await;
    assert_eq!(t.stop_reason(), StopReason::EndTurn);
    client.shutdown().await;
}

/// Cancelling while a child waits for a permission: the agent abandons the request (the SDK
/// sends `$/cancel_request`, which marks the responder), settles the child `cancelled`, and
/// answers the prompt `cancelled`. The client still answers the request, with `cancelled`.
#[tokio::test]
async fn demo_cancel_during_a_child_permission_request() {
    let mut client = AcpClient::launch(DEMO, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(true).await;
    let root = client.new_session().await;
    let c1 = child_id(&root, 1, "child-1");
    let mut t = Transcript::new(&root);
    client.prompt(&root, "children=1 permission=1 fail=0 late=0");
    let (request, responder) = loop {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            Event::Permission(request, responder) => break (request, responder),
            Event::PromptAnswered(_) => panic!("the prompt waits for the child"),
        }
    };
    assert_eq!(id(&request.session_id), c1);
    let states: Vec<&Value> = t
        .child(&c1)
        .expect("child 1")
        .states
        .iter()
        .map(|s| &s["state"])
        .collect();
    assert_eq!(states, ["running", "requires_action"]);
    client.cancel(&root);
    while t.answered_at.is_none() {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            Event::Permission(..) => panic!("one permission request only"),
            Event::PromptAnswered(answer) => t.record_answer(answer),
        }
    }
    assert_eq!(t.terminal(&c1), "cancelled");
    assert_eq!(t.stop_reason(), StopReason::Cancelled);
    assert!(
        responder.cancellation().is_cancelled(),
        "the agent withdrew the request"
    );
    responder
        .respond(RequestPermissionResponse::new(
            RequestPermissionOutcome::Cancelled,
        ))
        .expect("a late answer is still sent");
    assert!(client.drain(Duration::from_millis(300)).await.is_empty());
    client.shutdown().await;
}

/// The agent process dies mid-prompt: the pending prompt fails with the SDK's local
/// "incoming transport closed" error (the daemon's `providerExited` signal), and the
/// connection reports the closed input.
#[tokio::test]
async fn agent_exit_fails_the_pending_prompt() {
    let mut client = AcpClient::launch(PLAIN, &[("TUTTI_DEMO_SPEED", FAST)]).await;
    client.initialize(false).await;
    let root = client.new_session().await;
    let mut t = Transcript::new(&root);
    client.prompt(&root, "hang=1");
    while t.root_tool_calls.is_empty() {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            _ => panic!("only updates before the Task tool call"),
        }
    }
    client.child.start_kill().expect("kill the agent");
    let error = loop {
        match client.next_event().await {
            Event::Update(notification) => t.record_update(&notification),
            Event::Permission(..) => panic!("the plain agent asks nothing"),
            Event::PromptAnswered(answer) => break answer.expect_err("the prompt fails"),
        }
    };
    assert!(agent_client_protocol::is_incoming_transport_closed(&error));
    tokio::time::timeout(WAIT, client.cx.incoming_closed())
        .await
        .expect("the connection sees EOF");
}
