//! WAL checkpoints off the commit path: a thread of its own that copies committed WAL frames
//! into the main file while the writer goes on committing.
//!
//! A writer opened with [`OpenOptions::auto_checkpoint`](crate::OpenOptions::auto_checkpoint)
//! `false` never checkpoints (and never syncs the WAL) when it commits. A [`Checkpointer`] does
//! that work instead, from another connection:
//!
//! - every [`CheckpointPolicy::every`], if something was committed since its last look
//!   ([`Checkpointer::committed`]), it runs a passive checkpoint, which never blocks the writer;
//! - under a steady stream of commits the WAL never catches up at the moment a commit begins, so
//!   SQLite never starts it over by itself. Once the WAL is past
//!   [`CheckpointPolicy::restart_bytes`], the thread first catches up closely (each pass copies
//!   what was committed during the one before), then asks the writer for a restarting
//!   checkpoint between two commits ([`Checkpointer::restart_wanted`]), which has only the last
//!   few frames left to copy;
//! - a restart makes the WAL start over but leaves its file at its largest size (SQLite
//!   reuses it). Issue 36: "After deleting 1,000 sessions the WAL stays 63 MB beside a 5.4 MB
//!   database until a restart." So when a look finds that nothing was committed since the last
//!   one (the writer is quiet) and the `-wal` file is larger than
//!   [`CheckpointPolicy::truncate_bytes`], the thread runs a truncating checkpoint
//!   (`wal_checkpoint(TRUNCATE)`) itself, without waiting for anyone: it copies what is left
//!   (little, the passive passes kept up), and cuts the file to zero bytes. A reader in the way
//!   makes it report `busy`, and the next quiet look tries again. A large deletion or a
//!   retention prune followed by a quiet moment (one [`CheckpointPolicy::every`]) thus leaves a
//!   small WAL; a daemon that never pauses keeps reusing its file through restarts instead
//!   (growing it again after each cut would cost its commits);
//! - when it is dropped, it stops and runs one last restarting checkpoint, so the WAL is small
//!   for the next start.
//!
//! The writer's side, after each commit:
//!
//! ```no_run
//! # use tutti_sqlite::{Checkpointer, CheckpointPolicy, CheckpointMode, OpenOptions, SqliteStore};
//! # fn main() -> Result<(), tutti_sqlite::SqliteError> {
//! let mut store = SqliteStore::open_with("tutti.db", &OpenOptions::new().auto_checkpoint(false))?;
//! let checkpoints = Checkpointer::start("tutti.db", CheckpointPolicy::default(), |_| {})?;
//! # let batches: Vec<tutti_core::step::PersistBatch> = Vec::new();
//! store.apply_many(&batches)?;
//! checkpoints.committed();
//! if checkpoints.restart_wanted() {
//!     // Never waits: if a reader is in the way it reports `busy`, and the thread asks again.
//!     let _ = store.checkpoint(CheckpointMode::RestartNoWait);
//!     checkpoints.restarted();
//! }
//! # Ok(()) }
//! ```
//!
//! The checkpointing connection is a plain connection to the file: it reads no table, so it
//! works on any WAL-mode SQLite file (the benchmark's raw baseline uses it too).

use crate::error::SqliteError;
use crate::{Checkpoint, CheckpointMode};
use rusqlite::{Connection, OpenFlags};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// When a [`Checkpointer`] checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointPolicy {
    /// How often the thread looks for new commits.
    pub every: Duration,
    /// WAL size past which the writer is asked to make the WAL start over.
    pub restart_bytes: u64,
    /// A passive checkpoint that found at most this many new bytes of frames leaves the WAL
    /// close enough to caught up for a quick restart.
    pub close_bytes: u64,
    /// Size of the `-wal` file past which a quiet look (nothing committed since the last one)
    /// truncates it to zero bytes (`u64::MAX`: never).
    pub truncate_bytes: u64,
}

impl Default for CheckpointPolicy {
    /// 200 ms, 32 MiB, 256 KiB, 16 MiB.
    fn default() -> Self {
        CheckpointPolicy {
            every: Duration::from_millis(200),
            restart_bytes: 32 << 20,
            close_bytes: 256 << 10,
            truncate_bytes: 16 << 20,
        }
    }
}

/// What the checkpoint thread did, for the owner's logs.
#[derive(Debug)]
pub enum CheckpointEvent {
    /// One checkpoint ran.
    Pass {
        /// Its mode.
        mode: CheckpointMode,
        /// What it did.
        result: Checkpoint,
    },
    /// A checkpoint failed (the thread goes on).
    Failed {
        /// Its mode.
        mode: CheckpointMode,
        /// Why.
        error: SqliteError,
    },
    /// The WAL is past the restart size: the writer is asked to restart it.
    RestartWanted {
        /// Frames in the WAL.
        wal_frames: u64,
    },
}

#[derive(Default)]
struct Shared {
    commits: AtomicU64,
    restart: AtomicBool,
    stop: Mutex<bool>,
    wake: Condvar,
}

/// The checkpoint thread of one database file (see the module docs). Dropping it stops the
/// thread after one last restarting checkpoint.
pub struct Checkpointer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// How many nice steps the checkpoint thread runs below the thread that starts it (Linux): a
/// daemon at the default nice 0 checkpoints at 10, one started under `nice -n 5` at 15 (never
/// past 19, the lowest priority).
///
/// Checkpoints are background work that comes in bursts (every pass copies what the commits
/// wrote since the last one), and on a machine of few cores a burst takes a core from the
/// threads a provider line waits for (the engine thread, the commit thread, the runtime's
/// workers). Below them, the scheduler prefers those threads while they are runnable and gives
/// the checkpoint thread the cores they leave idle; it never starves (the scheduler still gives
/// it a share while every core is busy), and a WAL that grows meanwhile is restarted as before.
/// Relative rather than absolute, so that the thread is never put above a daemon an operator
/// started at a low priority. Measured with the knee bench (README, Benchmarks). Lowering a
/// thread's own priority needs no privilege; where it is refused, the thread keeps the
/// starting thread's.
pub const CHECKPOINT_NICE: i32 = 10;

/// The nice value the checkpoint thread takes, given the starting thread's.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(crate) fn checkpoint_nice(starting: i32) -> i32 {
    starting
        .saturating_add(CHECKPOINT_NICE)
        .min(19)
        .max(starting)
}

/// The calling thread's nice value (`None` where it cannot be read).
#[cfg(target_os = "linux")]
fn own_nice() -> Option<i32> {
    // SAFETY: gettid(2) has no preconditions; getpriority(2) only reads the calling thread's
    // scheduling value. -1 is a valid nice value, so errors are told apart by errno, cleared
    // first.
    unsafe {
        let tid = libc::id_t::try_from(libc::gettid()).ok()?;
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, tid);
        (*libc::__errno_location() == 0).then_some(nice)
    }
}

/// Moves the calling thread [`CHECKPOINT_NICE`] steps below the value it started with (a new
/// thread starts with its creator's). Linux; an error leaves the value as it is.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    if let Some(nice) = own_nice().map(checkpoint_nice) {
        // SAFETY: setpriority(2) on the calling thread's own id only changes its scheduling
        // weight, and an error is ignored (the value stays).
        unsafe {
            if let Ok(tid) = libc::id_t::try_from(libc::gettid()) {
                let _ = libc::setpriority(libc::PRIO_PROCESS, tid, nice);
            }
        }
    }
}

impl Checkpointer {
    /// Opens a second connection to the (existing) file at `path` and starts the thread.
    /// `observe` sees every checkpoint the thread runs (it must not block).
    pub fn start(
        path: impl AsRef<Path>,
        policy: CheckpointPolicy,
        observe: impl FnMut(CheckpointEvent) + Send + 'static,
    ) -> Result<Checkpointer, SqliteError> {
        let path = path.as_ref();
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        let mut wal = path.as_os_str().to_os_string();
        wal.push("-wal");
        let wal = std::path::PathBuf::from(wal);
        let page: i64 = conn.pragma_query_value(None, "page_size", |r| r.get(0))?;
        let page = u64::try_from(page).unwrap_or(4096).max(512);
        let shared = Arc::new(Shared::default());
        let inner = shared.clone();
        let thread = std::thread::Builder::new()
            .name("tutti-checkpoint".into())
            .spawn(move || {
                lower_priority();
                run(conn, &wal, page, policy, &inner, observe)
            })
            .map_err(|source| SqliteError::Io {
                what: "starting the checkpoint thread for",
                path: path.display().to_string(),
                source,
            })?;
        Ok(Checkpointer {
            shared,
            thread: Some(thread),
        })
    }

    /// Tells the thread that the writer committed something.
    pub fn committed(&self) {
        self.shared.commits.fetch_add(1, Ordering::Release);
    }

    /// Whether the writer should run a restarting checkpoint now
    /// ([`CheckpointMode::RestartNoWait`]), then call [`Checkpointer::restarted`].
    pub fn restart_wanted(&self) -> bool {
        self.shared.restart.load(Ordering::Acquire)
    }

    /// The writer ran (or tried) the restarting checkpoint; the thread goes on.
    pub fn restarted(&self) {
        self.shared.restart.store(false, Ordering::Release);
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        if let Ok(mut stop) = self.shared.stop.lock() {
            *stop = true;
        }
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The checkpointing connection's busy timeout (for the final restart).
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs one checkpoint on `conn`.
pub(crate) fn checkpoint_on(
    conn: &Connection,
    mode: CheckpointMode,
) -> Result<Checkpoint, SqliteError> {
    let sql = match mode {
        CheckpointMode::Passive => "PRAGMA wal_checkpoint(PASSIVE)",
        CheckpointMode::Restart | CheckpointMode::RestartNoWait => "PRAGMA wal_checkpoint(RESTART)",
        CheckpointMode::Truncate | CheckpointMode::TruncateNoWait => {
            "PRAGMA wal_checkpoint(TRUNCATE)"
        }
    };
    let (busy, log, done) = conn.query_row(sql, [], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
        ))
    })?;
    Ok(Checkpoint {
        busy: busy != 0,
        wal_frames: u64::try_from(log).unwrap_or(0),
        checkpointed_frames: u64::try_from(done).unwrap_or(0),
    })
}

fn run(
    conn: Connection,
    wal: &Path,
    page: u64,
    policy: CheckpointPolicy,
    shared: &Shared,
    mut observe: impl FnMut(CheckpointEvent),
) {
    let (restart_frames, close_frames) = (policy.restart_bytes / page, policy.close_bytes / page);
    let pass = |mode: CheckpointMode, observe: &mut dyn FnMut(CheckpointEvent)| match checkpoint_on(
        &conn, mode,
    ) {
        Ok(result) => {
            observe(CheckpointEvent::Pass { mode, result });
            Some(result)
        }
        Err(error) => {
            observe(CheckpointEvent::Failed { mode, error });
            None
        }
    };
    let mut seen_commits = 0;
    loop {
        // Sleep for `every`, or until told to stop.
        let Ok(stop) = shared.stop.lock() else { break };
        let Ok((stop, _)) = shared
            .wake
            .wait_timeout_while(stop, policy.every, |stop| !*stop)
        else {
            break;
        };
        if *stop {
            break;
        }
        drop(stop);
        let commits = shared.commits.load(Ordering::Acquire);
        if commits == seen_commits {
            // Quiet: cut a WAL file left large by a burst (a big deletion, a prune).
            let size = std::fs::metadata(wal).map(|m| m.len()).unwrap_or(0);
            if size > policy.truncate_bytes && !shared.restart.load(Ordering::Acquire) {
                // Never wait: the writer may start a commit at any moment.
                if conn.busy_timeout(Duration::ZERO).is_ok() {
                    pass(CheckpointMode::TruncateNoWait, &mut observe);
                    let _ = conn.busy_timeout(BUSY_TIMEOUT);
                }
            }
            continue;
        }
        if shared.restart.load(Ordering::Acquire) {
            // The writer has not restarted the WAL yet: two checkpoints at once would make its
            // restart wait.
            continue;
        }
        seen_commits = commits;
        let Some(c) = pass(CheckpointMode::Passive, &mut observe) else {
            continue;
        };
        if c.wal_frames > restart_frames {
            // Catch up closely first, so that the restart has only a handful of frames to copy
            // and sync while it holds up the writer.
            let mut seen = c.wal_frames;
            for _ in 0..8 {
                match pass(CheckpointMode::Passive, &mut observe) {
                    Some(c) if c.wal_frames.saturating_sub(seen) > close_frames => {
                        seen = c.wal_frames
                    }
                    _ => break,
                }
            }
            observe(CheckpointEvent::RestartWanted { wal_frames: seen });
            shared.restart.store(true, Ordering::Release);
        }
    }
    // The writer is done: one last checkpoint so the WAL is small for the next start.
    pass(CheckpointMode::Restart, &mut observe);
}

#[cfg(test)]
mod tests {
    use super::checkpoint_nice;

    #[test]
    fn the_checkpoint_nice_is_below_the_starting_threads_and_never_past_19() {
        assert_eq!(checkpoint_nice(0), 10);
        assert_eq!(checkpoint_nice(5), 15);
        assert_eq!(checkpoint_nice(-5), 5);
        assert_eq!(checkpoint_nice(15), 19);
        assert_eq!(checkpoint_nice(19), 19);
    }
}
