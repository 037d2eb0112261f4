//! One live sandbox and the API every backend shares (exec, files, processes, pause,
//! snapshot, destroy). Budgets are attributed here, from the counters the backend reports
//! and the writable layer's fill level, so every backend reports them the same way. What
//! differs between backends is behind [`SandboxBackend`]; nothing here asks which one a
//! sandbox has.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::json;

use crate::backend::{HibernateInfo, ProcessInfo, SandboxBackend, SandboxRef, SnapshotInfo};
use crate::cgroup::{Cgroup, Counters};
use crate::exec::ExecEnv;
use crate::exec::{Budget, ExecRequest, ExecResult, Stream};
use crate::files::FileEntry;
use crate::record::{EndReason, SandboxRecord};
use crate::spec::SandboxSpec;
use crate::{Runtime, RuntimeError};

/// A hibernated sandbox's saved state, under its directory.
pub(crate) const HIBERNATION_DIR: &str = "hibernation";
/// How long a hibernation waits for running commands to end.
const HIBERNATE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// Written last by a hibernation, removed first by a wake: the sandbox is hibernated.
pub(crate) const HIBERNATION_MARK: &str = "hibernation.json";

#[derive(serde::Serialize, serde::Deserialize)]
struct Hibernation {
    since_ms: u64,
    state_bytes: u64,
    /// It was paused: it wakes paused.
    paused: bool,
}

/// Within 256 KiB of the limit counts as full: the write that failed never landed.
fn disk_full(used: u64, limit: u64) -> bool {
    limit > 0 && used + (256 << 10) >= limit
}

/// Which budgets a command hit, and the one that ended it: from the counters before and
/// after it ran (a guest's own, reported with its exit, when it has them), the writable
/// layer's use at its end, and whether the wall clock fired. The same on every backend.
pub(crate) fn attribute(
    before: Counters,
    after: Counters,
    guest: Option<strata_agent_proto::GuestStats>,
    disk: Option<(u64, u64)>,
    timed_out: bool,
) -> (Option<Budget>, Vec<Budget>) {
    let mut budgets = Vec::new();
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
    let disk = guest.map(|g| (g.disk_used, g.disk_size)).or(disk);
    if disk.is_some_and(|(used, limit)| disk_full(used, limit)) {
        budgets.push(Budget::Disk);
    }
    if timed_out {
        budgets.push(Budget::Timeout);
    }
    // The wall clock ends a command outright; otherwise the first budget hit is the
    // likeliest cause of its end.
    let budget = if timed_out {
        Some(Budget::Timeout)
    } else {
        budgets.first().copied()
    };
    (budget, budgets)
}

/// An advisory lock on a sandbox directory: execs share it, destroy and reap take it
/// exclusively, so an idle reaper never tears down a sandbox mid-command.
pub struct DirLock {
    _file: File,
}

impl DirLock {
    pub fn take(dir: &Path, exclusive: bool, wait: bool) -> Result<Option<DirLock>, RuntimeError> {
        DirLock::take_file(&dir.join("lock"), exclusive, wait)
    }

    /// The same lock on another file of the directory (`path`, created if missing).
    fn take_file(
        path: &Path,
        exclusive: bool,
        wait: bool,
    ) -> Result<Option<DirLock>, RuntimeError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(RuntimeError::io(path))?;
        let lock = if exclusive {
            strata_host::fs::Lock::Exclusive
        } else {
            strata_host::fs::Lock::Shared
        };
        if !strata_host::fs::flock(&file, lock, wait).map_err(RuntimeError::io(path))? {
            return Ok(None);
        }
        Ok(Some(DirLock { _file: file }))
    }
}

/// A live sandbox (a handle: clones name the same one).
#[derive(Clone)]
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

    fn rootfs_paths(&self) -> crate::rootfs::RootfsPaths {
        crate::rootfs::RootfsPaths::new(
            &self.dir(),
            &self.rt.uppers().dir(&self.record.id),
            self.record.spec.layers.len(),
        )
    }

    /// The backend and what it needs to act on this sandbox.
    fn with_backend<T>(
        &self,
        f: impl FnOnce(&dyn SandboxBackend, &SandboxRef) -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        self.with_record(&self.record, f)
    }

    /// [`Sandbox::with_backend`] with the record read again, for the calls that reach the
    /// sandbox's init by PID (a snapshot's checkpoint, a port, the network): a wake (by
    /// any handle or process) starts a new init, which this handle's record does not name.
    fn with_current<T>(
        &self,
        f: impl FnOnce(&dyn SandboxBackend, &SandboxRef) -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        match self.rt.load(&self.record.id) {
            Ok(record) => self.with_record(&record, f),
            Err(_) => self.with_backend(f),
        }
    }

    /// [`Sandbox::with_backend`] with `record` as it is on disk now (its init may have
    /// changed since this handle was made: a wake starts a new one).
    fn with_record<T>(
        &self,
        record: &SandboxRecord,
        f: impl FnOnce(&dyn SandboxBackend, &SandboxRef) -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        let backend = self.rt.backend(record.spec.backend);
        let (dir, cgroup) = (self.dir(), self.cgroup());
        let sb = SandboxRef {
            record,
            dir: &dir,
            cgroup: &cgroup,
            uppers: self.rt.uppers(),
        };
        f(backend, &sb)
    }

    fn hibernation_dir(&self) -> PathBuf {
        self.dir().join(HIBERNATION_DIR)
    }

    /// Whether the sandbox is hibernated: its state on disk, no process running.
    pub fn is_hibernated(&self) -> bool {
        self.hibernation_dir().join(HIBERNATION_MARK).exists()
    }

    /// Saves the sandbox's whole state (a VM's memory and devices) to disk and stops it:
    /// its memory and CPU go back to the host, its files stay. The next call that needs it
    /// running (exec, files, processes, ports, commit, snapshot, pause) wakes it first, or
    /// [`Sandbox::wake`]. Refused as busy while a command runs (after a short wait). A
    /// hibernated sandbox is kept
    /// until woken or destroyed: its idle TTL counts again from the wake.
    pub fn hibernate(&self) -> Result<HibernateInfo, RuntimeError> {
        self.hibernate_waiting(HIBERNATE_WAIT)
    }

    /// [`Sandbox::hibernate`], waiting at most `wait` for running commands to end.
    pub fn hibernate_waiting(
        &self,
        wait: std::time::Duration,
    ) -> Result<HibernateInfo, RuntimeError> {
        let dir = self.dir();
        // A command streaming its output holds the shared lock: its stream would be cut
        // (its process would live on in the saved machine, unheard).
        let deadline = Instant::now() + wait;
        let _lock = loop {
            if let Some(lock) = DirLock::take(&dir, true, false)? {
                break lock;
            }
            if Instant::now() > deadline {
                return Err(RuntimeError::Busy(format!(
                    "sandbox {} is running a command; hibernate it when the command ends (a service started detached, `nohup CMD &`, is kept: it runs on after the wake)",
                    self.record.id
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        if !dir.join("sandbox.json").exists() {
            return Err(RuntimeError::NotFound(self.record.id.clone()));
        }
        let mark = self.hibernation_dir().join(HIBERNATION_MARK);
        if let Ok(bytes) = std::fs::read(&mark) {
            if let Ok(h) = serde_json::from_slice::<Hibernation>(&bytes) {
                return Ok(HibernateInfo {
                    state_bytes: h.state_bytes,
                    millis: 0.0,
                });
            }
        }
        let record = self.rt.load(&self.record.id)?;
        let to = self.hibernation_dir();
        // What a hibernation that failed midway left.
        let _ = std::fs::remove_dir_all(&to);
        let paused = self.with_record(&record, |b, sb| Ok(b.paused(sb)))?;
        let info = match self.with_record(&record, |b, sb| b.hibernate(sb, &to)) {
            Ok(info) => info,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&to);
                return Err(e);
            }
        };
        let h = Hibernation {
            since_ms: crate::audit::now_ms(),
            state_bytes: info.state_bytes,
            paused,
        };
        let tmp = mark.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(&h).unwrap_or_default())
            .and_then(|()| std::fs::rename(&tmp, &mark))
            .map_err(RuntimeError::io(&mark))?;
        self.rt.audit(&self.record.id).record(
            "hibernated",
            json!({"state_bytes": info.state_bytes, "ms": info.millis, "paused": paused}),
        )?;
        Ok(info)
    }

    /// Starts a hibernated sandbox again where it was (processes, memory, files; paused if
    /// it was); `false` when it was not hibernated.
    pub fn wake(&self) -> Result<bool, RuntimeError> {
        if !self.is_hibernated() {
            return Ok(false);
        }
        let dir = self.dir();
        let _lock = DirLock::take(&dir, true, true)?;
        // Woken meanwhile by another caller.
        let mark = self.hibernation_dir().join(HIBERNATION_MARK);
        let Ok(bytes) = std::fs::read(&mark) else {
            return Ok(false);
        };
        let h: Hibernation = serde_json::from_slice(&bytes)
            .map_err(|e| RuntimeError::Invalid(format!("{}: {e}", mark.display())))?;
        let t = Instant::now();
        let path = dir.join("sandbox.json");
        let _record_lock = DirLock::take_file(&dir.join("record.lock"), true, true)?;
        let mut record = SandboxRecord::load(&path)?;
        // A hibernation that died after the save but before its machine quit left that
        // machine stopped: it ends before the saved state starts.
        if crate::backend::process_start(record.init_pid) == Some(record.init_start) {
            self.cgroup().kill_all();
        }
        let pid = self.with_record(&record, |b, sb| {
            b.wake(sb, &self.hibernation_dir(), h.paused)
        })?;
        record.init_pid = pid;
        record.init_start = crate::backend::process_start(pid).unwrap_or(0);
        record.save(&path)?;
        let _ = std::fs::remove_file(&mark);
        let _ = std::fs::remove_dir_all(self.hibernation_dir());
        self.rt.touch(&self.record.id);
        self.rt.audit(&self.record.id).record(
            "woken",
            json!({"ms": t.elapsed().as_secs_f64() * 1e3,
                   "hibernated_ms": crate::audit::now_ms().saturating_sub(h.since_ms)}),
        )?;
        Ok(true)
    }

    /// Wakes the sandbox if it is hibernated: what every call that needs it running does.
    fn awake(&self) -> Result<(), RuntimeError> {
        self.wake().map(|_| ())
    }

    /// The host directory holding what the sandbox changed (its overlayfs upper), for
    /// reading while the sandbox lives, e.g. to turn a build's changes into a layer.
    pub fn upper_dir(&self) -> PathBuf {
        self.rootfs_paths().upper
    }

    /// Paths (relative to the root) the runtime itself writes into the upper, not the
    /// sandbox's commands (the mount points of its own files, the allowed hosts' names).
    pub fn runtime_written_paths(&self) -> Vec<String> {
        self.rt
            .backend(self.record.spec.backend)
            .runtime_written_paths(&self.record.spec)
    }

    /// What the sandbox changed over its layers, held still and readable on the host until
    /// the view is dropped (see [`crate::Changes`]): to commit it as a new layer.
    pub fn changes(&self) -> Result<crate::Changes, RuntimeError> {
        if !self.dir().join("sandbox.json").exists() {
            return Err(RuntimeError::NotFound(self.record.id.clone()));
        }
        self.awake()?;
        let upper = self.upper_dir();
        let (upper, release) = self.with_backend(|b, sb| b.hold_changes(sb, &upper))?;
        self.rt.touch(&self.record.id);
        Ok(crate::Changes {
            upper,
            lowers: self.layer_dirs(),
            runtime_paths: self.runtime_written_paths(),
            release,
        })
    }

    /// The host directories of the sandbox's layers, top-most first (read-only).
    pub fn layer_dirs(&self) -> Vec<PathBuf> {
        self.rootfs_paths().layers
    }

    /// The sandbox's audit record, to add what a caller did with it.
    pub fn audit(&self) -> crate::AuditLog {
        self.rt.audit(&self.record.id)
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
        self.awake()?;
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
        let started_ms = crate::audit::now_ms();
        let started = Instant::now();
        let (before, outcome, after, disk) = self.with_backend(|backend, sb| {
            let before = backend.counters(sb);
            let outcome = backend.exec(sb, &exec_env, req, sink);
            let after = backend.counters(sb);
            // A guest reports its disk with the exit; the host measures its own.
            let guest_reported = outcome.as_ref().is_ok_and(|c| c.exit.guest.is_some());
            let disk = if guest_reported {
                None
            } else {
                backend.disk_usage(sb).ok()
            };
            Ok((before, outcome, after, disk))
        })?;
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
        let (budget, budgets) = attribute(
            before,
            after,
            collected.exit.guest,
            disk,
            collected.timed_out,
        );
        let result = ExecResult {
            exit_code: collected.exit.code,
            signal: collected.exit.signal,
            truncated: collected.truncated(),
            stdout_bytes: collected.stdout_bytes,
            stderr_bytes: collected.stderr_bytes,
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
                   "stderr_bytes": result.stderr_bytes, "truncated": result.truncated,
                   "budget": result.budget,
                   "budgets_hit": result.budgets}),
        )?;
        Ok(result)
    }

    /// Runs a command and returns its result with the full output.
    pub fn exec(&self, req: &ExecRequest) -> Result<ExecResult, RuntimeError> {
        self.exec_streaming(req, &mut |_, _| {})
    }

    /// Bytes used in the sandbox's writable upper, and its quota.
    pub fn disk_usage(&self) -> Result<(u64, u64), RuntimeError> {
        self.awake()?;
        self.with_backend(|b, sb| b.disk_usage(sb))
    }

    /// Stops every process of the sandbox where it is (a VM's whole machine), until
    /// [`Sandbox::resume`].
    pub fn pause(&self) -> Result<(), RuntimeError> {
        self.set_paused(true)
    }

    /// `running`, `paused` (every process stopped where it is) or `hibernated` (its state
    /// on disk, nothing running).
    pub fn state(&self) -> &'static str {
        if self.is_hibernated() {
            return "hibernated";
        }
        if self.with_backend(|b, sb| Ok(b.paused(sb))).unwrap_or(false) {
            "paused"
        } else {
            "running"
        }
    }

    pub fn resume(&self) -> Result<(), RuntimeError> {
        self.set_paused(false)
    }

    fn set_paused(&self, paused: bool) -> Result<(), RuntimeError> {
        self.awake()?;
        let t = Instant::now();
        self.with_backend(|b, sb| b.pause(sb, paused))?;
        self.rt.touch(&self.record.id);
        self.rt.audit(&self.record.id).record(
            if paused { "paused" } else { "resumed" },
            json!({"ms": t.elapsed().as_secs_f64() * 1e3}),
        )
    }

    /// Whether a snapshot of this sandbox keeps its processes and memory (a VM's, or a
    /// container's checkpointed with CRIU), so a restore continues them; otherwise only
    /// its files can be carried over (commit).
    pub fn saves_memory(&self) -> bool {
        self.rt.backend(self.record.spec.backend).saves_memory()
    }

    /// Saves a container or VM sandbox (processes, memory and writable layer) into
    /// directory `dest`; the sandbox keeps running. [`crate::Runtime::restore`] starts a new sandbox from it.
    pub fn snapshot(&self, dest: &Path) -> Result<SnapshotInfo, RuntimeError> {
        self.snapshot_by(dest, "snapshot", |b, sb| b.snapshot(sb, dest))
    }

    /// A snapshot into `dest` for a fork of `children`: restored on this node only, while
    /// `dest` exists; the children may share the memory saved there (a VM's).
    pub fn fork_snapshot(
        &self,
        dest: &Path,
        children: usize,
    ) -> Result<SnapshotInfo, RuntimeError> {
        self.snapshot_by(dest, "fork-snapshot", |b, sb| {
            b.fork_snapshot(sb, dest, children)
        })
    }

    fn snapshot_by(
        &self,
        dest: &Path,
        event: &str,
        take: impl FnOnce(&dyn SandboxBackend, &SandboxRef) -> Result<SnapshotInfo, RuntimeError>,
    ) -> Result<SnapshotInfo, RuntimeError> {
        self.awake()?;
        // No command runs meanwhile: the disk copy and the memory state must agree.
        let _lock = DirLock::take(&self.dir(), true, true)?;
        let info = self.with_current(take)?;
        self.rt.audit(&self.record.id).record(
            event,
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
        let mut data = Vec::new();
        self.read_file_with(path, &mut |part| {
            data.extend_from_slice(part);
            Ok(())
        })?;
        Ok(data)
    }

    /// Reads a file in parts of at most 1 MiB, each handed to `sink` before the next is
    /// read; a sink's error ends the read.
    pub fn read_file_with(
        &self,
        path: &str,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        self.awake()?;
        self.rt.touch(&self.record.id);
        self.with_backend(|b, sb| b.read_file(sb, path, sink))
    }

    pub fn write_file(&self, path: &str, data: &[u8], mode: u32) -> Result<(), RuntimeError> {
        self.awake()?;
        self.rt.touch(&self.record.id);
        let r = self.with_backend(|b, sb| b.write_file(sb, path, data, mode));
        self.rt.audit(&self.record.id).record(
            "file-write",
            json!({"path": path, "bytes": data.len(), "ok": r.is_ok()}),
        )?;
        r
    }

    pub fn list_dir(&self, path: &str) -> Result<Vec<FileEntry>, RuntimeError> {
        self.awake()?;
        self.rt.touch(&self.record.id);
        self.with_backend(|b, sb| b.list_dir(sb, path))
    }

    /// A TCP connection to a port the sandbox listens on (its loopback), for proxying a
    /// server an agent started inside.
    pub fn connect_port(&self, port: u16) -> Result<crate::PortStream, RuntimeError> {
        self.awake()?;
        self.rt.touch(&self.record.id);
        self.with_current(|b, sb| b.connect_port(sb, port))
    }

    /// Every process in the sandbox (inside a VM, their host PID is 0).
    pub fn processes(&self) -> Vec<ProcessInfo> {
        if let Err(e) = self.awake() {
            tracing::warn!(sandbox = %self.record.id, "waking it to list its processes: {e}");
            return Vec::new();
        }
        self.with_backend(|b, sb| Ok(b.processes(sb)))
            .unwrap_or_default()
    }

    /// Ends the sandbox: kills its processes, unmounts its root, releases its layers,
    /// cgroups and upper. The audit record stays.
    pub fn destroy(self) -> Result<(), RuntimeError> {
        self.end(EndReason::Destroyed)
    }

    /// Ends the sandbox as [`Sandbox::destroy`] does, recording `reason` in its audit.
    pub fn end(self, reason: EndReason) -> Result<(), RuntimeError> {
        self.rt
            .teardown(&self.record.id, Some(&self.record), reason)
    }

    /// Whether the sandbox's init still runs (the same process it started with, or the
    /// one its last wake started), or it is hibernated.
    pub fn is_alive(&self) -> bool {
        if self.is_hibernated() {
            return true;
        }
        let r = self
            .rt
            .load(&self.record.id)
            .unwrap_or_else(|_| self.record.clone());
        crate::backend::process_start(r.init_pid) == Some(r.init_start)
    }

    /// Counts as activity: restarts the idle TTL (every command already does).
    pub fn touch(&self) {
        self.rt.touch(&self.record.id);
    }

    /// Sets the idle time after which the reaper destroys the sandbox; also restarts it.
    pub fn set_idle_ttl(&mut self, ttl: std::time::Duration) -> Result<(), RuntimeError> {
        self.update_record(|r| r.spec.limits.idle_ttl = ttl)?;
        self.rt.touch(&self.record.id);
        Ok(())
    }

    /// Replaces the sandbox's egress allowlist while it runs (empty: nothing but its own
    /// loopback). A VM created without an allowlist has no network card: Unsupported.
    pub fn set_network(&mut self, rules: Vec<crate::NetRule>) -> Result<(), RuntimeError> {
        self.awake()?;
        let before = self.record.spec.network.clone();
        // Recorded first: a crash while the network is wired leaves a record that says
        // there is one, which is what destroy and the reaper go by.
        if !rules.is_empty() {
            self.update_record(|r| r.spec.network = rules.clone())?;
        }
        let networks = self.rt.networks().clone();
        match self.with_current(|b, sb| b.set_network(sb, &networks, &rules)) {
            Ok(()) => {
                if rules.is_empty() {
                    self.update_record(|r| r.spec.network.clear())?;
                }
                self.rt.touch(&self.record.id);
                self.rt.audit(&self.record.id).record(
                    "network-changed",
                    json!({"allow": rules.iter().map(|r| format!("{}:{}", r.host, r.port)).collect::<Vec<_>>()}),
                )
            }
            Err(e) => {
                let _ = self.update_record(|r| r.spec.network = before);
                Err(e)
            }
        }
    }

    /// Changes the stored record under its own lock (commands keep running meanwhile:
    /// they share the directory's lock).
    fn update_record(
        &mut self,
        change: impl FnOnce(&mut SandboxRecord),
    ) -> Result<(), RuntimeError> {
        let dir = self.dir();
        let _lock = DirLock::take(&dir, false, true)?;
        let path = dir.join("sandbox.json");
        let _record = DirLock::take_file(&dir.join("record.lock"), true, true)?;
        let mut record = SandboxRecord::load(&path)?;
        change(&mut record);
        record.save(&path)?;
        self.record = record;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_agent_proto::GuestStats;

    fn counters(oom: u64, pids: u64) -> Counters {
        Counters {
            oom_kills: oom,
            pids_max_hits: pids,
            memory_peak: 0,
        }
    }

    #[test]
    fn budgets_are_attributed_from_counters_disk_and_clock() {
        let quiet = counters(3, 1);
        // Nothing hit: counters unchanged (earlier commands' hits do not count).
        assert_eq!(
            attribute(quiet, quiet, None, Some((10, 1 << 30)), false),
            (None, vec![])
        );
        // An OOM kill during the command.
        assert_eq!(
            attribute(quiet, counters(4, 1), None, Some((10, 1 << 30)), false),
            (Some(Budget::Memory), vec![Budget::Memory])
        );
        // A fork bomb hits pids, spins, and the wall clock ends it: timeout is the cause.
        assert_eq!(
            attribute(quiet, counters(3, 9), None, None, true),
            (Some(Budget::Timeout), vec![Budget::Pids, Budget::Timeout])
        );
        // A full writable layer (within 256 KiB of its size).
        let size = 32 << 20;
        assert_eq!(
            attribute(quiet, quiet, None, Some((size - 4096, size)), false),
            (Some(Budget::Disk), vec![Budget::Disk])
        );
        assert_eq!(
            attribute(quiet, quiet, None, Some((size / 2, size)), false).0,
            None
        );
    }

    #[test]
    fn a_guest_reports_its_own_budget_counters_and_disk() {
        // A VM's host counters are zero; the guest's deltas come with the exit.
        let zero = Counters::default();
        let g = GuestStats {
            oom_kills: 1,
            pids_max_hits: 0,
            memory_bytes: 0,
            disk_used: 1 << 20,
            disk_size: 1 << 30,
        };
        assert_eq!(
            attribute(zero, zero, Some(g), None, false),
            (Some(Budget::Memory), vec![Budget::Memory])
        );
        let full = GuestStats {
            oom_kills: 0,
            disk_used: (1 << 30) - 100,
            ..g
        };
        // The guest's disk figure wins over the host's (a VM's host has none).
        assert_eq!(
            attribute(zero, zero, Some(full), Some((0, 1 << 30)), false).0,
            Some(Budget::Disk)
        );
    }
}
