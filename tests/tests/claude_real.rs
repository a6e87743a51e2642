//! End-to-end through the HTTP API of a real `tuttid` process with a `kind = "claude"` provider:
//! the project's Node sidecar relaying the real, pinned `@anthropic-ai/claude-agent-sdk` (and its
//! native Claude Code binary), run offline against the scripted Messages-API server
//! ([`MockMessages`]) on 127.0.0.1.
//!
//! The sidecar is installed on first use (`npm ci` into `<workspace>/.providers/claude-sidecar`);
//! an install failure FAILS these tests, it never skips them.
//!
//! Covered (spec "Claude Code SDK Mapping", "Cancellation", "Root Turn Lifecycle"):
//! (a) a background child outlives the root result: the root waits, the SDK's automatic
//!     follow-up is another root provider turn (`synthetic-*`) on the same canonical root turn;
//! (b) two concurrent background children, each bound to its own SDK task;
//! (c) a child permission (`canUseTool` with `agentID`) owned by the child session/turn and
//!     answered through the HTTP API;
//! (d) a child-only cancel (`stopTask`): the child is canceled, the root settles from its own
//!     outcome;
//! (e) a root cancel with running children, while the root waits or while its provider turn
//!     still runs (the late provider terminal is recorded without reopening anything);
//! (f) the notification continuation boundary (`continuationTimeoutMs`) expiring;
//! and `Adapter::on_dropped`: a root permission asked after the root settled is denied, so the
//! SDK query goes on.
//!
//! Every test records the daemon's outbox through `GET /v1/events` (SSE) from sequence 0, so
//! transient states (a root turn `waiting` on a child, two children running at once) and "nothing
//! happened later" are asserted on the durable history rather than on lucky polling. Waits poll
//! with deadlines; no fixed sleep decides an outcome.
//!
//! Diagnostics on failure: the session detail, the recorded model requests, the outbox history
//! (turn phases) and the tail of the sidecar's stderr (ids and lengths only). Set `TUTTI_LOG`
//! (e.g. `debug`) to see the daemon's logs.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tutti_tests::claude_client::{offline_options, OfflineDirs};
use tutti_tests::claude_install::ensure_claude_sidecar;
use tutti_tests::daemon::{children, turn_of, TestDaemon};
use tutti_tests::mock_messages::{Block, Match, MockMessages, Reply, Role, Script};

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const WS: &str = "w1";
/// Deadline of one wait (each test stays well under ~40 s).
const WAIT: u64 = 45;

/// The real SDK is heavy (a Node process and the native CLI per test): on a 2-core machine the
/// tests run one at a time so each one's timings stay realistic.
static SERIAL: Mutex<()> = Mutex::new(());

// ----- harness ---------------------------------------------------------------------------------

/// The outbox rows of one daemon, read continuously from `GET /v1/events?after=0`.
#[derive(Clone, Default)]
struct Feed(Arc<Mutex<Vec<Value>>>);

impl Feed {
    fn start(d: &TestDaemon) -> Feed {
        let feed = Feed::default();
        let rows = feed.0.clone();
        let url = format!("http://{}/v1/events?after=0", d.addr);
        let auth = format!("Bearer {}", d.token);
        std::thread::spawn(move || {
            let Ok(resp) = ureq::get(&url)
                .set("authorization", &auth)
                .timeout(Duration::from_secs(600))
                .call()
            else {
                return;
            };
            for line in BufReader::new(resp.into_reader()).lines() {
                let Ok(line) = line else { return };
                if let Some(data) = line.strip_prefix("data:") {
                    if let Ok(v) = serde_json::from_str::<Value>(data.trim()) {
                        rows.lock().unwrap_or_else(|e| e.into_inner()).push(v);
                    }
                }
            }
        });
        feed
    }

    fn rows(&self) -> Vec<Value> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn last_seq(&self) -> u64 {
        self.rows()
            .last()
            .and_then(|r| r["seq"].as_u64())
            .unwrap_or(0)
    }
}

/// A daemon with a `claude` provider, the mock Messages API it talks to, and the outbox feed.
/// Fields drop in order: the daemon (and with it the sidecar) goes first.
struct Rig {
    d: TestDaemon,
    feed: Feed,
    mock: MockMessages,
    /// Taken right after the mock started: `RecordedRequest::at` is relative to (about) this.
    mock_started: Instant,
    dirs: OfflineDirs,
    log: PathBuf,
    _log_dir: tempfile::TempDir,
    started: Instant,
    /// Held for the test's whole life (dropped last).
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// A JSON value as a TOML value (inline tables and arrays; JSON strings are valid TOML basic
/// strings). `null` has no TOML form and is refused.
fn toml_value(v: &Value) -> String {
    match v {
        Value::Null => panic!("no TOML form for null"),
        Value::Bool(_) | Value::Number(_) | Value::String(_) => v.to_string(),
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(toml_value).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(o) => format!(
            "{{ {} }}",
            o.iter()
                .map(|(k, x)| format!("{} = {}", Value::String(k.clone()), toml_value(x)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

impl Rig {
    /// Installs the sidecar if needed (a failure fails the test), starts the mock with `script`
    /// and a daemon whose provider `claude` runs `node sidecar.mjs` with the offline query
    /// options; `continuation_timeout_ms` overrides the 30 s notification boundary.
    fn start(script: Script, continuation_timeout_ms: Option<u64>) -> Rig {
        Rig::start_with(script, continuation_timeout_ms, None)
    }

    /// [`Rig::start`] with the daemon's `idle_timeout_secs`; with it set, the SDK persists its
    /// sessions (`persistSession: true`, in the temp `HOME`) so that a relaunch can resume.
    fn start_with(
        script: Script,
        continuation_timeout_ms: Option<u64>,
        idle_timeout_secs: Option<u64>,
    ) -> Rig {
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let sidecar = ensure_claude_sidecar().unwrap_or_else(|e| {
            panic!(
                "the Claude sidecar (the pinned @anthropic-ai/claude-agent-sdk) must be installable \
                 for these end-to-end tests; they never skip: {e}"
            )
        });
        let mock = MockMessages::start(script).expect("the mock Messages API starts");
        let mock_started = Instant::now();
        let dirs = OfflineDirs::new().expect("temp HOME and cwd");
        let log_dir = tempfile::Builder::new()
            .prefix("tutti-claude-e2e-")
            .tempdir()
            .expect("temp dir");
        let log = log_dir.path().join("sidecar.log");
        // `options.query` is passed to the SDK's query() as given: cwd, model, the offline env
        // (HOME, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY=dummy, the DISABLE_* switches, NO_PROXY,
        // PATH), settingSources [], persistSession false, permissionMode "default".
        let mut query = offline_options(dirs.cwd.path(), dirs.home.path(), &mock.base_url());
        if idle_timeout_secs.is_some() {
            query["persistSession"] = json!(true);
        }
        let mut options = json!({ "query": query });
        if let Some(ms) = continuation_timeout_ms {
            options["continuationTimeoutMs"] = json!(ms);
        }
        // The sidecar's stderr (ids and lengths only) goes to a log shown on failure.
        let command = json!([
            "/bin/sh",
            "-c",
            "exec node \"$0\" 2>>\"$1\"",
            sidecar.to_string_lossy(),
            log.to_string_lossy(),
        ]);
        let idle = idle_timeout_secs
            .map(|s| format!("idle_timeout_secs = {s}\n"))
            .unwrap_or_default();
        let config = format!(
            "{idle}cancel_timeout_ms = 5000\n\n[providers.claude]\nkind = \"claude\"\ncommand = {}\n\
             env = {{ TUTTI_SIDECAR_TRACE = \"1\" }}\noptions = {}\n",
            toml_value(&command),
            toml_value(&options),
        );
        let level = std::env::var("TUTTI_LOG").unwrap_or_else(|_| "warn".into());
        let d = TestDaemon::start(EXE, Some(&config), &[("TUTTI_LOG", &level)]);
        let feed = Feed::start(&d);
        Rig {
            mock,
            mock_started,
            dirs,
            d,
            feed,
            log,
            _log_dir: log_dir,
            started: Instant::now(),
            _serial: serial,
        }
    }

    fn create(&self) -> String {
        self.d.create(WS, "claude")
    }

    fn submit(&self, id: &str, text: &str) -> (String, String) {
        self.d.submit(WS, id, text)
    }

    fn detail(&self, id: &str) -> Value {
        self.d.detail(WS, id)
    }

    fn messages(&self, session: &str) -> Vec<Value> {
        let (st, v) = self.d.call(
            "GET",
            &format!("/v1/workspaces/{WS}/agent-sessions/{session}/messages?limit=1000"),
            None,
        );
        assert_eq!(st, 200, "messages: {v}");
        v["messages"].as_array().cloned().unwrap_or_default()
    }

    fn cancel(&self, session: &str, turn: &str) -> Value {
        let (st, v) = self.d.call(
            "POST",
            &format!("/v1/workspaces/{WS}/agent-sessions/{session}/turns/{turn}/cancel"),
            Some(json!({})),
        );
        assert_eq!(st, 202, "cancel {session}/{turn}: {v}");
        v
    }

    /// The sidecar's stderr lines so far (ids, lengths and message shapes only).
    fn sidecar_log(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }

    /// Everything useful for a failure message.
    fn diagnostics(&self, id: &str) -> String {
        let lines = self.sidecar_log();
        let tail = lines[lines.len().saturating_sub(80)..].join("\n  ");
        format!(
            "after {:?}\ndetail: {:#}\nturn history: {}\nmodel requests: {}\nsidecar stderr (tail):\n  {tail}",
            self.started.elapsed(),
            self.detail(id),
            self.turn_history().join(" | "),
            self.mock.describe_requests(),
        )
    }

    /// Polls the session detail until `pred` holds; fails with the diagnostics after `WAIT`.
    fn wait(&self, id: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let d = self.detail(id);
            if pred(&d) {
                return d;
            }
            if start.elapsed() > Duration::from_secs(WAIT) {
                panic!("timed out waiting for {what}\n{}", self.diagnostics(id));
            }
            std::thread::sleep(Duration::from_millis(30));
        }
    }

    /// Waits until the outbox feed has caught up with `detail`: for every turn in it, the feed's
    /// latest version of that turn shows the same phase and outcome. Returns the turn rows.
    fn synced(&self, id: &str, detail: &Value) -> Vec<Value> {
        let start = Instant::now();
        loop {
            let rows = self.turn_rows();
            let caught_up = detail["turns"].as_array().into_iter().flatten().all(|t| {
                rows.iter()
                    .rfind(|r| r["id"] == t["id"])
                    .is_some_and(|r| r["phase"] == t["phase"] && r["outcome"] == t["outcome"])
            });
            if caught_up {
                return rows;
            }
            if start.elapsed() > Duration::from_secs(WAIT) {
                panic!(
                    "the event feed never caught up with the detail\n{}",
                    self.diagnostics(id)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Every published version of every turn, in outbox order.
    fn turn_rows(&self) -> Vec<Value> {
        self.feed
            .rows()
            .into_iter()
            .filter(|r| r["kind"] == "turn")
            .map(|r| r["payload"].clone())
            .collect()
    }

    /// Short labels of the turn history (`turn-id:phase[/outcome][ rpt=phase:id]`).
    fn turn_history(&self) -> Vec<String> {
        self.turn_rows()
            .iter()
            .map(|t| {
                let mut s = format!(
                    "{}:{}",
                    t["id"].as_str().unwrap_or("?"),
                    t["phase"].as_str().unwrap_or("?")
                );
                if let Some(o) = t["outcome"].as_str() {
                    s.push_str(&format!("/{o}"));
                }
                if let Some(r) = t.get("rootProviderTurn") {
                    s.push_str(&format!(
                        " rpt={}:{}",
                        r["phase"].as_str().unwrap_or("?"),
                        r["providerTurnId"].as_str().unwrap_or("-")
                    ));
                }
                s
            })
            .collect()
    }

    /// Replays the turn history and returns the first state (turn id -> latest version) for
    /// which `pred` holds.
    fn first_state(
        &self,
        pred: impl Fn(&std::collections::BTreeMap<String, Value>) -> bool,
    ) -> Option<std::collections::BTreeMap<String, Value>> {
        let mut state = std::collections::BTreeMap::new();
        for t in self.turn_rows() {
            state.insert(t["id"].as_str().unwrap_or("").to_string(), t);
            if pred(&state) {
                return Some(state);
            }
        }
        None
    }
}

fn phase(d: &Value, session: &str) -> String {
    turn_of(d, session)
        .and_then(|t| t["phase"].as_str().map(String::from))
        .unwrap_or_default()
}

fn outcome(d: &Value, session: &str) -> Option<String> {
    turn_of(d, session).and_then(|t| t["outcome"].as_str().map(String::from))
}

fn settled(d: &Value, session: &str) -> bool {
    outcome(d, session).is_some()
}

fn active(t: &Value) -> bool {
    matches!(
        t["phase"].as_str(),
        Some("submitted" | "running" | "waiting" | "settling")
    )
}

fn child_ids(d: &Value) -> Vec<String> {
    children(d)
        .iter()
        .filter_map(|c| c["id"].as_str().map(String::from))
        .collect()
}

/// The child turn ids of a detail (each child's last turn).
fn child_turn(d: &Value, child: &str) -> String {
    turn_of(d, child)
        .and_then(|t| t["id"].as_str().map(String::from))
        .unwrap_or_else(|| panic!("no turn for child {child}: {d:#}"))
}

fn texts(msgs: &[Value]) -> Vec<String> {
    msgs.iter()
        .filter_map(|m| m["text"].as_str().map(String::from))
        .collect()
}

/// The root-side rules shared by the background tests: the spawn reply for the first request
/// whose prompt contains `marker`, then `launched` once the Agent result is in, then
/// `followup` for every request that carries a `<task-notification>`.
fn background_root(script: Script, marker: &str, spawn: Reply) -> Script {
    script
        .on(
            "root-followup",
            Match::root().text_contains("<task-notification>"),
            Reply::text("ROOT_FOLLOWUP: the children reported back"),
        )
        .on(
            "root-launched",
            Match::root().min_tool_results(1),
            Reply::text("ROOT_LAUNCHED: delegated"),
        )
        .on(
            "root-spawn",
            Match::root().first_user_contains(marker),
            spawn,
        )
}

fn agent_block(description: &str, prompt: &str) -> Block {
    Block::ToolUse {
        id: String::new(),
        name: "Agent".into(),
        input: json!({
            "description": description,
            "prompt": prompt,
            "subagent_type": "general-purpose",
            "run_in_background": true,
        }),
    }
}

// ----- (a) a background child outlives the root result ------------------------------------------

#[test]
fn background_child_outlives_the_root_result_and_the_follow_up_stays_in_the_same_root_turn() {
    let rig = Rig::start(
        background_root(
            Script::new().on(
                "child",
                Match::subagent(),
                Reply::text("CHILD_A: background work finished").after(Duration::from_secs(3)),
            ),
            "SPAWN_BG",
            Reply::agent(
                "Background child",
                "CHILD_TASK: work in the background",
                Some("general-purpose"),
                true,
            ),
        ),
        None,
    );
    let id = rig.create();
    let (reply, turn) = rig.submit(&id, "SPAWN_BG: delegate in the background");
    assert_eq!(reply, "started");

    // The root provider turn completed while the child still runs: the root waits.
    let seen = rig.wait(&id, "the root waiting on its running child", |v| {
        let root = turn_of(v, &id);
        root.is_some_and(|t| {
            t["phase"] == "waiting" && t["rootProviderTurn"]["phase"] == "completed"
        }) && child_ids(v)
            .iter()
            .any(|c| turn_of(v, c).is_some_and(active))
    });
    let kids = child_ids(&seen);
    assert_eq!(kids.len(), 1, "{seen:#}");
    let child = kids[0].clone();
    let root_then = turn_of(&seen, &id).unwrap().clone();
    assert_eq!(root_then["id"], turn.as_str());
    assert_eq!(
        root_then["rootProviderTurn"]["retainedOutcome"],
        "completed"
    );

    let end = rig.wait(&id, "the root settled", |v| settled(v, &id));
    let diag = || rig.diagnostics(&id);
    assert_eq!(
        outcome(&end, &id).as_deref(),
        Some("completed"),
        "{}",
        diag()
    );
    assert_eq!(
        outcome(&end, &child).as_deref(),
        Some("completed"),
        "{}",
        diag()
    );
    // One canonical root turn: the automatic follow-up was another root *provider* turn on it.
    let root = turn_of(&end, &id).unwrap();
    assert_eq!(root["id"], turn.as_str());
    assert_eq!(end["session"]["lastTurnId"], turn.as_str());
    let pid = root["rootProviderTurn"]["providerTurnId"]
        .as_str()
        .unwrap_or_default();
    assert!(
        pid.starts_with("synthetic-"),
        "the follow-up: {pid}\n{}",
        diag()
    );
    let rows = rig.synced(&id, &end);
    let root_ids: std::collections::BTreeSet<&str> = rows
        .iter()
        .filter(|t| t["agentSessionId"] == id.as_str())
        .filter_map(|t| t["id"].as_str())
        .collect();
    assert_eq!(root_ids.len(), 1, "one root turn: {root_ids:?}");
    // The follow-up's text is on that same root turn; the child's text on the child turn.
    let msgs = rig.messages(&id);
    let follow = msgs
        .iter()
        .find(|m| {
            m["text"]
                .as_str()
                .is_some_and(|t| t.contains("ROOT_FOLLOWUP"))
        })
        .unwrap_or_else(|| panic!("no follow-up message: {msgs:#?}\n{}", diag()));
    assert_eq!(follow["turnId"], turn.as_str());
    assert!(texts(&rig.messages(&child))
        .iter()
        .any(|t| t.contains("CHILD_A")));
    // The root never settled before the child did, and never went back to active afterwards.
    let first_settled = rows
        .iter()
        .position(|t| t["id"] == turn.as_str() && !active(t))
        .unwrap();
    assert!(rows[first_settled..]
        .iter()
        .filter(|t| t["id"] == turn.as_str())
        .all(|t| !active(t)));
    let child_settled = rows
        .iter()
        .position(|t| t["agentSessionId"] == child.as_str() && !active(t))
        .unwrap();
    assert!(child_settled < first_settled);
    assert_eq!(end["session"].get("activeTurnId"), None);
    eprintln!("{}", rig.diagnostics(&id));
}

// ----- (b) two concurrent children ------------------------------------------------------------

#[test]
fn two_concurrent_background_children_each_keep_their_own_session_and_gate_the_root() {
    let rig = Rig::start(
        background_root(
            Script::new()
                .on(
                    "child-one",
                    Match::subagent().first_user_contains("CHILD_ONE_TASK"),
                    Reply::text("CHILD_ONE_DONE").after(Duration::from_millis(1500)),
                )
                .on(
                    "child-two",
                    Match::subagent().first_user_contains("CHILD_TWO_TASK"),
                    Reply::text("CHILD_TWO_DONE").after(Duration::from_millis(3500)),
                ),
            "SPAWN_TWO",
            Reply::blocks(vec![
                agent_block("First child", "CHILD_ONE_TASK: quick job"),
                agent_block("Second child", "CHILD_TWO_TASK: slower job"),
            ]),
        ),
        None,
    );
    let id = rig.create();
    let (_, turn) = rig.submit(&id, "SPAWN_TWO: delegate two jobs at once");
    let end = rig.wait(&id, "the root settled", |v| settled(v, &id));
    let diag = || rig.diagnostics(&id);
    assert_eq!(
        outcome(&end, &id).as_deref(),
        Some("completed"),
        "{}",
        diag()
    );
    let kids = children(&end);
    assert_eq!(kids.len(), 2, "{}", diag());

    // Both children ran at the same time, under the active root.
    rig.synced(&id, &end);
    let both = rig.first_state(|s| {
        let running = s
            .values()
            .filter(|t| t["agentSessionId"] != id.as_str() && active(t))
            .count();
        running == 2 && s.get(&turn).is_some_and(active)
    });
    assert!(
        both.is_some(),
        "never two active children at once\n{}",
        diag()
    );

    // Each child is bound to its own SDK task: its title, its agent id (the header of its own
    // model requests) and its own output; no cross-binding.
    let requests = rig.mock.message_requests();
    for (title, marker, mine, theirs) in [
        (
            "First child",
            "CHILD_ONE_TASK",
            "CHILD_ONE_DONE",
            "CHILD_TWO_DONE",
        ),
        (
            "Second child",
            "CHILD_TWO_TASK",
            "CHILD_TWO_DONE",
            "CHILD_ONE_DONE",
        ),
    ] {
        let c = kids
            .iter()
            .find(|c| c["title"] == title)
            .unwrap_or_else(|| panic!("no child titled {title}\n{}", diag()));
        let cid = c["id"].as_str().unwrap();
        assert_eq!(c["parentAgentSessionId"], id.as_str());
        assert_eq!(c["rootTurnId"], turn.as_str());
        assert_eq!(
            outcome(&end, cid).as_deref(),
            Some("completed"),
            "{}",
            diag()
        );
        let agent = c["providerAliases"]["agentId"]
            .as_str()
            .or(c["providerAliases"]["taskId"].as_str())
            .unwrap_or_else(|| panic!("{title} has no task/agent alias: {c:#}"));
        let own = requests
            .iter()
            .find(|r| r.role() == Role::Subagent && r.agent_id() == Some(agent))
            .unwrap_or_else(|| panic!("no model request of agent {agent}\n{}", diag()));
        assert!(
            own.first_user_text().contains(marker),
            "{title} bound to {agent}"
        );
        let t = texts(&rig.messages(cid));
        assert!(t.iter().any(|x| x.contains(mine)), "{title}: {t:?}");
        assert!(!t.iter().any(|x| x.contains(theirs)), "{title}: {t:?}");
    }
    assert_ne!(
        kids[0]["providerAliases"]["taskId"],
        kids[1]["providerAliases"]["taskId"]
    );
    // One canonical root turn, settled only after the last child, never reopened.
    let rows = rig.synced(&id, &end);
    assert!(rows
        .iter()
        .filter(|t| t["agentSessionId"] == id.as_str())
        .all(|t| t["id"] == turn.as_str()));
    let root_settled = rows
        .iter()
        .position(|t| t["id"] == turn.as_str() && !active(t))
        .unwrap();
    let last_child = rows
        .iter()
        .rposition(|t| t["agentSessionId"] != id.as_str() && !active(t))
        .unwrap();
    assert!(last_child < root_settled, "{}", diag());
    assert!(rows[root_settled..]
        .iter()
        .filter(|t| t["id"] == turn.as_str())
        .all(|t| !active(t)));
    eprintln!("{}", diag());
}

// ----- (c) a child permission answered through the API -----------------------------------------

#[test]
fn a_child_permission_is_owned_by_the_child_turn_and_answered_through_the_api() {
    // The Write goes to a file in the run's cwd: the script is set once that path is known.
    let rig = Rig::start(Script::new(), None);
    let target = rig.dirs.cwd.path().join("child-written.txt");
    rig.mock.set_script(
        Script::new()
            .on(
                "child-write",
                Match::subagent().tool_results(0),
                Reply::write_file(&target.to_string_lossy(), "written by the child\n"),
            )
            .on(
                "child-done",
                Match::subagent().min_tool_results(1),
                Reply::text("CHILD_WROTE: file written"),
            )
            .on(
                "root-final",
                Match::root().min_tool_results(1),
                Reply::text("ROOT_DONE: all done"),
            )
            .on(
                "root-spawn",
                Match::root().first_user_contains("SPAWN_WRITER"),
                Reply::agent(
                    "Writer child",
                    "CHILD_TASK: write a file",
                    Some("general-purpose"),
                    false,
                ),
            ),
    );
    let id = rig.create();
    let (_, turn) = rig.submit(&id, "SPAWN_WRITER: delegate a write");
    // The adapter emits the interaction, then the child's `waiting` (two engine steps).
    let v = rig.wait(&id, "a pending child interaction, its child waiting", |v| {
        v["interactions"]
            .as_array()
            .is_some_and(|a| a.iter().any(|i| i["status"] == "pending"))
            && child_ids(v)
                .iter()
                .any(|c| turn_of(v, c).is_some_and(|t| t["phase"] == "waiting"))
    });
    let diag = || rig.diagnostics(&id);
    let i = v["interactions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["status"] == "pending")
        .unwrap()
        .clone();
    let kids = child_ids(&v);
    assert_eq!(kids.len(), 1, "{}", diag());
    let child = kids[0].clone();
    let child_t = child_turn(&v, &child);
    // Canonical ownership: the exact child session and child turn, never the root.
    assert_eq!(i["agentSessionId"], child.as_str(), "{i:#}");
    assert_eq!(i["turnId"], child_t.as_str(), "{i:#}");
    assert_eq!(i["payload"]["toolName"], "Write", "{i:#}");
    let c = children(&v).into_iter().next().unwrap();
    let alias = c["providerAliases"]["agentId"]
        .as_str()
        .or(c["providerAliases"]["taskId"].as_str())
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        i["payload"]["agentId"],
        alias.as_str(),
        "the callback's agentID: {i:#}"
    );
    // Transport correlation keeps the provider turn that owns the SDK callback.
    assert_eq!(
        i["providerTurnId"].as_str(),
        turn_of(&v, &id).unwrap()["rootProviderTurn"]["providerTurnId"].as_str(),
        "{i:#}"
    );
    assert_eq!(phase(&v, &child), "waiting", "{}", diag());
    assert!(
        turn_of(&v, &id).is_some_and(active),
        "the root stays active"
    );
    assert!(!target.exists(), "nothing is written before the answer");

    // The root tuple is not the owner: refused.
    let req = i["requestId"].as_str().unwrap();
    let (st, e) = rig.d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/turns/{turn}/interactions/{req}"),
        Some(json!({"response": "allow"})),
    );
    assert_eq!(st, 404, "{e}");
    // The child tuple is.
    let (st, e) = rig.d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{child}/turns/{child_t}/interactions/{req}"),
        Some(json!({"response": "allow"})),
    );
    assert_eq!(st, 200, "{e}");
    let end = rig.wait(&id, "the root settled", |v| settled(v, &id));
    assert_eq!(
        outcome(&end, &id).as_deref(),
        Some("completed"),
        "{}",
        diag()
    );
    assert_eq!(
        outcome(&end, &child).as_deref(),
        Some("completed"),
        "{}",
        diag()
    );
    assert_eq!(
        std::fs::read_to_string(&target).expect("the child wrote the file after the allow"),
        "written by the child\n"
    );
    let answered = end["interactions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["requestId"] == req)
        .unwrap()
        .clone();
    assert!(
        matches!(answered["status"].as_str(), Some("answered" | "resolved")),
        "{answered:#}"
    );
    assert_eq!(answered["agentSessionId"], child.as_str());
    assert_eq!(answered["turnId"], child_t.as_str());
    // The child's own Write tool call stays on the child turn (without `forwardSubagentText`
    // the SDK forwards only a foreground subagent's tool blocks, not its text); the parent's
    // Agent call stays on the root turn.
    rig.synced(&id, &end);
    let calls: Vec<Value> = rig
        .feed
        .rows()
        .into_iter()
        .filter(|r| r["kind"] == "toolCall")
        .map(|r| r["payload"].clone())
        .collect();
    let write = calls
        .iter()
        .rfind(|c| c["name"] == "Write")
        .unwrap_or_else(|| panic!("no Write tool call: {calls:#?}"));
    assert_eq!(write["agentSessionId"], child.as_str(), "{write:#}");
    assert_eq!(write["turnId"], child_t.as_str(), "{write:#}");
    assert_eq!(write["status"], "completed", "{write:#}");
    let agent = calls
        .iter()
        .rfind(|c| c["name"] == "Agent" || c["name"] == "Task")
        .unwrap_or_else(|| panic!("no Agent tool call: {calls:#?}"));
    assert_eq!(agent["agentSessionId"], id.as_str(), "{agent:#}");
    assert_eq!(agent["turnId"], turn.as_str(), "{agent:#}");
    assert!(texts(&rig.messages(&id))
        .iter()
        .any(|x| x.contains("ROOT_DONE")));
    eprintln!("{}", diag());
}

// ----- (d) child-only cancel through stopTask ---------------------------------------------------

#[test]
fn child_only_cancel_stops_that_child_and_the_root_settles_from_its_own_outcome() {
    let rig = Rig::start(
        Script::new()
            .on(
                "child-hangs",
                Match::subagent(),
                Reply::text("CHILD_TOO_LATE").after(Duration::from_secs(60)),
            )
            .on(
                "root-followup",
                Match::root().text_contains("<task-notification>"),
                Reply::text("ROOT_NOTED_THE_STOP"),
            )
            .on(
                // The root goes on for a while after launching the child.
                "root-launched",
                Match::root().min_tool_results(1),
                Reply::text("ROOT_OWN_OUTCOME: finished my part").after(Duration::from_secs(4)),
            )
            .on(
                "root-spawn",
                Match::root().first_user_contains("SPAWN_SLOW"),
                Reply::agent(
                    "Slow child",
                    "CHILD_TASK: take forever",
                    Some("general-purpose"),
                    true,
                ),
            ),
        None,
    );
    let id = rig.create();
    let (_, turn) = rig.submit(&id, "SPAWN_SLOW: delegate something slow");
    // The child runs (its model request is in flight) while the root provider turn still runs.
    let v = rig.wait(&id, "a running child whose task id is known", |v| {
        children(v).iter().any(|c| {
            c["providerAliases"]["taskId"].is_string()
                && turn_of(v, c["id"].as_str().unwrap()).is_some_and(|t| t["phase"] == "running")
        })
    });
    let diag = || rig.diagnostics(&id);
    let start = Instant::now();
    while !rig
        .mock
        .requests()
        .iter()
        .any(|r| r.role() == Role::Subagent)
    {
        assert!(start.elapsed() < Duration::from_secs(WAIT), "{}", diag());
        std::thread::sleep(Duration::from_millis(30));
    }
    let child = child_ids(&v)[0].clone();
    let child_t = child_turn(&v, &child);
    assert_eq!(
        turn_of(&v, &id).unwrap()["rootProviderTurn"]["phase"],
        "running",
        "the root provider turn still runs\n{}",
        diag()
    );
    let op = rig.cancel(&child, &child_t);
    assert!(op["operationId"].is_string());

    let end = rig.wait(&id, "the root settled", |v| settled(v, &id));
    assert_eq!(
        outcome(&end, &child).as_deref(),
        Some("canceled"),
        "{}",
        diag()
    );
    assert_eq!(
        outcome(&end, &id).as_deref(),
        Some("completed"),
        "the root settles from its own outcome, not canceled\n{}",
        diag()
    );
    assert!(turn_of(&end, &id).unwrap().get("error").is_none());
    // The root went on after the child-only cancel: its own later output is on its turn.
    assert!(
        texts(&rig.messages(&id))
            .iter()
            .any(|t| t.contains("ROOT_OWN_OUTCOME")),
        "{}",
        diag()
    );
    // The SDK's targeted stop aborted only the child's model request.
    let start = Instant::now();
    while !rig
        .mock
        .requests()
        .iter()
        .any(|r| r.role() == Role::Subagent && r.aborted)
    {
        assert!(
            start.elapsed() < Duration::from_secs(WAIT),
            "the child's request was not abandoned\n{}",
            diag()
        );
        std::thread::sleep(Duration::from_millis(30));
    }
    // Whatever the SDK does after the stop (its stopped notification, a follow-up root turn)
    // neither relabels the child nor reopens the root. Quiesce: the feed stops growing.
    quiesce(&rig);
    let later = rig.detail(&id);
    assert_eq!(
        outcome(&later, &child).as_deref(),
        Some("canceled"),
        "{}",
        diag()
    );
    assert_eq!(
        outcome(&later, &id).as_deref(),
        Some("completed"),
        "{}",
        diag()
    );
    assert_eq!(later["session"].get("activeTurnId"), None);
    let rows = rig.synced(&id, &later);
    let settled_at = rows
        .iter()
        .position(|t| t["id"] == turn.as_str() && !active(t))
        .unwrap();
    assert!(rows[settled_at..]
        .iter()
        .filter(|t| t["id"] == turn.as_str())
        .all(|t| !active(t) && t["outcome"] == "completed"));
    assert!(rows
        .iter()
        .filter(|t| t["agentSessionId"] == child.as_str() && !active(t))
        .all(|t| t["outcome"] == "canceled"));
    eprintln!("{}", diag());
}

/// Waits until the outbox feed has not grown for 1.5 s (bounded by `WAIT`): the provider has
/// stopped producing facts. Used only before asserting that nothing changed later.
fn quiesce(rig: &Rig) {
    let start = Instant::now();
    let mut last = rig.feed.last_seq();
    let mut since = Instant::now();
    while since.elapsed() < Duration::from_millis(1500) {
        assert!(
            start.elapsed() < Duration::from_secs(WAIT),
            "the daemon never went quiet"
        );
        std::thread::sleep(Duration::from_millis(50));
        let now = rig.feed.last_seq();
        if now != last {
            last = now;
            since = Instant::now();
        }
    }
}

// ----- (e) root cancel ---------------------------------------------------------------------------

#[test]
fn root_cancel_cancels_the_root_and_its_children_and_nothing_resurrects() {
    let rig = Rig::start(
        background_root(
            Script::new()
                .on(
                    // Still running at cancel time; would finish soon after it.
                    "child-one",
                    Match::subagent().first_user_contains("CHILD_ONE_TASK"),
                    Reply::text("CHILD_ONE_LATE").after(Duration::from_secs(4)),
                )
                .on(
                    "child-two",
                    Match::subagent().first_user_contains("CHILD_TWO_TASK"),
                    Reply::text("CHILD_TWO_LATE").after(Duration::from_secs(60)),
                ),
            "SPAWN_TWO",
            Reply::blocks(vec![
                agent_block("First child", "CHILD_ONE_TASK: a job"),
                agent_block("Second child", "CHILD_TWO_TASK: a longer job"),
            ]),
        ),
        None,
    );
    let id = rig.create();
    let (_, turn) = rig.submit(&id, "SPAWN_TWO: delegate two jobs");
    let v = rig.wait(&id, "the root waiting on two running children", |v| {
        turn_of(v, &id).is_some_and(|t| t["phase"] == "waiting")
            && child_ids(v).len() == 2
            && child_ids(v)
                .iter()
                .all(|c| turn_of(v, c).is_some_and(|t| t["phase"] == "running"))
    });
    let diag = || rig.diagnostics(&id);
    let kids = child_ids(&v);
    let canceled_at = Instant::now();
    rig.cancel(&id, &turn);
    let end = rig.wait(&id, "the root canceled", |v| settled(v, &id));
    assert_eq!(
        outcome(&end, &id).as_deref(),
        Some("canceled"),
        "{}",
        diag()
    );
    assert!(turn_of(&end, &id).unwrap().get("error").is_none());
    for c in &kids {
        let o = outcome(&end, c);
        assert!(
            matches!(o.as_deref(), Some("canceled" | "interrupted")),
            "child {c}: {o:?}\n{}",
            diag()
        );
    }
    // Late facts: let the first child's delayed reply come due (unless the interrupt abandoned
    // both children's model requests first) and the SDK do whatever it does after the
    // interrupt, then wait until the daemon is quiet.
    let due = Duration::from_secs(4) + Duration::from_millis(500);
    while canceled_at.elapsed() < due
        && !rig
            .mock
            .requests()
            .iter()
            .filter(|r| r.role() == Role::Subagent)
            .all(|r| r.aborted)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    quiesce(&rig);
    let later = rig.detail(&id);
    assert_eq!(
        outcome(&later, &id).as_deref(),
        Some("canceled"),
        "{}",
        diag()
    );
    assert_eq!(
        later["session"].get("activeTurnId"),
        None,
        "nothing resurrects"
    );
    assert_eq!(
        later["session"]["lastTurnId"],
        turn.as_str(),
        "no new root turn"
    );
    assert_eq!(child_ids(&later).len(), 2, "no new child");
    for c in &kids {
        assert_eq!(outcome(&later, c), outcome(&end, c), "child {c} unchanged");
    }
    let rows = rig.synced(&id, &later);
    let settled_at = rows
        .iter()
        .position(|t| t["id"] == turn.as_str() && !active(t))
        .unwrap();
    assert!(
        rows[settled_at..].iter().all(|t| !active(t)),
        "no turn is active after the root cancel: {}",
        diag()
    );
    assert!(rows[settled_at..]
        .iter()
        .filter(|t| t["id"] == turn.as_str())
        .all(|t| t["outcome"] == "canceled"));
    // No late output reached the canceled root.
    assert!(
        !texts(&rig.messages(&id))
            .iter()
            .any(|t| t.contains("ROOT_FOLLOWUP")),
        "{}",
        diag()
    );
    eprintln!("{}", diag());
}

// ----- (f) the continuation boundary expires ------------------------------------------------------

#[test]
fn an_expired_continuation_boundary_settles_the_root_and_its_late_output_is_dropped() {
    let rig = Rig::start(
        Script::new()
            .on(
                "child",
                Match::subagent(),
                Reply::text("CHILD_DONE").after(Duration::from_millis(1000)),
            )
            .on(
                // The SDK's automatic follow-up after the final child's notification comes late:
                // beyond the 1.5 s boundary configured below.
                "root-late-continuation",
                Match::root()
                    .text_contains("<task-notification>")
                    .text_lacks("NEXT_TURN"),
                Reply::text("LATE_CONTINUATION_OUTPUT").after(Duration::from_secs(5)),
            )
            .on(
                "root-next",
                Match::root().last_message_contains("NEXT_TURN"),
                Reply::text("NEXT_TURN_ANSWER"),
            )
            .on(
                "root-launched",
                Match::root().min_tool_results(1),
                Reply::text("ROOT_LAUNCHED: delegated"),
            )
            .on(
                "root-spawn",
                Match::root().first_user_contains("SPAWN_BG"),
                Reply::agent(
                    "Background child",
                    "CHILD_TASK: work",
                    Some("general-purpose"),
                    true,
                ),
            ),
        Some(1500),
    );
    let id = rig.create();
    let (_, turn) = rig.submit(&id, "SPAWN_BG: delegate in the background");
    let end = rig.wait(&id, "the root settled", |v| settled(v, &id));
    let settled_seen = Instant::now();
    let diag = || rig.diagnostics(&id);
    let root = turn_of(&end, &id).unwrap().clone();
    let rpt = &root["rootProviderTurn"];
    // The reserved synthetic provider turn completed with the timeout stop reason ...
    assert!(
        rpt["providerTurnId"]
            .as_str()
            .is_some_and(|p| p.starts_with("synthetic-")),
        "{root:#}\n{}",
        diag()
    );
    assert_eq!(rpt["phase"], "completed");
    assert!(
        rpt["retainedError"]
            .as_str()
            .or(root["error"].as_str())
            .is_some_and(|e| e.contains("timeout")),
        "{root:#}"
    );
    // ... and the root settled from it (the adapter's timeout outcome is `interrupted`, not
    // canceled) ...
    assert_eq!(
        outcome(&end, &id).as_deref(),
        Some("interrupted"),
        "{}",
        diag()
    );
    let kid = child_ids(&end)[0].clone();
    assert_eq!(outcome(&end, &kid).as_deref(), Some("completed"));
    rig.synced(&id, &end);
    let history = rig.turn_history();
    assert!(
        history
            .iter()
            .any(|h| h.starts_with(&format!("{turn}:running")) && h.contains("synthetic-")),
        "the continuation was reserved on the same root turn: {history:?}"
    );

    // A new user turn right away: a new canonical root turn.
    let (reply, next) = rig.submit(&id, "NEXT_TURN: something else");
    assert_eq!(reply, "started");
    assert_ne!(next, turn);
    rig.wait(&id, "the next turn settled", |v| {
        turn_of(v, &id).is_some_and(|t| t["id"] == next.as_str() && !active(t))
    });

    // ... without waiting for the late continuation: its model reply was not even due when the
    // root settled. (The SDK usually asks for it before the boundary expires and the timeout
    // interrupt abandons it; if it asks later, the reply comes 5 s after that.)
    let start = Instant::now();
    let late = loop {
        if let Some(r) = rig
            .mock
            .requests()
            .into_iter()
            .find(|r| r.rule.as_deref() == Some("root-late-continuation"))
        {
            break r;
        }
        assert!(
            start.elapsed() < Duration::from_secs(WAIT),
            "the SDK never asked for the continuation\n{}",
            diag()
        );
        std::thread::sleep(Duration::from_millis(30));
    };
    let due = rig.mock_started + late.at + Duration::from_secs(5);
    assert!(settled_seen < due, "the root waited for the continuation");
    // Let that reply come due (unless the interrupt abandoned it) ...
    while Instant::now() < due + Duration::from_millis(500)
        && !rig
            .mock
            .requests()
            .iter()
            .any(|r| r.seq == late.seq && r.aborted)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    // ... and the timed-out continuation's own later output reach the adapter (at least its
    // `result`, relayed after the timeout interrupt).
    let start = Instant::now();
    loop {
        let log = rig.sidecar_log();
        let interrupt = log
            .iter()
            .position(|l| l.contains("command op=interrupt id=tutti:timeout-interrupt"))
            .unwrap_or_else(|| panic!("no timeout interrupt was sent\n{}", diag()));
        if log[interrupt..]
            .iter()
            .any(|l| l.contains("message type=result") && l.contains("origin=task-notification"))
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(WAIT),
            "the late continuation's result was never relayed\n{}",
            diag()
        );
        std::thread::sleep(Duration::from_millis(30));
    }
    quiesce(&rig);
    // ... which reopened nothing and landed nowhere.
    let after = rig.detail(&id);
    assert_eq!(
        outcome(&after, &id).as_deref(),
        Some("completed"),
        "{}",
        diag()
    );
    assert_eq!(after["session"].get("activeTurnId"), None, "{}", diag());
    // The timed-out continuation's output landed nowhere: not on the settled first turn, not on
    // the later one.
    let msgs = rig.messages(&id);
    assert!(
        !texts(&msgs)
            .iter()
            .any(|t| t.contains("LATE_CONTINUATION_OUTPUT")),
        "{msgs:#?}\n{}",
        diag()
    );
    let answer = msgs
        .iter()
        .find(|m| {
            m["text"]
                .as_str()
                .is_some_and(|t| t.contains("NEXT_TURN_ANSWER"))
        })
        .unwrap_or_else(|| panic!("no answer to the next turn: {msgs:#?}\n{}", diag()));
    assert_eq!(answer["turnId"], next.as_str());
    // The first root turn never reopened once settled.
    let rows = rig.synced(&id, &after);
    let settled_at = rows
        .iter()
        .position(|t| t["id"] == turn.as_str() && !active(t))
        .unwrap();
    assert!(rows[settled_at..]
        .iter()
        .filter(|t| t["id"] == turn.as_str())
        .all(|t| !active(t)));
    eprintln!("{}", diag());
}

// ----- (e') root cancel while the root provider turn still runs ---------------------------------

#[test]
fn root_cancel_while_the_root_provider_turn_runs_records_its_late_terminal_without_reopening() {
    let rig = Rig::start(
        Script::new()
            .on(
                "child-hangs",
                Match::subagent(),
                Reply::text("CHILD_TOO_LATE").after(Duration::from_secs(60)),
            )
            .on(
                "root-followup",
                Match::root().text_contains("<task-notification>"),
                Reply::text("ROOT_FOLLOWUP_AFTER_CANCEL"),
            )
            .on(
                "root-hangs",
                Match::root().min_tool_results(1),
                Reply::text("ROOT_TOO_LATE").after(Duration::from_secs(60)),
            )
            .on(
                "root-spawn",
                Match::root().first_user_contains("SPAWN_BG"),
                Reply::agent(
                    "Background child",
                    "CHILD_TASK: work",
                    Some("general-purpose"),
                    true,
                ),
            ),
        None,
    );
    let id = rig.create();
    let (_, turn) = rig.submit(&id, "SPAWN_BG: delegate, then keep thinking");
    let diag = || rig.diagnostics(&id);
    // Both the root's and the child's model requests are in flight.
    let start = Instant::now();
    while !(rig
        .mock
        .requests()
        .iter()
        .any(|r| r.rule.as_deref() == Some("root-hangs"))
        && rig
            .mock
            .requests()
            .iter()
            .any(|r| r.rule.as_deref() == Some("child-hangs")))
    {
        assert!(start.elapsed() < Duration::from_secs(WAIT), "{}", diag());
        std::thread::sleep(Duration::from_millis(30));
    }
    let v = rig.wait(&id, "the root provider turn and its child running", |v| {
        turn_of(v, &id).is_some_and(|t| t["rootProviderTurn"]["phase"] == "running")
            && child_ids(v)
                .iter()
                .any(|c| turn_of(v, c).is_some_and(|t| t["phase"] == "running"))
    });
    let kid = child_ids(&v)[0].clone();
    rig.cancel(&id, &turn);
    let end = rig.wait(&id, "the root canceled", |v| settled(v, &id));
    assert_eq!(
        outcome(&end, &id).as_deref(),
        Some("canceled"),
        "{}",
        diag()
    );
    assert!(
        matches!(
            outcome(&end, &kid).as_deref(),
            Some("canceled" | "interrupted")
        ),
        "{}",
        diag()
    );
    // The matching root provider terminal arrives after the canonical cancel: it closes the
    // provider lifecycle (no stale `running`) without changing or reopening the canonical root.
    let fin = rig.wait(&id, "the late root provider terminal recorded", |v| {
        turn_of(v, &id).is_some_and(|t| t["rootProviderTurn"]["phase"] == "completed")
    });
    assert_eq!(outcome(&fin, &id).as_deref(), Some("canceled"));
    assert!(turn_of(&fin, &id).unwrap().get("error").is_none());
    quiesce(&rig);
    let later = rig.detail(&id);
    assert_eq!(
        outcome(&later, &id).as_deref(),
        Some("canceled"),
        "{}",
        diag()
    );
    assert_eq!(
        later["session"].get("activeTurnId"),
        None,
        "nothing resurrects"
    );
    assert_eq!(later["session"]["lastTurnId"], turn.as_str());
    assert_eq!(outcome(&later, &kid), outcome(&end, &kid));
    let rows = rig.synced(&id, &later);
    let settled_at = rows
        .iter()
        .position(|t| t["id"] == turn.as_str() && !active(t))
        .unwrap();
    assert!(rows[settled_at..].iter().all(|t| !active(t)), "{}", diag());
    let root_texts = texts(&rig.messages(&id));
    assert!(
        !root_texts
            .iter()
            .any(|t| t.contains("ROOT_TOO_LATE") || t.contains("ROOT_FOLLOWUP_AFTER_CANCEL")),
        "{root_texts:?}"
    );
    // The SDK abandoned both in-flight model requests.
    assert!(
        rig.mock
            .requests()
            .iter()
            .filter(|r| matches!(r.rule.as_deref(), Some("root-hangs" | "child-hangs")))
            .all(|r| r.aborted),
        "{}",
        diag()
    );
    eprintln!("{}", diag());
}

// ----- Adapter::on_dropped: a root permission after the root settled -----------------------------

/// After a child-only stop, the SDK runs an automatic follow-up root turn once the canonical root
/// has already settled. If that late turn asks for a permission, the engine does not take the
/// interaction (its turn settled); the adapter must answer the SDK callback with deny
/// (`on_dropped`), or the query would wait forever and never run the user's next turn.
#[test]
fn a_root_permission_after_the_root_settled_is_denied_and_the_query_keeps_going() {
    let rig = Rig::start(Script::new(), None);
    let target = rig.dirs.cwd.path().join("late-root-write.txt");
    rig.mock.set_script(
        Script::new()
            .on(
                "child-hangs",
                Match::subagent(),
                Reply::text("CHILD_TOO_LATE").after(Duration::from_secs(60)),
            )
            .on(
                "root-next",
                Match::root().last_message_contains("NEXT_TURN"),
                Reply::text("NEXT_TURN_ANSWER"),
            )
            .on(
                // The late follow-up wants to write a file (asks for permission) ...
                "root-late-write",
                Match::root()
                    .text_contains("<task-notification>")
                    .tool_results(1),
                Reply::write_file(&target.to_string_lossy(), "late\n"),
            )
            .on(
                // ... and finishes once the (denied) result is in.
                "root-late-done",
                Match::root()
                    .text_contains("<task-notification>")
                    .min_tool_results(2),
                Reply::text("ROOT_LATE_FOLLOWUP_DONE"),
            )
            .on(
                "root-launched",
                Match::root().min_tool_results(1),
                Reply::text("ROOT_OWN_OUTCOME").after(Duration::from_secs(4)),
            )
            .on(
                "root-spawn",
                Match::root().first_user_contains("SPAWN_SLOW"),
                Reply::agent(
                    "Slow child",
                    "CHILD_TASK: take forever",
                    Some("general-purpose"),
                    true,
                ),
            ),
    );
    let id = rig.create();
    let (_, turn) = rig.submit(&id, "SPAWN_SLOW: delegate something slow");
    let v = rig.wait(&id, "a running child whose task id is known", |v| {
        children(v).iter().any(|c| {
            c["providerAliases"]["taskId"].is_string()
                && turn_of(v, c["id"].as_str().unwrap()).is_some_and(|t| t["phase"] == "running")
        })
    });
    let diag = || rig.diagnostics(&id);
    let child = child_ids(&v)[0].clone();
    rig.cancel(&child, &child_turn(&v, &child));
    let end = rig.wait(&id, "the root settled", |v| settled(v, &id));
    assert_eq!(
        outcome(&end, &id).as_deref(),
        Some("completed"),
        "{}",
        diag()
    );
    assert_eq!(
        outcome(&end, &child).as_deref(),
        Some("canceled"),
        "{}",
        diag()
    );

    // The late follow-up asks for the Write permission at the root, after the root settled.
    let start = Instant::now();
    let asked = loop {
        let log = rig.sidecar_log();
        if let Some(l) = log
            .iter()
            .find(|l| l.contains("canUseTool") && l.contains("tool=Write"))
        {
            break l.clone();
        }
        assert!(
            start.elapsed() < Duration::from_secs(WAIT),
            "the late follow-up never asked for a permission\n{}",
            diag()
        );
        std::thread::sleep(Duration::from_millis(30));
    };
    assert!(asked.contains("agent=-"), "a root callback: {asked}");
    let request = asked
        .split_whitespace()
        .find_map(|w| w.strip_prefix("requestId="))
        .unwrap()
        .to_string();
    // It is answered with deny, never shown as a pending interaction of the settled root.
    let start = Instant::now();
    while !rig.sidecar_log().iter().any(|l| {
        l.contains(&format!("permission requestId={request}")) && l.contains("behavior=deny")
    }) {
        assert!(
            start.elapsed() < Duration::from_secs(WAIT),
            "the late root permission was never answered\n{}",
            diag()
        );
        std::thread::sleep(Duration::from_millis(30));
    }
    let d = rig.detail(&id);
    assert!(
        !d["interactions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|i| i["requestId"] == request.as_str()),
        "{d:#}"
    );
    assert_eq!(outcome(&d, &id).as_deref(), Some("completed"));
    assert!(!target.exists(), "the denied Write wrote nothing");

    // The query is not stuck: the user's next turn runs and completes on its own turn.
    let (reply, next) = rig.submit(&id, "NEXT_TURN: anything else?");
    assert_eq!(reply, "started");
    assert_ne!(next, turn);
    let fin = rig.wait(&id, "the next turn settled", |v| {
        turn_of(v, &id).is_some_and(|t| t["id"] == next.as_str() && !active(t))
    });
    assert_eq!(
        outcome(&fin, &id).as_deref(),
        Some("completed"),
        "{}",
        diag()
    );
    let msgs = rig.messages(&id);
    let answer = msgs
        .iter()
        .find(|m| {
            m["text"]
                .as_str()
                .is_some_and(|t| t.contains("NEXT_TURN_ANSWER"))
        })
        .unwrap_or_else(|| panic!("no answer to the next turn: {msgs:#?}\n{}", diag()));
    assert_eq!(answer["turnId"], next.as_str());
    assert!(
        !texts(&msgs)
            .iter()
            .any(|t| t.contains("ROOT_LATE_FOLLOWUP_DONE")),
        "the late follow-up's output landed nowhere: {msgs:#?}"
    );
    let rows = rig.synced(&id, &fin);
    let settled_at = rows
        .iter()
        .position(|t| t["id"] == turn.as_str() && !active(t))
        .unwrap();
    assert!(rows[settled_at..]
        .iter()
        .filter(|t| t["id"] == turn.as_str())
        .all(|t| !active(t) && t["outcome"] == "completed"));
    eprintln!("{}", diag());
}

// ----- (g) two background children finishing together ------------------------------------------

/// Follow-up rules answer once each, `ROOT_FOLLOWUP_<n>`, so every follow-up reply is told apart.
const FOLLOW_UP_RULES: usize = 16;

/// The root launches two background children whose replies take the same time, so their task
/// notifications reach the SDK within a few ms of each other (real SDK 0.3.332: two follow-up
/// turns, or an empty one and then a real one; see `core/tests/data/claude/bg_two_*.jsonl`).
fn together_script() -> Script {
    let mut script = Script::new();
    for n in 1..=FOLLOW_UP_RULES {
        script = script.rule(
            tutti_tests::mock_messages::Rule::new(
                &format!("root-followup-{n}"),
                Match::root().last_message_contains("<task-notification>"),
                Reply::text(&format!("ROOT_FOLLOWUP_{n}: the children reported back")),
            )
            .times(1),
        );
    }
    script
        .on(
            "root-guided",
            Match::root().last_message_contains("GUIDANCE"),
            Reply::text("ROOT_GUIDED: noted while the children run"),
        )
        .on(
            "child-one",
            Match::subagent().first_user_contains("CHILD_ONE_TASK"),
            Reply::text("CHILD_ONE_DONE").after(Duration::from_millis(2000)),
        )
        .on(
            "child-two",
            Match::subagent().first_user_contains("CHILD_TWO_TASK"),
            Reply::text("CHILD_TWO_DONE").after(Duration::from_millis(2000)),
        )
        .on(
            "root-launched",
            Match::root().min_tool_results(2),
            Reply::text("ROOT_LAUNCHED: delegated two jobs"),
        )
        .on(
            "root-spawn",
            Match::root().first_user_contains("SPAWN_TOGETHER"),
            Reply::blocks(vec![
                agent_block("First child", "CHILD_ONE_TASK: quick job"),
                agent_block("Second child", "CHILD_TWO_TASK: equally quick job"),
            ]),
        )
}

/// Spec: "the continuation produced after a background child notification belongs to the same
/// canonical root turn", and no provider output is silently dropped while its owner can still
/// record it. Two background children finish together; the SDK answers with more than one
/// follow-up turn. Every follow-up reply the model sent is a message of the one root turn, and
/// the root settles completed only after the last of them. Run several times in a row (the
/// follow-ups' order is timing-dependent), each on a new root session of the same daemon; the
/// second run also appends a guidance submit while the children run (the other shape).
#[test]
fn children_finishing_together_every_follow_up_reply_is_a_message_of_the_one_root_turn() {
    const RUNS: usize = 3;
    let rig = Rig::start(together_script(), None);
    let follow_up_results = |rig: &Rig| {
        rig.sidecar_log()
            .iter()
            .filter(|l| l.contains("type=result") && l.contains("origin=task-notification"))
            .count()
    };
    let mut shapes = Vec::new();
    for run in 1..=RUNS {
        let requests_before = rig.mock.message_requests().len();
        let results_before = follow_up_results(&rig);
        let id = rig.create();
        let (reply, turn) = rig.submit(&id, "SPAWN_TOGETHER: delegate two jobs at once");
        assert_eq!(reply, "started");
        let guided = run == 2;
        if guided {
            rig.wait(&id, "the root waiting on its children", |v| {
                turn_of(v, &id).is_some_and(|t| {
                    t["phase"] == "waiting" && t["rootProviderTurn"]["phase"] == "completed"
                })
            });
            let (reply, guided_turn) = rig.submit(&id, "GUIDANCE: also mention the weather");
            assert_eq!(reply, "appended", "run {run}");
            assert_eq!(guided_turn, turn, "run {run}: guidance joins the root turn");
        }
        let end = rig.wait(&id, "the root settled", |v| settled(v, &id));
        // Any follow-up the SDK still had to send would arrive now: wait for quiet.
        quiesce(&rig);
        let end = {
            let again = rig.detail(&id);
            assert_eq!(
                again["turns"], end["turns"],
                "run {run}: nothing changed after settling"
            );
            again
        };
        let diag = || format!("run {run}\n{}", rig.diagnostics(&id));
        assert_eq!(
            outcome(&end, &id).as_deref(),
            Some("completed"),
            "{}",
            diag()
        );
        let kids = child_ids(&end);
        assert_eq!(kids.len(), 2, "{}", diag());
        for k in &kids {
            assert_eq!(outcome(&end, k).as_deref(), Some("completed"), "{}", diag());
        }
        // The follow-up replies the model sent during this run.
        let replies: Vec<String> = rig.mock.message_requests()[requests_before..]
            .iter()
            .filter_map(|r| {
                r.rule
                    .as_deref()?
                    .strip_prefix("root-followup-")
                    .map(String::from)
            })
            .map(|n| format!("ROOT_FOLLOWUP_{n}"))
            .collect();
        assert!(!replies.is_empty(), "no follow-up at all\n{}", diag());
        let results = follow_up_results(&rig) - results_before;
        shapes.push(format!(
            "run {run} (guided: {guided}): {results} follow-up result(s), {} model reply(ies)",
            replies.len()
        ));
        // Each is a message of the one root turn.
        let msgs = rig.messages(&id);
        for r in &replies {
            let m = msgs
                .iter()
                .find(|m| {
                    m["text"]
                        .as_str()
                        .is_some_and(|t| t.starts_with(r.as_str()))
                })
                .unwrap_or_else(|| panic!("{r} is in no message of the root\n{}", diag()));
            assert_eq!(m["turnId"], turn.as_str(), "{}", diag());
        }
        // One canonical root turn, settled after the last follow-up message, never reopened.
        let feed = rig.feed.rows();
        let root_rows: Vec<(usize, &Value)> = feed
            .iter()
            .enumerate()
            .filter(|(_, r)| r["kind"] == "turn" && r["payload"]["agentSessionId"] == id.as_str())
            .collect();
        assert!(
            root_rows
                .iter()
                .all(|(_, r)| r["payload"]["id"] == turn.as_str()),
            "one root turn\n{}",
            diag()
        );
        let settled_at = root_rows
            .iter()
            .find(|(_, r)| !active(&r["payload"]))
            .map(|(i, _)| *i)
            .unwrap_or_else(|| panic!("the feed never showed the root settled\n{}", diag()));
        assert!(root_rows
            .iter()
            .filter(|(i, _)| *i > settled_at)
            .all(|(_, r)| !active(&r["payload"])));
        let last_reply = feed
            .iter()
            .rposition(|r| {
                r["kind"] == "message"
                    && r["payload"]["agentSessionId"] == id.as_str()
                    && r["payload"]["text"]
                        .as_str()
                        .is_some_and(|t| t.starts_with("ROOT_FOLLOWUP"))
            })
            .unwrap_or_else(|| panic!("no follow-up message in the feed\n{}", diag()));
        assert!(
            last_reply < settled_at,
            "the root settled before the last follow-up reply\n{}",
            diag()
        );
        if guided {
            assert!(
                msgs.iter().any(|m| m["turnId"] == turn.as_str()
                    && m["text"]
                        .as_str()
                        .is_some_and(|t| t.starts_with("ROOT_GUIDED"))),
                "the guidance reply is on the root turn\n{}",
                diag()
            );
        }
        assert_eq!(end["session"].get("activeTurnId"), None);
    }
    eprintln!("{}", shapes.join("\n"));
    // The runs exercised the case at all: the SDK sent more than one follow-up at least once.
    assert!(
        shapes
            .iter()
            .any(|s| !s.contains(": 1 follow-up result(s)")),
        "no run had two follow-ups: {shapes:?}"
    );
}

// ----- idle stop and resume (issue 17 item 2) ----------------------------------------------------

/// "A runtime whose tree is quiescent is stopped after an idle timeout; the next submit starts the
/// provider again and continues the same provider conversation": Claude Agent SDK `resume` with
/// the recorded session id. The sidecar and the Claude CLI it started (one process group) are
/// gone after the idle timeout; the relaunched SDK reports the same session id and sends the
/// model the earlier exchange.
#[test]
fn an_idle_claude_is_stopped_and_the_next_submit_resumes_the_same_sdk_session() {
    use tutti_tests::procs::{alive, children_of, group_members, poll};
    let rig = Rig::start_with(
        Script::new()
            .on(
                "second",
                Match::root().last_message_contains("SECOND_PROMPT"),
                Reply::text("SECOND_ANSWER"),
            )
            .on(
                "first",
                Match::root().last_message_contains("FIRST_PROMPT"),
                Reply::text("FIRST_ANSWER"),
            ),
        None,
        Some(1),
    );
    let id = rig.create();
    rig.submit(&id, "FIRST_PROMPT: remember me");
    let daemon = rig.d.pid().expect("daemon runs");
    let sidecar = poll(WAIT, || match children_of(daemon).as_slice() {
        [one] => Some(*one),
        _ => None,
    })
    .expect("one sidecar process");
    let first = rig.wait(&id, "the first turn settled", |v| settled(v, &id));
    assert_eq!(
        outcome(&first, &id).as_deref(),
        Some("completed"),
        "{}",
        rig.diagnostics(&id)
    );
    let sdk_session = first["session"]["providerSessionId"]
        .as_str()
        .unwrap_or_else(|| panic!("no SDK session id\n{}", rig.diagnostics(&id)))
        .to_string();
    let group = group_members(sidecar);
    assert!(!group.is_empty(), "the sidecar leads its own process group");
    assert!(
        poll(WAIT, || group.iter().all(|p| !alive(*p)).then_some(())).is_some(),
        "the idle sidecar's process group {group:?} is stopped\n{}",
        rig.diagnostics(&id)
    );
    assert!(children_of(daemon).is_empty(), "no provider process left");

    rig.submit(&id, "SECOND_PROMPT: do you remember?");
    let second = rig.wait(&id, "the second turn settled", |v| {
        settled(v, &id)
            && texts(&rig.messages(&id))
                .iter()
                .any(|t| t == "SECOND_ANSWER")
    });
    assert_eq!(
        outcome(&second, &id).as_deref(),
        Some("completed"),
        "{}",
        rig.diagnostics(&id)
    );
    assert_eq!(
        second["session"]["providerSessionId"].as_str(),
        Some(sdk_session.as_str()),
        "the relaunched SDK continues the same session\n{}",
        rig.diagnostics(&id)
    );
    let asked = rig
        .mock
        .requests()
        .into_iter()
        .filter(|r| r.is_messages() && r.last_message_text().contains("SECOND_PROMPT"))
        .collect::<Vec<_>>();
    assert!(
        asked.iter().any(|r| r.all_text().contains("FIRST_ANSWER")),
        "the model sees the earlier exchange\n{}",
        rig.diagnostics(&id)
    );
}
