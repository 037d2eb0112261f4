//! Many conversations over one byte stream (a VM's virtio-serial port, which has no
//! notion of connections). Each envelope names a conversation and carries an opening,
//! a piece of its bytes, or its end; the bytes are ordinary frames, so both ends run
//! the same conversation code as over a Unix socket.

use std::io::{self, Read, Write};

pub const OPEN: u8 = 1;
pub const DATA: u8 = 2;
pub const CLOSE: u8 = 3;
/// Largest piece of a conversation carried in one envelope.
pub const MAX_PIECE: usize = 64 << 10;

/// One envelope: conversation, kind, bytes.
pub type Envelope = (u32, u8, Vec<u8>);

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

/// What the reader of the shared stream hands one conversation: its next bytes, or
/// `None` when the other end closed it.
pub type Inbox = std::sync::mpsc::Sender<Option<Vec<u8>>>;

/// Joins conversation `conn` to the local socket `stream`: bytes read from the socket
/// go out on the shared stream `out` as envelopes (and a `CLOSE` at its end); bytes
/// for it are written to the socket by a thread of its own, so one slow reader never
/// stalls the others sharing the stream. Returns where to deliver its bytes.
pub fn join<W: Write + Send + 'static>(
    conn: u32,
    stream: std::os::unix::net::UnixStream,
    out: std::sync::Arc<std::sync::Mutex<W>>,
) -> io::Result<Inbox> {
    let mut reader = stream.try_clone()?;
    let mut writer = stream;
    std::thread::spawn(move || {
        let mut buf = vec![0u8; MAX_PIECE];
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) | Err(_) => 0,
                Ok(n) => n,
            };
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
    let (tx, rx) = std::sync::mpsc::channel::<Option<Vec<u8>>>();
    std::thread::spawn(move || {
        while let Ok(Some(data)) = rx.recv() {
            if writer.write_all(&data).is_err() {
                break;
            }
        }
        let _ = writer.shutdown(std::net::Shutdown::Both);
    });
    Ok(tx)
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
    if !(OPEN..=CLOSE).contains(&kind) || len > MAX_PIECE {
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
}
