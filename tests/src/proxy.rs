//! A latency-injecting TCP proxy on loopback, for tests and benchmarks of a remote store: it
//! puts a configurable round-trip time and bandwidth cap between a client and a server
//! (radosgw), and can cut the link, partition it or corrupt response bodies on demand.
//!
//! The model: every byte the server sends reaches the client one RTT after the client's
//! bytes reached the proxy (the whole delay is applied on the way back, so one timer
//! rounding is paid per exchange, not two), a new connection pays one RTT for its
//! handshake, and all connections share one downstream link of the given bandwidth.
//! Queued data keeps its order: a response is delayed, never reordered.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

/// What the proxy adds between client and server.
#[derive(Debug, Clone, Copy, Default)]
pub struct Link {
    /// Added round-trip time per request (and per new connection).
    pub rtt: Duration,
    /// Server-to-client bytes per second shared by all connections; None: unlimited.
    pub bandwidth: Option<u64>,
}

#[derive(Default)]
struct Shared {
    rtt_us: AtomicU64,
    bandwidth: AtomicU64,
    down: AtomicBool,
    /// A partition: nothing passes and nobody is told.
    partitioned: AtomicBool,
    /// Response bodies still to corrupt (one byte flipped in each).
    corrupt: AtomicUsize,
    corrupted: AtomicUsize,
    /// Responses still to cut off halfway through their body (the connection then closed).
    truncate: AtomicUsize,
    truncated: AtomicUsize,
    /// Responses still to answer with a reset instead (RST, nothing of the response sent).
    reset: AtomicUsize,
    resets: AtomicUsize,
    connections: AtomicU64,
    bytes_down: AtomicU64,
    /// When the shared downstream link is next free (bandwidth cap).
    link_free: Mutex<Option<Instant>>,
}

impl Shared {
    fn rtt(&self) -> Duration {
        Duration::from_micros(self.rtt_us.load(Ordering::Relaxed))
    }

    /// Waits for a partition to heal.
    async fn healed(&self) {
        while self.partitioned.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A running proxy; stops (dropping every connection) when dropped.
pub struct LatencyProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LatencyProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`.
    pub fn start(upstream: SocketAddr, link: Link) -> std::io::Result<LatencyProxy> {
        let shared = Arc::new(Shared::default());
        let (stop, stopped) = watch::channel(false);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let mut proxy = LatencyProxy {
            addr,
            shared: shared.clone(),
            stop,
            thread: None,
        };
        proxy.set_link(link);
        proxy.thread = Some(
            std::thread::Builder::new()
                .name("latency-proxy".into())
                .spawn(move || rt.block_on(accept_loop(listener, upstream, shared, stopped)))?,
        );
        Ok(proxy)
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`, for an S3 endpoint.
    pub fn http_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set_link(&self, link: Link) {
        self.shared
            .rtt_us
            .store(link.rtt.as_micros() as u64, Ordering::Relaxed);
        self.shared
            .bandwidth
            .store(link.bandwidth.unwrap_or(0), Ordering::Relaxed);
    }

    /// An outage: while down, live connections are cut and new ones closed at once.
    pub fn set_down(&self, down: bool) {
        self.shared.down.store(down, Ordering::Relaxed);
    }

    /// A partition: while it lasts, new connections are accepted and nothing is forwarded
    /// either way, on them or on live ones, and nothing is closed: a request goes
    /// unanswered, as behind a dropped route. Once it heals, every connection that carried
    /// something during it is closed (what it carried was lost).
    pub fn set_partitioned(&self, partitioned: bool) {
        self.shared
            .partitioned
            .store(partitioned, Ordering::Relaxed);
    }

    /// Flips one byte in the body of each of the next `n` responses that have a body.
    pub fn corrupt_next(&self, n: usize) {
        self.shared.corrupt.store(n, Ordering::Relaxed);
    }

    /// Response bodies corrupted so far.
    pub fn corrupted(&self) -> usize {
        self.shared.corrupted.load(Ordering::Relaxed)
    }

    /// Cuts off each of the next `n` responses with a body halfway through it, then
    /// closes its connection: a truncated body.
    pub fn truncate_next(&self, n: usize) {
        self.shared.truncate.store(n, Ordering::Relaxed);
    }

    /// Responses truncated so far.
    pub fn truncated(&self) -> usize {
        self.shared.truncated.load(Ordering::Relaxed)
    }

    /// Answers each of the next `n` responses with a connection reset (RST) instead.
    pub fn reset_next(&self, n: usize) {
        self.shared.reset.store(n, Ordering::Relaxed);
    }

    /// Connections reset so far.
    pub fn resets(&self) -> usize {
        self.shared.resets.load(Ordering::Relaxed)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::Relaxed)
    }

    /// Bytes sent to clients so far.
    pub fn bytes_down(&self) -> u64 {
        self.shared.bytes_down.load(Ordering::Relaxed)
    }
}

impl Drop for LatencyProxy {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                shared.connections.fetch_add(1, Ordering::Relaxed);
                if shared.down.load(Ordering::Relaxed) {
                    drop(client);
                    continue;
                }
                if shared.partitioned.load(Ordering::Relaxed) {
                    let shared = shared.clone();
                    tasks.spawn(async move {
                        shared.healed().await;
                        drop(client);
                    });
                    continue;
                }
                tasks.spawn(connection(client, upstream, shared.clone()));
            }
        }
    }
    tasks.abort_all();
}

async fn connection(client: TcpStream, upstream: SocketAddr, shared: Arc<Shared>) {
    // The handshake's round trip.
    tokio::time::sleep(shared.rtt()).await;
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    // Acknowledge the server's segments at once, not after Linux's delayed-ACK wait: this
    // side only ever reads from it between requests, and a server whose socket still has
    // Nagle on (radosgw) would hold a response's second write for that ACK, 40 ms a
    // request that no real network adds. The kernel clears the flag, so it is set again
    // after every read.
    let quickack = |s: &tokio::net::tcp::OwnedReadHalf| {
        let _ = socket2::SockRef::from(s.as_ref()).set_tcp_quickack(true);
    };
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    quickack(&sr);
    // Client to server: forwarded at once, noting when each request's bytes arrived so
    // the answer is held until one RTT after that.
    let (arrived_tx, arrived_rx) = watch::channel(Instant::now());
    let up_shared = shared.clone();
    let up = async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if up_shared.down.load(Ordering::Relaxed) {
                break;
            }
            if up_shared.partitioned.load(Ordering::Relaxed) {
                up_shared.healed().await;
                break;
            }
            let _ = arrived_tx.send(Instant::now());
            if sw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = sw.shutdown().await;
    };
    let down = async move {
        let mut buf = vec![0u8; 64 << 10];
        let mut bodies = BodyTracker::default();
        let mut reset = false;
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            quickack(&sr);
            if shared.down.load(Ordering::Relaxed) {
                break;
            }
            if shared.partitioned.load(Ordering::Relaxed) {
                shared.healed().await;
                break;
            }
            let at = *arrived_rx.borrow() + shared.rtt();
            tokio::time::sleep_until(at).await;
            let data = &mut buf[..n];
            let (data, cut) = match bodies.feed(data, &shared) {
                Verdict::Pass => (data, false),
                Verdict::CutAt(at) => (&mut data[..at], true),
                Verdict::Reset => {
                    // SO_LINGER 0: the close sends RST rather than FIN.
                    let _ = socket2::SockRef::from(cw.as_ref()).set_linger(Some(Duration::ZERO));
                    reset = true;
                    break;
                }
            };
            let bw = shared.bandwidth.load(Ordering::Relaxed);
            if bw > 0 {
                let send_at = {
                    let mut free = shared.link_free.lock().unwrap_or_else(|p| p.into_inner());
                    let start = free.map_or(Instant::now(), |f| f.max(Instant::now()));
                    let done = start + Duration::from_secs_f64(n as f64 / bw as f64);
                    *free = Some(done);
                    done
                };
                tokio::time::sleep_until(send_at).await;
            }
            if cw.write_all(data).await.is_err() {
                break;
            }
            shared
                .bytes_down
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            if cut {
                break;
            }
        }
        // A reset closes without a FIN (a dropped write half would send one): the socket
        // closes when the read half goes too, with SO_LINGER 0 an RST.
        if reset {
            cw.forget();
        } else {
            let _ = cw.shutdown().await;
        }
    };
    // Either side ending ends the connection (as a reset would).
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// What to do with a piece of a response.
enum Verdict {
    Pass,
    /// Send this much of it, then close the connection.
    CutAt(usize),
    /// Reset the connection, sending none of it.
    Reset,
}

/// Follows HTTP/1.1 responses with a `Content-Length` through a connection, to corrupt a
/// byte inside a body, cut a body short or reset the connection, on request. A response it cannot follow (chunked, unparsable) ends
/// the tracking for that connection: its bytes pass untouched.
#[derive(Default)]
struct BodyTracker {
    head: Vec<u8>,
    /// Body bytes of the current response still to pass, and where in them to flip one.
    body_left: u64,
    flip_at: Option<u64>,
    /// Body bytes still to pass before the connection is cut.
    cut_after: Option<u64>,
    lost: bool,
}

/// Takes one from a counter of faults still to inject, if any is left.
fn take(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| c.checked_sub(1))
        .is_ok()
}

impl BodyTracker {
    fn feed(&mut self, data: &mut [u8], shared: &Shared) -> Verdict {
        let total = data.len();
        let mut pos = 0;
        while pos < total && !self.lost {
            let rest = &mut data[pos..];
            if self.body_left > 0 {
                let n = (self.body_left.min(rest.len() as u64)) as usize;
                if let Some(at) = self.flip_at {
                    if at < n as u64 {
                        rest[at as usize] ^= 0x5a;
                        self.flip_at = None;
                        shared.corrupted.fetch_add(1, Ordering::Relaxed);
                    } else {
                        self.flip_at = Some(at - n as u64);
                    }
                }
                if let Some(left) = self.cut_after {
                    if left <= n as u64 {
                        shared.truncated.fetch_add(1, Ordering::Relaxed);
                        return Verdict::CutAt(pos + left as usize);
                    }
                    self.cut_after = Some(left - n as u64);
                }
                self.body_left -= n as u64;
                pos += n;
                continue;
            }
            // In a response head: up to its blank line.
            let before = self.head.len();
            self.head.extend_from_slice(rest);
            let Some(end) = self.head.windows(4).position(|w| w == b"\r\n\r\n") else {
                if self.head.len() > 64 << 10 {
                    self.lost = true;
                }
                return Verdict::Pass;
            };
            let consumed = end + 4 - before;
            let head = String::from_utf8_lossy(&self.head[..end]).to_ascii_lowercase();
            self.head.clear();
            if head.contains("transfer-encoding: chunked") {
                self.lost = true;
                return Verdict::Pass;
            }
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0);
            if len > 0 && pos == 0 && before == 0 && take(&shared.reset) {
                shared.resets.fetch_add(1, Ordering::Relaxed);
                return Verdict::Reset;
            }
            pos += consumed;
            self.body_left = len;
            self.flip_at = None;
            self.cut_after = None;
            if len > 0 && take(&shared.corrupt) {
                self.flip_at = Some(len / 2);
            }
            if len > 1 && take(&shared.truncate) {
                self.cut_after = Some(len / 2);
            }
        }
        Verdict::Pass
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A one-shot HTTP server answering every request with `body`.
    fn server(body: &'static [u8]) -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        let head =
                            format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                        if s.write_all(head.as_bytes())
                            .and_then(|_| s.write_all(body))
                            .is_err()
                        {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    fn get(s: &mut std::net::TcpStream, len: usize) -> Vec<u8> {
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while out.len() < len {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "connection closed early");
            out.extend_from_slice(&buf[..n]);
        }
        out
    }

    #[test]
    fn adds_the_round_trip_and_corrupts_a_body_on_request() {
        let body = b"0123456789abcdef";
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
        let total = head.len() + body.len();
        let up = server(body);
        let proxy = LatencyProxy::start(
            up,
            Link {
                rtt: Duration::from_millis(20),
                bandwidth: None,
            },
        )
        .unwrap();
        let mut s = std::net::TcpStream::connect(proxy.addr()).unwrap();
        // The first answer pays the handshake too; later ones one RTT each.
        get(&mut s, total);
        let t = std::time::Instant::now();
        let plain = get(&mut s, total);
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(20), "{took:?}");
        assert!(plain.ends_with(body));

        proxy.corrupt_next(1);
        let bad = get(&mut s, total);
        assert_eq!(bad.len(), total);
        assert!(bad.starts_with(head.as_bytes()), "the head is left alone");
        assert_ne!(&bad[head.len()..], body);
        assert_eq!(proxy.corrupted(), 1);
        assert!(get(&mut s, total).ends_with(body), "only the next one");

        // Truncated: half the body, then the connection closes.
        proxy.truncate_next(1);
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut cut = Vec::new();
        let _ = s.read_to_end(&mut cut);
        assert_eq!(cut.len(), head.len() + body.len() / 2, "{cut:?}");
        assert_eq!(proxy.truncated(), 1);
        // Reset: nothing of the response, an RST.
        let mut s = std::net::TcpStream::connect(proxy.addr()).unwrap();
        get(&mut s, total);
        proxy.reset_next(1);
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut buf = [0u8; 64];
        let r = s.read(&mut buf);
        assert!(
            matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "{r:?}"
        );
        assert_eq!(proxy.resets(), 1);
        let mut s = std::net::TcpStream::connect(proxy.addr()).unwrap();

        // Down: the live connection is cut at its next exchange, new ones closed.
        proxy.set_down(true);
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut buf = [0u8; 64];
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)));
        let mut s2 = std::net::TcpStream::connect(proxy.addr()).unwrap();
        let _ = s2.write_all(b"GET / HTTP/1.1\r\n\r\n");
        assert!(matches!(s2.read(&mut buf), Ok(0) | Err(_)));
        proxy.set_down(false);
        let mut s3 = std::net::TcpStream::connect(proxy.addr()).unwrap();
        assert!(get(&mut s3, total).ends_with(body));

        // Partitioned: the live connection and a new one stay open and go unanswered;
        // once it heals, both are closed and a new connection is answered.
        proxy.set_partitioned(true);
        let mut s4 = std::net::TcpStream::connect(proxy.addr()).unwrap();
        for c in [&mut s3, &mut s4] {
            c.set_read_timeout(Some(Duration::from_millis(300)))
                .unwrap();
            c.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
            let e = c.read(&mut buf).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        }
        proxy.set_partitioned(false);
        for c in [&mut s3, &mut s4] {
            assert!(matches!(c.read(&mut buf), Ok(0) | Err(_)));
        }
        let mut s5 = std::net::TcpStream::connect(proxy.addr()).unwrap();
        assert!(get(&mut s5, total).ends_with(body));
    }
}
