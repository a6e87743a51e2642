//! Issue 33, the commit pipeline: on SQLite the group commits run on a commit thread with a
//! writer handle of its own, and the engine thread decides the next inputs meanwhile. Real
//! daemon core, real SQLite file, an outside SQLite connection holding the database's write
//! lock (so a commit is seen in flight), and the real demo ACP agent as a child process.

mod common;

use common::{create, reads, registry, settled, start, submit, tempdir, WS};
use std::time::{Duration, Instant};
use tutti_core::model::Id;
use tutti_core::store::Store;
use tutti_core::{Command, Input};
use tutti_tokio::daemon::Daemon;
use tutti_tokio::retention::Retention;

/// An outside connection to the daemon's file holding its write lock until released.
struct WriteLock(rusqlite::Connection);

impl WriteLock {
    fn take(db: &std::path::Path) -> WriteLock {
        let c = rusqlite::Connection::open(db).expect("outside connection");
        c.execute_batch("BEGIN IMMEDIATE")
            .expect("take the write lock");
        WriteLock(c)
    }

    /// Whether the file holds the session (as this connection sees it).
    fn has_session(&self, id: &str) -> bool {
        self.0
            .query_row("SELECT count(*) FROM sessions WHERE id = ?1", [id], |r| {
                r.get::<_, i64>(0)
            })
            .expect("read")
            > 0
    }

    fn release(self) {
        self.0
            .execute_batch("COMMIT")
            .expect("release the write lock");
    }
}

/// A create the daemon answers in a task of its own.
fn create_later(d: &Daemon, id: &str) -> tokio::task::JoinHandle<Result<(), String>> {
    let d = d.clone();
    let id = id.to_string();
    tokio::spawn(async move {
        let caps = d.providers().capabilities("agent");
        d.call(Input::Command(Command::CreateSession {
            agent_session_id: id.as_str().into(),
            workspace_id: WS.into(),
            provider: "agent".into(),
            title: None,
            capabilities: caps,
        }))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
    })
}

/// Waits until the engine holds `root` (decided; maybe not yet written).
async fn until_resident(d: &Daemon, root: &str) {
    let start = Instant::now();
    while !d
        .resident_trees()
        .await
        .expect("resident")
        .contains(&Id::from(root))
    {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the engine thread never decided the create of {root} while its commit waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn keep_resident() -> Retention {
    Retention {
        prune_interval_ms: 0,
        ..Retention::default()
    }
}

/// While a group commit waits for the database (another connection holds the write lock), the
/// engine thread goes on: it decided the create, answers other inputs, and holds the create's
/// reply until the group is written. Inline commits would block the engine thread until the
/// busy timeout failed the commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_thread_decides_while_a_group_commit_waits_for_the_database() {
    let dir = tempdir("pipeline-decides");
    let d = start(dir.path(), registry(), keep_resident());
    create(&d, "first").await;
    let lock = WriteLock::take(&dir.path().join("t.db"));
    let pending = create_later(&d, "second");
    until_resident(&d, "second").await;
    assert!(
        !pending.is_finished(),
        "the create is answered only once its batch is written"
    );
    assert!(!lock.has_session("second"), "nothing of it is written yet");
    // Another input is decided and answered meanwhile: a read of the engine's gauges.
    let text = d.metrics_text().await.expect("the engine thread answers");
    assert!(text.contains("tutti_"), "{text}");
    lock.release();
    pending
        .await
        .expect("task")
        .expect("the create is committed once the lock is free");
    let (detail, _) = reads(&d, "second");
    assert_eq!(detail["session"]["id"], "second", "{detail}");
    d.shutdown().await;
}

/// Shutdown writes and answers the group in flight before the engine thread ends: no reply is
/// lost and the batch is in the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_writes_and_answers_the_group_in_flight() {
    let dir = tempdir("pipeline-shutdown");
    let db = dir.path().join("t.db");
    let d = start(dir.path(), registry(), keep_resident());
    create(&d, "first").await;
    let lock = WriteLock::take(&db);
    let pending = create_later(&d, "late");
    until_resident(&d, "late").await;
    let shutdown = {
        let d = d.clone();
        tokio::spawn(async move { d.shutdown().await })
    };
    // Room for a shutdown that would not wait to end first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !shutdown.is_finished(),
        "shutdown waits for the group being written"
    );
    lock.release();
    shutdown.await.expect("shutdown");
    pending
        .await
        .expect("task")
        .expect("the create in flight at shutdown is answered as committed");
    drop(d);
    let store = tutti_sqlite::SqliteStore::open(&db).expect("reopen");
    assert!(
        store.session("late").expect("read").is_some(),
        "its batch is in the file"
    );
}

/// A real turn with children while an outside connection takes the write lock again and again:
/// the provider's lines decided while a commit waits go out in later groups, in order, and the
/// tree settles exactly as without the waits (every child, every root message in order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_with_children_settles_while_commits_wait_for_the_database() {
    let dir = tempdir("pipeline-turn");
    let db = dir.path().join("t.db");
    let d = start(dir.path(), registry(), keep_resident());
    create(&d, "R").await;
    submit(&d, "R", "T1", "children=3 permission=0 fail=0 late=0").await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let locker = {
        let stop = stop.clone();
        let db = db.clone();
        std::thread::spawn(move || {
            let mut held = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let lock = WriteLock::take(&db);
                std::thread::sleep(Duration::from_millis(40));
                lock.release();
                held += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            held
        })
    };
    let (detail, msgs) = settled(&d, "R", "T1").await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let held = locker.join().expect("locker");
    assert!(held > 0, "the outside connection took the lock");
    assert_eq!(
        detail["childSessions"].as_array().map(Vec::len),
        Some(3),
        "{detail}"
    );
    let root_turn = detail["turns"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["id"] == "T1"))
        .cloned()
        .expect("the root turn");
    assert_eq!(root_turn["outcome"], "completed", "{root_turn}");
    let root_seqs: Vec<u64> = msgs
        .iter()
        .filter(|m| m["agentSessionId"] == "R")
        .filter_map(|m| m["seq"].as_u64())
        .collect();
    assert!(!root_seqs.is_empty(), "the root wrote messages");
    assert_eq!(
        root_seqs,
        (0..root_seqs.len() as u64).collect::<Vec<_>>(),
        "root messages in order, without a gap or repeat"
    );
    d.shutdown().await;
}
