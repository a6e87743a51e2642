//! `acp_native`: see `tutti_core::fuzzing::acp_native`. Runs on stable as `tests/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tutti_core::fuzzing::acp_native(data));
