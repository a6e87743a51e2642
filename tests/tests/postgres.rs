//! PostgreSQL: the store conformance suite against a real server (started in a temporary
//! directory by [`tutti_tests::postgres::Server`]), and several writers on one database.

use tutti_postgres::PostgresStore;
use tutti_tests::postgres::Server;

#[test]
fn postgres_store_conforms() {
    let server = Server::fast().expect("postgres server");
    tutti_tests::conformance::run(
        || PostgresStore::connect(&server.create_database().expect("db")).expect("connect"),
        |s| {
            // The URL is not kept by the store: reopen by the database's name.
            let url = current_url(&server, &s);
            drop(s);
            PostgresStore::connect(&url).expect("reconnect")
        },
    );
}

fn current_url(server: &Server, s: &PostgresStore) -> String {
    server.url(&s.database_name().expect("database name"))
}

/// Issue 21: "the scenario files give identical snapshots through it (`tutti replay --db
/// postgres://...`)": every scenario file, replayed by the real CLI into a new PostgreSQL
/// database and into a new SQLite file, prints the same trees read back from each store.
#[test]
fn every_scenario_gives_identical_snapshots_through_postgres_and_sqlite() {
    const TUTTI: &str = env!("CARGO_BIN_EXE_tutti-test");
    let server = Server::fast().expect("postgres server");
    let dir = tempfile::tempdir().expect("dir");
    let scenarios = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut files: Vec<_> = std::fs::read_dir(&scenarios)
        .expect("scenarios")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    files.sort();
    assert!(files.len() > 50, "the scenario files are there");
    let replay = |db: &str, file: &std::path::Path| -> serde_json::Value {
        let out = std::process::Command::new(TUTTI)
            .args(["replay", "--db", db])
            .arg(file)
            .output()
            .expect("tutti replay");
        assert!(
            out.status.success(),
            "replay {} --db {db}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("JSON snapshot")
    };
    for (i, file) in files.iter().enumerate() {
        let sqlite = dir.path().join(format!("s{i}.db"));
        let sqlite = replay(sqlite.to_str().expect("utf-8"), file);
        let pg = replay(&server.create_schema().expect("schema"), file);
        assert!(
            sqlite.as_array().is_some_and(|a| !a.is_empty()),
            "{}: some tree",
            file.display()
        );
        assert_eq!(
            pg,
            sqlite,
            "{}: PostgreSQL and SQLite differ",
            file.display()
        );
    }
}

use serde_json::{json, Value};
use std::sync::{Arc, Barrier};
use tutti_core::store::{HostStore, Store};
use tutti_core::{Engine, PersistBatch};
use tutti_postgres::{Claim, PgError};

fn decide(engine: &mut Engine, now: i64, v: Value) -> PersistBatch {
    let input = serde_json::from_value(v.clone()).expect("input");
    engine
        .handle(now, &input)
        .unwrap_or_else(|e| panic!("engine rejected {v}: {e}"))
        .persist
}

/// Inputs that build root `r` with an active turn and one active child, then `n` messages.
fn tree_inputs(r: &str, n: usize) -> Vec<Value> {
    let mut v = vec![
        json!({"type": "createSession", "agentSessionId": r, "workspaceId": "W", "provider": "codex"}),
        json!({"type": "submit", "agentSessionId": r, "turnId": format!("T-{r}"), "text": "go"}),
        json!({"type": "rootProviderTurnStarted", "agentSessionId": r, "providerTurnId": "p"}),
        json!({"type": "childSessionCreated", "agentSessionId": format!("C-{r}"), "turnId": format!("CT-{r}"), "parentAgentSessionId": r, "parentTurnId": format!("T-{r}"), "rootAgentSessionId": r, "rootTurnId": format!("T-{r}")}),
        json!({"type": "turnStarted", "agentSessionId": format!("C-{r}"), "turnId": format!("CT-{r}")}),
    ];
    for i in 0..n {
        v.push(json!({"type": "messageAppended", "agentSessionId": format!("C-{r}"), "turnId": format!("CT-{r}"), "messageId": format!("m{i}"), "role": "assistant", "text": "x"}));
    }
    v
}

/// "A gap-free outbox sequence that every daemon shares": two writers (connections) commit
/// concurrently, singly and in groups, while a reader follows the outbox. Every seq from 1 to
/// the last is there exactly once, each writer got the seqs it was told, and the follower never
/// saw a later seq before an earlier one.
#[test]
fn concurrent_writers_share_one_gap_free_outbox() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("db");
    PostgresStore::connect(&url).expect("migrate");
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|w| {
            let url = url.clone();
            std::thread::spawn(move || {
                let mut store = PostgresStore::connect(&url).expect("connect");
                let mut engine = Engine::new();
                let mut seqs = Vec::new();
                let mut now = 0;
                for t in 0..6 {
                    let batches: Vec<PersistBatch> = tree_inputs(&format!("R{w}{t}"), 10)
                        .into_iter()
                        .map(|v| {
                            now += 1;
                            decide(&mut engine, now, v)
                        })
                        .collect();
                    if t % 2 == 0 {
                        for b in &batches {
                            seqs.extend(store.apply(b).expect("apply"));
                        }
                    } else {
                        let refs: Vec<&PersistBatch> = batches.iter().collect();
                        let p = store.apply_group(&refs, false).expect("group");
                        seqs.extend(p.into_iter().flatten().map(|p| p.seq));
                    }
                }
                seqs
            })
        })
        .collect();
    let follower = {
        let url = url.clone();
        let done = done.clone();
        std::thread::spawn(move || {
            let store = PostgresStore::connect(&url).expect("connect");
            let mut seen = Vec::new();
            loop {
                let finished = done.load(std::sync::atomic::Ordering::SeqCst);
                let after = seen.last().copied().unwrap_or(0);
                for r in store.outbox_after(after, 1000).expect("read") {
                    seen.push(r.seq);
                }
                if finished {
                    break;
                }
            }
            seen
        })
    };
    let mut all: Vec<u64> = Vec::new();
    for w in writers {
        let seqs = w.join().expect("writer");
        assert!(
            seqs.windows(2).all(|p| p[0] < p[1]),
            "a writer's seqs increase"
        );
        all.extend(seqs);
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = follower.join().expect("follower");
    all.sort();
    let n = all.len() as u64;
    assert!(n > 100);
    assert_eq!(all, (1..=n).collect::<Vec<_>>(), "seqs 1..=n, each once");
    assert_eq!(
        seen, all,
        "the follower saw every seq once, in order, never a gap"
    );
    let store = PostgresStore::connect(&url).expect("connect");
    assert_eq!(store.last_outbox_seq().expect("last"), n);
}

/// Two daemons decided on the same tree state: one a child creation, the other a cancel of the
/// root turn. Committed at the same moment from two connections, exactly one wins and the other
/// is refused by a guard, writing nothing ("a child first revealed after the target snapshot
/// must be rejected by persistence").
#[test]
fn racing_writers_on_one_tree_exactly_one_commits() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("db");
    let mut setup = PostgresStore::connect(&url).expect("connect");
    let mut engine = Engine::new();
    let roots: Vec<String> = (0..8).map(|i| format!("R{i}")).collect();
    let mut now = 0;
    for r in &roots {
        for v in tree_inputs(r, 0) {
            now += 1;
            setup.apply(&decide(&mut engine, now, v)).expect("setup");
        }
    }
    for r in &roots {
        let snap = setup.load_tree(r).expect("load").expect("tree");
        let mut a = Engine::new();
        a.restore(snap.clone()).expect("restore");
        let mut b = Engine::new();
        b.restore(snap).expect("restore");
        let cancel = decide(
            &mut a,
            100,
            json!({"type": "cancelTurn", "operationId": format!("op-{r}"), "agentSessionId": r, "turnId": format!("T-{r}")}),
        );
        let child = decide(
            &mut b,
            100,
            json!({"type": "childSessionCreated", "agentSessionId": format!("late-{r}"), "turnId": format!("LT-{r}"), "parentAgentSessionId": r, "parentTurnId": format!("T-{r}"), "rootAgentSessionId": r, "rootTurnId": format!("T-{r}")}),
        );
        let barrier = Arc::new(Barrier::new(2));
        let run = |batch: PersistBatch| {
            let url = url.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let mut s = PostgresStore::connect(&url).expect("connect");
                barrier.wait();
                s.apply(&batch)
            })
        };
        let (ta, tb) = (run(cancel), run(child));
        let (ra, rb) = (ta.join().expect("a"), tb.join().expect("b"));
        assert!(
            ra.is_ok() != rb.is_ok(),
            "{r}: exactly one commits: {ra:?} / {rb:?}"
        );
        let loser = ra.err().or(rb.err()).expect("a loser");
        assert!(PostgresStore::is_guard_failure(&loser), "{r}: {loser:?}");
        let late = setup.session(&format!("late-{r}")).expect("read").is_some();
        let op = setup
            .cancel_operation(&format!("op-{r}"))
            .expect("read")
            .is_some();
        assert!(
            late != op,
            "{r}: exactly one of the two decisions is stored"
        );
    }
}

/// Fencing (issue 21): "Every batch a daemon commits for a tree carries a fencing guard on the
/// lease epoch, so a daemon that lost its lease (paused, partitioned) can never commit for that
/// tree again." Two handles (two daemons): A owns the tree, pauses past its lease, B claims it;
/// A's next commit is refused and writes nothing; B commits; A can neither renew nor reclaim
/// while B's lease is live, and sees B's address to forward to.
#[test]
fn a_stale_owner_is_fenced_after_a_takeover() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("db");
    let mut a = PostgresStore::connect(&url).expect("a");
    let mut b = PostgresStore::connect(&url).expect("b");
    let mut engine = Engine::new();
    let ttl = 1_000;
    let la = match a
        .claim_lease("R", "daemon-a", "127.0.0.1:1", 0, ttl)
        .expect("claim")
    {
        Claim::Owned(l) => l,
        other => panic!("a claims a free lease: {other:?}"),
    };
    assert_eq!(la.epoch, 1);
    let mut now = 0;
    for v in tree_inputs("R", 2) {
        now += 1;
        a.apply(&decide(&mut engine, now, v))
            .expect("owner commits");
    }
    // B cannot take a live lease; it learns where to forward.
    match b
        .claim_lease("R", "daemon-b", "127.0.0.1:2", 500, ttl)
        .expect("claim")
    {
        Claim::HeldBy(l) => {
            assert_eq!(l.owner, "daemon-a");
            assert_eq!(l.owner_address, "127.0.0.1:1");
        }
        other => panic!("a live lease is not taken: {other:?}"),
    }
    assert!(a.renew_lease("R", "daemon-a", 1, 900, ttl).expect("renew"));
    // A pauses; its lease expires; B takes over with a new epoch.
    let lb = match b
        .claim_lease("R", "daemon-b", "127.0.0.1:2", 2_000, ttl)
        .expect("claim")
    {
        Claim::Owned(l) => l,
        other => panic!("an expired lease is taken: {other:?}"),
    };
    assert_eq!(lb.epoch, 2);
    // A wakes up and commits what it decided: refused, nothing written.
    let stale = decide(
        &mut engine,
        2_001,
        json!({"type": "messageAppended", "agentSessionId": "C-R", "turnId": "CT-R", "messageId": "from-a", "role": "assistant", "text": "x"}),
    );
    let before = b.outbox_after(0, usize::MAX).expect("outbox");
    match a.apply(&stale) {
        Err(PgError::Fenced {
            epoch: 1,
            current: Some(2),
            ..
        }) => {}
        other => panic!("the stale owner's commit is fenced: {other:?}"),
    }
    match a.apply_group(&[&stale], true) {
        Err(tutti_core::store::GroupError::Batch {
            index: 0,
            source: PgError::Fenced { .. },
        }) => {}
        other => panic!("fenced in a group too: {other:?}"),
    }
    assert_eq!(b.outbox_after(0, usize::MAX).expect("outbox"), before);
    assert_eq!(b.messages("C-R", None, 100).expect("messages").len(), 2);
    assert!(
        !a.renew_lease("R", "daemon-a", 1, 2_002, ttl)
            .expect("renew"),
        "A lost it"
    );
    assert!(matches!(
        a.claim_lease("R", "daemon-a", "127.0.0.1:1", 2_003, ttl)
            .expect("claim"),
        Claim::HeldBy(_)
    ));
    // The new owner commits the same decision (from a tree it loaded).
    let mut e2 = Engine::new();
    e2.restore(b.load_tree("R").expect("load").expect("tree"))
        .expect("restore");
    let mine = decide(
        &mut e2,
        2_004,
        json!({"type": "messageAppended", "agentSessionId": "C-R", "turnId": "CT-R", "messageId": "from-b", "role": "assistant", "text": "x"}),
    );
    b.apply(&mine).expect("the owner commits");
    assert_eq!(b.messages("C-R", None, 100).expect("messages").len(), 3);
    // Other trees are not fenced on A.
    let mut e3 = Engine::new();
    for v in tree_inputs("S", 0) {
        a.apply(&decide(&mut e3, 3_000, v)).expect("unfenced tree");
    }
    assert_eq!(
        b.lease("R").expect("lease").map(|l| l.owner),
        Some("daemon-b".into())
    );

    // Issue 21, fencing from the first batch: a tree's lease is claimed before its create
    // commits, so even the create of an owner that lost the tree before committing it is
    // refused, and nothing of the tree is written.
    assert!(matches!(
        a.claim_lease("T", "daemon-a", "127.0.0.1:1", 4_000, ttl)
            .expect("claim"),
        Claim::Owned(_)
    ));
    let (taken, previous) = b
        .claim_lease_after("T", "daemon-b", "127.0.0.1:2", 6_000, ttl)
        .expect("claim");
    assert!(
        matches!(taken, Claim::Owned(ref l) if l.epoch == 2),
        "{taken:?}"
    );
    let previous = previous.expect("A's lease was there");
    assert!(
        !previous.is_released(),
        "taken from an owner that stopped renewing (failover settles the tree)"
    );
    let mut e4 = Engine::new();
    let create = decide(
        &mut e4,
        6_001,
        json!({"type": "createSession", "agentSessionId": "T", "workspaceId": "W", "provider": "codex"}),
    );
    let before = b.outbox_after(0, usize::MAX).expect("outbox");
    assert!(
        matches!(a.apply(&create), Err(PgError::Fenced { .. })),
        "the lost create is fenced"
    );
    assert!(b.session("T").expect("read").is_none(), "nothing written");
    assert_eq!(b.outbox_after(0, usize::MAX).expect("outbox"), before);
    // A released lease is told apart from an expired one.
    assert!(b.release_lease("T", "daemon-b", 2).expect("release"));
    let (_, previous) = a
        .claim_lease_after("T", "daemon-a", "127.0.0.1:1", 6_002, ttl)
        .expect("claim");
    assert!(previous.expect("lease row").is_released());

    // The cluster secret (how daemons authenticate forwarded commands): the first stored
    // candidate wins, every later handle reads it.
    let first = a.cluster_secret("secret-of-a").expect("secret");
    assert_eq!(first, "secret-of-a");
    assert_eq!(b.cluster_secret("secret-of-b").expect("secret"), first);
}

/// Issue 21, "renewed while it runs", for every tree a daemon holds at once: `renew_leases`
/// extends exactly the leases still the caller's at the given epoch (one statement for all) and
/// leaves out a tree another daemon took over and one never claimed;
/// `release_leases` gives up exactly the caller's, stops fencing them, and leaves another
/// owner's lease alone. More leases than one statement takes are all renewed.
#[test]
fn many_leases_are_renewed_and_released_together_and_only_the_callers() {
    use tutti_postgres::lease::LEASES_PER_STATEMENT;
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("db");
    let mut a = PostgresStore::connect(&url).expect("a");
    let mut b = PostgresStore::connect(&url).expect("b");
    let ttl = 1_000;
    let roots: Vec<String> = (0..LEASES_PER_STATEMENT + 5)
        .map(|i| format!("R{i}"))
        .collect();
    for r in &roots {
        assert!(matches!(
            a.claim_lease(r, "daemon-a", "127.0.0.1:1", 0, ttl).expect("claim"),
            Claim::Owned(ref l) if l.epoch == 1
        ));
    }
    // R1 is taken over by B once A's lease expired.
    assert!(matches!(
        b.claim_lease("R1", "daemon-b", "127.0.0.1:2", 1_500, ttl).expect("claim"),
        Claim::Owned(ref l) if l.epoch == 2
    ));
    let mut held: Vec<(&str, u64)> = roots.iter().map(|r| (r.as_str(), 1)).collect();
    held.push(("never-claimed", 1));
    let renewed = a
        .renew_leases("daemon-a", &held, 1_600, ttl)
        .expect("renew");
    let renewed: std::collections::BTreeSet<&str> = renewed.iter().map(|r| &**r).collect();
    let expected: std::collections::BTreeSet<&str> = roots
        .iter()
        .map(String::as_str)
        .filter(|r| *r != "R1")
        .collect();
    assert_eq!(renewed, expected, "exactly the leases still A's at epoch 1");
    for r in ["R0", "R3", roots.last().expect("roots").as_str()] {
        let l = a.lease(r).expect("lease").expect("row");
        assert_eq!(
            (l.owner.as_str(), l.expires_at_ms),
            ("daemon-a", 2_600),
            "{r}"
        );
    }
    let r1 = a.lease("R1").expect("lease").expect("row");
    assert_eq!(
        (r1.owner.as_str(), r1.epoch, r1.expires_at_ms),
        ("daemon-b", 2, 2_500)
    );
    assert!(a.lease("never-claimed").expect("lease").is_none());

    // Released together: A's leases at epoch 1 (R1 is B's now and stays B's, live).
    let release: Vec<(&str, u64)> = ["R0", "R1", "R3"].iter().map(|r| (*r, 1)).collect();
    let released = a.release_leases("daemon-a", &release).expect("release");
    let released: std::collections::BTreeSet<&str> = released.iter().map(|r| &**r).collect();
    assert_eq!(released, ["R0", "R3"].into_iter().collect());
    assert!(a.lease("R0").expect("lease").expect("row").is_released());
    assert!(a.lease("R3").expect("lease").expect("row").is_released());
    assert_eq!(
        a.lease("R1").expect("lease").expect("row").expires_at_ms,
        2_500
    );
    assert_eq!(
        a.fenced_at("R0"),
        None,
        "a released tree is no longer fenced here"
    );
    assert_eq!(a.fenced_at("R4"), Some(1), "a held tree still is");
    // Nothing to do is no error.
    assert!(a
        .renew_leases("daemon-a", &[], 1_700, ttl)
        .expect("renew")
        .is_empty());
    assert!(a
        .release_leases("daemon-a", &[])
        .expect("release")
        .is_empty());
}

/// Issue 34, per-batch lease-epoch fencing: "a batch is fenced by the lease epoch it was
/// DECIDED under, not the one current at commit". A claims the tree at epoch 1 and decides a
/// batch; its lease expires and B takes the tree (epoch 2); B's lease expires too and A claims
/// the tree again (epoch 3, so A's handle fences the tree at 3). The batch A decided at epoch 1
/// is refused with nothing written, although A owns the tree again; a batch decided at
/// epoch 3 commits.
#[test]
fn a_batch_decided_under_a_lost_lease_is_refused_after_the_tree_is_reclaimed() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("db");
    let mut a = PostgresStore::connect(&url).expect("a");
    let mut b = PostgresStore::connect(&url).expect("b");
    let ttl = 1_000;
    let claim = |s: &mut PostgresStore, owner: &str, now: i64| match s
        .claim_lease("R", owner, "127.0.0.1:1", now, ttl)
        .expect("claim")
    {
        Claim::Owned(l) => l.epoch,
        other => panic!("{owner} claims a free or expired lease: {other:?}"),
    };
    assert_eq!(claim(&mut a, "daemon-a", 0), 1);
    let mut engine = Engine::new();
    let mut now = 0;
    for v in tree_inputs("R", 1) {
        now += 1;
        let batch = decide(&mut engine, now, v);
        a.group_decided(&[&batch], &[Some(1)], false)
            .expect("decided and committed under the live lease");
    }
    // Decided under epoch 1, not committed yet (A pauses here).
    let old = decide(
        &mut engine,
        now + 1,
        json!({"type": "messageAppended", "agentSessionId": "C-R", "turnId": "CT-R", "messageId": "decided-at-1", "role": "assistant", "text": "x"}),
    );
    assert_eq!(
        claim(&mut b, "daemon-b", 2_000),
        2,
        "B takes the expired lease"
    );
    assert_eq!(claim(&mut a, "daemon-a", 4_000), 3, "A re-claims it later");
    let before = b.outbox_after(0, usize::MAX).expect("outbox");
    match a.group_decided(&[&old], &[Some(1)], true) {
        Err((
            Some(0),
            PgError::Fenced {
                epoch: 1,
                current: Some(3),
                ..
            },
        )) => {}
        other => panic!("the batch decided under the lost lease is fenced: {other:?}"),
    }
    assert_eq!(
        b.outbox_after(0, usize::MAX).expect("outbox"),
        before,
        "nothing written"
    );
    assert_eq!(b.messages("C-R", None, 100).expect("messages").len(), 1);
    // A batch decided under the current epoch (from the reloaded tree) commits.
    let mut fresh = Engine::new();
    fresh
        .restore(a.load_tree("R").expect("load").expect("tree"))
        .expect("restore");
    let new = decide(
        &mut fresh,
        4_001,
        json!({"type": "messageAppended", "agentSessionId": "C-R", "turnId": "CT-R", "messageId": "decided-at-3", "role": "assistant", "text": "x"}),
    );
    a.group_decided(&[&new], &[Some(3)], true)
        .expect("decided under the current lease");
    assert_eq!(b.messages("C-R", None, 100).expect("messages").len(), 2);
    // One group, two batches of the tree: the first decided under the current epoch, the
    // second under the lost one. The group's fences are checked in one round trip; the
    // refusal names the second batch, and the first is not written either.
    let current = decide(
        &mut fresh,
        4_002,
        json!({"type": "messageAppended", "agentSessionId": "C-R", "turnId": "CT-R", "messageId": "decided-at-3-again", "role": "assistant", "text": "x"}),
    );
    let before = b.outbox_after(0, usize::MAX).expect("outbox");
    match a.group_decided(&[&current, &old], &[Some(3), Some(1)], true) {
        Err((
            Some(1),
            PgError::Fenced {
                epoch: 1,
                current: Some(3),
                ..
            },
        )) => {}
        other => panic!("the second batch of the group is fenced: {other:?}"),
    }
    assert_eq!(
        b.outbox_after(0, usize::MAX).expect("outbox"),
        before,
        "nothing of the group written"
    );
    assert_eq!(b.messages("C-R", None, 100).expect("messages").len(), 2);
    a.group_decided(&[&current], &[Some(3)], true)
        .expect("alone, the batch of the current epoch commits");
    assert_eq!(b.messages("C-R", None, 100).expect("messages").len(), 3);
}

/// "Schema migrations with a version table": a database of version 1 (with data) is migrated to
/// the current version in place, several daemons connecting to a new database at once migrate it
/// once, and a database of a newer version is refused with a typed error and left unchanged.
#[test]
fn migrations_are_versioned_and_a_newer_schema_is_refused() {
    let server = Server::fast().expect("postgres server");
    let version = |url: &str| -> i64 {
        let mut c = postgres::Client::connect(url, postgres::NoTls).expect("connect");
        c.query_one("SELECT max(version) FROM tutti_schema_version", &[])
            .expect("version")
            .get(0)
    };
    // Version 1 with a session in it.
    let url = server.create_database().expect("db");
    {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
        c.batch_execute("CREATE TABLE tutti_schema_version (version BIGINT NOT NULL)")
            .expect("version table");
        c.batch_execute(tutti_postgres::schema::migration(0).expect("v1"))
            .expect("v1 ddl");
        c.batch_execute("INSERT INTO tutti_schema_version VALUES (1)")
            .expect("v1");
    }
    let mut engine = Engine::new();
    {
        let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
        let b = decide(
            &mut engine,
            1,
            json!({"type": "createSession", "agentSessionId": "R", "workspaceId": "W", "provider": "codex"}),
        );
        let tutti_core::step::Row::Session(s) = &b.rows[0] else {
            panic!("a session row");
        };
        c.execute(
            "INSERT INTO sessions (id, workspace_id, kind, created_at, version, json) \
             VALUES ($1, $2, 'root', $3, $4, $5)",
            &[
                &&*s.id,
                &&*s.workspace_id,
                &s.created_at,
                &(s.version as i64),
                &serde_json::to_string(&**s).expect("json"),
            ],
        )
        .expect("v1 row");
    }
    let mut store = PostgresStore::connect(&url).expect("migrates");
    assert_eq!(version(&url), tutti_postgres::schema::SCHEMA_VERSION);
    assert!(store.session("R").expect("read").is_some(), "data kept");
    assert!(matches!(
        store.claim_lease("R", "d", "a", 0, 10).expect("v2 table"),
        Claim::Owned(_)
    ));
    drop(store);
    // Concurrent first connections.
    let fresh = server.create_database().expect("db");
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let url = fresh.clone();
            std::thread::spawn(move || PostgresStore::connect(&url).map(|_| ()))
        })
        .collect();
    for h in handles {
        h.join()
            .expect("thread")
            .expect("every connection migrates or finds it migrated");
    }
    assert_eq!(version(&fresh), tutti_postgres::schema::SCHEMA_VERSION);
    // Newer than this build.
    {
        let mut c = postgres::Client::connect(&fresh, postgres::NoTls).expect("connect");
        c.batch_execute("UPDATE tutti_schema_version SET version = 99")
            .expect("bump");
    }
    match PostgresStore::connect(&fresh) {
        Err(PgError::TooNew {
            found: 99,
            supported,
        }) => {
            assert_eq!(supported, tutti_postgres::schema::SCHEMA_VERSION)
        }
        other => panic!("a newer schema is refused: {other:?}"),
    }
    assert_eq!(version(&fresh), 99, "left unchanged");
}

/// Issue 21's event stream across daemons is woken by `LISTEN/NOTIFY`: a commit that publishes
/// rows notifies every listener of its store with its last seq, sent inside the committing
/// transaction (a batch that rolls back notifies nothing), and a store in another schema of the
/// same database (the channel is per database) does not wake this store's listeners.
#[test]
fn a_commit_notifies_the_listeners_of_its_store_with_its_last_seq() {
    use std::time::Duration;
    use tutti_postgres::{OutboxListener, Wake};
    let server = Server::fast().expect("postgres server");
    let url_a = server.create_schema().expect("schema a");
    let url_b = server.create_schema().expect("schema b");
    let mut a = PostgresStore::connect(&url_a).expect("a");
    let mut b = PostgresStore::connect(&url_b).expect("b");
    let mut listen = OutboxListener::connect(&url_a).expect("listener");
    let create = json!({"type": "createSession", "agentSessionId": "R", "workspaceId": "W", "provider": "codex"});
    // Another schema's commit: not this store's seq.
    let on_b = b
        .apply(&decide(&mut Engine::new(), 1, create.clone()))
        .expect("apply b");
    assert!(!on_b.is_empty());
    assert_eq!(
        listen.wait(Duration::from_millis(300)).expect("wait"),
        Wake::Quiet(0)
    );
    // This store's commit: its last seq.
    let mut engine = Engine::new();
    let seqs = a
        .apply(&decide(&mut engine, 1, create.clone()))
        .expect("apply a");
    let last = *seqs.last().expect("published");
    assert_eq!(
        listen.wait(Duration::from_secs(30)).expect("wait"),
        Wake::Committed(last)
    );
    // A second engine creating the same session fails its guard: rolled back, no notification.
    let err = a
        .apply(&decide(&mut Engine::new(), 2, create))
        .expect_err("guard");
    assert!(err.is_guard_failure(), "{err}");
    assert_eq!(
        listen.wait(Duration::from_millis(300)).expect("wait"),
        Wake::Quiet(last)
    );
}

/// Issue 33: a daemon's listener skips the notifications of its own writer (their rows reach
/// its followers on the live channel): the writer's commits do not wake it, another writer's
/// do, and after the writer's connection was replaced (a new backend) its commits still do not;
/// the polling fallback still reports the last seq, whoever committed it.
#[test]
fn a_listener_skipping_its_own_writer_is_woken_only_by_other_writers() {
    use std::time::Duration;
    use tutti_postgres::{OutboxListener, Wake};
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("db");
    let mut own = PostgresStore::connect(&url).expect("own writer");
    let mut other = PostgresStore::connect(&url).expect("other writer");
    let mut listen = OutboxListener::connect(&url)
        .expect("listener")
        .skipping(own.backend_pid_watch());
    let create = |id: &str| json!({"type": "createSession", "agentSessionId": id, "workspaceId": "W", "provider": "codex"});
    let mine = own
        .apply(&decide(&mut Engine::new(), 1, create("R1")))
        .expect("own commit");
    let mine_last = *mine.last().expect("published");
    assert_eq!(
        listen.wait(Duration::from_millis(300)).expect("wait"),
        Wake::Quiet(mine_last),
        "the own writer's commit does not wake the listener; the poll still reads its seq"
    );
    let theirs = other
        .apply(&decide(&mut Engine::new(), 1, create("R2")))
        .expect("other commit");
    let theirs_last = *theirs.last().expect("published");
    assert!(theirs_last > mine_last);
    assert_eq!(
        listen.wait(Duration::from_secs(30)).expect("wait"),
        Wake::Committed(theirs_last),
        "another writer's commit wakes it"
    );
    // The own writer's connection is replaced: its new backend is skipped too.
    let old = own.backend_pid().expect("connected");
    terminate(&url, old);
    let again = own
        .apply(&decide(&mut Engine::new(), 2, create("R3")))
        .expect("own commit on a new connection");
    assert_ne!(own.backend_pid(), Some(old), "a new backend");
    let again_last = *again.last().expect("published");
    assert_eq!(
        listen.wait(Duration::from_millis(300)).expect("wait"),
        Wake::Quiet(again_last),
        "the own writer's new backend is skipped as well"
    );
    // Without skipping, the same commit wakes a listener.
    let mut plain = OutboxListener::connect(&url).expect("plain listener");
    let last = *own
        .apply(&decide(&mut Engine::new(), 3, create("R4")))
        .expect("own commit")
        .last()
        .expect("published");
    assert_eq!(
        plain.wait(Duration::from_secs(30)).expect("wait"),
        Wake::Committed(last)
    );
}

/// Ends the backend `pid` from another connection (`pg_terminate_backend`, what an operator or
/// a failover does) and waits until it is gone.
fn terminate(url: &str, pid: i32) {
    let mut admin = postgres::Client::connect(url, postgres::NoTls).expect("admin connection");
    let ended: bool = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&pid])
        .expect("terminate")
        .get(0);
    assert!(ended, "backend {pid} was signalled");
    for _ in 0..500 {
        let alive: bool = admin
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)",
                &[&pid],
            )
            .expect("pg_stat_activity")
            .get(0);
        if !alive {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("backend {pid} did not end");
}

/// Issue 34: "Every PostgreSQL connection ... notices a broken connection and reconnects with
/// bounded backoff". A store whose backend was terminated from another connection commits its
/// next batch on a new connection (the transaction is retried there: nothing of the failed
/// attempt was written), its reads work again, and the reconnect is counted.
#[test]
fn a_store_whose_connection_was_terminated_reconnects_and_its_next_commit_succeeds() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("db");
    let mut store = PostgresStore::connect(&url).expect("connect");
    let health = store.health();
    let mut engine = Engine::new();
    let inputs = tree_inputs("R", 2);
    let mut batches = inputs.into_iter().map(|v| decide(&mut engine, 1, v));
    store
        .apply(&batches.next().expect("create"))
        .expect("first commit");
    let old = store.backend_pid().expect("connected");
    terminate(&url, old);

    for b in batches {
        store
            .apply(&b)
            .expect("commit after the backend was terminated");
    }
    assert_eq!(store.reconnects(), 1, "one reconnect");
    assert!(health.reconnects() >= 1 && health.is_up(), "health saw it");
    assert_ne!(store.backend_pid(), Some(old), "a new backend");
    let tree = store.load_tree("R").expect("read").expect("tree");
    assert_eq!(tree.sessions.len(), 2, "root and child stored");
    assert_eq!(
        store.messages("C-R", None, 10).expect("messages").len(),
        2,
        "every message committed once"
    );
    // A reader's connection terminated: its next read reconnects too.
    let reader = PostgresStore::connect(&url).expect("reader");
    terminate(&url, reader.backend_pid().expect("connected"));
    assert!(reader.session("R").expect("read after terminate").is_some());
    assert_eq!(reader.reconnects(), 1);
}

/// Issue 34: "A commit whose outcome is unknown (the connection broke after COMMIT was sent)
/// is resolved by reading back, never guessed". Every group transaction stores the handle's
/// commit mark inside itself: a committed batch's mark reads back as committed (also from a
/// new connection after the old backend was terminated), a mark that no transaction committed
/// reads back as not committed, and a refused batch (a failed guard) stores no mark.
#[test]
fn an_unknown_commit_outcome_is_resolved_by_reading_the_commit_mark_back() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("db");
    let mut store = PostgresStore::connect(&url).expect("connect");
    let mut engine = Engine::new();
    let inputs = tree_inputs("R", 0);
    let mut batches: Vec<PersistBatch> = inputs
        .into_iter()
        .map(|v| decide(&mut engine, 1, v))
        .collect();
    let create = batches.remove(0);
    store.apply(&create).expect("create");
    let committed = store.last_commit_mark();
    assert!(committed > 0, "the commit stored a mark");
    assert!(store.read_back_commit(committed).expect("read back"));
    assert!(
        !store.read_back_commit(committed + 1).expect("read back"),
        "a mark no transaction committed"
    );
    // From a new connection, after the backend that committed was terminated.
    terminate(&url, store.backend_pid().expect("connected"));
    assert!(store
        .read_back_commit(committed)
        .expect("read back after a reconnect"));
    // A refused batch leaves no mark: a second writer commits the submit first, then this
    // handle's copy of the same decision (another turn id) fails its guard.
    let mut other = PostgresStore::connect(&url).expect("second writer");
    let mut engine2 = Engine::new();
    decide(&mut engine2, 1, tree_inputs("R", 0).remove(0));
    let theirs = decide(
        &mut engine2,
        2,
        json!({"type": "submit", "agentSessionId": "R", "turnId": "T-other", "text": "go"}),
    );
    other.apply(&theirs).expect("their submit");
    let refused = store.apply(&batches.remove(0));
    assert!(
        matches!(refused, Err(PgError::GuardFailed(_))),
        "refused: {refused:?}"
    );
    assert_eq!(store.last_commit_mark(), committed, "no new mark");
    assert!(!store.read_back_commit(committed + 1).expect("read back"));
}

/// Issue 34: "A row that conflicts with an existing one is never dropped silently inside a
/// batch that otherwise commits: the batch is refused whole". Two writers decide different
/// messages at the same (session, seq); the first commits; the second's batch, with its guards
/// removed so that only the message collides, is refused whole (its turn and outbox rows are
/// not written), while a replay of the committed batch still passes and writes nothing.
#[test]
fn a_batch_whose_message_collides_with_a_stored_one_is_refused_whole() {
    let server = Server::fast().expect("postgres server");
    let url = server.create_database().expect("db");
    let mut store = PostgresStore::connect(&url).expect("connect");
    let mut engines = [Engine::new(), Engine::new()];
    for v in tree_inputs("R", 0) {
        let b = decide(&mut engines[0], 1, v.clone());
        decide(&mut engines[1], 1, v);
        store.apply(&b).expect("shared prefix");
    }
    let message = |id: &str| json!({"type": "messageAppended", "agentSessionId": "C-R", "turnId": "CT-R", "messageId": id, "role": "assistant", "text": "x"});
    let first = decide(&mut engines[0], 2, message("m-first"));
    let mut second = decide(&mut engines[1], 2, message("m-second"));
    store.apply(&first).expect("first message");
    let head = store.last_outbox_seq().expect("seq");
    second.guards.clear();
    let refused = store.apply(&second);
    assert!(
        matches!(
            refused,
            Err(PgError::RowConflict {
                table: "messages",
                ..
            })
        ),
        "refused whole: {refused:?}"
    );
    assert!(<PostgresStore as HostStore>::is_guard_failure(
        &refused.expect_err("refused")
    ));
    assert_eq!(store.last_outbox_seq().expect("seq"), head, "no outbox row");
    let msgs = store.messages("C-R", None, 10).expect("messages");
    assert_eq!(msgs.len(), 1);
    assert_eq!(&*msgs[0].message_id, "m-first", "the stored message stays");
    assert_eq!(
        store.apply(&first).expect("a replay passes"),
        Vec::<u64>::new(),
        "a replay writes nothing"
    );
}
