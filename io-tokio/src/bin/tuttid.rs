//! `tuttid`: the reference daemon (see `tutti_tokio::tuttid`).
//!
//! Allocations go through mimalloc (issue 33). The daemon allocates on one thread and frees on
//! another all the time: a provider line is parsed into JSON on a runtime worker and dropped on
//! the engine thread, a group's batches are built on the engine thread and dropped on the commit
//! thread. With the C library's allocator those frees lock the allocating thread's arena; with
//! mimalloc the knee bench's CPU per line fell by about a tenth (engine thread about a fifth)
//! and its p99 at the same rates fell with it (README, Benchmarks). Built without transparent
//! huge pages (`no_thp`): with them each thread's first heap pages took a 2 MiB page of
//! resident memory, about 24 MB more for an idle daemon; without, about 2 MB more than the C
//! library's allocator (`cargo bench -p tutti-tokio --bench retention`). The daemon benchmarks
//! (`load`, `knee`, `retention`) use the same allocator, so that they measure what ships.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    tutti_tokio::tuttid::main()
}
