//! Installers for the real provider programs that the end-to-end tests drive offline.
//!
//! Every provider lives in its own folder under `<workspace>/.providers/` (git-ignored) and is
//! installed from its package registry on first use, then reused by later runs. Installs are safe
//! when several test binaries (or several tests of one binary) ask at the same time: an exclusive
//! `flock` on `<workspace>/.providers/<name>.lock` serialises them, the package is installed into a
//! scratch folder beside the final one, and that folder is renamed into place only when it is
//! complete, so a half-finished install is never seen under the final name.
//!
//! A failed install is an error that names what could not be installed; tests must propagate it
//! (`ensure_codex().expect(..)`) and fail, never skip.
//!
//! `ensure_codex()` is here; sibling installers (e.g. `ensure_claude_sdk()`) live in their own
//! files and can reuse [`ensure_npm_package`].

use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The pinned `@openai/codex` npm version. The tests and the protocol notes were written against
/// exactly this version; bump deliberately (and re-run `codex app-server generate-json-schema`).
pub const CODEX_VERSION: &str = "0.171.0";

/// Where the static Codex binary lives inside the npm install (the platform package is an npm
/// alias `@openai/codex-linux-x64` -> `@openai/codex@<version>-linux-x64`).
pub const CODEX_BIN_IN_PREFIX: &str =
    "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex";

/// Environment variable that, when set, points at an already-installed `codex` binary and skips
/// the npm install (useful on a machine that has Codex elsewhere).
pub const CODEX_BIN_ENV: &str = "TUTTI_CODEX_BIN";

/// How long one `npm install` may take before it is treated as failed.
const NPM_TIMEOUT: Duration = Duration::from_secs(20 * 60);

/// The workspace root (the folder holding the workspace `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests crate has a parent folder")
        .to_path_buf()
}

/// `<workspace>/.providers`, the git-ignored home of all installed provider programs.
pub fn providers_dir() -> PathBuf {
    workspace_root().join(".providers")
}

/// Returns the path of the static `codex` binary (npm `@openai/codex` at [`CODEX_VERSION`]),
/// installing it with `npm install --prefix <workspace>/.providers/codex` when it is missing.
///
/// The error message always starts with "could not install the Codex binary".
pub fn ensure_codex() -> Result<PathBuf, String> {
    static CACHE: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut cached = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = cached.as_ref() {
        return Ok(path.clone());
    }
    let path = ensure_codex_uncached().map_err(|e| {
        format!("could not install the Codex binary (npm @openai/codex@{CODEX_VERSION}): {e}")
    })?;
    *cached = Some(path.clone());
    Ok(path)
}

fn ensure_codex_uncached() -> Result<PathBuf, String> {
    if let Some(bin) = std::env::var_os(CODEX_BIN_ENV) {
        let bin = PathBuf::from(bin);
        return if is_executable(&bin) {
            Ok(bin)
        } else {
            Err(format!(
                "{CODEX_BIN_ENV}={} is not an executable file",
                bin.display()
            ))
        };
    }
    if !(cfg!(target_os = "linux") && cfg!(target_arch = "x86_64")) {
        return Err("only linux x86_64 is supported by this installer".into());
    }
    let prefix = ensure_npm_package(
        "codex",
        &format!("@openai/codex@{CODEX_VERSION}"),
        &[("@openai/codex", CODEX_VERSION)],
        &[CODEX_BIN_IN_PREFIX],
    )?;
    let bin = prefix.join(CODEX_BIN_IN_PREFIX);
    if !is_executable(&bin) {
        // npm may drop the executable bit on some setups; restore it.
        let mut perms = fs::metadata(&bin)
            .map_err(|e| format!("{}: {e}", bin.display()))?
            .permissions();
        perms.set_mode(0o755);
        fs::set_permissions(&bin, perms).map_err(|e| format!("chmod {}: {e}", bin.display()))?;
    }
    Ok(bin)
}

/// Installs `spec` (an npm package spec such as `@openai/codex@0.171.0`) into
/// `<workspace>/.providers/<name>` unless an install already there satisfies `expect_versions`
/// (package name -> exact `version` in its `package.json`) and contains every file of
/// `expect_files` (relative to the prefix). Returns the prefix folder.
///
/// Safe to call concurrently from several processes and threads.
pub fn ensure_npm_package(
    name: &str,
    spec: &str,
    expect_versions: &[(&str, &str)],
    expect_files: &[&str],
) -> Result<PathBuf, String> {
    let root = providers_dir();
    fs::create_dir_all(&root).map_err(|e| format!("create {}: {e}", root.display()))?;
    let prefix = root.join(name);
    let check = |dir: &Path| install_is_complete(dir, expect_versions, expect_files);

    // Fast path, no lock: installs only ever appear by an atomic rename of a complete folder.
    if check(&prefix).is_ok() {
        return Ok(prefix);
    }

    let _lock = FileLock::acquire(&root.join(format!("{name}.lock")))?;
    // Someone else may have finished while we waited for the lock.
    let reason = match check(&prefix) {
        Ok(()) => return Ok(prefix),
        Err(reason) => reason,
    };

    let stamp = unique_stamp();
    let scratch = root.join(format!(".{name}.installing-{stamp}"));
    let _ = fs::remove_dir_all(&scratch);
    fs::create_dir_all(&scratch).map_err(|e| format!("create {}: {e}", scratch.display()))?;
    let result = npm_install(&scratch, spec).and_then(|()| check(&scratch));
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&scratch);
        return Err(format!(
            "npm install {spec} failed: {e}\n(no usable install was there before: {reason})"
        ));
    }
    if prefix.exists() {
        // An old or broken install: move it aside, then delete it.
        let old = root.join(format!(".{name}.old-{stamp}"));
        fs::rename(&prefix, &old).map_err(|e| format!("move aside {}: {e}", prefix.display()))?;
        let _ = fs::remove_dir_all(&old);
    }
    fs::rename(&scratch, &prefix).map_err(|e| {
        let _ = fs::remove_dir_all(&scratch);
        format!("rename into {}: {e}", prefix.display())
    })?;
    check(&prefix)?;
    Ok(prefix)
}

fn install_is_complete(
    prefix: &Path,
    expect_versions: &[(&str, &str)],
    expect_files: &[&str],
) -> Result<(), String> {
    for (package, version) in expect_versions {
        let manifest = prefix
            .join("node_modules")
            .join(package)
            .join("package.json");
        let text = fs::read_to_string(&manifest)
            .map_err(|e| format!("{} unreadable: {e}", manifest.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not JSON: {e}", manifest.display()))?;
        let found = json.get("version").and_then(|v| v.as_str()).unwrap_or("");
        if found != *version {
            return Err(format!("{package} is at version {found:?}, want {version}"));
        }
    }
    for file in expect_files {
        let path = prefix.join(file);
        if !path.is_file() {
            return Err(format!("{} is missing", path.display()));
        }
    }
    Ok(())
}

fn npm_install(prefix: &Path, spec: &str) -> Result<(), String> {
    let log_path = prefix.join("npm-install.log");
    let log = File::create(&log_path).map_err(|e| format!("create {}: {e}", log_path.display()))?;
    let log_err = log.try_clone().map_err(|e| e.to_string())?;
    eprintln!(
        "installing npm {spec} into {} (first run only; this can take minutes)",
        prefix.display()
    );
    let mut child = Command::new("npm")
        .arg("install")
        .arg("--prefix")
        .arg(prefix)
        .args([
            "--no-audit",
            "--no-fund",
            "--save-exact",
            "--loglevel=error",
        ])
        .arg(spec)
        .current_dir(prefix)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .spawn()
        .map_err(|e| format!("cannot run npm (is Node.js installed?): {e}"))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait().map_err(|e| e.to_string())? {
            Some(status) => break status,
            None if started.elapsed() > NPM_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("npm install timed out after {NPM_TIMEOUT:?}"));
            }
            None => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut text = String::new();
    let _ = File::open(&log_path).and_then(|mut f| f.read_to_string(&mut text));
    let tail: String = text
        .lines()
        .rev()
        .take(30)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    Err(format!("npm exited with {status}; output:\n{tail}"))
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

fn unique_stamp() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{}-{nanos}", std::process::id())
}

/// An exclusive advisory lock (`flock`) held until drop. Works across processes and across
/// threads of one process (each acquisition opens its own file description).
struct FileLock {
    file: File,
}

impl FileLock {
    fn acquire(path: &Path) -> Result<Self, String> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(|e| format!("open lock {}: {e}", path.display()))?;
        loop {
            // SAFETY: flock on a valid, owned file descriptor.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(Self { file });
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(format!("lock {}: {err}", path.display()));
            }
        }
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // SAFETY: unlocking the descriptor we locked; closing the file would release it too.
        unsafe {
            libc::flock(self.file.as_raw_fd(), libc::LOCK_UN);
        }
    }
}

/// Installs the pinned PyPI packages `specs` (such as `schemathesis==4.32.5`) into a virtualenv
/// at `<workspace>/.providers/<name>` unless one is there whose marker file (`.complete`, written
/// last) holds exactly `specs`. Returns the venv folder (programs in `bin/`).
///
/// A venv cannot be moved (its scripts name their interpreter by absolute path), so unlike
/// [`ensure_npm_package`] it is built in place under the `<name>.lock` flock; a half-built one
/// (no marker, or another one) is deleted and built again. `python3 -m venv` needs Debian's
/// `python3-venv` on a system Python. A failed install is an error (tests fail on it).
pub fn ensure_pip_venv(name: &str, specs: &[&str]) -> Result<PathBuf, String> {
    let root = providers_dir();
    fs::create_dir_all(&root).map_err(|e| format!("create {}: {e}", root.display()))?;
    // A venv's scripts name its interpreter by absolute path: it is built at the canonical path
    // (`.providers` may be a symlink) and the marker records that path, so a venv built
    // elsewhere (a removed worktree) is rebuilt rather than run with a dead interpreter.
    let root = fs::canonicalize(&root).map_err(|e| format!("resolve {}: {e}", root.display()))?;
    let venv = root.join(name);
    let marker = venv.join(".complete");
    let want = format!("{}\n@{}", specs.join("\n"), venv.display());
    let done = || fs::read_to_string(&marker).is_ok_and(|m| m == want);
    if done() {
        return Ok(venv);
    }
    let _lock = FileLock::acquire(&root.join(format!("{name}.lock")))?;
    if done() {
        return Ok(venv);
    }
    let _ = fs::remove_dir_all(&venv);
    eprintln!(
        "installing {} into {} (first run only; this can take a minute)",
        specs.join(" "),
        venv.display()
    );
    let run = |cmd: &mut Command, what: &str| -> Result<(), String> {
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("{what}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{what} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    };
    let venv_cmd = || {
        run(
            Command::new("python3").arg("-m").arg("venv").arg(&venv),
            "python3 -m venv",
        )
    };
    // Debian's python3 keeps `venv` in a package of its own: installed when missing (as the
    // other tests install postgresql and chromium), then tried once more.
    let result = venv_cmd()
        .or_else(|first| {
            let _ = fs::remove_dir_all(&venv);
            let root_user = Command::new("id")
                .arg("-u")
                .output()
                .is_ok_and(|o| o.stdout.starts_with(b"0"));
            let mut apt = if root_user {
                Command::new("apt-get")
            } else {
                let mut c = Command::new("sudo");
                c.arg("apt-get");
                c
            };
            apt.args(["install", "-y", "python3-venv"]);
            run(&mut apt, "apt-get install python3-venv")
                .and_then(|()| venv_cmd())
                .map_err(|second| format!("{first}; then {second}"))
        })
        .and_then(|()| {
            run(
                Command::new(venv.join("bin/pip"))
                    .args(["install", "--quiet", "--disable-pip-version-check"])
                    .args(specs),
                "pip install",
            )
        })
        .and_then(|()| fs::write(&marker, &want).map_err(|e| format!("write marker: {e}")));
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&venv);
        return Err(format!("could not install {}: {e}", specs.join(" ")));
    }
    Ok(venv)
}
