//! The daemon on PostgreSQL (`tuttid serve --db postgres://...`), and the event stream across
//! daemons that share one database.
//!
//! [`start`] connects two [`PostgresStore`] handles (the engine thread's writer and the API's
//! reader), runs [`Daemon::start_on`] on them (restart recovery as with SQLite: every live tree
//! found at start settles interrupted), and starts a listener thread: one more connection that
//! `LISTEN`s on [`OUTBOX_CHANNEL`] and feeds the highest committed outbox seq into
//! [`Daemon::with_commits_from`], so `GET /v1/events` on this daemon streams the rows every
//! daemon on the database commits. Polling is only the fallback: when no notification came for
//! [`POLL`], the listener reads the counter row once (a notification lost with a dropped
//! connection delays a follower by at most that long; it loses nothing, since rows are always
//! read from the outbox table).
//!
//! Not guaranteed yet with several daemons on one database (issue 21, step 3 is not built): a
//! daemon settles every live tree it finds when it starts, including trees another running
//! daemon is driving, and commands for a tree are not routed to the daemon running its provider
//! (a tree should be driven through one daemon; the store's version guards reject the losing
//! write of two daemons racing on one tree, so nothing is corrupted, but the loser's command
//! fails).

use crate::daemon::{Daemon, DaemonOptions, StartError, StoreCheckpoint};
use std::time::Duration;
use tokio::sync::watch;
use tracing::{debug, warn};
use tutti_core::store::HostStore;
use tutti_postgres::notify::{OutboxListener, Wake, OUTBOX_CHANNEL};
use tutti_postgres::PostgresStore;

/// How long the listener waits for a notification before it reads the counter row itself.
pub const POLL: Duration = Duration::from_secs(2);

/// Whether `--db` names a PostgreSQL database (`postgres://` or `postgresql://`).
pub fn is_url(db: &str) -> bool {
    PostgresStore::is_url(db)
}

/// `url` without its user information (user and password), for logs and messages.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "postgres".to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
        None => format!("{scheme}://{rest}"),
    }
}

/// Starts the daemon on the PostgreSQL database at `url` (see the module docs). `opts.db` is
/// only reported by [`Daemon::db`]. Call within a Tokio runtime (like [`Daemon::start_on`]);
/// from async code too: the blocking client (`postgres` runs its own runtime, which cannot be
/// started on a thread that drives async tasks) connects and recovers on a thread of its own.
pub fn start(url: &str, opts: DaemonOptions) -> Result<Daemon, StartError> {
    let handle = tokio::runtime::Handle::current();
    std::thread::scope(|s| {
        s.spawn(|| {
            let _guard = handle.enter();
            start_here(url, opts)
        })
        .join()
        .unwrap_or_else(|_| {
            Err(StartError::store(std::io::Error::other(
                "the PostgreSQL start-up thread panicked",
            )))
        })
    })
}

fn start_here(url: &str, opts: DaemonOptions) -> Result<Daemon, StartError> {
    let writer = PostgresStore::connect(url).map_err(StartError::store)?;
    let reader = PostgresStore::connect(url).map_err(StartError::store)?;
    let listener = OutboxListener::connect(url).map_err(StartError::store)?;
    let last = reader.last_outbox_seq().map_err(StartError::store)?;
    let daemon = Daemon::start_on(
        writer,
        Box::new(reader),
        Box::new(StoreCheckpoint::default()),
        opts,
    )?;
    let (tx, rx) = watch::channel(last);
    let url = url.to_string();
    std::thread::Builder::new()
        .name("tutti-pg-listen".into())
        .spawn(move || listen(&url, listener, &tx))?;
    Ok(daemon.with_commits_from(rx))
}

/// The listener thread: raises `tx` to every notified (or polled) last seq; reconnects after an
/// error; ends once no daemon handle holds the receiver.
fn listen(url: &str, mut listener: OutboxListener, tx: &watch::Sender<u64>) {
    loop {
        while !tx.is_closed() {
            match listener.wait(POLL) {
                Ok(w) => {
                    let seq = match w {
                        Wake::Committed(s) | Wake::Quiet(s) => s,
                    };
                    tx.send_if_modified(|v| {
                        let raised = seq > *v;
                        if raised {
                            *v = seq;
                        }
                        raised
                    });
                }
                Err(e) => {
                    warn!(channel = OUTBOX_CHANNEL, error = %e, "outbox listener failed; reconnecting");
                    break;
                }
            }
        }
        loop {
            if tx.is_closed() {
                debug!("outbox listener stopped");
                return;
            }
            std::thread::sleep(POLL);
            match OutboxListener::connect(url) {
                Ok(l) => {
                    listener = l;
                    break;
                }
                Err(e) => warn!(error = %e, "outbox listener cannot reconnect"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redact_drops_user_and_password() {
        assert_eq!(
            super::redact("postgres://u:secret@127.0.0.1:5432/db"),
            "postgres://127.0.0.1:5432/db"
        );
        assert_eq!(
            super::redact("postgresql://127.0.0.1/db"),
            "postgresql://127.0.0.1/db"
        );
    }
}
