//! Test helper for the crash-safety test (`tests/testkit/tests/crash.rs`): applies a deterministic stream of
//! realistic engine steps (from `--seed`) to a database file, in group commits of random sizes,
//! until it is killed (or `--max-secs` pass).
//!
//! On start it finds which prefix of the stream the file already holds (every batch is either
//! wholly present or wholly absent, so some prefix matches exactly), prints `ready K` and goes on
//! from batch K + 1. The test kills it with SIGKILL at random moments and checks the file.
//!
//! Usage: `tutti-sqlite-crashloop --db FILE --seed N [--max-group G] [--max-secs S]`

use tutti_testkit::{compare, workload};

use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use tutti_core::store::Store;
use tutti_sqlite::SqliteStore;

struct Args {
    db: String,
    seed: u64,
    max_group: u64,
    max_secs: u64,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        db: String::new(),
        seed: 1,
        max_group: 8,
        max_secs: 30,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || value.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--db" => a.db = value.clone(),
            "--seed" => a.seed = num()?,
            "--max-group" => a.max_group = num()?.max(1),
            "--max-secs" => a.max_secs = num()?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.db.is_empty() {
        return Err("--db FILE is required".into());
    }
    Ok(a)
}

fn run() -> Result<(), String> {
    let a = args()?;
    let mut db = SqliteStore::open(&a.db).map_err(|e| e.to_string())?;
    let (k, mut stream, _) = compare::locate(a.seed, &db)?;
    println!("ready {k}");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut sizes = workload::Rng(a.seed ^ k.rotate_left(17) ^ 0x5eed);
    let deadline = Instant::now() + Duration::from_secs(a.max_secs);
    while Instant::now() < deadline {
        let n = 1 + sizes.below(a.max_group);
        let group: Vec<_> = (0..n).map(|_| stream.next_step().persist).collect();
        if group.len() == 1 {
            db.apply(&group[0]).map_err(|e| e.to_string())?;
        } else {
            db.apply_many(&group).map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tutti-sqlite-crashloop: {e}");
            ExitCode::FAILURE
        }
    }
}
