//! One writer per SQLite database file (issue 36 item 1).
//!
//! `tuttid serve --db FILE` takes an exclusive advisory lock (`flock(2)`, through std's
//! [`std::fs::File::try_lock`]) on the side file `FILE.lock` (created with mode 0600) before it
//! opens the database, and holds it for its whole life: the [`DbLock`] lives as long as the
//! daemon, and the kernel releases the lock when the process ends, however it ends (`kill -9`
//! included). After locking, the daemon writes its pid, and once it listens its address, into
//! the lock file, so a second daemon on the same file refuses to start with
//! [`DbLockError::Held`] naming them, before any start-up recovery could settle the first
//! daemon's running trees.
//!
//! Choices: the lock is on the side file, not on the database, so outside readers (`sqlite3`,
//! `tutti snapshot`) open the database as before; a stale lock file left by a daemon that
//! ended is harmless (its content is only read when the lock is held by someone); the content
//! is two lines, `pid=N` and `addr=IP:PORT`. PostgreSQL databases take no such lock (several
//! daemons on one database is a supported setup, coordinated by tree leases).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The held lock of a database file; dropping it (or ending the process) releases it.
#[derive(Debug)]
pub struct DbLock {
    file: File,
    path: PathBuf,
}

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum DbLockError {
    /// Another process (a running daemon) holds the lock of this database file.
    #[error(
        "database {db} is in use by another tuttid (pid {pid}, listening on {addr}; lock file \
         {lock}): one daemon per database file",
        pid = pid.map_or_else(|| "unknown".to_string(), |p| p.to_string()),
        addr = addr.as_deref().unwrap_or("unknown")
    )]
    Held {
        /// The database file.
        db: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// The holder's pid, as it wrote it (`None` if not written yet or unreadable).
        pid: Option<u32>,
        /// The holder's listen address, as it wrote it.
        addr: Option<String>,
    },
    /// The lock file could not be opened, locked or written.
    #[error("lock file {path}: {source}")]
    Io {
        /// The lock file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// The lock file of database `db`: `db` with `.lock` appended.
pub fn lock_path(db: &Path) -> PathBuf {
    let mut p = db.as_os_str().to_os_string();
    p.push(".lock");
    PathBuf::from(p)
}

impl DbLock {
    /// Takes the lock of database `db` without waiting, and writes this process's pid into the
    /// lock file. [`DbLockError::Held`] when another process holds it.
    pub fn acquire(db: &Path) -> Result<DbLock, DbLockError> {
        let path = lock_path(db);
        let io = |source| DbLockError::Io {
            path: path.clone(),
            source,
        };
        // Not truncated on open: the holder's pid and address must stay readable.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                let (pid, addr) = parse_holder(&text);
                return Err(DbLockError::Held {
                    db: db.to_path_buf(),
                    lock: path,
                    pid,
                    addr,
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        let lock = DbLock { file, path };
        lock.write_holder(None)?;
        Ok(lock)
    }

    /// Writes the holder's pid and, once known, its listen address into the lock file.
    pub fn write_holder(&self, addr: Option<&str>) -> Result<(), DbLockError> {
        let io = |source| DbLockError::Io {
            path: self.path.clone(),
            source,
        };
        let mut text = format!("pid={}\n", std::process::id());
        if let Some(a) = addr {
            text.push_str(&format!("addr={a}\n"));
        }
        let mut f = &self.file;
        f.set_len(0).map_err(io)?;
        f.seek(SeekFrom::Start(0)).map_err(io)?;
        f.write_all(text.as_bytes()).map_err(io)?;
        f.flush().map_err(io)
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Reads `pid=` and `addr=` lines of a lock file (anything else is ignored).
fn parse_holder(text: &str) -> (Option<u32>, Option<String>) {
    let mut pid = None;
    let mut addr = None;
    for line in text.lines() {
        if let Some(p) = line.strip_prefix("pid=") {
            pid = p.trim().parse().ok();
        } else if let Some(a) = line.strip_prefix("addr=") {
            let a = a.trim();
            // Only what a daemon writes (an address), never terminal controls from a planted file.
            if !a.is_empty() && a.len() <= 128 && a.bytes().all(|b| b.is_ascii_graphic()) {
                addr = Some(a.to_string());
            }
        }
    }
    (pid, addr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A second lock on the same file (another open file description, as another process
    /// would have) is refused with the holder's pid and address; dropping the first frees it.
    #[test]
    fn a_second_lock_of_one_database_is_refused_with_the_holder() {
        let dir = std::env::temp_dir().join(format!("tutti-db-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let db = dir.join("t.db");
        let first = DbLock::acquire(&db).expect("first");
        first.write_holder(Some("127.0.0.1:7420")).expect("addr");
        let mode = std::fs::metadata(first.path())
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        match DbLock::acquire(&db) {
            Err(DbLockError::Held { pid, addr, .. }) => {
                assert_eq!(pid, Some(std::process::id()));
                assert_eq!(addr.as_deref(), Some("127.0.0.1:7420"));
            }
            other => panic!("second lock: {other:?}"),
        }
        drop(first);
        assert!(DbLock::acquire(&db).is_ok(), "free again");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn holder_lines_are_parsed_and_junk_ignored() {
        assert_eq!(
            parse_holder("pid=12\naddr=[::1]:80\n"),
            (Some(12), Some("[::1]:80".into()))
        );
        assert_eq!(parse_holder("pid=x\naddr=\u{1b}]0;\n"), (None, None));
        assert_eq!(parse_holder(""), (None, None));
    }
}
