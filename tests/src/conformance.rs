//! The store conformance suite (issue 19 item 3): one generic function, [`run`], that every
//! [`HostStore`] must pass unchanged. It runs against `MemoryStore`, `SqliteStore` (a real file)
//! and `PostgresStore` (a real server).
//!
//! Issue 19: "A store conformance suite, one generic function in the tests crate, runs against
//! `MemoryStore` and `SqliteStore`: guards, idempotent replay of a batch, gap-free outbox,
//! live-tree loading, deletion, reads. The next store must pass it unchanged."
//!
//! The batches are realistic: an [`Engine`] is driven through a workload of root sessions,
//! nested children, transcript, tool calls, interactions, a prepared cancel and deletions
//! ([`World`]); stale batches are either decided by a second engine restored from an older
//! snapshot (the race the guards exist for) or hand-made from stored rows.
//!
//! Each named sub-check panics with its name and what differed. A store may keep every outbox
//! row: the retention check tests only what [`HostStore::prune_outbox`] promises (nothing above
//! `protect` or above the policy's limits is deleted, numbers are never reused, and
//! `outbox_pruned_through` tells what is gone).

use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::fmt::Debug;
use std::sync::Arc;
use tutti_core::input::Input;
use tutti_core::model::{CancelState, Id, Message, Session};
use tutti_core::step::{redacted_payload, redacts, Guard, PersistBatch, Row, REDACTED};
use tutti_core::store::{GroupError, HostStore, OutboxRow, RetentionPolicy};
use tutti_core::{Engine, TreeSnapshot};

/// Runs every check. `make` returns a new, empty store each time it is called; `reopen` closes a
/// store and opens the same data again (for an in-memory store: returns it as it is).
pub fn run<S: HostStore>(mut make: impl FnMut() -> S, mut reopen: impl FnMut(S) -> S)
where
    S::Error: Debug,
{
    reads(make());
    guards_refuse_stale_batches(make());
    replay_is_idempotent(make());
    groups_are_all_or_nothing(make());
    outbox_is_gap_free_and_durable(make(), &mut reopen);
    live_trees_load(make());
    deletion(make());
    cwd(make());
    retention(make());
}

/// The workload's ids.
pub mod ids {
    /// Workspace of every root but [`R4`].
    pub const W: &str = "W";
    /// Root with an active turn, a child `C1` (messages, an interaction) and a nested `C2`.
    pub const R1: &str = "R1";
    /// Settled root with a settled child `C20` (messages, an interaction).
    pub const R2: &str = "R2";
    /// Root whose turn has a prepared cancel operation [`OP3`] over it and its child `C3`.
    pub const R3: &str = "R3";
    /// Root of another workspace.
    pub const R4: &str = "R4";
    /// A deleted root.
    pub const R5: &str = "R5";
    /// The prepared cancel operation of [`R3`].
    pub const OP3: &str = "op3";
}
use ids::*;

/// An engine and the batches it decided, applied to a store as the workload goes.
pub struct World {
    /// The engine that decided every batch so far.
    pub engine: Engine,
    /// Every committed batch, in order, with the seqs the store assigned.
    pub committed: Vec<(PersistBatch, Vec<u64>)>,
    /// The tree of [`R3`] just before its cancel was prepared.
    pub r3_before_cancel: TreeSnapshot,
    /// Time of the next input.
    pub now: i64,
}

fn input(v: Value) -> Input {
    match serde_json::from_value(v.clone()) {
        Ok(i) => i,
        Err(e) => panic!("conformance workload: bad input {v}: {e}"),
    }
}

impl World {
    /// Has the engine decide one input (which it must accept); nothing is applied.
    pub fn decide(&mut self, v: Value) -> PersistBatch {
        self.now += 10;
        let i = input(v.clone());
        match self.engine.handle(self.now, &i) {
            Ok(step) => step.persist,
            Err(e) => panic!("conformance workload: engine rejected {v}: {e}"),
        }
    }

    /// Decides one input and applies its batch (which must pass).
    pub fn feed<S: HostStore>(&mut self, store: &mut S, v: Value) -> Vec<u64>
    where
        S::Error: Debug,
    {
        let b = self.decide(v.clone());
        let seqs = store
            .apply(&b)
            .unwrap_or_else(|e| panic!("conformance workload: store refused {v}: {e:?}"));
        self.committed.push((b, seqs.clone()));
        seqs
    }

    /// Builds the workload's state in `store` (see [`ids`]).
    pub fn build<S: HostStore>(store: &mut S) -> World
    where
        S::Error: Debug,
    {
        let mut w = World {
            engine: Engine::new(),
            committed: Vec::new(),
            r3_before_cancel: TreeSnapshot::default(),
            now: 0,
        };
        let create = |id: &str, ws: &str| json!({"type": "createSession", "agentSessionId": id, "workspaceId": ws, "provider": "codex"});
        let submit = |id: &str, t: &str| json!({"type": "submit", "agentSessionId": id, "turnId": t, "text": "go"});
        let started = |id: &str, p: &str| json!({"type": "rootProviderTurnStarted", "agentSessionId": id, "providerTurnId": p});
        let child = |c: &str, ct: &str, parent: &str, pt: &str, root: &str, rt: &str| json!({"type": "childSessionCreated", "agentSessionId": c, "turnId": ct, "parentAgentSessionId": parent, "parentTurnId": pt, "parentToolCallId": format!("spawn-{c}"), "rootAgentSessionId": root, "rootTurnId": rt});
        let turn_started =
            |c: &str, ct: &str| json!({"type": "turnStarted", "agentSessionId": c, "turnId": ct});
        let message = |s: &str, t: &str, m: &str| json!({"type": "messageAppended", "agentSessionId": s, "turnId": t, "messageId": m, "role": "assistant", "text": format!("text of {m}")});

        // R1: active root turn, child C1 with transcript and a pending interaction, nested C2.
        w.feed(store, create(R1, W));
        w.feed(store, submit(R1, "T1"));
        w.feed(store, started(R1, "p1"));
        w.feed(store, json!({"type": "toolCallUpdated", "agentSessionId": R1, "turnId": "T1", "toolCallId": "spawn-C1", "name": "Task", "status": "in_progress"}));
        w.feed(store, child("C1", "CT1", R1, "T1", R1, "T1"));
        w.feed(store, turn_started("C1", "CT1"));
        for m in ["m1", "m2", "m3", "m4", "m5"] {
            w.feed(store, message("C1", "CT1", m));
        }
        w.feed(store, json!({"type": "interactionRequested", "agentSessionId": "C1", "turnId": "CT1", "requestId": "req1", "providerTurnId": "p1", "kind": "approval"}));
        w.feed(store, child("C2", "CT2", "C1", "CT1", R1, "T1"));

        // R2: settled root turn with a settled child C20.
        w.feed(store, create(R2, W));
        w.feed(store, submit(R2, "T2"));
        w.feed(store, started(R2, "p2"));
        w.feed(store, message(R2, "T2", "r2m1"));
        w.feed(store, child("C20", "CT20", R2, "T2", R2, "T2"));
        w.feed(store, turn_started("C20", "CT20"));
        w.feed(store, message("C20", "CT20", "c20m1"));
        w.feed(store, json!({"type": "interactionRequested", "agentSessionId": "C20", "turnId": "CT20", "requestId": "req20", "providerTurnId": "p2", "kind": "approval"}));
        w.feed(store, json!({"type": "interactionResolved", "agentSessionId": "C20", "turnId": "CT20", "requestId": "req20", "resolution": {"ok": true}}));
        w.feed(store, json!({"type": "turnTerminal", "agentSessionId": "C20", "turnId": "CT20", "outcome": "completed"}));
        w.feed(store, json!({"type": "rootProviderTurnCompleted", "agentSessionId": R2, "providerTurnId": "p2", "outcome": "completed"}));

        // R3: a prepared cancel over the root turn and its child.
        w.feed(store, create(R3, W));
        w.feed(store, submit(R3, "T3"));
        w.feed(store, started(R3, "p3"));
        w.feed(store, child("C3", "CT3", R3, "T3", R3, "T3"));
        w.feed(store, turn_started("C3", "CT3"));
        w.r3_before_cancel = match store.load_tree(R3) {
            Ok(Some(t)) => t,
            other => panic!("conformance workload: tree R3 not loaded: {other:?}"),
        };
        w.feed(
            store,
            json!({"type": "cancelTurn", "operationId": OP3, "agentSessionId": R3, "turnId": "T3"}),
        );

        // R4 in another workspace; R5 created and deleted.
        w.feed(store, create(R4, "W2"));
        w.feed(store, create(R5, W));
        w.feed(
            store,
            json!({"type": "deleteSession", "agentSessionId": R5}),
        );
        w
    }
}

fn ok<T, E: Debug>(check: &str, r: Result<T, E>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("conformance `{check}`: store error: {e:?}"),
    }
}

/// Everything a check can observe of a store after the workload: every tree, the outbox, the
/// last seq and every session's messages.
#[derive(Debug, PartialEq)]
pub struct Fingerprint {
    trees: Vec<Option<TreeSnapshot>>,
    outbox: Vec<OutboxRow>,
    last: u64,
    messages: Vec<Vec<Message>>,
}

impl Fingerprint {
    /// Panics naming the part that differs (and not the whole store).
    fn assert_same(&self, other: &Fingerprint, check: &str, what: &str) {
        if self == other {
            return;
        }
        let part = if self.trees != other.trees {
            let roots: Vec<&str> = ROOTS
                .iter()
                .zip(self.trees.iter().zip(&other.trees))
                .filter(|(_, (a, b))| a != b)
                .map(|(r, _)| *r)
                .collect();
            format!("the trees of {roots:?}")
        } else if self.outbox != other.outbox {
            format!(
                "the outbox ({} rows before, {} after)",
                self.outbox.len(),
                other.outbox.len()
            )
        } else if self.last != other.last {
            format!("the last seq ({} before, {} after)", self.last, other.last)
        } else {
            "the messages".to_string()
        };
        panic!("conformance `{check}`: {what}: {part} changed");
    }
}

/// Every root and session id of the workload (and a few that never exist).
const ROOTS: [&str; 6] = [R1, R2, R3, R4, R5, "RX"];
const SESSIONS: [&str; 12] = [
    R1, "C1", "C2", R2, "C20", R3, "C3", R4, R5, "RX", "CX", "C9",
];

/// The store as the checks see it.
pub fn fingerprint<S: HostStore>(check: &str, s: &S) -> Fingerprint
where
    S::Error: Debug,
{
    Fingerprint {
        trees: ROOTS.iter().map(|r| ok(check, s.load_tree(r))).collect(),
        outbox: ok(check, s.outbox_after(0, usize::MAX)),
        last: ok(check, s.last_outbox_seq()),
        messages: SESSIONS
            .iter()
            .map(|x| ok(check, s.messages(x, None, usize::MAX)))
            .collect(),
    }
}

fn expect_guard_failure<S: HostStore>(check: &str, s: &mut S, b: &PersistBatch, what: &str)
where
    S::Error: Debug,
{
    let before = fingerprint(check, s);
    match s.apply(b) {
        Ok(seqs) => panic!("conformance `{check}`: {what}: stale batch was applied ({seqs:?})"),
        Err(e) => assert!(
            S::is_guard_failure(&e),
            "conformance `{check}`: {what}: refused, but not as a guard failure: {e:?}"
        ),
    }
    before.assert_same(&fingerprint(check, s), check, what);
}

/// A message row no store holds yet, published: proof that a refused batch wrote nothing.
fn fresh_message<S: HostStore>(check: &str, s: &S, id: &str) -> Row
where
    S::Error: Debug,
{
    let mut m = ok(check, s.messages("C1", None, 1))
        .pop()
        .unwrap_or_else(|| panic!("conformance `{check}`: C1 has no message"));
    m.message_id = Id::from(id);
    m.seq = 1000;
    Row::Message(m)
}

fn batch(root: &str, guards: Vec<Guard>, rows: Vec<Row>, outbox: Vec<u32>) -> PersistBatch {
    PersistBatch {
        root_agent_session_id: Some(Id::from(root)),
        workspace_id: Some(Id::from(W)),
        guards: guards.into_iter().collect(),
        rows: rows.into_iter().collect(),
        outbox: outbox.into_iter().collect(),
    }
}

/// Guards: "every batch carries version guards, so two writers that decided on the same state
/// cannot both commit". Each guard kind fails on a stale version and nothing of the batch is
/// written (a message row placed before the guarded row included).
pub fn guards_refuse_stale_batches<S: HostStore>(mut s: S)
where
    S::Error: Debug,
{
    const C: &str = "guards_refuse_stale_batches";
    let mut w = World::build(&mut s);

    // A race: an engine restored from R3 before its cancel decides a child creation; the cancel
    // committed first, so "a child first revealed after the target snapshot must be rejected
    // by persistence".
    let mut late = Engine::new();
    if let Err(e) = late.restore(w.r3_before_cancel.clone()) {
        panic!("conformance `{C}`: restore: {e:?}");
    }
    let raced = late
        .handle(
            w.now + 1,
            &input(json!({"type": "childSessionCreated", "agentSessionId": "CX", "turnId": "CTX", "parentAgentSessionId": R3, "parentTurnId": "T3", "rootAgentSessionId": R3, "rootTurnId": "T3"})),
        )
        .unwrap_or_else(|e| panic!("conformance `{C}`: late engine rejected: {e}"));
    assert!(
        raced
            .persist
            .guards
            .iter()
            .any(|g| matches!(g, Guard::ChildCreationOpen { .. })),
        "conformance `{C}`: a child creation carries ChildCreationOpen"
    );
    expect_guard_failure(
        C,
        &mut s,
        &raced.persist,
        "child created after a prepared cancel",
    );

    // ChildCreationOpen alone (no version guard beside it).
    let op = ok(C, s.cancel_operation(OP3)).unwrap_or_else(|| panic!("{C}: op3 missing"));
    assert_eq!(op.state, CancelState::Prepared);
    let cx = raced
        .persist
        .rows
        .iter()
        .find(|r| matches!(r, Row::Session(x) if &*x.id == "CX"))
        .cloned()
        .unwrap_or_else(|| panic!("{C}: the raced batch writes CX"));
    let b = batch(
        R3,
        vec![Guard::ChildCreationOpen {
            root_turn_id: Id::from("T3"),
            child_agent_session_id: Id::from("CX"),
        }],
        vec![fresh_message(C, &s, "stale-0"), cx],
        vec![0, 1],
    );
    expect_guard_failure(C, &mut s, &b, "ChildCreationOpen on a closed root turn");

    // SessionVersion: decided on an older version, on a future version, and "absent" for a
    // stored session; and "already at next" with a different row (another writer got there).
    let r2 = ok(C, s.session(R2)).unwrap_or_else(|| panic!("{C}: R2 missing"));
    let v = r2.version;
    let mut other = r2.clone();
    other.title = Some("another writer".into());
    for (version, next, row, what) in [
        (
            v - 1,
            v,
            other.clone(),
            "SessionVersion: a different row at next",
        ),
        (
            v + 1,
            v + 2,
            bump_session(&r2, v + 2),
            "SessionVersion: future version",
        ),
        (0, 1, bump_session(&r2, 1), "SessionVersion: expects absent"),
        (
            v - 1,
            v + 1,
            bump_session(&r2, v + 1),
            "SessionVersion: stale by one",
        ),
    ] {
        let b = batch(
            R2,
            vec![Guard::SessionVersion {
                id: Id::from(R2),
                version,
                next,
            }],
            vec![fresh_message(C, &s, "stale-1"), Row::Session(Arc::new(row))],
            vec![0, 1],
        );
        expect_guard_failure(C, &mut s, &b, what);
    }

    // TurnVersion.
    let t2 = ok(C, s.turn("T2")).unwrap_or_else(|| panic!("{C}: T2 missing"));
    let tv = t2.version;
    for (version, next, what) in [
        (tv - 1, tv + 1, "TurnVersion: stale"),
        (tv + 3, tv + 4, "TurnVersion: future"),
        (0, 1, "TurnVersion: expects absent"),
    ] {
        let mut t = t2.clone();
        t.version = next;
        let b = batch(
            R2,
            vec![Guard::TurnVersion {
                id: Id::from("T2"),
                version,
                next,
            }],
            vec![fresh_message(C, &s, "stale-2"), Row::Turn(Arc::new(t))],
            vec![0, 1],
        );
        expect_guard_failure(C, &mut s, &b, what);
    }

    // CancelVersion.
    let ov = op.version;
    let mut failed = op.clone();
    failed.state = CancelState::Failed;
    for (version, next, what) in [
        (ov - 1, ov, "CancelVersion: a different row at next"),
        (ov + 1, ov + 2, "CancelVersion: future"),
        (0, 1, "CancelVersion: expects absent"),
    ] {
        let mut o = failed.clone();
        o.version = next;
        let b = batch(
            R3,
            vec![Guard::CancelVersion {
                id: Id::from(OP3),
                version,
                next,
            }],
            vec![
                fresh_message(C, &s, "stale-3"),
                Row::CancelOperation(Arc::new(o)),
            ],
            vec![0, 1],
        );
        expect_guard_failure(C, &mut s, &b, what);
    }

    // A batch the engine decided earlier, replayed after its entities moved on.
    let old = w
        .committed
        .iter()
        .find(|(b, _)| {
            b.root_agent_session_id.as_deref() == Some(R2)
                && b.guards
                    .iter()
                    .any(|g| matches!(g, Guard::TurnVersion { .. }))
        })
        .map(|(b, _)| b.clone())
        .unwrap_or_else(|| panic!("{C}: no guarded R2 batch"));
    expect_guard_failure(C, &mut s, &old, "an old engine batch replayed late");

    // And the stores' guards do pass on the current versions: the engine goes on.
    w.feed(
        &mut s,
        json!({"type": "submit", "agentSessionId": R2, "turnId": "T2b", "text": "again"}),
    );
}

fn bump_session(s: &Session, version: u64) -> Session {
    let mut s = s.clone();
    s.version = version;
    s.title = Some(format!("v{version}"));
    s
}

/// Idempotent replay: "a replay of this very batch" (a commit whose acknowledgement was lost)
/// passes, writes nothing and publishes nothing.
pub fn replay_is_idempotent<S: HostStore>(mut s: S)
where
    S::Error: Debug,
{
    const C: &str = "replay_is_idempotent";
    let mut w = World::build(&mut s);
    let inputs = [
        json!({"type": "messageAppended", "agentSessionId": "C1", "turnId": "CT1", "messageId": "m6", "role": "assistant", "text": "six"}),
        json!({"type": "respondInteraction", "agentSessionId": "C1", "turnId": "CT1", "requestId": "req1", "response": {"decision": "approve"}}),
        json!({"type": "turnTerminal", "agentSessionId": "C2", "turnId": "CT2", "outcome": "failed"}),
        json!({"type": "cancelResult", "operationId": OP3, "acked": [{"agentSessionId": R3, "turnId": "T3"}, {"agentSessionId": "C3", "turnId": "CT3"}]}),
        json!({"type": "deleteSession", "agentSessionId": R2}),
        json!({"type": "createSession", "agentSessionId": "R6", "workspaceId": W, "provider": "codex"}),
    ];
    let mut replayed = 0;
    for i in inputs {
        let b = match w.engine.handle(w.now + 10, &input(i.clone())) {
            Ok(step) => step.persist,
            // An input this engine version answers without a batch is not a replay case.
            Err(_) => continue,
        };
        w.now += 10;
        let first = ok(C, s.apply(&b));
        let after_first = fingerprint(C, &s);
        let again = s
            .apply(&b)
            .unwrap_or_else(|e| panic!("conformance `{C}`: replay of {i} refused: {e:?}"));
        assert!(
            again.is_empty(),
            "conformance `{C}`: replay of {i} published again: {again:?} (first {first:?})"
        );
        after_first.assert_same(&fingerprint(C, &s), C, &format!("replay of {i}"));
        // Also as a group of one.
        let again = match s.apply_group(&[&b], true) {
            Ok(p) => p,
            Err(e) => panic!("conformance `{C}`: group replay of {i} refused: {e:?}"),
        };
        assert_eq!(again.len(), 1);
        assert!(
            again[0].is_empty(),
            "conformance `{C}`: group replay published"
        );
        after_first.assert_same(&fingerprint(C, &s), C, &format!("group replay of {i}"));
        replayed += 1;
    }
    assert!(
        replayed >= 5,
        "conformance `{C}`: only {replayed} replays ran"
    );
}

/// Group commit: "All or nothing: if any batch fails, nothing of any batch is written, and the
/// error names the failing batch." Guards of a later batch see the earlier batches of the group.
pub fn groups_are_all_or_nothing<S: HostStore>(mut s: S)
where
    S::Error: Debug,
{
    const C: &str = "groups_are_all_or_nothing";
    let mut w = World::build(&mut s);
    let b0 = w.decide(json!({"type": "messageAppended", "agentSessionId": "C1", "turnId": "CT1", "messageId": "g1", "role": "assistant", "text": "g1"}));
    // b1 and b2: the second's guards are on the turn the first creates.
    let b1 =
        w.decide(json!({"type": "submit", "agentSessionId": R2, "turnId": "T2b", "text": "again"}));
    let b2 = w.decide(
        json!({"type": "rootProviderTurnStarted", "agentSessionId": R2, "providerTurnId": "p2b"}),
    );
    assert!(
        b2.guards
            .iter()
            .any(|g| matches!(g, Guard::TurnVersion { id, .. } if &**id == "T2b")),
        "conformance `{C}`: the workload's b2 guards T2b"
    );
    let stale = batch(
        R3,
        vec![Guard::ChildCreationOpen {
            root_turn_id: Id::from("T3"),
            child_agent_session_id: Id::from("CX"),
        }],
        vec![fresh_message(C, &s, "stale-g")],
        vec![0],
    );
    let before = fingerprint(C, &s);
    for (group, index) in [
        (vec![&b0, &b1, &stale, &b2], 2),
        (vec![&stale, &b0], 0),
        (vec![&b0, &b1, &b2, &stale], 3),
        // b2 without b1: its turn does not exist yet.
        (vec![&b0, &b2], 1),
    ] {
        match s.apply_group(&group, true) {
            Ok(p) => panic!("conformance `{C}`: a group with a stale batch committed: {p:?}"),
            Err(GroupError::Batch { index: i, source }) => {
                assert_eq!(
                    i, index,
                    "conformance `{C}`: the error names the failing batch"
                );
                assert!(
                    S::is_guard_failure(&source),
                    "conformance `{C}`: the failing batch failed a guard: {source:?}"
                );
            }
            Err(e) => panic!("conformance `{C}`: not a batch error: {e:?}"),
        }
        before.assert_same(&fingerprint(C, &s), C, "a failed group wrote something");
    }
    let last = before.last;
    let published = match s.apply_group(&[&b0, &b1, &b2], true) {
        Ok(p) => p,
        Err(e) => panic!("conformance `{C}`: a good group was refused: {e:?}"),
    };
    assert_eq!(published.len(), 3);
    let seqs: Vec<u64> = published.iter().flatten().map(|p| p.seq).collect();
    let want: Vec<u64> = (last + 1..=last + seqs.len() as u64).collect();
    assert_eq!(
        seqs, want,
        "conformance `{C}`: group seqs follow the last one, gap-free"
    );
    let expected_rows: usize = [&b0, &b1, &b2].iter().map(|b| b.outbox.len()).sum();
    assert_eq!(
        seqs.len(),
        expected_rows,
        "conformance `{C}`: one outbox row per published row"
    );
    for (b, ps) in [&b0, &b1, &b2].iter().zip(&published) {
        let rows: Vec<u32> = ps.iter().map(|p| p.row).collect();
        assert_eq!(
            rows,
            b.outbox.to_vec(),
            "conformance `{C}`: published row indexes"
        );
        for p in ps {
            let stored = ok(C, s.outbox_after(p.seq - 1, 1));
            let payload: Value = serde_json::from_str(&p.payload)
                .unwrap_or_else(|e| panic!("conformance `{C}`: payload is not JSON: {e}"));
            assert_eq!(stored.len(), 1);
            assert_eq!(
                stored[0].payload, payload,
                "conformance `{C}`: payload as stored"
            );
            assert_eq!(payload, b.rows[p.row as usize].to_json());
        }
    }
    assert_eq!(ok(C, s.last_outbox_seq()), last + seqs.len() as u64);
    assert!(ok(C, s.turn("T2b")).is_some());
    // Without payloads.
    let b3 = w.decide(json!({"type": "messageAppended", "agentSessionId": "C1", "turnId": "CT1", "messageId": "g2", "role": "assistant", "text": "g2"}));
    let p = match s.apply_group(&[&b3], false) {
        Ok(p) => p,
        Err(e) => panic!("conformance `{C}`: {e:?}"),
    };
    assert_eq!(p[0].len(), 1);
    assert_eq!(p[0][0].seq, last + seqs.len() as u64 + 1);
    assert!(
        p[0][0].payload.is_empty(),
        "conformance `{C}`: payload only when asked"
    );
    // An empty group is a no-op.
    match s.apply_group(&[], true) {
        Ok(p) => assert!(p.is_empty()),
        Err(e) => panic!("conformance `{C}`: empty group: {e:?}"),
    }
}

/// The outbox: "monotonic, gap-free, from 1", one row per published row actually written, with
/// the entity's wire form; it survives closing and reopening the store, and numbering goes on.
pub fn outbox_is_gap_free_and_durable<S: HostStore>(mut s: S, reopen: &mut impl FnMut(S) -> S)
where
    S::Error: Debug,
{
    const C: &str = "outbox_is_gap_free_and_durable";
    let mut w = World::build(&mut s);
    let all = ok(C, s.outbox_after(0, usize::MAX));
    let n = all.len() as u64;
    let seqs: Vec<u64> = all.iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs,
        (1..=n).collect::<Vec<_>>(),
        "conformance `{C}`: seqs 1..=n"
    );
    assert_eq!(ok(C, s.last_outbox_seq()), n);
    let assigned: Vec<u64> = w.committed.iter().flat_map(|(_, s)| s.clone()).collect();
    assert_eq!(
        assigned, seqs,
        "conformance `{C}`: apply returned exactly these seqs"
    );
    let mut expected: Vec<(String, Option<Id>, Option<Id>, Value)> = Vec::new();
    for (b, _) in &w.committed {
        // A purge redacts the rows of its sessions published before (see `assert_gone`).
        for r in &b.rows {
            if let Row::PurgeSession { agent_session_id } = r {
                for e in expected.iter_mut() {
                    if e.1 == b.root_agent_session_id && redacts(&e.0, &e.3, agent_session_id) {
                        e.3 = redacted_payload(agent_session_id, &e.0);
                        e.0 = REDACTED.to_string();
                    }
                }
            }
        }
        for &i in &b.outbox {
            let row = &b.rows[i as usize];
            expected.push((
                row.kind().to_string(),
                b.root_agent_session_id.clone(),
                b.workspace_id.clone(),
                row.to_json(),
            ));
        }
    }
    let got: Vec<_> = all
        .iter()
        .map(|r| {
            (
                r.kind.clone(),
                Some(r.root_agent_session_id.clone()),
                Some(r.workspace_id.clone()),
                r.payload.clone(),
            )
        })
        .collect();
    assert_eq!(
        got, expected,
        "conformance `{C}`: outbox rows are the published rows"
    );
    // Paging.
    let mut paged = Vec::new();
    let mut after = 0;
    loop {
        let page = ok(C, s.outbox_after(after, 4));
        assert!(page.len() <= 4);
        let Some(last) = page.last() else { break };
        after = last.seq;
        paged.extend(page);
    }
    assert_eq!(paged, all, "conformance `{C}`: paging");
    assert!(ok(C, s.outbox_after(n, 10)).is_empty());
    assert!(ok(C, s.outbox_after(n + 5, 10)).is_empty());

    let before = fingerprint(C, &s);
    let mut s = reopen(s);
    before.assert_same(&fingerprint(C, &s), C, "reopen");
    let seqs = w.feed(&mut s, json!({"type": "messageAppended", "agentSessionId": "C1", "turnId": "CT1", "messageId": "after-reopen", "role": "assistant", "text": "x"}));
    assert_eq!(
        seqs,
        vec![n + 1],
        "conformance `{C}`: numbering goes on after reopen"
    );
}

/// Live-tree loading: "every tree with an active root turn or a prepared cancel operation",
/// each exactly the engine's tree; an engine restores from them.
pub fn live_trees_load<S: HostStore>(mut s: S)
where
    S::Error: Debug,
{
    const C: &str = "live_trees_load";
    let mut w = World::build(&mut s);
    let live = ok(C, s.load_live_trees());
    let roots: BTreeSet<String> = live
        .iter()
        .filter_map(|t| t.root().map(|r| r.id.to_string()))
        .collect();
    assert_eq!(
        roots,
        [R1, R3].iter().map(|s| s.to_string()).collect(),
        "conformance `{C}`: live roots"
    );
    let mut restored = Engine::new();
    for t in live {
        let root = t.root().map(|r| r.id.to_string()).unwrap_or_default();
        assert_eq!(
            Some(&t),
            w.engine.snapshot(&root).as_ref(),
            "conformance `{C}`: stored tree {root} equals the engine's"
        );
        if let Err(e) = restored.restore(t) {
            panic!("conformance `{C}`: restore {root}: {e:?}");
        }
    }
    for r in [R2, R4, R5] {
        let t = ok(C, s.load_tree(r));
        assert_eq!(t, w.engine.snapshot(r), "conformance `{C}`: tree {r}");
    }
    assert_eq!(
        ok(C, s.load_tree("C1")),
        None,
        "conformance `{C}`: a child is no root"
    );
    assert_eq!(ok(C, s.load_tree("RX")), None);
    // Settling R3's cancel and R1's turn leaves nothing live.
    w.feed(&mut s, json!({"type": "cancelResult", "operationId": OP3, "acked": [{"agentSessionId": R3, "turnId": "T3"}, {"agentSessionId": "C3", "turnId": "CT3"}]}));
    w.feed(
        &mut s,
        json!({"type": "providerExited", "rootAgentSessionId": R1, "error": "exit status 137"}),
    );
    let live = ok(C, s.load_live_trees());
    assert!(
        live.is_empty(),
        "conformance `{C}`: nothing live after settling: {:?}",
        live.iter()
            .filter_map(|t| t.root().map(|r| r.id.clone()))
            .collect::<Vec<_>>()
    );
}

/// Deletion: a deleted session reads as absent, its turns, messages and interactions are
/// gone, its tree keeps the tombstones, `root_of` still finds its tree, and root lists skip it.
pub fn deletion<S: HostStore>(mut s: S)
where
    S::Error: Debug,
{
    const C: &str = "deletion";
    let mut w = World::build(&mut s);
    assert!(ok(C, s.interaction("CT20", "req20")).is_some());
    assert_eq!(ok(C, s.messages("C20", None, 10)).len(), 1);
    w.feed(&mut s, json!({"type": "sessionMetadataUpdated", "agentSessionId": R2, "title": "secret-title-R2", "goal": {"g": "secret-goal-R2"}}));
    let before = ok(C, s.outbox_after(0, usize::MAX));
    w.feed(
        &mut s,
        json!({"type": "deleteSession", "agentSessionId": R2}),
    );
    assert_gone(
        C,
        &s,
        &before,
        R2,
        &[R2, "C20"],
        &[
            "secret-title-R2",
            "secret-goal-R2",
            "text of r2m1",
            "text of c20m1",
        ],
    );
    for id in [R2, "C20"] {
        assert_eq!(
            ok(C, s.session(id)),
            None,
            "conformance `{C}`: {id} reads as absent"
        );
        assert!(
            ok(C, s.session_detail(id)).is_none(),
            "conformance `{C}`: detail {id}"
        );
        assert!(
            ok(C, s.messages(id, None, 10)).is_empty(),
            "conformance `{C}`: messages {id}"
        );
        assert_eq!(
            ok(C, s.root_of(id)).as_deref(),
            Some(R2),
            "conformance `{C}`: root_of {id}"
        );
    }
    for t in ["T2", "CT20"] {
        assert_eq!(
            ok(C, s.turn(t)),
            None,
            "conformance `{C}`: turn {t} removed"
        );
    }
    assert_eq!(ok(C, s.interaction("CT20", "req20")), None);
    let tree = ok(C, s.load_tree(R2)).unwrap_or_else(|| panic!("{C}: tombstoned tree kept"));
    assert_eq!(tree.sessions.len(), 2);
    assert!(tree.sessions.iter().all(|x| x.deleted_at.is_some()));
    assert!(tree.turns.is_empty() && tree.interactions.is_empty() && tree.message_ids.is_empty());
    assert_eq!(
        Some(tree),
        w.engine.snapshot(R2),
        "conformance `{C}`: tombstones as the engine"
    );
    let page = ok(C, s.roots(W, 10, None));
    assert!(page.sessions.iter().all(|x| &*x.id != R2 && &*x.id != R5));
    let last = ok(C, s.outbox_after(0, usize::MAX));
    assert!(
        last.iter()
            .any(|r| r.kind == "sessionDeleted" && r.payload["id"] == R2),
        "conformance `{C}`: the deletion is published"
    );
    // A child subtree: C2 is active under R1's turn, so settle R1 first, then delete C1.
    w.feed(&mut s, json!({"type": "toolCallUpdated", "agentSessionId": "C1", "turnId": "CT1", "toolCallId": "c1-tool", "name": "Read", "status": "completed", "payload": {"out": "secret-tool-C1"}}));
    w.feed(&mut s, json!({"type": "sessionMetadataUpdated", "agentSessionId": "C1", "title": "secret-title-C1"}));
    w.feed(&mut s, json!({"type": "turnTerminal", "agentSessionId": "C2", "turnId": "CT2", "outcome": "completed"}));
    w.feed(&mut s, json!({"type": "turnTerminal", "agentSessionId": "C1", "turnId": "CT1", "outcome": "completed"}));
    w.feed(&mut s, json!({"type": "rootProviderTurnCompleted", "agentSessionId": R1, "providerTurnId": "p1", "outcome": "completed"}));
    let before = ok(C, s.outbox_after(0, usize::MAX));
    w.feed(
        &mut s,
        json!({"type": "deleteSession", "agentSessionId": "C1"}),
    );
    assert_gone(
        C,
        &s,
        &before,
        R1,
        &["C1", "C2"],
        &[
            "secret-tool-C1",
            "secret-title-C1",
            "text of m1",
            "text of m5",
        ],
    );
    assert!(
        ok(C, s.outbox_after(0, usize::MAX))
            .iter()
            .any(|r| r.kind == "toolCall" && r.payload["toolCallId"] == "spawn-C1"),
        "conformance `{C}`: R1's own rows stay as they were"
    );
    assert!(
        ok(C, s.session(R1)).is_some(),
        "conformance `{C}`: the root stays"
    );
    assert!(ok(C, s.turn("T1")).is_some());
    for id in ["C1", "C2"] {
        assert_eq!(
            ok(C, s.session(id)),
            None,
            "conformance `{C}`: {id} deleted"
        );
        assert!(ok(C, s.messages(id, None, 10)).is_empty());
    }
    assert_eq!(ok(C, s.turn("CT1")), None);
    let detail = ok(C, s.session_detail(R1)).unwrap_or_else(|| panic!("{C}: R1 detail"));
    assert_eq!(
        serde_json::to_value(&detail)
            .map(|v| v.to_string().contains("\"C1\""))
            .ok(),
        Some(false),
        "conformance `{C}`: the detail of R1 lists no deleted child"
    );
    assert_eq!(ok(C, s.load_tree(R1)), w.engine.snapshot(R1));
}

/// Issue 36: "Deleted means gone: a deletion removes the subtree's content (messages, tool
/// calls, interaction payloads, titles) from the store and from the outbox rows still kept,
/// leaving a tombstone with ids only." After `sessions` of tree `root` were deleted: every row
/// kept `before` the deletion is still there under its seq (gap-free), a row of those sessions
/// is redacted (kind `redacted`, payload `{agentSessionId, kind}`), every other row is as it
/// was, no kept row or tombstone holds any of `markers`, and the tombstones have no title or
/// goal.
fn assert_gone<S: HostStore>(
    check: &str,
    s: &S,
    before: &[OutboxRow],
    root: &str,
    sessions: &[&str],
    markers: &[&str],
) where
    S::Error: Debug,
{
    let after = ok(check, s.outbox_after(0, usize::MAX));
    assert!(
        after.windows(2).all(|p| p[1].seq == p[0].seq + 1),
        "conformance `{check}`: the outbox stays gap-free"
    );
    let mut redacted = 0;
    for b in before {
        let a = after
            .iter()
            .find(|a| a.seq == b.seq)
            .unwrap_or_else(|| panic!("conformance `{check}`: row {} kept", b.seq));
        match sessions.iter().find(|id| redacts(&b.kind, &b.payload, id)) {
            Some(id) => {
                redacted += 1;
                assert_eq!(
                    (
                        a.kind.as_str(),
                        &a.payload,
                        &a.root_agent_session_id,
                        &a.workspace_id
                    ),
                    (
                        REDACTED,
                        &redacted_payload(id, &b.kind),
                        &b.root_agent_session_id,
                        &b.workspace_id
                    ),
                    "conformance `{check}`: row {} of {id} redacted",
                    b.seq
                );
            }
            None => assert_eq!(a, b, "conformance `{check}`: row {} unchanged", b.seq),
        }
    }
    assert!(redacted > 0, "conformance `{check}`: rows were redacted");
    let tree = ok(check, s.load_tree(root))
        .unwrap_or_else(|| panic!("conformance `{check}`: tree {root} kept"));
    for t in tree.sessions.iter().filter(|x| sessions.contains(&&*x.id)) {
        assert!(
            t.title.is_none() && t.goal.is_none() && t.deleted_at.is_some(),
            "conformance `{check}`: tombstone {} holds ids only: {t:?}",
            t.id
        );
    }
    let text = format!(
        "{}{}",
        serde_json::to_string(&after).unwrap_or_default(),
        serde_json::to_string(&tree).unwrap_or_default()
    );
    for m in markers {
        assert!(
            !text.contains(m),
            "conformance `{check}`: deleted text {m:?} still readable"
        );
    }
}

/// Reads: sessions, turns, details, messages paging, interactions, cancel operations, roots
/// paging newest first with cursors, `root_of`, consistent reads and the checkpoint hook.
pub fn reads<S: HostStore>(mut s: S)
where
    S::Error: Debug,
{
    const C: &str = "reads";
    let w = World::build(&mut s);
    let e = &w.engine;
    for id in [R1, "C1", "C2", R2, "C20", R3, "C3", R4] {
        assert_eq!(
            ok(C, s.session(id)).as_ref(),
            e.session(id),
            "conformance `{C}`: session {id}"
        );
    }
    assert_eq!(
        ok(C, s.session(R5)),
        None,
        "conformance `{C}`: a tombstone reads as absent"
    );
    assert_eq!(ok(C, s.session("nope")), None);
    for (sid, t) in [
        (R1, "T1"),
        ("C1", "CT1"),
        (R2, "T2"),
        ("C20", "CT20"),
        (R3, "T3"),
    ] {
        assert_eq!(
            ok(C, s.turn(t)).as_ref(),
            e.turn(sid, t),
            "conformance `{C}`: turn {t}"
        );
    }
    assert_eq!(ok(C, s.turn("nope")), None);
    // Session detail: the session and every nested child, flat.
    let d = ok(C, s.session_detail(R1)).unwrap_or_else(|| panic!("{C}: R1 detail"));
    let text = serde_json::to_string(&d).unwrap_or_default();
    assert!(
        text.contains("\"C1\"") && text.contains("\"C2\""),
        "conformance `{C}`: detail lists C1, C2"
    );
    assert!(ok(C, s.session_detail("C1")).is_some());
    assert!(ok(C, s.session_detail("nope")).is_none());
    // Messages, paged.
    let all = ok(C, s.messages("C1", None, usize::MAX));
    let texts: Vec<&str> = all.iter().map(|m| &*m.message_id).collect();
    assert_eq!(
        texts,
        ["m1", "m2", "m3", "m4", "m5"],
        "conformance `{C}`: messages in order"
    );
    let seqs: Vec<u64> = all.iter().map(|m| m.seq).collect();
    assert!(seqs.windows(2).all(|p| p[0] < p[1]));
    assert_eq!(ok(C, s.messages("C1", None, 2)), all[..2].to_vec());
    assert_eq!(
        ok(C, s.messages("C1", Some(seqs[1]), 2)),
        all[2..4].to_vec()
    );
    assert_eq!(
        ok(C, s.messages("C1", Some(seqs[3]), 10)),
        all[4..].to_vec()
    );
    assert!(ok(C, s.messages("C1", Some(seqs[4]), 10)).is_empty());
    assert!(ok(C, s.messages("C2", None, 10)).is_empty());
    // The prompt and r2m1.
    assert_eq!(
        ok(C, s.messages(R2, None, 10)).len(),
        2,
        "conformance `{C}`: R2 messages"
    );
    // Interactions, cancel operations.
    let i = ok(C, s.interaction("CT1", "req1")).unwrap_or_else(|| panic!("{C}: req1"));
    assert_eq!(&*i.agent_session_id, "C1");
    assert_eq!(
        Some(&i),
        e.pending_interactions(R1)
            .iter()
            .find(|x| &*x.request_id == "req1")
    );
    assert_eq!(ok(C, s.interaction("CT1", "nope")), None);
    assert_eq!(ok(C, s.interaction("CT2", "req1")), None);
    let op = ok(C, s.cancel_operation(OP3)).unwrap_or_else(|| panic!("{C}: op3"));
    assert_eq!(Some(&op), e.cancel_operation(OP3));
    assert_eq!(ok(C, s.cancel_operation("nope")), None);
    // root_of.
    for (x, root) in [
        (R1, Some(R1)),
        ("C1", Some(R1)),
        ("C2", Some(R1)),
        ("C3", Some(R3)),
        (R5, Some(R5)),
        ("nope", None),
    ] {
        assert_eq!(
            ok(C, s.root_of(x)).as_deref(),
            root,
            "conformance `{C}`: root_of {x}"
        );
    }
    assert_eq!(ok(C, s.root_of_cancel_operation(OP3)).as_deref(), Some(R3));
    assert_eq!(ok(C, s.root_of_cancel_operation("nope")), None);
    // Roots: newest first (R3, R2, R1 by createdAt), tombstones and other workspaces excluded.
    let first = ok(C, s.roots(W, 2, None));
    let ids: Vec<&str> = first.sessions.iter().map(|x| &*x.id).collect();
    assert_eq!(ids, [R3, R2], "conformance `{C}`: first page newest first");
    let cursor = first
        .next
        .clone()
        .unwrap_or_else(|| panic!("{C}: a next cursor"));
    let second = ok(C, s.roots(W, 2, Some(&cursor)));
    let ids: Vec<&str> = second.sessions.iter().map(|x| &*x.id).collect();
    assert_eq!(ids, [R1], "conformance `{C}`: second page");
    assert_eq!(
        second.next, None,
        "conformance `{C}`: no page after the last"
    );
    let one = ok(C, s.roots(W, 0, None));
    assert_eq!(
        one.sessions.len(),
        1,
        "conformance `{C}`: limit is at least 1"
    );
    let whole = ok(C, s.roots(W, 10, None));
    assert_eq!(whole.sessions.len(), 3);
    assert_eq!(whole.next, None);
    assert_eq!(Some(&whole.sessions[0]), e.session(R3));
    let other: Vec<Id> = ok(C, s.roots("W2", 10, None))
        .sessions
        .into_iter()
        .map(|x| x.id)
        .collect();
    assert_eq!(other, vec![Id::from(R4)]);
    assert!(ok(C, s.roots("none", 10, None)).sessions.is_empty());
    // Consistent reads and the checkpoint hook.
    let (a, b) = ok(
        C,
        s.read_consistent(|st| (st.session(R1).ok().flatten(), st.last_outbox_seq().ok())),
    );
    assert_eq!(a.as_ref(), e.session(R1));
    assert_eq!(b, Some(ok(C, s.last_outbox_seq())));
    let before = fingerprint(C, &s);
    ok(C, s.checkpoint());
    before.assert_same(&fingerprint(C, &s), C, "checkpoint");
}

/// The provider's working directory per root.
pub fn cwd<S: HostStore>(mut s: S)
where
    S::Error: Debug,
{
    const C: &str = "cwd";
    assert_eq!(ok(C, s.session_cwd(R1)), None);
    ok(C, s.set_session_cwd(R1, "/work/a"));
    ok(C, s.set_session_cwd(R2, "/work/b"));
    assert_eq!(ok(C, s.session_cwd(R1)).as_deref(), Some("/work/a"));
    ok(C, s.set_session_cwd(R1, "/work/c"));
    assert_eq!(
        ok(C, s.session_cwd(R1)).as_deref(),
        Some("/work/c"),
        "conformance `{C}`: replaced"
    );
    assert_eq!(ok(C, s.session_cwd(R2)).as_deref(), Some("/work/b"));
    assert_eq!(ok(C, s.session_cwd(R3)), None);
}

/// Retention: what [`HostStore::prune_outbox`] promises. A store may keep every row; one that
/// prunes deletes only expired rows at or below `protect`, says so in `outbox_pruned_through`,
/// keeps every later row, and never reuses a number.
pub fn retention<S: HostStore>(mut s: S)
where
    S::Error: Debug,
{
    const C: &str = "retention";
    let mut w = World::build(&mut s);
    let all = ok(C, s.outbox_after(0, usize::MAX));
    let n = all.len() as u64;
    assert!(n > 10);
    assert_eq!(
        ok(C, s.outbox_pruned_through()),
        0,
        "conformance `{C}`: nothing pruned yet"
    );
    let policy = RetentionPolicy {
        keep_rows: Some(2),
        max_age_ms: None,
    };
    let kept = |s: &S, through: u64| {
        let rest = ok(C, s.outbox_after(0, usize::MAX));
        let want: Vec<OutboxRow> = all.iter().filter(|r| r.seq > through).cloned().collect();
        assert_eq!(
            rest, want,
            "conformance `{C}`: exactly the rows above {through} remain"
        );
    };
    // Protected: nothing above 3 goes.
    let o = ok(C, s.prune_outbox(&policy, 1_000_000, Some(3), 1000));
    assert!(
        o.pruned_through <= 3,
        "conformance `{C}`: protect holds: {o:?}"
    );
    assert_eq!(ok(C, s.outbox_pruned_through()), o.pruned_through);
    assert_eq!(
        o.deleted as u64, o.pruned_through,
        "conformance `{C}`: deleted count"
    );
    kept(&s, o.pruned_through);
    // Unprotected, bounded by the count limit: the newest 2 stay.
    let p = ok(C, s.prune_outbox(&policy, 1_000_000, None, 1000));
    assert!(
        p.pruned_through >= o.pruned_through && p.pruned_through <= n - 2,
        "{p:?}"
    );
    assert_eq!(ok(C, s.outbox_pruned_through()), p.pruned_through);
    kept(&s, p.pruned_through);
    // A policy that expires nothing deletes nothing.
    let keep_all = RetentionPolicy {
        keep_rows: None,
        max_age_ms: None,
    };
    let q = ok(C, s.prune_outbox(&keep_all, 1_000_000, None, 1000));
    assert_eq!(q.deleted, 0);
    kept(&s, p.pruned_through);
    assert_eq!(
        ok(C, s.last_outbox_seq()),
        n,
        "conformance `{C}`: the last seq stays"
    );
    let seqs = w.feed(&mut s, json!({"type": "messageAppended", "agentSessionId": "C1", "turnId": "CT1", "messageId": "after-prune", "role": "assistant", "text": "x"}));
    assert_eq!(
        seqs,
        vec![n + 1],
        "conformance `{C}`: numbers are never reused"
    );
    // Readers still get the message whose outbox row may be gone.
    assert_eq!(ok(C, s.messages("C1", None, usize::MAX)).len(), 6);
    // Tombstones go too, once none of their tree's rows is left (a store that prunes).
    w.feed(
        &mut s,
        json!({"type": "deleteSession", "agentSessionId": R2}),
    );
    let everything = RetentionPolicy {
        keep_rows: Some(0),
        max_age_ms: None,
    };
    let r = ok(C, s.prune_outbox(&everything, 2_000_000, None, 100_000));
    if r.pruned_through == ok(C, s.last_outbox_seq()) {
        for (id, root) in [(R2, R2), ("C20", R2), (R5, R5)] {
            assert_eq!(
                ok(C, s.root_of(id)),
                None,
                "conformance `{C}`: tombstone {id} removed"
            );
            assert!(ok(C, s.load_tree(root)).is_none());
        }
        assert_eq!(
            ok(C, s.load_tree(R1)),
            w.engine.snapshot(R1),
            "conformance `{C}`: live trees stay"
        );
    } else {
        assert_eq!(r.pruned_through, 0, "conformance `{C}`: {r:?}");
    }
}
