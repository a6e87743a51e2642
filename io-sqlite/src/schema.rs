//! The schema and its migrations, keyed by `PRAGMA user_version`.
//!
//! Every entity table has the columns that queries filter or sort on, plus `json`: the entity's
//! wire form (serde_json), which is what reads decode, so rows round-trip exactly. Every read is
//! one or two indexed queries (a unit test checks the query plans).
//!
//! Entity tables are ordinary rowid tables with their key as a unique index: rows carry a JSON
//! document of a few hundred bytes, which rowid tables store more cheaply than `WITHOUT ROWID`
//! b-trees (measured with `benches/apply.rs`), and appends (messages, outbox) land at the end of
//! the table b-tree.
//!
//! Version 2: a published message's outbox row does not copy the message's JSON. Messages are
//! immutable, so the outbox row keeps the message's rowid (`outbox.message_rowid`, `payload` left
//! empty) and the message keeps its outbox row's `seq` (`messages.outbox_seq`); reads of the
//! outbox take the payload from the message. Before a session's messages are purged, the outbox
//! rows that still point at them get their payload copied in, so no outbox row ever dangles.
//! Every event's JSON is thus written once, not twice (measured with `benches/apply.rs`).
//! New files also use 8 KiB pages (fewer, fuller pages per commit for these rows, measured
//! likewise); an existing file keeps the page size it was created with.
//!
//! Version 3: the working directory of a root session's provider (`session_cwd`), so that it
//! survives restarts and a tree evicted from memory needs no per-root map in the daemon; and
//! `outbox_marks`, the (seq, time) marks that the outbox retention policy ages rows by (the outbox
//! rows themselves carry no time, so the hot write path is unchanged). Files of versions 1 and 2
//! are migrated in place; both new tables start empty.
//!
//! Version 4: an index on the outbox's root (`outbox_by_root`). Deleting a session redacts its
//! tree's kept outbox rows (`REDACT_TREE_OUTBOX`); without the index that was one scan of the
//! whole kept outbox per deletion, so a run with deletions grew quadratic in the outbox's size
//! (the store bench lost its floor to it). Choice: the index costs one more b-tree insert per
//! outbox row on the hot path, paid by the raw baseline of the store bench too (it writes into
//! these tables); measured in the README's Benchmarks section.
//!
//! Version 5: that index replaced by the table `outbox_roots`, which lists each root's outbox
//! rows in arrears, many rows at a time, so that a group commit no longer rewrites a leaf of the
//! index for every tree it touches (see `outbox_roots.rs` in this crate, issue 33). The
//! migration lists the rows already there and drops the index.

/// `PRAGMA application_id` of a tutti database: ASCII "tuti".
pub const APPLICATION_ID: i32 = 0x7475_7469;

/// The schema version this build writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 5;

/// The DDL of the current schema version (all migrations in order), for tools and benchmarks
/// that need equivalent tables.
pub fn ddl() -> String {
    MIGRATIONS.concat()
}

/// The DDL that takes a database from `user_version` `from` to `from + 1` (for tests and tools
/// that need a file of an older version).
pub fn migration(from: usize) -> Option<&'static str> {
    MIGRATIONS.get(from).copied()
}

/// `MIGRATIONS[n]` takes a database from `user_version` n to n + 1. Each runs inside the
/// migration transaction, which also sets `user_version`.
pub(crate) const MIGRATIONS: &[&str] = &[V1, V2, V3, V4, V5];

/// The page size of a new file (`PRAGMA page_size`, set before its first table exists).
pub const PAGE_SIZE: i64 = 8192;

const V1: &str = r#"
CREATE TABLE meta (
    key   TEXT PRIMARY KEY NOT NULL,
    value INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO meta (key, value) VALUES ('outbox_pruned_through', 0);

CREATE TABLE sessions (
    id                    TEXT PRIMARY KEY NOT NULL,
    workspace_id          TEXT NOT NULL,
    kind                  TEXT NOT NULL CHECK (kind IN ('root', 'child')),
    root_agent_session_id TEXT,
    active_turn_id        TEXT,
    created_at            INTEGER NOT NULL,
    deleted_at            INTEGER,
    version               INTEGER NOT NULL,
    json                  TEXT NOT NULL
);
-- Tree loads and session detail: every session of one root tree.
CREATE INDEX sessions_by_root ON sessions (root_agent_session_id)
    WHERE root_agent_session_id IS NOT NULL;
-- Root list of a workspace, newest first, tombstones excluded.
CREATE INDEX sessions_roots_by_workspace ON sessions (workspace_id, created_at DESC, id DESC)
    WHERE kind = 'root' AND deleted_at IS NULL;
-- Recovery: roots with an active turn.
CREATE INDEX sessions_live_roots ON sessions (id)
    WHERE kind = 'root' AND active_turn_id IS NOT NULL;

CREATE TABLE turns (
    id                    TEXT PRIMARY KEY NOT NULL,
    agent_session_id      TEXT NOT NULL,
    child_creation_closed INTEGER NOT NULL,
    created_at            INTEGER NOT NULL,
    version               INTEGER NOT NULL,
    json                  TEXT NOT NULL
);
CREATE INDEX turns_by_session ON turns (agent_session_id);

CREATE TABLE interactions (
    turn_id          TEXT NOT NULL,
    request_id       TEXT NOT NULL,
    agent_session_id TEXT NOT NULL,
    version          INTEGER NOT NULL,
    json             TEXT NOT NULL,
    PRIMARY KEY (turn_id, request_id)
);
CREATE INDEX interactions_by_session ON interactions (agent_session_id);

-- Messages are appended: new rows land at the end of the table b-tree; the (session, seq) key is
-- a small separate index.
CREATE TABLE messages (
    agent_session_id TEXT NOT NULL,
    seq              INTEGER NOT NULL,
    message_id       TEXT NOT NULL,
    json             TEXT NOT NULL
);
CREATE UNIQUE INDEX messages_by_session ON messages (agent_session_id, seq);

CREATE TABLE tool_calls (
    agent_session_id TEXT NOT NULL,
    tool_call_id     TEXT NOT NULL,
    version          INTEGER NOT NULL,
    json             TEXT NOT NULL,
    PRIMARY KEY (agent_session_id, tool_call_id)
);

CREATE TABLE cancel_operations (
    id                    TEXT PRIMARY KEY NOT NULL,
    root_agent_session_id TEXT NOT NULL,
    state                 TEXT NOT NULL,
    version               INTEGER NOT NULL,
    json                  TEXT NOT NULL
);
CREATE INDEX cancel_operations_by_root ON cancel_operations (root_agent_session_id);
-- Recovery: trees with a prepared cancel operation.
CREATE INDEX cancel_operations_prepared ON cancel_operations (root_agent_session_id)
    WHERE state = 'prepared';

-- seq is the rowid: appends are cheap; numbers are never reused (see meta.outbox_pruned_through).
CREATE TABLE outbox (
    seq                   INTEGER PRIMARY KEY,
    kind                  TEXT NOT NULL,
    root_agent_session_id TEXT NOT NULL,
    workspace_id          TEXT NOT NULL,
    payload               TEXT NOT NULL
);

CREATE TABLE outbox_consumers (
    consumer  TEXT PRIMARY KEY NOT NULL,
    acked_seq INTEGER NOT NULL
) WITHOUT ROWID;
"#;

/// Version 2: outbox rows of messages reference the message instead of copying its JSON.
const V2: &str = r#"
-- The seq of the message's outbox row, if it was published by reference (else NULL).
ALTER TABLE messages ADD COLUMN outbox_seq INTEGER;
-- The rowid of the message this outbox row publishes; its payload is then '' (read from the
-- message). NULL: the payload is in the row.
ALTER TABLE outbox ADD COLUMN message_rowid INTEGER;
"#;

/// Version 3: the per-root provider working directory, and the outbox retention marks.
const V3: &str = r#"
-- The working directory a root session's provider runs in (set at creation, never changed).
CREATE TABLE session_cwd (
    root_agent_session_id TEXT PRIMARY KEY NOT NULL,
    cwd                   TEXT NOT NULL
) WITHOUT ROWID;

-- Every outbox row with seq <= this seq was committed at or before at_ms (written by the
-- retention pass; the oldest time is kept for a seq).
CREATE TABLE outbox_marks (
    seq   INTEGER PRIMARY KEY NOT NULL,
    at_ms INTEGER NOT NULL
);
"#;

/// Version 4: the outbox by root, for the redaction of a deleted session's kept rows.
const V4: &str = r#"
CREATE INDEX outbox_by_root ON outbox (root_agent_session_id);
"#;

/// Version 5: the outbox by root as a table kept in arrears instead of an index.
const V5: &str = r#"
-- Which outbox rows each root has, for the rows with seq <= meta.outbox_roots_through, listed
-- in arrears (outbox_roots.rs): each catch-up appends one entry per root among the rows it
-- lists, with their seqs (comma-separated), the first and the last. Keyed by the
-- first seq, so entries are appended in seq order and pruning takes a prefix; found by root
-- through their own index (one entry per tree and catch-up, not per row).
CREATE TABLE outbox_roots (
    first_seq             INTEGER PRIMARY KEY,
    last_seq              INTEGER NOT NULL,
    root_agent_session_id TEXT NOT NULL,
    seqs                  TEXT NOT NULL
);
CREATE INDEX outbox_roots_by_root ON outbox_roots (root_agent_session_id);
INSERT INTO outbox_roots (first_seq, last_seq, root_agent_session_id, seqs)
    SELECT min(seq), max(seq), root_agent_session_id, group_concat(seq) FROM
    (SELECT seq, root_agent_session_id FROM outbox ORDER BY seq)
    GROUP BY root_agent_session_id ORDER BY min(seq);
INSERT INTO meta (key, value) VALUES ('outbox_roots_through', (SELECT coalesce(max(seq), 0) FROM outbox))
    ON CONFLICT (key) DO UPDATE SET value = excluded.value;
DROP INDEX outbox_by_root;
"#;
