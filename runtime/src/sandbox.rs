//! One sandbox: its on-disk record, the backend seam, and the API every backend shares
//! (exec, files, processes, destroy). Budgets are attributed here, from the cgroup counters
//! and the upper's quota, so every backend reports them the same way.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::cgroup::Cgroup;
use crate::exec::{Budget, Collected, Event, ExecRequest, ExecResult, Stream};
use crate::files::{self, FileEntry};
use crate::spec::SandboxSpec;
use crate::{Runtime, RuntimeError};
use strata_catalog::Backend;

/// What the runtime keeps about a live sandbox (`sandboxes/<id>/sandbox.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    pub spec: SandboxSpec,
    pub created_ms: u64,
    /// Host PID of the sandbox's init, and its start time (guards against PID reuse).
    pub init_pid: u32,
    pub init_start: u64,
    /// For a one-shot sandbox (`strata run`): the process that owns it. When that process
    /// dies without destroying it, the next reap does.
    #[serde(default)]
    pub owner: Option<(u32, u64)>,
}

/// What a backend gets to start a sandbox.
pub struct StartContext<'a> {
    pub id: String,
    pub dir: PathBuf,
    pub rootfs: PathBuf,
    pub hostname: String,
    pub spec: &'a SandboxSpec,
    pub cgroup: Cgroup,
    /// A prepared network namespace to join (allowlisted network); none means a fresh,
    /// empty one.
    pub netns: Option<PathBuf>,
    /// For a backend whose root lives in a guest: the disks to build it from.
    pub guest: Option<crate::vm::GuestDisks>,
    /// A VM snapshot to restore instead of starting fresh.
    pub restore: Option<PathBuf>,
}

/// A command, fully resolved against the sandbox's defaults.
pub struct ExecEnv {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    pub timeout: Duration,
}

/// The seam between the shared sandbox logic and one way of isolating processes.
pub trait SandboxBackend: Send + Sync {
    /// Starts the sandbox's init over the assembled root; returns its host PID.
    fn start(&self, ctx: &StartContext) -> Result<u32, RuntimeError>;
    /// Runs a command; by default through the sandbox's agent on its socket (fncall,
    /// and a VM's relay).
    fn exec(
        &self,
        _rec: &SandboxRecord,
        dir: &Path,
        cgroup: &Cgroup,
        env: &ExecEnv,
        req: &ExecRequest,
        sink: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<Collected, RuntimeError> {
        crate::agent::AgentClient::of(dir)?.exec(cgroup, env, req, sink)
    }
    /// Kills every process of the sandbox; by default everything in its cgroup (a VM's
    /// QEMU and relay live there too).
    fn stop(&self, _rec: &SandboxRecord, cgroup: &Cgroup) -> Result<(), RuntimeError> {
        cgroup.kill_all();
        Ok(())
    }
    /// Drops whatever state the backend keeps for `id` outside the sandbox directory.
    fn forget(&self, _id: &str) {}
    /// Whether the sandbox's root lives inside a guest kernel, reachable only through its
    /// agent (files, processes and budget counters then come from the agent).
    fn in_guest(&self) -> bool {
        false
    }
    /// Stops (`true`) or resumes every process of the sandbox.
    fn pause(&self, _dir: &Path, cgroup: &Cgroup, paused: bool) -> Result<(), RuntimeError> {
        cgroup.freeze(paused)
    }
    /// Saves the whole sandbox to `dest`, to be restored into a new one.
    fn snapshot(
        &self,
        rec: &SandboxRecord,
        _dir: &Path,
        _upper_image: &Path,
        _dest: &Path,
    ) -> Result<crate::vm::SnapshotInfo, RuntimeError> {
        Err(RuntimeError::Invalid(format!(
            "snapshots are for microvm and vm sandboxes; this one is a {} sandbox",
            rec.spec.backend.as_str()
        )))
    }
}

/// Forwards a pipe to the event channel in chunks.
pub fn pump(
    mut src: Box<dyn Read + Send>,
    stream: Stream,
    tx: Sender<Event>,
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
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    if matches!(fields.next(), Some("Z" | "X")) {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// A process inside a sandbox, as `ps` shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessInfo {
    /// PID inside the sandbox.
    pub pid: u32,
    pub host_pid: u32,
    pub state: String,
    pub rss_bytes: u64,
    pub cmdline: String,
}

/// Why a sandbox ended (audit `ended` records).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EndReason {
    Destroyed,
    IdleTtl,
    Crashed,
    /// The process that owned a one-shot sandbox died.
    OwnerGone,
    Error,
}

impl EndReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            EndReason::Destroyed => "destroyed",
            EndReason::IdleTtl => "idle-ttl",
            EndReason::Crashed => "crashed",
            EndReason::OwnerGone => "owner-gone",
            EndReason::Error => "error",
        }
    }
}

/// Within 256 KiB of the limit counts as full: the write that failed never landed.
fn disk_full(used: u64, limit: u64) -> bool {
    limit > 0 && used + (256 << 10) >= limit
}

/// An advisory lock on a sandbox directory: execs share it, destroy and reap take it
/// exclusively, so an idle reaper never tears down a sandbox mid-command.
pub struct DirLock {
    _file: File,
}

impl DirLock {
    pub fn take(dir: &Path, exclusive: bool, wait: bool) -> Result<Option<DirLock>, RuntimeError> {
        let path = dir.join("lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(RuntimeError::io(&path))?;
        let mut op = if exclusive {
            libc::LOCK_EX
        } else {
            libc::LOCK_SH
        };
        if !wait {
            op |= libc::LOCK_NB;
        }
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), op) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(RuntimeError::io(&path)(e));
        }
        Ok(Some(DirLock { _file: file }))
    }
}

/// A live sandbox.
pub struct Sandbox {
    pub(crate) rt: Runtime,
    pub(crate) record: SandboxRecord,
}

impl Sandbox {
    pub fn id(&self) -> &str {
        &self.record.id
    }

    pub fn record(&self) -> &SandboxRecord {
        &self.record
    }

    pub fn spec(&self) -> &SandboxSpec {
        &self.record.spec
    }

    fn dir(&self) -> PathBuf {
        self.rt.sandbox_dir(&self.record.id)
    }

    fn rootfs(&self) -> PathBuf {
        self.dir().join("rootfs")
    }

    fn rootfs_paths(&self) -> crate::rootfs::RootfsPaths {
        crate::rootfs::RootfsPaths::new(
            &self.dir(),
            &self.rt.uppers().dir(&self.record.id),
            self.record.spec.layers.len(),
        )
    }

    /// The host directory holding what the sandbox changed (its overlayfs upper), for
    /// reading while the sandbox lives, e.g. to turn a build's changes into a layer.
    pub fn upper_dir(&self) -> PathBuf {
        self.rootfs_paths().upper
    }

    /// Paths (relative to the root) the runtime itself writes into the upper, not the
    /// sandbox's commands: the mount points of its own files in a container, and the
    /// allowed hosts' addresses in `/etc/hosts`.
    pub fn runtime_written_paths(&self) -> Vec<String> {
        let mut paths = Vec::new();
        if self.record.spec.backend == Backend::Container {
            paths.push(
                crate::container::RUNTIME_DIR
                    .trim_start_matches('/')
                    .to_string(),
            );
        }
        if !self.record.spec.network.is_empty() {
            paths.push("etc/hosts".to_string());
        }
        paths
    }

    /// The host directories of the sandbox's layers, top-most first (read-only).
    pub fn layer_dirs(&self) -> Vec<PathBuf> {
        self.rootfs_paths().layers
    }

    pub fn cgroup(&self) -> Cgroup {
        self.rt.cgroup(&self.record.id)
    }

    /// Runs a command, streaming its output to `sink` as it comes, and returns its result
    /// with the full output.
    pub fn exec_streaming(
        &self,
        req: &ExecRequest,
        sink: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<ExecResult, RuntimeError> {
        if req.argv.is_empty() {
            return Err(RuntimeError::Invalid("empty command".into()));
        }
        let dir = self.dir();
        let _lock = DirLock::take(&dir, false, true)?;
        if !dir.join("sandbox.json").exists() {
            return Err(RuntimeError::NotFound(self.record.id.clone()));
        }
        self.rt.touch(&self.record.id);
        let spec = &self.record.spec;
        let (uid, gid) = self.resolve_user(&spec.user)?;
        let mut env = spec.env.clone();
        env.extend(req.env.clone());
        let exec_env = ExecEnv {
            argv: req.argv.clone(),
            env,
            cwd: req.cwd.clone().unwrap_or_else(|| spec.workdir.clone()),
            uid,
            gid,
            timeout: req.timeout.unwrap_or(spec.limits.timeout),
        };
        let cgroup = self.cgroup();
        let backend = self.rt.backend(spec.backend)?;
        // A guest reports its own counters with the exit; the host's cgroup holds the
        // others' (a VM's host cgroup is QEMU's, not the commands').
        let in_guest = backend.in_guest();
        let host_counters = || {
            if in_guest {
                Default::default()
            } else {
                cgroup.counters()
            }
        };
        let before = host_counters();
        let started_ms = crate::audit::now_ms();
        let started = Instant::now();
        let outcome = backend.exec(&self.record, &dir, &cgroup, &exec_env, req, sink);
        let after = host_counters();
        tracing::debug!(
            sandbox = %self.record.id,
            backend_ms = started.elapsed().as_secs_f64() * 1e3,
            "exec ran"
        );
        let collected = match outcome {
            Ok(c) => c,
            Err(e) => {
                self.rt.audit(&self.record.id).record(
                    "exec",
                    json!({"argv": req.argv, "start": started_ms, "end": crate::audit::now_ms(),
                           "error": e.to_string()}),
                )?;
                return Err(e);
            }
        };
        let mut budgets = Vec::new();
        let guest = collected.exit.guest;
        let (oom, pids_hit) = match guest {
            Some(g) => (g.oom_kills > 0, g.pids_max_hits > 0),
            None => (
                after.oom_kills > before.oom_kills,
                after.pids_max_hits > before.pids_max_hits,
            ),
        };
        if oom {
            budgets.push(Budget::Memory);
        }
        if pids_hit {
            budgets.push(Budget::Pids);
        }
        let disk = match guest {
            Some(g) => Ok((g.disk_used, g.disk_size)),
            None => self.disk_usage(),
        };
        if disk.is_ok_and(|(used, limit)| disk_full(used, limit)) {
            budgets.push(Budget::Disk);
        }
        if collected.timed_out {
            budgets.push(Budget::Timeout);
        }
        // The wall clock ends a command outright; otherwise the first budget hit is the
        // likeliest cause of its end.
        let budget = if collected.timed_out {
            Some(Budget::Timeout)
        } else {
            budgets.first().copied()
        };
        let result = ExecResult {
            exit_code: collected.exit.code,
            signal: collected.exit.signal,
            stdout_bytes: collected.stdout.len() as u64,
            stderr_bytes: collected.stderr.len() as u64,
            stdout: collected.stdout,
            stderr: collected.stderr,
            duration_ms: started.elapsed().as_millis() as u64,
            budget,
            budgets,
        };
        self.rt.touch(&self.record.id);
        self.rt.audit(&self.record.id).record(
            "exec",
            json!({"argv": req.argv, "cwd": exec_env.cwd, "start": started_ms,
                   "end": crate::audit::now_ms(), "exit_code": result.exit_code,
                   "signal": result.signal, "stdout_bytes": result.stdout_bytes,
                   "stderr_bytes": result.stderr_bytes, "budget": result.budget,
                   "budgets_hit": result.budgets}),
        )?;
        Ok(result)
    }

    /// Runs a command and returns its result with the full output.
    pub fn exec(&self, req: &ExecRequest) -> Result<ExecResult, RuntimeError> {
        self.exec_streaming(req, &mut |_, _| {})
    }

    fn in_guest(&self) -> bool {
        self.rt
            .backend(self.record.spec.backend)
            .is_ok_and(|b| b.in_guest())
    }

    /// Bytes used in the sandbox's writable upper, and its quota.
    pub fn disk_usage(&self) -> Result<(u64, u64), RuntimeError> {
        if self.in_guest() {
            let s = crate::agent::AgentClient::of(&self.dir())?.stats()?;
            return Ok((s.disk_used, s.disk_size));
        }
        self.rt.uppers().usage(&self.record.id)
    }

    /// Stops every process of the sandbox where it is (a VM's whole machine), until
    /// [`Sandbox::resume`].
    pub fn pause(&self) -> Result<(), RuntimeError> {
        self.set_paused(true)
    }

    pub fn resume(&self) -> Result<(), RuntimeError> {
        self.set_paused(false)
    }

    fn set_paused(&self, paused: bool) -> Result<(), RuntimeError> {
        let backend = self.rt.backend(self.record.spec.backend)?;
        let t = Instant::now();
        backend.pause(&self.dir(), &self.cgroup(), paused)?;
        self.rt.touch(&self.record.id);
        self.rt.audit(&self.record.id).record(
            if paused { "paused" } else { "resumed" },
            json!({"ms": t.elapsed().as_secs_f64() * 1e3}),
        )
    }

    /// Saves a VM sandbox (machine state and writable disk) into directory `dest`; the
    /// sandbox keeps running. [`crate::Runtime::restore`] starts a new sandbox from it.
    pub fn snapshot(&self, dest: &Path) -> Result<crate::vm::SnapshotInfo, RuntimeError> {
        let dir = self.dir();
        // No command runs meanwhile: the disk copy and the memory state must agree.
        let _lock = DirLock::take(&dir, true, true)?;
        let backend = self.rt.backend(self.record.spec.backend)?;
        let info = backend.snapshot(
            &self.record,
            &dir,
            &self.rt.uppers().image(&self.record.id),
            dest,
        )?;
        self.rt.audit(&self.record.id).record(
            "snapshot",
            json!({"dir": dest, "state_bytes": info.state_bytes, "disk_bytes": info.disk_bytes,
                   "ms": info.millis}),
        )?;
        Ok(info)
    }

    fn resolve_user(&self, user: &str) -> Result<(u32, u32), RuntimeError> {
        let (name, group) = match user.split_once(':') {
            Some((u, g)) => (u, Some(g)),
            None => (user, None),
        };
        let uid_gid = if let Ok(uid) = name.parse::<u32>() {
            (uid, uid)
        } else if name == "root" {
            (0, 0)
        } else {
            let passwd = self.read_file("/etc/passwd").unwrap_or_default();
            String::from_utf8_lossy(&passwd)
                .lines()
                .find_map(|l| {
                    let f: Vec<&str> = l.split(':').collect();
                    (f.len() > 3 && f[0] == name)
                        .then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
                        .flatten()
                })
                .or_else(|| (name == "root").then_some((0, 0)))
                .ok_or_else(|| {
                    RuntimeError::Invalid(format!(
                        "user `{name}` is not in the sandbox's /etc/passwd; use a numeric uid[:gid]"
                    ))
                })?
        };
        match group.map(str::parse::<u32>) {
            None => Ok(uid_gid),
            Some(Ok(g)) => Ok((uid_gid.0, g)),
            Some(Err(_)) => Err(RuntimeError::Invalid(format!(
                "group in user `{user}` must be numeric"
            ))),
        }
    }

    pub fn read_file(&self, path: &str) -> Result<Vec<u8>, RuntimeError> {
        self.rt.touch(&self.record.id);
        if self.in_guest() {
            return crate::agent::AgentClient::of(&self.dir())?.read_file(path);
        }
        files::read_file(&self.rootfs(), path)
    }

    pub fn write_file(&self, path: &str, data: &[u8], mode: u32) -> Result<(), RuntimeError> {
        self.rt.touch(&self.record.id);
        let r = if self.in_guest() {
            crate::agent::AgentClient::of(&self.dir()).and_then(|a| a.write_file(path, data, mode))
        } else {
            files::write_file(&self.rootfs(), path, data, mode)
        };
        self.rt.audit(&self.record.id).record(
            "file-write",
            json!({"path": path, "bytes": data.len(), "ok": r.is_ok()}),
        )?;
        r
    }

    pub fn list_dir(&self, path: &str) -> Result<Vec<FileEntry>, RuntimeError> {
        self.rt.touch(&self.record.id);
        if self.in_guest() {
            return Ok(crate::agent::AgentClient::of(&self.dir())?
                .list_dir(path)?
                .into_iter()
                .map(|e| FileEntry {
                    name: e.name,
                    kind: e.kind.as_str().to_string(),
                    size: e.size,
                    mode: e.mode,
                })
                .collect());
        }
        files::list_dir(&self.rootfs(), path)
    }

    /// Every process in the sandbox, read from its cgroup (or, in a VM, by its agent;
    /// their host PID is then 0).
    pub fn processes(&self) -> Vec<ProcessInfo> {
        if self.in_guest() {
            return crate::agent::AgentClient::of(&self.dir())
                .and_then(|a| a.processes())
                .unwrap_or_default()
                .into_iter()
                .map(|p| ProcessInfo {
                    pid: p.pid,
                    host_pid: 0,
                    state: p.state,
                    rss_bytes: p.rss_bytes,
                    cmdline: p.cmdline,
                })
                .collect();
        }
        let mut out: Vec<ProcessInfo> = self
            .cgroup()
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
                let cmdline = strata_agent_proto::proc_cmdline(host_pid);
                Some(ProcessInfo {
                    pid,
                    host_pid,
                    state,
                    rss_bytes,
                    cmdline,
                })
            })
            .collect();
        out.sort_by_key(|p| p.pid);
        out
    }

    /// Ends the sandbox: kills its processes, unmounts its root, releases its layers,
    /// cgroups and upper. The audit record stays.
    pub fn destroy(self) -> Result<(), RuntimeError> {
        self.rt
            .teardown(&self.record.id, Some(&self.record), EndReason::Destroyed)
    }
}
