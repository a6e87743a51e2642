//! Guards with two writers: "Preparing the durable root cancel operation also closes child
//! creation for that root turn ... A child first revealed after the target snapshot must be
//! rejected by persistence even if its event races ahead of the cancel completion transaction."
//!
//! Two connections on one file, two engines restored from the same snapshot: one decides
//! `childSessionCreated`, the other `cancelTurn` on the root turn. Whichever commits second is
//! rejected by a guard, so exactly the spec's outcome survives.

mod support;

use std::sync::Barrier;
use tutti_core::input::{Command, Input, NormalizedEvent};
use tutti_core::invariants::check_tree;
use tutti_core::model::{CancelState, Id, Target};
use tutti_core::step::Guard;
use tutti_core::store::{MemoryStore, Store};
use tutti_core::{Engine, PersistBatch, Step, TreeSnapshot};
use tutti_sqlite::{OpenOptions, ReplayRule, SqliteError, SqliteStore};

fn id(s: &str) -> Id {
    Id::from(s)
}

fn handle(engine: &mut Engine, now: i64, input: impl Into<Input>) -> Step {
    engine
        .handle(now, &input.into())
        .unwrap_or_else(|e| panic!("engine rejected: {e}"))
}

/// Root `r` with active root turn `t-r` (provider running) and one active child `c1-r`.
fn setup(db: &mut SqliteStore, r: &str) -> TreeSnapshot {
    let mut e = Engine::new();
    let t = format!("t-{r}");
    let steps = [
        handle(
            &mut e,
            1,
            Command::CreateSession {
                agent_session_id: id(r),
                workspace_id: id("w"),
                provider: id("codex"),
                title: None,
                capabilities: None,
            },
        ),
        handle(
            &mut e,
            2,
            Command::Submit {
                agent_session_id: id(r),
                turn_id: id(&t),
                text: "go".into(),
            },
        ),
        handle(
            &mut e,
            3,
            NormalizedEvent::RootProviderTurnStarted {
                agent_session_id: id(r),
                turn_id: None,
                provider_turn_id: Some("p1".into()),
            },
        ),
        handle(&mut e, 4, child_event(r, "c1")),
    ];
    for s in &steps {
        db.apply(&s.persist).expect("setup applies");
    }
    db.load_tree(r).expect("load").expect("tree exists")
}

fn child_event(r: &str, c: &str) -> NormalizedEvent {
    NormalizedEvent::ChildSessionCreated {
        agent_session_id: id(&format!("{c}-{r}")),
        turn_id: id(&format!("{c}t-{r}")),
        parent_agent_session_id: id(r),
        parent_turn_id: id(&format!("t-{r}")),
        parent_tool_call_id: Some(id(&format!("call-{c}-{r}"))),
        root_agent_session_id: id(r),
        root_turn_id: id(&format!("t-{r}")),
        title: None,
        provider_session_id: None,
        provider_aliases: None,
    }
}

fn cancel_command(r: &str, op: &str) -> Command {
    Command::CancelTurn {
        operation_id: id(op),
        agent_session_id: id(r),
        turn_id: id(&format!("t-{r}")),
    }
}

/// Both decisions, each by its own engine restored from the same snapshot.
fn decide(snap: &TreeSnapshot, r: &str, op: &str) -> (PersistBatch, PersistBatch) {
    let mut a = Engine::new();
    a.restore(snap.clone()).expect("restore a");
    let mut b = Engine::new();
    b.restore(snap.clone()).expect("restore b");
    let child = handle(&mut a, 10, child_event(r, "c2")).persist;
    let cancel = handle(&mut b, 11, cancel_command(r, op)).persist;
    (child, cancel)
}

fn targets(db: &SqliteStore, op: &str) -> Vec<Target> {
    db.cancel_operation(op)
        .expect("read")
        .expect("operation stored")
        .targets
}

fn target(r: &str, c: &str) -> Target {
    Target {
        agent_session_id: id(&format!("{c}-{r}")),
        turn_id: id(&format!("{c}t-{r}")),
    }
}

fn assert_sound(db: &SqliteStore, r: &str) {
    let tree = db.load_tree(r).expect("load").expect("tree");
    let v = check_tree(&tree);
    assert!(
        v.is_empty(),
        "invariants broken in the stored tree {r}: {v:?}"
    );
}

fn two_stores() -> (tempfile::TempDir, SqliteStore, SqliteStore) {
    let (dir, path) = support::temp_db();
    let a = SqliteStore::open(&path).expect("open a");
    let b = SqliteStore::open(&path).expect("open b");
    (dir, a, b)
}

/// The cancel commits first: the child batch is rejected (child creation is closed) and no
/// child exists; the child is also refused by the engine after reload.
#[test]
fn cancel_first_then_the_racing_child_is_rejected_by_persistence() {
    let (_dir, mut a, mut b) = two_stores();
    let snap = setup(&mut a, "r");
    let (child, cancel) = decide(&snap, "r", "op");

    b.apply(&cancel).expect("the cancel commits");
    let err = a.apply(&child).expect_err("the child is rejected");
    assert!(err.is_guard_failure(), "{err}");
    assert!(
        matches!(
            err.guard(),
            Some(Guard::ChildCreationOpen { .. }) | Some(Guard::TurnVersion { .. })
        ),
        "{err}"
    );
    assert_eq!(a.session("c2-r").expect("read"), None, "no child exists");
    assert_eq!(a.turn("c2t-r").expect("read"), None);
    let t = targets(&a, "op");
    assert!(t.contains(&target("r", "c1")));
    assert!(!t.iter().any(|x| x.agent_session_id.as_ref() == "c2-r"));

    // Crash-only: drop the tree, reload, and the engine itself now refuses the child.
    let mut e = Engine::new();
    e.restore(a.load_tree("r").expect("load").expect("tree"))
        .expect("restore");
    assert!(e.handle(12, &child_event("r", "c2").into()).is_err());
    assert_sound(&a, "r");
}

/// The child commits first: the cancel batch's target set is stale, so it is rejected by the
/// root turn's version guard; re-decided after reload, the child IS among the targets.
#[test]
fn child_first_then_the_stale_cancel_is_rejected_and_redecided_with_the_child() {
    let (_dir, mut a, mut b) = two_stores();
    let snap = setup(&mut a, "r");
    let (child, cancel) = decide(&snap, "r", "op");

    a.apply(&child).expect("the child commits");
    let err = b.apply(&cancel).expect_err("the stale cancel is rejected");
    assert!(
        matches!(err.guard(), Some(Guard::TurnVersion { id, .. }) if id.as_ref() == "t-r"),
        "{err}"
    );
    assert_eq!(
        b.cancel_operation("op").expect("read"),
        None,
        "nothing of it was written"
    );
    let root_turn = b.turn("t-r").expect("read").expect("root turn");
    assert!(!root_turn.child_creation_closed());

    let mut e = Engine::new();
    e.restore(b.load_tree("r").expect("load").expect("tree"))
        .expect("restore");
    let again = handle(&mut e, 12, cancel_command("r", "op"));
    b.apply(&again.persist)
        .expect("the re-decided cancel commits");
    let t = targets(&b, "op");
    assert!(t.contains(&target("r", "c1")), "{t:?}");
    assert!(
        t.contains(&target("r", "c2")),
        "the child is a target: {t:?}"
    );
    assert_sound(&b, "r");
}

/// Why the default replay rule is not the reference store's `stored >= next`: both decisions
/// move the root turn from version v to v + 1, so under that rule the stale cancel passes its
/// guard, its root-turn row is skipped as "already written", and the stored tree has a prepared
/// root cancel whose target set misses a live child (the invariant checker flags it). This pins
/// the reason for `ReplayRule::SameRowAtNext`; see the crate docs.
#[test]
fn reference_replay_rule_cannot_see_the_race() {
    let (_dir, path) = support::temp_db();
    let opts = OpenOptions::new().replay_rule(ReplayRule::AtOrPastNext);
    let mut a = SqliteStore::open_with(&path, &opts).expect("open a");
    let mut b = SqliteStore::open_with(&path, &opts).expect("open b");
    let snap = setup(&mut a, "r");
    let (child, cancel) = decide(&snap, "r", "op");
    a.apply(&child).expect("the child commits");
    b.apply(&cancel)
        .expect("the reference rule lets the stale cancel through");
    let tree = b.load_tree("r").expect("load").expect("tree");
    assert!(!check_tree(&tree).is_empty());

    // The reference store follows the default rule (`SameRowAtNext`): it rejects the stale cancel.
    let mut mem = MemoryStore::new();
    mem.apply(&seed_batch(&snap)).expect("seed");
    mem.apply(&child).expect("child");
    assert!(
        mem.apply(&cancel).is_err(),
        "the stale cancel is rejected by the reference store too"
    );
}

/// A batch that writes a whole snapshot (to seed a reference store).
fn seed_batch(s: &TreeSnapshot) -> PersistBatch {
    use std::sync::Arc;
    use tutti_core::Row;
    let mut rows: Vec<Row> = s
        .sessions
        .iter()
        .cloned()
        .map(|s| Row::Session(Arc::new(s)))
        .collect();
    rows.extend(s.turns.iter().cloned().map(|t| Row::Turn(Arc::new(t))));
    rows.extend(
        s.interactions
            .iter()
            .cloned()
            .map(|i| Row::Interaction(Arc::new(i))),
    );
    rows.extend(
        s.tool_calls
            .iter()
            .cloned()
            .map(|c| Row::ToolCall(Arc::new(c))),
    );
    rows.extend(
        s.cancel_operations
            .iter()
            .cloned()
            .map(|o| Row::CancelOperation(Arc::new(o))),
    );
    PersistBatch {
        rows: rows.into(),
        ..PersistBatch::default()
    }
}

/// Real threads on two connections, many times: exactly one of the two commits each time, the
/// loser is rejected by a guard, and the spec's outcome holds (a prepared root cancel's target
/// set contains every child of its root turn, re-decided after reload when it lost).
#[test]
fn threads_racing_child_creation_against_cancel_preparation() {
    let (_dir, mut a, mut b) = two_stores();
    let rounds = 60;
    let (mut cancel_won, mut child_won) = (0, 0);
    for i in 0..rounds {
        let r = format!("r{i}");
        let op = format!("op{i}");
        let snap = setup(&mut a, &r);
        let (child, cancel) = decide(&snap, &r, &op);
        let barrier = Barrier::new(2);
        let (ra, rb): (Result<Vec<u64>, SqliteError>, Result<Vec<u64>, SqliteError>) =
            std::thread::scope(|s| {
                let ha = s.spawn(|| {
                    barrier.wait();
                    a.apply(&child)
                });
                let hb = s.spawn(|| {
                    barrier.wait();
                    b.apply(&cancel)
                });
                (ha.join().expect("thread a"), hb.join().expect("thread b"))
            });
        match (ra, rb) {
            (Err(e), Ok(_)) => {
                assert!(e.is_guard_failure(), "{e}");
                cancel_won += 1;
                assert_eq!(a.session(&format!("c2-{r}")).expect("read"), None);
                let t = targets(&a, &op);
                assert!(t.contains(&target(&r, "c1")));
                assert!(!t.contains(&target(&r, "c2")));
            }
            (Ok(_), Err(e)) => {
                assert!(e.is_guard_failure(), "{e}");
                child_won += 1;
                assert_eq!(b.cancel_operation(&op).expect("read"), None);
                let mut eng = Engine::new();
                eng.restore(b.load_tree(&r).expect("load").expect("tree"))
                    .expect("restore");
                let again = handle(&mut eng, 12, cancel_command(&r, &op));
                b.apply(&again.persist).expect("re-decided cancel commits");
                assert!(targets(&b, &op).contains(&target(&r, "c2")));
            }
            (ra, rb) => panic!("round {i}: exactly one must commit: {ra:?} / {rb:?}"),
        }
        let op_row = a.cancel_operation(&op).expect("read").expect("op");
        assert_eq!(op_row.state, CancelState::Prepared);
        assert_sound(&a, &r);
    }
    println!("{rounds} rounds: cancel committed first {cancel_won}, child first {child_won}");
}

/// Group commit: a failing batch rolls the whole group back and names itself; the caller then
/// goes on batch by batch.
#[test]
fn a_failing_batch_rolls_back_its_whole_group_and_is_named() {
    let (_dir, mut a, mut b) = two_stores();
    let snap = setup(&mut a, "r");
    setup(&mut a, "s");
    let (child, cancel) = decide(&snap, "r", "op");
    a.apply(&child).expect("the child commits");
    let before = a.snapshot_all().expect("snapshot");
    let last = a.last_outbox_seq().expect("seq");

    // An unrelated, valid batch on another tree, then the stale cancel, then another valid one.
    let mut e = Engine::new();
    e.restore(b.load_tree("s").expect("load").expect("tree"))
        .expect("restore");
    let m1 = handle(
        &mut e,
        20,
        NormalizedEvent::MessageAppended {
            agent_session_id: id("s"),
            turn_id: id("t-s"),
            message_id: id("m1"),
            role: "assistant".into(),
            text: "one".into(),
        },
    )
    .persist;
    let m2 = handle(
        &mut e,
        21,
        NormalizedEvent::MessageAppended {
            agent_session_id: id("s"),
            turn_id: id("t-s"),
            message_id: id("m2"),
            role: "assistant".into(),
            text: "two".into(),
        },
    )
    .persist;
    let group = [m1.clone(), cancel.clone(), m2.clone()];
    let err = b.apply_many(&group).expect_err("the group fails");
    assert_eq!(err.failed_batch(), Some(1));
    assert!(err.is_guard_failure());
    assert_eq!(
        b.snapshot_all().expect("snapshot"),
        before,
        "nothing was written"
    );
    assert_eq!(
        b.last_outbox_seq().expect("seq"),
        last,
        "no outbox row, no seq used"
    );

    // Batch by batch: the others pass, the stale one fails again.
    let s1 = b.apply(&m1).expect("m1");
    assert!(b.apply(&cancel).is_err());
    let s2 = b.apply(&m2).expect("m2");
    assert_eq!(s1, vec![last + 1]);
    assert_eq!(
        s2,
        vec![last + 2],
        "gap-free: the failed group used no numbers"
    );
}

/// A version guard folded into its row's write never brings back a row that another writer
/// removed: the write is an update of exactly the guarded version, not an upsert ("never loses
/// or resurrects work").
#[test]
fn a_guarded_row_removed_by_another_writer_is_not_brought_back() {
    let (dir, mut a, _b) = two_stores();
    let snap = setup(&mut a, "r");
    let mut e = Engine::new();
    e.restore(snap).expect("restore");
    // The child's turn settles: a turn row at the next version, guarded by the current one.
    let step = handle(
        &mut e,
        30,
        NormalizedEvent::TurnTerminal {
            agent_session_id: id("c1-r"),
            turn_id: id("c1t-r"),
            outcome: tutti_core::model::Outcome::Completed,
            error: None,
        },
    );
    assert!(step.persist.guards.iter().any(
        |g| matches!(g, Guard::TurnVersion { id, version, .. } if &**id == "c1t-r" && *version > 0)
    ));
    // Meanwhile another writer removed that turn row.
    let raw = rusqlite::Connection::open(dir.path().join("tutti.db")).expect("raw open");
    assert_eq!(
        raw.execute("DELETE FROM turns WHERE id = 'c1t-r'", [])
            .expect("delete"),
        1
    );
    let err = a.apply(&step.persist).expect_err("the guard fails");
    assert!(err.is_guard_failure(), "{err}");
    let left: i64 = raw
        .query_row("SELECT count(*) FROM turns WHERE id = 'c1t-r'", [], |r| {
            r.get(0)
        })
        .expect("count");
    assert_eq!(left, 0, "the removed turn stays removed");
}
