//! Issue 17, item 3: memory and disk stay bounded. Settled trees leave the engine and come back
//! on demand; the session `cwd` lives in the database; outbox retention never takes a row from a
//! live follower, and a follower asking for pruned rows gets a reset instead of a silent gap.
//! Real daemon core, real SQLite file, the real demo ACP agent as a child process.

mod common;

use common::{create, reads, registry, settled, start, submit, tempdir, WS};
use serde_json::Value;
use std::time::{Duration, Instant};
use tutti_core::model::Id;
use tutti_core::store::OutboxRow;
use tutti_core::{Command, Input};
use tutti_sqlite::RetentionPolicy;
use tutti_tokio::daemon::Daemon;
use tutti_tokio::follow::{Followed, Follower};
use tutti_tokio::retention::Retention;

fn no_pruning(resident_trees: usize) -> Retention {
    Retention {
        resident_trees,
        prune_interval_ms: 0,
        ..Retention::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_tree_is_evicted_and_reloads_with_identical_reads_and_a_working_submit() {
    let dir = tempdir("evict");
    let d = start(dir.path(), registry(), no_pruning(0));
    create(&d, "R").await;
    create(&d, "idle").await;
    assert!(
        d.resident_trees().await.expect("resident").is_empty(),
        "a new session with no turn is quiescent and leaves memory at once"
    );
    submit(&d, "R", "T1", "children=2 permission=0 fail=0 late=0").await;
    let before = settled(&d, "R", "T1").await;
    assert_eq!(
        before.0["childSessions"].as_array().map(Vec::len),
        Some(2),
        "a real tree: {}",
        before.0
    );
    // The settling step left the tree quiescent: it is gone from the engine.
    let start = Instant::now();
    while !d.resident_trees().await.expect("resident").is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the settled tree was never evicted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(reads(&d, "R"), before, "eviction changes no read");

    // A later submit loads the tree from the file and runs a normal turn on it.
    submit(&d, "R", "T2", "children=1 permission=0 fail=0 late=0").await;
    let resident = d.resident_trees().await.expect("resident");
    assert!(
        resident.contains(&Id::from("R")),
        "the active tree is loaded again: {resident:?}"
    );
    let (detail, msgs) = settled(&d, "R", "T2").await;
    let root_turns: Vec<&Value> = detail["turns"]
        .as_array()
        .map(|ts| ts.iter().filter(|t| t["agentSessionId"] == "R").collect())
        .unwrap_or_default();
    assert_eq!(
        root_turns.len(),
        2,
        "the reloaded root has both turns: {detail}"
    );
    assert_eq!(
        detail["session"]["lastTurnId"], "T2",
        "the second submit started a new turn"
    );
    assert_eq!(
        detail["childSessions"].as_array().map(Vec::len),
        Some(3),
        "the second turn added its child to the same tree"
    );
    // Everything read before is still there unchanged, and the root's messages go on in order.
    for m in &before.1 {
        assert!(msgs.contains(m), "a message changed or vanished: {m}");
    }
    let root_seqs: Vec<u64> = msgs
        .iter()
        .filter(|m| m["agentSessionId"] == "R")
        .filter_map(|m| m["seq"].as_u64())
        .collect();
    let first = root_seqs.first().copied().unwrap_or(0);
    assert_eq!(
        root_seqs,
        (first..first + root_seqs.len() as u64).collect::<Vec<_>>(),
        "root message numbers continue without a gap or repeat after the reload"
    );
    assert!(
        root_seqs.len()
            > before
                .1
                .iter()
                .filter(|m| m["agentSessionId"] == "R")
                .count()
    );
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_cwd_is_stored_and_survives_a_restart() {
    let dir = tempdir("cwd");
    let work = dir.path().join("work dir");
    std::fs::create_dir_all(&work).expect("work dir");
    let cwd = work.to_string_lossy().into_owned();
    {
        let d = start(dir.path(), registry(), no_pruning(0));
        d.set_cwd("R".into(), cwd.clone());
        create(&d, "R").await;
        d.shutdown().await;
    }
    let providers = registry();
    let d = start(dir.path(), providers.clone(), no_pruning(0));
    let stored = d
        .read(|r| r.session_cwd("R"))
        .expect("read")
        .expect("query");
    assert_eq!(stored.as_deref(), Some(cwd.as_str()), "in the file");
    // The restarted daemon has no memory of it; the provider still starts in that directory.
    submit(&d, "R", "T1", "children=0 permission=0 fail=0 late=0").await;
    settled(&d, "R", "T1").await;
    let launches = providers.launches.lock().expect("launches").clone();
    assert_eq!(launches, vec![(Id::from("R"), Some(cwd))]);
    d.shutdown().await;
}

/// Sessions with no provider: each creation commits outbox rows.
async fn create_plain(d: &Daemon, from: usize, to: usize) {
    for i in from..to {
        d.call(Input::Command(Command::CreateSession {
            agent_session_id: format!("s{i}").into(),
            workspace_id: WS.into(),
            provider: "none".into(),
            title: None,
            capabilities: None,
        }))
        .await
        .expect("create");
    }
}

fn file_rows(d: &Daemon) -> Vec<OutboxRow> {
    d.read(|r| r.outbox_after(0, 1_000_000))
        .expect("read")
        .expect("rows")
}

fn pruned_through(d: &Daemon) -> u64 {
    d.read(|r| r.outbox_pruned_through())
        .expect("read")
        .expect("pruned")
}

async fn wait_pruned(d: &Daemon, at_least: u64) -> u64 {
    let start = Instant::now();
    loop {
        let p = pruned_through(d);
        if p >= at_least {
            return p;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "retention never pruned through {at_least} (at {p})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn keep(rows: u64) -> Retention {
    Retention {
        resident_trees: 0,
        outbox: RetentionPolicy {
            keep_rows: Some(rows),
            max_age_ms: None,
        },
        prune_interval_ms: 10,
        prune_batch: 7,
    }
}

async fn next(f: &mut Follower) -> Followed {
    tokio::time::timeout(Duration::from_secs(20), f.next_event())
        .await
        .expect("something arrives")
        .expect("no error")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_never_removes_a_row_a_connected_slow_follower_has_not_been_sent() {
    let dir = tempdir("slow");
    let d = start(dir.path(), registry(), keep(5));
    // A follower connected from the start that takes the first rows and then stops reading.
    let mut slow = Follower::new(&d, 0);
    create_plain(&d, 0, 10).await;
    let mut got: Vec<OutboxRow> = match next(&mut slow).await {
        Followed::Rows(r) => r,
        other => panic!("rows expected: {other:?}"),
    };
    let taken = got.last().map(|r| r.seq).expect("rows");
    create_plain(&d, 10, 200).await;
    let last = file_rows(&d).last().map(|r| r.seq).expect("rows");
    // Retention runs while the follower sits at `taken`: it prunes up to it, not beyond.
    wait_pruned(&d, taken).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // many more passes (every 10 ms)
    assert_eq!(
        pruned_through(&d),
        taken,
        "rows above the slow follower's position stay"
    );
    // It reads on: every row after it exactly once, in order, no reset.
    while got.last().map(|r| r.seq) != Some(last) {
        match next(&mut slow).await {
            Followed::Rows(r) => got.extend(r),
            reset => panic!("a connected follower never gets a reset: {reset:?}"),
        }
    }
    let seqs: Vec<u64> = got.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, (1..=last).collect::<Vec<_>>(), "gap-free, once");
    // Once it has everything (and then once it is gone), retention goes on to its limit.
    wait_pruned(&d, last - 5).await;
    drop(slow);
    let kept = file_rows(&d);
    assert_eq!(kept.len(), 5, "the newest 5 rows are kept");
    assert_eq!(kept.first().map(|r| r.seq), Some(last - 4));
    // Numbers are never reused after pruning.
    create_plain(&d, 200, 201).await;
    assert_eq!(file_rows(&d).last().map(|r| r.seq), Some(last + 1));
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_resuming_below_the_horizon_gets_a_reset_then_the_kept_rows() {
    let dir = tempdir("reset");
    let d = start(dir.path(), registry(), keep(5));
    create_plain(&d, 0, 40).await;
    let last = file_rows(&d).last().map(|r| r.seq).expect("rows");
    let p = wait_pruned(&d, last - 5).await;
    assert_eq!(p, last - 5);
    let mut f = Follower::new(&d, 2);
    assert_eq!(
        next(&mut f).await,
        Followed::Reset {
            requested_after: 2,
            pruned_through: p
        },
        "an explicit reset, not a silent gap"
    );
    let mut seqs = Vec::new();
    while seqs.last() != Some(&last) {
        match next(&mut f).await {
            Followed::Rows(r) => seqs.extend(r.iter().map(|r| r.seq)),
            reset => panic!("one reset only: {reset:?}"),
        }
    }
    assert_eq!(seqs, (p + 1..=last).collect::<Vec<_>>());
    // A position at the horizon or above, and position 0, get no reset.
    for after in [0, p, p + 2] {
        let mut f = Follower::new(&d, after);
        match next(&mut f).await {
            Followed::Rows(r) => assert_eq!(r.first().map(|r| r.seq), Some(after.max(p) + 1)),
            reset => panic!("no reset from {after}: {reset:?}"),
        }
    }
    d.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_recovered_at_start_up_numbers_later_messages_after_the_stored_ones() {
    let dir = tempdir("recover");
    {
        let d = start(dir.path(), registry(), no_pruning(64));
        create(&d, "R").await;
        submit(
            &d,
            "R",
            "T1",
            "children=1 hang=1 permission=0 fail=0 late=0",
        )
        .await;
        let start = Instant::now();
        loop {
            let (detail, msgs) = reads(&d, "R");
            let child_running = detail["childSessions"]
                .as_array()
                .is_some_and(|cs| cs.iter().any(|c| c["activeTurnId"].is_string()));
            if child_running && !msgs.is_empty() {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no child: {detail}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The daemon goes away with the turn still active, as in a crash.
        d.shutdown().await;
    }
    let d = start(dir.path(), registry(), no_pruning(64));
    let (detail, before) = reads(&d, "R");
    assert!(
        detail["session"]["activeTurnId"].is_null(),
        "recovery settled the turn: {detail}"
    );
    assert!(
        d.resident_trees().await.expect("resident").is_empty(),
        "recovered trees are loaded without message ids and must not stay"
    );
    // The next submit loads the whole tree: its user message follows the stored ones.
    submit(&d, "R", "T2", "children=0 permission=0 fail=0 late=0").await;
    let (_, msgs) = settled(&d, "R", "T2").await;
    let root_seqs: Vec<u64> = msgs
        .iter()
        .filter(|m| m["agentSessionId"] == "R")
        .filter_map(|m| m["seq"].as_u64())
        .collect();
    assert_eq!(root_seqs, (0..root_seqs.len() as u64).collect::<Vec<_>>());
    let before_root = before.iter().filter(|m| m["agentSessionId"] == "R").count();
    assert!(root_seqs.len() > before_root, "new messages were added");
    d.shutdown().await;
}
