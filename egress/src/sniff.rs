//! The name a client asks for in the first bytes of a connection: the server name of a
//! TLS ClientHello (parsed by rustls) or the Host header of an HTTP/1 request (parsed by
//! httparse). Bytes from the sandbox: bounded, never trusted beyond the name they give.

use std::time::{Duration, Instant};

/// What the first bytes of a connection say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniffed {
    /// Not enough bytes yet to tell.
    Incomplete,
    /// A TLS ClientHello, with its server name if it sends one.
    Tls(Option<String>),
    /// An HTTP/1 request, with its Host (port removed) if it sends one.
    Http(Option<String>),
    /// Neither: a protocol that names no host.
    Other,
}

impl Sniffed {
    /// The name asked for, lower-case without a trailing dot.
    pub fn name(&self) -> Option<&str> {
        match self {
            Sniffed::Tls(n) | Sniffed::Http(n) => n.as_deref(),
            _ => None,
        }
    }
}

/// The most of a connection read before deciding (a ClientHello with many extensions, or
/// request headers, fit; a client sending more without naming a host is refused).
pub const SNIFF_MAX: usize = 16 << 10;

/// Reads a connection's first bytes with `read` (given the time left; an error, a timeout
/// included, or 0 ends it) until they say what they ask for, [`SNIFF_MAX`] of them, or
/// `within` passes (a client waiting for a server that speaks first names nothing): the
/// bytes, to be sent on, and what they said.
pub fn first_bytes(
    within: Duration,
    mut read: impl FnMut(&mut [u8], Duration) -> std::io::Result<usize>,
) -> (Vec<u8>, Sniffed) {
    let deadline = Instant::now() + within;
    let mut first = Vec::with_capacity(4096);
    let mut buf = [0u8; 4096];
    loop {
        let s = sniff(&first);
        if s != Sniffed::Incomplete {
            return (first, s);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if first.len() >= SNIFF_MAX || left.is_zero() {
            return (first, Sniffed::Other);
        }
        let want = buf.len().min(SNIFF_MAX - first.len());
        match read(&mut buf[..want], left) {
            Ok(0) | Err(_) => return (first, Sniffed::Other),
            Ok(n) => first.extend_from_slice(&buf[..n]),
        }
    }
}

/// Reads what `first` (the connection's first bytes so far) asks for.
pub fn sniff(first: &[u8]) -> Sniffed {
    let Some(&lead) = first.first() else {
        return Sniffed::Incomplete;
    };
    // A TLS handshake record: content type 22, version 3.x.
    if lead == 22 {
        if first.len() < 5 {
            return Sniffed::Incomplete;
        }
        if first[1] != 3 {
            return Sniffed::Other;
        }
        let mut acceptor = rustls::server::Acceptor::default();
        let mut input = first;
        while !input.is_empty() {
            if acceptor.read_tls(&mut input).is_err() {
                return Sniffed::Other;
            }
        }
        return match acceptor.accept() {
            Ok(Some(accepted)) => Sniffed::Tls(
                accepted
                    .client_hello()
                    .server_name()
                    .map(|n| n.trim_end_matches('.').to_ascii_lowercase()),
            ),
            Ok(None) => Sniffed::Incomplete,
            // rustls refuses hellos no real client sends (without signature algorithms,
            // say): such a connection names no host.
            Err(_) => Sniffed::Other,
        };
    }
    if lead.is_ascii_uppercase() {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        return match req.parse(first) {
            Ok(httparse::Status::Complete(_)) => Sniffed::Http(host_of(req.headers)),
            Ok(httparse::Status::Partial) => {
                // Headers so far may already name the host; wait for the rest anyway, so a
                // second Host header cannot follow the one checked.
                Sniffed::Incomplete
            }
            Err(_) => Sniffed::Other,
        };
    }
    Sniffed::Other
}

/// The one Host header's name, without its port; none if absent, repeated or not text.
fn host_of(headers: &[httparse::Header<'_>]) -> Option<String> {
    let mut hosts = headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("host"));
    let host = hosts.next()?;
    if hosts.next().is_some() {
        return None;
    }
    let value = std::str::from_utf8(host.value).ok()?.trim();
    let name = match value.rsplit_once(':') {
        Some((n, port)) if port.chars().all(|c| c.is_ascii_digit()) => n,
        _ => value,
    };
    Some(name.trim_end_matches('.').to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ClientHello as a TLS 1.3 client sends it for `name`.
    fn client_hello(name: &str) -> Vec<u8> {
        let mut sni = Vec::new();
        sni.extend_from_slice(&((name.len() + 3) as u16).to_be_bytes());
        sni.push(0);
        sni.extend_from_slice(&(name.len() as u16).to_be_bytes());
        sni.extend_from_slice(name.as_bytes());
        let mut ext = Vec::new();
        ext.extend_from_slice(&0u16.to_be_bytes());
        ext.extend_from_slice(&(sni.len() as u16).to_be_bytes());
        ext.extend_from_slice(&sni);
        // supported_versions: TLS 1.3; signature_algorithms: rsa_pss_rsae_sha256.
        ext.extend_from_slice(&[0, 43, 0, 3, 2, 3, 4]);
        ext.extend_from_slice(&[0, 13, 0, 4, 0, 2, 8, 4]);
        let mut body = vec![3, 3];
        body.extend_from_slice(&[7u8; 32]);
        body.push(0);
        body.extend_from_slice(&[0, 2, 0x13, 0x01]);
        body.extend_from_slice(&[1, 0]);
        body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
        body.extend_from_slice(&ext);
        let mut hs = vec![1];
        hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        let mut rec = vec![22, 3, 1];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn a_client_hello_gives_its_server_name() {
        let hello = client_hello("PyPI.org");
        assert_eq!(sniff(&hello), Sniffed::Tls(Some("pypi.org".into())));
        for cut in [1, 4, 5, 20, hello.len() - 1] {
            assert_eq!(sniff(&hello[..cut]), Sniffed::Incomplete, "{cut}");
        }
        let mut broken = hello.clone();
        broken[5] = 2; // not a ClientHello
        assert_eq!(sniff(&broken), Sniffed::Other);
    }

    #[test]
    fn first_bytes_stop_at_a_name_the_bound_or_the_end() {
        let req = b"GET / HTTP/1.1\r\nHost: a.org\r\n\r\nbody";
        let mut parts = req.chunks(7);
        let (got, said) = first_bytes(Duration::from_secs(5), |buf, _| {
            let part = parts.next().unwrap_or_default();
            buf[..part.len()].copy_from_slice(part);
            Ok(part.len())
        });
        assert_eq!(said, Sniffed::Http(Some("a.org".into())));
        assert!(
            got.len() >= req.len() - 4 && req.starts_with(&got),
            "{got:?}"
        );
        // A request line that never ends is read up to the bound, no further.
        let (got, said) = first_bytes(Duration::from_secs(5), |buf, _| {
            buf.fill(b'G');
            Ok(buf.len())
        });
        assert_eq!((got.len(), said), (SNIFF_MAX, Sniffed::Other));
        let (got, said) = first_bytes(Duration::from_secs(5), |_, _| {
            Err(std::io::ErrorKind::TimedOut.into())
        });
        assert_eq!((got.len(), said), (0, Sniffed::Other));
    }

    #[test]
    fn a_request_gives_its_one_host() {
        let req = b"GET /simple/ HTTP/1.1\r\nHost: Deb.Debian.org:80\r\nAccept: */*\r\n\r\n";
        assert_eq!(sniff(req), Sniffed::Http(Some("deb.debian.org".into())));
        assert_eq!(sniff(&req[..30]), Sniffed::Incomplete);
        let twice = b"GET / HTTP/1.1\r\nHost: a.org\r\nHost: b.org\r\n\r\n";
        assert_eq!(sniff(twice), Sniffed::Http(None));
        assert_eq!(sniff(b"GET / HTTP/1.0\r\n\r\n"), Sniffed::Http(None));
        assert_eq!(sniff(b"SSH-2.0-OpenSSH_9.2\r\n"), Sniffed::Other);
        assert_eq!(sniff(&[0u8, 1, 2]), Sniffed::Other);
        assert_eq!(sniff(b""), Sniffed::Incomplete);
    }
}
