//! Opening or creating a database file: permissions, header check, pragmas, migrations.

use crate::error::SqliteError;
use crate::schema::{APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION};
use rusqlite::{Connection, OpenFlags, TransactionBehavior};
use std::io::Read;
use std::path::Path;
use std::time::Duration;

/// How durable a commit is (`PRAGMA synchronous` in WAL mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// `NORMAL` (default): a commit survives a process crash; the last commits before a power
    /// loss may be lost, never half of one. The WAL is synced at checkpoints.
    #[default]
    Normal,
    /// `FULL`: every commit is synced to disk before `apply` returns.
    Full,
}

impl Synchronous {
    fn pragma(self) -> &'static str {
        match self {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
        }
    }
}

/// When a version guard (`SessionVersion`, `TurnVersion`, `CancelVersion`) counts as "already at
/// `next`" — the escape hatch that makes replaying a batch harmless.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayRule {
    /// Default. The guard passes when the stored version is `version`, or when it is exactly `next`
    /// **and the stored row equals this batch's row for that entity** ("this batch was applied").
    /// A concurrent writer that moved the entity to the same (or a later) version is detected,
    /// which is what makes "a child revealed after the target snapshot must be rejected by
    /// persistence" hold with two writers: both a child creation and a cancel move the root turn
    /// from `v` to `v + 1`. In a single-writer history this behaves exactly like
    /// [`ReplayRule::AtOrPastNext`].
    #[default]
    SameRowAtNext,
    /// The reference store's rule, `stored == version || stored >= next`, bit for bit. It cannot
    /// tell "this batch was applied" from "another writer got there first".
    AtOrPastNext,
}

/// Options for [`SqliteStore::open_with`](crate::SqliteStore::open_with).
#[derive(Debug, Clone)]
pub struct OpenOptions {
    pub(crate) synchronous: Synchronous,
    pub(crate) busy_timeout: Duration,
    pub(crate) create: bool,
    pub(crate) replay_rule: ReplayRule,
    pub(crate) auto_checkpoint: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            synchronous: Synchronous::Normal,
            busy_timeout: Duration::from_secs(5),
            create: true,
            replay_rule: ReplayRule::default(),
            auto_checkpoint: true,
        }
    }
}

impl OpenOptions {
    /// Defaults: `synchronous=NORMAL`, 5 s busy timeout, create the file if missing.
    pub fn new() -> OpenOptions {
        OpenOptions::default()
    }
    /// Commit durability.
    pub fn synchronous(mut self, s: Synchronous) -> OpenOptions {
        self.synchronous = s;
        self
    }
    /// How long a writer waits for another connection's write transaction.
    pub fn busy_timeout(mut self, d: Duration) -> OpenOptions {
        self.busy_timeout = d;
        self
    }
    /// Whether a missing file is created (mode 0600). With `false` a missing file is an error.
    pub fn create(mut self, yes: bool) -> OpenOptions {
        self.create = yes;
        self
    }
    /// Whether commits on this connection checkpoint the WAL into the main file when it grows
    /// past SQLite's default 1000 pages (the default). A daemon that wants no checkpoint (and no
    /// checkpoint fsync) on its commit path turns this off and calls
    /// [`SqliteStore::checkpoint`](crate::SqliteStore::checkpoint) from another connection.
    pub fn auto_checkpoint(mut self, yes: bool) -> OpenOptions {
        self.auto_checkpoint = yes;
        self
    }
    /// The version guards' replay rule.
    pub fn replay_rule(mut self, r: ReplayRule) -> OpenOptions {
        self.replay_rule = r;
        self
    }
}

fn io(what: &'static str, path: &Path, source: std::io::Error) -> SqliteError {
    SqliteError::Io {
        what,
        path: path.display().to_string(),
        source,
    }
}

/// Creates the file with owner-only permissions before SQLite opens it (SQLite gives the `-wal`
/// and `-shm` files the same mode).
fn ensure_file(path: &Path, create: bool) -> Result<(), SqliteError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => return Ok(()),
        Ok(_) => {
            return Err(SqliteError::NotADatabase {
                detail: format!("{} is not a regular file", path.display()),
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {}
        Err(e) => return Err(io("cannot open", path, e)),
    }
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    match o.open(path) {
        Ok(_) => Ok(()),
        // Another process created it meanwhile: fine, identify it like any existing file.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io("cannot create", path, e)),
    }
}

const MAGIC: &[u8; 16] = b"SQLite format 3\0";

/// Checks the 100-byte SQLite header before handing the file to SQLite, so that garbage and a
/// truncated file get a clear error instead of a late "malformed" from some query.
fn check_header(path: &Path) -> Result<(), SqliteError> {
    let mut f = std::fs::File::open(path).map_err(|e| io("cannot read", path, e))?;
    let len = f.metadata().map_err(|e| io("cannot stat", path, e))?.len();
    if len == 0 {
        return Ok(()); // new (or created and never initialized): ours to set up
    }
    let mut h = [0u8; 100];
    let mut got = 0;
    while got < h.len() {
        match f.read(&mut h[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io("cannot read", path, e)),
        }
    }
    if got < h.len() || &h[..16] != MAGIC {
        return Err(SqliteError::NotADatabase {
            detail: format!("{} ({len} bytes) has no SQLite header", path.display()),
        });
    }
    let page_size = match u16::from_be_bytes([h[16], h[17]]) {
        1 => 65536u64,
        n if n >= 512 && n.is_power_of_two() => u64::from(n),
        n => {
            return Err(SqliteError::Corrupt {
                detail: format!("{}: invalid page size {n}", path.display()),
            })
        }
    };
    let change_counter = u32::from_be_bytes([h[24], h[25], h[26], h[27]]);
    let pages = u64::from(u32::from_be_bytes([h[28], h[29], h[30], h[31]]));
    let valid_for = u32::from_be_bytes([h[92], h[93], h[94], h[95]]);
    // With a non-empty WAL the main file may legitimately lag behind (an interrupted checkpoint
    // is finished by SQLite's recovery), so the size check only applies without one.
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let wal_len = std::fs::metadata(Path::new(&wal)).map_or(0, |m| m.len());
    if wal_len == 0 && pages > 0 && change_counter == valid_for {
        let want = pages.saturating_mul(page_size);
        if len < want || len % page_size != 0 {
            return Err(SqliteError::Corrupt {
                detail: format!(
                    "{} is truncated: {len} bytes, its header says {pages} pages of {page_size}",
                    path.display()
                ),
            });
        }
    }
    Ok(())
}

/// What the file says it is.
struct Identity {
    application_id: i32,
    user_version: i64,
    tables: i64,
}

fn identify(conn: &Connection) -> Result<Identity, SqliteError> {
    let application_id: i32 = conn.pragma_query_value(None, "application_id", |r| r.get(0))?;
    let user_version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    let tables: i64 = conn.query_row(
        "SELECT count(*) FROM sqlite_schema WHERE type = 'table'",
        [],
        |r| r.get(0),
    )?;
    Ok(Identity {
        application_id,
        user_version,
        tables,
    })
}

/// What to do with a file.
enum Plan {
    /// Up to date.
    Ready,
    /// Ours (or empty) at an older schema version: run migrations from this version.
    Migrate(i64),
}

fn plan(id: &Identity) -> Result<Plan, SqliteError> {
    let fresh = id.application_id == 0 && id.user_version == 0 && id.tables == 0;
    if fresh {
        return Ok(Plan::Migrate(0));
    }
    if id.application_id != APPLICATION_ID {
        return Err(SqliteError::NotOurs {
            application_id: id.application_id,
            tables: id.tables,
        });
    }
    if id.user_version > SCHEMA_VERSION {
        return Err(SqliteError::TooNew {
            found: id.user_version,
            supported: SCHEMA_VERSION,
        });
    }
    if id.user_version < 0 {
        return Err(SqliteError::Corrupt {
            detail: format!("negative schema version {}", id.user_version),
        });
    }
    if id.user_version < SCHEMA_VERSION {
        Ok(Plan::Migrate(id.user_version))
    } else {
        Ok(Plan::Ready)
    }
}

/// Opens, identifies, configures and migrates.
pub(crate) fn open(path: &Path, opts: &OpenOptions) -> Result<Connection, SqliteError> {
    ensure_file(path, opts.create)?;
    check_header(path)?;
    let mut conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(opts.busy_timeout)?;
    conn.set_prepared_statement_cache_capacity(64);
    // Identify before changing anything: someone else's file is left exactly as it was.
    let first = plan(&identify(&conn)?)?;
    if let Plan::Migrate(0) = first {
        // A new file: its page size can still be chosen (before WAL mode and the first table).
        conn.pragma_update(None, "page_size", crate::schema::PAGE_SIZE)?;
    }
    let mode: String = conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(SqliteError::NoWal(mode));
    }
    conn.pragma_update(None, "synchronous", opts.synchronous.pragma())?;
    conn.pragma_update(None, "foreign_keys", true)?;
    if !opts.auto_checkpoint {
        conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    }
    if let Plan::Migrate(_) = first {
        migrate(&mut conn)?;
    }
    Ok(conn)
}

fn migrate(conn: &mut Connection) -> Result<(), SqliteError> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    // Again under the write lock: another process may have migrated meanwhile.
    let from = match plan(&identify(&tx)?)? {
        Plan::Ready => return Ok(()),
        Plan::Migrate(v) => v,
    };
    let start = usize::try_from(from).unwrap_or(usize::MAX);
    for sql in MIGRATIONS.iter().skip(start) {
        tx.execute_batch(sql)?;
    }
    tx.pragma_update(None, "application_id", APPLICATION_ID)?;
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    tx.commit()?;
    Ok(())
}
