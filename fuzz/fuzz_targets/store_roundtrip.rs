//! `store_roundtrip`: see `tutti_testkit::roundtrip`. Runs on stable as `tests/tests/fuzz_corpus.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(e) = tutti_testkit::store_roundtrip(data) {
        panic!("store_roundtrip: {e}");
    }
});
