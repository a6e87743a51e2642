//! A real PostgreSQL server for tests (the `tutti-pg-server` member, shared with
//! `cargo bench -p tutti-postgres`).

pub use tutti_pg_server::{binaries, Server, ServerError};
