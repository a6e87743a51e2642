//! # tutti-tokio
//!
//! The tokio driver of tutti: it carries out the engine's [`tutti_core::Step`]s against real
//! provider processes, a clock and the SQLite store, and serves the spec's HTTP API.
//!
//! ## The driver loop
//!
//! The [`daemon`] owns one engine thread. Inputs (API commands, normalized events from provider
//! runtimes, runtime answers, timers) arrive on one channel; the thread decides each with
//! `Engine::handle`, group-commits the steps of inputs that arrived together in one SQLite
//! transaction, and only then carries out each step: provider requests go to the root session's
//! [`runtime`] (one provider process per root tree, driven by a pure adapter from
//! `tutti_core::adapters`), timers are armed, the commit's outbox rows go to live followers of
//! the event stream, and the command's reply is sent. A failed commit evicts the tree and reloads
//! it from the file. Commits never checkpoint the WAL: a checkpoint thread of its own does, and
//! asks the engine thread for a quick WAL restart between two group commits when the WAL grows
//! past a bound under a load that never pauses.
//!
//! - [`api`]: axum routes and the Server-Sent Events stream.
//! - [`follow`]: a position in the event stream, read from the file while behind and from each
//!   commit's rows once caught up.
//! - [`forward`]: several daemons on one PostgreSQL database: commands for a tree another
//!   daemon owns are forwarded to it (authenticated by the database's cluster secret).
//! - [`providers`]: the provider registry (demo, ACP, Codex, Claude).
//! - [`config`]: the TOML config.
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
pub mod daemon;
pub mod demo;
pub mod follow;
pub mod forward;
pub mod metrics;
pub mod openapi;
pub mod postgres;
pub mod providers;
pub mod reads;
pub mod render;
pub mod retention;
pub mod runtime;
pub mod status;
pub mod tuttid;
pub mod web;
