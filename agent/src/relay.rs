//! `strata-agent relay --port SOCK --listen SOCK`: the host end of a VM's agent channel.
//!
//! QEMU offers the guest's virtio-serial port as one Unix-socket connection; the runtime
//! (any number of CLI processes at once) wants a connection per conversation, exactly as
//! with a function-call sandbox's agent. The relay holds the port's one connection and
//! accepts conversations on `--listen`, multiplexing them over the port. It exits when
//! QEMU closes the port (the VM is gone).
//!
//! `strata-agent connect HOST PORT` is the other host-side helper of a VM: QEMU runs it
//! for each connection the guest opens to an allowlisted destination, and it joins the
//! connection (its stdin and stdout) to that destination.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_agent_proto::mux;

pub fn main(args: &[String]) -> Result<(), String> {
    let (mut port, mut listen) = (None, None);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--port" => port = Some(PathBuf::from(value)),
            "--listen" => listen = Some(PathBuf::from(value)),
            other => return Err(format!("unknown option {other}")),
        }
    }
    let usage = "usage: strata-agent relay --port SOCK --listen SOCK";
    let (port, listen) = (port.ok_or(usage)?, listen.ok_or(usage)?);
    let deadline = Instant::now() + Duration::from_secs(30);
    let stream = loop {
        match strata_host::unix::connect(&port) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(format!("connecting to {}: {e}", port.display()))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let _ = std::fs::remove_file(&listen);
    let listener = strata_host::unix::bind(&listen)
        .map_err(|e| format!("listening on {}: {e}", listen.display()))?;
    let out = Arc::new(Mutex::new(
        stream.try_clone().map_err(|e| format!("port: {e}"))?,
    ));
    let conns: Arc<Mutex<HashMap<u32, mux::Conversation>>> = Arc::default();
    {
        let (out, conns) = (out.clone(), conns.clone());
        // Conversation numbers start somewhere new each time, so a guest restored from a
        // snapshot never confuses a new conversation with one it had in flight.
        let mut next = std::process::id().wrapping_mul(2_654_435_761);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                next = next.wrapping_add(1);
                let id = next;
                // Known before the guest hears of it: its answer may come back before
                // `join` returns, and one to a conversation not (yet) in the map is dropped
                // (a lost `welcome` once made the next frame look like the handshake's
                // answer, with 64 VMs on two cores). The reader takes the map, then the
                // port, as this does: no deadlock.
                let mut map = conns.lock().unwrap_or_else(|p| p.into_inner());
                {
                    let mut w = out.lock().unwrap_or_else(|p| p.into_inner());
                    if mux::write(&mut *w, id, mux::OPEN, b"").is_err() {
                        std::process::exit(0);
                    }
                }
                if let Ok(conv) = mux::join(id, client, out.clone()) {
                    map.insert(id, conv);
                }
            }
        });
    }
    let mut input = std::io::BufReader::with_capacity(256 << 10, stream);
    loop {
        match mux::read(&mut input) {
            // Bytes, credit or an end; a guest that breaks a conversation's flow control
            // has it ended here, not held in our memory.
            Ok(Some(envelope)) => {
                let mut conns = conns.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(id) = mux::dispatch(&mut conns, &*out, envelope) {
                    eprintln!("strata-agent relay: conversation {id}: the guest broke flow control; ended");
                }
            }
            // QEMU closed the port: the VM is gone, and so is every conversation.
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("port: {e}")),
        }
    }
}

/// `connect HOST PORT ADDR...`, the forwarder QEMU runs per guest connection to an
/// allowed name: reads what the guest's first bytes ask for (TLS server name or HTTP
/// Host; a guest that names another host is cut off), then joins stdin/stdout to a TCP
/// connection to one of ADDR (the name's addresses when the sandbox was made, so a name
/// rebound since reaches nothing new) on PORT, until either side ends.
pub fn connect(args: &[String]) -> Result<(), String> {
    use std::io::{Read, Write};
    let [host, port, addrs @ ..] = args else {
        return Err("usage: strata-agent connect HOST PORT ADDR...".into());
    };
    let port: u16 = port.parse().map_err(|_| format!("bad port {port}"))?;
    let addrs: Vec<std::net::SocketAddr> = addrs
        .iter()
        .map(|a| {
            a.parse::<std::net::Ipv4Addr>()
                .map(|ip| std::net::SocketAddr::from((ip, port)))
                .map_err(|_| format!("bad address {a}"))
        })
        .collect::<Result<_, _>>()?;
    // Joined at once, so a server that speaks first is heard without delay; the guest's
    // bytes are held until they say which host they want.
    let stream = addrs
        .iter()
        .find_map(|a| std::net::TcpStream::connect_timeout(a, Duration::from_secs(10)).ok())
        .ok_or_else(|| format!("cannot reach {host}:{port}"))?;
    let mut downstream = stream.try_clone().map_err(|e| e.to_string())?;
    let answering = std::thread::spawn(move || {
        let mut out = std::io::stdout().lock();
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n) = downstream.read(&mut buf) {
            if n == 0 || out.write_all(&buf[..n]).and_then(|()| out.flush()).is_err() {
                break;
            }
        }
        // The server is done: so is this connection, whatever the guest still holds open.
        std::process::exit(0);
    });
    let (first, sniffed) = strata_egress::sniff::first_bytes(Duration::from_secs(5), read_stdin);
    if let Some(name) = sniffed.name() {
        if !name.eq_ignore_ascii_case(host) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return Err(format!(
                "the guest asked for {name} on the forwarder of {host}:{port}: cut off"
            ));
        }
    }
    let mut upstream = stream;
    if upstream.write_all(&first).is_ok() {
        let mut stdin = std::io::stdin().lock();
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n) = stdin.read(&mut buf) {
            if n == 0 || upstream.write_all(&buf[..n]).is_err() {
                break;
            }
        }
    }
    let _ = upstream.shutdown(std::net::Shutdown::Write);
    let _ = answering.join();
    Ok(())
}

/// Up to `buf.len()` bytes of stdin within `left`, unbuffered (what follows stays on stdin
/// for the pump); a timeout is an error.
fn read_stdin(buf: &mut [u8], left: Duration) -> std::io::Result<usize> {
    use std::os::fd::AsFd;
    let stdin = std::io::stdin();
    let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
    let mut fds = [nix::poll::PollFd::new(
        stdin.as_fd(),
        nix::poll::PollFlags::POLLIN,
    )];
    if nix::poll::poll(&mut fds, ms)? == 0 {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    Ok(nix::unistd::read(stdin.as_fd(), buf)?)
}
