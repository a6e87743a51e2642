//! `engine_orderings`: see `tutti_testkit::engine_orderings`. Runs on stable as `tests/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tutti_testkit::engine_orderings(data));
