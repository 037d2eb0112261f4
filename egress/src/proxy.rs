//! The per-sandbox egress proxy: a resolver on the host side of the sandbox's veth (UDP
//! port 53; nftables redirects every DNS packet the sandbox sends here) and a forwarder
//! (every TCP connection to a port a domain rule opens is redirected here). The forwarder
//! reads the name the client asks for (TLS server name or HTTP Host), and joins it to its
//! original destination only if that name is allowed on that port and the destination is
//! an address this resolver gave for it (its pins): a forged server name, a hard-coded
//! address or a name rebound to the host after the answer all fail. A protocol that names
//! no host reaches only pinned addresses of allowed names.
//!
//! Every decision goes to an aggregated, bounded log the runtime puts in the audit. The
//! proxy runs outside the sandbox as its own process; it ends when the sandbox's
//! directory does.

use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::dns::{self, Outcome};
use crate::rules::{AnswerFilter, Policy};
use crate::sniff::{first_bytes, Sniffed};
use crate::EgressError;

/// The port the forwarder listens on, on the host side of each sandbox's veth.
pub const FORWARD_PORT: u16 = 3129;
/// The most distinct log entries kept (more are counted in `dropped`).
const LOG_ENTRIES: usize = 1024;
/// The most names pinned, and addresses per name.
const PINNED_NAMES: usize = 4096;
const PINS_PER_NAME: usize = 64;
/// How long a client may take to say which host it wants.
const SNIFF_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What one sandbox's proxy serves, written by the runtime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProxyConfig {
    /// The host side of the sandbox's veth.
    pub listen: Ipv4Addr,
    pub dns_port: u16,
    pub forward_port: u16,
    pub policy: Policy,
    pub filter: AnswerFilter,
    /// Where the log of decisions is written (replaced whole, atomically).
    pub log: PathBuf,
    /// The proxy ends once this path is gone (the sandbox's directory).
    pub alive: PathBuf,
    /// The most connections forwarded at once.
    pub max_connections: usize,
}

/// One kind of decision, with how often and when it was made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    /// `dns` or `connect`.
    pub kind: String,
    /// The name asked for, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `address:port` of a connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination: Option<String>,
    pub allowed: bool,
    /// Why it was denied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub count: u64,
    /// Milliseconds since the epoch.
    pub first_ms: u64,
    pub last_ms: u64,
}

/// The proxy's log: entries in the order first seen.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressLog {
    pub entries: Vec<LogEntry>,
    /// Decisions not logged because the log was full.
    pub dropped: u64,
}

impl EgressLog {
    /// Reads a proxy's log; a missing one is empty.
    pub fn read(path: &Path) -> Result<EgressLog, EgressError> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| EgressError::BadLog {
                path: path.to_path_buf(),
                source: e,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(EgressLog::default()),
            Err(e) => Err(EgressError::Io {
                path: path.to_path_buf(),
                source: e,
            }),
        }
    }
}

/// Addresses the resolver gave, per name.
#[derive(Debug, Default)]
pub struct Pins(HashMap<String, BTreeSet<Ipv4Addr>>);

impl Pins {
    /// Adds `addrs` to `name`'s pins, within the bounds.
    pub fn pin(&mut self, name: &str, addrs: &[Ipv4Addr]) {
        if !self.0.contains_key(name) && self.0.len() >= PINNED_NAMES {
            return;
        }
        let set = self.0.entry(name.to_string()).or_default();
        for a in addrs {
            if set.len() < PINS_PER_NAME {
                set.insert(*a);
            }
        }
    }

    fn has(&self, name: &str, addr: Ipv4Addr) -> bool {
        self.0.get(name).is_some_and(|s| s.contains(&addr))
    }
}

/// Whether a connection to `dst` whose first bytes said `sniffed` goes through: the
/// allowed name it is for, or why not.
pub fn decide(
    policy: &Policy,
    pins: &Pins,
    sniffed: &Sniffed,
    dst: SocketAddrV4,
) -> Result<String, String> {
    let (ip, port) = (*dst.ip(), dst.port());
    if let Some(name) = sniffed.name() {
        if !policy.allows(name, port) {
            return Err(format!("{name} is not allowed on port {port}"));
        }
        if !pins.has(name, ip) {
            return Err(format!(
                "{ip} is not an address the resolver gave for {name}"
            ));
        }
        return Ok(name.to_string());
    }
    let mut names: Vec<&String> = pins
        .0
        .iter()
        .filter(|(n, addrs)| addrs.contains(&ip) && policy.allows(n, port))
        .map(|(n, _)| n)
        .collect();
    names.sort();
    names.first().map(|n| n.to_string()).ok_or_else(|| {
        format!("{ip}:{port} names no host and is no address the resolver gave for an allowed name")
    })
}

struct Shared {
    cfg: ProxyConfig,
    pins: Mutex<Pins>,
    log: Mutex<LogState>,
    active: AtomicUsize,
}

#[derive(Default)]
struct LogState {
    log: EgressLog,
    index: HashMap<(String, Option<String>, Option<String>, bool), usize>,
    dirty: bool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Shared {
    fn record(
        &self,
        kind: &str,
        name: Option<&str>,
        destination: Option<String>,
        denied: Option<String>,
    ) {
        let Ok(mut st) = self.log.lock() else {
            return;
        };
        let allowed = denied.is_none();
        let key = (
            kind.to_string(),
            name.map(str::to_string),
            destination.clone(),
            allowed,
        );
        let now = now_ms();
        if let Some(&i) = st.index.get(&key) {
            let e = &mut st.log.entries[i];
            e.count += 1;
            e.last_ms = now;
            st.dirty = true;
            return;
        }
        if st.log.entries.len() >= LOG_ENTRIES {
            st.log.dropped += 1;
            st.dirty = true;
            return;
        }
        let i = st.log.entries.len();
        st.log.entries.push(LogEntry {
            kind: kind.to_string(),
            name: name.map(str::to_string),
            destination,
            allowed,
            reason: denied,
            count: 1,
            first_ms: now,
            last_ms: now,
        });
        st.index.insert(key, i);
        // A destination seen for the first time is on disk at once.
        self.flush(&mut st);
    }

    fn flush(&self, st: &mut LogState) {
        let path = &self.cfg.log;
        let tmp = path.with_extension("tmp");
        let written = serde_json::to_vec(&st.log)
            .ok()
            .is_some_and(|bytes| std::fs::write(&tmp, bytes).is_ok());
        if written && std::fs::rename(&tmp, path).is_ok() {
            st.dirty = false;
        }
    }
}

/// A proxy with its sockets bound, not yet serving (so binding errors reach whoever
/// starts it before it goes to the background).
pub struct Proxy {
    dns: UdpSocket,
    forward: TcpListener,
    shared: Arc<Shared>,
}

impl Proxy {
    pub fn bind(cfg: ProxyConfig) -> Result<Proxy, EgressError> {
        let at = |port| SocketAddrV4::new(cfg.listen, port);
        let dns = UdpSocket::bind(at(cfg.dns_port)).map_err(|e| EgressError::Bind {
            addr: at(cfg.dns_port).to_string(),
            source: e,
        })?;
        let forward = TcpListener::bind(at(cfg.forward_port)).map_err(|e| EgressError::Bind {
            addr: at(cfg.forward_port).to_string(),
            source: e,
        })?;
        Ok(Proxy {
            dns,
            forward,
            shared: Arc::new(Shared {
                cfg,
                pins: Mutex::new(Pins::default()),
                log: Mutex::new(LogState::default()),
                active: AtomicUsize::new(0),
            }),
        })
    }

    /// Serves until the sandbox's directory is gone, then returns.
    pub fn serve(self) {
        let Proxy {
            dns,
            forward,
            shared,
        } = self;
        {
            let shared = shared.clone();
            std::thread::spawn(move || serve_dns(&dns, &shared));
        }
        {
            let shared = shared.clone();
            std::thread::spawn(move || {
                for conn in forward.incoming().flatten() {
                    if shared.active.fetch_add(1, Ordering::SeqCst) >= shared.cfg.max_connections {
                        shared.active.fetch_sub(1, Ordering::SeqCst);
                        shared.record(
                            "connect",
                            None,
                            None,
                            Some("too many connections at once".into()),
                        );
                        continue;
                    }
                    let shared = shared.clone();
                    std::thread::spawn(move || {
                        forward_one(conn, &shared);
                        shared.active.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            });
        }
        while shared.cfg.alive.exists() {
            std::thread::sleep(Duration::from_secs(1));
            if let Ok(mut st) = shared.log.lock() {
                if st.dirty {
                    shared.flush(&mut st);
                }
            }
        }
    }
}

fn serve_dns(sock: &UdpSocket, shared: &Shared) {
    let mut buf = [0u8; 1500];
    let mut resolve = |name: &str| -> Vec<Ipv4Addr> {
        std::net::ToSocketAddrs::to_socket_addrs(&(name, 0))
            .map(|it| {
                it.filter_map(|a| match a.ip() {
                    std::net::IpAddr::V4(v4) => Some(v4),
                    std::net::IpAddr::V6(_) => None,
                })
                .collect()
            })
            .unwrap_or_default()
    };
    loop {
        let Ok((n, from)) = sock.recv_from(&mut buf) else {
            continue;
        };
        let (reply, outcome) = dns::answer(
            &buf[..n],
            &shared.cfg.policy,
            &shared.cfg.filter,
            &mut resolve,
        );
        match outcome {
            Outcome::Answered { name, addrs } => {
                if let Ok(mut pins) = shared.pins.lock() {
                    pins.pin(&name, &addrs);
                }
                shared.record("dns", Some(&name), None, None);
            }
            Outcome::Denied { name } => {
                shared.record("dns", Some(&name), None, Some("no rule allows it".into()))
            }
            Outcome::Malformed => {}
        }
        if let Some(reply) = reply {
            let _ = sock.send_to(&reply, from);
        }
    }
}

/// Where the sandbox meant to connect, before nftables redirected it here.
fn original_destination(conn: &TcpStream) -> Option<SocketAddrV4> {
    let sa = nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::OriginalDst).ok()?;
    Some(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
        u16::from_be(sa.sin_port),
    ))
}

fn forward_one(mut conn: TcpStream, shared: &Shared) {
    let Some(dst) = original_destination(&conn) else {
        return;
    };
    let pinned = |sniffed: &Sniffed| match shared.pins.lock() {
        Ok(pins) => decide(&shared.cfg.policy, &pins, sniffed, dst),
        Err(_) => Err("internal: pins poisoned".into()),
    };
    // Any connection that can go through goes to a pinned address: one that is not is
    // refused before a byte is read. The rest is joined at once, so a server that speaks
    // first (SSH, SMTP) is heard without delay; the client's bytes are held until they
    // say which host they want.
    if let Err(why) = pinned(&Sniffed::Other) {
        shared.record("connect", None, Some(dst.to_string()), Some(why));
        return;
    }
    let upstream = match TcpStream::connect_timeout(&dst.into(), CONNECT_TIMEOUT) {
        Ok(u) => u,
        Err(e) => {
            shared.record(
                "connect",
                None,
                Some(dst.to_string()),
                Some(format!("unreachable: {e}")),
            );
            return;
        }
    };
    let (Ok(mut up_r), Ok(mut down_w)) = (upstream.try_clone(), conn.try_clone()) else {
        return;
    };
    let answering = std::thread::spawn(move || {
        let _ = std::io::copy(&mut up_r, &mut down_w);
        let _ = down_w.shutdown(Shutdown::Write);
    });
    let (first, sniffed) = first_bytes(SNIFF_TIMEOUT, |buf, left| {
        conn.set_read_timeout(Some(left))?;
        conn.read(buf)
    });
    match pinned(&sniffed) {
        Ok(name) => {
            shared.record("connect", Some(&name), Some(dst.to_string()), None);
            let _ = conn.set_read_timeout(None);
            let mut up_w = upstream;
            if up_w.write_all(&first).is_ok() {
                let _ = std::io::copy(&mut conn, &mut up_w);
            }
            let _ = up_w.shutdown(Shutdown::Write);
        }
        Err(why) => {
            shared.record("connect", sniffed.name(), Some(dst.to_string()), Some(why));
            let _ = upstream.shutdown(Shutdown::Both);
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
    let _ = answering.join();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_goes_through_only_for_an_allowed_name_at_its_pinned_address() {
        let policy = Policy::of(&[("pypi.org", 443), ("*.debian.org", 80)]).unwrap();
        let mut pins = Pins::default();
        let pypi = Ipv4Addr::new(151, 101, 0, 223);
        let deb = Ipv4Addr::new(199, 232, 0, 1);
        pins.pin("pypi.org", &[pypi]);
        pins.pin("deb.debian.org", &[deb]);
        let tls = |n: &str| Sniffed::Tls(Some(n.into()));
        let at = |ip, port| SocketAddrV4::new(ip, port);
        assert_eq!(
            decide(&policy, &pins, &tls("pypi.org"), at(pypi, 443)),
            Ok("pypi.org".into())
        );
        // A name not allowed, even at an allowed address (SNI of another site).
        assert!(decide(&policy, &pins, &tls("evil.net"), at(pypi, 443)).is_err());
        // An allowed name at an address the resolver did not give for it.
        assert!(decide(&policy, &pins, &tls("pypi.org"), at(deb, 443)).is_err());
        assert!(decide(
            &policy,
            &pins,
            &tls("pypi.org"),
            at(Ipv4Addr::new(127, 0, 0, 1), 443)
        )
        .is_err());
        // The right name on a port its rule does not open.
        assert!(decide(&policy, &pins, &tls("pypi.org"), at(pypi, 80)).is_err());
        // No name: only a pinned address of a name allowed on that port.
        assert_eq!(
            decide(&policy, &pins, &Sniffed::Other, at(deb, 80)),
            Ok("deb.debian.org".into())
        );
        assert!(decide(&policy, &pins, &Sniffed::Other, at(deb, 443)).is_err());
        assert!(decide(
            &policy,
            &pins,
            &Sniffed::Other,
            at(Ipv4Addr::new(1, 1, 1, 1), 80)
        )
        .is_err());
        assert_eq!(
            decide(
                &policy,
                &pins,
                &Sniffed::Http(Some("deb.debian.org".into())),
                at(deb, 80)
            ),
            Ok("deb.debian.org".into())
        );
    }

    #[test]
    fn pins_are_bounded() {
        let mut pins = Pins::default();
        for i in 0..PINNED_NAMES + 10 {
            pins.pin(&format!("n{i}.org"), &[Ipv4Addr::from(i as u32)]);
        }
        assert_eq!(pins.0.len(), PINNED_NAMES);
        let many: Vec<Ipv4Addr> = (0..200u32).map(Ipv4Addr::from).collect();
        pins.pin("n0.org", &many);
        assert_eq!(pins.0["n0.org"].len(), PINS_PER_NAME);
    }
}
