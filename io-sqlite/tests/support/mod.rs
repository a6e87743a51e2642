//! Shared test support: the workload generator and the store comparisons live in the
//! `tutti-testkit` crate (test tooling stays out of the library).
#![allow(unused_imports)]

pub use tutti_testkit::{compare, temp_db, workload};
