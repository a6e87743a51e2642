//! The `tutti` CLI, built as a binary of this package for its end-to-end tests.

fn main() {
    tutti_tokio::cli::main()
}
