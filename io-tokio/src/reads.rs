//! [`Reads`]: the reads the HTTP API, the event stream and the demo make, over any store.
//!
//! The daemon's reader is a second handle on the store (for SQLite, a second connection), used
//! from blocking tasks while the engine thread writes. It is kept behind this object-safe trait
//! so that the API, the follower and the demo are not generic over the store: every
//! [`HostStore`] is a [`Reads`].

use tutti_core::model::{CancelOperation, Interaction, Message, Session, Turn};
use tutti_core::projection::SessionDetail;
use tutti_core::snapshot::TreeSnapshot;
use tutti_core::store::{HostStore, OutboxRow, RootsPage, Store};

/// A read failed in the store (the store's own error, as text: identifiers only).
#[derive(Debug, Clone, thiserror::Error)]
#[error("store read failed: {0}")]
pub struct ReadError(pub String, pub ReadFailure);

/// What kind of failure a [`ReadError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFailure {
    /// The store could not be reached ([`HostStore::is_unavailable`]): retry later.
    Unavailable,
    /// Anything else (a bad cursor, an undecodable row).
    Other,
}

impl ReadError {
    /// Whether the store could not be reached (answered `503 unavailable`).
    pub fn is_unavailable(&self) -> bool {
        self.1 == ReadFailure::Unavailable
    }
}

fn err<S: HostStore>(e: S::Error) -> ReadError {
    let kind = if S::is_unavailable(&e) {
        ReadFailure::Unavailable
    } else {
        ReadFailure::Other
    };
    ReadError(e.to_string(), kind)
}

/// The store reads of a running daemon (see the module docs).
pub trait Reads: Send {
    /// One session, unless deleted.
    fn session(&self, id: &str) -> Result<Option<Session>, ReadError>;
    /// One turn.
    fn turn(&self, id: &str) -> Result<Option<Turn>, ReadError>;
    /// The session and every nested child session, flat.
    fn session_detail(&self, id: &str) -> Result<Option<SessionDetail>, ReadError>;
    /// Messages of one session with `seq > after`, at most `limit`.
    fn messages(
        &self,
        session: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Message>, ReadError>;
    /// One interaction by its (turn, request) key.
    fn interaction(&self, turn: &str, request: &str) -> Result<Option<Interaction>, ReadError>;
    /// One cancel operation.
    fn cancel_operation(&self, id: &str) -> Result<Option<CancelOperation>, ReadError>;
    /// One whole tree.
    fn load_tree(&self, root: &str) -> Result<Option<TreeSnapshot>, ReadError>;
    /// Root sessions of a workspace, newest first.
    fn roots(
        &self,
        workspace: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage, ReadError>;
    /// Outbox rows with `seq > after`, at most `limit`.
    fn outbox_after(&self, after: u64, limit: usize) -> Result<Vec<OutboxRow>, ReadError>;
    /// The highest outbox seq ever pruned.
    fn outbox_pruned_through(&self) -> Result<u64, ReadError>;
    /// The last assigned outbox seq.
    fn last_outbox_seq(&self) -> Result<u64, ReadError>;
    /// The working directory recorded for a root session's provider.
    fn session_cwd(&self, root: &str) -> Result<Option<String>, ReadError>;
    /// Runs `f` so that every read it makes sees one committed state
    /// ([`HostStore::read_consistent`]).
    fn read_consistent_dyn(&self, f: &mut dyn FnMut(&dyn Reads)) -> Result<(), ReadError>;
}

impl<S: HostStore + Send> Reads for S {
    fn session(&self, id: &str) -> Result<Option<Session>, ReadError> {
        Store::session(self, id).map_err(err::<S>)
    }
    fn turn(&self, id: &str) -> Result<Option<Turn>, ReadError> {
        Store::turn(self, id).map_err(err::<S>)
    }
    fn session_detail(&self, id: &str) -> Result<Option<SessionDetail>, ReadError> {
        Store::session_detail(self, id).map_err(err::<S>)
    }
    fn messages(
        &self,
        session: &str,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<Message>, ReadError> {
        Store::messages(self, session, after, limit).map_err(err::<S>)
    }
    fn interaction(&self, turn: &str, request: &str) -> Result<Option<Interaction>, ReadError> {
        Store::interaction(self, turn, request).map_err(err::<S>)
    }
    fn cancel_operation(&self, id: &str) -> Result<Option<CancelOperation>, ReadError> {
        Store::cancel_operation(self, id).map_err(err::<S>)
    }
    fn load_tree(&self, root: &str) -> Result<Option<TreeSnapshot>, ReadError> {
        Store::load_tree(self, root).map_err(err::<S>)
    }
    fn roots(
        &self,
        workspace: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<RootsPage, ReadError> {
        HostStore::roots(self, workspace, limit, cursor).map_err(err::<S>)
    }
    fn outbox_after(&self, after: u64, limit: usize) -> Result<Vec<OutboxRow>, ReadError> {
        Store::outbox_after(self, after, limit).map_err(err::<S>)
    }
    fn outbox_pruned_through(&self) -> Result<u64, ReadError> {
        HostStore::outbox_pruned_through(self).map_err(err::<S>)
    }
    fn last_outbox_seq(&self) -> Result<u64, ReadError> {
        HostStore::last_outbox_seq(self).map_err(err::<S>)
    }
    fn session_cwd(&self, root: &str) -> Result<Option<String>, ReadError> {
        HostStore::session_cwd(self, root).map_err(err::<S>)
    }
    fn read_consistent_dyn(&self, f: &mut dyn FnMut(&dyn Reads)) -> Result<(), ReadError> {
        HostStore::read_consistent(self, |s| f(s)).map_err(err::<S>)
    }
}
