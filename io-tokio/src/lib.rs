//! # tutti-tokio
//!
//! The tokio driver of tutti: it carries out the engine's [`tutti_core::Step`]s against real
//! provider processes, a clock and a store (an embedded SQLite file or PostgreSQL), and serves
//! the spec's HTTP API.
//!
//! ## The driver loop
//!
//! The [`daemon`] owns one engine thread, which owns one [`tutti_core::driver::Driver`]: the
//! engine, the pure adapters of the live roots (from `tutti_core::adapters`) and every timer, as
//! one sans-I/O machine. The thread's loop:
//!
//! 1. take what arrived on its one channel, as a group, and hand each to
//!    [`tutti_core::driver::Driver::handle`] as a [`tutti_core::driver::DriverInput`]: API
//!    commands (`Host`, with a reply token), native messages a provider [`runtime`] read from
//!    its process (`Native`; runtimes only move lines, they decide nothing), a provider's exit
//!    or failed write, and the timers due by [`tutti_core::driver::Driver::poll_timeout`]
//!    (`Timeout`);
//! 2. poll the driver's [`tutti_core::driver::Output`]s: gather every `Persist` (a decided
//!    batch, with the lease epoch it was decided under) and commit them in one store transaction
//!    (SQLite or PostgreSQL, fenced by the tree's lease on PostgreSQL), then report each as
//!    `Committed` or `NotCommitted` (a failed commit evicts the tree and reloads it from the
//!    store). On SQLite the group goes to a commit thread with a writer handle of its own (the
//!    commit pipeline, issue 33): the engine thread goes back to step 1 at once, and reports
//!    the group when the commit thread wakes it; the next group is every batch decided
//!    meanwhile. The commit thread sends a written group's outbox rows to the live followers
//!    itself, before it wakes the engine thread (so before anything the group released);
//! 3. carry out the outputs those commits released: `Launch` a provider process, `Transmit`
//!    native messages to one, `Publish` the committed outbox rows to the live followers of the
//!    event stream (on SQLite only the committed seq: the commit thread sent the rows), send
//!    each `Reply`, log each `Diagnostic`; repeat 2-3 until the driver is quiet.
//!
//! Nothing leaves the daemon before the batch that caused it is durable. On SQLite, commits
//! never checkpoint the WAL: a checkpoint thread of its own does, and asks the engine thread
//! for a quick WAL restart between two group commits when the WAL grows past a bound under a
//! load that never pauses.
//!
//! ## Layers
//!
//! Modules import only from the layers below them (checked by
//! `tests/tests/import_graph.rs`: no circles anywhere in the workspace, and io-tokio's layers
//! point down):
//!
//! 1. leaves: [`http`] (the JSON error envelope, limits, request ids), [`auth`] (tokens, cookies,
//!    the cluster secret, constant-time compares), [`outbox`] (live rows and batches),
//!    [`durability`], [`clock`], [`reads`] (the API's reads over any store), [`retention`];
//! 2. [`follow`]: a position in the event stream, read from the file while behind and from each
//!    commit's rows once caught up, over the narrow [`follow::OutboxSource`] trait with its own
//!    [`follow::FollowError`];
//! 3. the daemon core: [`daemon`] (the engine thread, [`daemon::DaemonError`]), its commit
//!    pipeline (`pipeline`: the SQLite commit thread), [`runtime`] and
//!    the provider transports, [`lease_watch`], [`postgres`], [`metrics`];
//! 4. the routes and entry points: [`api`], [`forward`], [`web`], [`openapi`], [`tuttid`],
//!    [`cli`].
//!
//! - [`api`]: axum routes and the Server-Sent Events stream.
//! - [`follow`]: the event stream's follower (above).
//! - [`forward`]: several daemons on one PostgreSQL database: commands for a tree another
//!   daemon owns are forwarded to it (authenticated by the database's cluster secret).
//! - [`providers`]: the provider registry (demo, ACP, Codex, Claude).
//! - [`config`]: the TOML config.
//! - [`connections`]: the HTTP accept loop (connection cap, header/body/idle timeouts).
//! - [`db_lock`]: one daemon per SQLite file (an advisory lock beside it).
//! - [`openapi`]: the OpenAPI 3.1 document of the API, from the same route table as the router.
//! - [`web`]: the web view of agent trees at `/` (assets in the binary, cookie login).

#![warn(missing_docs)]

pub mod acp_transport;
pub mod agents;
pub mod api;
pub mod auth;
pub mod cli;
pub mod clock;
pub mod config;
pub mod connections;
pub mod daemon;
pub mod db_lock;
pub mod demo;
pub mod durability;
pub mod follow;
pub mod forward;
pub mod http;
pub mod lease_watch;
pub mod metrics;
pub mod openapi;
pub mod outbox;
mod pipeline;
pub mod postgres;
pub mod providers;
pub mod reads;
pub mod render;
pub mod retention;
pub mod runtime;
pub mod status;
pub mod tuttid;
pub mod web;
