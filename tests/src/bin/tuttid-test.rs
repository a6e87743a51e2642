//! The `tuttid` program, built as a binary of this package so that its end-to-end tests can run
//! the real daemon as a separate process (`CARGO_BIN_EXE_tuttid-test`).

fn main() {
    tutti_tokio::tuttid::main()
}
