//! The host–agent protocol, shared by the runtime (client) and the agent (server).
//!
//! One connection carries one conversation (a ping, one exec, a process listing). The byte
//! stream is a sequence of frames: a kind byte, a little-endian u32 length, the payload.
//! Control frames carry JSON ([`HostMsg`] / [`AgentMsg`]); data frames carry raw stdin,
//! stdout or stderr bytes, so output is never re-encoded. The same framing runs over a Unix
//! socket (function-call sandboxes) and a virtio-serial port (VMs).

use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

/// Bumped when a message changes incompatibly; the host checks it on `Ping`.
pub const PROTOCOL_VERSION: u32 = 1;
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

/// What to run inside the sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    /// Whether the host streams stdin; otherwise the command reads /dev/null.
    pub stdin: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum HostMsg {
    Ping,
    /// To a pooled agent (started with `--pooled`, waiting in its cgroups): enter this root
    /// and start serving. Answered with `Ready`.
    Setup {
        rootfs: String,
        hostname: String,
        /// A network namespace to join; none means a fresh, empty one.
        netns: Option<String>,
    },
    Exec(ExecSpec),
    /// Signals the running command's process group.
    Signal {
        signal: i32,
    },
    Ps,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessEntry {
    pub pid: u32,
    pub ppid: u32,
    pub state: String,
    pub rss_bytes: u64,
    pub cmdline: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum AgentMsg {
    Pong {
        version: u32,
        pid: u32,
    },
    Ready,
    Started {
        pid: u32,
    },
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    Processes {
        list: Vec<ProcessEntry>,
    },
    Error {
        message: String,
    },
}

pub mod policy {
    //! The confinement every sandbox gets, whichever backend builds it: the capabilities it
    //! keeps and the syscalls it is refused. One list, so fncall and containers agree.

    /// The usual container set, without MKNOD and NET_RAW (no raw-socket network scans).
    pub const KEPT_CAPS: &[(&str, u32)] = &[
        ("CAP_CHOWN", 0),
        ("CAP_DAC_OVERRIDE", 1),
        ("CAP_FOWNER", 3),
        ("CAP_FSETID", 4),
        ("CAP_KILL", 5),
        ("CAP_SETGID", 6),
        ("CAP_SETUID", 7),
        ("CAP_SETPCAP", 8),
        ("CAP_NET_BIND_SERVICE", 10),
        ("CAP_SYS_CHROOT", 18),
    ];

    /// Syscalls no sandboxed process needs that widen the attack surface or undo the
    /// confinement; refused with EPERM.
    pub const DENIED_SYSCALLS: &[(&str, libc::c_long)] = &[
        ("mount", libc::SYS_mount),
        ("umount2", libc::SYS_umount2),
        ("pivot_root", libc::SYS_pivot_root),
        ("kexec_load", libc::SYS_kexec_load),
        ("kexec_file_load", libc::SYS_kexec_file_load),
        ("init_module", libc::SYS_init_module),
        ("finit_module", libc::SYS_finit_module),
        ("delete_module", libc::SYS_delete_module),
        ("bpf", libc::SYS_bpf),
        ("perf_event_open", libc::SYS_perf_event_open),
        ("keyctl", libc::SYS_keyctl),
        ("add_key", libc::SYS_add_key),
        ("request_key", libc::SYS_request_key),
        ("unshare", libc::SYS_unshare),
        ("setns", libc::SYS_setns),
        ("swapon", libc::SYS_swapon),
        ("swapoff", libc::SYS_swapoff),
        ("reboot", libc::SYS_reboot),
        ("open_by_handle_at", libc::SYS_open_by_handle_at),
        ("name_to_handle_at", libc::SYS_name_to_handle_at),
        ("userfaultfd", libc::SYS_userfaultfd),
        ("acct", libc::SYS_acct),
        ("settimeofday", libc::SYS_settimeofday),
        ("clock_settime", libc::SYS_clock_settime),
        ("clock_adjtime", libc::SYS_clock_adjtime),
        ("adjtimex", libc::SYS_adjtimex),
        ("iopl", libc::SYS_iopl),
        ("ioperm", libc::SYS_ioperm),
        ("quotactl", libc::SYS_quotactl),
        ("syslog", libc::SYS_syslog),
        ("vhangup", libc::SYS_vhangup),
        ("fsopen", libc::SYS_fsopen),
        ("fsmount", libc::SYS_fsmount),
        ("fsconfig", libc::SYS_fsconfig),
        ("move_mount", libc::SYS_move_mount),
        ("open_tree", libc::SYS_open_tree),
        ("mount_setattr", libc::SYS_mount_setattr),
    ];
}

/// A process's command line from /proc, arguments joined by spaces.
pub fn proc_cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .trim_end_matches('\0')
                .replace('\0', " ")
        })
        .unwrap_or_default()
}

/// One decoded frame.
#[derive(Debug)]
pub enum Frame<M> {
    Control(M),
    Data(FrameKind, Vec<u8>),
}

pub fn write_frame(w: &mut impl Write, kind: FrameKind, payload: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 5];
    head[0] = kind as u8;
    let len = u32::try_from(payload.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    head[1..].copy_from_slice(&len.to_le_bytes());
    w.write_all(&head)?;
    w.write_all(payload)?;
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
    }
}
