//! The ACP agents people already use, through a real `tuttid` (issues 23, 35): npm
//! `@agentclientprotocol/claude-agent-acp` (pinned in `tutti_tests::acp_agents`, an ACP agent on the
//! Claude Agent SDK, driven by the scripted Anthropic Messages server of
//! `tutti_tests::mock_messages`) and npm `@zed-industries/codex-acp` (an ACP agent built on Codex,
//! driven by the scripted Responses server of `tutti_tests::mock_responses` with the same offline
//! `CODEX_HOME/config.toml` the Codex tests use). codex-acp runs offline: it only ever calls
//! `POST /v1/responses` of the configured provider, so no Gemini fallback is needed.
//!
//! Each test starts its own scripted model server, its own temp `HOME`/`CODEX_HOME` and work dir,
//! and its own daemon whose config names the agent as a `kind = "acp"` provider, exactly as the
//! README's "Using an existing ACP agent" section shows. The agents are installed from npm on
//! first use (`ensure_claude_agent_acp`, `ensure_codex_acp`); an install failure fails the test.
//!
//! Rules checked for each agent (the test names say which):
//! - a plain prompt completes with the agent's text recorded;
//! - `{"response": "allow"}` allows once: the next use of the same tool asks again;
//! - a cancel settles the turn canceled, keeps the text streamed before it, closes the open tool
//!   call as `interrupted`, and the agent answers the next submit;
//! - guidance during a turn joins that turn and reaches the model;
//! - a `Task`-like delegation tool creates no child session ("agents that do not opt in get no
//!   child sessions");
//! - the agent killed mid-turn settles the turn `interrupted`, and the next submit continues the
//!   same conversation (`session/load`; the model server receives the earlier history);
//! - `SIGTERM` to the daemon leaves no process of the agent's tree behind.
//!
//! Determinism: the test acts only after it observed what it needs (a model request recorded by
//! the scripted server, a message, tool call or interaction in the daemon); model replies that
//! must still be running are held by a [`Gate`] or never finish. Waits are bounds for a slow
//! machine, not timed assertions.

use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tutti_tests::acp_agents::{claude_agent_acp_env, ensure_claude_agent_acp, ensure_codex_acp};
use tutti_tests::codex_client::CodexConfig;
use tutti_tests::daemon::{children, turn_of, TestDaemon};
use tutti_tests::mock_messages::{self as mm, MockMessages};
use tutti_tests::mock_responses::{self as mr, Gate, MockResponses, MULTI_AGENT_V1};
use tutti_tests::procs;

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const WS: &str = "w1";
/// Bound of one wait (an agent start plus a model round trip on a loaded 2-core machine).
const WAIT: Duration = Duration::from_secs(90);

// ---- the rig --------------------------------------------------------------------------------

/// One daemon configured with one third-party ACP agent as provider `agent`.
struct Rig {
    d: TestDaemon,
    work: tempfile::TempDir,
    home: tempfile::TempDir,
}

/// The `[providers.agent]` table of the daemon's config (the README's shape).
fn provider_toml(command: &[String], env: &[(String, String)]) -> String {
    let q = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let command: Vec<String> = command.iter().map(|c| q(c)).collect();
    let env: Vec<String> = env
        .iter()
        .map(|(k, v)| format!("{} = {}", q(k), q(v)))
        .collect();
    format!(
        "[providers.agent]\nkind = \"acp\"\ncommand = [{}]\nenv = {{ {} }}\n",
        command.join(", "),
        env.join(", ")
    )
}

impl Rig {
    fn start(toml: &str, home: tempfile::TempDir, work: tempfile::TempDir) -> Rig {
        let d = TestDaemon::start(EXE, Some(toml), &[]);
        Rig { d, work, home }
    }

    /// A root session of the agent, working in the rig's work dir.
    fn create(&self) -> String {
        let (st, v) = self.d.call(
            "POST",
            &format!("/v1/workspaces/{WS}/agent-sessions"),
            Some(json!({"provider": "agent", "title": "e2e", "cwd": self.work.path()})),
        );
        assert_eq!(st, 201, "create: {v}");
        v["session"]["id"].as_str().expect("session id").to_string()
    }

    fn submit(&self, id: &str, text: &str) -> (String, String) {
        self.d.submit(WS, id, text)
    }

    fn wait(&self, id: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        self.d.wait_for(WS, id, WAIT.as_secs(), what, pred)
    }

    /// Waits until turn `turn` of `id` has an outcome; returns it.
    fn settle(&self, id: &str, turn: &str) -> String {
        let d = self.wait(id, &format!("turn {turn} settled"), |v| {
            turn_of(v, id).is_some_and(|t| t["id"] == turn && t["outcome"].is_string())
        });
        turn_of(&d, id).expect("the turn")["outcome"]
            .as_str()
            .expect("an outcome")
            .to_string()
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

    /// The texts of the assistant messages of `turn`.
    fn assistant_texts(&self, id: &str, turn: &str) -> Vec<String> {
        self.messages(id)
            .iter()
            .filter(|m| m["role"] == "assistant" && m["turnId"] == turn)
            .filter_map(|m| m["text"].as_str().map(String::from))
            .collect()
    }

    /// Waits for a pending interaction whose request id is not in `seen`.
    fn next_pending(&self, id: &str, seen: &[String]) -> Value {
        let d = self.wait(id, "a new pending interaction", |v| {
            v["interactions"].as_array().is_some_and(|a| {
                a.iter().any(|i| {
                    i["status"] == "pending" && !seen.iter().any(|s| i["requestId"] == s.as_str())
                })
            })
        });
        d["interactions"]
            .as_array()
            .expect("interactions")
            .iter()
            .find(|i| {
                i["status"] == "pending" && !seen.iter().any(|s| i["requestId"] == s.as_str())
            })
            .expect("the pending interaction")
            .clone()
    }

    fn answer(&self, i: &Value, response: Value) {
        let (st, v) = self.d.call(
            "POST",
            &format!(
                "/v1/workspaces/{WS}/agent-sessions/{}/turns/{}/interactions/{}",
                i["agentSessionId"].as_str().expect("owner"),
                i["turnId"].as_str().expect("turn"),
                i["requestId"].as_str().expect("request id"),
            ),
            Some(json!({ "response": response })),
        );
        assert_eq!(st, 200, "answer: {v}");
    }

    fn cancel(&self, id: &str, turn: &str) {
        let (st, v) = self.d.call(
            "POST",
            &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/{turn}/cancel"),
            Some(json!({})),
        );
        assert_eq!(st, 202, "cancel: {v}");
    }

    /// Every published tool call row (payloads, in outbox order).
    fn tool_call_rows(&self) -> Vec<Value> {
        self.d
            .events(Some(0), None, usize::MAX, 1)
            .into_iter()
            .filter(|e| e["kind"] == "toolCall")
            .map(|e| e["payload"].clone())
            .collect()
    }

    /// The agent process (the daemon's child), once it runs.
    fn agent_pid(&self) -> u32 {
        let daemon = self.d.pid().expect("the daemon runs");
        procs::poll(WAIT.as_secs(), || {
            procs::children_of(daemon).first().copied()
        })
        .expect("the daemon started the agent")
    }

    /// SIGKILLs the agent's whole process group (the agent crashed, taking its children along).
    fn kill_agent_group(&self) -> u32 {
        let pid = self.agent_pid();
        let pgrp = procs::processes()
            .iter()
            .find(|p| p.0 == pid)
            .map(|p| p.2)
            .expect("the agent's process group");
        assert_eq!(pgrp, pid, "the agent leads its own process group");
        // SAFETY: kill(2) of the process group of a provider this test's daemon started.
        unsafe { libc::kill(-(pgrp as libc::pid_t), libc::SIGKILL) };
        pid
    }

    /// Waits until the agent has written a transcript (a `.jsonl` file anywhere under its
    /// home: the Claude CLI's `~/.claude/projects/`, Codex's `$CODEX_HOME/sessions/`) holding
    /// every one of `needles`.
    ///
    /// The agent's own durability is not what these tests check: the Claude CLI writes its
    /// transcript in batches, so a SIGKILL shortly after a turn can lose that turn on the
    /// agent's side, and its `session/load` then answers "Session not found" (tutti falls back
    /// to a new ACP session, as documented in the ACP adapter). Waiting here makes the kill land
    /// after the agent saved the turn, so the test checks what tutti does with a saved one.
    fn wait_agent_transcript(&self, needles: &[&str]) {
        let saved = procs::poll(WAIT.as_secs(), || {
            let mut files = Vec::new();
            jsonl_files(self.home.path(), &mut files);
            files
                .iter()
                .filter_map(|f| std::fs::read_to_string(f).ok())
                .any(|text| needles.iter().all(|n| text.contains(n)))
                .then_some(())
        });
        assert!(
            saved.is_some(),
            "the agent saved a transcript with {needles:?} under its home"
        );
    }

    /// Removes every transcript the agent saved under its home (see
    /// [`Rig::wait_agent_transcript`]), as if it lost them; returns how many it removed.
    fn remove_agent_transcripts(&self) -> usize {
        let mut files = Vec::new();
        jsonl_files(self.home.path(), &mut files);
        files
            .iter()
            .filter(|f| std::fs::remove_file(f).is_ok())
            .count()
    }

    fn provider_session_id(&self, id: &str) -> Option<String> {
        self.d.detail(WS, id)["session"]["providerSessionId"]
            .as_str()
            .map(String::from)
    }
}

impl Drop for Rig {
    /// A graceful stop, so the daemon ends the agent's process group: codex-acp does not exit
    /// when its input closes, and a SIGKILLed daemon would leave it running.
    fn drop(&mut self) {
        if self.d.pid().is_some() {
            let _ = self.d.signal_and_wait(libc::SIGTERM, 15);
        }
    }
}

/// Every `.jsonl` file under `dir`, at any depth.
fn jsonl_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => jsonl_files(&path, out),
            Ok(t) if t.is_file() && path.extension().is_some_and(|x| x == "jsonl") => {
                out.push(path)
            }
            _ => {}
        }
    }
}

/// Every live descendant of `pid` (children, their children, ...).
fn descendants(pid: u32) -> Vec<u32> {
    let all = procs::processes();
    let mut out = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        for c in all.iter().filter(|q| q.1 == p && q.3 != 'Z') {
            out.push(c.0);
            frontier.push(c.0);
        }
    }
    out
}

/// Waits until `pred` holds for the model server's recorded requests.
fn wait_model<T>(what: &str, mut f: impl FnMut() -> Option<T>, describe: impl Fn() -> String) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        if start.elapsed() > WAIT {
            panic!(
                "timed out waiting for {what}; model requests:\n{}",
                describe()
            );
        }
        std::thread::sleep(Duration::from_millis(30));
    }
}

/// `SIGTERM` to the daemon while a turn runs: the daemon exits and every process of the agent's
/// tree (all descendants seen before the signal) is gone afterwards.
fn sigterm_leaves_nothing(rig: &mut Rig, at_least: usize) {
    let daemon = rig.d.pid().expect("the daemon runs");
    let before = descendants(daemon);
    assert!(
        before.len() >= at_least,
        "the agent's tree runs before the signal: {before:?}"
    );
    let status = rig.d.signal_and_wait(libc::SIGTERM, WAIT.as_secs());
    assert!(status.is_some(), "the daemon exits on SIGTERM");
    let left = procs::poll(10, || {
        let alive: Vec<u32> = before
            .iter()
            .copied()
            .filter(|p| procs::alive(*p))
            .collect();
        alive.is_empty().then_some(())
    });
    let alive: Vec<u32> = before
        .iter()
        .copied()
        .filter(|p| procs::alive(*p))
        .collect();
    assert!(
        left.is_some(),
        "processes outlived the daemon: {alive:?} of {before:?}"
    );
}

// ---- claude-agent-acp ------------------------------------------------------------------------

/// What the scenarios both agents share need from an agent under test and its scripted model
/// server.
trait UnderTest {
    fn rig(&self) -> &Rig;
    /// Waits until the model server got a request whose last user text contains `needle`;
    /// returns whether that request also carries `history` anywhere in its input.
    fn request_carries(&self, needle: &str, history: &str) -> bool;
    /// Every request the model server got, for a failure message.
    fn requests(&self) -> String;
}

/// Guidance sent while a turn runs joins that turn (`appended`, the same turn id) and reaches
/// the model; `gate` holds the first answer until the guidance is in. Returns the session and
/// the turn.
fn guidance_joins_the_running_turn(a: &impl UnderTest, gate: &Gate) -> (String, String) {
    let rig = a.rig();
    let id = rig.create();
    let (_, turn) = rig.submit(&id, "start the work");
    a.request_carries("start the work", "");
    let (reply, same) = rig.submit(&id, "also check the docs");
    assert_eq!(reply, "appended", "guidance joins the running turn");
    assert_eq!(same, turn);
    gate.open();
    assert_eq!(rig.settle(&id, &turn), "completed");
    a.request_carries("also check the docs", "");
    let users = rig
        .messages(&id)
        .iter()
        .filter(|m| m["role"] == "user" && m["turnId"] == turn.as_str())
        .count();
    assert_eq!(users, 2, "both user messages on the one turn");
    (id, turn)
}

/// A root whose first turn ("remember the word PAPAYA") completed and was saved by the agent,
/// and whose second turn was interrupted by a SIGKILL of the agent's process group while the
/// model hung on "second question". Returns the session, its ACP session id and the killed pid.
fn killed_during_the_second_turn(a: &impl UnderTest) -> (String, String, u32) {
    let rig = a.rig();
    let id = rig.create();
    let (_, t1) = rig.submit(&id, "remember the word PAPAYA");
    assert_eq!(rig.settle(&id, &t1), "completed");
    let acp_session = rig.provider_session_id(&id).expect("the ACP session id");
    rig.wait_agent_transcript(&["PAPAYA", "Noted."]);
    let (_, t2) = rig.submit(&id, "second question");
    a.request_carries("second question", "");
    let killed = rig.kill_agent_group();
    assert_eq!(rig.settle(&id, &t2), "interrupted");
    (id, acp_session, killed)
}

/// The agent's process group killed while the model hangs on "second question": the turn
/// settles interrupted, and the next submit starts a new agent process that continues the same
/// ACP session (`session/load`) with the earlier history.
fn killed_mid_turn_then_the_conversation_continues(a: &impl UnderTest) {
    let rig = a.rig();
    let (id, acp_session, killed) = killed_during_the_second_turn(a);
    let (reply, t3) = rig.submit(&id, "third question");
    assert_eq!(reply, "started");
    assert_eq!(rig.settle(&id, &t3), "completed");
    assert_ne!(rig.agent_pid(), killed, "a new agent process");
    assert!(
        a.request_carries("third question", "PAPAYA"),
        "the model receives the earlier history: {}",
        a.requests()
    );
    let texts = rig.assistant_texts(&id, &t3);
    assert!(
        texts.iter().any(|t| t.contains("Noted.")),
        "the relaunched agent's answer is recorded on the turn: {texts:?} of {:?}",
        rig.messages(&id)
    );
    assert_eq!(
        rig.provider_session_id(&id).as_deref(),
        Some(acp_session.as_str()),
        "the same ACP session (session/load)"
    );
}

/// The agent's process group killed mid-turn, then the agent's saved conversation removed (as if
/// the agent lost it): `session/load` of the recorded ACP session fails, and tutti falls back to
/// a new ACP session, records its id as the root's provider session id, and the turn completes
/// (the ACP adapter's documented fallback).
fn a_lost_agent_session_continues_in_a_new_acp_session(a: &impl UnderTest) {
    let rig = a.rig();
    let (id, acp_session, _) = killed_during_the_second_turn(a);
    let removed = rig.remove_agent_transcripts();
    assert!(removed > 0, "the agent had saved its conversation");
    let (reply, t3) = rig.submit(&id, "third question");
    assert_eq!(reply, "started");
    assert_eq!(rig.settle(&id, &t3), "completed");
    let now = rig.provider_session_id(&id).expect("a provider session id");
    assert_ne!(
        now, acp_session,
        "the new ACP session's id is recorded on the root"
    );
    assert!(
        !a.request_carries("third question", "PAPAYA"),
        "the agent lost the history, so a new conversation started: {}",
        a.requests()
    );
    let texts = rig.assistant_texts(&id, &t3);
    assert!(
        texts.iter().any(|t| t.contains("Noted.")),
        "the new session's answer is recorded on the turn: {texts:?} of {:?}",
        rig.messages(&id)
    );
}

struct Claude {
    rig: Rig,
    mock: MockMessages,
}

impl Claude {
    fn start(script: mm::Script) -> Claude {
        Claude::start_with(script, None)
    }

    /// [`Claude::start`] with everything the agent writes to the daemon also appended to
    /// `wire` (through `tee`, line by line in the order the agent wrote it).
    fn start_recording(script: mm::Script, wire: &std::path::Path) -> Claude {
        Claude::start_with(script, Some(wire))
    }

    fn start_with(script: mm::Script, wire: Option<&std::path::Path>) -> Claude {
        let entry = ensure_claude_agent_acp()
            .unwrap_or_else(|e| panic!("these tests need the real claude-agent-acp: {e}"));
        let mock = MockMessages::start(script.answering_side_requests())
            .expect("start the scripted Messages server");
        let home = tempfile::tempdir().expect("temp HOME");
        let work = tempfile::tempdir().expect("temp work dir");
        let env = claude_agent_acp_env(&mock.base_url(), &home.path().to_string_lossy());
        let entry = entry.to_string_lossy().to_string();
        let command = match wire {
            None => vec!["node".to_string(), entry],
            Some(wire) => vec![
                "sh".to_string(),
                "-c".to_string(),
                r#"node "$0" | tee -a "$1""#.to_string(),
                entry,
                wire.to_string_lossy().to_string(),
            ],
        };
        let rig = Rig::start(&provider_toml(&command, &env), home, work);
        Claude { rig, mock }
    }

    /// Waits until the server recorded a root request whose last message contains `needle`.
    fn wait_request(&self, needle: &str) -> mm::RecordedRequest {
        wait_model(
            &format!("a model request with {needle:?}"),
            || {
                self.mock
                    .message_requests()
                    .into_iter()
                    .find(|r| !r.is_side_request() && r.last_user_text().contains(needle))
            },
            || self.mock.describe_requests(),
        )
    }
}

impl Claude {
    /// The model answers "Noted." and hangs on "second question".
    fn hanging_on_the_second_question() -> Claude {
        Claude::start(
            mm::Script::new()
                .on(
                    "hang",
                    mm::Match::any().last_user_contains("second question"),
                    mm::Reply::stall("Thinking", None),
                )
                .fallback(mm::Reply::text("Noted.")),
        )
    }
}

impl UnderTest for Claude {
    fn rig(&self) -> &Rig {
        &self.rig
    }
    fn request_carries(&self, needle: &str, history: &str) -> bool {
        self.wait_request(needle).all_text().contains(history)
    }
    fn requests(&self) -> String {
        self.mock.describe_requests()
    }
}

#[test]
fn claude_agent_acp_plain_prompt_completes_with_the_text_recorded() {
    let c = Claude::start(
        mm::Script::new().fallback(mm::Reply::text("Hello from the scripted model.")),
    );
    let id = c.rig.create();
    let (reply, turn) = c.rig.submit(&id, "hi there");
    assert_eq!(reply, "started");
    assert_eq!(c.rig.settle(&id, &turn), "completed");
    let texts = c.rig.assistant_texts(&id, &turn);
    assert!(
        texts.iter().any(|t| t == "Hello from the scripted model."),
        "the agent's text is recorded on the turn: {texts:?}"
    );
    assert!(
        c.rig.provider_session_id(&id).is_some(),
        "the ACP session id is recorded"
    );
    assert!(children(&c.rig.d.detail(WS, &id)).is_empty());
}

/// `{"response": "allow"}` picks `allow_once` among claude-agent-acp's options (it also offers
/// `allow_always`, "Yes, allow all edits during this session"): the second `Write` asks again.
#[test]
fn claude_agent_acp_permission_allow_is_once_and_the_next_use_asks_again() {
    let c = Claude::start(mm::Script::new());
    let a = c.rig.work.path().join("a.txt");
    let b = c.rig.work.path().join("b.txt");
    c.mock.set_script(
        mm::Script::new()
            .answering_side_requests()
            .on(
                "first write",
                mm::Match::any()
                    .first_user_contains("write both")
                    .tool_results(0),
                mm::Reply::write_file(&a.to_string_lossy(), "one"),
            )
            .on(
                "second write",
                mm::Match::any()
                    .first_user_contains("write both")
                    .tool_results(1),
                mm::Reply::write_file(&b.to_string_lossy(), "two"),
            )
            .fallback(mm::Reply::text("Both written.")),
    );
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "write both files");
    let first = c.rig.next_pending(&id, &[]);
    let kinds: Vec<&str> = first["payload"]["options"]
        .as_array()
        .expect("ACP permission options")
        .iter()
        .filter_map(|o| o["kind"].as_str())
        .collect();
    assert!(
        kinds.contains(&"allow_once") && kinds.contains(&"allow_always"),
        "the agent offers once and always (the shortcut must pick once): {first:#}"
    );
    c.rig.answer(&first, json!("allow"));
    let second = c.rig.next_pending(
        &id,
        &[first["requestId"].as_str().unwrap_or("").to_string()],
    );
    assert_ne!(second["requestId"], first["requestId"]);
    c.rig.answer(&second, json!("allow"));
    assert_eq!(c.rig.settle(&id, &turn), "completed");
    assert_eq!(std::fs::read_to_string(&a).ok().as_deref(), Some("one"));
    assert_eq!(std::fs::read_to_string(&b).ok().as_deref(), Some("two"));
}

/// The model's reply is cut off mid-stream: text, then the start of a `Bash` tool use, then
/// nothing. The agent streams the text and opens the tool call (whose arrival makes the text a
/// message in the daemon); the cancel settles the turn canceled with the text kept and the tool
/// call closed as `interrupted`, and the agent answers the next prompt. (The text still buffered
/// in the adapter at the cancel is covered by `acp_real`'s plain-agent test: a real agent gives
/// no signal that the daemon has read a chunk.)
#[test]
fn claude_agent_acp_cancel_mid_stream_keeps_the_text_and_the_agent_answers_again() {
    let c = Claude::start(
        mm::Script::new()
            .on(
                "stall",
                mm::Match::any().last_user_contains("look around"),
                mm::Reply::stall("Working on it...", Some("Bash")),
            )
            .fallback(mm::Reply::text("Back again.")),
    );
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "look around");
    let open = wait_model(
        "the open tool call",
        || {
            c.rig
                .tool_call_rows()
                .into_iter()
                .find(|t| t["turnId"] == turn.as_str())
        },
        || c.mock.describe_requests(),
    );
    c.rig.cancel(&id, &turn);
    assert_eq!(c.rig.settle(&id, &turn), "canceled");
    let texts = c.rig.assistant_texts(&id, &turn);
    assert!(
        texts.iter().any(|t| t.contains("Working on it...")),
        "the text streamed before the cancel is kept: {texts:?}"
    );
    let rows = c.rig.tool_call_rows();
    let last = rows
        .iter()
        .rfind(|t| t["toolCallId"] == open["toolCallId"])
        .expect("the tool call's rows");
    assert_eq!(last["status"], "interrupted", "{rows:#?}");

    let (reply, next) = c.rig.submit(&id, "and now?");
    assert_eq!(reply, "started");
    assert_eq!(c.rig.settle(&id, &next), "completed");
    assert!(
        c.rig
            .assistant_texts(&id, &next)
            .iter()
            .any(|t| t == "Back again."),
        "the agent answers after the cancel"
    );
}

#[test]
fn claude_agent_acp_guidance_during_a_turn_joins_it_and_reaches_the_model() {
    let gate = Gate::new();
    let c = Claude::start(
        mm::Script::new()
            .rule(
                mm::Rule::new(
                    "held",
                    mm::Match::any().last_user_contains("start the work"),
                    mm::Reply::text("First answer.").until(&gate),
                )
                .times(1),
            )
            .fallback(mm::Reply::text("Guided answer.")),
    );
    let (id, turn) = guidance_joins_the_running_turn(&c, &gate);
    assert!(c
        .rig
        .assistant_texts(&id, &turn)
        .iter()
        .any(|t| t == "Guided answer."));
}

#[test]
fn claude_agent_acp_killed_mid_turn_is_interrupted_and_the_next_submit_continues_the_conversation()
{
    let c = Claude::hanging_on_the_second_question();
    killed_mid_turn_then_the_conversation_continues(&c);
}

#[test]
fn claude_agent_acp_that_lost_its_session_continues_in_a_new_acp_session_recorded_on_the_root() {
    let c = Claude::hanging_on_the_second_question();
    a_lost_agent_session_continues_in_a_new_acp_session(&c);
}

#[test]
fn claude_agent_acp_daemon_sigterm_leaves_no_process_behind() {
    let mut c = Claude::start(mm::Script::new().fallback(mm::Reply::stall("Thinking", None)));
    let id = c.rig.create();
    c.rig.submit(&id, "keep going");
    c.wait_request("keep going");
    // The agent (node) and the Claude CLI it started.
    sigterm_leaves_nothing(&mut c.rig, 2);
}

// ---- claude-agent-acp's subagents as child sessions (issue 35) ------------------------------

impl Claude {
    /// The child session titled `title`, once it exists.
    fn child(&self, id: &str, title: &str) -> Value {
        let d = self.rig.wait(id, &format!("the child {title:?}"), |v| {
            children(v).iter().any(|c| c["title"] == title)
        });
        children(&d)
            .into_iter()
            .find(|c| c["title"] == title)
            .expect("the child")
    }

    /// The outcome of `session`'s last turn, once it has one.
    fn outcome(&self, root: &str, session: &str) -> String {
        let d = self.rig.wait(root, &format!("{session} settled"), |v| {
            turn_of(v, session).is_some_and(|t| t["outcome"].is_string())
        });
        turn_of(&d, session).expect("the turn")["outcome"]
            .as_str()
            .expect("an outcome")
            .to_string()
    }

    /// Whether `session`'s last turn is still unsettled now.
    fn running(&self, root: &str, session: &str) -> bool {
        turn_of(&self.rig.d.detail(WS, root), session).is_some_and(|t| t["outcome"].is_null())
    }
}

/// "The real agent's subagents appear as child sessions with lanes": the delegation is a child
/// session of the root turn, linked to the delegation (`parentToolCallId` = the model's tool-use
/// id, with its card on the root turn), whose own text is recorded on its own turn; the child
/// completes and the root completes after it.
#[test]
fn claude_agent_acp_foreground_subagent_is_a_child_session_with_a_lane() {
    let c = Claude::start(
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
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "delegate please");
    assert_eq!(c.rig.settle(&id, &turn), "completed");
    let child = c.child(&id, "look around");
    let cid = child["id"].as_str().expect("child id");
    assert_eq!(child["parentAgentSessionId"], id.as_str());
    assert_eq!(child["parentTurnId"], turn.as_str());
    let call = child["parentToolCallId"]
        .as_str()
        .expect("a delegation link");
    assert!(
        call.starts_with("toolu_"),
        "the model's tool-use id: {call}"
    );
    assert!(
        c.rig
            .tool_call_rows()
            .iter()
            .any(|t| t["toolCallId"] == call && t["turnId"] == turn.as_str()),
        "the lane hangs on a delegation card of the root turn"
    );
    assert_eq!(c.outcome(&id, cid), "completed");
    let texts: Vec<String> = c
        .rig
        .messages(cid)
        .iter()
        .filter(|m| m["role"] == "assistant")
        .filter_map(|m| m["text"].as_str().map(String::from))
        .collect();
    assert!(texts.iter().any(|t| t == "Child one done."), "{texts:?}");
}

/// Two parallel subagents finishing apart: the root turn stays open while the slow one works
/// after the fast one completed, and settles once both did.
#[test]
fn claude_agent_acp_parallel_subagents_keep_the_root_open_until_both_finish() {
    let gate = Gate::new();
    let c = Claude::start(
        mm::Script::new()
            .on(
                "fast",
                mm::Match::subagent().first_user_contains("CHILD-FAST"),
                mm::Reply::text("Fast child done."),
            )
            .on(
                "slow",
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
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "delegate twice");
    let fast = c.child(&id, "fast one");
    let slow = c.child(&id, "slow one");
    let (fast, slow) = (
        fast["id"].as_str().expect("id").to_string(),
        slow["id"].as_str().expect("id").to_string(),
    );
    assert_eq!(c.outcome(&id, &fast), "completed");
    assert!(c.running(&id, &slow), "the slow child still works");
    assert!(c.running(&id, &id), "the root turn waits for it");
    gate.open();
    assert_eq!(c.rig.settle(&id, &turn), "completed");
    assert_eq!(c.outcome(&id, &slow), "completed");
}

/// A background subagent (`run_in_background`): the root turn waits while it works, the child
/// settles, and then the root does. The agent's own follow-up (its reply to the background
/// task's notification) is recorded on the root turn when the agent writes it before its answer
/// to the prompt, which it usually does (it holds the prompt for the subagents it spawned and
/// answers at the follow-up's end); when its hold ends first (at an `idle` of the CLI between
/// the subagent's end and the follow-up, the agent's own timing), the follow-up is a late
/// notification and is attached to no turn ("A late notification after the prompt result must
/// not be attached to a recently settled root turn"). The agent's stdout is recorded, so the
/// test knows which of the two orders it got.
#[test]
fn claude_agent_acp_background_subagent_keeps_the_root_waiting_until_it_settles() {
    let gate = Gate::new();
    let wire_dir = tempfile::tempdir().expect("temp dir for the wire");
    let wire = wire_dir.path().join("agent-stdout.jsonl");
    let c = Claude::start_recording(
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
        &wire,
    );
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "delegate in the background");
    let child = c.child(&id, "in the background");
    let cid = child["id"].as_str().expect("id").to_string();
    c.rig.wait(&id, "the root's text", |_| {
        c.rig
            .assistant_texts(&id, &turn)
            .iter()
            .any(|t| t.contains("Started it"))
    });
    assert!(
        c.running(&id, &id),
        "the root turn waits for the background child"
    );
    gate.open();
    assert_eq!(c.rig.settle(&id, &turn), "completed");
    assert_eq!(c.outcome(&id, &cid), "completed");
    const FOLLOW_UP: &str = "The background child reported.";
    let order = wire_order(&wire, FOLLOW_UP);
    eprintln!("the agent's order: {order:?}");
    match order {
        WireOrder::FollowUpFirst => assert!(
            c.rig
                .assistant_texts(&id, &turn)
                .iter()
                .any(|t| t.contains(FOLLOW_UP)),
            "the agent's follow-up, written before its answer to the prompt, belongs to the root \
             turn"
        ),
        WireOrder::AnswerFirst => {
            let on_turns: Vec<Value> = [&id, &cid]
                .into_iter()
                .flat_map(|s| c.rig.messages(s))
                .filter(|m| m["text"].as_str().is_some_and(|t| t.contains(FOLLOW_UP)))
                .collect();
            assert!(
                on_turns.is_empty(),
                "a follow-up written after the prompt's answer is attached to no turn: \
                 {on_turns:#?}"
            );
            let d = c.rig.d.detail(WS, &id);
            assert_eq!(
                turn_of(&d, &id).expect("the root's turn")["id"],
                turn.as_str(),
                "no turn is made up for the late follow-up"
            );
        }
    }
}

/// Which the agent wrote first: the chunk with the follow-up's text, or its answer to the prompt
/// (the response carrying a `stopReason`; the test sends one prompt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WireOrder {
    FollowUpFirst,
    AnswerFirst,
}

/// Reads the agent's recorded stdout (see [`Claude::start_recording`]), waiting until both the
/// follow-up chunk and the prompt's answer are in it.
fn wire_order(wire: &std::path::Path, follow_up: &str) -> WireOrder {
    let deadline = Instant::now() + WAIT;
    loop {
        let text = std::fs::read_to_string(wire).unwrap_or_default();
        let lines: Vec<Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let chunk = lines.iter().position(|m| {
            m["method"] == "session/update"
                && m["params"]["update"]["sessionUpdate"] == "agent_message_chunk"
                && m["params"]["update"]["content"]["text"]
                    .as_str()
                    .is_some_and(|t| t.contains(follow_up))
        });
        let answer = lines
            .iter()
            .position(|m| m["result"]["stopReason"].is_string());
        match (chunk, answer) {
            (Some(c), Some(a)) => {
                return if c < a {
                    WireOrder::FollowUpFirst
                } else {
                    WireOrder::AnswerFirst
                }
            }
            _ if Instant::now() > deadline => {
                panic!("the agent's wire lacks the follow-up ({chunk:?}) or the prompt's answer ({answer:?}):\n{text}")
            }
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// A permission inside a subagent is an interaction of the child's turn; answering it on that
/// exact child tuple lets the child write and complete.
#[test]
fn claude_agent_acp_permission_inside_a_subagent_is_answered_on_the_child_turn() {
    let c = Claude::start(mm::Script::new());
    let file = c.rig.work.path().join("child.txt");
    c.mock.set_script(
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
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "delegate a write");
    let child = c.child(&id, "write a file");
    let cid = child["id"].as_str().expect("id").to_string();
    let pending = c.rig.next_pending(&id, &[]);
    assert_eq!(pending["agentSessionId"], cid.as_str(), "{pending:#}");
    assert_eq!(pending["turnId"], child["lastTurnId"], "{pending:#}");
    c.rig.answer(&pending, json!("allow"));
    assert_eq!(c.rig.settle(&id, &turn), "completed");
    assert_eq!(c.outcome(&id, &cid), "completed");
    assert_eq!(
        std::fs::read_to_string(&file).ok().as_deref(),
        Some("from the child")
    );
}

/// Child-only cancel: `session/cancel` of that subagent; it settles canceled and the root goes
/// on to complete.
#[test]
fn claude_agent_acp_child_only_cancel_cancels_the_subagent_and_the_root_goes_on() {
    let c = Claude::start(
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
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "delegate something long");
    let child = c.child(&id, "hang");
    let cid = child["id"].as_str().expect("id").to_string();
    wait_model(
        "the child's model request",
        || {
            c.mock
                .message_requests()
                .into_iter()
                .find(|q| q.first_user_text().contains("CHILD-HANG"))
        },
        || c.mock.describe_requests(),
    );
    c.rig
        .cancel(&cid, child["lastTurnId"].as_str().expect("turn"));
    assert_eq!(c.outcome(&id, &cid), "canceled");
    assert_eq!(c.rig.settle(&id, &turn), "completed");
}

/// Whole-tree cancel with a background subagent: the agent keeps background subagents running
/// after a parent cancel, so tutti cancels the child too; the child's own `idle`/`cancelled`
/// confirms it (canceled, not the interrupted timeout), the root settles canceled, and the
/// agent's follow-up after the cancel is not recorded on the canceled root.
#[test]
fn claude_agent_acp_whole_tree_cancel_ends_the_background_subagent() {
    let c = Claude::start(
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
            .on(
                "notified",
                mm::Match::root().text_contains("task-notification"),
                mm::Reply::text("AFTER-CANCEL follow-up."),
            )
            .fallback(mm::Reply::text("Started it in the background.")),
    );
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "delegate in the background");
    let child = c.child(&id, "hang in bg");
    let cid = child["id"].as_str().expect("id").to_string();
    wait_model(
        "the child's model request",
        || {
            c.mock
                .message_requests()
                .into_iter()
                .find(|q| q.first_user_text().contains("CHILD-BG-HANG"))
        },
        || c.mock.describe_requests(),
    );
    c.rig.cancel(&id, &turn);
    assert_eq!(c.rig.settle(&id, &turn), "canceled");
    assert_eq!(
        c.outcome(&id, &cid),
        "canceled",
        "the agent confirmed the child's cancel"
    );
    // The agent's own follow-up after the cancel (it reaches the model) stays off the
    // canceled root turn.
    wait_model(
        "the agent's follow-up",
        || {
            c.mock
                .message_requests()
                .into_iter()
                .find(|q| !q.is_subagent() && q.all_text().contains("task-notification"))
        },
        || c.mock.describe_requests(),
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        !c.rig
            .assistant_texts(&id, &turn)
            .iter()
            .any(|t| t.contains("AFTER-CANCEL")),
        "nothing resurrects the canceled root"
    );
}

/// A subagent delegating to its own subagent: the grandchild is a child of the child session's
/// turn, in the same tree.
#[test]
fn claude_agent_acp_nested_subagent_is_a_grandchild_session() {
    let c = Claude::start(
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
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "delegate nested");
    assert_eq!(c.rig.settle(&id, &turn), "completed");
    let child = c.child(&id, "nest");
    let grand = c.child(&id, "deeper");
    assert_eq!(grand["parentAgentSessionId"], child["id"]);
    assert_eq!(grand["parentTurnId"], child["lastTurnId"]);
    assert_eq!(grand["rootAgentSessionId"], id.as_str());
    assert_eq!(
        c.outcome(&id, grand["id"].as_str().expect("id")),
        "completed"
    );
}

/// Relaunch: after the agent process is gone, the next submit loads the ACP session; the agent
/// replays the subagent it ran (same child id) and reports it idle once more, which binds to the
/// recorded child session: no duplicate child, nothing reopened, and the second turn completes
/// with the earlier conversation.
#[test]
fn claude_agent_acp_relaunch_binds_the_restored_subagent_to_its_recorded_child() {
    let c = Claude::start(
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
    let id = c.rig.create();
    let (_, first) = c.rig.submit(&id, "remember the word PAPAYA");
    assert_eq!(c.rig.settle(&id, &first), "completed");
    let child = c.child(&id, "remember");
    c.rig.wait_agent_transcript(&["PAPAYA", "Noted."]);
    let acp_session = c.rig.provider_session_id(&id);
    c.rig.kill_agent_group();
    // The daemon noticed the exit before the next submit (a submit racing the kill would go
    // to the dying process and be interrupted, which `killed_mid_turn...` covers).
    procs::poll(WAIT.as_secs(), || {
        let r = ureq::get(&format!("http://{}/metrics", c.rig.d.addr))
            .set("authorization", &format!("Bearer {}", c.rig.d.token))
            .call()
            .ok()?;
        let text = r.into_string().ok()?;
        text.lines()
            .any(|l| l.starts_with("tutti_provider_process_exits") && !l.ends_with(" 0"))
            .then_some(())
    })
    .expect("the daemon notices the agent's exit");
    let (reply, second) = c.rig.submit(&id, "third question");
    assert_eq!(reply, "started");
    assert_eq!(c.rig.settle(&id, &second), "completed");
    assert!(
        c.request_carries("third question", "PAPAYA"),
        "the loaded session carries the earlier history"
    );
    assert_eq!(
        c.rig.provider_session_id(&id),
        acp_session,
        "session/load, not a new one"
    );
    let d = c.rig.d.detail(WS, &id);
    let kids = children(&d);
    assert_eq!(kids.len(), 1, "no duplicate child: {d:#}");
    assert_eq!(kids[0]["id"], child["id"]);
    assert_eq!(
        kids[0]["lastTurnId"], child["lastTurnId"],
        "nothing reopened"
    );
    assert_eq!(
        turn_of(&d, kids[0]["id"].as_str().expect("id")).expect("turn")["outcome"],
        "completed"
    );
}

// ---- codex-acp ------------------------------------------------------------------------------

/// codex-acp against the scripted Responses server. Fields drop in order: the daemon first, the
/// model server, then its runtime.
struct Codex {
    rig: Rig,
    mock: MockResponses,
    _rt: tokio::runtime::Runtime,
}

impl Codex {
    fn start(script: mr::MockResponsesBuilder, approval_policy: &str) -> Codex {
        let bin = ensure_codex_acp()
            .unwrap_or_else(|e| panic!("these tests need the real codex-acp: {e}"));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime for the model server");
        let mock = rt
            .block_on(script.start())
            .expect("start the scripted Responses server");
        let home = tempfile::tempdir().expect("temp CODEX_HOME");
        let work = tempfile::tempdir().expect("temp work dir");
        CodexConfig::new(mock.base_url())
            .approval_policy(approval_policy)
            .write(home.path())
            .expect("write config.toml");
        let env = vec![
            (
                "CODEX_HOME".to_string(),
                home.path().to_string_lossy().to_string(),
            ),
            (
                "HOME".to_string(),
                home.path().to_string_lossy().to_string(),
            ),
        ];
        let command = vec![bin.to_string_lossy().to_string()];
        let rig = Rig::start(&provider_toml(&command, &env), home, work);
        Codex { rig, mock, _rt: rt }
    }

    /// Waits until the server recorded a request whose last user text contains `needle`.
    fn wait_request(&self, needle: &str) -> mr::RecordedRequest {
        wait_model(
            &format!("a model request with {needle:?}"),
            || {
                self.mock
                    .requests()
                    .into_iter()
                    .find(|r| r.last_user_text().is_some_and(|t| t.contains(needle)))
            },
            || self.mock.describe_requests(),
        )
    }
}

impl Codex {
    /// The model answers "Noted." and hangs on "second question".
    fn hanging_on_the_second_question() -> Codex {
        Codex::start(
            MockResponses::builder()
                .on(
                    mr::Match::root().last_user_text_contains("second question"),
                    mr::Reply::hang(),
                )
                .on(mr::Match::any(), mr::Reply::text("Noted.")),
            "never",
        )
    }
}

impl UnderTest for Codex {
    fn rig(&self) -> &Rig {
        &self.rig
    }
    fn request_carries(&self, needle: &str, history: &str) -> bool {
        self.wait_request(needle).input_contains(history)
    }
    fn requests(&self) -> String {
        self.mock.describe_requests()
    }
}

#[test]
fn codex_acp_plain_prompt_completes_with_the_text_recorded() {
    let c = Codex::start(
        MockResponses::builder().on(
            mr::Match::any(),
            mr::Reply::text("Hello from the scripted model."),
        ),
        "never",
    );
    let id = c.rig.create();
    let (reply, turn) = c.rig.submit(&id, "hi there");
    assert_eq!(reply, "started");
    assert_eq!(c.rig.settle(&id, &turn), "completed");
    let texts = c.rig.assistant_texts(&id, &turn);
    assert!(
        texts
            .iter()
            .any(|t| t.contains("Hello from the scripted model.")),
        "the agent's text is recorded on the turn: {texts:?}"
    );
    assert!(c.rig.provider_session_id(&id).is_some());
}

/// codex remembers an "approved for session" command and would not ask again for the same
/// command: the second identical escalated command asking again proves `"allow"` allowed once.
#[test]
fn codex_acp_permission_allow_is_once_and_the_next_use_asks_again() {
    let cmd = "echo tutti-allow-once";
    let c = Codex::start(
        MockResponses::builder()
            .on(
                mr::Match::root().tool_outputs(0),
                mr::Reply::exec_command_escalated(cmd, "needs the network"),
            )
            .on(
                mr::Match::root().tool_outputs(1),
                mr::Reply::exec_command_escalated(cmd, "needs the network"),
            )
            .on(mr::Match::any(), mr::Reply::text("Ran it twice.")),
        "on-request",
    );
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "run it twice");
    let first = c.rig.next_pending(&id, &[]);
    let kinds: Vec<&str> = first["payload"]["options"]
        .as_array()
        .expect("ACP permission options")
        .iter()
        .filter_map(|o| o["kind"].as_str())
        .collect();
    assert!(
        kinds.contains(&"allow_once") && kinds.contains(&"allow_always"),
        "{first:#}"
    );
    c.rig.answer(&first, json!("allow"));
    let second = c.rig.next_pending(
        &id,
        &[first["requestId"].as_str().unwrap_or("").to_string()],
    );
    c.rig.answer(&second, json!("allow"));
    assert_eq!(c.rig.settle(&id, &turn), "completed");
    let outputs = c
        .mock
        .requests()
        .iter()
        .map(|r| r.tool_outputs())
        .max()
        .unwrap_or(0);
    assert_eq!(
        outputs,
        2,
        "both commands ran: {}",
        c.mock.describe_requests()
    );
}

/// codex-acp reports nothing between a streamed text delta and the end of the model's reply, so
/// the cancel happens at the next thing a test can observe: the reply's text, then a command
/// waiting for approval. The cancel settles the turn canceled with the text kept and the
/// command's tool call (known only from the permission request) closed as `interrupted`, and
/// the agent answers the next prompt.
#[test]
fn codex_acp_cancel_mid_turn_keeps_the_text_and_the_agent_answers_again() {
    let c = Codex::start(
        MockResponses::builder()
            .once(
                mr::Match::root().last_user_text_contains("look around"),
                mr::Reply::items(vec![
                    mr::OutputItem::text("Working on it..."),
                    mr::OutputItem::call(
                        None,
                        "exec_command",
                        json!({"cmd": "echo later", "sandbox_permissions": "require_escalated",
                               "justification": "needs the network"}),
                    ),
                ]),
            )
            .on(mr::Match::any(), mr::Reply::text("Back again.")),
        "on-request",
    );
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "look around");
    let asked = c.rig.next_pending(&id, &[]);
    c.rig.cancel(&id, &turn);
    assert_eq!(c.rig.settle(&id, &turn), "canceled");
    let texts = c.rig.assistant_texts(&id, &turn);
    assert!(
        texts.iter().any(|t| t.contains("Working on it...")),
        "the text streamed before the cancel is kept: {texts:?}"
    );
    // codex-acp announces the command only inside its permission request: the call is recorded
    // from it and closed as `interrupted` when the canceled turn settles.
    let call = asked["payload"]["toolCall"]["toolCallId"].clone();
    assert!(call.is_string(), "{asked:#}");
    let rows = c.rig.tool_call_rows();
    let last = rows
        .iter()
        .rfind(|t| t["toolCallId"] == call)
        .unwrap_or_else(|| panic!("the asked-for tool call is recorded: {rows:#?}"));
    assert_eq!(last["status"], "interrupted", "{rows:#?}");
    assert_eq!(last["turnId"], turn.as_str());
    let (reply, next) = c.rig.submit(&id, "and now?");
    assert_eq!(reply, "started");
    assert_eq!(c.rig.settle(&id, &next), "completed");
    assert!(c
        .rig
        .assistant_texts(&id, &next)
        .iter()
        .any(|t| t.contains("Back again.")));
}

#[test]
fn codex_acp_guidance_during_a_turn_joins_it_and_reaches_the_model() {
    let gate = Gate::new();
    let c = Codex::start(
        MockResponses::builder()
            .once(
                mr::Match::root().last_user_text_contains("start the work"),
                mr::Reply::text("First answer.").until(&gate),
            )
            .on(mr::Match::any(), mr::Reply::text("Guided answer.")),
        "never",
    );
    guidance_joins_the_running_turn(&c, &gate);
}

#[test]
fn codex_acp_spawn_agent_tool_creates_no_child_session() {
    let c = Codex::start(
        MockResponses::builder()
            .on(mr::Match::child(), mr::Reply::text("Child result."))
            .once(
                mr::Match::root().has_tool(MULTI_AGENT_V1).tool_outputs(0),
                mr::Reply::spawn_agent("SUBTASK-PROMPT find it"),
            )
            .on(mr::Match::any(), mr::Reply::text("Delegated and done.")),
        "never",
    );
    let id = c.rig.create();
    let (_, turn) = c.rig.submit(&id, "delegate please");
    assert_eq!(c.rig.settle(&id, &turn), "completed");
    wait_model(
        "the spawned agent's model request",
        || c.mock.requests().into_iter().find(|r| r.is_child()),
        || c.mock.describe_requests(),
    );
    let detail = c.rig.d.detail(WS, &id);
    assert!(children(&detail).is_empty(), "no child session: {detail:#}");
}

#[test]
fn codex_acp_that_lost_its_session_continues_in_a_new_acp_session_recorded_on_the_root() {
    let c = Codex::hanging_on_the_second_question();
    a_lost_agent_session_continues_in_a_new_acp_session(&c);
}

#[test]
fn codex_acp_killed_mid_turn_is_interrupted_and_the_next_submit_continues_the_conversation() {
    let c = Codex::hanging_on_the_second_question();
    killed_mid_turn_then_the_conversation_continues(&c);
}

#[test]
fn codex_acp_daemon_sigterm_leaves_no_process_behind() {
    let mut c = Codex::start(
        MockResponses::builder().on(mr::Match::any(), mr::Reply::hang()),
        "never",
    );
    let id = c.rig.create();
    c.rig.submit(&id, "keep going");
    c.wait_request("keep going");
    sigterm_leaves_nothing(&mut c.rig, 1);
}
