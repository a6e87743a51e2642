//! The checkpoint thread ([`Checkpointer`]): commits never checkpoint, the thread copies the WAL
//! into the main file behind them, asks the writer for a restart once the WAL is past its size,
//! and leaves a fully copied WAL when it is dropped. Real file, real threads; waits are bounded
//! polls, never timing assertions.

mod support;

use std::sync::mpsc;
use std::time::{Duration, Instant};
use support::workload::{Mix, Stream};
use tutti_sqlite::{
    CheckpointEvent, CheckpointMode, CheckpointPolicy, Checkpointer, OpenOptions, SqliteStore,
};

/// Polls `f` every few milliseconds for up to 20 s.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn commit(db: &mut SqliteStore, s: &mut Stream, n: usize) {
    let steps: Vec<_> = (0..n).map(|_| s.next_step()).collect();
    db.apply_many(steps.iter().map(|st| &st.persist))
        .expect("commit");
}

fn policy(restart_bytes: u64) -> CheckpointPolicy {
    CheckpointPolicy {
        every: Duration::from_millis(2),
        restart_bytes,
        close_bytes: 64 << 10,
    }
}

#[test]
fn the_thread_copies_committed_frames_into_the_main_file() {
    let (_dir, path) = support::temp_db();
    let mut db =
        SqliteStore::open_with(&path, &OpenOptions::new().auto_checkpoint(false)).expect("open");
    let (tx, rx) = mpsc::channel();
    let ckp = Checkpointer::start(&path, policy(u64::MAX), move |e| {
        let _ = tx.send(e);
    })
    .expect("start");
    let mut s = Stream::new(3, Mix::ALL);
    commit(&mut db, &mut s, 200);
    // Nothing was said about the commit yet: the thread does not look.
    std::thread::sleep(Duration::from_millis(50));
    assert!(rx.try_recv().is_err(), "no commit announced, no checkpoint");
    ckp.committed();
    let copied = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("a checkpoint pass");
    match copied {
        CheckpointEvent::Pass { mode, result } => {
            assert_eq!(mode, CheckpointMode::Passive);
            assert!(result.wal_frames > 0);
            assert_eq!(result.checkpointed_frames, result.wal_frames, "all copied");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(
        !ckp.restart_wanted(),
        "the WAL is far below the restart size"
    );
}

#[test]
fn past_the_restart_size_the_writer_is_asked_to_restart_and_the_wal_starts_over() {
    let (_dir, path) = support::temp_db();
    let mut db =
        SqliteStore::open_with(&path, &OpenOptions::new().auto_checkpoint(false)).expect("open");
    let (tx, rx) = mpsc::channel();
    let ckp = Checkpointer::start(&path, policy(256 << 10), move |e| {
        if let CheckpointEvent::RestartWanted { wal_frames } = e {
            let _ = tx.send(wal_frames);
        }
    })
    .expect("start");
    let page = db.page_size().expect("page size");
    let mut s = Stream::new(4, Mix::ALL);
    let other = SqliteStore::open(&path).expect("reader");
    eventually("a restart request", || {
        commit(&mut db, &mut s, 50);
        ckp.committed();
        ckp.restart_wanted()
    });
    let wanted_at = rx.try_recv().expect("the request was observed");
    assert!(wanted_at * page > 256 << 10, "the WAL was past the size");
    let r = db
        .checkpoint(CheckpointMode::RestartNoWait)
        .expect("restart");
    ckp.restarted();
    assert!(!ckp.restart_wanted());
    assert!(!r.busy, "nobody was in the way");
    commit(&mut db, &mut s, 5);
    let after = other.checkpoint(CheckpointMode::Passive).expect("look");
    assert!(
        after.wal_frames < wanted_at,
        "the WAL started over ({} frames, was {wanted_at})",
        after.wal_frames,
    );
}

#[test]
fn dropping_it_leaves_the_whole_wal_copied() {
    let (_dir, path) = support::temp_db();
    let mut db =
        SqliteStore::open_with(&path, &OpenOptions::new().auto_checkpoint(false)).expect("open");
    let (tx, rx) = mpsc::channel();
    let ckp = Checkpointer::start(
        &path,
        CheckpointPolicy {
            every: Duration::from_secs(3600),
            ..CheckpointPolicy::default()
        },
        move |e| {
            let _ = tx.send(e);
        },
    )
    .expect("start");
    let mut s = Stream::new(5, Mix::ALL);
    commit(&mut db, &mut s, 100);
    ckp.committed();
    // Dropping does not wait out the hour: it stops the thread at once, after a last restart.
    drop(ckp);
    let events: Vec<CheckpointEvent> = rx.try_iter().collect();
    assert!(
        matches!(events.as_slice(), [CheckpointEvent::Pass { mode: CheckpointMode::Restart, result }]
            if !result.busy && result.checkpointed_frames == result.wal_frames && result.wal_frames > 0),
        "one final restarting checkpoint: {events:?}"
    );
}

#[test]
fn a_missing_file_is_an_error_not_a_new_database() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("absent.db");
    assert!(Checkpointer::start(&path, CheckpointPolicy::default(), |_| {}).is_err());
    assert!(!path.exists(), "nothing was created");
}
