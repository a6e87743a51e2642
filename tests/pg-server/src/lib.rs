#![warn(missing_docs)]
//! A real PostgreSQL server for tests: `initdb` + `pg_ctl` in a temporary directory, as an
//! unprivileged user, on a private port, stopped on drop.
//!
//! Issue 21: "The test harness starts a real PostgreSQL server in a temporary directory
//! (`initdb` + `pg_ctl` as an unprivileged user; `apt-get install -y postgresql` when missing),
//! on a private port, and stops it afterwards."
//!
//! - The binaries are Debian's (`/usr/lib/postgresql/<version>/bin`, the newest version), or
//!   the ones on `PATH`; when neither exists and we are root, `apt-get install -y postgresql`
//!   runs once.
//! - PostgreSQL refuses to run as root: when we are root, every server command runs as `nobody`
//!   through `runuser`, and the data directory is owned by it.
//! - The server listens on 127.0.0.1 only, on a free port below the kernel's ephemeral range, with its unix
//!   socket in the temporary directory; authentication is `trust` for the one superuser `tutti`.
//! - [`Server::fast`] turns `fsync` off (tests of semantics need no disk flushes); [`Server::start`]
//!   keeps PostgreSQL's durable defaults (benchmarks).
//! - Drop stops the server (`pg_ctl stop -m immediate`, waiting for it), then removes the
//!   directory.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A running PostgreSQL server.
pub struct Server {
    dir: tempfile::TempDir,
    bin: PathBuf,
    port: u16,
    run_as: Option<String>,
    next_db: std::sync::atomic::AtomicU32,
    /// The server options (`pg_ctl -o`), for [`Server::start_again`].
    opts: String,
}

/// Why a server could not be started.
#[derive(Debug)]
pub struct ServerError(pub String);

impl std::fmt::Display for ServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn find_bin() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Some(bin);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).find(|p| p.join("initdb").exists() && p.join("pg_ctl").exists())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The PostgreSQL binaries' directory, installing the Debian package when missing (as root).
pub fn binaries() -> Result<PathBuf, ServerError> {
    if let Some(b) = find_bin() {
        return Ok(b);
    }
    if is_root() {
        let ok = Command::new("apt-get")
            .args(["install", "-y", "postgresql"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            let _ = Command::new("apt-get").arg("update").status();
            let _ = Command::new("apt-get")
                .args(["install", "-y", "postgresql"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .status();
        }
    }
    find_bin().ok_or_else(|| {
        ServerError("PostgreSQL binaries not found (apt-get install -y postgresql)".into())
    })
}

/// A port for a server, below the kernel's ephemeral range (32768 and up on Linux).
///
/// A port that `bind(0)` reported free is taken again by the next outgoing connection or
/// `bind(0)` of a parallel test, most dangerously while a server is stopped for a restart.
/// Ports in 20000..30000 are never handed out by the kernel, so only another server of this
/// helper can collide with one; the choice is spread by process id, a counter and the clock,
/// checked by a bind, and [`Server::launch`] tries again with another port if PostgreSQL still
/// finds the address in use.
fn free_port() -> Result<u16, ServerError> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let mut seed = std::process::id()
        .wrapping_mul(2_654_435_761)
        .wrapping_add(nanos)
        .wrapping_add(NEXT.fetch_add(7919, std::sync::atomic::Ordering::Relaxed));
    for _ in 0..200 {
        seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let port = 20_000 + (seed >> 8) % 10_000;
        let port = u16::try_from(port).unwrap_or(20_000);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(ServerError("no free port in 20000..30000".into()))
}

fn chown(path: &Path, user: &str) -> Result<(), ServerError> {
    let out = Command::new("chown")
        .args(["-R", user])
        .arg(path)
        .output()
        .map_err(|e| ServerError(format!("chown: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(ServerError(format!(
            "chown {user} {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

impl Server {
    /// A server with PostgreSQL's durable defaults.
    pub fn start() -> Result<Server, ServerError> {
        Server::launch(&[])
    }

    /// A server for semantic tests: `fsync`, `synchronous_commit` and `full_page_writes` off.
    pub fn fast() -> Result<Server, ServerError> {
        Server::launch(&[
            "fsync=off",
            "synchronous_commit=off",
            "full_page_writes=off",
        ])
    }

    fn launch(settings: &[&str]) -> Result<Server, ServerError> {
        let bin = binaries()?;
        let dir = tempfile::Builder::new()
            .prefix("tutti-pg-")
            .tempdir()
            .map_err(|e| ServerError(format!("temp dir: {e}")))?;
        let run_as = is_root().then(|| "nobody".to_string());
        if let Some(u) = &run_as {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
                .map_err(|e| ServerError(format!("chmod: {e}")))?;
            chown(dir.path(), u)?;
        }
        let port = free_port()?;
        let mut server = Server {
            dir,
            bin,
            port,
            run_as,
            next_db: std::sync::atomic::AtomicU32::new(0),
            opts: String::new(),
        };
        let data = server.data();
        server.run(
            "initdb",
            &[
                "-D",
                path_str(&data)?,
                "-A",
                "trust",
                "-U",
                "tutti",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
        )?;
        let mut opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1",
            path_str(server.dir.path())?
        );
        for s in settings {
            opts.push_str(" -c ");
            opts.push_str(s);
        }
        server.opts = opts;
        // Another server of a parallel test may have taken the port after our bind check.
        let mut tries = 0;
        loop {
            match server.start_again() {
                Ok(()) => return Ok(server),
                Err(e) if tries < 8 && e.0.contains("Address already in use") => {
                    tries += 1;
                    let old = format!("-p {} ", server.port);
                    server.port = free_port()?;
                    server.opts = server
                        .opts
                        .replacen(&old, &format!("-p {} ", server.port), 1);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Starts the server again after [`Server::stop`] (same port, options and data).
    pub fn start_again(&self) -> Result<(), ServerError> {
        let data = self.data();
        let log = self.dir.path().join("server.log");
        self.run(
            "pg_ctl",
            &[
                "-D",
                path_str(&data)?,
                "-l",
                path_str(&log)?,
                "-o",
                &self.opts,
                "-w",
                "-t",
                "60",
                "start",
            ],
        )
    }

    /// Stops the server as an operator does before an upgrade (`pg_ctl stop -m fast`: open
    /// transactions are rolled back, every connection is closed), waiting until it is down.
    pub fn stop(&self) -> Result<(), ServerError> {
        let data = self.data();
        self.run(
            "pg_ctl",
            &[
                "-D",
                path_str(&data)?,
                "-m",
                "fast",
                "-w",
                "-t",
                "60",
                "stop",
            ],
        )
    }

    /// `pg_ctl restart -m fast` (what a config reload needing a restart, a minor upgrade or a
    /// managed failover does), waiting until the server accepts connections again.
    pub fn restart(&self) -> Result<(), ServerError> {
        let data = self.data();
        // With its log file: the server's output must not hold our pipe open.
        let log = self.dir.path().join("server.log");
        self.run(
            "pg_ctl",
            &[
                "-D",
                path_str(&data)?,
                "-l",
                path_str(&log)?,
                "-m",
                "fast",
                "-w",
                "-t",
                "60",
                "-o",
                &self.opts,
                "restart",
            ],
        )
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn run(&self, program: &str, args: &[&str]) -> Result<(), ServerError> {
        let exe = self.bin.join(program);
        let mut cmd = match &self.run_as {
            Some(u) => {
                let mut c = Command::new("runuser");
                c.args(["-u", u, "--"]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        let out = cmd
            .args(args)
            .current_dir(self.dir.path())
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| ServerError(format!("{program}: {e}")))?;
        if out.status.success() {
            Ok(())
        } else {
            let log =
                std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
            Err(ServerError(format!(
                "{program} failed ({}): {}{}\n{log}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    }

    /// The process id of the running server's postmaster (the first line of its
    /// `postmaster.pid`), for tests that freeze the server (`SIGSTOP` to it and its backends).
    pub fn postmaster_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.data().join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// The server's TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `db` on this server.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://tutti@127.0.0.1:{}/{db}", self.port)
    }

    /// Creates a new, empty database and returns its URL.
    pub fn create_database(&self) -> Result<String, ServerError> {
        let n = self
            .next_db
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.create_database_named(&format!("tutti_{n}"))
    }

    /// Creates a new, empty schema in the database `postgres` and returns a URL whose
    /// connections use it (`search_path`): a private namespace for one store, much cheaper than
    /// a database (`CREATE DATABASE` copies a template).
    pub fn create_schema(&self) -> Result<String, ServerError> {
        let n = self
            .next_db
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let name = format!("tutti_s{n}");
        let mut c = postgres::Client::connect(&self.url("postgres"), postgres::NoTls)
            .map_err(|e| ServerError(format!("connect: {e}")))?;
        c.batch_execute(&format!("CREATE SCHEMA {name}"))
            .map_err(|e| ServerError(format!("create schema: {e}")))?;
        Ok(format!(
            "{}?options=-c%20search_path%3D{name}",
            self.url("postgres")
        ))
    }

    /// Creates a new, empty database named `name` (letters, digits and `_`) and returns its URL.
    pub fn create_database_named(&self, name: &str) -> Result<String, ServerError> {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(ServerError(format!("bad database name {name:?}")));
        }
        let mut c = postgres::Client::connect(&self.url("postgres"), postgres::NoTls)
            .map_err(|e| ServerError(format!("connect: {e}")))?;
        c.batch_execute(&format!("CREATE DATABASE {name}"))
            .map_err(|e| ServerError(format!("create database: {e}")))?;
        Ok(self.url(name))
    }
}

fn path_str(p: &Path) -> Result<&str, ServerError> {
    p.to_str()
        .ok_or_else(|| ServerError(format!("not UTF-8: {}", p.display())))
}

impl Drop for Server {
    fn drop(&mut self) {
        let data = self.data();
        if let Some(d) = data.to_str() {
            let _ = self.run("pg_ctl", &["-D", d, "-m", "immediate", "-w", "stop"]);
        }
    }
}
