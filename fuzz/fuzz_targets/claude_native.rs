//! `claude_native`: see `tutti_testkit::claude_native`. Runs on stable as `tests/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tutti_testkit::claude_native(data));
