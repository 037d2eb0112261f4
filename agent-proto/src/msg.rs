//! The typed messages of a conversation: what the host asks ([`HostMsg`]) and what the
//! agent answers ([`AgentMsg`]). Failures carry an [`ErrorKind`] code, so the host branches
//! on the code and never on the wording of a message.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What to run inside the sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecSpec {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    /// Whether the host streams stdin; otherwise the command reads /dev/null.
    pub stdin: bool,
}

/// How the runtime starts a function-call sandbox's agent (`strata-agent sandbox`): this,
/// as JSON on the agent's stdin, so nothing of the host's layout is in its command line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxBoot {
    /// The assembled root to pivot into; none for a pooled agent, which gets it with
    /// `Setup`.
    pub rootfs: Option<String>,
    /// Where to listen, in the host's view (bound before the pivot).
    pub socket: String,
    pub hostname: String,
    /// A network namespace to join instead of a fresh, empty one.
    pub netns: Option<String>,
    /// The key (hex) every conversation must prove (a pooled agent's: its slot's).
    pub key: String,
    /// The size of /dev/shm ([`crate::policy::shm_bytes`] of the memory budget); none:
    /// 64 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_bytes: Option<u64>,
    /// A descriptor of the host's launch mount namespace (one without any sandbox's
    /// mounts, see `strata_host::mountns`) the agent inherited: it enters a copy of it,
    /// carrying its root in, instead of copying the host's whole mount table. None: it
    /// copies the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mountns_fd: Option<i32>,
}

/// The first frame of every conversation (see [`crate::handshake`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u32,
    /// Fresh random bytes (hex) the agent's proof covers.
    pub nonce: String,
    /// The host's proof of the sandbox key over the nonce (hex); empty when the host has
    /// no key yet (a VM guest before its setup).
    pub proof: String,
}

/// To a pooled agent (started ahead of time, waiting in its cgroups): enter this root and
/// start serving. Answered with `Ready`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolSetup {
    pub rootfs: String,
    pub hostname: String,
    /// A network namespace to join; none means a fresh, empty one.
    pub netns: Option<String>,
    /// The sandbox's own key (hex), which replaces the pool slot's from now on.
    pub key: String,
    /// The size of /dev/shm, as in [`SandboxBoot`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_bytes: Option<u64>,
}

/// After a VM is restored from a snapshot: set the clock, mix fresh entropy into the
/// guest's pool, and take the new sandbox's key. Answered with `Done`. A restored
/// container's agent (which shares the host's clock and pool) takes only the key: sent
/// with no seed and no host name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reseed {
    pub time_ns: u64,
    pub seed: Vec<u8>,
    pub key: String,
    /// A restored copy's own name: the guest takes it as its host name, and makes itself
    /// a new machine ID. `None`: the same sandbox woken, its identity kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// A restored copy's own network link (its address, route and resolver), which
    /// replaces the one it was saved with. `None`: unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<GuestNetwork>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum HostMsg {
    Hello(Hello),
    Ping,
    Setup(PoolSetup),
    Exec(ExecSpec),
    /// Signals the running command's process group.
    Signal {
        signal: i32,
    },
    Ps,
    /// To a VM guest's agent, once after boot (or after a template restore): mount these
    /// disks as the sandbox's root and enter it. Answered with `Ready`.
    GuestSetup(GuestSetup),
    Reseed(Reseed),
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
    /// Joins the conversation to a TCP connection to `port` on the sandbox's loopback (a
    /// server a command started). Answered with `Connected`; after it, both directions
    /// carry the connection's bytes as they are, no frames, until either side ends.
    Connect {
        port: u16,
    },
    /// To a container's agent before its process checkpoint: stop serving and hold no
    /// descriptor of the host's (its listening socket is replaced by an unbound socket of
    /// its own at the same descriptor number); answered with `Done` once no other
    /// conversation is open, after which the agent closes this one too. It serves again
    /// once that socket listens: the host takes it (`pidfd_getfd`), binds and listens.
    Park,
}

/// One layer of a guest's root: the serial of its metadata image's disk and of its data
/// blob's disk (none for a layer without file data).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestLayer {
    pub meta: String,
    pub blob: Option<String>,
}

/// A directory to create in the upper before the overlay is mounted: one holding
/// whiteouts, so overlayfs merges and hides them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MergeDir {
    /// Relative to the root.
    pub path: String,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// Where a VM guest finds its root: virtio disks named by serial number.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuestSetup {
    /// Top-most first.
    pub layers: Vec<GuestLayer>,
    /// The serial of the writable disk (an ext4 image sized to the disk budget).
    pub upper: String,
    pub merge_dirs: Vec<MergeDir>,
    pub hostname: String,
    /// Memory and process budgets of the sandbox's commands (a cgroup inside the guest).
    pub memory_bytes: u64,
    pub pids: u32,
    /// The host's clock and fresh entropy (a restored guest has stale ones).
    pub time_ns: u64,
    pub seed: Vec<u8>,
    /// The allowlisted network, when the sandbox has one.
    #[serde(default)]
    pub network: Option<GuestNetwork>,
    /// A full VM with a graphics card: load its display driver.
    #[serde(default)]
    pub display: bool,
    /// A whole disk image whose root filesystem is the bottom of the stack, under
    /// `layers` (the entry's base layer only carries the image).
    #[serde(default)]
    pub root_image: Option<GuestRootImage>,
    /// The sandbox's key (hex): every later conversation must prove it.
    pub key: String,
    /// Commands keep the guest's full privileges and devices (a nesting host): no jail
    /// but close-on-exec descriptors.
    #[serde(default)]
    pub privileged: bool,
    /// Layers only read-only views use (disks beside the stack's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub view_layers: Vec<GuestLayer>,
    /// Read-only views mounted over the root before any command runs (an evaluation's
    /// grader files and protected paths), in this order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub views: Vec<GuestView>,
}

/// A read-only view over the guest's root: `from` of its tree mounted at `at`. The tree
/// is one layer, or several stacked without an upper (top-most first), each named by
/// index: below `layers.len()` one of the stack's, else `view_layers[i - layers.len()]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestView {
    pub layers: Vec<usize>,
    pub from: String,
    pub at: String,
}

/// The disk holding a guest's root image, and which of its partitions is the root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestRootImage {
    pub serial: String,
    /// 1-based; none: the first partition that mounts, else the whole disk.
    pub partition: Option<u32>,
}

/// A guest's one interface and the names of its allowed destinations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestNetwork {
    /// The address of the guest's interface and its prefix length.
    pub address: String,
    pub prefix: u8,
    /// The host's side of the guest's link, its default route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// The resolver for /etc/resolv.conf (the sandbox's egress proxy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nameserver: Option<String>,
    /// Lines for /etc/hosts.
    #[serde(default)]
    pub hosts: Vec<HostName>,
}

/// One /etc/hosts line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostName {
    pub address: String,
    pub name: String,
}

/// Budget counters of a VM guest's sandbox cgroup and upper disk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestStats {
    pub oom_kills: u64,
    pub pids_max_hits: u64,
    pub memory_bytes: u64,
    pub disk_used: u64,
    pub disk_size: u64,
}

/// What a directory entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Other,
}

impl EntryKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            EntryKind::File => "file",
            EntryKind::Dir => "dir",
            EntryKind::Symlink => "symlink",
            EntryKind::Other => "other",
        }
    }

    pub fn of(ft: &std::fs::FileType) -> EntryKind {
        if ft.is_dir() {
            EntryKind::Dir
        } else if ft.is_symlink() {
            EntryKind::Symlink
        } else if ft.is_file() {
            EntryKind::File
        } else {
            EntryKind::Other
        }
    }
}

/// One directory entry, as `ListDir` returns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    pub kind: EntryKind,
    pub size: u64,
    pub mode: u32,
    /// Last modification, seconds since the epoch (absent from older agents: 0).
    #[serde(default)]
    pub mtime: i64,
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
    /// Where a symlink points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEntry {
    pub pid: u32,
    pub ppid: u32,
    pub state: String,
    pub rss_bytes: u64,
    pub cmdline: String,
}

/// Why a request failed, as a code the host branches on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    NotFound,
    PermissionDenied,
    /// The request itself is wrong (an empty command, a message out of place).
    Invalid,
    TooLarge,
    /// The command could not be started (not found, not executable).
    ExecFailed,
    /// The handshake's proof did not match the sandbox key.
    Unauthenticated,
    /// The peer speaks another protocol version.
    ProtocolVersion,
    /// Setting the sandbox up failed.
    Setup,
    /// Any other failure of the agent's own.
    Other,
}

impl ErrorKind {
    /// The kind of an I/O error's cause.
    pub fn of_io(e: &std::io::Error) -> ErrorKind {
        match e.kind() {
            std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            std::io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            std::io::ErrorKind::InvalidInput => ErrorKind::Invalid,
            _ => ErrorKind::Other,
        }
    }

    /// The matching I/O error kind, for errors the host reports as I/O on a path.
    pub fn io_kind(&self) -> std::io::ErrorKind {
        match self {
            ErrorKind::NotFound => std::io::ErrorKind::NotFound,
            ErrorKind::PermissionDenied => std::io::ErrorKind::PermissionDenied,
            ErrorKind::Invalid => std::io::ErrorKind::InvalidInput,
            _ => std::io::ErrorKind::Other,
        }
    }
}

/// A failure as the agent reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct AgentError {
    pub kind: ErrorKind,
    pub message: String,
}

impl AgentError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> AgentError {
        AgentError {
            kind,
            message: message.into(),
        }
    }

    /// An I/O failure on `what`, its kind taken from the error.
    pub fn io(what: &str, e: &std::io::Error) -> AgentError {
        AgentError::new(ErrorKind::of_io(e), format!("{what}: {e}"))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum AgentMsg {
    /// The handshake's answer: the agent's version and its proof of the key.
    Welcome {
        version: u32,
        proof: String,
    },
    /// The handshake failed: another version, or a wrong proof.
    Refused {
        version: u32,
        kind: ErrorKind,
        message: String,
    },
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
    Error(AgentError),
    /// A file's bytes follow in one data frame.
    FileFollows {
        mode: u32,
    },
    Entries {
        list: Vec<DirEntry>,
    },
    Stats(GuestStats),
    Done,
    /// The port answered: raw bytes follow (see `HostMsg::Connect`).
    Connected,
}

impl From<AgentError> for AgentMsg {
    fn from(e: AgentError) -> AgentMsg {
        AgentMsg::Error(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_carry_their_kind_as_a_code() {
        let msg = AgentMsg::Error(AgentError::new(ErrorKind::NotFound, "/x: gone"));
        let json = serde_json::to_value(&msg).unwrap();
        assert_eq!(json["op"], "error");
        assert_eq!(json["kind"], "not-found");
        let back: AgentMsg = serde_json::from_value(json).unwrap();
        assert_eq!(back, msg);
        let e = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        assert_eq!(ErrorKind::of_io(&e), ErrorKind::PermissionDenied);
        assert_eq!(ErrorKind::NotFound.io_kind(), std::io::ErrorKind::NotFound);
    }
}
