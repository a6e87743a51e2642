//! The outbox's live rows: what one commit wrote, as the engine thread hands it to every live
//! follower at once (see [`crate::follow`], which combines them with the file). A leaf: the
//! daemon's engine thread produces these and the followers consume them; neither needs the
//! other to name them.

use bytes::Bytes;
use std::sync::{Arc, OnceLock};
use tutti_core::model::Id;

/// One outbox row as a commit wrote it (the payload is the stored JSON text).
///
/// Every live follower gets the same `LiveRow` (one [`LiveBatch`] per commit, shared), so what
/// an event stream sends for it is rendered once for all of them ([`LiveRow::sse_frame`],
/// issue 33: "serializing an outbox row once for all followers").
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
    /// The row's event-stream frame, once a follower asked for it.
    frame: OnceLock<Result<Bytes, String>>,
}

impl LiveRow {
    /// A row of a commit.
    pub fn new(
        seq: u64,
        kind: &'static str,
        root_agent_session_id: Id,
        workspace_id: Id,
        payload: String,
    ) -> LiveRow {
        LiveRow {
            seq,
            kind,
            root_agent_session_id,
            workspace_id,
            payload,
            frame: OnceLock::new(),
        }
    }

    /// The row as `GET /v1/events` sends it, as one whole SSE event ([`sse_frame`]: `id:` the
    /// seq, `event:` the kind, `data:` the JSON of its [`OutboxRow`](tutti_core::store::OutboxRow)
    /// with `seq`, `kind`, `rootAgentSessionId`, `workspaceId` and `payload`), rendered on the
    /// first call and shared by every later caller (the same bytes, not a copy). The payload is
    /// the stored text, checked once to be one JSON value (a row whose payload is not is an
    /// error for every follower, as it is when parsed).
    ///
    /// Choice: the payload's keys keep the order the store wrote them in; a row read back from
    /// the file is re-serialized from its parsed value instead, so the two may order keys
    /// differently (JSON objects are unordered; the values are equal).
    pub fn sse_frame(&self) -> Result<Bytes, BadPayload> {
        self.frame
            .get_or_init(|| self.render_frame())
            .clone()
            .map_err(BadPayload)
    }

    /// The frame, rendered now unless it was already (not kept: see [`LiveRows::frames_from`]).
    fn frame_once(&self) -> Result<Bytes, String> {
        match self.frame.get() {
            Some(f) => f.clone(),
            None => self.render_frame(),
        }
    }

    fn render_frame(&self) -> Result<Bytes, String> {
        let data = self.render()?;
        sse_frame(self.seq, self.kind, &data).map_err(|e| e.to_string())
    }

    fn render(&self) -> Result<String, String> {
        serde_json::from_str::<serde::de::IgnoredAny>(&self.payload).map_err(|e| e.to_string())?;
        let text = |s: &str| serde_json::to_string(s).map_err(|e| e.to_string());
        let mut out = String::with_capacity(self.payload.len() + 128);
        out.push_str("{\"seq\":");
        out.push_str(&self.seq.to_string());
        out.push_str(",\"kind\":");
        out.push_str(&text(self.kind)?);
        out.push_str(",\"rootAgentSessionId\":");
        out.push_str(&text(&self.root_agent_session_id)?);
        out.push_str(",\"workspaceId\":");
        out.push_str(&text(&self.workspace_id)?);
        out.push_str(",\"payload\":");
        out.push_str(self.payload.trim());
        out.push('}');
        Ok(out)
    }
}

/// An event name that cannot be sent (it would end the `event:` line early).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an event name of {len} bytes holds a line break")]
pub struct BadEventName {
    /// The name's length (its text may be anything a database held: not logged).
    pub len: usize,
}

/// One whole server-sent event, as the bytes an event stream writes: `id: {id}`, `event:
/// {event}`, `data: {data}` and the blank line that ends the event.
///
/// `data` is one JSON text. A line break in it can only be insignificant whitespace (JSON
/// strings hold line breaks escaped), so each is written as a space: the event has one `data:`
/// line and its data parses to the same value. An `event` name with a line break is refused.
pub fn sse_frame(id: u64, event: &str, data: &str) -> Result<Bytes, BadEventName> {
    if event.bytes().any(|b| b == b'\n' || b == b'\r') {
        return Err(BadEventName { len: event.len() });
    }
    let id = id.to_string();
    let mut out = Vec::with_capacity(data.len() + event.len() + id.len() + 24);
    out.extend_from_slice(b"id: ");
    out.extend_from_slice(id.as_bytes());
    out.extend_from_slice(b"\nevent: ");
    out.extend_from_slice(event.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    let at = out.len();
    out.extend_from_slice(data.as_bytes());
    for b in &mut out[at..] {
        if *b == b'\n' || *b == b'\r' {
            *b = b' ';
        }
    }
    out.extend_from_slice(b"\n\n");
    Ok(Bytes::from(out))
}

/// A live row whose stored payload is not one JSON value (the text says why). Every follower
/// gets the same error for it, as a follower parsing the row would.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("outbox row payload is not JSON: {0}")]
pub struct BadPayload(pub String);

/// The rows of the commits one announcement carries (one group of the commit thread, or on
/// PostgreSQL one pass of the engine thread), in sequence order, shared by every live follower.
pub type LiveBatch = Arc<LiveRows>;

/// The rows of one live announcement (a [`LiveBatch`]), read as a slice of [`LiveRow`]s, with
/// their event-stream frames joined into one buffer the first time a follower asks for them
/// ([`LiveRows::frames_from`]), so that every follower of the batch writes the same bytes: no
/// copy and no per-row work per follower (issue 33: with 100 followers, copying each batch's
/// frames into a buffer of each follower's own was the largest part of their CPU time that
/// grew with their number).
#[derive(Debug)]
pub struct LiveRows {
    rows: Vec<LiveRow>,
    /// The frames of all rows in one buffer, with where each row's frame starts; `None` when
    /// a row's frame is an error (then each follower joins the frames it sends itself, and
    /// gets that error only if the row is among them).
    joined: OnceLock<Option<(Bytes, Vec<usize>)>>,
}

impl LiveRows {
    /// The rows, in sequence order.
    pub fn new(rows: Vec<LiveRow>) -> LiveRows {
        LiveRows {
            rows,
            joined: OnceLock::new(),
        }
    }

    /// The frames of the rows from index `from` on, as one buffer: a slice of the batch's
    /// joined frames (shared by every follower, rendered once), or, when a row's payload is
    /// bad, the frames of these rows joined here (an error if one of them is bad). Empty past
    /// the end.
    pub fn frames_from(&self, from: usize) -> Result<Bytes, BadPayload> {
        let joined = self.joined.get_or_init(|| {
            let frames = self
                .rows
                .iter()
                .map(LiveRow::frame_once)
                .collect::<Result<Vec<Bytes>, String>>()
                .ok()?;
            if let [one] = frames.as_slice() {
                return Some((one.clone(), vec![0]));
            }
            let mut buf = bytes::BytesMut::with_capacity(frames.iter().map(Bytes::len).sum());
            let mut starts = Vec::with_capacity(frames.len());
            for frame in &frames {
                starts.push(buf.len());
                buf.extend_from_slice(frame);
            }
            Some((buf.freeze(), starts))
        });
        match joined {
            Some((all, starts)) => Ok(all.slice(starts.get(from).copied().unwrap_or(all.len())..)),
            None => {
                let rows = self.rows.get(from..).unwrap_or_default();
                let frames = rows
                    .iter()
                    .map(LiveRow::sse_frame)
                    .collect::<Result<Vec<Bytes>, BadPayload>>()?;
                Ok(frames.concat().into())
            }
        }
    }
}

impl std::ops::Deref for LiveRows {
    type Target = [LiveRow];

    fn deref(&self) -> &[LiveRow] {
        &self.rows
    }
}

impl From<Vec<LiveRow>> for LiveRows {
    fn from(rows: Vec<LiveRow>) -> LiveRows {
        LiveRows::new(rows)
    }
}

/// How many commits the live channel holds for a slow follower before it falls back to the file.
pub const LIVE_CAPACITY: usize = 1024;
