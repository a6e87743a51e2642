//! The real `@agentclientprotocol/claude-agent-acp` (pinned in `tutti_tests::acp_agents`) driven
//! directly over its stdio by a recording ACP client (`tutti_tests::acp_wire`), offline against
//! the scripted Anthropic Messages server: the shapes of ACP v1 subagent sessions this agent
//! sends (issue 35), checked on a fresh run every time.
//!
//! With `TUTTI_ACP_CAPTURE_DIR` set, every scenario also saves its transcript there as
//! `<name>.wire.jsonl` (the `>> `/`<< ` format of `tutti replay-native`); the golden copies in
//! `tests/data/acp/` were made so, with one change to keep them small: each
//! `available_commands_update` keeps only its first two commands (the agent lists ~11 KB of
//! skills there, twice per prompt; nothing reads them).
//!
//! The client behaves as tutti's ACP adapter does: `initialize` with `fs`/`terminal` off and
//! `clientCapabilities.subagents: {}` (absent in [`without_the_capability`]), `session/new` or
//! `session/load` with the work dir and no MCP servers, `session/prompt`, `session/cancel`. The
//! agent starts in mode `default` because `claude_agent_acp_env` writes it into the agent's
//! settings (its built-in default `auto` blocks tools offline).
//!
//! What each scenario checks of the agent (the shapes the ACP adapter maps; details in the
//! adapter's docs): a child is announced by `subagent_update` on its parent with the child's own
//! `sessionId`; the delegation is a `session_message` pair; a child's permission request carries
//! the child's `sessionId`; a root cancel leaves a background child running until the child itself
//! is cancelled; without the capability no `subagent_update` is sent.

use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;
use tutti_tests::acp_agents::{claude_agent_acp_env, ensure_claude_agent_acp};
use tutti_tests::acp_wire::{is_update, WireClient};
use tutti_tests::mock_messages::{self as mm, MockMessages};
use tutti_tests::mock_responses::Gate;

const WAIT: Duration = Duration::from_secs(90);

/// Starts the agent in `work` with `home` and answers its `initialize`.
fn spawn_initialized(
    mock: &MockMessages,
    home: &std::path::Path,
    work: &std::path::Path,
    subagents: bool,
) -> WireClient {
    let entry = ensure_claude_agent_acp().unwrap_or_else(|e| panic!("{e}"));
    let env = claude_agent_acp_env(&mock.base_url(), &home.to_string_lossy());
    let mut c = WireClient::spawn("node", &[entry.to_string_lossy().to_string()], &env, work)
        .expect("spawn the agent");
    let mut caps = json!({"fs": {"readTextFile": false, "writeTextFile": false},
                          "terminal": false});
    if subagents {
        caps["subagents"] = json!({});
    }
    let init = c.request(
        "initialize",
        json!({"protocolVersion": 1, "clientCapabilities": caps}),
    );
    let r = c.wait_response(init, WAIT).expect("initialize answered");
    assert!(r.get("result").is_some(), "initialize: {r}");
    c
}

struct Run {
    c: WireClient,
    mock: MockMessages,
    sid: String,
    _home: tempfile::TempDir,
    work: tempfile::TempDir,
    name: String,
}

impl Run {
    fn start(name: &str, subagents: bool, script: mm::Script) -> Run {
        let mock = MockMessages::start(script.answering_side_requests()).expect("mock server");
        let home = tempfile::tempdir().expect("home");
        let work = tempfile::tempdir().expect("work");
        let mut c = spawn_initialized(&mock, home.path(), work.path(), subagents);
        let new = c.request("session/new", json!({"cwd": work.path(), "mcpServers": []}));
        let r = c.wait_response(new, WAIT).expect("session/new answered");
        let sid = r["result"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("session/new: {r}"))
            .to_string();
        assert_eq!(
            r["result"]["modes"]["currentModeId"], "default",
            "the settings file's defaultMode applies: {r}"
        );
        Run {
            c,
            mock,
            sid,
            _home: home,
            work,
            name: name.to_string(),
        }
    }

    fn prompt(&mut self, text: &str) -> u64 {
        let sid = self.sid.clone();
        self.c.request(
            "session/prompt",
            json!({"sessionId": sid, "prompt": [{"type": "text", "text": text}]}),
        )
    }

    fn wait(&self, what: &str, from: usize, pred: impl Fn(&Value) -> bool) -> Value {
        self.c.wait_from(from, WAIT, pred).unwrap_or_else(|| {
            panic!(
                "{}: timed out waiting for {what}\nwire:\n{}\nmodel:\n{}",
                self.name,
                self.c.transcript(),
                self.mock.describe_requests()
            )
        })
    }

    fn answered(&self, id: u64) -> Value {
        self.wait(&format!("the answer to request {id}"), 0, |v| {
            v.get("id") == Some(&json!(id)) && v.get("method").is_none()
        })
    }

    /// Waits until nothing arrived for `quiet` (bounded by [`WAIT`]).
    fn settle_quiet(&self, quiet: Duration) {
        let start = std::time::Instant::now();
        loop {
            let n = self.c.mark();
            if self.c.wait_from(n, quiet, |_| true).is_none() || start.elapsed() > WAIT {
                return;
            }
        }
    }

    fn save(&self) {
        if let Some(dir) = std::env::var_os("TUTTI_ACP_CAPTURE_DIR") {
            let path = PathBuf::from(dir).join(format!("{}.wire.jsonl", self.name));
            self.c.save(&path).expect("save the capture");
        }
    }

    /// This run's fresh capture replayed by `tutti replay-native --provider acp`: the tree it
    /// gives (issue 35: "real captures of this agent that you have not seen replay to the right
    /// tree").
    fn replayed(&self) -> Tree {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join(format!("{}.wire.jsonl", self.name));
        self.c.save(&path).expect("save the capture");
        let out = std::process::Command::new(TUTTI)
            .args(["replay-native", "--provider", "acp"])
            .arg(&path)
            .output()
            .expect("run tutti");
        assert!(
            out.status.success(),
            "{}: replay-native: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).expect("replay-native prints JSON");
        assert_eq!(v["violations"], json!([]), "{}: {v}", self.name);
        Tree(v["snapshot"].clone())
    }
}

const TUTTI: &str = env!("CARGO_BIN_EXE_tutti-test");

/// A replayed tree (`TreeSnapshot` JSON).
struct Tree(Value);

impl Tree {
    fn children(&self) -> Vec<&Value> {
        self.0["sessions"]
            .as_array()
            .map(|s| s.iter().filter(|s| s["kind"] == "child").collect())
            .unwrap_or_default()
    }

    /// The outcome of the turn of `session` (the root's is `turn-1`).
    fn outcome(&self, session: &str) -> Value {
        self.0["turns"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["agentSessionId"] == session))
            .map(|t| t["outcome"].clone())
            .unwrap_or(Value::Null)
    }

    /// The canonical child session of native child `native`.
    fn child(&self, native: &str) -> &Value {
        self.children()
            .into_iter()
            .find(|c| c["providerSessionId"] == native)
            .unwrap_or_else(|| panic!("no child session for {native}: {}", self.0))
    }

    /// Every turn settled, with these outcomes for root and children together.
    fn all_settled(&self, outcome: &str) -> bool {
        self.0["turns"].as_array().is_some_and(|t| {
            t.iter()
                .all(|t| t["phase"] == "settled" && t["outcome"] == outcome)
        })
    }
}

fn subagent_updates(v: &[Value]) -> Vec<Value> {
    v.iter()
        .filter(|m| is_update(m, "subagent_update"))
        .cloned()
        .collect()
}

#[test]
fn foreground_child() {
    let mut r = Run::start(
        "claude-agent-acp-foreground",
        true,
        mm::Script::new()
            .on(
                "child",
                mm::Match::subagent().first_user_contains("CHILD-ONE"),
                mm::Reply::text("Child one done."),
            )
            .on(
                "delegate",
                mm::Match::root().tool_results(0),
                mm::Reply::agent(
                    "look around",
                    "CHILD-ONE find it",
                    Some("general-purpose"),
                    false,
                ),
            )
            .fallback(mm::Reply::text("Delegated and done.")),
    );
    let p = r.prompt("delegate please");
    let a = r.answered(p);
    r.settle_quiet(Duration::from_secs(2));
    r.save();
    assert_eq!(a["result"]["stopReason"], "end_turn", "{a}");
    let subs = subagent_updates(&r.c.received());
    assert!(!subs.is_empty(), "{}", r.c.transcript());
    let tree = r.replayed();
    let native = subs[0]["params"]["update"]["sessionId"]
        .as_str()
        .unwrap_or_default();
    let child = tree.child(native);
    assert!(child["parentToolCallId"]
        .as_str()
        .is_some_and(|c| c.starts_with("toolu_")));
    assert_eq!(child["parentAgentSessionId"], "root");
    assert!(tree.all_settled("completed"), "{}", tree.0);
}

/// An `Agent` tool use block (the CLI's delegation tool).
fn is_sub(v: &Value, child: Option<&str>, state: Option<&str>) -> bool {
    is_update(v, "subagent_update")
        && child.is_none_or(|c| v["params"]["update"]["sessionId"] == c)
        && state.is_none_or(|s| v["params"]["update"]["state"]["state"] == s)
}

/// The first `subagent_update` announcing a child whose delegation `session_message` carried
/// `prompt_marker`.
fn child_for(r: &Run, prompt_marker: &str) -> String {
    let m = r.wait(&format!("the delegation of {prompt_marker}"), 0, |v| {
        is_update(v, "session_message")
            && v["params"]["update"]["content"]
                .to_string()
                .contains(prompt_marker)
    });
    m["params"]["update"]["recipientSessionId"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn two_parallel_children_finishing_apart() {
    let gate = Gate::new();
    let mut r = Run::start(
        "claude-agent-acp-parallel",
        true,
        mm::Script::new()
            .on(
                "fast child",
                mm::Match::subagent().first_user_contains("CHILD-FAST"),
                mm::Reply::text("Fast child done."),
            )
            .on(
                "slow child",
                mm::Match::subagent().first_user_contains("CHILD-SLOW"),
                mm::Reply::text("Slow child done.").until(&gate),
            )
            .on(
                "delegate",
                mm::Match::root().tool_results(0),
                mm::Reply::blocks(vec![
                    mm::Block::agent("fast one", "CHILD-FAST go", false),
                    mm::Block::agent("slow one", "CHILD-SLOW go", false),
                ]),
            )
            .fallback(mm::Reply::text("Both done.")),
    );
    let p = r.prompt("delegate twice");
    let fast = child_for(&r, "CHILD-FAST");
    let slow = child_for(&r, "CHILD-SLOW");
    r.wait("the fast child idle", 0, |v| {
        is_sub(v, Some(&fast), Some("idle"))
    });
    let n = r.c.mark();
    assert!(
        r.c.wait_from(n, Duration::from_millis(500), |v| is_sub(
            v,
            Some(&slow),
            Some("idle")
        ))
        .is_none(),
        "the slow child is still running"
    );
    gate.open();
    r.wait("the slow child idle", 0, |v| {
        is_sub(v, Some(&slow), Some("idle"))
    });
    let a = r.answered(p);
    r.settle_quiet(Duration::from_secs(2));
    r.save();
    assert_eq!(a["result"]["stopReason"], "end_turn", "{a}");
    let tree = r.replayed();
    assert_eq!(tree.children().len(), 2, "{}", tree.0);
    assert_ne!(
        tree.child(&fast)["parentToolCallId"],
        tree.child(&slow)["parentToolCallId"]
    );
    assert!(tree.all_settled("completed"), "{}", tree.0);
}

#[test]
fn background_child_outliving_the_prompt() {
    let gate = Gate::new();
    let mut r = Run::start(
        "claude-agent-acp-background",
        true,
        mm::Script::new()
            .on(
                "bg child",
                mm::Match::subagent().first_user_contains("CHILD-BG"),
                mm::Reply::text("Background child done.").until(&gate),
            )
            .on(
                "delegate",
                mm::Match::root().tool_results(0),
                mm::Reply::blocks(vec![mm::Block::agent(
                    "in the background",
                    "CHILD-BG go",
                    true,
                )]),
            )
            .on(
                "notified",
                mm::Match::root().text_contains("task-notification"),
                mm::Reply::text("The background child reported."),
            )
            .fallback(mm::Reply::text("Started it in the background.")),
    );
    let p = r.prompt("delegate in the background");
    let child = child_for(&r, "CHILD-BG");
    r.wait("the root's text", 0, |v| {
        is_update(v, "agent_message_chunk")
            && v["params"]["update"]["content"]["text"]
                .as_str()
                .is_some_and(|t| t.contains("Started it"))
    });
    let n = r.c.mark();
    let early = r.c.wait_from(n, Duration::from_secs(1), |v| {
        v.get("id") == Some(&json!(p))
    });
    gate.open();
    r.wait("the child idle", 0, |v| {
        is_sub(v, Some(&child), Some("idle"))
    });
    let a = r.answered(p);
    r.settle_quiet(Duration::from_secs(3));
    r.save();
    assert!(
        early.is_none(),
        "the prompt is held open while the child runs"
    );
    assert_eq!(a["result"]["stopReason"], "end_turn", "{a}");
    let tree = r.replayed();
    tree.child(&child);
    assert!(tree.all_settled("completed"), "{}", tree.0);
}

/// Picks the `allow_once` option of a permission request.
fn allow_once(r: &mut Run, req: &Value) {
    let opt = req["params"]["options"]
        .as_array()
        .and_then(|o| o.iter().find(|o| o["kind"] == "allow_once"))
        .map(|o| o["optionId"].clone())
        .unwrap_or_else(|| panic!("an allow_once option: {req}"));
    r.c.respond(
        &req["id"],
        json!({"outcome": {"outcome": "selected", "optionId": opt}}),
    );
}

#[test]
fn permission_inside_a_child() {
    let mut r = Run::start("claude-agent-acp-child-permission", true, mm::Script::new());
    let file = r.work.path().join("child.txt");
    r.mock.set_script(
        mm::Script::new()
            .answering_side_requests()
            .on(
                "child write",
                mm::Match::subagent()
                    .first_user_contains("CHILD-WRITE")
                    .tool_results(0),
                mm::Reply::write_file(&file.to_string_lossy(), "from the child"),
            )
            .on(
                "child done",
                mm::Match::subagent().first_user_contains("CHILD-WRITE"),
                mm::Reply::text("Child wrote it."),
            )
            .on(
                "delegate",
                mm::Match::root().tool_results(0),
                mm::Reply::blocks(vec![mm::Block::agent(
                    "write a file",
                    "CHILD-WRITE do it",
                    false,
                )]),
            )
            .fallback(mm::Reply::text("The child wrote it.")),
    );
    let p = r.prompt("delegate a write");
    let child = child_for(&r, "CHILD-WRITE");
    let req = r.wait("the child's permission request", 0, |v| {
        v["method"] == "session/request_permission"
    });
    assert_eq!(req["params"]["sessionId"], child.as_str(), "{req}");
    allow_once(&mut r, &req);
    let a = r.answered(p);
    r.settle_quiet(Duration::from_secs(2));
    r.save();
    assert_eq!(a["result"]["stopReason"], "end_turn", "{a}");
    assert_eq!(
        std::fs::read_to_string(&file).ok().as_deref(),
        Some("from the child")
    );
    let tree = r.replayed();
    let session = tree.child(&child)["id"].clone();
    let interactions = tree.0["interactions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(interactions.len(), 1, "{}", tree.0);
    assert_eq!(interactions[0]["agentSessionId"], session);
    assert!(tree.all_settled("completed"), "{}", tree.0);
}

#[test]
fn child_only_cancel() {
    let mut r = Run::start(
        "claude-agent-acp-child-cancel",
        true,
        mm::Script::new()
            .on(
                "child hangs",
                mm::Match::subagent().first_user_contains("CHILD-HANG"),
                mm::Reply::stall("Child working", None),
            )
            .on(
                "delegate",
                mm::Match::root().tool_results(0),
                mm::Reply::blocks(vec![mm::Block::agent("hang", "CHILD-HANG go", false)]),
            )
            .fallback(mm::Reply::text("The child was stopped; carrying on.")),
    );
    let p = r.prompt("delegate something long");
    let child = child_for(&r, "CHILD-HANG");
    r.wait("the child's model request", 0, |_| {
        r.mock
            .message_requests()
            .iter()
            .any(|q| q.first_user_text().contains("CHILD-HANG"))
    });
    r.c.notify("session/cancel", json!({"sessionId": child}));
    r.wait("the child idle", 0, |v| {
        is_sub(v, Some(&child), Some("idle"))
    });
    let a = r.answered(p);
    r.settle_quiet(Duration::from_secs(2));
    r.save();
    assert_eq!(a["result"]["stopReason"], "end_turn", "{a}");
    let tree = r.replayed();
    let session = tree.child(&child)["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(tree.outcome(&session), "canceled", "{}", tree.0);
    assert_eq!(tree.outcome("root"), "completed", "{}", tree.0);
}

#[test]
fn whole_tree_cancel_with_a_background_child() {
    let mut r = Run::start(
        "claude-agent-acp-tree-cancel",
        true,
        mm::Script::new()
            .on(
                "bg child hangs",
                mm::Match::subagent().first_user_contains("CHILD-BG-HANG"),
                mm::Reply::stall("Child working", None),
            )
            .on(
                "delegate",
                mm::Match::root().tool_results(0),
                mm::Reply::blocks(vec![mm::Block::agent(
                    "hang in bg",
                    "CHILD-BG-HANG go",
                    true,
                )]),
            )
            .fallback(mm::Reply::text("Started it in the background.")),
    );
    let p = r.prompt("delegate in the background");
    let child = child_for(&r, "CHILD-BG-HANG");
    r.wait("the root's text", 0, |v| {
        is_update(v, "agent_message_chunk")
            && v["params"]["update"]["content"]["text"]
                .as_str()
                .is_some_and(|t| t.contains("Started it"))
    });
    let sid = r.sid.clone();
    r.c.notify("session/cancel", json!({"sessionId": sid}));
    let a = r.answered(p);
    r.settle_quiet(Duration::from_secs(3));
    let n = r.c.mark();
    let still =
        !r.c.received()
            .iter()
            .any(|v| is_sub(v, Some(&child), Some("idle")));
    r.c.notify("session/cancel", json!({"sessionId": child}));
    r.wait("the child idle", n, |v| {
        is_sub(v, Some(&child), Some("idle"))
    });
    r.settle_quiet(Duration::from_secs(3));
    r.save();
    assert_eq!(a["result"]["stopReason"], "cancelled", "{a}");
    assert!(still, "the background child outlived the root cancel");
    let tree = r.replayed();
    let session = tree.child(&child)["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(tree.outcome(&session), "canceled", "{}", tree.0);
    assert_eq!(tree.outcome("root"), "canceled", "{}", tree.0);
}

#[test]
fn nested_child() {
    let mut r = Run::start(
        "claude-agent-acp-nested",
        true,
        mm::Script::new()
            .on(
                "grandchild",
                mm::Match::subagent().first_user_contains("GRANDCHILD"),
                mm::Reply::text("Grandchild done."),
            )
            .on(
                "child delegates",
                mm::Match::subagent()
                    .first_user_contains("CHILD-NEST")
                    .tool_results(0),
                mm::Reply::blocks(vec![mm::Block::agent("deeper", "GRANDCHILD go", false)]),
            )
            .on(
                "child done",
                mm::Match::subagent().first_user_contains("CHILD-NEST"),
                mm::Reply::text("Child done."),
            )
            .on(
                "delegate",
                mm::Match::root().tool_results(0),
                mm::Reply::blocks(vec![mm::Block::agent("nest", "CHILD-NEST go", false)]),
            )
            .fallback(mm::Reply::text("Nested done.")),
    );
    let p = r.prompt("delegate nested");
    let a = r.answered(p);
    r.settle_quiet(Duration::from_secs(2));
    r.save();
    assert_eq!(a["result"]["stopReason"], "end_turn", "{a}");
    let child = child_for(&r, "CHILD-NEST");
    let grandchild = child_for(&r, "GRANDCHILD");
    let tree = r.replayed();
    assert_eq!(tree.children().len(), 2, "{}", tree.0);
    assert_eq!(
        tree.child(&grandchild)["parentAgentSessionId"],
        tree.child(&child)["id"],
        "the grandchild's parent is the child"
    );
    assert_eq!(tree.child(&grandchild)["rootAgentSessionId"], "root");
    assert!(tree.all_settled("completed"), "{}", tree.0);
}

#[test]
fn without_the_capability() {
    let mut r = Run::start(
        "claude-agent-acp-no-capability",
        false,
        mm::Script::new()
            .on(
                "child write",
                mm::Match::subagent()
                    .first_user_contains("CHILD-PLAIN")
                    .tool_results(0),
                mm::Reply::bash("echo hi", false),
            )
            .on(
                "child",
                mm::Match::subagent().first_user_contains("CHILD-PLAIN"),
                mm::Reply::text("Child one done."),
            )
            .on(
                "delegate",
                mm::Match::root().tool_results(0),
                mm::Reply::blocks(vec![mm::Block::agent(
                    "look around",
                    "CHILD-PLAIN go",
                    false,
                )]),
            )
            .fallback(mm::Reply::text("Delegated and done.")),
    );
    let p = r.prompt("delegate please");
    let req = r.wait("the child's permission request", 0, |v| {
        v["method"] == "session/request_permission" || v.get("id") == Some(&json!(p))
    });
    if req["method"] == "session/request_permission" {
        allow_once(&mut r, &req);
    }
    let a = r.answered(p);
    r.settle_quiet(Duration::from_secs(2));
    r.save();
    assert_eq!(a["result"]["stopReason"], "end_turn", "{a}");
    assert!(subagent_updates(&r.c.received()).is_empty());
    let tree = r.replayed();
    assert!(tree.children().is_empty(), "root-only: {}", tree.0);
    assert!(tree.all_settled("completed"), "{}", tree.0);
}

/// A root that delegated to a foreground child, then a new agent process loading the session
/// (`session/load`, what tutti sends after an idle stop, a crash or a restart): the history it
/// replays, and the next prompt carrying the earlier conversation.
#[test]
fn relaunch_loads_a_session_with_a_child() {
    let mut r = Run::start(
        "claude-agent-acp-relaunch-first",
        true,
        mm::Script::new()
            .on(
                "child",
                mm::Match::subagent().first_user_contains("CHILD-PAPAYA"),
                mm::Reply::text("Child saw PAPAYA."),
            )
            .on(
                "delegate",
                mm::Match::root()
                    .tool_results(0)
                    .text_lacks("third question"),
                mm::Reply::blocks(vec![mm::Block::agent("remember", "CHILD-PAPAYA go", false)]),
            )
            .fallback(mm::Reply::text("Noted.")),
    );
    let p = r.prompt("remember the word PAPAYA");
    r.answered(p);
    r.settle_quiet(Duration::from_secs(2));
    r.save();
    assert_eq!(r.replayed().children().len(), 1);
    r.c.stop(Duration::from_secs(5));
    let mut c = spawn_initialized(&r.mock, r._home.path(), r.work.path(), true);
    let sid = r.sid.clone();
    let l = c.request(
        "session/load",
        json!({"sessionId": sid, "cwd": r.work.path(), "mcpServers": []}),
    );
    let loaded = c.wait_response(l, WAIT).expect("load answered");
    let p = c.request(
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "text", "text": "third question"}]}),
    );
    let answered = c.wait_response(p, WAIT).expect("prompt answered");
    r.c = c;
    r.name = "claude-agent-acp-relaunch-load".into();
    r.settle_quiet(Duration::from_secs(2));
    r.save();
    assert!(loaded.get("result").is_some(), "session/load: {loaded}");
    assert_eq!(answered["result"]["stopReason"], "end_turn", "{answered}");
    let third = r
        .mock
        .message_requests()
        .into_iter()
        .find(|q| !q.is_side_request() && q.last_user_text().contains("third question"))
        .expect("the third question reached the model");
    assert!(
        third.all_text().contains("PAPAYA"),
        "the loaded session carries the earlier history"
    );
    let tree = r.replayed();
    assert!(
        tree.children().is_empty(),
        "the replayed child is bound, not created again: {}",
        tree.0
    );
    assert!(tree.all_settled("completed"), "{}", tree.0);
}
