//! Following the outbox: a client's position in the event stream, read from the file while it
//! is behind and from memory (the rows each commit just wrote) once it has caught up.
//!
//! Every committed outbox row is in the file, numbered gap-free from 1, so the file alone is the
//! truth: a follower that falls behind the live channel (it lags, or sees a batch that does not
//! start right after its position) reads the file again from its position. The live channel only
//! saves the round trip through SQLite for a follower that keeps up, which is what keeps the
//! provider line → committed → streamed latency low under load.
//!
//! Rows that another daemon commits to the same database never pass through this daemon's live
//! channel: the daemon's commits watch (see [`Daemon::with_commits_from`], fed by `LISTEN/NOTIFY`
//! on PostgreSQL) wakes a waiting follower, which reads the store again when the committed seq
//! is above its position. Its own later live batches then start above its position + 1 or
//! carry only rows it has seen, so each row is still yielded once, in order.
//!
//! Retention (see [`crate::retention`]) deletes old rows, but never a row above the position of
//! a live follower: each follower registers its position with the daemon while it exists. A
//! follower that starts at a position whose next rows were already pruned (`0 < position <
//! outbox_pruned_through`) gets [`Followed::Reset`] once, then continues with the oldest kept
//! row: never a silent gap. Position 0 means "everything kept" and never resets (choice: a
//! client with no position has nothing to miss).
//!
//! A follower that starts at a position beyond the newest row (a client coming back to a
//! restored, older database, or to another database) gets a [`Followed::Reset`] too, with
//! `pruned_through` = the newest seq: the rows it has seen are not the rows this database holds,
//! so it reloads and continues after the newest row (issue 36 item 8). A position equal to the
//! newest row is simply caught up.

use crate::daemon::{Daemon, DaemonError};
use crate::metrics::Stage;
use std::sync::Arc;
use tokio::sync::broadcast;
use tutti_core::model::Id;
use tutti_core::store::OutboxRow;

/// One outbox row as a commit wrote it (the payload is the stored JSON text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveRow {
    /// Outbox sequence number.
    pub seq: u64,
    /// Entity kind.
    pub kind: &'static str,
    /// The tree.
    pub root_agent_session_id: Id,
    /// The workspace.
    pub workspace_id: Id,
    /// The entity's wire JSON, as stored.
    pub payload: String,
}

/// The rows of one commit, in sequence order.
pub type LiveBatch = Arc<Vec<LiveRow>>;

/// How many commits the live channel holds for a slow follower before it falls back to the file.
pub const LIVE_CAPACITY: usize = 1024;

/// How many rows one read from the file returns at most.
const PAGE: usize = 256;

/// What a follower yields next.
#[derive(Debug, Clone, PartialEq)]
pub enum Followed {
    /// The next rows, in order (never empty).
    Rows(Vec<OutboxRow>),
    /// The rows after `requested_after` up to and including `pruned_through` no longer exist
    /// (retention deleted them before this follower asked); the next rows have a seq above
    /// `pruned_through`. The reader should reload what it shows from the API. Also yielded, with
    /// `pruned_through` = the newest seq, for a starting position beyond the newest row.
    Reset {
        /// The position the follower asked for.
        requested_after: u64,
        /// Every row up to this seq is gone; the follower continues after it.
        pruned_through: u64,
    },
}

/// A position in the outbox that yields every row after it exactly once, in order.
pub struct Follower {
    daemon: Daemon,
    cursor: u64,
    live: broadcast::Receiver<LiveBatch>,
    behind: bool,
    /// This follower's key in the daemon's live positions.
    key: u64,
    /// Commits of any writer of the database (see [`Daemon::with_commits_from`]); `None` once
    /// its sender is gone.
    commits: Option<tokio::sync::watch::Receiver<u64>>,
    /// Whether the starting position was checked against the newest row (only the first read
    /// can find it beyond: later positions are rows this follower was given).
    head_checked: bool,
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.daemon.live_positions().remove(self.key);
    }
}

impl Follower {
    /// Follows the outbox from after `after` (0: from the start of what is kept).
    pub fn new(daemon: &Daemon, after: u64) -> Follower {
        // Subscribe before the first read: a row committed between the two is in one or the other.
        let live = daemon.live();
        // Registered before the first read: rows above `after` are kept from now on (rows a
        // pass deleted just before are reported by a reset, see `next_event`).
        let key = daemon.live_positions().register(after);
        let mut commits = daemon.commits_watch();
        commits.mark_unchanged();
        Follower {
            commits: Some(commits),
            daemon: daemon.clone(),
            cursor: after,
            live,
            behind: true,
            key,
            head_checked: false,
        }
    }

    fn advance(&mut self, to: u64) {
        self.cursor = to;
        self.daemon.live_positions().set(self.key, to);
    }

    /// The sequence number of the last row returned.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// The next rows (never empty); waits until there are some. `Err` once the daemon stops or
    /// the file cannot be read, and [`DaemonError::OutboxPruned`] for a [`Followed::Reset`]
    /// (the follower then continues after the pruned rows).
    pub async fn next(&mut self) -> Result<Vec<OutboxRow>, DaemonError> {
        match self.next_event().await? {
            Followed::Rows(rows) => Ok(rows),
            Followed::Reset {
                requested_after,
                pruned_through,
            } => Err(DaemonError::OutboxPruned {
                requested_after,
                pruned_through,
            }),
        }
    }

    /// The next rows, or a reset if the rows after this follower's position were pruned; waits
    /// until there is something. `Err` once the daemon stops or the file cannot be read.
    pub async fn next_event(&mut self) -> Result<Followed, DaemonError> {
        loop {
            if self.behind {
                let d = self.daemon.clone();
                let after = self.cursor;
                let check_head = !self.head_checked && after > 0;
                // One read transaction: the pruned mark, the newest seq and the rows are of one
                // committed state.
                let (pruned, head, rows) = tokio::task::spawn_blocking(move || {
                    d.read(|r| {
                        let pruned = r.outbox_pruned_through()?;
                        let head = if check_head {
                            Some(r.last_outbox_seq()?)
                        } else {
                            None
                        };
                        let rows =
                            if (after > 0 && after < pruned) || head.is_some_and(|h| after > h) {
                                Vec::new()
                            } else {
                                r.outbox_after(after, PAGE)?
                            };
                        Ok::<_, crate::reads::ReadError>((pruned, head, rows))
                    })
                })
                .await
                .map_err(|e| DaemonError::Storage(e.to_string()))??
                .map_err(DaemonError::from)?;
                self.head_checked = true;
                if let Some(head) = head.filter(|h| after > *h) {
                    self.advance(head);
                    return Ok(Followed::Reset {
                        requested_after: after,
                        pruned_through: head,
                    });
                }
                if after > 0 && after < pruned {
                    self.advance(pruned);
                    return Ok(Followed::Reset {
                        requested_after: after,
                        pruned_through: pruned,
                    });
                }
                if let Some(last) = rows.last() {
                    self.advance(last.seq);
                    return Ok(Followed::Rows(rows));
                }
                self.behind = false;
            }
            let live = match &mut self.commits {
                Some(commits) => tokio::select! {
                    r = self.live.recv() => r,
                    changed = commits.changed() => {
                        match changed {
                            // Another writer committed rows past this position: read them.
                            Ok(()) => {
                                if *commits.borrow_and_update() > self.cursor {
                                    self.behind = true;
                                }
                            }
                            Err(_) => self.commits = None,
                        }
                        continue;
                    }
                },
                None => self.live.recv().await,
            };
            match live {
                Ok(batch) => {
                    let Some(first) = batch.first() else { continue };
                    if first.seq > self.cursor + 1 {
                        // Rows this follower has not seen were committed before this batch.
                        self.behind = true;
                        continue;
                    }
                    let t = std::time::Instant::now();
                    let mut out = Vec::with_capacity(batch.len());
                    for r in batch.iter().filter(|r| r.seq > self.cursor) {
                        let payload = serde_json::from_str(&r.payload)
                            .map_err(|e| DaemonError::Storage(e.to_string()))?;
                        out.push(OutboxRow {
                            seq: r.seq,
                            kind: r.kind.to_string(),
                            root_agent_session_id: r.root_agent_session_id.clone(),
                            workspace_id: r.workspace_id.clone(),
                            payload,
                        });
                    }
                    self.daemon.metrics().stage(Stage::Stream, t.elapsed());
                    if let Some(last) = out.last() {
                        self.advance(last.seq);
                        return Ok(Followed::Rows(out));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => self.behind = true,
                Err(broadcast::error::RecvError::Closed) => return Err(DaemonError::Stopped),
            }
        }
    }
}
