//! `tutti`: the command-line client (see `tutti_tokio::cli`).

fn main() {
    tutti_tokio::cli::main()
}
