//! Smoke tests of the real `codex app-server` (npm `@openai/codex`, pinned in
//! `tutti_tests::providers::CODEX_VERSION`) driven offline by the scripted model server.
//!
//! The binary is installed on first use into `<workspace>/.providers/codex`; if that fails the
//! tests fail (they never skip).

use std::time::Duration;

use serde_json::{json, Value};
use tutti_tests::codex_client::{CodexAppServer, CodexConfig, Incoming, SpawnOptions};
use tutti_tests::mock_responses::{Match, MockResponses, Reply};
use tutti_tests::providers::ensure_codex;

/// Upper bound for one whole turn (root plus child); the runs take about a second.
const TURN_TIMEOUT: Duration = Duration::from_secs(25);

struct Harness {
    codex: CodexAppServer,
    mock: MockResponses,
    _home: tempfile::TempDir,
    work: tempfile::TempDir,
}

async fn start(mock: MockResponses, config: CodexConfig) -> Harness {
    let bin = ensure_codex().unwrap_or_else(|e| panic!("{e}"));
    let home = tempfile::tempdir().expect("temp CODEX_HOME");
    let work = tempfile::tempdir().expect("temp work dir");
    config.write(home.path()).expect("write config.toml");
    let codex = CodexAppServer::spawn(SpawnOptions {
        bin,
        codex_home: home.path().to_path_buf(),
        cwd: work.path().to_path_buf(),
        args: Vec::new(),
        env: Vec::new(),
    })
    .await
    .expect("start codex app-server");
    let init = codex.initialize("tutti_tests").await.expect("initialize");
    assert!(
        init.get("userAgent").and_then(Value::as_str).is_some(),
        "initialize result: {init}"
    );
    Harness {
        codex,
        mock,
        _home: home,
        work,
    }
}

impl Harness {
    async fn start_thread(&self, approval_policy: &str) -> String {
        self.codex
            .thread_start(json!({
                "cwd": self.work.path(),
                "approvalPolicy": approval_policy,
                "sandbox": "read-only",
            }))
            .await
            .expect("thread/start")
    }

    /// Fails with the wire transcript and the model requests attached.
    fn fail(&self, what: &str) -> ! {
        panic!(
            "{what}\n--- model requests ---\n{}\n{}",
            self.mock.describe_requests(),
            self.codex.diagnostics()
        )
    }

    async fn wait_for(&mut self, what: &str, pred: impl Fn(&Incoming) -> bool) -> Incoming {
        match self.codex.wait_for(TURN_TIMEOUT, what, pred).await {
            Ok(m) => m,
            Err(e) => {
                let msg = format!(
                    "{e}\n--- model requests ---\n{}",
                    self.mock.describe_requests()
                );
                panic!("{msg}")
            }
        }
    }
}

fn position(history: &[Incoming], pred: impl Fn(&Incoming) -> bool) -> Option<usize> {
    history.iter().position(pred)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_spawns_child_waits_and_completes() {
    let mock = MockResponses::builder()
        .on(
            Match::root().tool_outputs(0),
            Reply::spawn_agent("CHILD_TASK: say hi"),
        )
        .on(Match::root().tool_outputs(1), Reply::wait_spawned_agents())
        .on(Match::root().tool_outputs(2), Reply::text("parent done"))
        .on(Match::child().tool_outputs(0), Reply::text("child says hi"))
        .start()
        .await
        .expect("start mock model server");
    let config = CodexConfig::new(mock.base_url());
    let mut h = start(mock, config).await;

    let root = h.start_thread("never").await;
    let root_turn = h
        .codex
        .turn_start(&root, "PARENT_TASK: please spawn a sub-agent")
        .await
        .expect("turn/start");

    let root_done = h
        .wait_for("root turn/completed", |m| m.is("turn/completed", &root))
        .await;
    assert_eq!(root_done.turn_id(), Some(root_turn.as_str()));
    if root_done.turn_status() != Some("completed") {
        h.fail(&format!("root turn did not complete: {}", root_done.params));
    }

    let history = h.codex.history().to_vec();
    // The spawn edge: collabAgentToolCall spawnAgent, completed with the child's thread id.
    let spawn_done = history
        .iter()
        .find(|m| {
            m.method == "item/completed"
                && m.item_type() == Some("collabAgentToolCall")
                && m.item().and_then(|i| i.get("tool")).and_then(Value::as_str)
                    == Some("spawnAgent")
        })
        .cloned()
        .unwrap_or_else(|| h.fail("no completed spawnAgent collabAgentToolCall"));
    assert_eq!(spawn_done.thread_id(), Some(root.as_str()));
    assert_eq!(spawn_done.turn_id(), Some(root_turn.as_str()));
    let item = spawn_done.item().unwrap();
    assert_eq!(item["senderThreadId"], json!(root));
    assert_eq!(item["prompt"], json!("CHILD_TASK: say hi"));
    let receivers = item["receiverThreadIds"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(receivers.len(), 1, "receiverThreadIds: {item}");
    let child = receivers[0].as_str().unwrap().to_string();
    assert_ne!(child, root);

    // The child thread's own events: turn/started with rootTurnId = the root turn, its
    // agentMessage, and its turn/completed.
    let child_started = history
        .iter()
        .find(|m| m.is("turn/started", &child))
        .cloned()
        .unwrap_or_else(|| h.fail("no turn/started on the child thread"));
    assert_eq!(
        child_started.params.pointer("/turn/rootTurnId"),
        Some(&json!(root_turn))
    );
    let child_turn = child_started.turn_id().unwrap().to_string();
    assert_ne!(child_turn, root_turn);
    let child_msg = history
        .iter()
        .find(|m| m.is("item/completed", &child) && m.item_type() == Some("agentMessage"))
        .unwrap_or_else(|| h.fail("no agentMessage on the child thread"));
    assert_eq!(child_msg.item().unwrap()["text"], json!("child says hi"));
    assert_eq!(child_msg.turn_id(), Some(child_turn.as_str()));
    let child_done = history
        .iter()
        .find(|m| m.is("turn/completed", &child))
        .unwrap_or_else(|| h.fail("no turn/completed on the child thread"));
    assert_eq!(child_done.turn_status(), Some("completed"));
    // No thread/started is sent for a child.
    assert!(!history.iter().any(|m| m.is("thread/started", &child)));

    // The wait: a collabAgentToolCall `wait` on the root naming the child, completed after the
    // child's turn/completed, with the child's final message in agentsStates.
    let wait_done = history
        .iter()
        .find(|m| {
            m.method == "item/completed"
                && m.item().and_then(|i| i.get("tool")).and_then(Value::as_str) == Some("wait")
        })
        .unwrap_or_else(|| h.fail("no completed wait collabAgentToolCall"));
    assert_eq!(wait_done.thread_id(), Some(root.as_str()));
    assert_eq!(
        wait_done.item().unwrap()["agentsStates"][&child]["status"],
        json!("completed")
    );

    // Ordering: spawn completed -> child turn completed -> root final message -> root completed.
    let p_spawn = position(&history, |m| {
        m.method == "item/completed"
            && m.item().and_then(|i| i.get("tool")).and_then(Value::as_str) == Some("spawnAgent")
    })
    .unwrap();
    let p_child_done = position(&history, |m| m.is("turn/completed", &child)).unwrap();
    let p_root_msg = position(&history, |m| {
        m.is("item/completed", &root)
            && m.item_type() == Some("agentMessage")
            && m.item().unwrap()["text"] == json!("parent done")
    })
    .unwrap_or_else(|| h.fail("no root agentMessage \"parent done\""));
    let p_root_done = position(&history, |m| m.is("turn/completed", &root)).unwrap();
    assert!(
        p_spawn < p_child_done,
        "spawn completed after child turn ended"
    );
    assert!(p_child_done < p_root_msg && p_root_msg < p_root_done);

    // The model server saw: root spawn, root wait, child text, root final (child before the
    // root's final request), and every request matched a rule.
    h.mock.assert_all_matched();
    let requests = h.mock.requests();
    assert_eq!(requests.len(), 4, "{}", h.mock.describe_requests());
    let child_reqs: Vec<_> = requests.iter().filter(|r| r.is_child()).collect();
    assert_eq!(child_reqs.len(), 1);
    assert_eq!(child_reqs[0].thread_id.as_deref(), Some(child.as_str()));
    assert_eq!(
        child_reqs[0].parent_thread_id.as_deref(),
        Some(root.as_str())
    );
    assert_eq!(
        child_reqs[0].header("x-openai-subagent"),
        Some("collab_spawn")
    );
    assert_eq!(child_reqs[0].header("session-id"), Some(root.as_str()));
    assert_eq!(
        child_reqs[0].last_user_text().as_deref(),
        Some("CHILD_TASK: say hi")
    );
    assert!(requests
        .iter()
        .filter(|r| r.is_root())
        .all(|r| r.thread_id.as_deref() == Some(root.as_str())));

    h.codex.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_command_approval_is_asked_on_the_child_thread() {
    let mock = MockResponses::builder()
        .on(
            Match::root().tool_outputs(0),
            Reply::spawn_agent("CHILD_TASK: touch a file"),
        )
        .on(Match::root().tool_outputs(1), Reply::wait_spawned_agents())
        .on(Match::root().tool_outputs(2), Reply::text("parent done"))
        .on(
            Match::child().tool_outputs(0),
            Reply::exec_command_escalated("touch approved.txt", "child needs to write"),
        )
        .on(Match::child().tool_outputs(1), Reply::text("exec done"))
        .start()
        .await
        .expect("start mock model server");
    let config = CodexConfig::new(mock.base_url()).approval_policy("on-request");
    let mut h = start(mock, config).await;

    let root = h.start_thread("on-request").await;
    let root_turn = h
        .codex
        .turn_start(&root, "PARENT_TASK: spawn a child that writes")
        .await
        .expect("turn/start");

    let approval = h
        .wait_for("item/commandExecution/requestApproval", |m| {
            m.is_request() && m.method == "item/commandExecution/requestApproval"
        })
        .await;
    let child = h
        .codex
        .history()
        .iter()
        .find_map(|m| {
            (m.method == "item/completed"
                && m.item().and_then(|i| i.get("tool")).and_then(Value::as_str)
                    == Some("spawnAgent"))
            .then(|| {
                m.item().unwrap()["receiverThreadIds"][0]
                    .as_str()
                    .map(str::to_string)
            })
            .flatten()
        })
        .unwrap_or_else(|| h.fail("approval arrived before the spawn edge"));
    assert_eq!(
        approval.thread_id(),
        Some(child.as_str()),
        "{}",
        approval.raw
    );
    let child_turn = h
        .codex
        .history()
        .iter()
        .find(|m| m.is("turn/started", &child))
        .and_then(|m| m.turn_id().map(str::to_string))
        .unwrap_or_else(|| h.fail("no child turn/started before the approval"));
    assert_eq!(approval.turn_id(), Some(child_turn.as_str()));
    assert_eq!(approval.params["kind"], json!("command"));
    assert!(
        approval.params["command"]
            .as_str()
            .unwrap_or("")
            .contains("touch approved.txt"),
        "{}",
        approval.raw
    );
    assert_eq!(approval.params["reason"], json!("child needs to write"));
    let request_id = approval.id.clone().unwrap();

    h.codex
        .respond(&request_id, json!({ "decision": "accept" }))
        .await
        .expect("answer approval");

    let resolved = h
        .wait_for("serverRequest/resolved", |m| {
            m.method == "serverRequest/resolved"
        })
        .await;
    assert_eq!(resolved.thread_id(), Some(child.as_str()));
    assert_eq!(resolved.params["requestId"], request_id);

    let root_done = h
        .wait_for("root turn/completed", |m| m.is("turn/completed", &root))
        .await;
    assert_eq!(root_done.turn_id(), Some(root_turn.as_str()));
    if root_done.turn_status() != Some("completed") {
        h.fail(&format!("root turn did not complete: {}", root_done.params));
    }
    let history = h.codex.history().to_vec();
    let cmd_done = history
        .iter()
        .find(|m| m.is("item/completed", &child) && m.item_type() == Some("commandExecution"))
        .unwrap_or_else(|| h.fail("no completed commandExecution on the child"));
    assert_eq!(cmd_done.item().unwrap()["status"], json!("completed"));
    assert_eq!(cmd_done.item().unwrap()["exitCode"], json!(0));
    assert!(h.work.path().join("approved.txt").exists());
    let child_done = history
        .iter()
        .find(|m| m.is("turn/completed", &child))
        .unwrap_or_else(|| h.fail("no child turn/completed"));
    assert_eq!(child_done.turn_status(), Some("completed"));
    h.mock.assert_all_matched();

    h.codex.shutdown().await;
}
