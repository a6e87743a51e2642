//! An outside client of a tutti database, for the durability tests: another process that opens
//! the file **read-write** with its own SQLite (as an operator's script would), reads a few
//! counts, and closes it. Closing the last connection to a WAL database checkpoints it and
//! deletes the WAL, which is exactly what loses a running daemon's commits if the daemon's own
//! locks were dropped.
//!
//! Usage: `tutti-outside-client DB`. Prints `sessions=N outbox=M` and exits 0, or prints the
//! error and exits 1.

use rusqlite::{Connection, OpenFlags};

fn main() {
    let Some(path) = std::env::args_os().nth(1) else {
        eprintln!("usage: tutti-outside-client DB");
        std::process::exit(2);
    };
    let run = || -> rusqlite::Result<(i64, i64)> {
        let c = Connection::open_with_flags(
            &path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        c.busy_timeout(std::time::Duration::from_secs(5))?;
        let sessions = c.query_row("SELECT count(*) FROM sessions", [], |r| r.get(0))?;
        let outbox = c.query_row("SELECT count(*) FROM outbox", [], |r| r.get(0))?;
        c.close().map_err(|(_, e)| e)?;
        Ok((sessions, outbox))
    };
    match run() {
        Ok((s, o)) => println!("sessions={s} outbox={o}"),
        Err(e) => {
            eprintln!("tutti-outside-client: {e}");
            std::process::exit(1);
        }
    }
}
