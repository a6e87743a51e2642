//! The commit pipeline (issue 33, "committing while the engine decides the next group"): group
//! commits on a thread of their own, with a store handle of their own, so that the engine
//! thread decides the next inputs while the last group is written.
//!
//! The engine thread hands over one group at a time ([`Pipeline::send`]): every batch the
//! driver decided while the previous group was being written, so a group grows with the load
//! instead of being whatever one short round decided. The commit thread writes it in one
//! transaction and, if that fails, batch by batch ([`commit_group`]); it sends the outcome back
//! and wakes the engine thread, which acknowledges each batch to the driver in order
//! ([`GroupOutcome`]), exactly as an inline commit would. Only one group is in flight: the next
//! is sent after the last one's outcome was acknowledged, so a batch the driver dropped because
//! an earlier batch of its tree failed is never sent.
//!
//! What keeps this safe is the driver's contract: nothing a batch caused (its rows, provider
//! requests, timers, reply) leaves the driver before the batch is acknowledged, and a tree whose
//! batches wait for a commit is never evicted or read back from the store (a tree is reloaded
//! only after its failed batch was acknowledged, when none of its batches is in flight).
//!
//! The commit thread also announces each group's rows to the live followers itself, as soon as
//! they are durable ([`announce`]), instead of the engine thread after it acknowledged the
//! group: a row then reaches the followers without waiting for the engine thread to finish the
//! round it is deciding and to be scheduled again. That keeps the promises the engine thread's
//! announcement kept: rows are announced in seq order (one group in flight, written by the only
//! handle that writes outbox rows), each announced batch is gap-free, and a commit's rows go
//! out before anything it released (replies included), which the engine thread sends only after
//! it acknowledged the group. The engine thread still moves the committed seq
//! ([`crate::daemon`]'s commits watch) when it acknowledges, after the rows went out.
//!
//! Choice: the pipeline runs only for stores without tree leases (SQLite, opened a second time
//! by [`crate::daemon::Daemon::start`]). With leases (PostgreSQL) a batch's fence and the lease
//! state live on the engine thread, next to the claims and renewals that move them, so those
//! commits stay inline.

use crate::metrics::{Metrics, Stage};
use crate::outbox::{LiveBatch, LiveRow, LiveRows};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::broadcast;
use tracing::warn;
use tutti_core::driver::BatchId;
use tutti_core::model::Id;
use tutti_core::step::PersistBatch;
use tutti_core::store::{GroupError, HostStore, Published};

/// A group's batches, each with the lease epoch it was decided under, oldest first.
pub(crate) type Decided = Vec<(BatchId, Option<u64>)>;

/// What a store answers for a group commit: the outbox rows of each batch.
type GroupResult<S> =
    Result<Vec<Vec<Published>>, GroupError<<S as tutti_core::store::Store>::Error>>;

/// One group commit of batches with their epochs (inline: [`crate::daemon::Housekeeping::commit_group`];
/// on the commit thread: [`HostStore::apply_group`]).
pub(crate) type CommitFn<'a, S> =
    dyn FnMut(&[&PersistBatch], &[Option<u64>]) -> GroupResult<S> + 'a;

/// What became of one batch of a group.
#[derive(Debug)]
pub(crate) enum BatchOutcome {
    /// Durable, with the outbox rows the store wrote for it.
    Committed(Vec<Published>),
    /// Not written.
    Failed(CommitError),
    /// Not tried: an earlier batch of its tree in the same group failed (the driver drops such
    /// batches when it learns of that failure).
    Skipped,
}

/// Why a batch was not written, classified by the store that refused it (the driver and the
/// caller are told a conflict, an unavailable store, or a failure).
#[derive(Debug, Clone)]
pub(crate) struct CommitError {
    /// The store's message (ids and kinds, never content).
    pub message: String,
    /// A failed guard: the batch was decided on a state that no longer holds.
    pub guard: bool,
    /// The store's fence refused it (a lost tree lease).
    pub fenced: bool,
    /// The store could not be reached.
    pub unavailable: bool,
}

impl CommitError {
    fn of<S: HostStore>(e: &S::Error) -> CommitError {
        CommitError {
            message: e.to_string(),
            guard: S::is_guard_failure(e),
            fenced: S::is_fenced(e),
            unavailable: S::is_unavailable(e),
        }
    }
}

/// The outcome of one group: one [`BatchOutcome`] per batch, in order.
#[derive(Debug)]
pub(crate) struct GroupOutcome {
    /// The group's batches with the lease epoch each was decided under, as sent.
    pub ids: Decided,
    /// What became of each.
    pub results: Vec<BatchOutcome>,
    /// Why the group's one transaction failed (then its batches were written one by one).
    pub group_error: Option<CommitError>,
    /// Time spent writing.
    pub took: Duration,
    /// When the engine took the round of provider lines the group was decided in, if any.
    pub line_round: Option<Instant>,
}

/// Commits `batches` as one group with `commit`; if the group fails, one by one, skipping the
/// later batches of a tree whose batch failed (they were decided on its lost state). Returns
/// one outcome per batch and the group's own error, if it failed.
pub(crate) fn commit_group<S: HostStore>(
    batches: &[&PersistBatch],
    epochs: &[Option<u64>],
    commit: &mut CommitFn<'_, S>,
) -> (Vec<BatchOutcome>, Option<CommitError>) {
    let group_error = match commit(batches, epochs) {
        Ok(published) => {
            let mut out: Vec<BatchOutcome> =
                published.into_iter().map(BatchOutcome::Committed).collect();
            // A store answers one entry per batch; a short answer is a store bug, and the
            // batches it left out are not known to be durable.
            out.resize_with(batches.len(), || {
                BatchOutcome::Failed(CommitError {
                    message: "the store did not report this batch".into(),
                    guard: false,
                    fenced: false,
                    unavailable: false,
                })
            });
            return (out, None);
        }
        Err(e) => CommitError::of::<S>(e.source_error()),
    };
    let mut failed_roots: Vec<&Id> = Vec::new();
    let mut out = Vec::with_capacity(batches.len());
    for (batch, epoch) in batches.iter().zip(epochs) {
        let root = batch.root_agent_session_id.as_ref();
        if root.is_some_and(|r| failed_roots.contains(&r)) {
            out.push(BatchOutcome::Skipped);
            continue;
        }
        match commit(&[batch], &[*epoch]) {
            Ok(mut p) => out.push(BatchOutcome::Committed(p.pop().unwrap_or_default())),
            Err(e) => {
                out.push(BatchOutcome::Failed(CommitError::of::<S>(e.source_error())));
                failed_roots.extend(root);
            }
        }
    }
    (out, Some(group_error))
}

/// The rows of a written group, as the live followers get them: one [`LiveRows`] per gap-free
/// run of seqs (a committed batch without a tree or workspace is not sent live, and its rows
/// leave a gap that followers fill from the store). Each row's payload moves from the outcome
/// into its live row: the engine thread, which gets the outcomes, no longer announces rows.
pub(crate) fn announce(batches: &[PersistBatch], results: &mut [BatchOutcome]) -> Vec<LiveRows> {
    let mut out = Vec::new();
    let mut run: Vec<LiveRow> = Vec::new();
    for (batch, result) in batches.iter().zip(results.iter_mut()) {
        let BatchOutcome::Committed(published) = result else {
            continue;
        };
        let (Some(root), Some(ws)) = (&batch.root_agent_session_id, &batch.workspace_id) else {
            continue;
        };
        for p in published.iter_mut() {
            let Some(row) = batch.rows.get(p.row as usize) else {
                continue;
            };
            if run.last().is_some_and(|last| last.seq + 1 != p.seq) {
                out.push(LiveRows::new(std::mem::take(&mut run)));
            }
            let payload = std::mem::take(&mut p.payload);
            run.push(LiveRow::new(
                p.seq,
                row.kind(),
                root.clone(),
                ws.clone(),
                payload,
            ));
        }
    }
    if !run.is_empty() {
        out.push(LiveRows::new(run));
    }
    out
}

/// One group on its way to the commit thread.
struct Group {
    batches: Vec<PersistBatch>,
    epochs: Vec<Option<u64>>,
}

/// What the commit thread sends back for one group.
struct Written {
    results: Vec<BatchOutcome>,
    group_error: Option<CommitError>,
    took: Duration,
}

/// The engine thread's end of the commit thread (see the module docs).
pub(crate) struct Pipeline {
    to_commit: mpsc::Sender<Group>,
    written: mpsc::Receiver<Written>,
    /// The group being written: its batches with their epochs, and its round of lines.
    in_flight: Option<(Decided, Option<Instant>)>,
}

impl Pipeline {
    /// Starts the commit thread on `store` (a handle of its own on the engine thread's data);
    /// `live` is the live followers' channel it announces committed rows on ([`announce`]), and
    /// `wake` tells the engine thread an outcome is ready.
    pub(crate) fn start<S: HostStore + Send + 'static>(
        mut store: S,
        metrics: Arc<Metrics>,
        live: broadcast::WeakSender<LiveBatch>,
        wake: impl Fn() + Send + 'static,
    ) -> std::io::Result<Pipeline> {
        let (to_commit, groups) = mpsc::channel::<Group>();
        let (done, written) = mpsc::channel();
        std::thread::Builder::new()
            .name("tutti-commit".into())
            .spawn(move || {
                // Ends when the engine thread drops its end.
                while let Ok(group) = groups.recv() {
                    let refs: Vec<&PersistBatch> = group.batches.iter().collect();
                    let t = Instant::now();
                    let (mut results, group_error) =
                        commit_group::<S>(&refs, &group.epochs, &mut |b, _| {
                            store.apply_group(b, true)
                        });
                    let took = t.elapsed();
                    metrics.stage(Stage::Commit, took);
                    let t = Instant::now();
                    if let Some(live) = live.upgrade().filter(|l| l.receiver_count() > 0) {
                        for rows in announce(&group.batches, &mut results) {
                            let _ = live.send(Arc::new(rows));
                        }
                        metrics.stage(Stage::Publish, t.elapsed());
                    }
                    let w = Written {
                        results,
                        group_error,
                        took,
                    };
                    if done.send(w).is_err() {
                        return;
                    }
                    wake();
                }
            })?;
        Ok(Pipeline {
            to_commit,
            written,
            in_flight: None,
        })
    }

    /// Whether a group is being written.
    pub(crate) fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Hands one group over: `batches[i]` is the batch of `ids[i]`. Call only when none is in
    /// flight.
    pub(crate) fn send(
        &mut self,
        ids: Decided,
        batches: Vec<PersistBatch>,
        line_round: Option<Instant>,
    ) {
        debug_assert!(self.in_flight.is_none(), "one group in flight at a time");
        let epochs = ids.iter().map(|(_, e)| *e).collect();
        // A commit thread that is gone (it only ends when this end is dropped, or if it
        // panicked) is seen by [`Pipeline::outcome`], which fails the group.
        let _ = self.to_commit.send(Group { batches, epochs });
        self.in_flight = Some((ids, line_round));
    }

    /// The outcome of the group in flight, if it is ready (`wait`: blocks until it is). A
    /// commit thread that is gone fails the group (nothing of it is known to be written).
    pub(crate) fn outcome(&mut self, wait: bool) -> Option<GroupOutcome> {
        self.in_flight.as_ref()?;
        let written = if wait {
            self.written.recv().map_err(|_| true)
        } else {
            self.written
                .try_recv()
                .map_err(|e| e == mpsc::TryRecvError::Disconnected)
        };
        let written = match written {
            Ok(w) => w,
            Err(false) => return None,
            Err(true) => {
                warn!("the commit thread is gone; its group is failed");
                let gone = CommitError {
                    message: "the commit thread is gone".into(),
                    guard: false,
                    fenced: false,
                    unavailable: false,
                };
                let n = self.in_flight.as_ref().map_or(0, |(ids, _)| ids.len());
                Written {
                    results: (0..n).map(|_| BatchOutcome::Failed(gone.clone())).collect(),
                    group_error: Some(gone),
                    took: Duration::ZERO,
                }
            }
        };
        let (ids, line_round) = self.in_flight.take()?;
        Some(GroupOutcome {
            ids,
            results: written.results,
            group_error: written.group_error,
            took: written.took,
            line_round,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tutti_core::step::Guard;
    use tutti_core::store::Store;
    use tutti_core::{Command, Engine, Input};
    use tutti_sqlite::SqliteStore;

    fn create(engine: &mut Engine, id: &str) -> PersistBatch {
        let input = Input::Command(Command::CreateSession {
            agent_session_id: id.into(),
            workspace_id: "w".into(),
            provider: "demo".into(),
            title: None,
            capabilities: None,
        });
        engine.handle(1_000, &input).expect("create").persist
    }

    /// The rows a written group announces: in seq order, one gap-free run per batch of live
    /// rows, each row's kind from its batch row and its payload moved out of the outcome; a
    /// failed or skipped batch, and a batch with no tree, announce nothing, and a gap in the
    /// seqs starts a new run.
    #[test]
    fn a_written_group_announces_its_committed_rows_in_gap_free_runs() {
        let mut engine = Engine::new();
        let a = create(&mut engine, "a");
        let b = create(&mut engine, "b");
        let c = create(&mut engine, "c");
        let mut treeless = c.clone();
        treeless.root_agent_session_id = None;
        let rows = |first: u64, batch: &PersistBatch| -> Vec<Published> {
            (0..batch.rows.len())
                .map(|i| Published {
                    seq: first + i as u64,
                    row: i as u32,
                    payload: format!("{{\"n\":{}}}", first + i as u64),
                })
                .collect()
        };
        let (na, nb) = (a.rows.len() as u64, b.rows.len() as u64);
        assert!(na > 0 && nb > 0, "a creation writes rows");
        let batches = vec![a.clone(), b.clone(), c.clone(), treeless, a.clone()];
        let mut results = vec![
            BatchOutcome::Committed(rows(1, &a)),
            BatchOutcome::Committed(rows(1 + na, &b)),
            BatchOutcome::Failed(CommitError {
                message: "guard".into(),
                guard: true,
                fenced: false,
                unavailable: false,
            }),
            // Committed but not live: its seqs leave a gap.
            BatchOutcome::Committed(rows(1 + na + nb, &c)),
            BatchOutcome::Committed(rows(1 + na + nb + c.rows.len() as u64, &a)),
        ];
        let runs = announce(&batches, &mut results);
        let seqs: Vec<Vec<u64>> = runs
            .iter()
            .map(|r| r.iter().map(|row| row.seq).collect())
            .collect();
        let first_run: Vec<u64> = (1..=na + nb).collect();
        let after_gap = 1 + na + nb + c.rows.len() as u64;
        let second_run: Vec<u64> = (after_gap..after_gap + na).collect();
        assert_eq!(seqs, vec![first_run, second_run]);
        let first = &runs[0][0];
        assert_eq!(first.kind, a.rows[0].kind());
        assert_eq!(&*first.root_agent_session_id, "a");
        assert_eq!(first.payload, "{\"n\":1}");
        assert!(
            matches!(&results[0], BatchOutcome::Committed(p) if p.iter().all(|p| p.payload.is_empty())),
            "the payloads moved into the live rows"
        );
        assert!(
            matches!(&results[3], BatchOutcome::Committed(p) if p.iter().all(|p| !p.payload.is_empty())),
            "a batch that is not live keeps its payloads"
        );
    }

    /// A failed group is written batch by batch: the failing batch is named by its store's
    /// classification, the later batches of its tree are not tried (they were decided on its
    /// lost state; here one would commit on its own), and the other trees' batches commit.
    #[test]
    fn a_failed_group_commits_batch_by_batch_and_skips_the_rest_of_a_failed_tree() {
        let dir = std::env::temp_dir().join(format!("tutti-pipeline-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let mut store = SqliteStore::open(dir.join("t.db")).expect("open");
        let mut engine = Engine::new();
        let b = create(&mut engine, "b");
        let a = create(&mut engine, "a");
        let c = create(&mut engine, "c");
        assert_eq!(a.root_agent_session_id.as_deref(), Some("a"));
        // A batch of tree `a` decided on a state the store does not hold.
        let mut stale = a.clone();
        stale.guards = [Guard::SessionVersion {
            id: "a".into(),
            version: 5,
            next: 6,
        }]
        .into_iter()
        .collect();
        let batches = [&b, &stale, &a, &c];
        let epochs = [None; 4];
        let (out, group_error) =
            commit_group::<SqliteStore>(&batches, &epochs, &mut |g, _| store.apply_group(g, true));
        let e = group_error.expect("the group failed");
        assert!(e.guard && !e.unavailable && !e.fenced, "{e:?}");
        assert!(
            matches!(&out[0], BatchOutcome::Committed(p) if !p.is_empty()),
            "{out:?}"
        );
        assert!(
            matches!(&out[1], BatchOutcome::Failed(e) if e.guard),
            "{out:?}"
        );
        assert!(matches!(&out[2], BatchOutcome::Skipped), "{out:?}");
        assert!(
            matches!(&out[3], BatchOutcome::Committed(p) if !p.is_empty()),
            "{out:?}"
        );
        assert!(store.session("b").expect("read").is_some());
        assert!(store.session("c").expect("read").is_some());
        assert!(
            store.session("a").expect("read").is_none(),
            "nothing of the failed tree was written"
        );
        let (out, group_error) =
            commit_group::<SqliteStore>(&[&a], &[None], &mut |g, _| store.apply_group(g, true));
        assert!(group_error.is_none() && matches!(&out[0], BatchOutcome::Committed(_)));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
