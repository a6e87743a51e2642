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
//! channel: the daemon's commits watch ([`OutboxSource::commits`], fed by `LISTEN/NOTIFY`
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
//!
//! A follower sees the daemon only through [`OutboxSource`] (subscribe to live batches, the
//! commits watch, the live positions, one consistent read of the outbox, the stream stage's
//! time), and fails with its own [`FollowError`]: this module sits below the daemon core, which
//! implements the trait (issue 30: "`follow` over a narrow read-and-subscribe trait with its own
//! error").

pub use crate::outbox::{
    sse_frame, BadEventName, BadPayload, LiveBatch, LiveRow, LiveRows, LIVE_CAPACITY,
};
use crate::reads::{ReadError, Reads};
use crate::retention::{LivePosition, LivePositions};
use bytes::{Bytes, BytesMut};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::sync::{broadcast, watch};
use tutti_core::store::OutboxRow;

/// What a [`Follower`] needs of the daemon, and nothing more.
pub trait OutboxSource: Send + Sync + 'static {
    /// A receiver of the batches of rows each commit of this daemon publishes, from now on.
    fn subscribe(&self) -> broadcast::Receiver<LiveBatch>;
    /// The newest outbox seq committed by another writer of the database (rows other daemons
    /// commit never pass through this daemon's live channel; it may include this daemon's
    /// own seqs).
    fn commits(&self) -> watch::Receiver<u64>;
    /// The positions of the live followers: retention never deletes a row above one.
    fn positions(&self) -> &LivePositions;
    /// One consistent read of the outbox ([`read_page`] over the store). Blocking: a follower
    /// calls it on a blocking thread.
    fn read_outbox(&self, after: u64, check_head: bool) -> Result<OutboxPage, FollowError>;
    /// Time spent shaping rows for followers (the `stream` stage of the daemon's metrics).
    fn stream_time(&self, spent: Duration);
}

/// Why a follower could not go on.
#[derive(Debug, Error)]
pub enum FollowError {
    /// The daemon stopped (its live channel closed).
    #[error("the daemon is not running")]
    Stopped,
    /// The store could not be reached; a reader retries later.
    #[error("the store is unavailable; retry later ({0})")]
    Unavailable(String),
    /// The outbox could not be read, or a row is not what the store promised (a payload that is
    /// not one JSON value).
    #[error("the outbox could not be read: {0}")]
    Read(String),
    /// [`Follower::next`] only: the rows after `requested_after` through `pruned_through` were
    /// pruned (see [`Followed::Reset`]); the follower continues after `pruned_through`.
    #[error("outbox rows after {requested_after} through {pruned_through} were pruned")]
    Pruned {
        /// The position asked for.
        requested_after: u64,
        /// Every row up to this seq is gone.
        pruned_through: u64,
    },
}

impl From<ReadError> for FollowError {
    fn from(e: ReadError) -> FollowError {
        if e.is_unavailable() {
            FollowError::Unavailable(e.0)
        } else {
            FollowError::Read(e.to_string())
        }
    }
}

/// What one read of the outbox found: the pruned mark, the newest seq (when asked for) and the
/// rows after the position, all of one committed state.
#[derive(Debug, Clone, Default)]
pub struct OutboxPage {
    /// Every row up to this seq was deleted by retention.
    pub pruned_through: u64,
    /// The newest seq, when the read checked the head.
    pub head: Option<u64>,
    /// Up to a page of rows after the position; none when the position was pruned or is beyond
    /// the head.
    pub rows: Vec<OutboxRow>,
}

/// The read a follower makes, inside one read transaction of `r` (the daemon's
/// [`OutboxSource::read_outbox`] runs it).
pub fn read_page(r: &dyn Reads, after: u64, check_head: bool) -> Result<OutboxPage, ReadError> {
    let pruned_through = r.outbox_pruned_through()?;
    let head = if check_head {
        Some(r.last_outbox_seq()?)
    } else {
        None
    };
    let rows = if (after > 0 && after < pruned_through) || head.is_some_and(|h| after > h) {
        Vec::new()
    } else {
        r.outbox_after(after, PAGE)?
    };
    Ok(OutboxPage {
        pruned_through,
        head,
        rows,
    })
}

/// What [`Follower::next_stream`] yields next.
#[derive(Debug, Clone, PartialEq)]
pub enum Streamed {
    /// The next rows (at least one) as the bytes an event stream writes: one whole event per
    /// row, in order ([`sse_frame`]; `id:` the seq, `event:` the kind, `data:` the row's JSON).
    Events(Bytes),
    /// As [`Followed::Reset`].
    Reset {
        /// The position the follower asked for.
        requested_after: u64,
        /// Every row up to this seq is gone; the follower continues after it.
        pruned_through: u64,
    },
}

/// What the follower found next, before it is shaped for its caller.
enum Next {
    File(Vec<OutboxRow>),
    /// A live batch and the index of its first row this follower has not seen.
    Live(LiveBatch, usize),
    Reset {
        requested_after: u64,
        pruned_through: u64,
    },
}

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
    source: Arc<dyn OutboxSource>,
    cursor: u64,
    live: broadcast::Receiver<LiveBatch>,
    behind: bool,
    /// This follower's entry in the daemon's live positions.
    position: LivePosition,
    /// Commits of any writer of the database ([`OutboxSource::commits`]); `None` once its
    /// sender is gone.
    commits: Option<watch::Receiver<u64>>,
    /// Whether the starting position was checked against the newest row (only the first read
    /// can find it beyond: later positions are rows this follower was given).
    head_checked: bool,
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.source.positions().remove(self.position.key());
    }
}

impl Follower {
    /// Follows the outbox of `source` (the daemon) from after `after` (0: from the start of
    /// what is kept).
    pub fn new<S: OutboxSource + Clone>(source: &S, after: u64) -> Follower {
        let source: Arc<dyn OutboxSource> = Arc::new(source.clone());
        // Subscribe before the first read: a row committed between the two is in one or the other.
        let live = source.subscribe();
        // Registered before the first read: rows above `after` are kept from now on (rows a
        // pass deleted just before are reported by a reset, see `next_event`).
        let position = source.positions().register(after);
        let mut commits = source.commits();
        commits.mark_unchanged();
        Follower {
            commits: Some(commits),
            source,
            cursor: after,
            live,
            behind: true,
            position,
            head_checked: false,
        }
    }

    fn advance(&mut self, to: u64) {
        self.cursor = to;
        self.position.set(to);
    }

    /// The sequence number of the last row returned.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    /// The next rows (never empty); waits until there are some. `Err` once the daemon stops or
    /// the file cannot be read, and [`FollowError::Pruned`] for a [`Followed::Reset`] (the
    /// follower then continues after the pruned rows).
    pub async fn next(&mut self) -> Result<Vec<OutboxRow>, FollowError> {
        match self.next_event().await? {
            Followed::Rows(rows) => Ok(rows),
            Followed::Reset {
                requested_after,
                pruned_through,
            } => Err(FollowError::Pruned {
                requested_after,
                pruned_through,
            }),
        }
    }

    /// The next rows, or a reset if the rows after this follower's position were pruned; waits
    /// until there is something. `Err` once the daemon stops or the file cannot be read.
    pub async fn next_event(&mut self) -> Result<Followed, FollowError> {
        Ok(match self.next_any().await? {
            Next::File(rows) => Followed::Rows(rows),
            Next::Live(batch, from) => {
                let t = std::time::Instant::now();
                let mut out = Vec::with_capacity(batch.len() - from);
                for r in &batch[from..] {
                    let payload = serde_json::from_str(&r.payload)
                        .map_err(|e| FollowError::Read(e.to_string()))?;
                    out.push(OutboxRow {
                        seq: r.seq,
                        kind: r.kind.to_string(),
                        root_agent_session_id: r.root_agent_session_id.clone(),
                        workspace_id: r.workspace_id.clone(),
                        payload,
                    });
                }
                self.source.stream_time(t.elapsed());
                Followed::Rows(out)
            }
            Next::Reset {
                requested_after,
                pruned_through,
            } => Followed::Reset {
                requested_after,
                pruned_through,
            },
        })
    }

    /// [`Follower::next_event`] shaped for an event stream: the rows as the events it writes,
    /// all of them in one buffer. A live row's event is rendered once for every follower
    /// ([`LiveRow::sse_frame`]: a follower of a one-row commit writes the shared bytes
    /// themselves); a row read from the file is serialized here.
    pub async fn next_stream(&mut self) -> Result<Streamed, FollowError> {
        let next = self.next_any().await?;
        let t = std::time::Instant::now();
        let out = match next {
            Next::File(rows) => Streamed::Events(joined(rows.iter().map(|row| {
                let data =
                    serde_json::to_string(row).map_err(|e| FollowError::Read(e.to_string()))?;
                sse_frame(row.seq, &row.kind, &data).map_err(|e| FollowError::Read(e.to_string()))
            }))?),
            Next::Live(batch, from) => Streamed::Events(
                batch
                    .frames_from(from)
                    .map_err(|e| FollowError::Read(e.to_string()))?,
            ),
            Next::Reset {
                requested_after,
                pruned_through,
            } => Streamed::Reset {
                requested_after,
                pruned_through,
            },
        };
        self.source.stream_time(t.elapsed());
        Ok(out)
    }

    async fn next_any(&mut self) -> Result<Next, FollowError> {
        loop {
            if self.behind {
                let source = self.source.clone();
                let after = self.cursor;
                let check_head = !self.head_checked && after > 0;
                // One read transaction: the pruned mark, the newest seq and the rows are of one
                // committed state.
                let OutboxPage {
                    pruned_through: pruned,
                    head,
                    rows,
                } = tokio::task::spawn_blocking(move || source.read_outbox(after, check_head))
                    .await
                    .map_err(|e| FollowError::Read(e.to_string()))??;
                self.head_checked = true;
                if let Some(head) = head.filter(|h| after > *h) {
                    self.advance(head);
                    return Ok(Next::Reset {
                        requested_after: after,
                        pruned_through: head,
                    });
                }
                if after > 0 && after < pruned {
                    self.advance(pruned);
                    return Ok(Next::Reset {
                        requested_after: after,
                        pruned_through: pruned,
                    });
                }
                if let Some(last) = rows.last() {
                    self.advance(last.seq);
                    return Ok(Next::File(rows));
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
                    // Rows in sequence order: the unseen ones are a suffix.
                    let from = batch.partition_point(|r| r.seq <= self.cursor);
                    if let Some(last) = batch.last().filter(|_| from < batch.len()) {
                        self.advance(last.seq);
                        return Ok(Next::Live(batch, from));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => self.behind = true,
                Err(broadcast::error::RecvError::Closed) => return Err(FollowError::Stopped),
            }
        }
    }
}

/// The frames in one buffer: a single frame as it is (shared, not copied), several copied
/// together once.
fn joined(frames: impl Iterator<Item = Result<Bytes, FollowError>>) -> Result<Bytes, FollowError> {
    let frames = frames.collect::<Result<Vec<Bytes>, FollowError>>()?;
    if let [one] = frames.as_slice() {
        return Ok(one.clone());
    }
    let mut buf = BytesMut::with_capacity(frames.iter().map(Bytes::len).sum());
    for frame in &frames {
        buf.extend_from_slice(frame);
    }
    Ok(buf.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn row(payload: &str) -> LiveRow {
        LiveRow::new(
            7,
            "toolCall",
            "root \"quoted\" \u{e9}".into(),
            "w\\1".into(),
            payload.to_string(),
        )
    }

    /// The `data:` of one event frame, checked to be the frame's only data line.
    fn data_of(frame: &[u8], id: u64, event: &str) -> Value {
        let text = std::str::from_utf8(frame).expect("utf-8");
        let head = format!("id: {id}\nevent: {event}\ndata: ");
        let data = text
            .strip_prefix(&head)
            .and_then(|t| t.strip_suffix("\n\n"))
            .unwrap_or_else(|| panic!("not one event: {text:?}"));
        assert!(!data.contains(['\n', '\r']), "one data line: {text:?}");
        serde_json::from_str(data).expect("one JSON value")
    }

    /// Issue 33: a live row's event is the JSON of its `OutboxRow`, as the stream sent it when
    /// every follower serialized the row itself (ids with quotes and escapes included); line
    /// breaks between the stored payload's tokens do not split its `data:` line.
    #[test]
    fn sse_frame_is_the_outbox_row_json() {
        let payload = json!({"toolCallId": "c1", "name": "t=\"1\"\n", "n": [1, 2.5, null]});
        let expected = serde_json::to_value(OutboxRow {
            seq: 7,
            kind: "toolCall".into(),
            root_agent_session_id: "root \"quoted\" \u{e9}".into(),
            workspace_id: "w\\1".into(),
            payload: payload.clone(),
        })
        .expect("row");
        let pretty = serde_json::to_string_pretty(&payload)
            .expect("pretty")
            .replace("\n", "\r\n");
        for stored in [payload.to_string(), pretty] {
            let frame = row(&stored).sse_frame().expect("rendered");
            assert_eq!(data_of(&frame, 7, "toolCall"), expected, "{stored:?}");
        }
    }

    /// Issue 33: "serializing an outbox row once for all followers": every follower of a commit
    /// shares one batch, and a row's event is rendered once, then shared (the same bytes).
    #[test]
    fn sse_frame_is_rendered_once_for_all_followers() {
        let batch: LiveBatch = Arc::new(vec![row(r#"{"a":1}"#)].into());
        let (one, two) = (batch.clone(), batch.clone());
        let a = one[0].sse_frame().expect("rendered");
        let b = two[0].sse_frame().expect("rendered");
        assert_eq!(a.as_ptr(), b.as_ptr());
        // One frame goes out as it is; several are joined in order.
        let single = joined([Ok(a.clone())].into_iter()).expect("joined");
        assert_eq!(single.as_ptr(), a.as_ptr());
        let other = LiveRow::new(8, "message", "r".into(), "w".into(), "{}".into());
        let both = joined(
            [
                Ok(a.clone()),
                other.sse_frame().map_err(|e| FollowError::Read(e.0)),
            ]
            .into_iter(),
        )
        .expect("joined");
        assert_eq!(&both[..a.len()], &a[..]);
        assert_eq!(data_of(&both[a.len()..], 8, "message")["seq"], 8);
    }

    /// Issue 33: the frames of a live batch are joined once for all its followers: each gets a
    /// slice of the same buffer (the same bytes, whatever row it starts from), equal to its
    /// rows' frames one after the other; nothing past the end.
    #[test]
    fn a_live_batch_is_joined_once_for_all_followers() {
        let rows: Vec<LiveRow> = (1..=3)
            .map(|seq| {
                LiveRow::new(
                    seq,
                    "message",
                    "r".into(),
                    "w".into(),
                    format!("{{\"n\":{seq}}}"),
                )
            })
            .collect();
        let frames: Vec<Bytes> = rows.iter().map(|r| r.sse_frame().expect("frame")).collect();
        let batch = LiveRows::new(rows);
        let all = batch.frames_from(0).expect("joined");
        assert_eq!(&all[..], &frames.concat()[..]);
        let again = batch.frames_from(0).expect("joined");
        assert_eq!(
            all.as_ptr(),
            again.as_ptr(),
            "one buffer for every follower"
        );
        let tail = batch.frames_from(1).expect("joined");
        assert_eq!(&tail[..], &frames[1..].concat()[..]);
        assert_eq!(
            tail.as_ptr(),
            all[frames[0].len()..].as_ptr(),
            "a slice, not a copy"
        );
        assert_eq!(
            data_of(&batch.frames_from(2).expect("last"), 3, "message")["seq"],
            3
        );
        assert!(batch.frames_from(3).expect("past the end").is_empty());
    }

    /// A batch with a bad row: a follower whose rows hold it gets the row's error; one that
    /// starts after it gets its rows' frames.
    #[test]
    fn a_bad_row_of_a_live_batch_fails_only_the_followers_that_send_it() {
        let good = |seq| LiveRow::new(seq, "message", "r".into(), "w".into(), "{}".into());
        let batch = LiveRows::new(vec![good(1), row("{\"a\":"), good(8)]);
        for from in [0, 1] {
            assert!(batch.frames_from(from).is_err(), "{from}");
        }
        let last = batch.frames_from(2).expect("the good row after it");
        assert_eq!(data_of(&last, 8, "message")["seq"], 8);
    }

    /// A payload that is not one JSON value is a storage error for every follower (as when the
    /// followers parsed it), never a malformed event; so is an event name with a line break
    /// (a kind read from a damaged file).
    #[test]
    fn sse_frame_of_a_bad_payload_is_an_error() {
        for bad in ["", "{\"a\":", "1 2", "{} x"] {
            let r = row(bad);
            for _ in 0..2 {
                assert!(matches!(r.sse_frame(), Err(BadPayload(_))), "{bad:?}");
            }
        }
        for name in ["a\nb", "a\r", "\n"] {
            assert_eq!(
                sse_frame(1, name, "{}"),
                Err(BadEventName { len: name.len() })
            );
        }
    }
}
