//! The outbox (cursors, pruning, numbers never reused) and recovery ("Recovery replays the same
//! idempotent target set": prepared cancel operations come back with their exact targets).

mod support;

use support::workload::{Mix, Stream};
use tutti_core::input::{Command, NormalizedEvent};
use tutti_core::model::{CancelState, Id, Target};
use tutti_core::store::Store;
use tutti_core::{Engine, Input, ProviderRequest};
use tutti_sqlite::{SqliteError, SqliteStore};

fn id(s: &str) -> Id {
    Id::from(s)
}

#[test]
fn outbox_cursors_prune_and_never_reuse_numbers() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut s = Stream::new(11, Mix::ALL);
    let mut assigned = Vec::new();
    for _ in 0..50 {
        assigned.extend(db.apply(&s.next_step().persist).expect("apply"));
    }
    let last = db.last_outbox_seq().expect("last");
    assert_eq!(assigned, (1..=last).collect::<Vec<_>>(), "gap-free from 1");

    assert_eq!(
        db.prune_acked().expect("prune"),
        0,
        "no consumer, nothing pruned"
    );
    assert_eq!(db.consumer_cursor("sse").expect("cursor"), None);
    db.ack("sse", 10).expect("ack");
    db.ack("sse", 4).expect("ack backwards is a no-op");
    assert_eq!(db.consumer_cursor("sse").expect("cursor"), Some(10));
    db.ack("audit", 6).expect("ack");
    assert_eq!(
        db.prune_acked().expect("prune"),
        6,
        "acked by every consumer"
    );
    assert_eq!(db.outbox_after(0, 1).expect("read")[0].seq, 7);
    let err = db.ack("sse", last + 1).expect_err("beyond the end");
    assert!(matches!(err, SqliteError::AckBeyondEnd { .. }), "{err}");

    // Everyone acks everything; prune all; numbering goes on after a reopen.
    db.ack("sse", last).expect("ack");
    db.ack("audit", last).expect("ack");
    assert_eq!(db.prune_acked().expect("prune"), (last - 6) as usize);
    assert!(db.outbox_after(0, 100).expect("read").is_empty());
    drop(db);
    let mut db = SqliteStore::open(&path).expect("reopen");
    assert_eq!(db.last_outbox_seq().expect("last"), last);
    let next = loop {
        let seqs = db.apply(&s.next_step().persist).expect("apply");
        if let Some(&first) = seqs.first() {
            break first;
        }
    };
    assert_eq!(next, last + 1, "pruning never makes a number come back");
    assert!(db.forget_consumer("audit").expect("forget"));
    assert!(!db.forget_consumer("audit").expect("forget again"));
}

/// A root cancel prepared before a crash comes back in `load_live_trees` with its exact target
/// set, and the restored engine replays the same cancel request.
#[test]
fn a_prepared_cancel_comes_back_with_its_exact_targets() {
    let (_dir, path) = support::temp_db();
    let targets: Vec<Target>;
    {
        let mut db = SqliteStore::open(&path).expect("open");
        let mut e = Engine::new();
        let inputs: Vec<Input> = vec![
            Command::CreateSession {
                agent_session_id: id("r"),
                workspace_id: id("w"),
                provider: id("codex"),
                title: None,
                capabilities: None,
            }
            .into(),
            Command::Submit {
                agent_session_id: id("r"),
                turn_id: id("t"),
                text: "go".into(),
            }
            .into(),
            NormalizedEvent::RootProviderTurnStarted {
                agent_session_id: id("r"),
                turn_id: None,
                provider_turn_id: Some("p".into()),
            }
            .into(),
            NormalizedEvent::ChildSessionCreated {
                agent_session_id: id("c1"),
                turn_id: id("ct1"),
                parent_agent_session_id: id("r"),
                parent_turn_id: id("t"),
                parent_tool_call_id: None,
                root_agent_session_id: id("r"),
                root_turn_id: id("t"),
                title: None,
                provider_session_id: None,
                provider_aliases: None,
            }
            .into(),
            NormalizedEvent::ChildSessionCreated {
                agent_session_id: id("c2"),
                turn_id: id("ct2"),
                parent_agent_session_id: id("c1"),
                parent_turn_id: id("ct1"),
                parent_tool_call_id: None,
                root_agent_session_id: id("r"),
                root_turn_id: id("t"),
                title: None,
                provider_session_id: None,
                provider_aliases: None,
            }
            .into(),
            Command::CancelTurn {
                operation_id: id("op"),
                agent_session_id: id("r"),
                turn_id: id("t"),
            }
            .into(),
        ];
        let mut last = None;
        for (n, i) in inputs.iter().enumerate() {
            let step = e.handle(n as i64 + 1, i).expect("accepted");
            db.apply(&step.persist).expect("apply");
            last = Some(step);
        }
        targets = match last.and_then(|s| s.provider.into_iter().next()) {
            Some(ProviderRequest::Cancel { targets, .. }) => targets,
            other => panic!("want a cancel request, got {other:?}"),
        };
        assert_eq!(targets.len(), 3);
        // Another, settled tree that must not come back as live.
        let step = e
            .handle(
                10,
                &Command::CreateSession {
                    agent_session_id: id("quiet"),
                    workspace_id: id("w"),
                    provider: id("codex"),
                    title: None,
                    capabilities: None,
                }
                .into(),
            )
            .expect("create");
        db.apply(&step.persist).expect("apply");
    }
    let db = SqliteStore::open(&path).expect("reopen after the crash");
    let live = db.load_live_trees().expect("live");
    assert_eq!(live.len(), 1, "only the tree with work in flight");
    let op = &live[0].cancel_operations[0];
    assert_eq!(op.state, CancelState::Prepared);
    assert_eq!(op.targets, targets, "the exact recorded target set");

    let mut e = Engine::new();
    for t in live {
        e.restore(t).expect("restore");
    }
    let prepared = e.prepared_cancels();
    assert_eq!(prepared.len(), 1);
    assert_eq!(prepared[0].targets, targets);

    // On-demand loading of an evicted tree from any of its sessions.
    assert_eq!(db.root_of("c2").expect("root_of"), Some(id("r")));
    assert_eq!(db.root_of("quiet").expect("root_of"), Some(id("quiet")));
    assert_eq!(db.root_of("nobody").expect("root_of"), None);
    assert_eq!(
        db.root_of_cancel_operation("op").expect("root_of"),
        Some(id("r"))
    );
    let quiet = db.load_tree("quiet").expect("load").expect("tree");
    assert_eq!(quiet.sessions.len(), 1);
    assert_eq!(db.load_tree("c2").expect("load"), None, "not a root");
    assert_eq!(db.snapshot_all().expect("all").len(), 2);
    let detail = db.session_detail("r").expect("detail").expect("exists");
    let kids: Vec<&str> = detail.child_sessions.iter().map(|s| &*s.id).collect();
    assert_eq!(kids, vec!["c1", "c2"], "flat, parents before children");
}

#[test]
fn a_bad_cursor_is_a_typed_error() {
    let (_dir, path) = support::temp_db();
    let db = SqliteStore::open(&path).expect("open");
    for c in ["", "nocolon", "x:y"] {
        let err = db.roots("w", 10, Some(c)).expect_err("bad cursor");
        assert!(matches!(err, SqliteError::BadCursor(_)), "{err}");
    }
    assert_eq!(db.roots("w", 10, None).expect("empty"), (Vec::new(), None));
}

/// `read_consistent` nests, and a panic inside it leaves no transaction open.
#[test]
fn consistent_reads_nest_and_survive_a_panic() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut s = Stream::new(13, Mix::ALL);
    for _ in 0..20 {
        db.apply(&s.next_step().persist).expect("apply");
    }
    let n = db
        .read_consistent(|d| {
            d.read_consistent(|d| d.snapshot_all().map(|t| t.len()))
                .expect("nested")
        })
        .expect("outer")
        .expect("snapshot");
    assert!(n > 0);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = db.read_consistent(|_| panic!("reader bug"));
    }));
    assert!(r.is_err());
    // A write still works: no read transaction was left open.
    db.apply(&s.next_step().persist)
        .expect("apply after a panicking reader");
}

/// `apply_many_published` hands back exactly what the outbox stored: the same numbers, the row
/// each came from, and the payload text a reader of the file gets.
#[test]
fn published_rows_are_the_stored_outbox_rows() {
    let (_dir, path) = support::temp_db();
    let mut db = SqliteStore::open(&path).expect("open");
    let mut s = Stream::new(23, Mix::ALL);
    let steps: Vec<_> = (0..60).map(|_| s.next_step()).collect();
    let published = db
        .apply_many_published(steps.iter().map(|st| &st.persist))
        .expect("group commit");
    assert_eq!(published.len(), steps.len());
    let stored = db.outbox_after(0, 10_000).expect("read");
    let flat: Vec<_> = published.iter().flatten().collect();
    assert!(!flat.is_empty());
    assert_eq!(flat.len(), stored.len(), "one published row per outbox row");
    for ((batch, pubs), _) in steps.iter().zip(&published).zip(0..) {
        for p in pubs {
            let row = &batch.persist.rows[p.row as usize];
            let file = stored.iter().find(|o| o.seq == p.seq).expect("stored");
            let payload: serde_json::Value = serde_json::from_str(&p.payload).expect("json");
            if file.kind == tutti_core::step::REDACTED {
                // A later batch of the workload deleted its session: ids only remain.
                let owner = file.payload["agentSessionId"].as_str().expect("owner");
                assert!(tutti_core::step::redacts(row.kind(), &payload, owner));
                assert_eq!(
                    file.payload,
                    tutti_core::step::redacted_payload(owner, row.kind())
                );
                continue;
            }
            assert_eq!(file.kind, row.kind());
            assert_eq!(file.payload, payload);
        }
    }
    // The plain group commit numbers the same way and captures nothing.
    let more: Vec<_> = (0..5).map(|_| s.next_step()).collect();
    let seqs = db
        .apply_many(more.iter().map(|st| &st.persist))
        .expect("group commit");
    let last = flat.last().map(|p| p.seq).unwrap_or(0);
    let next: Vec<u64> = seqs.into_iter().flatten().collect();
    assert_eq!(
        next,
        (last + 1..=last + next.len() as u64).collect::<Vec<_>>()
    );
}

/// With automatic checkpoints off, commits only grow the WAL (nothing is copied or synced on the
/// commit path); a checkpoint from another connection copies it into the main file, and a
/// restarting one lets the next commit write the WAL from its start.
#[test]
fn checkpoints_run_apart_from_commits() {
    use tutti_sqlite::{CheckpointMode, OpenOptions};
    let wal_after_commits = |auto: bool| {
        let (dir, path) = support::temp_db();
        let mut db =
            SqliteStore::open_with(&path, &OpenOptions::new().auto_checkpoint(auto)).expect("open");
        let mut s = Stream::new(5, Mix::ALL);
        for _ in 0..150 {
            let steps: Vec<_> = (0..20).map(|_| s.next_step()).collect();
            db.apply_many(steps.iter().map(|st| &st.persist))
                .expect("commit");
        }
        (dir, path, db, s)
    };
    // SQLite's automatic checkpoint keeps the WAL near its 1000-frame threshold.
    let (_d, path, _db, _) = wal_after_commits(true);
    let other = SqliteStore::open(&path).expect("second connection");
    let auto = other.checkpoint(CheckpointMode::Passive).expect("passive");
    // Without it, everything stays in the WAL until someone checkpoints.
    let (_dir, path, mut db, mut s) = wal_after_commits(false);
    let other = SqliteStore::open(&path).expect("second connection");
    let c = other.checkpoint(CheckpointMode::Passive).expect("passive");
    assert!(!c.busy);
    assert!(
        c.wal_frames > 2000 && c.wal_frames > 2 * auto.wal_frames,
        "commits did not checkpoint: {} frames (automatic: {})",
        c.wal_frames,
        auto.wal_frames
    );
    assert_eq!(c.checkpointed_frames, c.wal_frames, "all of it copied");
    // More commits, then a restarting checkpoint: the next commit starts the WAL over.
    let steps: Vec<_> = (0..20).map(|_| s.next_step()).collect();
    db.apply_many(steps.iter().map(|st| &st.persist))
        .expect("commit");
    let r = db.checkpoint(CheckpointMode::Restart).expect("restart");
    assert!(!r.busy);
    assert_eq!(r.checkpointed_frames, r.wal_frames);
    db.apply(&s.next_step().persist).expect("commit");
    let after = other.checkpoint(CheckpointMode::Passive).expect("passive");
    assert!(
        after.wal_frames < 100,
        "the commit after a restart writes the WAL from its start ({} frames)",
        after.wal_frames
    );
    assert!(db.integrity_check().expect("check").is_empty());
    assert_eq!(
        db.outbox_after(0, 1_000_000).expect("read").len() as u64,
        db.last_outbox_seq().expect("last"),
        "nothing lost across checkpoints"
    );
}

/// A writer that must not stall asks for a restart that gives up at once when a reader still
/// uses the WAL, and gets it once the reader is gone.
#[test]
fn a_no_wait_restart_gives_up_while_a_reader_uses_the_wal() {
    use tutti_sqlite::{CheckpointMode, OpenOptions};
    let (_dir, path) = support::temp_db();
    let mut db =
        SqliteStore::open_with(&path, &OpenOptions::new().auto_checkpoint(false)).expect("open");
    let reader = SqliteStore::open(&path).expect("reader");
    let mut s = Stream::new(9, Mix::ALL);
    for _ in 0..20 {
        db.apply(&s.next_step().persist).expect("commit");
    }
    let during = reader
        .read_consistent(|r| {
            // The first read takes the snapshot (a read mark in the WAL).
            assert!(!r.outbox_after(0, 5).expect("read").is_empty());
            db.checkpoint(CheckpointMode::RestartNoWait)
                .expect("checkpoint")
        })
        .expect("read");
    assert!(
        during.busy,
        "a reader on the WAL keeps it from starting over"
    );
    let after = db
        .checkpoint(CheckpointMode::RestartNoWait)
        .expect("checkpoint");
    assert!(!after.busy, "nobody in the way: {after:?}");
    assert_eq!(after.checkpointed_frames, after.wal_frames);
    db.apply(&s.next_step().persist).expect("commit");
    let next = reader.checkpoint(CheckpointMode::Passive).expect("passive");
    assert!(
        next.wal_frames < 50,
        "the WAL started over ({})",
        next.wal_frames
    );
}
