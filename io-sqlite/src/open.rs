//! Opening or creating a database file: permissions, header check, pragmas, migrations.

use crate::error::SqliteError;
use crate::schema::{APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION};
use rusqlite::{Connection, OpenFlags, TransactionBehavior};
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
    /// The mode `PRAGMA synchronous` reports (`1` NORMAL, `2` FULL); other values (`0` OFF,
    /// `3` EXTRA, which this crate never sets) are `None`.
    pub fn from_pragma_value(v: i64) -> Option<Synchronous> {
        match v {
            1 => Some(Synchronous::Normal),
            2 => Some(Synchronous::Full),
            _ => None,
        }
    }
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
    pub(crate) cache_kib: u32,
}

/// The default most a connection's page cache holds: 16 MiB (SQLite's own default is 2 MiB).
///
/// Choice (issue 33): a group commit of a few tens of batches from many agents dirties a leaf of
/// its own per active session in each per-session index (messages, tool calls, the outbox by
/// root); with 2 MiB (256 pages of 8 KiB) those leaves of 100 active sessions did not stay
/// cached between commits, and the commit thread spent 7-9 % of its time re-reading them from
/// the operating system. The cache grows only as pages are read, so a small database uses
/// little; the daemon opens three connections this way (its checkpoint thread's own keeps
/// SQLite's default), so at most 48 MiB.
pub const DEFAULT_CACHE_KIB: u32 = 16 * 1024;

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            synchronous: Synchronous::Normal,
            busy_timeout: Duration::from_secs(5),
            create: true,
            replay_rule: ReplayRule::default(),
            auto_checkpoint: true,
            cache_kib: DEFAULT_CACHE_KIB,
        }
    }
}

impl OpenOptions {
    /// Defaults: `synchronous=NORMAL`, 5 s busy timeout, create the file if missing, a page
    /// cache of at most [`DEFAULT_CACHE_KIB`].
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
    /// The most the connection's page cache holds, in KiB (`PRAGMA cache_size`; at least 64).
    pub fn cache_kib(mut self, kib: u32) -> OpenOptions {
        self.cache_kib = kib.max(64);
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
///
/// An existing file is only `stat`ed, never opened: a descriptor of ours opened and closed on a
/// file another connection of this process holds would drop that connection's POSIX locks (see
/// [`check_header`]). The only descriptor opened here is on a file that did not exist a moment
/// before (`create_new`), which no connection can hold.
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

/// Checks the file's header through SQLite, so that garbage and a truncated file get a clear
/// error instead of a late "malformed" from some query.
///
/// The header is read by SQLite's own file handle, never by a second descriptor of ours: on
/// POSIX, closing *any* descriptor of a file drops *every* lock the process holds on it (SQLite's
/// documentation, "How To Corrupt An SQLite Database File", 2.2). If another connection of this
/// process (the daemon's writer, say) has the file open, a `File::open` + close here would
/// silently drop its WAL lock; an outside `sqlite3` client would then believe it is the last
/// connection, checkpoint and delete the WAL, and every later commit of the daemon would go to an
/// unlinked file. Only `stat` (which opens nothing) is used on the path itself.
///
/// The first read of page 1 reports a missing magic string as `SQLITE_NOTADB`
/// ([`SqliteError::NotADatabase`]) and a header that claims more pages than the file holds as
/// `SQLITE_CORRUPT` ([`SqliteError::Corrupt`]). A file whose length is not a whole number of
/// pages, or shorter than the header says, is reported here as corrupt too; that check only
/// applies while the WAL is empty, since with a non-empty WAL the main file may legitimately lag
/// behind (an interrupted checkpoint is finished by SQLite's recovery).
fn check_header(conn: &Connection, path: &Path) -> Result<(), SqliteError> {
    let len = std::fs::metadata(path)
        .map_err(|e| io("cannot stat", path, e))?
        .len();
    if len == 0 {
        return Ok(()); // new (or created and never initialized): ours to set up
    }
    // Reads page 1 (the header) through SQLite: NOTADB / CORRUPT come back typed.
    conn.query_row("SELECT count(*) FROM sqlite_schema", [], |r| {
        r.get::<_, i64>(0)
    })?;
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let wal_len = std::fs::metadata(Path::new(&wal)).map_or(0, |m| m.len());
    if wal_len != 0 {
        return Ok(());
    }
    let page_size: i64 = conn.pragma_query_value(None, "page_size", |r| r.get(0))?;
    let pages: i64 = conn.pragma_query_value(None, "page_count", |r| r.get(0))?;
    let page_size = u64::try_from(page_size).unwrap_or(0);
    let pages = u64::try_from(pages).unwrap_or(0);
    if page_size < 512 || !page_size.is_power_of_two() {
        return Err(SqliteError::Corrupt {
            detail: format!("{}: invalid page size {page_size}", path.display()),
        });
    }
    let want = pages.saturating_mul(page_size);
    if len < want || len % page_size != 0 {
        return Err(SqliteError::Corrupt {
            detail: format!(
                "{} is truncated: {len} bytes, its header says {pages} pages of {page_size}",
                path.display()
            ),
        });
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
    let mut conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(opts.busy_timeout)?;
    check_header(&conn, path)?;
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
    // Negative: a size in KiB rather than in pages.
    conn.pragma_update(None, "cache_size", -i64::from(opts.cache_kib))?;
    // Deleted means gone (issue 36): deleted rows (a deleted session's content, its rewritten
    // outbox rows, pruned rows) are overwritten with zeros in the file, not left in free space.
    conn.pragma_update(None, "secure_delete", true)?;
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
