//! The schema and its migrations, recorded in a version table (`tutti_schema_version`).
//!
//! The rows are those of the SQLite store (`tutti_sqlite::schema`): one table per entity with the
//! columns that queries filter or sort on, plus `json`, the entity's wire form (serde_json), which
//! is what reads decode, so rows round-trip exactly. `json` is `TEXT`, not `jsonb`: it is never
//! queried inside, and `jsonb` would reorder keys and normalize numbers.
//!
//! Differences from SQLite, each for several writers on one database:
//! - Ids are `TEXT COLLATE "C"`: keys sort by bytes whatever the database's locale, so root lists
//!   page exactly as in the other stores.
//! - The outbox sequence is a single counter row (`meta.outbox_next_seq`) read `FOR UPDATE` and
//!   advanced in the transaction that writes the outbox rows, not a `SEQUENCE`: a sequence hands
//!   out numbers outside transactions (a rolled-back writer leaves a gap) and lets a later number
//!   commit before an earlier one. With the counter row, publishing transactions commit one after
//!   the other in seq order, so a reader never sees seq `n + 1` before `n`.
//! - An outbox row copies its payload (SQLite version 2 references the message instead).
//!
//! Version 2 adds `tree_leases` (tree ownership and fencing, [`crate::lease`]); version 3 adds
//! `cluster_secret` (how daemons on one database authenticate forwarded commands to each other,
//! [`crate::cluster`]); version 4 adds `commit_marks` (one row per store handle: the mark of its
//! last commit, written inside every group transaction, so that a commit whose connection broke
//! after `COMMIT` was sent is resolved by reading back, see
//! [`crate::PostgresStore::read_back_commit`]).
//!
//! Migrations run in one transaction under an advisory lock, so daemons starting together on a
//! new database migrate it once.

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = 5;

/// The DDL that takes a database from version `from` to `from + 1` (for tests and tools that
/// need a database of an older version; the caller records the version in
/// `tutti_schema_version`).
pub fn migration(from: usize) -> Option<&'static str> {
    MIGRATIONS.get(from).copied()
}

/// `MIGRATIONS[n]` takes a database from version n to n + 1.
pub(crate) const MIGRATIONS: &[&str] = &[V1, V2, V3, V4, V5];

/// The advisory lock key migrations hold (ASCII "tuti").
pub(crate) const MIGRATION_LOCK: i64 = 0x7475_7469;

const V1: &str = r#"
CREATE TABLE meta (
    key   TEXT COLLATE "C" PRIMARY KEY,
    value BIGINT NOT NULL
);
INSERT INTO meta (key, value) VALUES ('outbox_next_seq', 1), ('outbox_pruned_through', 0);

CREATE TABLE sessions (
    id                    TEXT COLLATE "C" PRIMARY KEY,
    workspace_id          TEXT COLLATE "C" NOT NULL,
    kind                  TEXT NOT NULL CHECK (kind IN ('root', 'child')),
    root_agent_session_id TEXT COLLATE "C",
    active_turn_id        TEXT COLLATE "C",
    created_at            BIGINT NOT NULL,
    deleted_at            BIGINT,
    version               BIGINT NOT NULL,
    json                  TEXT NOT NULL
);
CREATE INDEX sessions_by_root ON sessions (root_agent_session_id)
    WHERE root_agent_session_id IS NOT NULL;
CREATE INDEX sessions_roots_by_workspace ON sessions (workspace_id, created_at DESC, id DESC)
    WHERE kind = 'root' AND deleted_at IS NULL;
CREATE INDEX sessions_live_roots ON sessions (id)
    WHERE kind = 'root' AND active_turn_id IS NOT NULL;

CREATE TABLE turns (
    id                    TEXT COLLATE "C" PRIMARY KEY,
    agent_session_id      TEXT COLLATE "C" NOT NULL,
    child_creation_closed BOOLEAN NOT NULL,
    created_at            BIGINT NOT NULL,
    version               BIGINT NOT NULL,
    json                  TEXT NOT NULL
);
CREATE INDEX turns_by_session ON turns (agent_session_id);

CREATE TABLE interactions (
    turn_id          TEXT COLLATE "C" NOT NULL,
    request_id       TEXT COLLATE "C" NOT NULL,
    agent_session_id TEXT COLLATE "C" NOT NULL,
    version          BIGINT NOT NULL,
    json             TEXT NOT NULL,
    PRIMARY KEY (turn_id, request_id)
);
CREATE INDEX interactions_by_session ON interactions (agent_session_id);

CREATE TABLE messages (
    agent_session_id TEXT COLLATE "C" NOT NULL,
    seq              BIGINT NOT NULL,
    message_id       TEXT COLLATE "C" NOT NULL,
    json             TEXT NOT NULL,
    PRIMARY KEY (agent_session_id, seq)
);

CREATE TABLE tool_calls (
    agent_session_id TEXT COLLATE "C" NOT NULL,
    tool_call_id     TEXT COLLATE "C" NOT NULL,
    version          BIGINT NOT NULL,
    json             TEXT NOT NULL,
    PRIMARY KEY (agent_session_id, tool_call_id)
);

CREATE TABLE cancel_operations (
    id                    TEXT COLLATE "C" PRIMARY KEY,
    root_agent_session_id TEXT COLLATE "C" NOT NULL,
    state                 TEXT NOT NULL,
    version               BIGINT NOT NULL,
    json                  TEXT NOT NULL
);
CREATE INDEX cancel_operations_by_root ON cancel_operations (root_agent_session_id);
CREATE INDEX cancel_operations_prepared ON cancel_operations (root_agent_session_id)
    WHERE state = 'prepared';

CREATE TABLE outbox (
    seq                   BIGINT PRIMARY KEY,
    kind                  TEXT NOT NULL,
    root_agent_session_id TEXT COLLATE "C" NOT NULL,
    workspace_id          TEXT COLLATE "C" NOT NULL,
    payload               TEXT NOT NULL
);

CREATE TABLE session_cwd (
    root_agent_session_id TEXT COLLATE "C" PRIMARY KEY,
    cwd                   TEXT NOT NULL
);

CREATE TABLE outbox_marks (
    seq   BIGINT PRIMARY KEY,
    at_ms BIGINT NOT NULL
);
"#;

/// Version 2: tree ownership leases (issue 21: "a lease row per live root (owner, epoch,
/// expiry)"), see [`crate::lease`].
const V2: &str = r#"
CREATE TABLE tree_leases (
    root_agent_session_id TEXT COLLATE "C" PRIMARY KEY,
    owner                 TEXT NOT NULL,
    owner_address         TEXT NOT NULL,
    epoch                 BIGINT NOT NULL,
    expires_at_ms         BIGINT NOT NULL
);
"#;

/// Version 3: the cluster secret (one row; created by the first daemon that starts), see
/// [`crate::cluster`].
const V3: &str = r#"
CREATE TABLE cluster_secret (
    id     INT PRIMARY KEY CHECK (id = 1),
    secret TEXT NOT NULL
);
"#;

/// Version 4: commit marks (issue 34: an unknown commit outcome is read back), see
/// [`crate::PostgresStore::read_back_commit`].
const V4: &str = r#"
CREATE TABLE commit_marks (
    writer TEXT COLLATE "C" PRIMARY KEY,
    n      BIGINT NOT NULL
);
"#;

/// Version 5: the outbox by root. Deleting a session redacts its tree's kept outbox rows
/// (`REDACT_TREE_OUTBOX`); without the index that was one scan of the whole kept outbox per
/// deletion. Choice: one more b-tree insert per outbox row, against a scan per deletion.
const V5: &str = r#"
CREATE INDEX outbox_by_root ON outbox (root_agent_session_id);
"#;

/// Brings the database to [`SCHEMA_VERSION`]: creates the version table if needed, then runs
/// every missing migration, all in one transaction under [`MIGRATION_LOCK`].
pub(crate) fn migrate(client: &mut postgres::Client) -> Result<i64, crate::PgError> {
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS tutti_schema_version (version BIGINT NOT NULL)")?;
    let found: Option<i64> = tx
        .query_opt("SELECT max(version) FROM tutti_schema_version", &[])?
        .and_then(|r| r.get(0));
    let found = found.unwrap_or(0);
    if found > SCHEMA_VERSION {
        return Err(crate::PgError::TooNew {
            found,
            supported: SCHEMA_VERSION,
        });
    }
    for (from, ddl) in MIGRATIONS.iter().enumerate().skip(found.max(0) as usize) {
        tx.batch_execute(ddl)?;
        let to = from as i64 + 1;
        tx.execute("DELETE FROM tutti_schema_version", &[])?;
        tx.execute(
            "INSERT INTO tutti_schema_version (version) VALUES ($1)",
            &[&to],
        )?;
    }
    tx.commit()?;
    Ok(found)
}
