//! Following the outbox: a client's position in the event stream, read from the file while it
//! is behind and from memory (the rows each commit just wrote) once it has caught up.
//!
//! Every committed outbox row is in the file, numbered gap-free from 1, so the file alone is the
//! truth: a follower that falls behind the live channel (it lags, or sees a batch that does not
//! start right after its position) reads the file again from its position. The live channel only
//! saves the round trip through SQLite for a follower that keeps up, which is what keeps the
//! provider line → committed → streamed latency low under load.

use crate::daemon::{Daemon, DaemonError};
use std::sync::Arc;
use tokio::sync::broadcast;
use tutti_core::model::Id;
use tutti_core::store::{OutboxRow, Store};

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

/// A position in the outbox that yields every row after it exactly once, in order.
pub struct Follower {
    daemon: Daemon,
    cursor: u64,
    live: broadcast::Receiver<LiveBatch>,
    behind: bool,
}

impl Follower {
    /// Follows the outbox from after `after` (0: from the start of what is kept).
    pub fn new(daemon: &Daemon, after: u64) -> Follower {
        // Subscribe before the first read: a row committed between the two is in one or the other.
        let live = daemon.live();
        Follower {
            daemon: daemon.clone(),
            cursor: after,
            live,
            behind: true,
        }
    }

    /// The sequence number of the last row returned.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// The next rows (never empty); waits until there are some. `Err` once the daemon stops or
    /// the file cannot be read.
    pub async fn next(&mut self) -> Result<Vec<OutboxRow>, DaemonError> {
        loop {
            if self.behind {
                let d = self.daemon.clone();
                let after = self.cursor;
                let rows =
                    tokio::task::spawn_blocking(move || d.read(|r| r.outbox_after(after, PAGE)))
                        .await
                        .map_err(|e| DaemonError::Storage(e.to_string()))??
                        .map_err(|e| DaemonError::Storage(e.to_string()))?;
                if let Some(last) = rows.last() {
                    self.cursor = last.seq;
                    return Ok(rows);
                }
                self.behind = false;
            }
            match self.live.recv().await {
                Ok(batch) => {
                    let Some(first) = batch.first() else { continue };
                    if first.seq > self.cursor + 1 {
                        // Rows this follower has not seen were committed before this batch.
                        self.behind = true;
                        continue;
                    }
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
                    if let Some(last) = out.last() {
                        self.cursor = last.seq;
                        return Ok(out);
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => self.behind = true,
                Err(broadcast::error::RecvError::Closed) => return Err(DaemonError::Stopped),
            }
        }
    }
}
