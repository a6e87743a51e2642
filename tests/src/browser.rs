//! A real headless Chromium driven over WebDriver (the W3C protocol, spoken with `ureq`
//! directly: a handful of JSON requests, no client crate). Debian's `chromium` and
//! `chromium-driver` packages are installed with `apt-get install -y chromium chromium-driver`
//! when `chromedriver` is missing.
//!
//! [`Browser`] starts `chromedriver` in a process group of its own on a free loopback port and
//! one browser session; dropping it ends the session (Chromium exits) and then kills the whole
//! group, so no `chromedriver` or `chromium` process outlives a test.

use serde_json::{json, Value};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// One browser at a time: the machine has few cores, and Chromium is heavy.
static ONE_BROWSER: Mutex<()> = Mutex::new(());

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// The W3C key code of Enter.
pub const ENTER: &str = "\u{E007}";
/// The W3C key code of Tab.
pub const TAB: &str = "\u{E004}";

/// Installs Chromium and its driver when missing (Debian packages).
pub fn ensure_chromium() {
    if Path::new(CHROMEDRIVER).exists() && Path::new(CHROMIUM).exists() {
        return;
    }
    // SAFETY: geteuid(2) has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let apt = |args: &[&str]| {
        let mut cmd = if root {
            Command::new("apt-get")
        } else {
            let mut c = Command::new("sudo");
            c.arg("-n").arg("apt-get");
            c
        };
        cmd.args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    let install = ["install", "-y", "chromium", "chromium-driver"];
    let ok = apt(&install) || (apt(&["update"]) && apt(&install));
    assert!(
        ok,
        "installing chromium and chromium-driver with apt-get failed"
    );
    assert!(
        Path::new(CHROMEDRIVER).exists(),
        "apt-get ran but {CHROMEDRIVER} is still missing"
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A WebDriver session on a headless Chromium.
pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    profile: tempfile::TempDir,
    _one: MutexGuard<'static, ()>,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium with a `width` x `height` viewport.
    pub fn start(width: u32, height: u32) -> Browser {
        let one = ONE_BROWSER.lock().unwrap_or_else(PoisonError::into_inner);
        ensure_chromium();
        let port = free_port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start chromedriver");
        let base = format!("http://127.0.0.1:{port}");
        let start = Instant::now();
        loop {
            if let Ok(r) = ureq::get(&format!("{base}/status")).call() {
                let v: Value = r.into_json().unwrap_or(Value::Null);
                if v["value"]["ready"] == true {
                    break;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "chromedriver did not come up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let profile = tempfile::tempdir().expect("profile dir");
        let mut b = Browser {
            driver,
            base,
            session: String::new(),
            profile,
            _one: one,
        };
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu",
                    "--disable-dev-shm-usage", "--no-first-run",
                    "--disable-extensions", "--disable-background-networking",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", b.profile.path().display()),
                ],
            },
        }}});
        // Chromium keeps desktop windows at least 500 px wide: a narrower viewport is emulated
        // (device metrics only: same browser, same engine).
        let mut caps = caps;
        if width < 500 {
            caps["capabilities"]["alwaysMatch"]["goog:chromeOptions"]["mobileEmulation"] =
                json!({"deviceMetrics": {"width": width, "height": height, "pixelRatio": 1.0}});
        }
        let v = b.raw("POST", "/session", Some(caps));
        b.session = v["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {v}"))
            .to_string();
        b
    }

    fn raw(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let req = ureq::request(method, &format!("{}{}", self.base, path))
            .timeout(Duration::from_secs(60));
        let r = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match r {
            Ok(r) => r.into_json::<Value>().unwrap_or(Value::Null)["value"].take(),
            Err(ureq::Error::Status(code, r)) => {
                let v: Value = r.into_json().unwrap_or(Value::Null);
                panic!("WebDriver {method} {path}: {code} {v}")
            }
            Err(e) => panic!("WebDriver {method} {path}: {e}"),
        }
    }

    fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.raw(method, &format!("/session/{}{}", self.session, path), body)
    }

    /// Navigates to `url`.
    pub fn goto(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url })));
    }

    /// The current URL.
    pub fn url(&self) -> String {
        self.cmd("GET", "/url", None)
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Runs `script` (a function body; `arguments` are `args`) and returns its value.
    pub fn js(&self, script: &str, args: Vec<Value>) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": args})),
        )
    }

    /// Polls `script` until it returns a truthy value; panics with `what` and the page's text
    /// after `secs`.
    pub fn wait(&self, what: &str, secs: u64, script: &str, args: Vec<Value>) -> Value {
        let start = Instant::now();
        loop {
            let v = self.js(script, args.clone());
            let truthy = match &v {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return v;
            }
            if start.elapsed() > Duration::from_secs(secs) {
                let text = self.js("return document.body.innerText", vec![]);
                panic!(
                    "timed out waiting for {what}; page text:\n{}",
                    text.as_str().unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The WebDriver id of the first element matching `css` (panics when none).
    pub fn find(&self, css: &str) -> String {
        let v = self.cmd(
            "POST",
            "/element",
            Some(json!({"using": "css selector", "value": css})),
        );
        v.as_object()
            .and_then(|o| o.values().next())
            .and_then(|id| id.as_str())
            .unwrap_or_else(|| panic!("no element {css}"))
            .to_string()
    }

    /// Clicks the first element matching `css`, as a user would (WebDriver element click).
    /// A live page may replace the element between finding and clicking it; then it is found
    /// again (a few times).
    pub fn click(&self, css: &str) {
        for _ in 0..5 {
            let id = self.find(css);
            let url = format!("{}/session/{}/element/{id}/click", self.base, self.session);
            match ureq::post(&url)
                .timeout(Duration::from_secs(60))
                .send_json(json!({}))
            {
                Ok(_) => return,
                Err(ureq::Error::Status(404, r)) => {
                    let v: Value = r.into_json().unwrap_or(Value::Null);
                    assert_eq!(
                        v["value"]["error"], "stale element reference",
                        "click {css}: {v}"
                    );
                }
                Err(e) => panic!("click {css}: {e}"),
            }
        }
        panic!("click {css}: the element kept being replaced");
    }

    /// Presses the pointer on the first element matching `css`, holds it `ms` milliseconds and
    /// releases it (WebDriver actions: real pointer events, as a person's press). A page that
    /// replaces the element while it is held loses the click.
    pub fn hold_click(&self, css: &str, ms: u64) {
        let id = self.find(css);
        let el = json!({"element-6066-11e4-a52e-4f735466cecf": id});
        self.cmd(
            "POST",
            "/actions",
            Some(json!({"actions": [{"type": "pointer", "id": "mouse",
            "parameters": {"pointerType": "mouse"},
            "actions": [
                {"type": "pointerMove", "origin": el, "x": 0, "y": 0, "duration": 0},
                {"type": "pointerDown", "button": 0},
                {"type": "pause", "duration": ms},
                {"type": "pointerUp", "button": 0},
            ]}]})),
        );
        self.cmd("DELETE", "/actions", None);
    }

    /// Presses and releases each key of `keys` on whatever has focus (WebDriver key actions;
    /// [`TAB`], [`ENTER`] and friends are the WebDriver key codes).
    pub fn press(&self, keys: &str) {
        let mut actions = Vec::new();
        for k in keys.chars() {
            actions.push(json!({"type": "keyDown", "value": k.to_string()}));
            actions.push(json!({"type": "keyUp", "value": k.to_string()}));
        }
        self.cmd(
            "POST",
            "/actions",
            Some(json!({"actions": [{"type": "key", "id": "keyboard", "actions": actions}]})),
        );
        self.cmd("DELETE", "/actions", None);
    }

    /// Types `text` into the first element matching `css` (WebDriver element send keys: real
    /// key events; [`ENTER`] presses Enter).
    pub fn keys(&self, css: &str, text: &str) {
        let id = self.find(css);
        self.cmd(
            "POST",
            &format!("/element/{id}/value"),
            Some(json!({ "text": text })),
        );
    }

    /// The browser's cookies (WebDriver cookie objects: `name`, `value`, `httpOnly`,
    /// `sameSite`, ...).
    pub fn cookies(&self) -> Vec<Value> {
        self.cmd("GET", "/cookie", None)
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Deletes every cookie.
    pub fn delete_cookies(&self) {
        self.cmd("DELETE", "/cookie", None);
    }

    /// Resizes the window.
    pub fn window(&self, width: u32, height: u32) {
        self.cmd(
            "POST",
            "/window/rect",
            Some(json!({"width": width, "height": height})),
        );
    }

    /// Saves a PNG screenshot of the viewport to `path` (parent directories created).
    pub fn screenshot(&self, path: &Path) {
        let v = self.cmd("GET", "/screenshot", None);
        let png = base64_decode(v.as_str().unwrap_or_default()).expect("screenshot is base64");
        assert!(png.starts_with(b"\x89PNG"), "screenshot is a PNG");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot dir");
        }
        std::fs::write(path, png).expect("write screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = ureq::delete(&format!("{}/session/{}", self.base, self.session))
                .timeout(Duration::from_secs(10))
                .call();
        }
        // chromedriver and any Chromium it left behind are in the driver's process group.
        if let Ok(pgid) = libc::pid_t::try_from(self.driver.id()) {
            // SAFETY: kill(2) on the process group we created for our own child.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
        let _ = self.driver.wait();
    }
}

/// Standard base64 (with or without padding).
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' | b'\n' | b'\r' => continue,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_decodes() {
        assert_eq!(super::base64_decode("aGVsbG8=").unwrap(), b"hello");
        assert_eq!(super::base64_decode("aGk").unwrap(), b"hi");
        assert!(super::base64_decode("a*b").is_none());
    }
}
