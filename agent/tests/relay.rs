//! The VM relay (`strata-agent relay`) against a guest that lies (SECURITY.md, "a VM
//! guest's kernel": frames from the guest are parsed as untrusted). The test plays QEMU's
//! port with a hostile guest behind it and a host client in front: bytes forged for a
//! conversation the host never opened reach no one (within one VM every open conversation
//! is the guest's to answer: its kernel is trusted with its own commands' results), a
//! conversation sent past its window is ended rather than buffered, and an envelope out of
//! step ends the relay with a reason, every client seeing its connection end, never bytes
//! it was not sent.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use strata_agent_proto::mux;

struct Relay {
    child: Child,
    guest: UnixStream,
    listen: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

fn start() -> Relay {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (port, listen) = (dir.path().join("port.sock"), dir.path().join("agent.sock"));
    let qemu = UnixListener::bind(&port).expect("the port socket");
    let child = Command::new(env!("CARGO_BIN_EXE_strata-agent"))
        .args(["relay", "--port"])
        .arg(&port)
        .arg("--listen")
        .arg(&listen)
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the relay");
    let (guest, _) = qemu.accept().expect("the relay connects to the port");
    guest
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    wait_for(&listen);
    Relay {
        child,
        guest,
        listen,
        _dir: dir,
    }
}

/// Waits for the relay's socket without connecting (a connection is a conversation).
fn wait_for(p: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !p.exists() {
        assert!(Instant::now() < deadline, "the relay never listened");
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Relay {
    /// A host client's conversation: its socket and the number the relay gave it.
    fn client(&mut self) -> (UnixStream, u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let c = loop {
            match UnixStream::connect(&self.listen) {
                Ok(c) => break c,
                // Bound a moment before it listens.
                Err(e) => assert!(Instant::now() < deadline, "no client: {e}"),
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        loop {
            let (id, kind, _) = mux::read(&mut self.guest)
                .expect("an envelope")
                .expect("not the end");
            if kind == mux::OPEN {
                return (c, id);
            }
        }
    }

    fn send(&mut self, id: u32, kind: u8, data: &[u8]) {
        mux::write(&mut self.guest, id, kind, data).expect("writing to the relay");
    }
}

/// Everything readable on `c` until it ends or `limit` bytes came.
fn drain(c: &mut UnixStream, limit: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 64 << 10];
    while out.len() < limit {
        match c.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    out
}

#[test]
fn bytes_forged_for_another_conversation_reach_no_one() {
    let mut r = start();
    let (mut a, id) = r.client();
    // A conversation the host never opened, and a number near the real one.
    for forged in [id.wrapping_add(1), id.wrapping_sub(1), 0, u32::MAX] {
        r.send(forged, mux::DATA, b"{\"op\":\"exited\",\"code\":0}");
        r.send(forged, mux::CREDIT, &[0xff; 4]);
        r.send(forged, mux::CLOSE, b"");
    }
    r.send(id, mux::DATA, b"mine");
    r.send(id, mux::CLOSE, b"");
    assert_eq!(
        drain(&mut a, 1 << 20),
        b"mine",
        "the client got bytes not sent to it"
    );
    let _ = r.child.kill();
}

#[test]
fn a_conversation_sent_past_its_window_is_ended_not_buffered() {
    let mut r = start();
    let (mut a, id) = r.client();
    // The client reads nothing while the guest sends past the window.
    let piece = vec![b'x'; mux::MAX_PIECE];
    let sent = 4 * mux::WINDOW;
    for _ in 0..sent / mux::MAX_PIECE {
        r.send(id, mux::DATA, &piece);
    }
    // The relay answers with a CLOSE for it (after the client's credit, if any).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(
            Instant::now() < deadline,
            "no CLOSE for the flooded conversation"
        );
        let (got, kind, _) = mux::read(&mut r.guest).expect("envelope").expect("open");
        if got == id && kind == mux::CLOSE {
            break;
        }
    }
    // What reached the client: at most the window the relay held and what the client
    // socket's own buffer took, nowhere near what the guest sent.
    let held = drain(&mut a, 64 << 20);
    assert!(
        held.len() <= 2 * mux::WINDOW,
        "{} of {sent} bytes reached a client that read none while they came",
        held.len()
    );
    // Another conversation still works: the relay lives on.
    let (mut b, id2) = r.client();
    r.send(id2, mux::DATA, b"still here");
    r.send(id2, mux::CLOSE, b"");
    assert_eq!(drain(&mut b, 1 << 20), b"still here");
    let _ = r.child.kill();
}

#[test]
fn an_envelope_out_of_step_ends_the_relay_with_a_reason() {
    let mut r = start();
    let (mut a, id) = r.client();
    // A length past the largest piece, then the bytes a trusting reader would take as the
    // next frames.
    let mut head = Vec::new();
    head.extend_from_slice(&id.to_le_bytes());
    head.push(mux::DATA);
    head.extend_from_slice(&(u32::MAX).to_le_bytes());
    r.guest.write_all(&head).expect("writing");
    r.guest
        .write_all(b"{\"op\":\"exited\",\"code\":0}")
        .expect("writing");
    let status = r.child.wait().expect("the relay ends");
    let mut err = String::new();
    if let Some(mut e) = r.child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    assert!(!status.success(), "{status}: {err}");
    assert!(status.code().is_some(), "ended by a signal: {status}");
    assert!(err.contains("out of step"), "{err}");
    assert!(drain(&mut a, 1 << 20).is_empty(), "the client got bytes");
}
