//! Issue 19: "The daemon runs on any `Store`": the daemon core uses only `Store` and `HostStore`,
//! so it runs unchanged on the in-memory reference store. A real demo ACP agent process runs a
//! turn with children through `Daemon::start_on` over a shared `MemoryStore`; the tree settles,
//! its rows are in that store, the outbox is gap-free, and a follower streams every row.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tutti_core::model::{CancelOperation, Id, Interaction, Message, Session, Turn};
use tutti_core::projection::SessionDetail;
use tutti_core::snapshot::TreeSnapshot;
use tutti_core::step::PersistBatch;
use tutti_core::store::{
    GroupError, HostStore, MemoryStore, OutboxRow, Published, RootsPage, Store, StoreError,
};
use tutti_core::{Command, EngineConfig, Input};
use tutti_tokio::daemon::{Daemon, DaemonOptions, ProviderFactory, StoreCheckpoint};
use tutti_tokio::follow::Follower;
use tutti_tokio::providers::Registry;
use tutti_tokio::retention::Retention;

/// One `MemoryStore` behind a lock: the engine thread's writer and the API's reader are two
/// handles on it (as two SQLite connections are on one file). Every call locks once. `fail`
/// makes that many next group commits fail as a whole (a store that is briefly unavailable),
/// writing nothing.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<MemoryStore>>, Arc<AtomicUsize>);

impl Shared {
    fn get(&self) -> MutexGuard<'_, MemoryStore> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Store for Shared {
    type Error = StoreError;
    fn apply(&mut self, batch: &PersistBatch) -> Result<Vec<u64>, StoreError> {
        self.get().apply(batch)
    }
    fn load_tree(&self, root: &str) -> Result<Option<TreeSnapshot>, StoreError> {
        self.get().load_tree(root)
    }
    fn load_live_trees(&self) -> Result<Vec<TreeSnapshot>, StoreError> {
        self.get().load_live_trees()
    }
    fn session(&self, id: &str) -> Result<Option<Session>, StoreError> {
        self.get().session(id)
    }
    fn turn(&self, id: &str) -> Result<Option<Turn>, StoreError> {
        self.get().turn(id)
    }
    fn session_detail(&self, id: &str) -> Result<Option<SessionDetail>, StoreError> {
        self.get().session_detail(id)
    }
    fn messages(
        &self,
        session: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Message>, StoreError> {
        self.get().messages(session, after, limit)
    }
    fn interaction(&self, turn: &str, request: &str) -> Result<Option<Interaction>, StoreError> {
        self.get().interaction(turn, request)
    }
    fn cancel_operation(&self, id: &str) -> Result<Option<CancelOperation>, StoreError> {
        self.get().cancel_operation(id)
    }
    fn outbox_after(&self, after: u64, limit: usize) -> Result<Vec<OutboxRow>, StoreError> {
        self.get().outbox_after(after, limit)
    }
}

impl HostStore for Shared {
    fn apply_group(
        &mut self,
        batches: &[&PersistBatch],
        payloads: bool,
    ) -> Result<Vec<Vec<Published>>, GroupError<StoreError>> {
        let fail = self
            .1
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            return Err(GroupError::Commit(StoreError::GuardFailed(
                "unavailable".into(),
            )));
        }
        self.get().apply_group(batches, payloads)
    }
    fn is_guard_failure(error: &StoreError) -> bool {
        MemoryStore::is_guard_failure(error)
    }
    fn is_unavailable(error: &StoreError) -> bool {
        MemoryStore::is_unavailable(error)
    }
    fn root_of(&self, session: &str) -> Result<Option<Id>, StoreError> {
        HostStore::root_of(&*self.get(), session)
    }
    fn root_of_cancel_operation(&self, operation: &str) -> Result<Option<Id>, StoreError> {
        self.get().root_of_cancel_operation(operation)
    }
    fn roots(
        &self,
        workspace: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage, StoreError> {
        HostStore::roots(&*self.get(), workspace, limit, cursor)
    }
    fn last_outbox_seq(&self) -> Result<u64, StoreError> {
        self.get().last_outbox_seq()
    }
    fn set_session_cwd(&mut self, root: &str, cwd: &str) -> Result<(), StoreError> {
        self.get().set_session_cwd(root, cwd)
    }
    fn session_cwd(&self, root: &str) -> Result<Option<String>, StoreError> {
        self.get().session_cwd(root)
    }
    fn prune_outbox(
        &mut self,
        policy: &tutti_core::store::RetentionPolicy,
        now_ms: i64,
        protect: Option<u64>,
        max_rows: usize,
    ) -> Result<tutti_core::store::PruneOutcome, StoreError> {
        self.get().prune_outbox(policy, now_ms, protect, max_rows)
    }
    fn read_consistent<T>(&self, f: impl FnOnce(&Self) -> T) -> Result<T, StoreError> {
        Ok(f(self))
    }
}

fn registry() -> Arc<Registry> {
    Arc::new(common::demo_registry())
}

fn start(store: &Shared, providers: Arc<Registry>) -> Daemon {
    Daemon::start_on(
        store.clone(),
        Box::new(store.clone()),
        Box::new(StoreCheckpoint::default()),
        DaemonOptions {
            durability: Default::default(),
            max_providers: None,
            db: "memory".into(),
            providers: providers.clone(),
            engine: EngineConfig::default(),
            idle_timeout: None,
            retention: Retention {
                prune_interval_ms: 0,
                ..Retention::default()
            },
        },
    )
    .expect("start on the memory store")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_runs_a_real_provider_turn_on_the_memory_store() {
    let store = Shared::default();
    let providers = registry();
    let d = start(&store, providers.clone());
    let mut follower = Follower::new(&d, 0);
    d.call(Input::Command(Command::CreateSession {
        agent_session_id: "R".into(),
        workspace_id: "w".into(),
        provider: "agent".into(),
        title: None,
        capabilities: providers.capabilities("agent"),
    }))
    .await
    .expect("create");
    d.call(Input::Command(Command::Submit {
        agent_session_id: "R".into(),
        turn_id: "t1".into(),
        text: "children=2 permission=0 fail=0 late=0".into(),
    }))
    .await
    .expect("submit");
    // A liveness bound only (the demo agent at speed 16 settles in well under a second).
    let start = Instant::now();
    let detail = loop {
        let detail = d
            .read(|r| r.session_detail("R"))
            .expect("read")
            .expect("detail")
            .expect("the root exists");
        let settled = detail.session.active_turn_id.is_none()
            && detail
                .child_sessions
                .iter()
                .all(|c| c.active_turn_id.is_none());
        let root_turn = store.get().turn("t1").expect("turn");
        if settled && root_turn.is_some_and(|t| t.outcome().is_some()) {
            break detail;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the tree did not settle: {detail:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        !detail.child_sessions.is_empty(),
        "the demo agent's children were recorded in the memory store"
    );
    let outbox = store.get().outbox().to_vec();
    let seqs: Vec<u64> = outbox.iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs,
        (1..=outbox.len() as u64).collect::<Vec<_>>(),
        "gap-free outbox"
    );
    // Every committed row reaches a follower, in order.
    let mut streamed = Vec::new();
    while streamed.len() < outbox.len() {
        let rows = tokio::time::timeout(Duration::from_secs(20), follower.next())
            .await
            .expect("the follower is fed")
            .expect("rows");
        streamed.extend(rows.into_iter().map(|r| r.seq));
    }
    assert_eq!(streamed[..outbox.len()], seqs[..]);
    d.shutdown().await;
}

fn create(id: &str) -> Input {
    Input::Command(Command::CreateSession {
        agent_session_id: id.into(),
        workspace_id: "w".into(),
        provider: "agent".into(),
        title: None,
        capabilities: None,
    })
}

/// "Group commit + one-by-one retry on failure": a group that fails as a whole is retried batch
/// by batch; a batch that fails again answers an error (for a guard failure, the typed
/// conflict), its tree is reloaded from the
/// store (so the engine holds nothing the store does not), and the tree goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_group_is_retried_one_by_one_and_a_lost_batch_reloads_its_tree() {
    let store = Shared::default();
    let d = start(&store, registry());
    // The group fails, its retry passes.
    store.1.store(1, SeqCst);
    d.call(create("A")).await.expect("committed on the retry");
    assert!(store.get().session("A").expect("read").is_some());
    // The group and the retry fail: the caller learns it and nothing was kept.
    store.1.store(2, SeqCst);
    let submit = |turn: &str| {
        Input::Command(Command::Submit {
            agent_session_id: "A".into(),
            turn_id: turn.into(),
            text: "children=0 permission=0 fail=0 late=0".into(),
        })
    };
    let lost = d.call(submit("t1")).await;
    // The injected failure is a guard failure: the caller gets the typed conflict (issue 21,
    // commit races: 409 `commit_conflict`).
    assert!(
        matches!(lost, Err(tutti_tokio::daemon::DaemonError::Conflict)),
        "{lost:?}"
    );
    assert!(store.get().turn("t1").expect("read").is_none());
    // The engine reloaded the tree: the next submit starts a new root turn (it would be
    // appended to the lost turn had the engine kept it).
    let step = d.call(submit("t2")).await.expect("submit after the reload");
    assert_eq!(step.reply.map(|r| r.name()), Some("started"));
    d.shutdown().await;
}
