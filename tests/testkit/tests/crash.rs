//! Crash safety: a child process applies realistic engine steps to a file in group commits; the
//! test kills it with SIGKILL at random moments until fifty kills landed after progress (the
//! file held more whole batches than before the kill; a run that cannot get them in ten times
//! as many kills fails), and after every kill checks the file: `PRAGMA integrity_check` is ok;
//! the file holds exactly a prefix of whole
//! batches (it equals a `MemoryStore` that replayed the same deterministic batches up to some
//! batch, trees and outbox alike, and that prefix never shrinks); the outbox has no gap; every
//! reloaded tree passes the invariant checker and restores into an engine.
//!
//! Set `TUTTI_CRASH_SEED` to replay one run's kill moments.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tutti_core::invariants::check_tree;
use tutti_core::store::Store;
use tutti_core::Engine;
use tutti_sqlite::SqliteStore;
use tutti_testkit::compare::locate;
use tutti_testkit::temp_db;
use tutti_testkit::workload::Rng;

const FILES: u64 = 10;
/// Kills that land after progress, per file.
const KILLS_PER_FILE: u64 = 5;
/// At most this many kills per kill that must land after progress.
const MAX_TRIES_PER_KILL: u64 = 10;

fn check(path: &std::path::Path, seed: u64, floor: u64) -> Result<u64, String> {
    let db = SqliteStore::open(path).map_err(|e| format!("reopen after kill: {e}"))?;
    let problems = db.integrity_check().map_err(|e| e.to_string())?;
    if !problems.is_empty() {
        return Err(format!("integrity_check: {problems:?}"));
    }
    let (k, _, _) = locate(seed, &db)?;
    if k < floor {
        return Err(format!("committed batches disappeared: {k} < {floor}"));
    }
    let outbox = db.outbox_after(0, usize::MAX).map_err(|e| e.to_string())?;
    for (i, row) in outbox.iter().enumerate() {
        if row.seq != i as u64 + 1 {
            return Err(format!("outbox gap: row {i} has seq {}", row.seq));
        }
    }
    if db.last_outbox_seq().map_err(|e| e.to_string())? != outbox.len() as u64 {
        return Err("last_outbox_seq disagrees with the rows".into());
    }
    let mut engine = Engine::new();
    for tree in db.snapshot_all().map_err(|e| e.to_string())? {
        let v = check_tree(&tree);
        if !v.is_empty() {
            return Err(format!("invariants: {v:?}"));
        }
        engine.restore(tree).map_err(|e| format!("restore: {e}"))?;
    }
    let v = engine.check_invariants();
    if !v.is_empty() {
        return Err(format!("engine invariants after restore: {v:?}"));
    }
    for tree in db.load_live_trees().map_err(|e| e.to_string())? {
        let root = tree.root().map(|s| s.id.clone()).unwrap_or_default();
        if engine.snapshot(&root).as_ref() != Some(&tree) {
            return Err(format!("live tree {root} differs from the full snapshot"));
        }
    }
    Ok(k)
}

#[test]
fn sigkill_at_random_moments_never_tears_a_batch() {
    let bin = env!("CARGO_BIN_EXE_tutti-sqlite-crashloop");
    let run_seed = std::env::var("TUTTI_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("TUTTI_CRASH_SEED={run_seed}");
    let mut rng = Rng(run_seed);
    let started = Instant::now();
    let mut kills = 0;
    let mut mid_run = 0;
    for f in 0..FILES {
        let (_dir, path) = temp_db();
        let seed = run_seed.rotate_left(7) ^ f;
        let mut committed = 0;
        // Kills count only when they land after progress (the file holds more whole batches
        // than before the kill); a run that cannot get that many in a bounded number of kills
        // fails instead of passing with kills that proved nothing.
        let mut landed = 0;
        let mut tries = 0;
        while landed < KILLS_PER_FILE {
            tries += 1;
            assert!(
                tries <= KILLS_PER_FILE * MAX_TRIES_PER_KILL,
                "TUTTI_CRASH_SEED={run_seed} file {f}: only {landed} of {tries} kills landed after progress"
            );
            let mut child = Command::new(bin)
                .arg("--db")
                .arg(&path)
                .arg("--seed")
                .arg(seed.to_string())
                .arg("--max-group")
                .arg("12")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn the crash loop");
            let mut out = BufReader::new(child.stdout.take().expect("stdout"));
            let mut line = String::new();
            out.read_line(&mut line).expect("read ready line");
            if !line.starts_with("ready ") {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                let _ = child.kill();
                let _ = child.wait();
                panic!("TUTTI_CRASH_SEED={run_seed}: crash loop did not start: {line:?} {err}");
            }
            let resumed: u64 = line["ready ".len()..].trim().parse().expect("ready K");
            assert_eq!(
                resumed, committed,
                "TUTTI_CRASH_SEED={run_seed}: the crash loop resumed elsewhere"
            );
            std::thread::sleep(Duration::from_millis(5 + rng.below(80)));
            if let Ok(Some(status)) = child.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!("TUTTI_CRASH_SEED={run_seed}: crash loop exited by itself: {status} {err}");
            }
            child.kill().expect("SIGKILL");
            child.wait().expect("reap");
            kills += 1;
            let k = check(&path, seed, committed).unwrap_or_else(|e| {
                panic!("TUTTI_CRASH_SEED={run_seed} file {f} kill {kills}: {e}")
            });
            if k > committed {
                mid_run += 1;
                landed += 1;
            }
            committed = k;
        }
        println!("file {f}: {committed} batches committed over {tries} kills");
    }
    println!(
        "{kills} kills ({mid_run} after progress) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        mid_run,
        FILES * KILLS_PER_FILE,
        "every file took {KILLS_PER_FILE} kills after progress"
    );
}
