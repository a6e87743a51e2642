//! The driver's invariants, each with a test that fails when the invariant breaks.
//!
//! `Probe` is a minimal adapter: its native messages spell out the adapter output to produce,
//! and it records every call the driver makes.

use super::*;
use crate::adapters::{Adapter, AdapterError, AdapterOutput, AdapterTimer};
use crate::model::CancelState;
use crate::store::{MemoryStore, Store};
use serde_json::json;
use std::sync::{Arc, Mutex};

type Log = Arc<Mutex<Vec<String>>>;

struct Probe {
    log: Log,
    /// Text events `flush_text` emits.
    buffered: Vec<NormalizedEvent>,
}

impl Probe {
    fn boxed() -> (Box<dyn Adapter>, Log) {
        let log = Log::default();
        (
            Box::new(Probe {
                log: log.clone(),
                buffered: Vec::new(),
            }),
            log,
        )
    }
    fn note(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
}

impl Adapter for Probe {
    fn open(&mut self, _: Millis) -> AdapterOutput {
        self.note("open".into());
        AdapterOutput {
            native: vec![json!({"hello": true})],
            ..AdapterOutput::default()
        }
    }
    fn on_request(&mut self, _: Millis, request: &ProviderRequest) -> AdapterOutput {
        let kind = match request {
            ProviderRequest::Start { .. } => "start",
            ProviderRequest::Guide { .. } => "guide",
            ProviderRequest::Cancel { .. } => "cancel",
            ProviderRequest::RespondInteraction { .. } => "respond",
        };
        self.note(format!("request {kind}"));
        AdapterOutput {
            native: vec![json!({ "request": kind })],
            ..AdapterOutput::default()
        }
    }
    fn on_native(&mut self, _: Millis, m: &Value) -> Result<AdapterOutput, AdapterError> {
        if m.get("bad").is_some() {
            return Err(AdapterError::Malformed("probe".into()));
        }
        let list = |k: &str| m.get(k).cloned().unwrap_or(json!([]));
        let timers: Vec<(String, Millis)> = serde_json::from_value(list("timers")).unwrap();
        if let Some(b) = m.get("buffer") {
            self.buffered
                .push(serde_json::from_value(b.clone()).unwrap());
        }
        Ok(AdapterOutput {
            events: serde_json::from_value(list("events")).unwrap(),
            answers: serde_json::from_value(list("answers")).unwrap(),
            native: serde_json::from_value(list("native")).unwrap(),
            timers: timers
                .into_iter()
                .map(|(id, at)| AdapterTimer { id, at })
                .collect(),
            diagnostics: serde_json::from_value(list("diagnostics")).unwrap(),
        })
    }
    fn on_timer(&mut self, now: Millis, id: &str) -> AdapterOutput {
        self.note(format!("timer {id} at {now}"));
        AdapterOutput::default()
    }
    fn on_dropped(&mut self, _: Millis, event: &NormalizedEvent) -> AdapterOutput {
        let NormalizedEvent::InteractionRequested { request_id, .. } = event else {
            return AdapterOutput::default();
        };
        self.note(format!("dropped {request_id}"));
        AdapterOutput {
            native: vec![json!({ "refuse": &**request_id })],
            ..AdapterOutput::default()
        }
    }
    fn flush_text(&mut self, _: Millis) -> AdapterOutput {
        self.note("flush".into());
        AdapterOutput {
            events: std::mem::take(&mut self.buffered),
            ..AdapterOutput::default()
        }
    }
}

/// A host over a [`MemoryStore`] that commits only when told.
struct Host {
    d: Driver,
    store: MemoryStore,
    now: Millis,
    transmits: Vec<Transmit>,
    launches: Vec<LaunchSpec>,
    replies: Vec<(ReplyTo, Result<Step, DriverError>)>,
    published: Vec<PublishedRow>,
    diagnostics: Vec<Diagnostic>,
    /// Batches handed out as [`Output::Persist`] while draining, not committed yet.
    handed: std::collections::VecDeque<super::BatchId>,
}

impl Host {
    fn new() -> Host {
        Host {
            d: Driver::new(),
            store: MemoryStore::new(),
            now: 1_000,
            transmits: Vec::new(),
            launches: Vec::new(),
            replies: Vec::new(),
            published: Vec::new(),
            diagnostics: Vec::new(),
            handed: Default::default(),
        }
    }

    fn input(&mut self, input: impl Into<Input>, reply: Option<ReplyTo>) {
        self.now += 1;
        let _ = self.d.handle(
            DriverInput::Host {
                now: self.now,
                input: input.into(),
                reply,
            },
            &self.store,
        );
    }

    fn native(&mut self, root: &str, m: Value) {
        self.now += 1;
        self.d
            .handle(
                DriverInput::Native {
                    now: self.now,
                    root,
                    message: &m,
                },
                &self.store,
            )
            .unwrap();
    }

    /// Commits every handed-out batch, one by one.
    fn commit(&mut self) {
        while let Some(id) = self.handed.pop_front().or_else(|| self.d.poll_batch()) {
            let Some(b) = self.d.batch(id) else { continue };
            let report = match self.store.apply_group(&[b], true) {
                Ok(mut p) => DriverInput::Committed {
                    batch: id,
                    published: p.pop().unwrap_or_default(),
                },
                Err(e) => DriverInput::NotCommitted {
                    batch: id,
                    why: CommitFailure::Failed(e.to_string()),
                },
            };
            let _ = self.d.handle(report, &self.store);
        }
    }

    /// Commits one batch to the store and tells the driver.
    fn commit_one(&mut self, batch: super::BatchId) {
        let b = self.d.batch(batch).expect("a batch to commit");
        let published = self.store.apply_group(&[b], true).unwrap().pop().unwrap();
        let _ = self
            .d
            .handle(DriverInput::Committed { batch, published }, &self.store);
    }

    /// Tells the driver a batch was not committed.
    fn fail(&mut self, batch: super::BatchId, why: CommitFailure) {
        let _ = self
            .d
            .handle(DriverInput::NotCommitted { batch, why }, &self.store);
    }

    /// Collects every released output.
    fn drain(&mut self) {
        while let Some(o) = self.d.poll_output() {
            match o {
                Output::Persist(id) => self.handed.push_back(id),
                Output::Launch(s) => self.launches.push(s),
                Output::Transmit(t) => self.transmits.push(t),
                Output::Publish(p) => self.published.extend(p.rows),
                Output::Reply { to, result } => self.replies.push((to, result)),
                Output::Diagnostic(d) => self.diagnostics.push(d),
            }
        }
    }

    fn settle(&mut self) {
        for _ in 0..8 {
            self.commit();
            self.drain();
        }
    }

    fn sent(&self) -> Vec<Value> {
        self.transmits
            .iter()
            .flat_map(|t| t.messages.iter().cloned())
            .collect()
    }

    /// A root session `root` with `adapter` attached and turn `t1` started.
    fn started(adapter: Box<dyn Adapter>) -> Host {
        let mut h = Host::new();
        let _ = h.d.handle(
            DriverInput::Attach {
                now: h.now,
                root: "root".into(),
                adapter,
            },
            &h.store,
        );
        h.input(create("root"), None);
        h.input(submit("root", "t1"), Some(1));
        h.settle();
        h
    }
}

fn create(id: &str) -> Command {
    Command::CreateSession {
        agent_session_id: id.into(),
        workspace_id: "W".into(),
        provider: "probe".into(),
        title: None,
        capabilities: None,
    }
}

fn submit(id: &str, turn: &str) -> Command {
    Command::Submit {
        agent_session_id: id.into(),
        turn_id: turn.into(),
        text: "hi".into(),
    }
}

fn child_created(child: &str, turn: &str) -> Value {
    json!({"type":"childSessionCreated","agentSessionId":child,"turnId":turn,
        "parentAgentSessionId":"root","parentTurnId":"t1","rootAgentSessionId":"root","rootTurnId":"t1"})
}

#[test]
fn a_provider_write_a_timer_and_a_reply_wait_for_their_batch_ack() {
    let (adapter, log) = Probe::boxed();
    let mut h = Host::new();
    let _ = h.d.handle(
        DriverInput::Attach {
            now: h.now,
            root: "root".into(),
            adapter,
        },
        &h.store,
    );
    h.drain();
    assert_eq!(
        h.sent(),
        [json!({"hello": true})],
        "the handshake needs no commit"
    );
    h.input(create("root"), None);
    h.settle();
    h.input(submit("root", "t1"), Some(7));
    let id = h.d.poll_batch().expect("the submit's batch");
    h.drain();
    assert_eq!(
        h.sent().len(),
        1,
        "start written before its batch was acked"
    );
    assert!(
        h.replies.is_empty(),
        "reply released before its batch was acked"
    );
    assert!(!log.lock().unwrap().iter().any(|l| l == "request start"));
    h.commit_one(id);
    h.drain();
    assert_eq!(h.sent()[1], json!({"request": "start"}));
    assert_eq!(h.replies.len(), 1);
    assert_eq!(h.replies[0].0, 7);
    assert!(h.published.iter().any(|r| r.kind == "turn"));

    // A cancel's deadline timer is armed only once its batch is acked.
    h.input(
        Command::CancelTurn {
            operation_id: "op1".into(),
            agent_session_id: "root".into(),
            turn_id: "t1".into(),
        },
        Some(8),
    );
    assert_eq!(h.d.poll_timeout(), None, "timer armed before the ack");
    h.drain();
    assert!(!h.sent().contains(&json!({"request": "cancel"})));
    h.settle();
    assert!(h.d.poll_timeout().is_some());
    assert!(h.sent().contains(&json!({"request": "cancel"})));
}

#[test]
fn a_step_without_rows_waits_behind_an_unacked_batch() {
    let (adapter, _) = Probe::boxed();
    let mut h = Host::started(adapter);
    h.input(submit("root", "t2"), Some(2)); // appended to t1: rows
    h.input(submit("nobody", "t3"), Some(3)); // rejected: no rows
    let id = h.d.poll_batch().unwrap();
    h.drain();
    assert!(
        h.replies.iter().all(|(to, _)| *to == 1),
        "a later reply overtook an unacked batch"
    );
    h.commit_one(id);
    h.drain();
    let order: Vec<ReplyTo> = h.replies.iter().map(|(to, _)| *to).collect();
    assert_eq!(order, [1, 2, 3]);
    assert!(matches!(
        h.replies[2].1,
        Err(DriverError::Rejected(Rejected::UnknownSession(_)))
    ));
}

#[test]
fn an_interaction_the_engine_did_not_take_goes_back_to_its_adapter() {
    let (adapter, log) = Probe::boxed();
    let mut h = Host::started(adapter);
    // For a turn that does not exist: rejected.
    h.native(
        "root",
        json!({"events":[{"type":"interactionRequested","agentSessionId":"root","turnId":"nope","requestId":"r1"}]}),
    );
    h.settle();
    assert!(log.lock().unwrap().contains(&"dropped r1".to_string()));
    assert!(h.sent().contains(&json!({"refuse": "r1"})));
    // On the active turn: taken, not given back.
    h.native(
        "root",
        json!({"events":[{"type":"interactionRequested","agentSessionId":"root","turnId":"t1","requestId":"r2"}]}),
    );
    h.settle();
    assert!(!log.lock().unwrap().contains(&"dropped r2".to_string()));
    assert_eq!(h.d.engine().pending_interactions("root").len(), 1);
}

#[test]
fn an_interaction_whose_batch_failed_goes_back_to_its_adapter() {
    let (adapter, log) = Probe::boxed();
    let mut h = Host::started(adapter);
    h.native(
        "root",
        json!({"events":[{"type":"interactionRequested","agentSessionId":"root","turnId":"t1","requestId":"r1"}]}),
    );
    let id = h.d.poll_batch().unwrap();
    h.fail(id, CommitFailure::Failed("disk full".into()));
    h.drain();
    assert!(log.lock().unwrap().contains(&"dropped r1".to_string()));
    assert!(
        h.d.engine().pending_interactions("root").is_empty(),
        "the tree was not reloaded from the store"
    );
}

#[test]
fn a_failed_commit_reloads_the_tree_and_supersedes_its_later_batches() {
    let (adapter, log) = Probe::boxed();
    let mut h = Host::started(adapter);
    h.native("root", json!({"events":[child_created("c1", "c1t")]}));
    h.input(submit("root", "t9"), Some(9)); // appended: decided on the state with c1
    let first = h.d.poll_batch().unwrap();
    let second = h.d.poll_batch().unwrap();
    h.fail(first, CommitFailure::Failed("disk full".into()));
    assert!(
        h.d.batch(second).is_none(),
        "a superseded batch is still offered"
    );
    assert!(h.d.engine().session("c1").is_none(), "tree not reloaded");
    assert!(h.d.engine().session("root").is_some());
    h.drain();
    assert!(matches!(&h.replies[1], (9, Err(DriverError::Storage(_)))));
    assert_eq!(
        log.lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with("request"))
            .count(),
        1,
        "a superseded step reached the adapter"
    );
    // The tree works on: the same child again.
    h.native("root", json!({"events":[child_created("c1", "c1t")]}));
    h.settle();
    assert!(h.store.session("c1").unwrap().is_some());
}

/// A tree waits while any input decided on it is not released (its batch committed or failed)
/// and stops waiting once the last one is; other trees never wait for it.
#[test]
fn a_tree_waits_until_every_input_decided_on_it_is_released() {
    let (adapter, _) = Probe::boxed();
    let mut h = Host::started(adapter);
    assert!(!h.d.is_waiting("root"), "a settled tree waits");
    h.input(create("other"), None);
    h.settle();
    h.native("root", json!({"events":[child_created("c1", "c1t")]}));
    h.input(submit("root", "t2"), Some(2));
    assert!(h.d.is_waiting("root"));
    assert!(
        !h.d.is_waiting("other"),
        "a tree waits for another's inputs"
    );
    let first = h.d.poll_batch().unwrap();
    h.commit_one(first);
    assert!(
        h.d.is_waiting("root"),
        "its second input is still in flight"
    );
    let second = h.d.poll_batch().unwrap();
    h.fail(second, CommitFailure::Failed("disk full".into()));
    h.drain();
    assert!(
        !h.d.is_waiting("root"),
        "a failed input keeps its tree waiting"
    );
    h.input(submit("root", "t3"), Some(3));
    assert!(h.d.is_waiting("root"));
    h.settle();
    assert!(!h.d.is_waiting("root"));
}

#[test]
fn adapter_events_reach_the_engine_before_its_answers() {
    let (adapter, _) = Probe::boxed();
    let mut h = Host::started(adapter);
    h.native("root", json!({"events":[child_created("c1", "c1t")]}));
    h.settle();
    h.input(
        Command::CancelTurn {
            operation_id: "op1".into(),
            agent_session_id: "c1".into(),
            turn_id: "c1t".into(),
        },
        None,
    );
    h.settle();
    let before = h.store.outbox().len();
    // In one output: an answer, and an event. The event's rows are decided (and published)
    // first, whichever order the output lists them in.
    h.native(
        "root",
        json!({
            "answers":[{"type":"cancelResult","operationId":"op1","acked":[{"agentSessionId":"c1","turnId":"c1t"}]}],
            "events":[{"type":"messageAppended","agentSessionId":"root","turnId":"t1","messageId":"m1","role":"assistant","text":"x"}]
        }),
    );
    h.settle();
    let kinds: Vec<&str> = h.store.outbox()[before..]
        .iter()
        .map(|r| r.kind.as_str())
        .collect();
    assert_eq!(kinds.first(), Some(&"message"), "{kinds:?}");
    assert!(kinds.contains(&"cancelOperation"), "{kinds:?}");
}

#[test]
fn a_start_without_an_adapter_launches_and_waits_for_attach() {
    let mut h = Host::new();
    h.input(create("root"), None);
    h.input(submit("root", "t1"), Some(1));
    h.settle();
    assert_eq!(h.launches.len(), 1);
    assert_eq!(&*h.launches[0].provider, "probe");
    assert!(h.sent().is_empty());
    let (adapter, log) = Probe::boxed();
    let _ = h.d.handle(
        DriverInput::Attach {
            now: h.now,
            root: "root".into(),
            adapter,
        },
        &h.store,
    );
    h.drain();
    assert_eq!(
        h.sent(),
        [json!({"hello": true}), json!({"request": "start"})]
    );
    assert_eq!(*log.lock().unwrap(), ["open", "request start"]);
}

#[test]
fn a_factory_makes_the_adapter_of_a_launched_root() {
    let mut h = Host::new();
    let made = Arc::new(Mutex::new(Vec::new()));
    let m = made.clone();
    h.d.set_factory(Box::new(move |spec: &LaunchSpec| {
        m.lock().unwrap().push(spec.root.clone());
        Some(Probe::boxed().0)
    }));
    h.input(create("root"), None);
    h.input(submit("root", "t1"), Some(1));
    h.settle();
    assert_eq!(made.lock().unwrap().len(), 1);
    assert_eq!(
        h.sent(),
        [json!({"hello": true}), json!({"request": "start"})]
    );
}

#[test]
fn a_cancel_without_a_live_adapter_fails_its_operation() {
    let (adapter, _) = Probe::boxed();
    let mut h = Host::started(adapter);
    let _ = h.d.handle(
        DriverInput::Exit {
            now: h.now,
            root: "root",
            error: "gone",
        },
        &h.store,
    );
    h.settle();
    assert!(!h.d.has_adapter("root"));
    h.input(submit("root", "t2"), Some(2));
    h.settle();
    assert_eq!(h.launches.len(), 1, "a start after the exit launches again");
    // The launch is not attached: requests wait for it.
    let _ = h.d.handle(
        DriverInput::Exit {
            now: h.now,
            root: "root",
            error: "could not start",
        },
        &h.store,
    );
    h.settle();
    h.native_err();
    h.input(
        Command::CancelTurn {
            operation_id: "op1".into(),
            agent_session_id: "root".into(),
            turn_id: "t2".into(),
        },
        None,
    );
    h.settle();
    // t2 settled interrupted at the second exit: nothing to cancel. A cancel of a settled
    // turn is rejected, so check the exit settled it.
    assert!(h
        .d
        .engine()
        .session("root")
        .unwrap()
        .active_turn_id
        .is_none());
}

impl Host {
    fn native_err(&mut self) {
        let e = self.d.handle(
            DriverInput::Native {
                now: self.now,
                root: "root",
                message: &json!({}),
            },
            &self.store,
        );
        assert!(matches!(e, Err(DriverError::NoAdapter(_))));
    }
}

#[test]
fn a_cancel_request_with_no_adapter_is_answered_cancel_failed() {
    let (adapter, _) = Probe::boxed();
    let mut h = Host::started(adapter);
    h.native("root", json!({"events":[child_created("c1", "c1t")]}));
    h.settle();
    // The host stops the provider on purpose: the engine is not told.
    assert!(h.d.detach("root").is_some());
    h.input(
        Command::CancelTurn {
            operation_id: "op1".into(),
            agent_session_id: "c1".into(),
            turn_id: "c1t".into(),
        },
        None,
    );
    h.settle();
    let op = h.d.engine().cancel_operation("op1").unwrap();
    assert_eq!(op.state, CancelState::Failed, "{op:?}");
}

#[test]
fn buffered_text_is_flushed_before_a_cancel() {
    let (adapter, log) = Probe::boxed();
    let mut h = Host::started(adapter);
    h.native(
        "root",
        json!({"buffer":{"type":"messageAppended","agentSessionId":"root","turnId":"t1","messageId":"m1","role":"assistant","text":"partial"}}),
    );
    h.settle();
    h.input(
        Command::CancelTurn {
            operation_id: "op1".into(),
            agent_session_id: "root".into(),
            turn_id: "t1".into(),
        },
        None,
    );
    h.settle();
    assert!(log.lock().unwrap().contains(&"flush".to_string()));
    let msgs = h.store.messages("root", None, 100).unwrap();
    assert_eq!(
        msgs.len(),
        2,
        "the buffered text was not recorded: {msgs:?}"
    );
}

#[test]
fn engine_and_adapter_timers_share_one_queue() {
    let (adapter, log) = Probe::boxed();
    let mut h = Host::started(adapter);
    h.native(
        "root",
        json!({"timers":[["late", 90_000], ["soon", 5_000]]}),
    );
    h.settle();
    assert_eq!(h.d.poll_timeout(), Some(5_000));
    let _ = h.d.handle(DriverInput::Timeout(5_000), &h.store);
    assert_eq!(h.d.poll_timeout(), Some(90_000));
    let _ = h.d.handle(DriverInput::Timeout(100_000), &h.store);
    assert_eq!(h.d.poll_timeout(), None);
    let fired: Vec<String> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.starts_with("timer"))
        .cloned()
        .collect();
    assert_eq!(fired, ["timer soon at 5000", "timer late at 100000"]);
}

#[test]
fn an_evicted_tree_is_loaded_on_demand_by_a_child_id() {
    let (adapter, _) = Probe::boxed();
    let mut h = Host::started(adapter);
    h.native("root", json!({"events":[child_created("c1", "c1t")]}));
    h.native(
        "root",
        json!({"events":[{"type":"turnTerminal","agentSessionId":"c1","turnId":"c1t","outcome":"completed"},
            {"type":"rootProviderTurnCompleted","agentSessionId":"root","outcome":"completed"}]}),
    );
    h.settle();
    assert!(h.d.engine().is_quiescent("root"));
    assert!(h.d.evict("root"));
    assert!(h.d.engine().session("root").is_none());
    assert_eq!(h.d.root_of("c1", &h.store).as_deref(), Some("root"));
    h.input(submit("root", "t2"), Some(2));
    h.settle();
    assert!(h.replies.iter().any(|(to, r)| *to == 2 && r.is_ok()));
    assert_eq!(h.d.take_loaded(), [Id::from("root")]);
}

#[test]
fn a_native_message_the_adapter_cannot_use_is_a_typed_error() {
    let (adapter, _) = Probe::boxed();
    let mut h = Host::started(adapter);
    let e = h.d.handle(
        DriverInput::Native {
            now: h.now,
            root: "root",
            message: &json!({"bad": 1}),
        },
        &h.store,
    );
    assert!(matches!(e, Err(DriverError::Adapter(_))));
    let e = h.d.handle(
        DriverInput::Line {
            now: h.now,
            root: "root",
            line: "not json",
        },
        &h.store,
    );
    assert!(matches!(e, Err(DriverError::Adapter(_))));
    assert!(!h.d.is_busy());
}

/// The old runtime logged adapter diagnostics; the driver hands them to the host to log.
#[test]
fn adapter_diagnostics_reach_the_host() {
    let (adapter, _) = Probe::boxed();
    let mut h = Host::started(adapter);
    h.native("root", json!({"diagnostics": ["unknown method x/y"]}));
    h.settle();
    assert_eq!(
        h.diagnostics,
        vec![Diagnostic::Adapter {
            root: "root".into(),
            lines: vec!["unknown method x/y".into()],
        }]
    );
}

/// Issue 19: an internal inconsistency is "a distinct internal error, logged". An input with no
/// caller to answer (here a submit without a reply token, as a timer or provider event would
/// be) surfaces as a diagnostic for the host to log; a caller gets it in its reply instead.
#[test]
fn an_internal_inconsistency_without_a_caller_is_a_diagnostic() {
    let (adapter, _) = Probe::boxed();
    let mut h = Host::started(adapter);
    // Lose the active turn's row, as a damaged store would: the engine relies on it.
    let mut snap = h.d.engine().snapshot("root").expect("loaded");
    snap.turns.retain(|t| &*t.id != "t1");
    let mut engine = crate::Engine::new();
    engine
        .restore(snap)
        .expect("restore does not check activeTurnId");
    h.d = Driver::with_engine(engine);
    h.replies.clear();
    h.input(submit("root", "t2"), None);
    h.input(submit("root", "t3"), Some(7));
    h.settle();
    assert!(
        matches!(
            h.diagnostics.as_slice(),
            [Diagnostic::Internal { input_kind: "submit", error }] if error.is_internal()
        ),
        "{:?}",
        h.diagnostics
    );
    assert!(
        matches!(h.replies.as_slice(), [(7, Err(DriverError::Rejected(r)))] if r.is_internal()),
        "the caller's submit is answered, not logged as a diagnostic: {:?}",
        h.replies
    );
}

/// A batch the store refused by a guard or a fence answers its caller `Refused` (the daemon's
/// 409 `commit_conflict`, issue 21), not a storage error, and reloads the tree like any failed
/// commit.
#[test]
fn a_refused_commit_answers_its_caller_refused_and_reloads_the_tree() {
    let (mut h, first) = with_a_child_batch_decided();
    h.fail(first, CommitFailure::Refused);
    assert!(h.d.engine().session("c1").is_none(), "tree not reloaded");
    h.input(submit("root", "t9"), Some(9));
    let id = h.d.poll_batch().unwrap();
    h.fail(id, CommitFailure::Refused);
    h.drain();
    assert_answered_refused(&h, 9);
}

/// A started host whose root's provider created a child: the batch, decided, not committed.
fn with_a_child_batch_decided() -> (Host, BatchId) {
    let (adapter, _log) = Probe::boxed();
    let mut h = Host::started(adapter);
    h.native("root", json!({"events":[child_created("c1", "c1t")]}));
    let first = h.d.poll_batch().unwrap();
    (h, first)
}

fn assert_answered_refused(h: &Host, token: u64) {
    assert!(
        h.replies
            .iter()
            .any(|r| matches!(r, (t, Err(DriverError::Refused)) if *t == token)),
        "{:?}",
        h.replies
    );
}

/// A host that commits while the driver decides (a commit thread) may hold a command's batch
/// behind an earlier batch of the same tree: when the store refuses that earlier batch by a
/// guard or the fence, the command's batch, decided on the refused state, is never committed,
/// and its caller is answered `Refused` as well (409 `commit_conflict`, to retry), not a
/// storage failure.
#[test]
fn the_later_batches_of_a_refused_batch_answer_their_callers_refused() {
    let (mut h, first) = with_a_child_batch_decided();
    h.input(submit("root", "t9"), Some(9));
    let later =
        h.d.poll_batch()
            .expect("the submit's batch, decided behind the first");
    assert_ne!(first, later);
    h.fail(first, CommitFailure::Refused);
    h.drain();
    assert_answered_refused(&h, 9);
    assert!(h.d.batch(later).is_none(), "the later batch is dropped");
}

/// Issue 34, per-batch fencing: a host tags each batch with what held when it was decided
/// (the daemon: the tree's lease epoch), so it must learn of every decided batch once, in
/// decision order, before it is handed out.
#[test]
fn decided_after_names_each_decided_batch_once_in_order() {
    let (adapter, _) = Probe::boxed();
    let mut h = Host::started(adapter);
    assert!(h.d.decided_after(None).is_empty(), "started: all committed");
    h.input(submit("root", "t2"), Some(2));
    let first = h.d.decided_after(None);
    assert_eq!(first.len(), 1);
    h.input(submit("root", "t3"), Some(3));
    let second = h.d.decided_after(first.last().copied());
    assert_eq!(second.len(), 1, "only the batch decided since");
    assert!(second[0] > first[0]);
    assert_eq!(h.d.decided_after(None), [first[0], second[0]]);
    assert_eq!(
        h.d.poll_batch(),
        Some(first[0]),
        "handed out in the same order"
    );
    assert_eq!(
        h.d.decided_after(None),
        [second[0]],
        "a handed-out batch is not named"
    );
}
