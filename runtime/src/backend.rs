//! The seam between the shared sandbox logic and one way of isolating processes: the
//! [`SandboxBackend`] trait, and what crosses it. Shared code (`Sandbox`, the
//! runtime's create, destroy and reap) calls only these methods and never asks which
//! backend it holds. The defaults are the host-root behaviour fncall and container share
//! (the root is an overlay on the host, processes and counters live in the sandbox's
//! cgroup, files are read straight from the root); a VM overrides them with its guest
//! agent's answers.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::mpsc::SyncSender;

use serde::Serialize;

use crate::agent::AgentClient;
use crate::audit::AuditLog;
use crate::cgroup::{Cgroup, Counters};
use crate::exec::{Collected, Event, ExecEnv, ExecRequest, Stream};
use crate::files::{self, FileEntry};
use crate::network::{self, Networks};
use crate::quota::Uppers;
use crate::record::SandboxRecord;
use crate::spec::{NetRule, SandboxSpec};
use crate::{LazyfsAccess, RuntimeError};

/// What the runtime lends a backend to build a sandbox.
pub(crate) struct Host<'a> {
    pub lazyfs: &'a LazyfsAccess,
    pub uppers: &'a Uppers,
    pub networks: &'a Networks,
    /// Cached per-layer facts (`layer-facts/`).
    pub facts: PathBuf,
}

/// A sandbox to build and start.
pub(crate) struct NewSandbox<'a> {
    pub id: &'a str,
    pub dir: &'a Path,
    pub spec: &'a SandboxSpec,
    pub hostname: String,
    pub cgroup: Cgroup,
    pub audit: AuditLog,
    /// A snapshot to restore instead of starting fresh (containers, VMs).
    pub restore: Option<&'a Path>,
}

/// A live sandbox, as a backend sees it.
pub(crate) struct SandboxRef<'a> {
    pub record: &'a SandboxRecord,
    pub dir: &'a Path,
    pub cgroup: &'a Cgroup,
    pub uppers: &'a Uppers,
}

impl SandboxRef<'_> {
    pub(crate) fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }
}

/// A process inside a sandbox, as `ps` shows it.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct ProcessInfo {
    /// PID inside the sandbox.
    pub pid: u32,
    /// PID on the host (0 for a process inside a VM guest).
    pub host_pid: u32,
    pub state: String,
    pub rss_bytes: u64,
    pub cmdline: String,
}

/// A connection to a port a sandbox listens on.
#[derive(Debug)]
pub enum PortStream {
    /// Made from inside the sandbox's network namespace.
    Tcp(std::net::TcpStream),
    /// Relayed by the sandbox's agent (a VM guest's ports are behind its own kernel).
    Relayed(std::os::unix::net::UnixStream),
}

/// What a snapshot took.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotInfo {
    pub dir: PathBuf,
    /// Bytes of the machine state file.
    pub state_bytes: u64,
    /// Bytes the writable disk's copy occupies on the host.
    pub disk_bytes: u64,
    pub millis: f64,
}

/// What a hibernation saved (see [`crate::Sandbox::hibernate`]).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct HibernateInfo {
    /// Bytes of the saved state (memory and devices; the writable disk stays where it is).
    pub state_bytes: u64,
    pub millis: f64,
}

pub(crate) trait SandboxBackend: Send + Sync {
    /// Builds the sandbox's root and starts its init; returns the init's host PID (a VM's
    /// QEMU). What it leaves behind on failure, the runtime's teardown removes.
    fn create(&self, host: &Host, new: &NewSandbox) -> Result<u32, RuntimeError>;

    /// Runs a command; by default through the sandbox's agent.
    fn exec(
        &self,
        sb: &SandboxRef,
        env: &ExecEnv,
        req: &ExecRequest,
        sink: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<Collected, RuntimeError> {
        AgentClient::of(sb.dir)?.exec(sb.cgroup, env, req, sink)
    }

    /// Budget counters the host sees (its cgroup's); a VM guest reports its own with each
    /// command's exit instead, so a VM's are zero.
    fn counters(&self, sb: &SandboxRef) -> Counters {
        sb.cgroup.counters()
    }

    /// Bytes used in the sandbox's writable layer, and its size.
    fn disk_usage(&self, sb: &SandboxRef) -> Result<(u64, u64), RuntimeError> {
        sb.uppers.usage(&sb.record.id)
    }

    /// Hands the file to `sink` in parts (see [`files::read_file_with`]).
    fn read_file(
        &self,
        sb: &SandboxRef,
        path: &str,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        files::read_file_with(&sb.rootfs(), path, sink)
    }

    fn write_file(
        &self,
        sb: &SandboxRef,
        path: &str,
        data: &[u8],
        mode: u32,
    ) -> Result<(), RuntimeError> {
        files::write_file(&sb.rootfs(), path, data, mode)
    }

    fn list_dir(&self, sb: &SandboxRef, path: &str) -> Result<Vec<FileEntry>, RuntimeError> {
        files::list_dir(&sb.rootfs(), path)
    }

    /// Replaces the sandbox's egress allowlist while it runs: the host's rules for its
    /// network namespace (one created without an allowlist is wired now), its egress
    /// proxy, and the resolver its /etc/resolv.conf names.
    fn set_network(
        &self,
        sb: &SandboxRef,
        networks: &Networks,
        rules: &[NetRule],
    ) -> Result<(), RuntimeError> {
        let net = network::update(networks, &sb.record.id, sb.record.init_pid, rules)?;
        crate::hostroot::write_resolver(&sb.rootfs(), net.nameserver)
    }

    /// A TCP connection to `port` on the sandbox's own loopback, made from its network
    /// namespace (that of its init), so nothing needs a route into the sandbox.
    fn connect_port(&self, sb: &SandboxRef, port: u16) -> Result<PortStream, RuntimeError> {
        let ns = PathBuf::from(format!("/proc/{}/ns/net", sb.record.init_pid));
        connect_in_netns(&ns, port).map(PortStream::Tcp)
    }

    /// Every process in the sandbox, from its cgroup.
    fn processes(&self, sb: &SandboxRef) -> Vec<ProcessInfo> {
        cgroup_processes(sb.cgroup)
    }

    /// Kills every process of the sandbox; by default everything in its cgroup.
    fn stop(&self, _rec: &SandboxRecord, cgroup: &Cgroup) -> Result<(), RuntimeError> {
        cgroup.kill_all();
        Ok(())
    }

    /// Drops whatever state the backend keeps for `id` outside the sandbox directory.
    fn forget(&self, _id: &str) {}

    /// Stops (`true`) or resumes every process of the sandbox.
    fn pause(&self, sb: &SandboxRef, paused: bool) -> Result<(), RuntimeError> {
        sb.cgroup.freeze(paused)
    }

    /// Whether every process of the sandbox is stopped ([`SandboxBackend::pause`]).
    fn paused(&self, sb: &SandboxRef) -> bool {
        sb.cgroup.is_frozen()
    }

    /// Whether [`SandboxBackend::snapshot`] saves processes and memory (a restore then
    /// continues them); otherwise only files can be carried over.
    fn saves_memory(&self) -> bool {
        false
    }

    /// Saves the whole sandbox to `dest`, to be restored into a new one.
    fn snapshot(&self, sb: &SandboxRef, _dest: &Path) -> Result<SnapshotInfo, RuntimeError> {
        Err(RuntimeError::Invalid(format!(
            "snapshots with processes are of container, microvm and vm sandboxes; this one is a {} sandbox (commit its files instead)",
            sb.record.spec.backend.as_str()
        )))
    }

    /// [`SandboxBackend::snapshot`] for a fork of `children`, restored on this node while
    /// it exists: a backend may keep the memory there in a form its children share (a
    /// VM's: an image each child maps copy-on-write) rather than one each loads a copy of.
    fn fork_snapshot(
        &self,
        sb: &SandboxRef,
        dest: &Path,
        _children: usize,
    ) -> Result<SnapshotInfo, RuntimeError> {
        self.snapshot(sb, dest)
    }

    /// Whether [`SandboxBackend::hibernate`] can save this backend's sandboxes here (the
    /// reaper's `auto_hibernate` only tries those).
    fn hibernates(&self) -> bool {
        false
    }

    /// Saves the sandbox's whole state under `to` and stops it, releasing its memory and
    /// CPU (its files stay where they are); [`SandboxBackend::wake`] starts it again.
    fn hibernate(&self, sb: &SandboxRef, _to: &Path) -> Result<HibernateInfo, RuntimeError> {
        Err(RuntimeError::Unsupported(format!(
            "hibernating a {} sandbox is not supported on this node; pause it (memory kept) or commit its files",
            sb.record.spec.backend.as_str()
        )))
    }

    /// Starts a hibernated sandbox again from what [`SandboxBackend::hibernate`] saved
    /// under `from`; its new init's host PID. `paused`: leave it stopped.
    fn wake(&self, sb: &SandboxRef, _from: &Path, _paused: bool) -> Result<u32, RuntimeError> {
        Err(RuntimeError::Unsupported(format!(
            "a {} sandbox cannot be woken: it cannot hibernate",
            sb.record.spec.backend.as_str()
        )))
    }

    /// Holds what the sandbox changed still and readable on the host at `upper` (its
    /// overlayfs upper); how to give it back. By default the upper is already a host
    /// directory: the sandbox is frozen meanwhile (unless it is paused already).
    fn hold_changes(
        &self,
        sb: &SandboxRef,
        upper: &Path,
    ) -> Result<(PathBuf, crate::changes::Release), RuntimeError> {
        if sb.cgroup.is_frozen() {
            return Ok((upper.to_path_buf(), crate::changes::Release::Nothing));
        }
        sb.cgroup.freeze(true)?;
        Ok((
            upper.to_path_buf(),
            crate::changes::Release::Thaw(sb.cgroup.clone()),
        ))
    }

    /// Paths (relative to the root) the runtime itself writes into the writable layer, not
    /// the sandbox's commands (a step build leaves them out of its layer).
    fn runtime_written_paths(&self, _spec: &SandboxSpec) -> Vec<String> {
        Vec::new()
    }
}

/// The processes of a host cgroup, with their PIDs inside the sandbox's namespace.
/// SIGKILLs `root` and every process of the cgroup descended from it.
pub(crate) fn kill_tree(cgroup: &Cgroup, root: u32) {
    let parent_of = |pid: u32| -> Option<u32> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The command name may hold spaces and parentheses: fields follow the last `)`.
        let rest = stat.rsplit_once(')')?.1;
        rest.split_whitespace().nth(1)?.parse().ok()
    };
    let pids = cgroup.pids();
    let parents: std::collections::HashMap<u32, u32> = pids
        .iter()
        .filter_map(|&p| Some((p, parent_of(p)?)))
        .collect();
    let mut doomed = vec![root];
    for &pid in &pids {
        let mut at = pid;
        for _ in 0..64 {
            match parents.get(&at) {
                Some(&p) if p == root => {
                    doomed.push(pid);
                    break;
                }
                Some(&p) => at = p,
                None => break,
            }
        }
    }
    for pid in doomed {
        if let Ok(pid) = i32::try_from(pid) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

pub(crate) fn cgroup_processes(cgroup: &Cgroup) -> Vec<ProcessInfo> {
    let mut out: Vec<ProcessInfo> = cgroup
        .pids()
        .into_iter()
        .filter_map(|host_pid| {
            let status = std::fs::read_to_string(format!("/proc/{host_pid}/status")).ok()?;
            let field = |k: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(k).map(|v| v.trim().to_string()))
            };
            let pid = field("NSpid:")?.split_whitespace().last()?.parse().ok()?;
            let state = field("State:").unwrap_or_default();
            let rss_bytes = field("VmRSS:")
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024;
            Some(ProcessInfo {
                pid,
                host_pid,
                state,
                rss_bytes,
                cmdline: strata_agent_proto::proc_cmdline(host_pid),
            })
        })
        .collect();
    out.sort_by_key(|p| p.pid);
    out
}

/// Forwards a pipe to the event channel in chunks.
pub(crate) fn pump(
    mut src: Box<dyn Read + Send>,
    stream: Stream,
    tx: SyncSender<Event>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match src.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send(Event::Output(stream, buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    })
}

/// Start time of a live process in clock ticks since boot (field 22 of /proc/PID/stat);
/// `None` for a process that is gone or a zombie.
pub fn process_start(pid: u32) -> Option<u64> {
    let fields = strata_agent_proto::proc_stat_fields(pid)?;
    if matches!(fields.first().map(String::as_str), Some("Z" | "X")) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Connects to `127.0.0.1:port` inside the network namespace `ns`. A namespace switch is
/// per thread, so it is made on a thread of its own, which ends with it; the socket keeps
/// the namespace it was made in.
pub(crate) fn connect_in_netns(ns: &Path, port: u16) -> Result<std::net::TcpStream, RuntimeError> {
    let file = std::fs::File::open(ns).map_err(|source| RuntimeError::Io {
        path: ns.display().to_string(),
        source,
    })?;
    std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(std::io::Error::from)?;
        std::net::TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            std::time::Duration::from_secs(5),
        )
    })
    .join()
    .map_err(|_| RuntimeError::Unsupported("the connecting thread panicked".into()))?
    .map_err(|source| RuntimeError::Io {
        path: format!("port {port} in the sandbox"),
        source,
    })
}
