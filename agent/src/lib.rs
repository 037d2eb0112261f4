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
    /// To a VM guest's agent, once after boot (or after a template restore): mount these
    /// disks as the sandbox's root and enter it. Answered with `Ready`.
    GuestSetup(GuestSetup),
    /// After a VM is restored from a snapshot: set the clock, mix fresh entropy into the
    /// guest's pool. Answered with `Done`.
    Reseed {
        time_ns: u64,
        seed: Vec<u8>,
    },
    /// Answered with `FileFollows` and one data frame holding the bytes.
    ReadFile {
        path: String,
    },
    /// Followed by one data frame holding the bytes; answered with `Done`.
    WriteFile {
        path: String,
        mode: u32,
    },
    ListDir {
        path: String,
    },
    /// Budget counters inside a VM guest. Answered with `Stats`.
    Stats,
}

/// Where a VM guest finds its root: virtio disks named by serial number.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuestSetup {
    /// Layers, top-most first: the serial of the metadata image's disk and of the data
    /// blob's disk (none for a layer without file data).
    pub layers: Vec<(String, Option<String>)>,
    /// The serial of the writable disk (an ext4 image sized to the disk budget).
    pub upper: String,
    /// Directories to create in the upper before mounting the overlay (relative path,
    /// mode, uid, gid): the ones holding whiteouts, so overlayfs merges and hides them.
    pub merge_dirs: Vec<(String, u32, u32, u32)>,
    pub hostname: String,
    /// Memory and process budgets of the sandbox's commands (a cgroup inside the guest).
    pub memory_bytes: u64,
    pub pids: u32,
    /// The host's clock and fresh entropy (a restored guest has stale ones).
    pub time_ns: u64,
    pub seed: Vec<u8>,
    /// The allowlisted network, when the sandbox has one: the address of the guest's
    /// one interface (`10.0.2.15/24`) and the /etc/hosts lines naming its destinations.
    #[serde(default)]
    pub network: Option<GuestNetwork>,
    /// A full VM with a graphics card: load its display driver.
    #[serde(default)]
    pub display: bool,
    /// A whole disk image whose root filesystem is the bottom of the stack, under
    /// `layers` (the entry's base layer only carries the image).
    #[serde(default)]
    pub root_image: Option<GuestRootImage>,
}

/// The disk holding a guest's root image, and which of its partitions is the root.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuestRootImage {
    pub serial: String,
    /// 1-based; none: the first partition that mounts, else the whole disk.
    pub partition: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuestNetwork {
    pub address: String,
    pub prefix: u8,
    /// (address, host name) pairs for /etc/hosts.
    pub hosts: Vec<(String, String)>,
}

/// Budget counters of a VM guest's sandbox cgroup and upper disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct GuestStats {
    pub oom_kills: u64,
    pub pids_max_hits: u64,
    pub memory_bytes: u64,
    pub disk_used: u64,
    pub disk_size: u64,
}

/// One directory entry, as `ListDir` returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: String,
    pub size: u64,
    pub mode: u32,
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
        /// In a VM guest: the budget counters over the command's run (OOM kills and
        /// process-limit hits it caused) and the writable disk's use at its end, so the
        /// host needs no extra round trips to attribute budgets.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        guest: Option<GuestStats>,
    },
    Processes {
        list: Vec<ProcessEntry>,
    },
    Error {
        message: String,
    },
    /// A file's bytes follow in one data frame.
    FileFollows {
        mode: u32,
    },
    Entries {
        list: Vec<DirEntry>,
    },
    Stats(GuestStats),
    Done,
}

pub mod mux {
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

    #[test]
    fn envelopes_round_trip_and_reject_garbage() {
        let mut buf = Vec::new();
        mux::write(&mut buf, 7, mux::OPEN, b"").unwrap();
        mux::write(&mut buf, 7, mux::DATA, b"hello").unwrap();
        mux::write(&mut buf, 9, mux::CLOSE, b"").unwrap();
        let mut r = &buf[..];
        assert_eq!(mux::read(&mut r).unwrap(), Some((7, mux::OPEN, vec![])));
        assert_eq!(
            mux::read(&mut r).unwrap(),
            Some((7, mux::DATA, b"hello".to_vec()))
        );
        assert_eq!(mux::read(&mut r).unwrap(), Some((9, mux::CLOSE, vec![])));
        assert_eq!(mux::read(&mut r).unwrap(), None);
        let bad_kind = [0u8, 0, 0, 0, 9, 0, 0, 0, 0];
        assert!(mux::read(&mut &bad_kind[..]).is_err());
        let too_big = [0u8, 0, 0, 0, mux::DATA, 0xff, 0xff, 0, 0];
        assert!(mux::read(&mut &too_big[..]).is_err());
    }
}
