//! Frames: a kind byte, a little-endian u32 length, the payload. Every length is checked
//! against [`MAX_FRAME`] before anything is allocated, since the peer may be hostile (a VM
//! guest's kernel is not trusted).

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Largest payload accepted in one frame.
pub const MAX_FRAME: usize = 16 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Control = 0,
    Stdout = 1,
    Stderr = 2,
    Stdin = 3,
    StdinEof = 4,
}

impl FrameKind {
    fn from_byte(b: u8) -> io::Result<FrameKind> {
        Ok(match b {
            0 => FrameKind::Control,
            1 => FrameKind::Stdout,
            2 => FrameKind::Stderr,
            3 => FrameKind::Stdin,
            4 => FrameKind::StdinEof,
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unknown frame kind {other}"),
                ))
            }
        })
    }
}

/// One decoded frame.
#[derive(Debug)]
pub enum Frame<M> {
    Control(M),
    Data(FrameKind, Vec<u8>),
}

pub fn write_frame(w: &mut impl Write, kind: FrameKind, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l as usize <= MAX_FRAME)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    let mut buf = Vec::with_capacity(5 + payload.len());
    buf.push(kind as u8);
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

pub fn write_control<M: Serialize>(w: &mut impl Write, msg: &M) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    write_frame(w, FrameKind::Control, &body)
}

/// Reads one frame; `Ok(None)` at a clean end of stream.
pub fn read_frame<M: for<'de> Deserialize<'de>>(r: &mut impl Read) -> io::Result<Option<Frame<M>>> {
    let mut head = [0u8; 5];
    match r.read_exact(&mut head[..1]) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    r.read_exact(&mut head[1..])?;
    let kind = FrameKind::from_byte(head[0])?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the {MAX_FRAME}-byte limit"),
        ));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok(Some(match kind {
        FrameKind::Control => Frame::Control(
            serde_json::from_slice(&payload)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?,
        ),
        k => Frame::Data(k, payload),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostMsg;

    #[test]
    fn frames_round_trip_and_reject_garbage() {
        let mut buf = Vec::new();
        write_control(&mut buf, &HostMsg::Signal { signal: 9 }).unwrap();
        write_frame(&mut buf, FrameKind::Stdin, b"abc").unwrap();
        write_frame(&mut buf, FrameKind::StdinEof, b"").unwrap();
        let mut r = &buf[..];
        assert!(matches!(
            read_frame::<HostMsg>(&mut r).unwrap(),
            Some(Frame::Control(HostMsg::Signal { signal: 9 }))
        ));
        match read_frame::<HostMsg>(&mut r).unwrap() {
            Some(Frame::Data(FrameKind::Stdin, d)) => assert_eq!(d, b"abc"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            read_frame::<HostMsg>(&mut r).unwrap(),
            Some(Frame::Data(FrameKind::StdinEof, _))
        ));
        assert!(read_frame::<HostMsg>(&mut r).unwrap().is_none());
        let bad = [9u8, 0, 0, 0, 0];
        assert!(read_frame::<HostMsg>(&mut &bad[..]).is_err());
        let huge = [0u8, 0xff, 0xff, 0xff, 0xff];
        assert!(read_frame::<HostMsg>(&mut &huge[..]).is_err());
        let not_json = [0u8, 2, 0, 0, 0, b'{', b'x'];
        assert!(read_frame::<HostMsg>(&mut &not_json[..]).is_err());
        assert!(write_frame(&mut Vec::new(), FrameKind::Stdout, &vec![0; MAX_FRAME + 1]).is_err());
    }
}
