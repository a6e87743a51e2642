//! `codex_native`: see `tutti_testkit::codex_native`. Runs on stable as `tests/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tutti_testkit::codex_native(data));
