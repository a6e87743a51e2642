//! `tuttid`: the reference daemon (see `tutti_tokio::tuttid`).

fn main() {
    tutti_tokio::tuttid::main()
}
