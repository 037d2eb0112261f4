//! Many conversations over one byte stream (a VM's virtio-serial port, which has no
//! notion of connections). Each envelope names a conversation and carries an opening,
//! a piece of its bytes, credit for more, or its end; the bytes are ordinary frames, so
//! both ends run the same conversation code as over a Unix socket.
//!
//! Flow control is per conversation and direction: a side sends at most [`WINDOW`] bytes
//! the other has not yet passed on, and the other grants more (`CREDIT`) as it writes
//! them to its socket. So one slow reader holds up only its own conversation, and a peer
//! that sends past its window (a hostile guest) has the conversation ended instead of
//! growing the other side's memory.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

pub const OPEN: u8 = 1;
pub const DATA: u8 = 2;
pub const CLOSE: u8 = 3;
/// Four bytes (little-endian): how many more bytes the sender of this envelope takes.
pub const CREDIT: u8 = 4;
/// A new host on the stream (conversation 0, no bytes): the first envelope every host
/// end sends. It knows no conversation from before it, so the guest ends every one it
/// had (a restored machine's, or those of a host that went away). The guest does not
/// take the port's end-of-file for that: a guest kernel reports "no host" whenever its
/// last word from QEMU says so, and that word travels apart from the data (Linux handles
/// virtio-serial control messages in a work queue), so a loaded guest can read a host's
/// request and then an end-of-file while the same host is waiting for the answer.
pub const SYNC: u8 = 5;
/// Largest piece of a conversation carried in one envelope.
pub const MAX_PIECE: usize = 64 << 10;
/// The most bytes of one conversation in flight in one direction: sent, and not yet
/// written to the receiver's socket.
pub const WINDOW: usize = 1 << 20;

/// One envelope: conversation, kind, bytes.
pub type Envelope = (u32, u8, Vec<u8>);

/// Starts a host's session on the stream (see [`SYNC`]).
pub fn start_session(w: &mut impl Write) -> io::Result<()> {
    write(w, 0, SYNC, b"")
}

pub fn write(w: &mut impl Write, conn: u32, kind: u8, data: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 9];
    head[..4].copy_from_slice(&conn.to_le_bytes());
    head[4] = kind;
    head[5..].copy_from_slice(&(data.len() as u32).to_le_bytes());
    let mut buf = Vec::with_capacity(9 + data.len());
    buf.extend_from_slice(&head);
    buf.extend_from_slice(data);
    w.write_all(&buf)?;
    w.flush()
}

/// How much a conversation may still send, and whether it ended.
#[derive(Default)]
struct Credit {
    bytes: Mutex<(usize, bool)>,
    more: Condvar,
}

impl Credit {
    /// Waits for credit; how much there is, or `None` once the conversation ended.
    fn wait(&self) -> Option<usize> {
        let mut g = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match *g {
                (_, true) => return None,
                (0, false) => g = self.more.wait(g).unwrap_or_else(|p| p.into_inner()),
                (n, false) => return Some(n),
            }
        }
    }

    fn take(&self, n: usize) {
        let mut g = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        g.0 = g.0.saturating_sub(n);
    }

    fn grant(&self, n: usize) {
        let mut g = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        g.0 = (g.0 + n).min(WINDOW);
        self.more.notify_all();
    }

    fn end(&self) {
        self.bytes.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        self.more.notify_all();
    }
}

/// One conversation, as the reader of the shared stream sees it: where the peer's bytes
/// for it go, and where the peer's credit for it goes.
pub struct Conversation {
    to_socket: std::sync::mpsc::Sender<Option<Vec<u8>>>,
    /// Bytes handed over and not yet written to the socket.
    held: Arc<AtomicUsize>,
    credit: Arc<Credit>,
}

impl Conversation {
    /// Passes on bytes the peer sent. `false` when the peer sent past its window: the
    /// caller ends the conversation (see [`Conversation::end`]).
    #[must_use]
    pub fn deliver(&self, data: Vec<u8>) -> bool {
        let n = data.len();
        if self.held.fetch_add(n, Ordering::SeqCst) + n > WINDOW {
            return false;
        }
        let _ = self.to_socket.send(Some(data));
        true
    }

    /// Takes a `CREDIT` envelope's bytes; `false` when they are not four.
    #[must_use]
    pub fn credit(&self, data: &[u8]) -> bool {
        match <[u8; 4]>::try_from(data) {
            Ok(b) => {
                self.credit.grant(u32::from_le_bytes(b) as usize);
                true
            }
            Err(_) => false,
        }
    }

    /// The conversation is over (the peer closed it, or broke its rules): the socket is
    /// shut once what was handed over is written, and nothing more is sent.
    pub fn end(self) {
        self.credit.end();
        let _ = self.to_socket.send(None);
    }
}

/// Hands an envelope other than an opening to its conversation in `conns`: bytes,
/// credit, or its end. When the peer broke the conversation's rules (sent past its
/// window, or credit that is not a count) the conversation ends here, the peer is sent a
/// `CLOSE`, and its number is returned for the log.
pub fn dispatch<W: Write>(
    conns: &mut HashMap<u32, Conversation>,
    out: &Mutex<W>,
    (id, kind, data): Envelope,
) -> Option<u32> {
    let kept = match conns.get(&id) {
        Some(conv) if kind == DATA => conv.deliver(data),
        Some(conv) if kind == CREDIT => conv.credit(&data),
        Some(_) => {
            if let Some(conv) = conns.remove(&id) {
                conv.end();
            }
            true
        }
        None => true,
    };
    if kept {
        return None;
    }
    if let Some(conv) = conns.remove(&id) {
        conv.end();
    }
    let mut w = out.lock().unwrap_or_else(|p| p.into_inner());
    let _ = write(&mut *w, id, CLOSE, b"");
    Some(id)
}

/// Joins conversation `conn` to the local socket `stream`: bytes read from the socket
/// go out on the shared stream `out` as envelopes (and a `CLOSE` at its end) as the
/// peer's credit allows; bytes for it are written to the socket by a thread of its own,
/// which grants the peer credit for each piece written.
pub fn join<W: Write + Send + 'static>(
    conn: u32,
    stream: std::os::unix::net::UnixStream,
    out: Arc<Mutex<W>>,
) -> io::Result<Conversation> {
    let mut reader = stream.try_clone()?;
    let mut writer = stream;
    let credit = Arc::new(Credit {
        bytes: Mutex::new((WINDOW, false)),
        more: Condvar::new(),
    });
    let held = Arc::new(AtomicUsize::new(0));
    {
        let (out, credit) = (out.clone(), credit.clone());
        std::thread::spawn(move || {
            let mut buf = vec![0u8; MAX_PIECE];
            loop {
                let n = match credit.wait() {
                    None => return,
                    Some(c) => match reader.read(&mut buf[..c.min(MAX_PIECE)]) {
                        Ok(0) | Err(_) => 0,
                        Ok(n) => n,
                    },
                };
                credit.take(n);
                let mut w = out.lock().unwrap_or_else(|p| p.into_inner());
                let sent = if n == 0 {
                    write(&mut *w, conn, CLOSE, b"")
                } else {
                    write(&mut *w, conn, DATA, &buf[..n])
                };
                if n == 0 || sent.is_err() {
                    return;
                }
            }
        });
    }
    let (tx, rx) = std::sync::mpsc::channel::<Option<Vec<u8>>>();
    {
        let held = held.clone();
        std::thread::spawn(move || {
            while let Ok(Some(data)) = rx.recv() {
                if writer.write_all(&data).is_err() {
                    break;
                }
                held.fetch_sub(data.len(), Ordering::SeqCst);
                let grant = (data.len() as u32).to_le_bytes();
                let mut w = out.lock().unwrap_or_else(|p| p.into_inner());
                if write(&mut *w, conn, CREDIT, &grant).is_err() {
                    break;
                }
            }
            let _ = writer.shutdown(std::net::Shutdown::Both);
        });
    }
    Ok(Conversation {
        to_socket: tx,
        held,
        credit,
    })
}

/// The next envelope; `Ok(None)` at end of stream.
pub fn read(r: &mut impl Read) -> io::Result<Option<Envelope>> {
    let mut head = [0u8; 9];
    match r.read_exact(&mut head[..1]) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    r.read_exact(&mut head[1..])?;
    let conn = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    let kind = head[4];
    let len = u32::from_le_bytes([head[5], head[6], head[7], head[8]]) as usize;
    if !(OPEN..=SYNC).contains(&kind) || len > MAX_PIECE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad envelope (kind {kind}, {len} bytes): the stream is out of step"),
        ));
    }
    let mut data = vec![0u8; len];
    r.read_exact(&mut data)?;
    Ok(Some((conn, kind, data)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip_and_reject_garbage() {
        let mut buf = Vec::new();
        write(&mut buf, 7, OPEN, b"").unwrap();
        write(&mut buf, 7, DATA, b"hello").unwrap();
        write(&mut buf, 9, CLOSE, b"").unwrap();
        let mut r = &buf[..];
        assert_eq!(read(&mut r).unwrap(), Some((7, OPEN, vec![])));
        assert_eq!(read(&mut r).unwrap(), Some((7, DATA, b"hello".to_vec())));
        assert_eq!(read(&mut r).unwrap(), Some((9, CLOSE, vec![])));
        assert_eq!(read(&mut r).unwrap(), None);
        let bad_kind = [0u8, 0, 0, 0, 9, 0, 0, 0, 0];
        assert!(read(&mut &bad_kind[..]).is_err());
        let too_big = [0u8, 0, 0, 0, DATA, 0xff, 0xff, 0, 0];
        assert!(read(&mut &too_big[..]).is_err());
    }

    /// What went out on the shared stream, by kind: data bytes, credit granted, closes.
    fn sent(out: &Mutex<Vec<u8>>) -> (usize, usize, usize) {
        let buf = out.lock().unwrap().clone();
        let mut r = &buf[..];
        let (mut data, mut credit, mut closes) = (0, 0, 0);
        while let Some((_, kind, bytes)) = read(&mut r).unwrap() {
            match kind {
                DATA => data += bytes.len(),
                CREDIT => credit += u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize,
                CLOSE => closes += 1,
                _ => {}
            }
        }
        (data, credit, closes)
    }

    fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !f() {
            assert!(std::time::Instant::now() < deadline, "never: {what}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    #[test]
    fn a_conversation_sends_within_its_window_and_a_peer_past_it_is_cut_off() {
        use std::os::unix::net::UnixStream;
        let out = Arc::new(Mutex::new(Vec::new()));
        let (local, ours) = UnixStream::pair().unwrap();
        let conv = join(5, ours, out.clone()).unwrap();
        // The local side has 3 MiB to send: one window goes out, then it waits.
        let mut writer = local.try_clone().unwrap();
        std::thread::spawn(move || {
            let _ = writer.write_all(&vec![7u8; 3 << 20]);
        });
        until("a window sent", || sent(&out).0 == WINDOW);
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(sent(&out).0, WINDOW, "sent past the window without credit");
        // Credit for one piece lets one more piece out.
        assert!(conv.credit(&(MAX_PIECE as u32).to_le_bytes()));
        until("a credited piece sent", || {
            sent(&out).0 == WINDOW + MAX_PIECE
        });
        assert!(!conv.credit(b"xx"), "credit that is not four bytes");
        // Bytes for the local side are written to it and credited back, as they are.
        let mut reader = local.try_clone().unwrap();
        assert!(conv.deliver(b"hello".to_vec()));
        let mut got = [0u8; 5];
        reader.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
        until("credit for what was written", || sent(&out).1 == 5);
        // A peer that sends past its window while the local side reads nothing: the
        // conversation is ended and the peer told so.
        let mut conns = HashMap::from([(5, conv)]);
        let closes = sent(&out).2;
        let mut cut = None;
        for _ in 0..(2 * WINDOW / MAX_PIECE) {
            cut = dispatch(&mut conns, &out, (5, DATA, vec![0u8; MAX_PIECE]));
            if cut.is_some() {
                break;
            }
        }
        assert_eq!(
            cut,
            Some(5),
            "took more than a window the local side never read"
        );
        assert!(conns.is_empty());
        until("a close sent", || sent(&out).2 > closes);
        // Envelopes of conversations that are gone are dropped.
        assert_eq!(dispatch(&mut conns, &out, (9, DATA, b"x".to_vec())), None);
    }
}
