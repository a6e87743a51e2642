//! Provider processes have a lifetime (issue 17 item 2, issue 23 items 4 and 5), with a real
//! `tuttid`, a real SQLite file and the real bundled ACP agents as child processes:
//!
//! - "a runtime whose tree is quiescent is stopped after an idle timeout and at once on DELETE";
//! - "the next submit to that root starts the provider again and continues the same provider
//!   conversation": ACP `session/load` when the agent advertises `loadSession`, otherwise a new
//!   ACP session, recorded as the root's provider session id;
//! - "each provider in its own process group; the whole group ended when the runtime stops";
//!   SIGTERM and SIGINT to `tuttid` leave no provider process (nor its children) behind;
//! - 500 sessions leave a bounded number of processes and descriptors.

use serde_json::{json, Value};
use tutti_tests::daemon::{turn_of, TestDaemon};
use tutti_tests::procs::{alive, children_of, fd_count, group_members, poll};

const EXE: &str = env!("CARGO_BIN_EXE_tuttid-test");
const WS: &str = "w1";
/// A demo prompt without subagents (quick, nothing left running after the answer).
const QUICK: &str = "children=0 permission=0 fail=0 late=0";

fn settled(d: &TestDaemon, id: &str) -> Value {
    d.wait_for(WS, id, 60, "root settled", |v| {
        v["session"].get("activeTurnId").is_none()
            && turn_of(v, id).is_some_and(|t| t["outcome"].is_string())
    })
}

/// The one provider process the daemon runs (polls until it exists).
fn the_provider(d: &TestDaemon) -> u32 {
    let daemon = d.pid().expect("daemon runs");
    poll(30, || match children_of(daemon).as_slice() {
        [one] => Some(*one),
        _ => None,
    })
    .expect("one provider process")
}

fn provider_session_id(detail: &Value) -> String {
    detail["session"]["providerSessionId"]
        .as_str()
        .unwrap_or_else(|| panic!("no provider session id: {detail:#}"))
        .to_string()
}

/// The texts of the root's assistant messages on `turn`.
fn assistant_texts(d: &TestDaemon, id: &str, turn: &Value) -> Vec<String> {
    let (st, v) = d.call(
        "GET",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}/messages"),
        None,
    );
    assert_eq!(st, 200, "messages: {v}");
    v["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["role"] == "assistant" && m["turnId"] == turn["id"])
        .filter_map(|m| m["text"].as_str().map(String::from))
        .collect()
}

fn gone(pids: &[u32]) -> bool {
    pids.iter().all(|p| !alive(*p))
}

/// Idle stop, then relaunch with `session/load`: the demo agent (which advertises `loadSession`
/// and keeps its sessions in a file) gets the same ACP session back, and its next turn is the
/// session's second one. The provider's whole process group (the agent and its grandchild) is
/// gone after the idle timeout.
#[test]
fn idle_acp_provider_is_stopped_and_the_next_submit_loads_the_same_session() {
    let d = TestDaemon::start(
        EXE,
        Some("idle_timeout_secs = 1\n"),
        &[("TUTTI_DEMO_SPEED", "20"), ("TUTTI_DEMO_GRANDCHILD", "1")],
    );
    let id = d.create(WS, "demo");
    d.submit(WS, &id, QUICK);
    let agent = the_provider(&d);
    let group = poll(30, || {
        let g = group_members(agent);
        (g.len() >= 2).then_some(g)
    })
    .expect("the agent and its grandchild share the agent's process group");
    let first = settled(&d, &id);
    let sid = provider_session_id(&first);
    let first_texts = assistant_texts(&d, &id, turn_of(&first, &id).expect("first turn"));
    assert!(
        !first_texts.is_empty(),
        "the first turn's answer is recorded"
    );
    assert!(
        poll(60, || gone(&group).then_some(())).is_some(),
        "the idle provider's process group {group:?} is stopped"
    );
    assert!(children_of(d.pid().expect("daemon runs")).is_empty());

    d.submit(WS, &id, QUICK);
    let again = the_provider(&d);
    assert_ne!(again, agent, "a new provider process");
    let second = settled(&d, &id);
    assert_eq!(
        turn_of(&second, &id).expect("second turn")["outcome"],
        "completed"
    );
    assert_eq!(
        provider_session_id(&second),
        sid,
        "the relaunched agent continues the same ACP session"
    );
    // Every answer of the relaunched agent is recorded: none is taken for a duplicate of the
    // first process's messages.
    let second_texts = assistant_texts(&d, &id, turn_of(&second, &id).expect("second turn"));
    assert_eq!(
        second_texts.len(),
        first_texts.len(),
        "the relaunched agent's answers are recorded like the first's: {first_texts:?} then \
         {second_texts:?}"
    );
    // The agent's own record: the loaded session went on with its second turn.
    let mut state = d.db().into_os_string();
    state.push(".demo-agent");
    let file = std::path::PathBuf::from(state).join(format!("{sid}.json"));
    let saved: Value =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("the agent's state file"))
            .expect("JSON state");
    assert_eq!(saved["turns"], 2, "the agent loaded turn 1 and ran turn 2");
    let events = d.events(Some(0), None, usize::MAX, 2);
    let text = serde_json::to_string(&events).expect("events");
    assert!(
        text.contains(&format!("{sid}-t2-read")),
        "the second turn's tool call is the loaded session's turn 2"
    );
}

/// An agent without `loadSession` (the plain agent) gets a new ACP session on relaunch, and the
/// root records it as its provider session id.
#[test]
fn an_agent_without_load_session_gets_a_new_recorded_session_on_relaunch() {
    let d = TestDaemon::start(
        EXE,
        Some("idle_timeout_secs = 1\n"),
        &[("TUTTI_DEMO_SPEED", "20")],
    );
    let id = d.create(WS, "plain");
    d.submit(WS, &id, "hello");
    let agent = the_provider(&d);
    let first_detail = settled(&d, &id);
    let first = provider_session_id(&first_detail);
    let first_texts = assistant_texts(&d, &id, turn_of(&first_detail, &id).expect("turn"));
    assert!(
        !first_texts.is_empty(),
        "the first turn's answer is recorded"
    );
    assert!(
        poll(60, || (!alive(agent)).then_some(())).is_some(),
        "idle provider stopped"
    );
    d.submit(WS, &id, "hello again");
    let second = settled(&d, &id);
    assert_eq!(turn_of(&second, &id).expect("turn")["outcome"], "completed");
    let now = provider_session_id(&second);
    assert_ne!(now, first, "a new ACP session, recorded on the root");
    let second_texts = assistant_texts(&d, &id, turn_of(&second, &id).expect("turn"));
    assert_eq!(
        second_texts.len(),
        first_texts.len(),
        "the new session's answers are all recorded: {first_texts:?} then {second_texts:?}"
    );
}

/// DELETE stops the provider at once (the idle timeout is off here).
#[test]
fn delete_stops_the_provider_process_group_at_once() {
    let d = TestDaemon::start(
        EXE,
        Some("idle_timeout_secs = 0\n"),
        &[("TUTTI_DEMO_SPEED", "20"), ("TUTTI_DEMO_GRANDCHILD", "1")],
    );
    let id = d.create(WS, "demo");
    d.submit(WS, &id, QUICK);
    let agent = the_provider(&d);
    settled(&d, &id);
    let group = group_members(agent);
    assert!(group.len() >= 2, "agent and grandchild: {group:?}");
    assert!(alive(agent), "without an idle timeout the provider stays");
    let (st, v) = d.call(
        "DELETE",
        &format!("/v1/workspaces/{WS}/agent-sessions/{id}"),
        None,
    );
    assert_eq!(st, 200, "{v}");
    assert!(
        poll(30, || gone(&group).then_some(())).is_some(),
        "DELETE ended the provider's process group {group:?}"
    );
}

fn signal_leaves_no_provider(signal: i32) {
    let mut d = TestDaemon::start(
        EXE,
        Some("idle_timeout_secs = 0\n"),
        &[("TUTTI_DEMO_SPEED", "20"), ("TUTTI_DEMO_GRANDCHILD", "1")],
    );
    let daemon = d.pid().expect("daemon runs");
    // One settled tree and one with a turn still running.
    let idle = d.create(WS, "demo");
    d.submit(WS, &idle, QUICK);
    settled(&d, &idle);
    let busy = d.create(WS, "demo");
    d.submit(WS, &busy, "children=1 hang=1 permission=0 fail=0 late=0");
    d.wait_for(WS, &busy, 60, "child running", |v| {
        v["childSessions"].as_array().is_some_and(|a| a.len() == 1)
    });
    let agents = children_of(daemon);
    assert_eq!(agents.len(), 2, "two provider processes: {agents:?}");
    let everything: Vec<u32> = agents.iter().flat_map(|a| group_members(*a)).collect();
    assert!(
        everything.len() >= 4,
        "each agent with its grandchild: {everything:?}"
    );
    let status = d.signal_and_wait(signal, 30);
    assert!(status.is_some(), "tuttid exits on signal {signal}");
    assert!(
        poll(10, || gone(&everything).then_some(())).is_some(),
        "no provider process or child outlives the daemon: {:?}",
        everything.iter().filter(|p| alive(**p)).collect::<Vec<_>>()
    );
}

#[test]
fn sigterm_to_the_daemon_leaves_no_provider_process_behind() {
    signal_leaves_no_provider(libc::SIGTERM);
}

#[test]
fn sigint_to_the_daemon_leaves_no_provider_process_behind() {
    signal_leaves_no_provider(libc::SIGINT);
}

/// 500 sessions, each run to completion, leave a bounded number of provider processes and open
/// descriptors: idle providers are stopped (timeout 1 s), so neither grows with the number of
/// sessions ever created, and once everything is idle none is left.
#[test]
fn five_hundred_sessions_leave_bounded_processes_and_descriptors() {
    const SESSIONS: usize = 500;
    let d = TestDaemon::start(
        EXE,
        Some("idle_timeout_secs = 1\n"),
        &[("TUTTI_DEMO_SPEED", "100")],
    );
    let daemon = d.pid().expect("daemon runs");
    let baseline_fds = fd_count(daemon);
    let (mut max_children, mut max_fds) = (0usize, 0usize);
    for i in 0..SESSIONS {
        let id = d.create(WS, "plain");
        d.submit(WS, &id, "hi");
        settled(&d, &id);
        if i % 10 == 0 {
            max_children = max_children.max(children_of(daemon).len());
            max_fds = max_fds.max(fd_count(daemon));
        }
    }
    let end = poll(60, || children_of(daemon).is_empty().then_some(()));
    let fds = fd_count(daemon);
    println!(
        "{SESSIONS} sessions: at most {max_children} provider processes and {max_fds} descriptors \
         at once (baseline {baseline_fds}); after the idle timeout {} processes, {fds} descriptors",
        children_of(daemon).len()
    );
    assert!(end.is_some(), "every idle provider is stopped");
    assert!(
        max_children < SESSIONS / 2,
        "providers do not accumulate: at most {max_children} at once"
    );
    assert!(
        fds <= baseline_fds + 16,
        "descriptors return to the baseline: {fds} (baseline {baseline_fds})"
    );
}

/// A `kill -9` of `tuttid` leaves no provider that would outlive it: the provider gets SIGTERM
/// when the daemon dies (on Linux), also one that does not exit when its stdin closes (as
/// codex-acp does not). The provider here is `sh` running the demo agent and then, once the
/// agent has ended on stdin EOF, `exec sleep 600` in the same process: without the signal, that
/// process would still run ten minutes after the daemon died.
#[test]
fn a_provider_that_ignores_stdin_eof_does_not_outlive_a_killed_daemon() {
    let config = format!(
        "[providers.stubborn]\nkind = \"acp\"\ncommand = [\"sh\", \"-c\", \"\\\"$0\\\" demo-agent; exec sleep 600\", \"{EXE}\"]\n"
    );
    let mut d = TestDaemon::start(EXE, Some(&config), &[("TUTTI_DEMO_SPEED", "20")]);
    let id = d.create(WS, "stubborn");
    d.submit(WS, &id, QUICK);
    settled(&d, &id);
    let provider = the_provider(&d);
    d.kill9();
    let ended = poll(10, || (!alive(provider)).then_some(()));
    if ended.is_none() {
        // Leave nothing behind, then fail.
        unsafe { libc::kill(provider as i32, libc::SIGKILL) };
    }
    assert!(
        ended.is_some(),
        "provider {provider} still runs after the daemon was killed"
    );
}

/// Issue 36 item 3: "No limit on provider processes ... at the fd limit, later sessions settle
/// `interrupted: provider could not be started`." With `max_providers = 2` and three sessions:
/// the third start stops the least recently used idle provider (not the other one) and its
/// turn completes; when both running providers are busy, a submit that needs a third is
/// refused `503 provider_limit` and starts no turn.
#[test]
fn past_the_provider_cap_the_least_recently_used_idle_one_is_stopped_and_a_busy_cap_refuses() {
    let d = TestDaemon::start(
        EXE,
        // Settled trees leave memory at once: the cap holds for trees read back from the file.
        Some("max_providers = 2\nidle_timeout_secs = 0\n[retention]\nresident_trees = 0\n"),
        &[("TUTTI_DEMO_SPEED", "20")],
    );
    let daemon = d.pid().expect("daemon runs");
    let [a, b, c] = [0, 1, 2].map(|_| d.create(WS, "demo"));
    d.submit(WS, &a, QUICK);
    let agent_a = the_provider(&d);
    settled(&d, &a);
    d.submit(WS, &b, QUICK);
    settled(&d, &b);
    let both = poll(30, || {
        let kids = children_of(daemon);
        (kids.len() == 2).then_some(kids)
    })
    .expect("two providers, idle ones are kept (no idle timeout)");
    let agent_b = *both.iter().find(|p| **p != agent_a).expect("b's provider");
    let (reply, _) = d.submit(WS, &c, QUICK);
    assert_eq!(reply, "started");
    let done = settled(&d, &c);
    assert_eq!(
        turn_of(&done, &c).expect("c's turn")["outcome"],
        "completed",
        "the third session's turn runs: {done:#}"
    );
    assert!(
        poll(30, || (!alive(agent_a)).then_some(())).is_some(),
        "the least recently used idle provider (a's) was stopped"
    );
    assert!(alive(agent_b), "b's provider, used later, stays");
    assert_eq!(children_of(daemon).len(), 2, "never more than the cap");
    // Both running providers busy (a child that works until cancelled): no room for a's.
    for id in [&b, &c] {
        let (reply, _) = d.submit(WS, id, "children=1 hang=1 permission=0 fail=0 late=0");
        assert_eq!(reply, "started");
    }
    let last = d.detail(WS, &a)["session"]["lastTurnId"].clone();
    let (st, v) = d.call(
        "POST",
        &format!("/v1/workspaces/{WS}/agent-sessions/{a}/submit"),
        Some(json!({"text": QUICK})),
    );
    assert_eq!(st, 503, "{v}");
    assert_eq!(v["error"]["code"], "provider_limit", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("max_providers")),
        "{v}"
    );
    let after = d.detail(WS, &a);
    assert_eq!(after["session"]["lastTurnId"], last, "no turn was started");
    assert!(after["session"].get("activeTurnId").is_none());
    assert_eq!(children_of(daemon).len(), 2);
}
