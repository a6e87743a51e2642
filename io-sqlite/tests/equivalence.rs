//! The SQLite store behaves exactly like the reference `MemoryStore`: every scenario file passes
//! the same way on a real database file, and random histories leave the same trees, reads and
//! outbox, also after reopening the file.

mod support;

use proptest::prelude::*;
use std::path::PathBuf;
use support::compare::{compare_reads, compare_state};
use support::workload::{Driver, Op};
use tutti_core::store::{MemoryStore, Store};
use tutti_core::{scenario, Engine, PersistBatch};
use tutti_sqlite::SqliteStore;

fn scenario_files() -> Vec<PathBuf> {
    let dir = std::env::var_os("TUTTI_SCENARIOS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join("tests")
                .join("scenarios")
        });
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read scenario folder {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    files
}

/// Every scenario gives the same result against a real SQLite file as against `MemoryStore`;
/// after reopening the file, every tree equals the engine's snapshot and every read and the
/// outbox equal the reference store's.
#[test]
fn every_scenario_runs_on_sqlite_exactly_as_in_memory() {
    let files = scenario_files();
    assert!(!files.is_empty(), "no scenario files found");
    let mut failures = Vec::new();
    for f in &files {
        let name = f
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let text = std::fs::read_to_string(f).expect("readable scenario file");
        let (_dir, path) = support::temp_db();

        let mut mem = MemoryStore::new();
        let want = scenario::run(&text, &mut tutti_core::Driver::new(), &mut mem);

        let mut driver = tutti_core::Driver::new();
        let got = {
            let mut db = SqliteStore::open(&path).expect("open a new database");
            scenario::run(&text, &mut driver, &mut db)
        };
        let engine = driver.engine();
        if want != got {
            failures.push(format!("{name}: memory {want:?}, sqlite {got:?}"));
            continue;
        }

        let db = SqliteStore::open(&path).expect("reopen");
        for root in engine.roots() {
            let stored = db.load_tree(&root).expect("load_tree");
            if stored != engine.snapshot(&root) {
                failures.push(format!(
                    "{name}: reloaded tree {root} differs from the engine"
                ));
            }
        }
        if let Err(e) = compare_state(&mem, &db) {
            failures.push(format!("{name}: {e}"));
        }
        if let Err(e) = compare_reads(&mem, &db) {
            failures.push(format!("{name}: {e}"));
        }
        println!(
            "{} {name} ({want:?})",
            if failures.is_empty() { "SAME" } else { "DIFF" }
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

fn op() -> impl Strategy<Value = Op> {
    let i = any::<u16>;
    prop_oneof![
        3 => (0u8..3).prop_map(|workspace| Op::CreateRoot { workspace }),
        6 => i().prop_map(|root| Op::Submit { root }),
        5 => i().prop_map(|root| Op::ProviderStarted { root }),
        5 => (i(), any::<u8>()).prop_map(|(root, outcome)| Op::ProviderCompleted { root, outcome }),
        8 => i().prop_map(|parent| Op::ChildCreated { parent }),
        2 => i().prop_map(|child| Op::ChildUpdated { child }),
        5 => i().prop_map(|child| Op::TurnStarted { child }),
        2 => i().prop_map(|child| Op::TurnWaiting { child }),
        6 => (i(), any::<u8>()).prop_map(|(child, outcome)| Op::TurnTerminal { child, outcome }),
        8 => (i(), 0u16..300).prop_map(|(session, len)| Op::Message { session, len }),
        4 => (i(), 0u8..3).prop_map(|(session, call)| Op::ToolCall { session, call }),
        3 => i().prop_map(|session| Op::InteractionRequested { session }),
        2 => i().prop_map(|interaction| Op::InteractionResolved { interaction }),
        2 => (i(), any::<bool>())
            .prop_map(|(interaction, with_response)| Op::Respond { interaction, with_response }),
        3 => i().prop_map(|session| Op::Cancel { session }),
        3 => (i(), any::<u8>()).prop_map(|(op, mask)| Op::CancelResult { op, mask }),
        1 => i().prop_map(|op| Op::CancelFailed { op }),
        1 => i().prop_map(|op| Op::CancelDeadline { op }),
        2 => (i(), any::<bool>()).prop_map(|(session, null_goal)| Op::Metadata { session, null_goal }),
        1 => i().prop_map(|root| Op::GuideFailed { root }),
        1 => i().prop_map(|root| Op::ProviderExited { root }),
        2 => i().prop_map(|session| Op::Delete { session }),
    ]
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(96)
}

proptest! {
    // Failures are persisted under io-sqlite/proptest-regressions/ (and replayed first on the
    // next run); proptest prints the minimal failing ops and the seed.
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Random engine histories, applied both one by one and in group commits of random sizes,
    /// leave the SQLite file identical to the reference store: every tree (also against the
    /// engine), every read, the outbox, after reopening.
    #[test]
    fn random_histories_store_exactly_as_in_memory(
        ops in proptest::collection::vec(op(), 1..150),
        groups in proptest::collection::vec(1usize..6, 1..8),
    ) {
        let (_dir, path) = support::temp_db();
        let mut engine = Engine::new();
        let mut driver = Driver::new();
        let mut mem = MemoryStore::new();
        let mut db = SqliteStore::open(&path).expect("open");
        let start = [
            Op::CreateRoot { workspace: 0 },
            Op::CreateRoot { workspace: 1 },
            Op::Submit { root: 0 },
            Op::Submit { root: 1 },
            Op::ProviderStarted { root: 0 },
        ];
        let mut pending: Vec<PersistBatch> = Vec::new();
        let mut want_seqs: Vec<Vec<u64>> = Vec::new();
        let mut group_no = 0usize;
        for op in start.iter().chain(ops.iter()) {
            let Some(step) = driver.step(&mut engine, op) else { continue };
            want_seqs.push(mem.apply(&step.persist).expect("reference store accepts engine steps"));
            pending.push(step.persist);
            let size = groups[group_no % groups.len()];
            if pending.len() >= size {
                group_no += 1;
                let got = if pending.len() == 1 {
                    vec![db.apply(&pending[0]).expect("sqlite accepts engine steps")]
                } else {
                    db.apply_many(&pending).expect("sqlite accepts engine step groups")
                };
                prop_assert_eq!(&got, &want_seqs, "outbox seqs assigned");
                pending.clear();
                want_seqs.clear();
            }
        }
        if !pending.is_empty() {
            let got = db.apply_many(&pending).expect("sqlite accepts engine step groups");
            prop_assert_eq!(&got, &want_seqs);
        }
        drop(db);
        let db = SqliteStore::open(&path).expect("reopen");
        for root in engine.roots() {
            prop_assert_eq!(db.load_tree(&root).expect("load_tree"), engine.snapshot(&root));
        }
        if let Err(e) = compare_state(&mem, &db) {
            prop_assert!(false, "{}", e);
        }
        if let Err(e) = compare_reads(&mem, &db) {
            prop_assert!(false, "{}", e);
        }
        prop_assert!(db.integrity_check().expect("integrity_check").is_empty());
    }
}

/// Replaying a batch that was just applied is harmless: nothing is written, no outbox row.
#[test]
fn replaying_the_last_batch_is_a_no_op_in_both_stores() {
    let (_dir, path) = support::temp_db();
    let mut engine = Engine::new();
    let mut driver = Driver::new();
    let mut mem = MemoryStore::new();
    let mut db = SqliteStore::open(&path).expect("open");
    for op in [
        Op::CreateRoot { workspace: 0 },
        Op::Submit { root: 0 },
        Op::ProviderStarted { root: 0 },
        Op::ChildCreated { parent: 0 },
        Op::Message {
            session: 1,
            len: 40,
        },
        Op::Cancel { session: 0 },
    ] {
        let step = driver.step(&mut engine, &op).expect("accepted");
        assert_eq!(
            mem.apply(&step.persist).expect("memory"),
            db.apply(&step.persist).expect("sqlite")
        );
        assert_eq!(
            mem.apply(&step.persist).expect("memory replay"),
            Vec::<u64>::new()
        );
        assert_eq!(
            db.apply(&step.persist).expect("sqlite replay"),
            Vec::<u64>::new()
        );
    }
    compare_state(&mem, &db).expect("same state");
    compare_reads(&mem, &db).expect("same reads");
}
