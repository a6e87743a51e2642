//! A TCP proxy that injects network faults between a daemon and its database (issue 34 item 5,
//! the fault-injection harness): each accepted connection gets its own upstream connection and
//! two pump threads (one per direction). Modes:
//!
//! - [`Mode::Pass`]: bytes flow, after the configured latency ([`FaultProxy::set_latency`]);
//! - [`Mode::Pause`]: nothing is forwarded (the pumps hold what they read), sockets stay open,
//!   as in a partition; back to `Pass`, the held bytes flow on;
//! - [`Mode::Refuse`]: new connections are accepted and closed at once (live ones are kept);
//! - [`FaultProxy::drop_all`]: every live pair is closed now (both sides see a reset/EOF);
//! - [`FaultProxy::pause_port`]: one pair is paused as in `Pause`, found by the port its
//!   upstream socket has (what the server reports as the backend's `client_port`), so a test
//!   can freeze one connection of a daemon (say, its engine's, found in `pg_stat_activity`)
//!   and leave its others working.
//!
//! Loopback only. Dropping the proxy closes every connection and stops its threads.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward (after the latency).
    Pass,
    /// Forward nothing; keep every socket open.
    Pause,
    /// Close every new connection at once; live ones go on as in `Pass`.
    Refuse,
}

struct Pair {
    id: u64,
    client: TcpStream,
    upstream: TcpStream,
    closed: Arc<AtomicBool>,
}

struct Shared {
    mode: Mutex<Mode>,
    changed: Condvar,
    latency_ms: AtomicU64,
    pairs: Mutex<Vec<Pair>>,
    /// Upstream local ports of the pairs paused one by one ([`FaultProxy::pause_port`]).
    paused_ports: Mutex<std::collections::HashSet<u16>>,
    next_id: AtomicU64,
    stop: AtomicBool,
    accepted: AtomicU64,
}

/// A running proxy (see the module docs).
pub struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub fn start(upstream: SocketAddr) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            mode: Mutex::new(Mode::Pass),
            changed: Condvar::new(),
            latency_ms: AtomicU64::new(0),
            pairs: Mutex::new(Vec::new()),
            paused_ports: Mutex::new(std::collections::HashSet::new()),
            next_id: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
        });
        let s = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("fault-proxy-accept".into())
            .spawn(move || accept_loop(&listener, upstream, &s))?;
        Ok(FaultProxy {
            addr,
            upstream,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the proxy forwards to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Sets the mode (see [`Mode`]).
    pub fn set_mode(&self, mode: Mode) {
        *lock(&self.shared.mode) = mode;
        self.shared.changed.notify_all();
    }

    /// The current mode.
    pub fn mode(&self) -> Mode {
        *lock(&self.shared.mode)
    }

    /// Delays every forwarded chunk by `ms` (0: none).
    pub fn set_latency(&self, ms: u64) {
        self.shared.latency_ms.store(ms, Ordering::SeqCst);
    }

    /// Closes every live connection pair; returns how many there were.
    pub fn drop_all(&self) -> usize {
        let pairs: Vec<Pair> = std::mem::take(&mut *lock(&self.shared.pairs));
        for p in &pairs {
            close(p);
        }
        self.shared.changed.notify_all();
        pairs.len()
    }

    /// Live connection pairs.
    pub fn live(&self) -> usize {
        lock(&self.shared.pairs).len()
    }

    /// Connections accepted so far (refused ones included).
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Pauses the live pair whose upstream socket has local port `port` (both directions, as
    /// [`Mode::Pause`] does for all); `false` when no live pair has it. [`FaultProxy::heal`]
    /// lets it go on.
    pub fn pause_port(&self, port: u16) -> bool {
        let live = lock(&self.shared.pairs)
            .iter()
            .any(|p| p.upstream.local_addr().is_ok_and(|a| a.port() == port));
        if live {
            lock(&self.shared.paused_ports).insert(port);
        }
        live
    }

    /// Back to `Pass` without latency, no pair paused.
    pub fn heal(&self) {
        self.set_latency(0);
        lock(&self.shared.paused_ports).clear();
        self.set_mode(Mode::Pass);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.drop_all();
        // Wake the acceptor.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn close(p: &Pair) {
    p.closed.store(true, Ordering::SeqCst);
    let _ = p.client.shutdown(Shutdown::Both);
    let _ = p.upstream.shutdown(Shutdown::Both);
}

fn accept_loop(listener: &TcpListener, upstream: SocketAddr, shared: &Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = conn else { continue };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        if *lock(&shared.mode) == Mode::Refuse {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let Ok(up) = TcpStream::connect_timeout(&upstream, Duration::from_secs(3)) else {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = up.set_nodelay(true);
        let (Ok(c2), Ok(u2), Ok(c3), Ok(u3)) = (
            client.try_clone(),
            up.try_clone(),
            client.try_clone(),
            up.try_clone(),
        ) else {
            continue;
        };
        let closed = Arc::new(AtomicBool::new(false));
        let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
        let port = up.local_addr().map_or(0, |a| a.port());
        lock(&shared.pairs).push(Pair {
            id,
            client: c3,
            upstream: u3,
            closed: closed.clone(),
        });
        for (from, to) in [(client, u2), (up, c2)] {
            let s = shared.clone();
            let closed = closed.clone();
            let _ = std::thread::Builder::new()
                .name("fault-proxy-pump".into())
                .spawn(move || pump(from, to, &s, &closed, id, port));
        }
    }
}

/// Copies `from` to `to` chunk by chunk, holding each chunk while the proxy is paused and for
/// the latency; closes the pair when either side ends. `port`: the pair's upstream local port
/// (see [`FaultProxy::pause_port`]).
fn pump(
    mut from: TcpStream,
    mut to: TcpStream,
    shared: &Shared,
    closed: &AtomicBool,
    id: u64,
    port: u16,
) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        // Held while paused (the sockets stay open), released on Pass/Refuse or a close.
        {
            let paused =
                |mode: Mode| mode == Mode::Pause || lock(&shared.paused_ports).contains(&port);
            let mut mode = lock(&shared.mode);
            while paused(*mode) && !closed.load(Ordering::SeqCst) {
                mode = shared
                    .changed
                    .wait_timeout(mode, Duration::from_millis(200))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        }
        let ms = shared.latency_ms.load(Ordering::SeqCst);
        if ms > 0 {
            std::thread::sleep(Duration::from_millis(ms));
        }
        if closed.load(Ordering::SeqCst) || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    closed.store(true, Ordering::SeqCst);
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
    lock(&shared.pairs).retain(|p| p.id != id);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// An upstream that echoes every byte back.
    fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr");
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 || s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    fn connect(p: &FaultProxy) -> TcpStream {
        let s = TcpStream::connect(p.addr()).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s
    }

    /// Writes `held` through `s` and asserts that nothing comes back within 300 ms.
    fn assert_held(s: &mut TcpStream, what: &str) {
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        s.write_all(b"held").expect("write while paused");
        let mut buf = [0u8; 4];
        let r = s.read(&mut buf);
        assert!(
            matches!(&r, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
            "{what}: {r:?}"
        );
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
    }

    fn roundtrip(s: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        s.write_all(msg)?;
        let mut got = vec![0u8; msg.len()];
        s.read_exact(&mut got)?;
        Ok(got)
    }

    /// Each mode does what it says: pass echoes, latency delays by at least its value, pause
    /// holds the bytes with the socket open and releases them on pass, drop-all closes live
    /// connections, refuse closes new ones and keeps live ones.
    #[test]
    fn the_proxy_passes_pauses_drops_refuses_and_delays() {
        let p = FaultProxy::start(echo_server()).expect("proxy");
        let mut a = connect(&p);
        assert_eq!(roundtrip(&mut a, b"hello").expect("pass"), b"hello");
        assert_eq!(p.live(), 1);

        p.set_latency(150);
        let t = Instant::now();
        assert_eq!(roundtrip(&mut a, b"slow").expect("latency"), b"slow");
        // Two directions, each delayed: a lower bound of the injected delay, not a timing
        // measurement of the machine.
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
        p.set_latency(0);

        p.set_mode(Mode::Pause);
        assert_held(&mut a, "nothing comes back while paused");
        assert_eq!(p.live(), 1, "the socket stays open while paused");
        p.set_mode(Mode::Pass);
        let mut buf = [0u8; 4];
        a.read_exact(&mut buf).expect("released on pass");
        assert_eq!(&buf, b"held");

        p.set_mode(Mode::Refuse);
        let mut refused = connect(&p);
        let mut one = [0u8; 1];
        let r = refused
            .write_all(b"x")
            .and_then(|()| refused.read(&mut one));
        assert!(
            matches!(r, Ok(0) | Err(_)),
            "a new connection is closed: {r:?}"
        );
        assert_eq!(
            roundtrip(&mut a, b"live").expect("a live connection goes on"),
            b"live"
        );
        p.set_mode(Mode::Pass);

        assert_eq!(p.drop_all(), 1);
        let r = a.write_all(b"x").and_then(|()| a.read(&mut one));
        assert!(matches!(r, Ok(0) | Err(_)), "dropped: {r:?}");
        let mut b = connect(&p);
        assert_eq!(
            roundtrip(&mut b, b"again").expect("new after drop"),
            b"again"
        );
        assert!(p.accepted() >= 3);
    }

    /// `pause_port` holds one pair (found by its upstream port, as the echo server sees the
    /// peer) while another goes on; `heal` releases it.
    #[test]
    fn one_connection_is_paused_by_its_upstream_port() {
        let p = FaultProxy::start(echo_server()).expect("proxy");
        let mut a = connect(&p);
        let mut b = connect(&p);
        assert_eq!(roundtrip(&mut a, b"a").expect("a"), b"a");
        assert_eq!(roundtrip(&mut b, b"b").expect("b"), b"b");
        let ports: Vec<u16> = lock(&p.shared.pairs)
            .iter()
            .map(|pair| pair.upstream.local_addr().expect("addr").port())
            .collect();
        assert_eq!(ports.len(), 2);
        assert!(!p.pause_port(1), "no pair has port 1");
        // The first pair accepted is `a`'s.
        assert!(p.pause_port(ports[0]));
        assert_held(&mut a, "the paused pair forwards nothing");
        assert_eq!(roundtrip(&mut b, b"goes").expect("b goes on"), b"goes");
        p.heal();
        let mut buf = [0u8; 4];
        a.read_exact(&mut buf).expect("released by heal");
        assert_eq!(&buf, b"held");
    }
}
