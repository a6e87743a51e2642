//! Installer for the Claude Agent SDK sidecar that the Claude end-to-end tests drive offline.
//!
//! The sidecar's sources live in `<workspace>/io-tokio/sidecar/claude` (`package.json`,
//! `package-lock.json`, `sidecar.mjs`). [`ensure_claude_sidecar`] runs `npm ci` for them in
//! `<workspace>/.providers/claude-sidecar` (git-ignored) on first use and reuses that install on
//! later runs, as long as `package.json` and `package-lock.json` are unchanged (their hash is
//! stamped into the install). `sidecar.mjs` itself is refreshed on every call, so editing it needs
//! no reinstall.
//!
//! Concurrency: an exclusive `flock` on `<workspace>/.providers/claude-sidecar.lock` serialises
//! installers across test binaries and threads; `npm ci` runs in a scratch folder that is renamed
//! into place only once it is complete and verified, and `sidecar.mjs` is replaced by an atomic
//! rename, so a reader never sees a half-written install.
//!
//! Failures are errors starting with "could not install the Claude sidecar"; tests must fail on
//! them (`.expect(..)`), never skip.

use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::providers::{providers_dir, workspace_root};

/// The npm package the sidecar drives; its exact version is pinned in the sidecar's
/// `package.json` (and `package-lock.json`).
pub const CLAUDE_SDK_PACKAGE: &str = "@anthropic-ai/claude-agent-sdk";

/// Name of the install folder under `<workspace>/.providers`.
pub const SIDECAR_INSTALL_NAME: &str = "claude-sidecar";

/// Stamp file inside the install: the hash of the `package.json` + `package-lock.json` it was
/// installed from.
const STAMP_FILE: &str = ".tutti-install-stamp";

/// How long one `npm ci` may take before it is treated as failed.
const NPM_TIMEOUT: Duration = Duration::from_secs(20 * 60);

/// `<workspace>/io-tokio/sidecar/claude`: the checked-in sidecar sources.
pub fn sidecar_source_dir() -> PathBuf {
    workspace_root().join("io-tokio/sidecar/claude")
}

/// `<workspace>/.providers/claude-sidecar`: where the sidecar is installed and run from.
pub fn sidecar_install_dir() -> PathBuf {
    providers_dir().join(SIDECAR_INSTALL_NAME)
}

/// Makes sure the Claude sidecar is installed (running `npm ci` when needed) and returns the path
/// of its `sidecar.mjs`, to be run as `node <path>`.
///
/// Checks that the pinned `@anthropic-ai/claude-agent-sdk` is installed and that its native
/// binary (the optional dependency `@anthropic-ai/claude-agent-sdk-<os>-<arch>[-musl]`) is
/// present, and that `node` runs.
pub fn ensure_claude_sidecar() -> Result<PathBuf, String> {
    static CACHE: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut cached = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(path) = cached.as_ref() {
        return Ok(path.clone());
    }
    let path = ensure_uncached().map_err(|e| {
        format!(
            "could not install the Claude sidecar ({CLAUDE_SDK_PACKAGE} via npm ci in {}): {e}",
            sidecar_install_dir().display()
        )
    })?;
    *cached = Some(path.clone());
    Ok(path)
}

/// The exact SDK version pinned by the sidecar's `package.json`.
pub fn pinned_sdk_version() -> Result<String, String> {
    let manifest = sidecar_source_dir().join("package.json");
    let json = read_json(&manifest)?;
    json.get("dependencies")
        .and_then(|d| d.get(CLAUDE_SDK_PACKAGE))
        .and_then(|v| v.as_str())
        .map(str::to_owned)
        .ok_or_else(|| {
            format!(
                "{} does not depend on {CLAUDE_SDK_PACKAGE}",
                manifest.display()
            )
        })
}

/// The native-binary package names the SDK looks for on this platform, in its preference order,
/// each with the binary's path relative to `node_modules`.
pub fn native_binary_candidates() -> Vec<String> {
    let os = match std::env::consts::OS {
        "macos" => "darwin",
        "windows" => "win32",
        other => other,
    };
    let arch = match std::env::consts::ARCH {
        "x86_64" => "x64",
        "aarch64" => "arm64",
        other => other,
    };
    let exe = if os == "win32" { ".exe" } else { "" };
    let base = format!("{CLAUDE_SDK_PACKAGE}-{os}-{arch}");
    let names = if os == "linux" {
        if cfg!(target_env = "musl") {
            vec![format!("{base}-musl"), base]
        } else {
            vec![base.clone(), format!("{base}-musl")]
        }
    } else {
        vec![base]
    };
    names
        .into_iter()
        .map(|n| format!("{n}/claude{exe}"))
        .collect()
}

fn ensure_uncached() -> Result<PathBuf, String> {
    check_node()?;
    let source = sidecar_source_dir();
    let package_json = read_bytes(&source.join("package.json"))?;
    let package_lock = read_bytes(&source.join("package-lock.json"))?;
    let sidecar = read_bytes(&source.join("sidecar.mjs"))?;
    let version = pinned_sdk_version()?;
    let stamp = format!(
        "{:016x}",
        fnv1a64(&[package_json.as_slice(), package_lock.as_slice()])
    );

    let root = providers_dir();
    fs::create_dir_all(&root).map_err(|e| format!("create {}: {e}", root.display()))?;
    let dir = sidecar_install_dir();
    let script = dir.join("sidecar.mjs");
    let check = |d: &Path| install_is_complete(d, &stamp, &version);

    // Fast path, no lock: installs only ever appear by an atomic rename of a complete folder.
    if check(&dir).is_ok() && fs::read(&script).ok().as_deref() == Some(sidecar.as_slice()) {
        return Ok(script);
    }

    let _lock = FileLock::acquire(&root.join(format!("{SIDECAR_INSTALL_NAME}.lock")))?;
    if let Err(reason) = check(&dir) {
        let unique = unique_stamp();
        let scratch = root.join(format!(".{SIDECAR_INSTALL_NAME}.installing-{unique}"));
        let _ = fs::remove_dir_all(&scratch);
        fs::create_dir_all(&scratch).map_err(|e| format!("create {}: {e}", scratch.display()))?;
        let prepared = (|| {
            fs::write(scratch.join("package.json"), &package_json)
                .map_err(|e| format!("write package.json: {e}"))?;
            fs::write(scratch.join("package-lock.json"), &package_lock)
                .map_err(|e| format!("write package-lock.json: {e}"))?;
            npm_ci(&scratch)?;
            fs::write(scratch.join(STAMP_FILE), &stamp).map_err(|e| format!("write stamp: {e}"))?;
            check(&scratch)
        })();
        if let Err(e) = prepared {
            let _ = fs::remove_dir_all(&scratch);
            return Err(format!("npm ci failed ({reason} before): {e}"));
        }
        if dir.exists() {
            let old = root.join(format!(".{SIDECAR_INSTALL_NAME}.old-{unique}"));
            fs::rename(&dir, &old).map_err(|e| format!("move aside {}: {e}", dir.display()))?;
            let _ = fs::remove_dir_all(&old);
        }
        fs::rename(&scratch, &dir).map_err(|e| {
            let _ = fs::remove_dir_all(&scratch);
            format!("rename into {}: {e}", dir.display())
        })?;
        check(&dir)?;
    }
    if fs::read(&script).ok().as_deref() != Some(sidecar.as_slice()) {
        let tmp = dir.join(format!(".sidecar.mjs.{}", unique_stamp()));
        fs::write(&tmp, &sidecar).map_err(|e| format!("write {}: {e}", tmp.display()))?;
        fs::rename(&tmp, &script).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            format!("rename into {}: {e}", script.display())
        })?;
    }
    Ok(script)
}

fn install_is_complete(dir: &Path, stamp: &str, version: &str) -> Result<(), String> {
    let found_stamp = fs::read_to_string(dir.join(STAMP_FILE))
        .map_err(|_| format!("{} has no install stamp", dir.display()))?;
    if found_stamp.trim() != stamp {
        return Err(format!(
            "{} was installed from another package-lock.json",
            dir.display()
        ));
    }
    let modules = dir.join("node_modules");
    let manifest = modules.join(CLAUDE_SDK_PACKAGE).join("package.json");
    let json = read_json(&manifest)?;
    let found = json.get("version").and_then(|v| v.as_str()).unwrap_or("");
    if found != version {
        return Err(format!(
            "{CLAUDE_SDK_PACKAGE} is at version {found:?}, want {version}"
        ));
    }
    let candidates = native_binary_candidates();
    let binary = candidates
        .iter()
        .map(|c| modules.join(c))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "the SDK's native Claude binary (an optional dependency) is missing: none of {} \
                 exists under {}",
                candidates.join(", "),
                modules.display()
            )
        })?;
    let meta = fs::metadata(&binary).map_err(|e| format!("{}: {e}", binary.display()))?;
    if meta.permissions().mode() & 0o111 == 0 {
        let mut perms = meta.permissions();
        perms.set_mode(0o755);
        fs::set_permissions(&binary, perms)
            .map_err(|e| format!("chmod {}: {e}", binary.display()))?;
    }
    Ok(())
}

fn check_node() -> Result<(), String> {
    let out = Command::new("node")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run node (is Node.js >= 18 installed?): {e}"))?;
    if !out.status.success() {
        return Err(format!("`node --version` exited with {}", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let major: u32 = text
        .trim()
        .trim_start_matches('v')
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    if major < 18 {
        return Err(format!("node {} is too old; need >= 18", text.trim()));
    }
    Ok(())
}

fn npm_ci(dir: &Path) -> Result<(), String> {
    let log_path = dir.join("npm-ci.log");
    let log = File::create(&log_path).map_err(|e| format!("create {}: {e}", log_path.display()))?;
    let log_err = log.try_clone().map_err(|e| e.to_string())?;
    eprintln!(
        "installing the Claude sidecar (npm ci) into {} (first run only; this can take minutes)",
        dir.display()
    );
    let mut child = Command::new("npm")
        .args([
            "ci",
            "--no-audit",
            "--no-fund",
            "--ignore-scripts",
            "--omit=dev",
            "--loglevel=error",
        ])
        .current_dir(dir)
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
                return Err(format!("npm ci timed out after {NPM_TIMEOUT:?}"));
            }
            None => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut text = String::new();
    let _ = File::open(&log_path).and_then(|mut f| f.read_to_string(&mut text));
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(30)..].join("\n");
    Err(format!("npm ci exited with {status}; output:\n{tail}"))
}

fn read_bytes(path: &Path) -> Result<Vec<u8>, String> {
    fs::read(path).map_err(|e| format!("read {}: {e}", path.display()))
}

fn read_json(path: &Path) -> Result<serde_json::Value, String> {
    let text =
        fs::read_to_string(path).map_err(|e| format!("{} unreadable: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))
}

/// 64-bit FNV-1a over the parts, with a separator so that ("ab","c") != ("a","bc").
fn fnv1a64(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in part.iter().chain(&[0xffu8]) {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

fn unique_stamp() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{}-{nanos}-{n}", std::process::id())
}

/// An exclusive advisory lock (`flock`) held until drop; works across processes and threads.
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
            // SAFETY: flock on a valid file descriptor owned by `file`.
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
        // SAFETY: unlocking the descriptor we locked (closing it would release it as well).
        unsafe {
            libc::flock(self.file.as_raw_fd(), libc::LOCK_UN);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_separates_parts() {
        assert_ne!(fnv1a64(&[b"ab", b"c"]), fnv1a64(&[b"a", b"bc"]));
        // FNV-1a 64 of `x` then the 0xff part separator, written out: the cache key of an
        // installed SDK must not change between runs or builds.
        assert_eq!(fnv1a64(&[b"x"]), 0x08f1_c907_b58e_ba68);
    }

    #[test]
    fn candidates_name_the_platform_package() {
        let c = native_binary_candidates();
        assert!(!c.is_empty());
        assert!(c[0].starts_with("@anthropic-ai/claude-agent-sdk-"));
        assert!(c[0].contains("/claude"));
    }
}
