//! The runtime: turns a catalog entry into a running sandbox and back into nothing.
//!
//! A sandbox's root is its layers (attached through lazyfs, one shared EROFS mount per
//! layer per host) stacked with overlayfs under a writable upper with a disk quota
//! (`rootfs`, `quota`, `hostroot`), or, in a VM, handed to the guest as disks. A backend
//! (`fncall`: our own agent as pid 1; `container`: an OCI runtime; `vm`: QEMU) isolates
//! the processes behind the one seam that varies, `backend::SandboxBackend`; [`Sandbox`]
//! is the API every backend shares; `cgroup` holds the budgets; `audit` records what
//! happened. All state lives under one directory, so a restarted runtime finds what a
//! dead one left and reaps it.
//!
//! The public API is [`Runtime`], [`Sandbox`] and the types they take and return
//! (re-exported here), plus `doctor` (host checks).

mod agent;
mod audit;
mod backend;
mod cgroup;
mod changes;
mod checkpoint;
mod container;
pub mod doctor;
mod exec;
mod files;
mod fncall;
mod hostroot;
mod network;
mod quota;
mod record;
mod rootfs;
mod sandbox;
mod spec;
mod vm;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use strata_catalog::Backend;
use strata_lazyfs::{connect_or_start, Client, LazyError, Paths};

pub use audit::AuditLog;
pub use backend::{process_start, HibernateInfo, PortStream, ProcessInfo, SnapshotInfo};
pub use cgroup::CgroupMode;
pub use changes::Changes;
pub use checkpoint::{installed_criu, INSTALLED_CRIU};
pub use container::{static_agent_for, OciRuntime};
pub use exec::{Budget, ExecCancel, ExecRequest, ExecResult, Stdin, StdinFeed, Stream};
pub use files::FileEntry;
pub use network::public_ranges;
pub use record::{EndReason, SandboxRecord, RECORD_FORMAT};
pub use sandbox::Sandbox;
pub use spec::{base_env, local_identity, Limits, NetRule, Overrides, ReadonlyView, SandboxSpec};
pub use vm::VmConfig;

use backend::{Host, NewSandbox, SandboxBackend};
use cgroup::{Cgroup, Cgroups};
use sandbox::DirLock;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} (inside the sandbox): {source}")]
    File {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid: {0}")]
    Invalid(String),
    #[error("no sandbox `{0}` on this host (see `strata sandbox ls`)")]
    NotFound(String),
    #[error("host setup: {0}")]
    Setup(String),
    #[error("disk quota: {0}")]
    Quota(String),
    /// The OCI runtime (crun, runc) failed.
    #[error("{engine} {what}: {message}")]
    Oci {
        engine: &'static str,
        what: String,
        message: String,
    },
    /// QEMU's machine protocol failed (pause, resume, saving state).
    /// A process checkpoint (CRIU) failed, or cannot be restored.
    #[error("process checkpoint (CRIU): {0}")]
    Checkpoint(String),
    #[error("QMP: {0}")]
    Qmp(String),
    /// A VM did not come up (QEMU, its relay or its guest).
    #[error("VM start: {0}")]
    VmStart(String),
    /// A bug of ours, not of the input or the host.
    #[error("internal: {0}")]
    Internal(String),
    #[error("exec: {0}")]
    Exec(String),
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The sandbox is doing something the request must not cut short (a running command).
    #[error("busy: {0}")]
    Busy(String),
    /// The agent is of another protocol version, or failed to prove the sandbox's key.
    #[error(transparent)]
    Handshake(#[from] strata_agent_proto::HandshakeError),
    #[error("the sandbox agent refused the request: {0}")]
    AgentRefused(String),
    /// A failure the agent reported, with its code.
    #[error("sandbox agent: {message}")]
    Agent {
        kind: strata_agent_proto::ErrorKind,
        message: String,
    },
    /// The agent could not be reached, or the conversation broke off.
    #[error("sandbox agent unreachable: {0}")]
    AgentGone(String),
    /// The agent sent something the protocol does not allow there.
    #[error("sandbox agent protocol violation: {0}")]
    Protocol(String),
    #[error(transparent)]
    Lazyfs(#[from] LazyError),
}

impl RuntimeError {
    pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
        move |source| RuntimeError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// Runs a host tool (mkfs.ext4, mount, ip, nft), feeding it `stdin`; its stdout, or an
/// error with its stderr that says how to install it when it is missing.
pub(crate) fn run_tool(
    cmd: &mut std::process::Command,
    stdin: Option<&str>,
) -> Result<String, RuntimeError> {
    use std::process::Stdio;
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            RuntimeError::Setup(format!(
                "cannot run {program}: {e} (install it with scripts/setup.sh)"
            ))
        })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        std::io::Write::write_all(&mut pipe, text.as_bytes())
            .map_err(|e| RuntimeError::Setup(format!("{program}: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| RuntimeError::Setup(format!("{program}: {e}")))?;
    if !out.status.success() {
        return Err(RuntimeError::Setup(format!(
            "{program} {:?} failed: {}",
            cmd.get_args().collect::<Vec<_>>(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Claims the right to end the sandbox in `dir`: a marker created exclusively, naming the
/// ender (PID and start time). A marker whose ender is gone (it died mid-teardown: a CLI
/// or a service killed) is taken over at once, one without a readable ender (an older
/// build's) after a minute.
fn claim_end(dir: &Path) -> bool {
    let marker = dir.join("ending");
    let me = std::process::id();
    let create = || {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&marker)
            .map(|mut f| {
                let start = backend::process_start(me).unwrap_or(0);
                let _ = std::io::Write::write_all(&mut f, format!("{me} {start}\n").as_bytes());
            })
            .is_ok()
    };
    if create() {
        return true;
    }
    if !being_ended(dir) {
        let _ = std::fs::remove_file(&marker);
        return create();
    }
    // The directory is gone or unwritable: nothing left to claim.
    !dir.exists()
}

/// Whether someone is ending the sandbox in `dir` now: its `ending` marker names a live
/// ender (a marker without a readable ender, being written this instant or an older
/// build's, counts for a minute).
fn being_ended(dir: &Path) -> bool {
    let marker = dir.join("ending");
    let Ok(text) = std::fs::read_to_string(&marker) else {
        return false;
    };
    let mut words = text.split_whitespace();
    match (
        words.next().and_then(|w| w.parse::<u32>().ok()),
        words.next().and_then(|w| w.parse::<u64>().ok()),
    ) {
        (Some(pid), Some(start)) => backend::process_start(pid) == Some(start),
        _ => age(&marker) < Duration::from_secs(60),
    }
}

/// `p` from `/`, for the tools that run in a directory of their own (QEMU in the
/// machine's, CRIU in its images'), where a relative path (a home given as one) names
/// another file or none.
pub(crate) fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Time since a file or directory was last modified.
pub(crate) fn age(path: &Path) -> Duration {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .unwrap_or_default()
}

/// Starts the lazyfs daemon when none answers; the process it started, if it can tell, so
/// a daemon that dies at start is reported at once.
pub type StartDaemon =
    Arc<dyn Fn() -> Result<Option<std::process::Child>, LazyError> + Send + Sync>;

/// How the runtime reaches the lazyfs daemon.
#[derive(Clone)]
pub struct LazyfsAccess {
    pub paths: Paths,
    pub start: StartDaemon,
}

impl LazyfsAccess {
    pub fn client(&self) -> Result<Client, RuntimeError> {
        let start = self.start.clone();
        Ok(connect_or_start(
            &self.paths,
            Duration::from_secs(30),
            move || start(),
        )?)
    }

    pub fn running_client(&self) -> Option<Client> {
        let mut c = Client::connect(&self.paths.socket()).ok()?;
        c.call(&strata_lazyfs::Request::Ping).ok()?;
        Some(c)
    }
}

pub struct RuntimeConfig {
    /// Where sandboxes, uppers and audit logs live (`$STRATA_HOME/runtime`).
    pub state_dir: PathBuf,
    pub lazyfs: LazyfsAccess,
    pub oci_runtime: OciRuntime,
    /// The `strata-agent` binary (fncall init).
    pub agent: PathBuf,
    /// A static init for containers (catatonit), used without a static agent.
    pub container_init: PathBuf,
    /// A statically linked `strata-agent` to be every container's init, so commands run
    /// through it instead of `<oci runtime> exec`, and every VM guest's init.
    pub container_agent: Option<PathBuf>,
    /// How microVMs and VMs run here.
    pub vm: vm::VmConfig,
    /// The CRIU binary that checkpoints containers for hibernation (scripts/criu.sh
    /// builds it); none: containers cannot hibernate.
    pub criu: Option<PathBuf>,
    /// Where the host's cgroups are mounted (`/sys/fs/cgroup`).
    pub cgroup_root: PathBuf,
    /// Where networked sandboxes' address slots are claimed, shared by every home on the
    /// host (`/run/strata/net`).
    pub net_slots: PathBuf,
    /// Reap what an earlier runtime left when opening (the CLI's default). A node service
    /// opens without it, first ends its own sandboxes that did not survive its restart with
    /// [`EndReason::NodeRestart`], then reaps.
    pub reap_at_open: bool,
}

impl RuntimeConfig {
    /// Defaults for this host: crun on PATH, Debian's catatonit, no static agent, the
    /// default [`vm::VmConfig`]. The caller (the `strata` binary, from its settings) sets
    /// the fields it wants otherwise; nothing here reads the environment.
    pub fn new(state_dir: PathBuf, lazyfs: LazyfsAccess, agent: PathBuf) -> RuntimeConfig {
        RuntimeConfig {
            state_dir,
            lazyfs,
            oci_runtime: OciRuntime::Crun(PathBuf::from("crun")),
            agent,
            container_init: PathBuf::from("/usr/bin/catatonit"),
            container_agent: None,
            vm: vm::VmConfig::default(),
            criu: None,
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            net_slots: PathBuf::from("/run/strata/net"),
            reap_at_open: true,
        }
    }
}

struct Inner {
    cfg: RuntimeConfig,
    uppers: quota::Uppers,
    cgroups: Cgroups,
    networks: network::Networks,
    container: container::ContainerBackend,
    fncall: fncall::FncallBackend,
    microvm: vm::VmBackend,
    vm: vm::VmBackend,
    /// What the reap at open removed, until someone asks.
    opened_with: std::sync::Mutex<ReapReport>,
}

/// The file `tool` names in a directory of the PATH, as a command named so would run.
pub(crate) fn on_path(tool: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// A suffix for a temporary file no other process or thread uses at once (the PID and a
/// counter: a node service creates many sandboxes at once in one process).
pub(crate) fn unique_suffix() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{}-{n}", std::process::id())
}

/// The runtime on this host. Cheap to clone; any number of processes may open it at once.
#[derive(Clone)]
pub struct Runtime {
    inner: Arc<Inner>,
}

/// What a reap pass removed.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct ReapReport {
    pub crashed: Vec<String>,
    pub expired: Vec<String>,
    pub orphans: Vec<String>,
    /// Sandboxes idle past their `auto_hibernate`, hibernated by this reap.
    pub hibernated: Vec<String>,
}

impl ReapReport {
    pub fn is_empty(&self) -> bool {
        self.crashed.is_empty()
            && self.expired.is_empty()
            && self.orphans.is_empty()
            && self.hibernated.is_empty()
    }

    fn merge(&mut self, other: ReapReport) {
        self.crashed.extend(other.crashed);
        self.expired.extend(other.expired);
        self.orphans.extend(other.orphans);
        self.hibernated.extend(other.hibernated);
    }
}

impl Runtime {
    /// Opens the runtime's state, mounting the upper pool if needed, and reaps whatever an
    /// earlier runtime left behind.
    pub fn open(mut cfg: RuntimeConfig) -> Result<Runtime, RuntimeError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(RuntimeError::Setup(
                "the runtime needs root: it mounts overlays, creates namespaces and cgroups".into(),
            ));
        }
        for d in ["sandboxes", "audit"] {
            let p = cfg.state_dir.join(d);
            std::fs::create_dir_all(&p).map_err(RuntimeError::io(&p))?;
        }
        cfg.state_dir =
            std::fs::canonicalize(&cfg.state_dir).map_err(RuntimeError::io(&cfg.state_dir))?;
        let uppers = quota::Uppers::open(
            &cfg.state_dir.join("upper-images"),
            &cfg.state_dir.join("uppers"),
            &cfg.state_dir.join("upper-pool"),
        )?;
        let cgroups = Cgroups::probe(&cfg.cgroup_root, cgroup::parent_for(&cfg.state_dir))?;
        tracing::debug!(mode = %cgroups.mode(), "cgroups");
        let networks =
            network::Networks::new(&cfg.state_dir, cfg.net_slots.clone(), cfg.agent.clone());
        let launch = std::sync::Arc::new(hostroot::LaunchNamespace::new(cfg.state_dir.clone()));
        let container = container::ContainerBackend {
            criu: cfg.criu.clone().map(|binary| checkpoint::Criu { binary }),
            networks: networks.clone(),
            runtime: cfg.oci_runtime.clone(),
            state_root: cfg.state_dir.join(cfg.oci_runtime.name()),
            init: cfg.container_init.clone(),
            agent: cfg.container_agent.clone(),
            hybrid_cgroups: cgroups.mode() == cgroup::CgroupMode::Hybrid,
            launch: launch.clone(),
            sealed_crun: Arc::default(),
        };
        let fncall = fncall::FncallBackend {
            agent: cfg.agent.clone(),
            static_agent: cfg.container_agent.clone(),
            criu: cfg.criu.clone().map(|binary| checkpoint::Criu { binary }),
            networks: networks.clone(),
            pool: cfg.state_dir.join("pool"),
            cgroups: cgroups.clone(),
            launch,
        };
        let vm_backend = |machine| vm::VmBackend {
            machine,
            cfg: cfg.vm.clone(),
            agent: cfg.agent.clone(),
            guest_agent: cfg.container_agent.clone(),
            dir: cfg.state_dir.join("vm"),
        };
        let (microvm, vm) = (
            vm_backend(vm::Machine::Microvm),
            vm_backend(vm::Machine::Q35),
        );
        let rt = Runtime {
            inner: Arc::new(Inner {
                cgroups,
                networks,
                cfg,
                uppers,
                container,
                fncall,
                microvm,
                vm,
                opened_with: Default::default(),
            }),
        };
        let report = if rt.inner.cfg.reap_at_open {
            rt.reap()?
        } else {
            ReapReport::default()
        };
        if !report.is_empty() {
            tracing::info!(?report, "reaped what an earlier runtime left");
        }
        *rt.inner
            .opened_with
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = report;
        Ok(rt)
    }

    /// How this runtime reaches the lazyfs daemon (for its statistics).
    pub fn lazyfs(&self) -> &LazyfsAccess {
        &self.inner.cfg.lazyfs
    }

    pub fn state_dir(&self) -> &Path {
        &self.inner.cfg.state_dir
    }

    pub fn cgroup(&self, id: &str) -> Cgroup {
        self.inner.cgroups.sandbox(id)
    }

    /// How this host's cgroups are laid out.
    pub fn cgroup_mode(&self) -> CgroupMode {
        self.inner.cgroups.mode()
    }

    pub(crate) fn uppers(&self) -> &quota::Uppers {
        &self.inner.uppers
    }

    pub(crate) fn networks(&self) -> &network::Networks {
        &self.inner.networks
    }

    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.inner.cfg.state_dir.join("sandboxes").join(id)
    }

    pub fn audit(&self, id: &str) -> AuditLog {
        AuditLog::new(
            self.inner
                .cfg
                .state_dir
                .join("audit")
                .join(format!("{id}.jsonl")),
        )
    }

    pub(crate) fn backend(&self, b: Backend) -> &dyn SandboxBackend {
        match b {
            Backend::Container => &self.inner.container,
            Backend::Fncall => &self.inner.fncall,
            Backend::Microvm => &self.inner.microvm,
            Backend::Vm => &self.inner.vm,
        }
    }

    pub(crate) fn touch(&self, id: &str) {
        let p = self.sandbox_dir(id).join("active");
        let _ = std::fs::write(p, b"");
    }

    /// Starts pooled function-call agents until `target` wait, so fncall creates skip the
    /// agent start and the cgroup attach. Returns how many it started.
    pub fn fill_pool(&self, target: usize) -> Result<usize, RuntimeError> {
        self.inner.fncall.fill(target)
    }

    /// Formats writable uppers of `disk_bytes` until `target` wait, so creates with that
    /// disk budget skip mkfs and the loop mount.
    pub fn fill_uppers(&self, disk_bytes: u64, target: usize) -> Result<(), RuntimeError> {
        self.uppers().fill(disk_bytes, target)
    }

    /// Stops every pooled agent (and drops the runtime's cgroup parent if nothing else
    /// uses it).
    pub fn drain_pool(&self) -> usize {
        let n = self.inner.fncall.drain(false);
        self.uppers().drain();
        if self.ids().is_empty() {
            self.inner.cgroups.remove_parent();
        }
        n
    }

    /// Pooled agents waiting.
    pub fn pooled(&self) -> usize {
        self.inner.fncall.pooled().len()
    }

    /// Creates and starts a sandbox that lives until destroyed or idle past its TTL.
    pub fn create(&self, spec: SandboxSpec) -> Result<Sandbox, RuntimeError> {
        self.create_inner(spec, None, None)
    }

    /// Starts a new sandbox from a snapshot (`Sandbox::snapshot`) of a container or VM:
    /// the same processes, memory and files as when it was taken. `owned` ties it to this
    /// process, as [`Runtime::create_owned`] does.
    pub fn restore(&self, snapshot: &Path, owned: bool) -> Result<Sandbox, RuntimeError> {
        let record: record::SnapshotHeader = record::read_snapshot(snapshot)?;
        let snapshot = std::fs::canonicalize(snapshot).map_err(RuntimeError::io(snapshot))?;
        let owner = if owned {
            let me = std::process::id();
            process_start(me).map(|start| (me, start))
        } else {
            None
        };
        self.create_inner(record.spec, owner, Some(snapshot))
    }

    /// Creates a sandbox owned by this process: if the process dies without destroying
    /// it, the next reap on this host does.
    pub fn create_owned(&self, spec: SandboxSpec) -> Result<Sandbox, RuntimeError> {
        let me = std::process::id();
        let owner = process_start(me).map(|start| (me, start));
        self.create_inner(spec, owner, None)
    }

    fn create_inner(
        &self,
        spec: SandboxSpec,
        owner: Option<(u32, u64)>,
        restore: Option<PathBuf>,
    ) -> Result<Sandbox, RuntimeError> {
        let backend = self.backend(spec.backend);
        if spec.privileged && !matches!(spec.backend, Backend::Microvm | Backend::Vm) {
            return Err(RuntimeError::Invalid(format!(
                "--privileged is for microvm and vm sandboxes (their own kernel is the boundary); a {} sandbox's commands share the host's kernel",
                spec.backend.as_str()
            )));
        }
        if spec.layers.is_empty() {
            return Err(RuntimeError::Invalid(
                "a sandbox needs at least a base layer".into(),
            ));
        }
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
        let dir = self.sandbox_dir(&id);
        std::fs::create_dir_all(&dir).map_err(RuntimeError::io(&dir))?;
        let lock = DirLock::take(&dir, true, true)?;
        // The key every conversation with the sandbox's agent proves (see `agent`).
        agent::write_key(&dir, &strata_agent_proto::SandboxKey::generate()?)?;
        let audit = self.audit(&id);
        audit.record(
            "created",
            json!({"identity": spec.identity, "catalog": spec.catalog_ref, "layers": spec.layers,
                   "backend": spec.backend, "limits": spec.limits, "network": spec.network}),
        )?;
        match self.build(&id, &dir, spec, backend, owner, restore) {
            Ok(record) => {
                drop(lock);
                Ok(Sandbox {
                    rt: self.clone(),
                    record,
                })
            }
            Err(e) => {
                drop(lock);
                let _ = audit.record("create-failed", json!({"error": e.to_string()}));
                if let Err(t) = self.teardown(&id, None, EndReason::Error) {
                    tracing::warn!("cleaning up after a failed create of {id}: {t}");
                }
                Err(e)
            }
        }
    }

    fn build(
        &self,
        id: &str,
        dir: &Path,
        spec: SandboxSpec,
        backend: &dyn SandboxBackend,
        owner: Option<(u32, u64)>,
        restore: Option<PathBuf>,
    ) -> Result<SandboxRecord, RuntimeError> {
        // On cgroup v2 the runtime's subtree must exist, with its controllers delegated,
        // before any backend (or the OCI runtime) makes the sandbox's group.
        self.inner.cgroups.prepare()?;
        let t = std::time::Instant::now();
        let host = Host {
            lazyfs: &self.inner.cfg.lazyfs,
            uppers: &self.inner.uppers,
            networks: &self.inner.networks,
            facts: self.inner.cfg.state_dir.join("layer-facts"),
        };
        let new = NewSandbox {
            id,
            dir,
            spec: &spec,
            hostname: format!("sandbox-{id}"),
            cgroup: self.cgroup(id),
            audit: self.audit(id),
            restore: restore.as_deref(),
        };
        let init_pid = backend.create(&host, &new)?;
        tracing::debug!(
            sandbox = id,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "created"
        );
        self.save_record(id, dir, spec, init_pid, owner)
    }

    fn save_record(
        &self,
        id: &str,
        dir: &Path,
        spec: SandboxSpec,
        init_pid: u32,
        owner: Option<(u32, u64)>,
    ) -> Result<SandboxRecord, RuntimeError> {
        let record = SandboxRecord {
            format: record::RECORD_FORMAT,
            id: id.to_string(),
            created_ms: audit::now_ms(),
            init_pid,
            init_start: process_start(init_pid).unwrap_or(0),
            owner,
            spec,
        };
        record.save(&dir.join("sandbox.json"))?;
        self.touch(id);
        Ok(record)
    }

    fn load(&self, id: &str) -> Result<SandboxRecord, RuntimeError> {
        let path = self.sandbox_dir(id).join("sandbox.json");
        if !path.exists() {
            return Err(RuntimeError::NotFound(id.to_string()));
        }
        SandboxRecord::load(&path)
    }

    /// A live sandbox by ID (or unique ID prefix).
    pub fn get(&self, id: &str) -> Result<Sandbox, RuntimeError> {
        // A whole ID (what the node service and scripts pass) is its directory: no
        // listing of every sandbox on the host.
        let exact = !id.is_empty() && !id.contains(['/', '.']);
        if exact && self.sandbox_dir(id).join("sandbox.json").is_file() {
            return Ok(Sandbox {
                rt: self.clone(),
                record: self.load(id)?,
            });
        }
        let ids = self.ids();
        let matches: Vec<&String> = ids.iter().filter(|i| i.starts_with(id)).collect();
        let id = match matches.as_slice() {
            [one] => one.as_str(),
            [] => return Err(RuntimeError::NotFound(id.to_string())),
            _ if ids.iter().any(|i| i == id) => id,
            _ => {
                return Err(RuntimeError::Invalid(format!(
                    "sandbox ID prefix `{id}` is ambiguous"
                )))
            }
        };
        Ok(Sandbox {
            rt: self.clone(),
            record: self.load(id)?,
        })
    }

    fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = std::fs::read_dir(self.inner.cfg.state_dir.join("sandboxes"))
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    // `.gone-*`: a sandbox directory being removed (see `teardown`).
                    .filter(|n| !n.starts_with('.'))
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        ids
    }

    /// Every live sandbox on this host.
    pub fn list(&self) -> Vec<SandboxRecord> {
        self.ids()
            .iter()
            .filter_map(|id| self.load(id).ok())
            .collect()
    }

    /// Seconds since a sandbox was last used.
    pub fn idle_for(&self, id: &str) -> Duration {
        std::fs::metadata(self.sandbox_dir(id).join("active"))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .unwrap_or_default()
    }

    /// Reaps now; the report also holds what the reap at [`Runtime::open`] removed, the
    /// first time it is asked for.
    pub fn reap_report(&self) -> Result<ReapReport, RuntimeError> {
        let mut report = std::mem::take(
            &mut *self
                .inner
                .opened_with
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        report.merge(self.reap()?);
        Ok(report)
    }

    /// Destroys sandboxes whose init died or whose idle TTL passed, and removes cgroups,
    /// mounts, uppers and OCI state that belong to no sandbox.
    pub fn reap(&self) -> Result<ReapReport, RuntimeError> {
        let mut report = ReapReport::default();
        for id in self.ids() {
            let dir = self.sandbox_dir(&id);
            // A sandbox being created or running a command holds its lock, and one being
            // ended has its live ender's marker: leave them.
            if being_ended(&dir) {
                continue;
            }
            let lock = match DirLock::take(&dir, true, false) {
                Ok(Some(lock)) => lock,
                Ok(None) => continue,
                // Removed meanwhile by whoever ended it.
                Err(_) if !dir.exists() => continue,
                Err(e) => {
                    tracing::warn!("reaping sandbox {id}: {e}");
                    continue;
                }
            };
            let record = self.load(&id).ok();
            let hibernated = dir
                .join(sandbox::HIBERNATION_DIR)
                .join(sandbox::HIBERNATION_MARK)
                .exists();
            let reason = reap_decision(
                record.as_ref(),
                hibernated,
                age(&dir),
                self.idle_for(&id),
                &|pid, start| process_start(pid) == Some(start),
            );
            drop(lock);
            if let (None, false, Some(r)) = (reason, hibernated, &record) {
                let idle_past = r
                    .spec
                    .limits
                    .auto_hibernate
                    .is_some_and(|after| self.idle_for(&id) >= after);
                if idle_past && self.backend(r.spec.backend).hibernates() {
                    let sb = Sandbox {
                        rt: self.clone(),
                        record: r.clone(),
                    };
                    // A command running now is activity: it is left alone (busy).
                    match sb.hibernate_waiting(Duration::ZERO) {
                        Ok(_) => {
                            let _ = self.audit(&id).record(
                                "auto-hibernated",
                                json!({"idle_s": self.idle_for(&id).as_secs()}),
                            );
                            report.hibernated.push(id.clone());
                        }
                        Err(RuntimeError::Busy(_)) => {}
                        Err(e) => tracing::warn!("hibernating idle sandbox {id}: {e}"),
                    }
                }
            }
            if let (Some(EndReason::Crashed), Some(r)) = (reason, &record) {
                let _ = self.audit(&id).record(
                    "init-gone",
                    json!({"init_pid": r.init_pid, "recorded_start": r.init_start,
                           "now_start": process_start(r.init_pid),
                           "stat": std::fs::read_to_string(format!("/proc/{}/stat", r.init_pid)).ok()}),
                );
            }
            if let Some(reason) = reason {
                // One stubborn sandbox must not stop the reaping of the others.
                if let Err(e) = self.teardown(&id, record.as_ref(), reason) {
                    tracing::warn!("reaping sandbox {id}: {e}");
                    continue;
                }
                match reason {
                    EndReason::IdleTtl => report.expired.push(id),
                    EndReason::Crashed | EndReason::OwnerGone => report.crashed.push(id),
                    _ => report.orphans.push(id),
                }
            }
        }
        // Directories a teardown moved aside and did not get to remove (it died): their
        // mounts were undone before the move.
        if let Ok(rd) = std::fs::read_dir(self.inner.cfg.state_dir.join("sandboxes")) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                // `.gone-<id>-<pid>-<n>`: left when the process that moved it is gone.
                let remover = name.rsplit('-').nth(1).and_then(|p| p.parse::<u32>().ok());
                let abandoned = remover.is_some_and(|pid| process_start(pid).is_none());
                if name.starts_with(".gone-")
                    && abandoned
                    && std::fs::remove_dir_all(e.path()).is_ok()
                {
                    report.orphans.push(format!("directory {name}"));
                }
            }
        }
        // A sandbox directory is made before anything else of a sandbox, so what has no
        // directory *now* belongs to no sandbox, even while others are being created.
        let live = |id: &str| self.sandbox_dir(id).exists();
        for id in network::existing(&self.inner.networks) {
            if !live(&id) {
                network::teardown(&self.inner.networks, &id);
                report.orphans.push(format!("network {id}"));
            }
        }
        report
            .orphans
            .extend((0..self.inner.fncall.drain(true)).map(|_| "stale pooled agent".to_string()));
        for id in self.inner.cgroups.existing() {
            // Pooled agents' cgroups belong to their pool slots, while those exist.
            if id
                .strip_prefix("pool-")
                .is_some_and(|slot| self.inner.fncall.has_slot(slot))
            {
                continue;
            }
            if !live(&id) {
                let cg = self.cgroup(&id);
                cg.kill_all();
                let _ = cg.remove();
                self.inner.container.forget(&id);
                report.orphans.push(format!("cgroup {id}"));
            }
        }
        if self.ids().is_empty() && self.inner.fncall.pooled().is_empty() {
            self.inner.cgroups.remove_parent();
        }
        for name in self.uppers().entries() {
            if !live(&name) && !self.uppers().is_pooled(&name) {
                match self.uppers().remove(&name) {
                    Ok(()) => report.orphans.push(format!("upper {name}")),
                    Err(e) => tracing::warn!("removing the upper of {name}: {e}"),
                }
            }
        }
        Ok(report)
    }

    /// Removes everything of sandbox `id`, whatever state it is in.
    pub(crate) fn teardown(
        &self,
        id: &str,
        record: Option<&SandboxRecord>,
        reason: EndReason,
    ) -> Result<(), RuntimeError> {
        let dir = self.sandbox_dir(id);
        let cgroup = self.cgroup(id);
        // One ender per sandbox: a destroy and a reap racing (the reaper sees the init the
        // destroy just killed) must not both tear down, nor record two ends.
        if dir.exists() && !claim_end(&dir) {
            if reason == EndReason::Destroyed {
                // Someone else is ending it; wait until it is gone.
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                while dir.exists() && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            return Ok(());
        }
        // Kill first, so a running exec holding the shared lock ends.
        let t = std::time::Instant::now();
        match record {
            Some(r) => self.backend(r.spec.backend).stop(r, &cgroup)?,
            None => {
                cgroup.kill_all();
                self.inner.container.forget(id);
            }
        }
        let stop_ms = t.elapsed().as_secs_f64() * 1e3;
        let _lock = match DirLock::take(&dir, true, true) {
            Ok(lock) => lock,
            Err(_) if !dir.exists() => None,
            Err(e) => return Err(e),
        };
        self.inner.container.forget(id);
        // A namespace of ours, or a record that says there is one (a network changed
        // while the sandbox ran may have one with an empty allowlist, or be half-wired).
        let networked = record.is_some_and(|r| !r.spec.network.is_empty());
        if networked || network::maybe_wired(&self.inner.networks, id) {
            let refused = network::refused(id);
            if !refused.is_empty() {
                let destinations: Vec<&str> = refused
                    .attempts
                    .iter()
                    .map(|a| a.destination.as_str())
                    .collect();
                let _ = self.audit(id).record(
                    "network-refused",
                    json!({
                        "destinations": destinations,
                        "attempts": refused.attempts,
                        "untracked_packets": refused.untracked_packets,
                    }),
                );
            }
            let egress = network::egress_log(&self.inner.networks, id);
            if !egress.entries.is_empty() || egress.dropped > 0 {
                let _ = self.audit(id).record(
                    "network-egress",
                    json!({"entries": egress.entries, "dropped": egress.dropped}),
                );
            }
            network::teardown(&self.inner.networks, id);
        }
        let t = std::time::Instant::now();
        cgroup.remove()?;
        let cgroup_ms = t.elapsed().as_secs_f64() * 1e3;
        // A hibernated container's pinned network namespace.
        checkpoint::unpin_netns(&dir.join(checkpoint::NETNS_PIN))?;
        changes::remove_copies(&dir)?;
        let t = std::time::Instant::now();
        let overlay_gone = rootfs::disassemble(&self.inner.cfg.lazyfs, &dir)?;
        let rootfs_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = std::time::Instant::now();
        // Only an upper no overlay can still write to goes to another sandbox.
        let recycled = overlay_gone && self.uppers().recycle(id);
        if !recycled {
            self.uppers().remove(id)?;
        }
        tracing::debug!(
            sandbox = id,
            stop_ms,
            cgroup_ms,
            rootfs_ms,
            upper_ms = t.elapsed().as_secs_f64() * 1e3,
            recycled,
            "torn down"
        );
        let _ = self
            .audit(id)
            .record("ended", json!({"reason": reason.as_str()}));
        // Out of the way first, in one rename: a reaper or a caller that still finds the
        // directory by its path (taking its lock, touching its activity file) would
        // otherwise create files in it while it is being removed.
        let gone = self
            .inner
            .cfg
            .state_dir
            .join("sandboxes")
            .join(format!(".gone-{id}-{}", unique_suffix()));
        let doomed = match std::fs::rename(&dir, &gone) {
            Ok(()) => gone,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(_) => dir,
        };
        match std::fs::remove_dir_all(&doomed) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError::io(&doomed)(e)),
        }
    }
}

/// Whether the reaper ends a sandbox, and why: `record` as found (none while it is being
/// created), how long its directory has existed and it has been idle, and whether a
/// process (PID, start time) still runs.
/// How long a sandbox directory without a record (and without its maker holding its
/// lock) is left alone: the moment between the directory appearing and its lock taken.
const RECORDLESS_GRACE: Duration = Duration::from_secs(5);

pub(crate) fn reap_decision(
    record: Option<&SandboxRecord>,
    hibernated: bool,
    dir_age: Duration,
    idle: Duration,
    running: &dyn Fn(u32, u64) -> bool,
) -> Option<EndReason> {
    match record {
        // No record yet. Its maker holds the directory's lock from a moment after the
        // directory appears until the record is written, so a reaper that got the lock
        // finds a maker that died (a CLI killed mid-create): reaped once past that moment.
        None if dir_age < RECORDLESS_GRACE => None,
        None => Some(EndReason::Error),
        // Nothing runs and nothing idles: it waits on disk until woken or destroyed.
        Some(_) if hibernated => None,
        Some(r) if !running(r.init_pid, r.init_start) => Some(EndReason::Crashed),
        Some(r) if idle > r.spec.limits.idle_ttl => Some(EndReason::IdleTtl),
        Some(SandboxRecord {
            owner: Some((pid, start)),
            ..
        }) if !running(*pid, *start) => Some(EndReason::OwnerGone),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_claimed_by_a_dead_ender_is_taken_over_at_once_and_a_live_ones_is_not() {
        let dir = tempfile::tempdir().unwrap();
        assert!(claim_end(dir.path()), "the first claim");
        // This process is a live ender: a second claim (of another process, or thread)
        // waits for it.
        assert!(being_ended(dir.path()));
        assert!(!claim_end(dir.path()));
        // An ender that died mid-teardown (no process has PID 0's start time of 1).
        std::fs::write(dir.path().join("ending"), "4194303 1\n").unwrap();
        assert!(!being_ended(dir.path()));
        assert!(claim_end(dir.path()), "taken over from a dead ender");
        // An older build's empty marker counts for a minute.
        std::fs::write(dir.path().join("ending"), "").unwrap();
        assert!(being_ended(dir.path()));
        assert!(!claim_end(dir.path()));
    }

    fn record(owner: Option<(u32, u64)>) -> SandboxRecord {
        SandboxRecord {
            format: record::RECORD_FORMAT,
            id: "abc".into(),
            spec: SandboxSpec {
                catalog_ref: String::new(),
                layers: vec!["ab".into()],
                backend: Backend::Fncall,
                limits: Limits::from_budgets(&strata_catalog::Budgets {
                    idle_ttl: Some("30m".into()),
                    ..Default::default()
                })
                .unwrap(),
                env: Default::default(),
                workdir: "/".into(),
                user: "root".into(),
                network: Vec::new(),
                commands: Default::default(),
                identity: String::new(),
                display: false,
                disk_image: None,
                privileged: false,
                views: Vec::new(),
            },
            created_ms: 0,
            init_pid: 100,
            init_start: 7,
            owner,
        }
    }

    #[test]
    fn the_reaper_ends_crashed_idle_and_orphaned_sandboxes_only() {
        let min = |m: u64| Duration::from_secs(m * 60);
        // Running: init 100 (started at 7) and owner 200 (started at 9).
        let running = |pid: u32, start: u64| (pid, start) == (100, 7) || (pid, start) == (200, 9);
        let healthy = record(Some((200, 9)));
        assert_eq!(
            reap_decision(Some(&healthy), false, min(5), min(1), &running),
            None
        );
        // The init's PID now belongs to another process (another start time).
        let mut reused = record(None);
        reused.init_start = 8;
        assert_eq!(
            reap_decision(Some(&reused), false, min(5), min(1), &running),
            Some(EndReason::Crashed)
        );
        assert_eq!(
            reap_decision(Some(&healthy), false, min(5), min(31), &running),
            Some(EndReason::IdleTtl)
        );
        let orphan = record(Some((200, 10)));
        assert_eq!(
            reap_decision(Some(&orphan), false, min(5), min(1), &running),
            Some(EndReason::OwnerGone)
        );
        // Being made (its lock free a moment): left alone, then an error.
        assert_eq!(
            reap_decision(None, false, Duration::from_secs(1), min(0), &running),
            None
        );
        assert_eq!(
            reap_decision(None, false, Duration::from_secs(10), min(0), &running),
            Some(EndReason::Error)
        );
        assert_eq!(
            reap_decision(None, false, min(2), min(0), &running),
            Some(EndReason::Error)
        );
        // Hibernated: no init runs, it is idle past its TTL, its owner is gone: kept.
        assert_eq!(
            reap_decision(Some(&reused), true, min(5), min(31), &running),
            None
        );
        assert_eq!(
            reap_decision(Some(&orphan), true, min(5), min(1), &running),
            None
        );
    }
}
