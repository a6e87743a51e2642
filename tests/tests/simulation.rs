//! The seeded simulation of the whole stack (`tutti_tests::sim`): simulated Codex, Claude, ACP
//! and direct providers, the real adapters and engine, a real SQLite store for every
//! `SQLITE_EVERY`-th seed, crashes at random commit boundaries, user commands at random moments;
//! a safety phase with faults, then a liveness phase without.
//!
//! - `TUTTI_SIM_SEEDS=N` runs seeds `0..N` (default 10,000, the CI figure);
//! - `TUTTI_SIM_SEED=S` replays seed `S` only, with its trace (with `TUTTI_SIM_TAPE=` the shrunk
//!   tape a failure printed, instead of the seed's own draws);
//! - `TUTTI_SIM_FIRST=F` starts at seed `F` (with `TUTTI_SIM_SEEDS`);
//! - `TUTTI_SIM_THREADS=T` (default: available cores);
//! - `TUTTI_SIM_KEEP_GOING=1` runs every seed even after a failure (and reports them all);
//! - `TUTTI_SIM_SHRINK_SECS=S` bounds the shrinking of a failure (default 30);
//! - `TUTTI_SIM_SQLITE_EVERY=N` runs every N-th seed against SQLite (default 8).
//!
//! A failure prints its seed, the broken rule, the shrunk tape and the shortest trace found (also
//! written to `$TMPDIR/tutti-sim-seed-S.trace`). It prints seeds/s and `N passed, 0 failed`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;
use tutti_core::driver::{DriverInput, Testkit};
use tutti_tests::sim;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().replace('_', "").parse().ok())
}

fn report(seed: u64, failure: &sim::Failure, trace: &[String]) -> String {
    let path = std::env::temp_dir().join(format!("tutti-sim-seed-{seed}.trace"));
    let text = trace.join("\n");
    let _ = std::fs::write(&path, &text);
    let tape: Vec<String> = failure.tape.iter().map(|v| format!("{v:x}")).collect();
    format!(
        "seed {seed} FAILED: {}\n  replay: TUTTI_SIM_SEED={seed} cargo test -p tutti-tests --test simulation\n  replay the shrunk run: TUTTI_SIM_SEED={seed} TUTTI_SIM_TAPE=<the tape below> cargo test -p tutti-tests --test simulation\n  shrunk tape ({} draws): {}\n  shortest trace ({} lines, also in {}):\n{}\n",
        failure.message,
        failure.tape.len(),
        tape.join(","),
        trace.len(),
        path.display(),
        text
    )
}

#[test]
fn seeded_simulation() {
    if let (Some(seed), Ok(tape)) = (env_u64("TUTTI_SIM_SEED"), std::env::var("TUTTI_SIM_TAPE")) {
        // Replays a (shrunk) tape as printed by a failure.
        let tape: Vec<u64> = tape
            .split(',')
            .filter_map(|v| u64::from_str_radix(v.trim(), 16).ok())
            .collect();
        let (r, _, trace) = sim::run(seed, Some(tape), true);
        eprintln!("{}", trace.join("\n"));
        match r {
            Ok(_) => eprintln!("tape of seed {seed}: ok\n1 passed, 0 failed"),
            Err(e) => panic!("tape of seed {seed} FAILED: {e}\n0 passed, 1 failed"),
        }
        return;
    }
    if let Some(seed) = env_u64("TUTTI_SIM_SEED") {
        let (r, tape, trace) = sim::run(seed, None, true);
        match r {
            Ok(stats) => {
                eprintln!("{}", trace.join("\n"));
                eprintln!(
                    "seed {seed}: ok ({} inputs, {} steps, {} crashes, {} draws, sqlite {})",
                    stats.inputs,
                    stats.steps,
                    stats.crashes,
                    tape.len(),
                    stats.sqlite
                );
                eprintln!("1 passed, 0 failed");
            }
            Err(_) => {
                let Err((f, trace)) = sim::check_seed(seed) else {
                    panic!("seed {seed} failed once and passed on replay: the simulation is not deterministic");
                };
                panic!("{}\n0 passed, 1 failed", report(seed, &f, &trace));
            }
        }
        return;
    }
    let n = env_u64("TUTTI_SIM_SEEDS").unwrap_or(10_000);
    let first = env_u64("TUTTI_SIM_FIRST").unwrap_or(0);
    let threads = env_u64("TUTTI_SIM_THREADS")
        .map(|t| t.max(1) as usize)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    let keep_going = std::env::var("TUTTI_SIM_KEEP_GOING").is_ok_and(|v| v == "1");
    let next = AtomicU64::new(first);
    let passed = AtomicUsize::new(0);
    let inputs = AtomicUsize::new(0);
    let crashes = AtomicUsize::new(0);
    let failures: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let seed = next.fetch_add(1, Ordering::Relaxed);
                if seed >= first + n {
                    break;
                }
                // After a failure the others stop (the first one is reported), unless
                // TUTTI_SIM_KEEP_GOING=1 asks for every failing seed.
                if !keep_going && !failures.lock().map(|f| f.is_empty()).unwrap_or(false) {
                    break;
                }
                match sim::check_seed(seed) {
                    Ok(stats) => {
                        passed.fetch_add(1, Ordering::Relaxed);
                        inputs.fetch_add(stats.inputs, Ordering::Relaxed);
                        crashes.fetch_add(stats.crashes, Ordering::Relaxed);
                    }
                    Err((f, trace)) => {
                        let text = report(seed, &f, &trace);
                        eprintln!("{text}");
                        if let Ok(mut v) = failures.lock() {
                            v.push(text);
                        }
                    }
                }
            });
        }
    });
    let secs = start.elapsed().as_secs_f64();
    let passed = passed.into_inner();
    let failed = failures.lock().map(|f| f.len()).unwrap_or(1);
    eprintln!(
        "simulation: {passed} seeds in {secs:.1} s on {threads} threads: {:.0} seeds/s, {} engine inputs, {} crashes",
        passed as f64 / secs.max(1e-9),
        inputs.into_inner(),
        crashes.into_inner()
    );
    eprintln!("{passed} passed, {failed} failed");
    assert_eq!(failed, 0, "the simulation found a failure (see above)");
}

// ----- regressions found by the simulation -----------------------------------------------------
//
// Each test below is the minimal reproduction of a failing seed, through the real adapter and
// engine ([`tutti_testkit::LineDriver`]: `<<` lines come from the provider, `!` lines are the
// user). Every bug below is fixed; each comment describes the bug as it was found, and the test
// fails if it comes back.

/// Feeds ACP lines; returns the driver.
fn acp(lines: &[&str]) -> tutti_testkit::LineDriver {
    let make = || -> Box<dyn tutti_core::adapters::Adapter> {
        Box::new(tutti_core::adapters::acp::AcpAdapter::new(
            "root".into(),
            Default::default(),
        ))
    };
    let d = tutti_testkit::LineDriver::new(make, "acp", None).expect("driver starts");
    d.run(lines.join("\n").as_bytes()).expect("no rule broke")
}

/// A [`Driver`](tutti_core::Driver) host with the reference store, for the races below: the
/// engine decides an input whose batch the host has not committed yet (the daemon commits in
/// groups) while the provider's next line reaches the adapter; the input's provider request
/// reaches the adapter only once its batch is committed.
struct Host {
    d: tutti_core::Driver,
    store: tutti_core::store::MemoryStore,
    history: tutti_testkit::History,
}

impl Host {
    fn new(adapter: Box<dyn tutti_core::adapters::Adapter>, provider: &str) -> Host {
        let mut h = Host {
            d: tutti_core::Driver::new(),
            store: Default::default(),
            history: Default::default(),
        };
        h.d.set_recording(true);
        h.input(0, serde_json::json!({"type":"createSession","agentSessionId":"root","workspaceId":"W","provider":provider}));
        let _ = h.d.handle(
            DriverInput::Attach {
                now: 0,
                root: "root".into(),
                adapter,
            },
            &h.store,
        );
        h.commit();
        h
    }

    /// A host command; not committed yet.
    fn input(&mut self, now: i64, v: serde_json::Value) {
        let input: tutti_core::Input = serde_json::from_value(v).expect("a valid input");
        let _ = self.d.handle(
            DriverInput::Host {
                now,
                input,
                reply: None,
            },
            &self.store,
        );
    }

    /// A line from the provider (must be valid); not committed yet.
    fn native(&mut self, now: i64, v: serde_json::Value) {
        self.d
            .handle(
                DriverInput::Native {
                    now,
                    root: "root",
                    message: &v,
                },
                &self.store,
            )
            .expect("a valid line");
    }

    /// Commits every decided batch (checking every rule) and returns the adapter outputs so far.
    fn commit(&mut self) -> Vec<tutti_core::adapters::AdapterOutput> {
        self.d.commit_pending(&mut self.store);
        tutti_testkit::check_all(self.d.engine(), &self.store, &mut self.history)
            .expect("no rule broke");
        self.d
            .take_records()
            .into_iter()
            .filter_map(|r| match r {
                tutti_core::driver::Record::Adapter { output, .. } => Some(output),
                _ => None,
            })
            .collect()
    }

    fn root_active(&self) -> bool {
        self.d
            .engine()
            .turn("root", "turn-1")
            .expect("root turn")
            .is_active()
    }
}

const ACP_HANDSHAKE: [&str; 2] = [
    r#"<< {"jsonrpc":"2.0","id":0,"result":{"protocolVersion":1,"agentCapabilities":{}}}"#,
    r#"<< {"jsonrpc":"2.0","id":1,"result":{"sessionId":"s"}}"#,
];

/// Regression (simulation seed 1): "every root turn must settle". A user message while an ACP prompt
/// runs is queued by the adapter and sent as the next prompt when the first one answers (no
/// completion is reported in between). The adapter then reports `rootProviderTurnCompleted` with
/// the *second* prompt's provider turn id (`prompt-3`), while `rootProviderTurnStarted` announced
/// `prompt-2`; the engine ignores the completion as a stale provider turn and the root turn stays
/// running forever. Fix (AcpAdapter): complete with the announced id, or announce the
/// continuation prompt.
#[test]
fn regression_acp_guidance_folded_into_the_next_prompt_still_settles_the_root() {
    let mut lines = ACP_HANDSHAKE.to_vec();
    lines.extend([
        "!submit",
        r#"<< {"jsonrpc":"2.0","id":2,"result":{"stopReason":"end_turn"}}"#,
        r#"<< {"jsonrpc":"2.0","id":3,"result":{"stopReason":"end_turn"}}"#,
    ]);
    let d = acp(&lines);
    let turn = d
        .engine()
        .turn("root", "turn-1")
        .expect("root turn")
        .clone();
    assert!(
        !turn.is_active(),
        "root turn stuck {:?}: {:?}",
        turn.phase(),
        turn.root_provider_turn()
    );
}

/// Regression (simulation seed 123, direct provider): a duplicate `rootProviderTurnStarted` delivered
/// after that same provider turn completed (same `providerTurnId`) reopens the root provider
/// lifecycle (phase `running` again). While a child still runs, the root then waits forever for a
/// provider terminal that already came. A provider turn cannot start after it completed: the
/// engine should ignore the repeat (`gate::provider_started`: `Duplicate` when the completed
/// provider turn has the same id), as it does for the reserved case.
#[test]
fn regression_duplicate_root_provider_start_after_its_completion_changes_nothing() {
    use serde_json::json;
    let mut h = tutti_testkit::Harness::new();
    for v in [
        json!({"type":"createSession","agentSessionId":"R","workspaceId":"W","provider":"test"}),
        json!({"type":"submit","agentSessionId":"R","turnId":"T","text":"go"}),
        json!({"type":"rootProviderTurnStarted","agentSessionId":"R","providerTurnId":"p1"}),
        json!({"type":"childSessionCreated","agentSessionId":"C","turnId":"CT","parentAgentSessionId":"R",
            "parentTurnId":"T","rootAgentSessionId":"R","rootTurnId":"T"}),
        json!({"type":"rootProviderTurnCompleted","agentSessionId":"R","providerTurnId":"p1","outcome":"completed"}),
        // The duplicate: same provider turn, after its terminal.
        json!({"type":"rootProviderTurnStarted","agentSessionId":"R","providerTurnId":"p1"}),
        json!({"type":"turnTerminal","agentSessionId":"C","turnId":"CT","outcome":"completed"}),
    ] {
        h.feed_json(v).expect("no rule broke");
    }
    let t = h.engine.turn("R", "T").expect("root turn").clone();
    assert!(
        !t.is_active(),
        "root turn stuck {:?}: {:?}",
        t.phase(),
        t.root_provider_turn()
    );
}

/// Regression (simulation seed 56): a child-only cancel of an ACP child that did not advertise
/// `capabilities.cancel` while it waits for a permission answer. The adapter sends nothing, the
/// cancel deadline settles the child `interrupted` and supersedes its interaction, so nobody can
/// answer the permission request any more, but the agent still waits for it: a foreground child
/// blocks its prompt forever and the root turn never settles. The adapter should answer a
/// canceled child's pending permission requests `cancelled` (as it does for a root cancel; "the
/// provider never waits on a request nobody can answer").
#[test]
fn regression_acp_child_cancel_answers_the_childs_pending_permission() {
    let mut lines = ACP_HANDSHAKE.to_vec();
    lines.extend([
        r#"<< {"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{"sessionUpdate":"tool_call","toolCallId":"d1","title":"Delegate","status":"in_progress"}}}"#,
        r#"<< {"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{"sessionUpdate":"subagent_update","sessionId":"c1","capabilities":{}}}}"#,
        r#"<< {"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{"sessionUpdate":"tool_call_update","toolCallId":"d1","content":[{"type":"session","sessionId":"c1"}]}}}"#,
        r#"<< {"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{"sessionUpdate":"subagent_update","sessionId":"c1","state":{"state":"running"}}}}"#,
        r#"<< {"jsonrpc":"2.0","id":"perm-1","method":"session/request_permission","params":{"sessionId":"c1","toolCall":{"toolCallId":"e1","title":"Edit"},"options":[{"optionId":"allow","name":"Allow","kind":"allow_once"},{"optionId":"reject","name":"Reject","kind":"reject_once"}]}}"#,
        "!cancel-child 0",
        "!timers",
    ]);
    let d = acp(&lines);
    let answered = d
        .native
        .iter()
        .any(|m| m.get("id") == Some(&serde_json::json!("perm-1")));
    assert!(
        answered,
        "the agent still waits for perm-1; the adapter wrote: {:?}",
        d.native
    );
}

/// Regression (simulation seeds 388, 530, 1070): the engine decides a `steer` while the Claude root
/// provider turn runs, but the SDK's `result` for that turn reaches the adapter before the guide
/// request does (two independent channels). The canonical root settles from the `result`; the
/// adapter then still writes `input`, the SDK runs it as a new turn, and the adapter attributes
/// that SDK-started turn (`claude-2`) to the settled canonical root turn: the engine ignores
/// everything in it (children are rejected), a permission callback inside it is never answered
/// (the SDK waits forever), and every later canonical turn queues behind it. The Codex adapter
/// gets `guideFailed` here (`expectedTurnId` no longer matches); the Claude adapter should answer
/// `guideFailed` too when the steered provider turn (`providerTurnId` of the request) already
/// ended, instead of starting new SDK work.
#[test]
fn regression_claude_steer_after_the_steered_turn_ended_fails_instead_of_orphaning() {
    use serde_json::json;
    use tutti_core::RuntimeAnswer;
    let a = tutti_core::adapters::claude::ClaudeAdapter::new("root".into(), Default::default());
    let mut h = Host::new(Box::new(a), "claude");
    let line = |v: serde_json::Value| tutti_core::adapters::claude::sidecar_line(&v, 0).unwrap();
    h.input(
        1,
        json!({"type":"submit","agentSessionId":"root","turnId":"turn-1","text":"go"}),
    );
    h.commit();
    h.native(
        2,
        line(json!({"type":"system","subtype":"init","session_id":"s"})),
    );
    h.commit();
    // The user steers: the engine decides `guide` (steer) now...
    h.input(
        3,
        json!({"type":"submit","agentSessionId":"root","turnId":"turn-2","text":"also"}),
    );
    // ...but the SDK's result arrives before that batch is committed: the canonical root settles.
    h.native(
        3,
        line(
            json!({"type":"result","subtype":"success","is_error":false,"result":"done","session_id":"s"}),
        ),
    );
    assert!(!h.root_active(), "the root settled from the result");
    // The commit releases the guide request to the adapter.
    let outs = h.commit();
    let wrote_input = outs
        .iter()
        .flat_map(|o| &o.native)
        .any(|n| n.get("op") == Some(&json!("input")));
    let failed = outs
        .iter()
        .flat_map(|o| &o.answers)
        .any(|x| matches!(x, RuntimeAnswer::GuideFailed { .. }));
    assert!(failed && !wrote_input, "a steer for an ended provider turn must fail, not start SDK work (input written: {wrote_input})");
}

/// Regression (simulation seed 751): guidance while only a background child runs (`guide` mode
/// `startOnRoot`, decided by the engine) reaches the Claude adapter after the child's
/// `task_notification` made the adapter open the notification continuation `synthetic-1`. The
/// spec says "Guidance submitted during the notification wait remains part of the same canonical
/// root and the same reserved synthetic provider turn", but the adapter opens a second one,
/// `synthetic-2`, and announces it; the SDK reads the input inside the running continuation, so
/// only one `result` comes: it completes `synthetic-1`, which the engine then ignores as stale
/// (the running provider turn is `synthetic-2`), and the root turn never settles.
#[test]
fn regression_claude_guidance_during_the_notification_continuation_joins_it() {
    use serde_json::json;
    let a = tutti_core::adapters::claude::ClaudeAdapter::new("root".into(), Default::default());
    let mut h = Host::new(Box::new(a), "claude");
    let line = |v: serde_json::Value| tutti_core::adapters::claude::sidecar_line(&v, 0).unwrap();
    h.input(
        1,
        json!({"type":"submit","agentSessionId":"root","turnId":"turn-1","text":"go"}),
    );
    h.commit();
    let sdk = |h: &mut Host, v: serde_json::Value| {
        h.native(2, line(v));
        h.commit()
    };
    sdk(
        &mut h,
        json!({"type":"system","subtype":"init","session_id":"s"}),
    );
    sdk(
        &mut h,
        json!({"type":"assistant","message":{"role":"assistant","content":[{"type":"tool_use","id":"tu1","name":"Agent",
        "input":{"description":"bg","prompt":"x","run_in_background":true}}]},"parent_tool_use_id":null,"session_id":"s"}),
    );
    sdk(
        &mut h,
        json!({"type":"system","subtype":"task_started","task_id":"k1","tool_use_id":"tu1","is_backgrounded":true,"session_id":"s"}),
    );
    sdk(
        &mut h,
        json!({"type":"user","message":{"role":"user","content":[{"tool_use_id":"tu1","type":"tool_result","content":"launched"}]},
        "parent_tool_use_id":null,"tool_use_result":{"isAsync":true,"status":"async_launched","agentId":"k1"},"session_id":"s"}),
    );
    sdk(
        &mut h,
        json!({"type":"result","subtype":"success","is_error":false,"result":"done","session_id":"s"}),
    );
    // Only the background child runs; the user writes: the engine decides `startOnRoot`...
    h.input(
        3,
        json!({"type":"submit","agentSessionId":"root","turnId":"turn-2","text":"also"}),
    );
    // ...but the child's notification reaches the adapter before that batch is committed (it
    // opens `synthetic-1`); the commit then releases the guide request to the adapter.
    let outs = sdk(
        &mut h,
        json!({"type":"system","subtype":"task_notification","task_id":"k1","tool_use_id":"tu1","status":"completed","session_id":"s"}),
    );
    let written: Vec<serde_json::Value> = outs.iter().flat_map(|o| o.native.clone()).collect();
    // The sidecar acknowledges what it was sent (a guidance turn is announced on its ack).
    for cmd in written.iter().filter_map(|n| n.get("id").cloned()) {
        sdk(&mut h, json!({"kind":"ack","id":cmd,"ok":true}));
    }
    // The SDK runs the continuation (with the guidance read in it) and answers once.
    sdk(
        &mut h,
        json!({"type":"system","subtype":"init","session_id":"s"}),
    );
    sdk(
        &mut h,
        json!({"type":"assistant","message":{"role":"assistant","content":[{"type":"text","text":"ok"}]},"parent_tool_use_id":null,"session_id":"s"}),
    );
    sdk(
        &mut h,
        json!({"type":"result","subtype":"success","is_error":false,"result":"done","session_id":"s",
        "origin":{"kind":"task-notification"}}),
    );
    let t =
        h.d.engine()
            .turn("root", "turn-1")
            .expect("root turn")
            .clone();
    assert!(
        !t.is_active(),
        "root turn stuck {:?}: {:?}",
        t.phase(),
        t.root_provider_turn()
    );
}

/// Regression (simulation seed 1077): a new canonical root turn starts while the ACP prompt of the
/// previous, canceled turn has not answered yet (the cancel settled at its deadline). The adapter
/// queues the new turn's text as *guidance* of the canceled prompt and re-targets its root turn,
/// so the canceled prompt's `cancelled` answer is reported as the new turn's root provider
/// terminal: the new turn settles `interrupted` ("prompt cancelled") although the user never
/// canceled it, and its message is never sent as a prompt of its own (it is later folded into an
/// unrelated prompt). Expected: the old prompt's answer closes the old turn's provider lifecycle;
/// the new turn gets its own announced prompt.
#[test]
fn regression_acp_new_turn_while_the_canceled_prompt_still_runs_gets_its_own_prompt() {
    let mut lines = ACP_HANDSHAKE.to_vec();
    lines.extend([
        "!cancel",
        "!timers",
        "!submit",
        r#"<< {"jsonrpc":"2.0","id":2,"result":{"stopReason":"cancelled"}}"#,
    ]);
    let d = acp(&lines);
    let t2 = d.engine().turn("root", "turn-2").expect("turn-2").clone();
    assert!(
        t2.is_active(),
        "turn-2 settled {:?} from the canceled prompt of turn-1: {:?}",
        t2.outcome(),
        t2.error()
    );
    let prompted = d.native.iter().any(|m| {
        m.get("method") == Some(&serde_json::json!("session/prompt"))
            && m.get("id") == Some(&serde_json::json!(3))
    });
    assert!(
        prompted,
        "turn-2 never got its own prompt; adapter wrote {:?}",
        d.native
    );
}

/// Regression (simulation seeds 1362, 4725): the same race as the Claude one above, on ACP. The engine
/// decides a `steer` while the root prompt runs; the prompt's answer reaches the adapter first
/// and the root settles; then the guide request arrives and the adapter, seeing no prompt
/// running, sends a new *announced* prompt for the settled root turn. The engine ignores
/// everything of that prompt (its children are rejected); a permission request inside it is
/// never answered, the agent waits forever and the next canonical turn's prompt queues behind
/// it. Expected: `guideFailed` for a steer whose prompt already answered.
#[test]
fn regression_acp_steer_after_the_prompt_answered_fails_instead_of_orphaning() {
    use serde_json::json;
    use tutti_core::RuntimeAnswer;
    let a = tutti_core::adapters::acp::AcpAdapter::new("root".into(), Default::default());
    let mut h = Host::new(Box::new(a), "acp");
    for l in ACP_HANDSHAKE {
        let v: serde_json::Value = serde_json::from_str(l.trim_start_matches("<< ")).unwrap();
        h.native(1, v);
        h.commit();
    }
    h.input(
        2,
        json!({"type":"submit","agentSessionId":"root","turnId":"turn-1","text":"go"}),
    );
    h.commit();
    // The engine decides a steer; the prompt's answer reaches the adapter before that batch is
    // committed, and the root settles.
    h.input(
        3,
        json!({"type":"submit","agentSessionId":"root","turnId":"turn-2","text":"also"}),
    );
    h.native(
        3,
        json!({"jsonrpc":"2.0","id":2,"result":{"stopReason":"end_turn"}}),
    );
    assert!(!h.root_active(), "the root settled from the answer");
    // The commit releases the guide request to the adapter.
    let outs = h.commit();
    let prompted = outs
        .iter()
        .flat_map(|o| &o.native)
        .any(|n| n.get("method") == Some(&json!("session/prompt")));
    let failed = outs
        .iter()
        .flat_map(|o| &o.answers)
        .any(|x| matches!(x, RuntimeAnswer::GuideFailed { .. }));
    assert!(failed && !prompted, "a steer whose prompt already answered must fail, not open a new prompt (prompt sent: {prompted})");
}
