//! `engine_orderings`: see `tutti_core::fuzzing::engine_orderings`. Runs on stable as `tests/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tutti_core::fuzzing::engine_orderings(data));
