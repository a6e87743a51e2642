//! End-to-end through the HTTP API of a real `tuttid` process driving the real `codex app-server`
//! (npm `@openai/codex`, pinned in `tutti_tests::providers::CODEX_VERSION`) against the scripted
//! Responses-API model server on 127.0.0.1.
//!
//! Each test starts its own mock model server, its own `CODEX_HOME` (a temp dir whose
//! `config.toml` points codex at the mock server, with the v1 multi-agent tools and
//! `agents.max_depth = 2`), and its own daemon whose config names a provider `codex` of kind
//! `codex` running `<codex> app-server`. The codex binary is installed on first use
//! (`ensure_codex`); if that fails the tests fail, they never skip.
//!
//! Determinism: a child that must outlive something is held by a [`Gate`] on the mock server
//! until the test has observed what it needs, or hangs until it is interrupted; nothing relies on
//! a fixed sleep for correctness. Every durable change is also recorded from the daemon's event
//! stream (`GET /v1/events`), so transient states (the root waiting on its children) are checked
//! on the exact committed sequence, not on a lucky poll.

use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tutti_tests::codex_client::CodexConfig;
use tutti_tests::daemon::{children, turn_of, TestDaemon};
use tutti_tests::mock_responses::{
    Gate, Match, MockResponses, MockResponsesBuilder, OutputItem, RecordedRequest, Reply,
    MULTI_AGENT_V1,
};
use tutti_tests::providers::ensure_codex;

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const WS: &str = "w1";
/// Upper bound for one condition (a whole root turn with children takes a few seconds).
const TIMEOUT: Duration = Duration::from_secs(20);

// ---- the rig ------------------------------------------------------------------------------------

/// One daemon + one codex home + one scripted model server.
struct Rig {
    /// Dropped first (see [`Drop`]).
    d: TestDaemon,
    events: Recorder,
    mock: MockResponses,
    home: tempfile::TempDir,
    work: tempfile::TempDir,
    /// Hosts the mock server; dropped last.
    rt: tokio::runtime::Runtime,
}

/// How the codex provider is configured.
struct Setup {
    /// `approval_policy` in config.toml and the adapter's `approvalPolicy`.
    approval_policy: &'static str,
    /// The v2 collaboration tools instead of v1.
    v2: bool,
    /// The daemon's `idle_timeout_secs`, if set.
    idle_timeout_secs: Option<u64>,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            approval_policy: "never",
            v2: false,
            idle_timeout_secs: None,
        }
    }
}

impl Rig {
    fn start(script: MockResponsesBuilder, setup: Setup) -> Rig {
        let bin = ensure_codex().unwrap_or_else(|e| {
            panic!("the Codex end-to-end tests need the real codex binary: {e}")
        });
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime for the mock model server");
        let mock = rt
            .block_on(script.start())
            .expect("start the mock model server");
        let home = tempfile::tempdir().expect("temp CODEX_HOME");
        let work = tempfile::tempdir().expect("temp work dir");
        let mut config = CodexConfig::new(mock.base_url())
            .approval_policy(setup.approval_policy)
            .max_depth(2)
            .multi_agent_v2(setup.v2);
        if !setup.v2 {
            config = config.extra_toml("[features]\nmulti_agent = true\n");
        }
        config.write(home.path()).expect("write config.toml");
        let mut toml = daemon_config(&bin, home.path(), setup.approval_policy);
        if let Some(secs) = setup.idle_timeout_secs {
            toml = format!("idle_timeout_secs = {secs}\n{toml}");
        }
        let d = TestDaemon::start(EXE, Some(&toml), &[]);
        let events = Recorder::start(&d);
        Rig {
            d,
            events,
            mock,
            home,
            work,
            rt,
        }
    }

    /// A root session of provider `codex` working in the rig's temp work dir.
    fn create(&self) -> String {
        let (st, v) = self.d.call(
            "POST",
            &format!("/v1/workspaces/{WS}/agent-sessions"),
            Some(json!({"provider": "codex", "title": "e2e", "cwd": self.work.path()})),
        );
        assert_eq!(st, 201, "create: {v}");
        v["session"]["id"].as_str().expect("session id").to_string()
    }

    fn detail(&self, id: &str) -> Value {
        self.d.detail(WS, id)
    }

    fn messages(&self, id: &str) -> Vec<Value> {
        let (st, v) = self.d.call(
            "GET",
            &format!("/v1/workspaces/{WS}/agent-sessions/{id}/messages"),
            None,
        );
        assert_eq!(st, 200, "messages: {v}");
        v["messages"].as_array().cloned().unwrap_or_default()
    }

    /// Polls the session detail until `pred` holds; fails with everything known.
    fn wait(&self, id: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let d = self.detail(id);
            if pred(&d) {
                return d;
            }
            if start.elapsed() > TIMEOUT {
                self.fail(&format!("timed out waiting for {what}"), &d);
            }
            std::thread::sleep(Duration::from_millis(40));
        }
    }

    /// Waits until the model server has received a request matching `pred`.
    fn wait_model(&self, what: &str, pred: impl Fn(&RecordedRequest) -> bool) -> RecordedRequest {
        self.rt
            .block_on(self.mock.wait_for_request(TIMEOUT, pred))
            .unwrap_or_else(|e| panic!("waiting for the model request {what}: {e}"))
    }

    fn fail(&self, what: &str, detail: &Value) -> ! {
        panic!(
            "{what}\n--- detail ---\n{detail:#}\n--- model requests ---\n{}\n--- codex processes ---\n{:?}",
            self.mock.describe_requests(),
            codex_pids(self.home.path()),
        )
    }

    /// The pid of this rig's `codex app-server` (exactly one must be running).
    fn codex_pid(&self) -> i32 {
        let pids = codex_pids(self.home.path());
        assert_eq!(
            pids.len(),
            1,
            "expected one codex app-server with CODEX_HOME={}: {pids:?}",
            self.home.path().display()
        );
        pids[0]
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // The daemon goes first (SIGKILL); its codex process then sees its stdin close. Anything
        // still alive with this rig's CODEX_HOME is ours: end it by pid.
        self.d.kill9();
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let pids = codex_pids(self.home.path());
            if pids.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                for pid in pids {
                    // SAFETY: plain kill(2) on a pid this test's daemon started.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The daemon's TOML: provider `codex` runs `<bin> app-server` with this rig's CODEX_HOME.
fn daemon_config(bin: &Path, home: &Path, approval_policy: &str) -> String {
    let s = |p: &Path| toml_string(&p.to_string_lossy());
    // Codex logs to the daemon's stderr; quiet unless asked (`TUTTI_CODEX_LOG=error`, ...).
    let codex_log = std::env::var("TUTTI_CODEX_LOG").unwrap_or_else(|_| "off".into());
    format!(
        "[providers.codex]\n\
         kind = \"codex\"\n\
         command = [{bin}, \"app-server\"]\n\
         env = {{ CODEX_HOME = {home}, RUST_LOG = {log} }}\n\
         options = {{ approvalPolicy = {policy}, sandbox = \"read-only\" }}\n",
        bin = s(bin),
        home = s(home),
        policy = toml_string(approval_policy),
        log = toml_string(&codex_log),
    )
}

/// A TOML basic string (JSON string escapes are valid TOML escapes).
fn toml_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// Pids of live `codex app-server` processes whose environment has `CODEX_HOME=<home>`.
fn codex_pids(home: &Path) -> Vec<i32> {
    let needle = format!("CODEX_HOME={}", home.display()).into_bytes();
    let mut pids = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return pids;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let base = PathBuf::from("/proc").join(pid.to_string());
        let Ok(cmdline) = std::fs::read(base.join("cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_codex = args.first().is_some_and(|a| a.ends_with(b"codex"))
            && args.get(1).is_some_and(|a| *a == b"app-server");
        if !is_codex {
            continue;
        }
        let Ok(environ) = std::fs::read(base.join("environ")) else {
            continue;
        };
        if environ.split(|b| *b == 0).any(|kv| kv == needle.as_slice()) {
            pids.push(pid);
        }
    }
    pids
}

/// Every outbox row of the daemon, read from its event stream (`GET /v1/events?after=0`) on a
/// background thread for the whole test. The thread ends when the daemon goes away.
struct Recorder {
    rows: Arc<Mutex<Vec<Value>>>,
}

impl Recorder {
    fn start(d: &TestDaemon) -> Recorder {
        let rows = Arc::new(Mutex::new(Vec::new()));
        let sink = rows.clone();
        let url = format!("http://{}/v1/events?after=0", d.addr);
        let auth = format!("Bearer {}", d.token);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let resp = ureq::get(&url).set("authorization", &auth).call();
            let _ = ready_tx.send(resp.is_ok());
            let Ok(resp) = resp else { return };
            for line in BufReader::new(resp.into_reader()).lines() {
                let Ok(line) = line else { return };
                if let Some(data) = line.strip_prefix("data:") {
                    if let Ok(v) = serde_json::from_str::<Value>(data.trim()) {
                        sink.lock().unwrap_or_else(|e| e.into_inner()).push(v);
                    }
                }
            }
        });
        assert_eq!(
            ready_rx.recv_timeout(TIMEOUT),
            Ok(true),
            "the event stream did not open"
        );
        Recorder { rows }
    }

    /// Waits until the stream has delivered every turn of `detail` in the phase and outcome the
    /// detail shows (the stream may lag behind a read), so checks on the recorded sequence cover
    /// what that read saw. Versions are not compared: some durable updates are deliberately not
    /// republished (a late root provider terminal after a cancel).
    fn sync(&self, detail: &Value) {
        let want: Vec<(Value, Value, Value)> = detail["turns"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| (t["id"].clone(), t["phase"].clone(), t["outcome"].clone()))
            .collect();
        self.wait_until(&format!("the turns {want:?}"), |turns| {
            want.iter().all(|(id, phase, outcome)| {
                turns
                    .iter()
                    .any(|t| t["id"] == *id && t["phase"] == *phase && t["outcome"] == *outcome)
            })
        });
    }

    /// Waits until the recorded turn rows satisfy `pred`.
    fn wait_until(&self, what: &str, pred: impl Fn(&[Value]) -> bool) {
        let deadline = Instant::now() + TIMEOUT;
        while !pred(&self.turns()) {
            assert!(
                Instant::now() < deadline,
                "the event stream never showed {what}; turn rows:\n{:#?}",
                self.turns()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Turn rows (the turn entity of each `turn` outbox row), in commit order.
    fn turns(&self) -> Vec<Value> {
        self.rows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|r| r["kind"] == "turn")
            .map(|r| r["payload"].clone())
            .collect()
    }

    /// Whether, at some committed point, the root turn was `waiting` with its root provider turn
    /// `completed` while a child turn (any session other than the root) was still active.
    fn saw_root_waiting_on_active_children(&self, root: &str, root_turn: &str) -> bool {
        let mut state: HashMap<String, Value> = HashMap::new();
        for t in self.turns() {
            let id = t["id"].as_str().unwrap_or_default().to_string();
            state.insert(id.clone(), t.clone());
            if id == root_turn
                && t["phase"] == "waiting"
                && t["rootProviderTurn"]["phase"] == "completed"
                && state
                    .values()
                    .any(|x| x["agentSessionId"] != root && x["phase"] != "settled")
            {
                return true;
            }
        }
        false
    }

    /// The index of the first turn row where `pred` holds.
    fn first_turn(&self, pred: impl Fn(&Value) -> bool) -> Option<usize> {
        self.turns().iter().position(pred)
    }

    /// Number of rows so far.
    fn len(&self) -> usize {
        self.rows.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Rows after the first `n`.
    fn since(&self, n: usize) -> Vec<Value> {
        self.rows.lock().unwrap_or_else(|e| e.into_inner())[n..].to_vec()
    }
}

// ---- detail helpers -------------------------------------------------------------------------------

fn phase(d: &Value, session: &str) -> String {
    turn_of(d, session)
        .and_then(|t| t["phase"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn outcome(d: &Value, session: &str) -> Option<String> {
    turn_of(d, session).and_then(|t| t["outcome"].as_str().map(String::from))
}

fn settled(d: &Value, session: &str) -> bool {
    outcome(d, session).is_some()
}

fn provider_phase(d: &Value, session: &str) -> String {
    turn_of(d, session)
        .and_then(|t| t["rootProviderTurn"]["phase"].as_str())
        .unwrap_or_default()
        .to_string()
}

fn sid(v: &Value) -> String {
    v["id"].as_str().expect("session id").to_string()
}

fn turn_id_of(d: &Value, session: &str) -> String {
    turn_of(d, session)
        .and_then(|t| t["id"].as_str())
        .unwrap_or_else(|| panic!("no turn of {session} in {d:#}"))
        .to_string()
}

/// `n` children whose latest turn is running with its native turn bound.
fn children_running(d: &Value, n: usize) -> bool {
    let kids = children(d);
    kids.len() == n
        && kids.iter().all(|c| {
            turn_of(d, &sid(c))
                .is_some_and(|t| t["phase"] == "running" && t["providerTurnId"].is_string())
        })
}

fn texts(messages: &[Value], role: &str) -> Vec<String> {
    messages
        .iter()
        .filter(|m| m["role"] == role)
        .filter_map(|m| m["text"].as_str().map(String::from))
        .collect()
}

fn spawn_call(message: &str) -> OutputItem {
    OutputItem::call(
        Some(MULTI_AGENT_V1.into()),
        "spawn_agent",
        json!({ "message": message }),
    )
}

// ---- (a) two children outlive the root provider turn ------------------------------------------

#[test]
fn two_children_outlive_the_root_provider_turn_the_root_waits_then_settles_completed() {
    let gate = Gate::new();
    let script = MockResponses::builder()
        // Two spawns in one model response (parallel tool calls).
        .on(
            Match::root().tool_outputs(0),
            Reply::items(vec![
                spawn_call("CHILD_A: count the files"),
                spawn_call("CHILD_B: read the docs"),
            ]),
        )
        // The root provider turn ends without waiting for its children.
        .on(Match::root().tool_outputs(2), Reply::text("parent done"))
        .on(
            Match::child().last_user_text_contains("CHILD_A"),
            Reply::text("child A done").until(&gate),
        )
        .on(
            Match::child().last_user_text_contains("CHILD_B"),
            Reply::text("child B done").until(&gate),
        );
    let r = Rig::start(script, Setup::default());
    let id = r.create();
    let (reply, turn) = r.d.submit(WS, &id, "PARENT: delegate to two helpers");
    assert_eq!(reply, "started");

    // The root provider turn completed; both children are held by the model server: the
    // canonical root turn waits.
    let seen = r.wait(&id, "the root waiting on two running children", |v| {
        provider_phase(v, &id) == "completed"
            && phase(v, &id) == "waiting"
            && children_running(v, 2)
    });
    assert!(!settled(&seen, &id));
    assert!(seen["session"]["activeTurnId"] == turn.as_str());
    r.events.sync(&seen);
    assert!(
        r.events.saw_root_waiting_on_active_children(&id, &turn),
        "no committed state with the root waiting on an active child"
    );
    let root_thread = seen["session"]["providerSessionId"]
        .as_str()
        .expect("root providerSessionId = the codex root thread")
        .to_string();

    gate.open();
    let end = r.wait(&id, "the root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
    assert_eq!(turn_id_of(&end, &id), turn, "the same canonical root turn");
    assert!(end["session"].get("activeTurnId").is_none());
    let kids = children(&end);
    assert_eq!(kids.len(), 2, "{kids:#?}");
    let mut child_texts = Vec::new();
    for c in &kids {
        let cid = sid(c);
        assert_eq!(c["kind"], "child");
        assert_eq!(c["parentAgentSessionId"], id.as_str());
        assert_eq!(c["parentTurnId"], turn.as_str());
        assert_eq!(c["rootAgentSessionId"], id.as_str());
        assert_eq!(c["rootTurnId"], turn.as_str());
        assert!(c["parentToolCallId"].is_string(), "{c}");
        let thread = c["providerAliases"]["threadId"].as_str().expect("threadId");
        assert_eq!(c["providerSessionId"], thread);
        assert_ne!(thread, root_thread);
        assert_eq!(outcome(&end, &cid).as_deref(), Some("completed"));
        let msgs = r.messages(&cid);
        let child_turn = turn_id_of(&end, &cid);
        assert!(msgs.iter().all(|m| m["turnId"] == child_turn.as_str()));
        assert_eq!(
            texts(&msgs, "user").len(),
            1,
            "the delegated task: {msgs:#?}"
        );
        child_texts.extend(texts(&msgs, "assistant"));
    }
    child_texts.sort();
    assert_eq!(child_texts, ["child A done", "child B done"]);
    // Child messages belong to the children, not to the root transcript.
    let root_msgs = r.messages(&id);
    assert_eq!(texts(&root_msgs, "assistant"), ["parent done"]);
    assert!(root_msgs.iter().all(|m| m["turnId"] == turn.as_str()));

    // Order of commits: the root settled only after its last child did.
    r.events.sync(&end);
    let root_settled = r
        .events
        .first_turn(|t| t["id"] == turn.as_str() && t["phase"] == "settled")
        .expect("root settled row");
    for c in &kids {
        let cid = sid(c);
        let child_settled = r
            .events
            .first_turn(|t| t["agentSessionId"] == cid.as_str() && t["phase"] == "settled")
            .expect("child settled row");
        assert!(child_settled < root_settled);
    }
    r.mock.assert_all_matched();
    assert_eq!(r.mock.requests().len(), 4, "{}", r.mock.describe_requests());
}

// ---- (b) a nested child ---------------------------------------------------------------------------

#[test]
fn a_grandchild_keeps_the_root_relation_and_its_direct_parent_is_the_child() {
    let script = MockResponses::builder()
        .on(
            Match::root().tool_outputs(0),
            Reply::spawn_agent("CHILD: delegate further"),
        )
        .on(Match::root().tool_outputs(1), Reply::wait_spawned_agents())
        .on(Match::root().tool_outputs(2), Reply::text("parent done"))
        .on(
            Match::depth(1).tool_outputs(0),
            Reply::spawn_agent("GRANDCHILD: leaf work"),
        )
        .on(
            Match::depth(1).tool_outputs(1),
            Reply::wait_spawned_agents(),
        )
        .on(Match::depth(1).tool_outputs(2), Reply::text("child done"))
        .on(Match::depth(2), Reply::text("grandchild done"));
    let r = Rig::start(script, Setup::default());
    let id = r.create();
    let (_, turn) = r.d.submit(WS, &id, "PARENT: delegate two levels deep");
    let end = r.wait(&id, "the root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
    let kids = children(&end);
    assert_eq!(kids.len(), 2, "a child and a grandchild: {kids:#?}");
    let child = kids
        .iter()
        .find(|k| k["parentAgentSessionId"] == id.as_str())
        .expect("the child")
        .clone();
    let grandchild = kids
        .iter()
        .find(|k| k["parentAgentSessionId"] != id.as_str())
        .expect("the grandchild")
        .clone();
    let (cid, gid) = (sid(&child), sid(&grandchild));
    let child_turn = turn_id_of(&end, &cid);
    // Direct parent: the child session and its turn; root relation: the original root turn.
    assert_eq!(grandchild["parentAgentSessionId"], cid.as_str());
    assert_eq!(grandchild["parentTurnId"], child_turn.as_str());
    assert_eq!(grandchild["rootAgentSessionId"], id.as_str());
    assert_eq!(grandchild["rootTurnId"], turn.as_str());
    assert_eq!(child["rootAgentSessionId"], id.as_str());
    assert_eq!(child["rootTurnId"], turn.as_str());
    assert_eq!(child["parentTurnId"], turn.as_str());
    for s in [&cid, &gid] {
        assert_eq!(outcome(&end, s).as_deref(), Some("completed"), "{s}");
    }
    assert_eq!(texts(&r.messages(&gid), "assistant"), ["grandchild done"]);
    assert_eq!(texts(&r.messages(&cid), "assistant"), ["child done"]);
    // The detail of the child lists only its own subtree; the grandchild's is empty.
    let cd = r.detail(&cid);
    assert_eq!(
        children(&cd).iter().map(sid).collect::<Vec<_>>(),
        vec![gid.clone()]
    );
    assert!(children(&r.detail(&gid)).is_empty());
    // The canonical root turn counts both descendants.
    assert_eq!(turn_of(&end, &id).unwrap()["childSessionCount"], 2);
    let grand_req = r
        .mock
        .requests()
        .into_iter()
        .find(|q| q.depth == 2)
        .expect("a grandchild model request");
    assert_eq!(
        grand_req.parent_thread_id.as_deref(),
        child["providerSessionId"].as_str()
    );
    r.mock.assert_all_matched();
}

// ---- (c) a child approval answered through the API ---------------------------------------------

#[test]
fn a_child_command_approval_is_owned_by_the_child_and_answered_through_the_api() {
    let script = MockResponses::builder()
        .on(
            Match::root().tool_outputs(0),
            Reply::spawn_agent("CHILD: write a file"),
        )
        .on(Match::root().tool_outputs(1), Reply::wait_spawned_agents())
        .on(Match::root().tool_outputs(2), Reply::text("parent done"))
        .on(
            Match::child().tool_outputs(0),
            Reply::exec_command_escalated("touch approved.txt", "child needs to write"),
        )
        .on(Match::child().tool_outputs(1), Reply::text("exec done"));
    let r = Rig::start(
        script,
        Setup {
            approval_policy: "on-request",
            ..Setup::default()
        },
    );
    let id = r.create();
    let (_, turn) = r.d.submit(WS, &id, "PARENT: have a helper write a file");
    let v = r.wait(&id, "a pending interaction", |v| {
        v["interactions"]
            .as_array()
            .is_some_and(|a| a.iter().any(|i| i["status"] == "pending"))
    });
    let kids = children(&v);
    assert_eq!(kids.len(), 1);
    let cid = sid(&kids[0]);
    let child_turn = turn_id_of(&v, &cid);
    let i = v["interactions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["status"] == "pending")
        .unwrap()
        .clone();
    // Canonical ownership: the exact child session and child turn, not the root.
    assert_eq!(i["agentSessionId"], cid.as_str(), "{i:#}");
    assert_eq!(i["turnId"], child_turn.as_str(), "{i:#}");
    assert_eq!(i["kind"], "item/commandExecution/requestApproval");
    assert!(i["payload"]["command"]
        .as_str()
        .is_some_and(|c| c.contains("touch approved.txt")));
    // Transport correlation: the child's native turn id.
    assert_eq!(
        i["providerTurnId"],
        turn_of(&v, &cid).unwrap()["providerTurnId"],
        "{i:#}"
    );
    assert!(
        ["running", "waiting"].contains(&phase(&v, &id).as_str()),
        "the root stays active"
    );
    let req = i["requestId"].as_str().unwrap().to_string();
    // The root tuple does not own it.
    let (st, e) = r.d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/{turn}/interactions/{req}"),
        Some(json!({"response": "accept"})),
    );
    assert_eq!(st, 404, "{e}");
    assert!(!r.work.path().join("approved.txt").exists());
    let (st, ok) = r.d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{cid}/turns/{child_turn}/interactions/{req}"),
        Some(json!({"response": "accept"})),
    );
    assert_eq!(st, 200, "{ok}");
    let end = r.wait(&id, "the root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &cid).as_deref(), Some("completed"));
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
    assert!(
        r.work.path().join("approved.txt").exists(),
        "the approved command ran in the session's cwd"
    );
    let done = end["interactions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["requestId"] == req.as_str())
        .unwrap()
        .clone();
    assert_eq!(done["agentSessionId"], cid.as_str());
    assert_eq!(done["response"], "accept");
    // Codex confirmed it (`serverRequest/resolved` on the child thread) before running it.
    assert_eq!(done["status"], "resolved", "{done:#}");
    assert_eq!(done["resolution"]["threadId"], kids[0]["providerSessionId"]);
    assert_eq!(texts(&r.messages(&cid), "assistant"), ["exec done"]);
    r.mock.assert_all_matched();
}

// ---- (d) guidance while only children run ------------------------------------------------------

#[test]
fn guidance_while_only_children_run_starts_a_root_provider_turn_on_the_same_canonical_turn() {
    let gate = Gate::new();
    let script = MockResponses::builder()
        // The guidance turn (its input also holds the spawn result, so this rule goes first).
        .on(
            Match::root().last_user_text_contains("GUIDE"),
            Reply::text("guided"),
        )
        .on(
            Match::root().tool_outputs(0),
            Reply::spawn_agent("CHILD: slow work"),
        )
        .on(Match::root().tool_outputs(1), Reply::text("parent done"))
        .on(Match::child(), Reply::text("child done").until(&gate));
    let r = Rig::start(script, Setup::default());
    let id = r.create();
    let (_, turn) = r.d.submit(WS, &id, "PARENT: delegate and return");
    let v = r.wait(&id, "only the child runs", |v| {
        provider_phase(v, &id) == "completed"
            && phase(v, &id) == "waiting"
            && children_running(v, 1)
    });
    let first_native = turn_of(&v, &id).unwrap()["rootProviderTurn"]["providerTurnId"]
        .as_str()
        .expect("first root provider turn id")
        .to_string();

    let (reply, t2) = r.d.submit(WS, &id, "GUIDE: also check the docs");
    assert_eq!(reply, "appended");
    assert_eq!(t2, turn, "no second root turn");

    // The adapter started a new root provider turn on the root thread; it completes while the
    // child is still held, and the canonical root keeps waiting.
    let v = r.wait(&id, "the guidance turn answered", |v| {
        let rpt = &turn_of(v, &id).unwrap()["rootProviderTurn"];
        rpt["phase"] == "completed"
            && rpt["providerTurnId"].is_string()
            && rpt["providerTurnId"] != first_native.as_str()
    });
    assert_eq!(phase(&v, &id), "waiting", "the child still runs");
    assert!(children_running(&v, 1));
    let guided = r
        .mock
        .requests()
        .into_iter()
        .find(|q| q.last_user_text().is_some_and(|t| t.contains("GUIDE")))
        .expect("the guidance reached the model");
    assert!(guided.is_root());
    assert_eq!(
        guided.thread_id.as_deref(),
        v["session"]["providerSessionId"].as_str(),
        "on the root thread"
    );
    assert_ne!(guided.turn_id.as_deref(), Some(first_native.as_str()));
    assert!(
        r.mock
            .requests()
            .iter()
            .filter(|q| q.is_child())
            .all(|q| !q.input_contains("GUIDE")),
        "guidance is not fanned out to children"
    );
    // It counted as an active root provider turn at some committed point.
    r.events
        .wait_until("the guidance's root provider turn running", |turns| {
            turns.iter().any(|t| {
                t["id"] == turn.as_str()
                    && t["rootProviderTurn"]["phase"] == "running"
                    && t["rootProviderTurn"]["providerTurnId"].is_string()
                    && t["rootProviderTurn"]["providerTurnId"] != first_native.as_str()
            })
        });

    gate.open();
    let end = r.wait(&id, "the root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
    assert_eq!(
        turn_id_of(&end, &id),
        turn,
        "settled on the same canonical turn"
    );
    let msgs = r.messages(&id);
    assert!(
        msgs.iter().all(|m| m["turnId"] == turn.as_str()),
        "{msgs:#?}"
    );
    assert_eq!(
        texts(&msgs, "user"),
        ["PARENT: delegate and return", "GUIDE: also check the docs"]
    );
    assert_eq!(texts(&msgs, "assistant"), ["parent done", "guided"]);
    let cid = sid(&children(&end)[0]);
    assert_eq!(outcome(&end, &cid).as_deref(), Some("completed"));
    r.mock.assert_all_matched();
}

// ---- (e) cancel with children running -----------------------------------------------------------

#[test]
fn cancel_with_children_running_cancels_the_tree_and_nothing_resurrects() {
    let script = MockResponses::builder()
        .on(
            Match::root().tool_outputs(0),
            Reply::spawn_agent("CHILD_A: endless"),
        )
        .on(
            Match::root().tool_outputs(1),
            Reply::spawn_agent("CHILD_B: endless"),
        )
        .on(Match::root().tool_outputs(2), Reply::wait_spawned_agents())
        .on(Match::root().tool_outputs(3), Reply::text("parent done"))
        .on(Match::child(), Reply::hang());
    let r = Rig::start(script, Setup::default());
    let id = r.create();
    let (_, turn) = r.d.submit(WS, &id, "PARENT: two endless helpers");
    r.wait(&id, "two running children under a running root", |v| {
        provider_phase(v, &id) == "running" && children_running(v, 2)
    });
    // The root is waiting in wait_agent: both children's model requests are held open.
    let (st, v) = r.d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/{turn}/cancel"),
        Some(json!({})),
    );
    assert_eq!(st, 202, "{v}");
    assert!(v["operationId"].is_string());
    let end = r.wait(&id, "the tree settled", |v| {
        settled(v, &id) && children(v).iter().all(|c| settled(v, &sid(c)))
    });
    assert_eq!(outcome(&end, &id).as_deref(), Some("canceled"));
    assert!(turn_of(&end, &id).unwrap().get("error").is_none());
    assert_eq!(children(&end).len(), 2);
    let op = turn_of(&end, &id).unwrap()["cancelOperationId"].clone();
    assert!(op.is_string(), "the root records its cancel operation");
    for c in children(&end) {
        let t = turn_of(&end, &sid(&c)).unwrap();
        assert!(
            matches!(
                t["outcome"].as_str(),
                Some("canceled") | Some("interrupted")
            ),
            "child {}: {t:#}",
            sid(&c)
        );
        assert_eq!(t["cancelOperationId"], op, "a target of the same operation");
    }
    // Codex's own terminal of the interrupted root provider turn is recorded without reopening
    // the canonical root: no stale running root provider phase.
    let end = r.wait(&id, "the late root provider terminal recorded", |v| {
        provider_phase(v, &id) == "completed"
    });
    assert_eq!(outcome(&end, &id).as_deref(), Some("canceled"));
    // Nothing resurrects: give late provider events time to arrive, then nothing is active again.
    r.events.sync(&end);
    let mark = r.events.len();
    std::thread::sleep(Duration::from_millis(1500));
    let later = r.detail(&id);
    assert_eq!(outcome(&later, &id).as_deref(), Some("canceled"));
    assert!(later["session"].get("activeTurnId").is_none(), "{later:#}");
    for c in children(&later) {
        assert!(c.get("activeTurnId").is_none(), "{c:#}");
        assert!(settled(&later, &sid(&c)));
    }
    let reopened: Vec<Value> = r
        .events
        .since(mark)
        .into_iter()
        .filter(|row| row["kind"] == "turn" && row["payload"]["phase"] != "settled")
        .collect();
    assert!(
        reopened.is_empty(),
        "turns reopened after the cancel: {reopened:#?}"
    );
    assert!(
        !r.mock
            .requests()
            .iter()
            .any(|q| q.reply.contains("parent done")),
        "the canceled root went on: {}",
        r.mock.describe_requests()
    );
    r.mock.assert_all_matched();
}

// ---- (f) the codex process dies mid-turn ---------------------------------------------------------

#[test]
fn killing_codex_mid_turn_interrupts_every_active_turn_and_the_daemon_stays_healthy() {
    let script = MockResponses::builder()
        .on(
            Match::root().last_user_text_contains("AFTER"),
            Reply::text("still alive"),
        )
        .on(
            Match::root().tool_outputs(0),
            Reply::spawn_agent("CHILD: endless"),
        )
        .on(Match::root().tool_outputs(1), Reply::wait_spawned_agents())
        .on(Match::child(), Reply::hang());
    let r = Rig::start(script, Setup::default());
    let id = r.create();
    let (_, turn) = r.d.submit(WS, &id, "PARENT: one endless helper");
    r.wait(&id, "a running child under a running root", |v| {
        provider_phase(v, &id) == "running" && children_running(v, 1)
    });
    let pid = r.codex_pid();
    // SAFETY: kill(2) on the codex process this test's daemon started (found by its CODEX_HOME).
    let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill {pid}: {}", std::io::Error::last_os_error());

    let end = r.wait(&id, "the tree settled", |v| {
        settled(v, &id) && children(v).iter().all(|c| settled(v, &sid(c)))
    });
    let root_turn = turn_of(&end, &id).unwrap().clone();
    assert_eq!(root_turn["id"], turn.as_str());
    assert_eq!(root_turn["outcome"], "interrupted");
    let error = root_turn["error"].as_str().unwrap_or_default().to_string();
    assert!(
        error.contains("provider exited")
            && (error.contains("SIGKILL") || error.contains("signal: 9")),
        "the error names the exit: {error:?}"
    );
    let kids = children(&end);
    assert_eq!(kids.len(), 1);
    let child_turn = turn_of(&end, &sid(&kids[0])).unwrap().clone();
    assert_eq!(child_turn["outcome"], "interrupted");
    assert_eq!(child_turn["error"], error.as_str());
    assert!(end["session"].get("activeTurnId").is_none());
    assert!(
        codex_pids(r.home.path()).is_empty(),
        "the killed codex is gone"
    );

    // The daemon stays healthy: it serves, and the same session runs a new turn on a new codex.
    let health = ureq::get(&format!("http://{}/healthz", r.d.addr))
        .call()
        .expect("healthz");
    assert_eq!(health.status(), 200);
    let (reply, t2) = r.d.submit(WS, &id, "AFTER: are you there?");
    assert_eq!(reply, "started");
    assert_ne!(t2, turn);
    let again = r.wait(&id, "the new turn settled", |v| {
        turn_id_of(v, &id) == t2 && settled(v, &id)
    });
    assert_eq!(outcome(&again, &id).as_deref(), Some("completed"));
    assert!(texts(&r.messages(&id), "assistant").contains(&"still alive".to_string()));
    assert_eq!(outcome(&r.detail(&id), &id).as_deref(), Some("completed"));
    // The new codex process resumed the session's thread: same thread, history kept.
    let reqs = r.mock.requests();
    let first = reqs.first().and_then(|q| q.thread_id.clone());
    let after = reqs
        .iter()
        .find(|q| q.input_contains("AFTER"))
        .expect("the AFTER request");
    assert_eq!(after.thread_id, first, "the root thread is resumed");
    assert!(
        after.input_contains("PARENT"),
        "the earlier history is kept"
    );
    r.mock.assert_all_matched();
}

// ---- idle stop and thread/resume (issue 17 item 2) ----------------------------------------------

/// "A runtime whose tree is quiescent is stopped after an idle timeout; the next submit starts the
/// provider again and continues the same provider conversation": Codex `thread/resume`. The idle
/// app-server is gone after the timeout; the new one works on the same thread, with its history.
#[test]
fn an_idle_codex_is_stopped_and_the_next_submit_resumes_the_same_thread() {
    let script = MockResponses::builder()
        .on(
            Match::root().last_user_text_contains("SECOND"),
            Reply::text("second answer"),
        )
        .on(Match::root(), Reply::text("first answer"));
    let r = Rig::start(
        script,
        Setup {
            idle_timeout_secs: Some(1),
            ..Setup::default()
        },
    );
    let id = r.create();
    r.d.submit(WS, &id, "FIRST: remember me");
    let first = r.wait(&id, "the first turn settled", |v| settled(v, &id));
    assert_eq!(outcome(&first, &id).as_deref(), Some("completed"));
    let thread = first["session"]["providerSessionId"]
        .as_str()
        .expect("the root's thread id")
        .to_string();
    let pid = r.codex_pid();
    let start = Instant::now();
    while !codex_pids(r.home.path()).is_empty() {
        if start.elapsed() > TIMEOUT {
            r.fail(&format!("the idle codex {pid} was not stopped"), &first);
        }
        std::thread::sleep(Duration::from_millis(50));
    }

    let (_, t2) = r.d.submit(WS, &id, "SECOND: do you remember?");
    let again = r.wait(&id, "the second turn settled", |v| {
        turn_id_of(v, &id) == t2 && settled(v, &id)
    });
    assert_eq!(outcome(&again, &id).as_deref(), Some("completed"));
    assert_ne!(r.codex_pid(), pid, "a new app-server process");
    assert_eq!(
        again["session"]["providerSessionId"].as_str(),
        Some(thread.as_str()),
        "the root keeps its thread"
    );
    // The relaunched app-server's answer is recorded, not taken for a duplicate of the first
    // process's messages.
    let second_turn: Vec<Value> = r
        .messages(&id)
        .into_iter()
        .filter(|m| m["turnId"] == t2.as_str())
        .collect();
    let answers = texts(&second_turn, "assistant");
    assert!(
        answers.iter().any(|t| t == "second answer"),
        "the second turn's answer is recorded: {answers:?}"
    );
    let reqs = r.mock.requests();
    let second = reqs
        .iter()
        .find(|q| q.input_contains("SECOND"))
        .expect("the SECOND request");
    assert_eq!(
        second.thread_id.as_deref(),
        Some(thread.as_str()),
        "the model request of the relaunched codex is on the same thread"
    );
    assert!(
        second.input_contains("FIRST"),
        "the earlier history is kept"
    );
    r.mock.assert_all_matched();
}

// ---- guidance while the root provider turn runs ------------------------------------------------

#[test]
fn guidance_while_the_root_provider_turn_runs_is_steered_into_that_provider_turn() {
    let gate = Gate::new();
    let script = MockResponses::builder()
        .on(
            Match::root().tool_outputs(0),
            Reply::spawn_agent("CHILD: slow work"),
        )
        .on(Match::root().tool_outputs(1), Reply::wait_spawned_agents())
        .on(Match::root().tool_outputs(2), Reply::text("parent done"))
        .on(Match::child(), Reply::text("child done").until(&gate));
    let r = Rig::start(script, Setup::default());
    let id = r.create();
    let (_, turn) = r.d.submit(WS, &id, "PARENT: wait for a helper");
    let v = r.wait(&id, "the root provider turn running with its child", |v| {
        provider_phase(v, &id) == "running" && children_running(v, 1)
    });
    let native = turn_of(&v, &id).unwrap()["rootProviderTurn"]["providerTurnId"]
        .as_str()
        .expect("native root turn")
        .to_string();
    // The root is inside wait_agent.
    r.wait_model("wait_agent", |q| q.reply.contains("wait_agent"));
    let (reply, t2) = r.d.submit(WS, &id, "STEER: hurry up");
    assert_eq!(reply, "appended");
    assert_eq!(t2, turn);
    gate.open();
    let end = r.wait(&id, "the root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
    // Steered into the running native turn: no second native root turn, and the model saw the
    // guidance in that same turn.
    assert_eq!(
        turn_of(&end, &id).unwrap()["rootProviderTurn"]["providerTurnId"],
        native.as_str()
    );
    let last = r.wait_model("the root's final request", |q| {
        q.is_root() && q.reply.contains("parent done")
    });
    assert_eq!(last.turn_id.as_deref(), Some(native.as_str()));
    assert!(last.user_texts().iter().any(|t| t == "STEER: hurry up"));
    assert!(r
        .mock
        .requests()
        .iter()
        .filter(|q| q.is_root())
        .all(|q| q.turn_id.as_deref() == Some(native.as_str())));
    let msgs = r.messages(&id);
    assert_eq!(
        texts(&msgs, "user"),
        ["PARENT: wait for a helper", "STEER: hurry up"]
    );
    assert!(msgs.iter().all(|m| m["turnId"] == turn.as_str()));
    r.mock.assert_all_matched();
}

// ---- cancel with a pending child approval ------------------------------------------------------

#[test]
fn cancel_with_a_pending_child_approval_supersedes_it_and_a_late_answer_is_refused() {
    let script = MockResponses::builder()
        .on(
            Match::root().tool_outputs(0),
            Reply::spawn_agent("CHILD: write a file"),
        )
        .on(Match::root().tool_outputs(1), Reply::wait_spawned_agents())
        .on(
            Match::child().tool_outputs(0),
            Reply::exec_command_escalated("touch approved.txt", "child needs to write"),
        );
    let r = Rig::start(
        script,
        Setup {
            approval_policy: "on-request",
            ..Setup::default()
        },
    );
    let id = r.create();
    let (_, turn) = r.d.submit(WS, &id, "PARENT: have a helper write a file");
    let v = r.wait(&id, "a pending child approval", |v| {
        v["interactions"]
            .as_array()
            .is_some_and(|a| a.iter().any(|i| i["status"] == "pending"))
    });
    let i = v["interactions"][0].clone();
    let (cid, ct, req) = (
        i["agentSessionId"].as_str().unwrap().to_string(),
        i["turnId"].as_str().unwrap().to_string(),
        i["requestId"].as_str().unwrap().to_string(),
    );
    assert_ne!(cid, id);
    let (st, _) = r.d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/{turn}/cancel"),
        Some(json!({})),
    );
    assert_eq!(st, 202);
    let end = r.wait(&id, "the tree settled", |v| {
        settled(v, &id) && settled(v, &cid)
    });
    assert_eq!(outcome(&end, &id).as_deref(), Some("canceled"));
    assert!(matches!(
        outcome(&end, &cid).as_deref(),
        Some("canceled") | Some("interrupted")
    ));
    // No longer pending: superseded by the settled turn, or resolved by codex itself when it
    // interrupted the child (`serverRequest/resolved` may arrive before or after the settle).
    let i = end["interactions"][0].clone();
    assert!(
        ["superseded", "resolved"].contains(&i["status"].as_str().unwrap_or("")),
        "{i:#}"
    );
    assert!(i.get("response").is_none(), "nobody answered it: {i:#}");
    // A late answer (in the native object shape) is refused: nothing reaches codex.
    let (st, e) = r.d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{cid}/turns/{ct}/interactions/{req}"),
        Some(json!({"response": {"decision": "accept"}})),
    );
    assert_eq!(st, 409, "{e}");
    assert!(!r.work.path().join("approved.txt").exists());
    r.mock.assert_all_matched();
}

// ---- v2 collaboration tools -------------------------------------------------------------------

#[test]
fn a_v2_sub_agent_activity_child_gates_the_root_like_a_v1_child() {
    let gate = Gate::new();
    let script = MockResponses::builder()
        .on(
            Match::root().tool_outputs(0),
            Reply::spawn_agent_v2("helper_one", "CHILD: v2 work"),
        )
        .on(Match::root().tool_outputs(1), Reply::text("parent done"))
        .on(Match::child(), Reply::text("child done").until(&gate));
    let r = Rig::start(
        script,
        Setup {
            v2: true,
            ..Setup::default()
        },
    );
    let id = r.create();
    let (_, turn) = r.d.submit(WS, &id, "PARENT: one v2 helper");
    let v = r.wait(&id, "the root waiting on its v2 child", |v| {
        provider_phase(v, &id) == "completed"
            && phase(v, &id) == "waiting"
            && children_running(v, 1)
    });
    let child = children(&v)[0].clone();
    assert_eq!(child["title"], "helper_one", "from the v2 agentPath");
    assert_eq!(child["parentTurnId"], turn.as_str());
    r.events.sync(&v);
    assert!(r.events.saw_root_waiting_on_active_children(&id, &turn));
    // The spawn tool call is completed on the root turn as soon as delegation was accepted.
    let spawn = r
        .events
        .since(0)
        .into_iter()
        .find(|row| {
            row["kind"] == "toolCall" && row["payload"]["toolCallId"] == child["parentToolCallId"]
        })
        .expect("the delegation tool call");
    assert_eq!(spawn["payload"]["status"], "completed");
    assert_eq!(spawn["payload"]["turnId"], turn.as_str());
    gate.open();
    let end = r.wait(&id, "the root settled", |v| settled(v, &id));
    assert_eq!(outcome(&end, &id).as_deref(), Some("completed"));
    assert_eq!(outcome(&end, &sid(&child)).as_deref(), Some("completed"));
    assert_eq!(
        texts(&r.messages(&sid(&child)), "assistant"),
        ["child done"]
    );
    r.mock.assert_all_matched();
}
