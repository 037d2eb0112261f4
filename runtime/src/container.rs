//! The container backend: an OCI bundle (generated with `oci-spec`) over the sandbox's
//! overlay root, run detached by an OCI runtime binary (crun by default, runc supported).
//! With the static agent the container's init is `strata-agent init`, executed from a
//! descriptor the runtime passes (nothing of the host's layout is mounted or named inside),
//! serving on a listening socket and taking the sandbox key from a pipe, both passed the
//! same way; commands are forked by it. Without one, the init is catatonit in pause mode,
//! bound in read-only from the host, and commands enter with `<runtime> exec`.
//!
//! Debian's crun refuses hybrid cgroup hosts ("cgroups in hybrid mode not supported"). On
//! such a host (and only there) every crun call runs in a private mount namespace in which
//! the cgroup2 mount at /sys/fs/cgroup/unified is detached, so crun sees plain v1 and
//! works; on v1 and v2 hosts crun runs as it is.
//!
//! Every OCI runtime call runs in a launch mount namespace (`strata_host::mountns`): a
//! copy of the host's mount table without any sandbox's mounts, into which a `run` carries
//! its own root and network namespace. The container's namespace is copied from it, so
//! neither that copy nor crun's reading of the table grows with the sandboxes on the node.

use std::ffi::CStr;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{mpsc, Arc, OnceLock};

use oci_spec::runtime::{
    Capability, LinuxBuilder, LinuxCpuBuilder, LinuxMemoryBuilder, LinuxPidsBuilder,
    LinuxResourcesBuilder, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder,
    LinuxSeccompBuilder, LinuxSeccompOperator, LinuxSyscallBuilder, Mount, MountBuilder,
    PosixRlimitBuilder, PosixRlimitType, ProcessBuilder, RootBuilder, Spec, UserBuilder,
};
use strata_agent_proto::policy::{self, KEPT_CAPS};

use crate::backend::{HibernateInfo, Host, NewSandbox, SandboxBackend, SandboxRef, SnapshotInfo};
use crate::cgroup::Cgroup;
use crate::checkpoint::HostCheckpoints;
use crate::exec::ExecEnv;
use crate::exec::{drive, Collected, Event, ExecRequest, RawExit, Stdin, Stream, OUTPUT_QUEUE};
use crate::hostroot::{self, HostRoot};
use crate::record::SandboxRecord;
use crate::RuntimeError;

/// Which OCI runtime binary runs containers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OciRuntime {
    Crun(PathBuf),
    Runc(PathBuf),
}

impl OciRuntime {
    /// `crun`, `runc`, or a path whose file name says which.
    pub fn parse(text: &str) -> Result<OciRuntime, RuntimeError> {
        let name = Path::new(text)
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or(text);
        let path = PathBuf::from(text);
        if name.starts_with("crun") {
            Ok(OciRuntime::Crun(path))
        } else if name.starts_with("runc") {
            Ok(OciRuntime::Runc(path))
        } else {
            Err(RuntimeError::Invalid(format!(
                "OCI runtime `{text}`: expected crun or runc (or a path to one)"
            )))
        }
    }

    pub fn binary(&self) -> &Path {
        match self {
            OciRuntime::Crun(p) | OciRuntime::Runc(p) => p,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            OciRuntime::Crun(_) => "crun",
            OciRuntime::Runc(_) => "runc",
        }
    }
}

#[derive(Clone)]
pub struct ContainerBackend {
    /// Checkpoints containers for hibernation; none: they cannot hibernate.
    pub(crate) criu: Option<crate::checkpoint::Criu>,
    /// Where a networked container's named namespace is.
    pub(crate) networks: crate::network::Networks,
    pub runtime: OciRuntime,
    /// The runtime's own state directory (`--root`).
    pub state_root: PathBuf,
    /// A static init binary bound into every container (catatonit), used when there is
    /// no static agent.
    pub init: PathBuf,
    /// A statically linked `strata-agent`: when set, it is the container's init and runs
    /// every command (no `exec` of the OCI runtime per command).
    pub agent: Option<PathBuf>,
    /// The host mounts cgroup2 beside its v1 controllers, which Debian's crun refuses:
    /// every crun call then runs with that mount detached.
    pub hybrid_cgroups: bool,
    /// Where the OCI runtime's calls run.
    pub(crate) launch: Arc<hostroot::LaunchNamespace>,
    /// crun's binary as a sealed in-memory copy, made at its first call (see
    /// [`ContainerBackend::oci_command`]); none where it cannot be made.
    pub(crate) sealed_crun: Arc<OnceLock<Option<OwnedFd>>>,
}

/// The statically linked agent for container init found beside the binary `exe`: the one
/// `cargo build --target x86_64-unknown-linux-gnu` (with crt-static; scripts/test.sh and
/// scripts/demo.sh do it) put in the same profile. The `strata` binary uses it when no
/// static agent is configured (`STRATA_STATIC_AGENT`). Without one containers keep
/// catatonit as init and run commands with `<oci runtime> exec`.
pub fn static_agent_for(exe: &Path) -> Option<PathBuf> {
    let profile_dir = exe.parent()?;
    let candidate = profile_dir
        .parent()?
        .join("x86_64-unknown-linux-gnu")
        .join(profile_dir.file_name()?)
        .join("strata-agent");
    candidate.is_file().then_some(candidate)
}

/// Where a container's own init (catatonit, without the static agent) is bound, inside
/// the container.
pub const RUNTIME_DIR: &str = "/.strata";
const INIT_PATH: &str = "/.strata/init";
/// The descriptors the agent gets in the container's init, in this order: the host's
/// listening socket, the pipe holding the sandbox key, the agent's executable.
const LISTEN_FD: i32 = 3;
const KEY_FD: i32 = 4;
const AGENT_FD: i32 = 5;

impl ContainerBackend {
    /// The engine that made container `id`: this one, or the other OCI runtime if its
    /// state directory (a sibling of ours) holds the container, so a sandbox made under
    /// `STRATA_OCI_RUNTIME=runc` is still exec'd and removed by runc.
    fn engine_for(&self, id: &str) -> ContainerBackend {
        if self.state_root.join(id).exists() {
            return self.clone();
        }
        let other = match self.runtime {
            OciRuntime::Crun(_) => OciRuntime::Runc(PathBuf::from("runc")),
            OciRuntime::Runc(_) => OciRuntime::Crun(PathBuf::from("crun")),
        };
        let root = self.state_root.with_file_name(other.name());
        if root.join(id).exists() {
            return ContainerBackend {
                criu: self.criu.clone(),
                networks: self.networks.clone(),
                runtime: other,
                state_root: root,
                init: self.init.clone(),
                agent: self.agent.clone(),
                hybrid_cgroups: self.hybrid_cgroups,
                launch: self.launch.clone(),
                sealed_crun: Arc::default(),
            };
        }
        self.clone()
    }
}

/// A policy's path list as the OCI spec takes it.
fn strings(paths: &[&str]) -> Vec<String> {
    paths.iter().map(|p| p.to_string()).collect()
}

/// The shared policy's capabilities as an OCI set: bounding, effective and permitted;
/// nothing inheritable or ambient (ambient must be a subset of inheritable).
fn kept_capabilities() -> Result<oci_spec::runtime::LinuxCapabilities, RuntimeError> {
    let caps: oci_spec::runtime::Capabilities = KEPT_CAPS
        .iter()
        .filter_map(|(name, _)| serde_json::from_value::<Capability>(serde_json::json!(name)).ok())
        .collect();
    oci_spec::runtime::LinuxCapabilitiesBuilder::default()
        .bounding(caps.clone())
        .effective(caps.clone())
        .permitted(caps)
        .inheritable(oci_spec::runtime::Capabilities::new())
        .ambient(oci_spec::runtime::Capabilities::new())
        .build()
        .map_err(|e| RuntimeError::Internal(format!("OCI spec: {e}")))
}

impl ContainerBackend {
    /// A command running the OCI runtime. crun makes itself a read-only copy of its binary
    /// and executes that again at every start, unless its binary already is a sealed
    /// memfd (so that no container can write the host's binary through
    /// `/proc/<pid>/exe`, CVE-2019-5736): a second start of a dynamic binary per call.
    /// The copy is made once per process and every call runs it, `argv[0]` unchanged;
    /// crun then skips its own (measured: one exec fewer per `crun run`).
    fn oci_command(&self) -> Command {
        match self.sealed_crun() {
            Some(fd) => {
                let mut cmd = Command::new(format!("/proc/self/fd/{}", fd.as_raw_fd()));
                cmd.arg0(self.runtime.binary());
                cmd
            }
            None => Command::new(self.runtime.binary()),
        }
    }

    /// The sealed copy of crun's binary, made at the first call; none for runc (whose
    /// guard differs) or where it cannot be made.
    fn sealed_crun(&self) -> Option<&OwnedFd> {
        if !matches!(self.runtime, OciRuntime::Crun(_)) {
            return None;
        }
        let binary = self.runtime.binary();
        self.sealed_crun
            .get_or_init(|| {
                sealed_copy(binary)
                    .inspect_err(|e| {
                        tracing::warn!(
                            "no sealed copy of {} ({e}): it copies itself at every call",
                            binary.display()
                        )
                    })
                    .ok()
            })
            .as_ref()
    }

    fn command(&self) -> Command {
        self.command_passing(Vec::new(), &[])
    }

    /// The mount the OCI runtime must not see: the cgroup2 mount of a hybrid host, which
    /// Debian's crun refuses to run beside.
    fn hidden_mount(&self) -> Option<&'static CStr> {
        let hybrid = matches!(self.runtime, OciRuntime::Crun(_)) && self.hybrid_cgroups;
        hybrid.then_some(c"/sys/fs/cgroup/unified")
    }

    /// The OCI runtime command, in a launch namespace with the mounts at `carry` brought
    /// in from the host's; `pass` become its descriptors 3, 4, ... in order (for
    /// `--preserve-fds`).
    fn command_passing(&self, pass: Vec<i32>, carry: &[&Path]) -> Command {
        let mut cmd = self.oci_command();
        cmd.arg("--root").arg(&self.state_root);
        let hide = self.hidden_mount().map(CStr::to_owned);
        let launched = self.launch.template().and_then(|template| {
            let carried = carry
                .iter()
                .map(|p| strata_host::mountns::carry(p))
                .collect::<std::io::Result<Vec<_>>>()
                .inspect_err(|e| tracing::warn!("carrying a mount into the launch namespace: {e}"))
                .ok()?;
            strata_host::mountns::enter(&mut cmd, template, carried, hide.clone()).ok()
        });
        match launched {
            // The namespace hook runs first and uses its own descriptors; the hide is done.
            Some(()) => strata_host::exec::pass_fds_and_hide(&mut cmd, pass, None),
            None => strata_host::exec::pass_fds_and_hide(&mut cmd, pass, hide),
        }
        cmd
    }

    fn run_checked(&self, args: &[&str], what: &str) -> Result<(), RuntimeError> {
        self.run_logged(args, what, None, &[], &[])
    }

    /// Runs the OCI runtime. Its stderr goes to a file, not a pipe: a detached container's
    /// init inherits the runtime's stdio and would hold a pipe open forever.
    fn run_logged(
        &self,
        args: &[&str],
        what: &str,
        log: Option<&Path>,
        pass: &[BorrowedFd<'_>],
        carry: &[&Path],
    ) -> Result<(), RuntimeError> {
        let tmp = self
            .state_root
            .join(format!("{what}-{}.log", crate::unique_suffix()));
        let log = log.unwrap_or(&tmp);
        let file = std::fs::File::create(log).map_err(RuntimeError::io(log))?;
        let cannot_run = |e: std::io::Error| {
            RuntimeError::Setup(format!(
                "cannot run {}: {e} (install it with scripts/setup.sh)",
                self.runtime.binary().display()
            ))
        };
        let status = match self.launch.template() {
            // Started without a fork of this process (see `mountns::spawn_in`).
            Some(template) => {
                let mut cmd = self.oci_command();
                cmd.arg("--root").arg(&self.state_root).args(args);
                let launch = strata_host::mountns::Launch {
                    carry,
                    hide: self.hidden_mount(),
                    pass,
                    stderr: file.as_fd(),
                };
                strata_host::mountns::spawn_in(&mut cmd, template, &launch)
                    .and_then(|mut child| child.wait())
                    .map_err(cannot_run)?
            }
            None => {
                let raw = pass.iter().map(|fd| fd.as_raw_fd()).collect();
                self.command_passing(raw, carry)
                    .args(args)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(file)
                    .status()
                    .map_err(cannot_run)?
            }
        };
        let message = std::fs::read_to_string(log).unwrap_or_default();
        if log == tmp {
            let _ = std::fs::remove_file(log);
        }
        if !status.success() {
            return Err(RuntimeError::Oci {
                engine: self.runtime.name(),
                what: what.to_string(),
                message: message.trim().to_string(),
            });
        }
        Ok(())
    }

    fn spec(&self, new: &NewSandbox, root: &HostRoot) -> Result<Spec, RuntimeError> {
        let bad = |e: oci_spec::OciSpecError| RuntimeError::Internal(format!("OCI spec: {e}"));
        let capabilities = kept_capabilities()?;
        let process = ProcessBuilder::default()
            .terminal(false)
            .args(match &self.agent {
                Some(_) => vec![
                    format!("/proc/self/fd/{AGENT_FD}"),
                    "init".to_string(),
                    "--listen-fd".to_string(),
                    LISTEN_FD.to_string(),
                    "--key-fd".to_string(),
                    KEY_FD.to_string(),
                ],
                None => vec![INIT_PATH.to_string(), "-P".to_string()],
            })
            .env(vec![format!("PATH={}", crate::spec::DEFAULT_PATH)])
            .cwd("/")
            .user(
                UserBuilder::default()
                    .uid(0u32)
                    .gid(0u32)
                    .build()
                    .map_err(bad)?,
            )
            .no_new_privileges(true)
            .capabilities(capabilities)
            .rlimits(vec![PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitCore)
                .hard(0u64)
                .soft(0u64)
                .build()
                .map_err(bad)?])
            .build()
            .map_err(bad)?;
        // /dev and /dev/shm are tmpfs, whose pages count against the memory budget: sized
        // below it (see `policy::shm_bytes`), so filling them is a refused write, never
        // an OOM kill of the agent.
        let tmpfs_size = |dest: &std::path::Path| match dest.to_str() {
            Some("/dev") => Some(strata_agent_proto::policy::DEV_TMPFS_BYTES),
            Some("/dev/shm") => Some(strata_agent_proto::policy::shm_bytes(
                new.spec.limits.memory_bytes,
            )),
            _ => None,
        };
        let mut mounts: Vec<Mount> = oci_spec::runtime::get_default_mounts()
            .into_iter()
            .filter(|m| !m.destination().starts_with("/sys/fs/cgroup"))
            .map(|mut m| {
                if let Some(bytes) = tmpfs_size(m.destination()) {
                    let options = m
                        .options()
                        .iter()
                        .flatten()
                        .filter(|o| !o.starts_with("size="))
                        .cloned()
                        .chain([format!("size={bytes}")])
                        .collect();
                    m.set_options(Some(options));
                }
                m
            })
            .collect();
        if self.agent.is_none() {
            mounts.push(
                MountBuilder::default()
                    .destination(INIT_PATH)
                    .typ("bind")
                    .source(&self.init)
                    .options(vec![
                        "bind".into(),
                        "ro".into(),
                        "nosuid".into(),
                        "nodev".into(),
                    ])
                    .build()
                    .map_err(bad)?,
            );
        }
        let limits = &new.spec.limits;
        let mut cpu = LinuxCpuBuilder::default();
        if let Some(c) = limits.cpus {
            cpu = cpu
                .period(100_000u64)
                .quota(((c * 100_000.0).round() as i64).max(1000));
        }
        let resources = LinuxResourcesBuilder::default()
            .memory(
                LinuxMemoryBuilder::default()
                    .limit(limits.memory_bytes as i64)
                    .swap(limits.memory_bytes as i64)
                    .build()
                    .map_err(bad)?,
            )
            .pids(
                LinuxPidsBuilder::default()
                    .limit(limits.pids as i64)
                    .build()
                    .map_err(bad)?,
            )
            .cpu(cpu.build().map_err(bad)?)
            .build()
            .map_err(bad)?;
        let mut linux = LinuxBuilder::default();
        // With the static agent as init, the policy's whole filter (the allowlist, the
        // denied set and the denied arguments) is the agent's own, loaded before it serves
        // anything: an OCI filter under it would only repeat its allowlist, and libseccomp
        // compiling one costs every `crun run` about 1.7 ms (12% of it, measured). Without
        // the agent (catatonit as init) the OCI filter is all there is.
        if self.agent.is_none() {
            linux = linux.seccomp(oci_seccomp().map_err(bad)?);
        }
        let linux = linux
            .namespaces(
                oci_spec::runtime::get_default_namespaces()
                    .into_iter()
                    .filter(|n| n.typ() != oci_spec::runtime::LinuxNamespaceType::Cgroup)
                    .map(|mut n| {
                        if n.typ() == oci_spec::runtime::LinuxNamespaceType::Network {
                            n.set_path(root.netns.clone());
                        }
                        n
                    })
                    .collect::<Vec<_>>(),
            )
            .cgroups_path(PathBuf::from(new.cgroup.oci_path()))
            .resources(resources)
            .masked_paths(strings(policy::MASKED_PATHS))
            .readonly_paths(strings(policy::READONLY_PATHS))
            .build()
            .map_err(bad)?;
        let mut spec = Spec::default();
        spec.set_process(Some(process));
        spec.set_root(Some(
            RootBuilder::default()
                .path(&root.rootfs)
                .readonly(false)
                .build()
                .map_err(bad)?,
        ));
        spec.set_hostname(Some(new.hostname.clone()));
        spec.set_mounts(Some(mounts));
        spec.set_linux(Some(linux));
        Ok(spec)
    }

    fn exec_process(&self, env: &ExecEnv) -> Result<oci_spec::runtime::Process, RuntimeError> {
        let bad = |e: oci_spec::OciSpecError| RuntimeError::Internal(format!("OCI spec: {e}"));
        ProcessBuilder::default()
            .terminal(false)
            .args(env.argv.clone())
            .env(
                env.env
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>(),
            )
            .cwd(&env.cwd)
            .user(
                UserBuilder::default()
                    .uid(env.uid)
                    .gid(env.gid)
                    .build()
                    .map_err(bad)?,
            )
            .no_new_privileges(true)
            .capabilities(kept_capabilities()?)
            .build()
            .map_err(bad)
    }
}

impl ContainerBackend {
    /// What checkpointing this container takes: CRIU, and the static agent as its init
    /// (catatonit's containers take each command through the OCI runtime, whose state a
    /// restore would not match).
    fn checkpointing(&self, sb: &SandboxRef) -> Result<HostCheckpoints<'_>, RuntimeError> {
        let found = self.checkpointer()?;
        if !crate::agent::socket_path(sb.dir).exists() {
            return Err(RuntimeError::Unsupported(
                "checkpointing a container needs the static agent as its init (this one runs catatonit): build it as scripts/test.sh does".into(),
            ));
        }
        Ok(found)
    }

    /// CRIU and the static agent, which every checkpoint and restore takes.
    fn checkpointer(&self) -> Result<HostCheckpoints<'_>, RuntimeError> {
        HostCheckpoints::of(
            self.criu.as_ref(),
            self.agent.as_deref(),
            &self.networks,
            "container",
        )
    }
}

impl SandboxBackend for ContainerBackend {
    fn create(&self, host: &Host, new: &NewSandbox) -> Result<u32, RuntimeError> {
        if let Some(snapshot) = new.restore {
            return self.checkpointer()?.restore_copy(host, new, snapshot);
        }
        let root = hostroot::prepare(host, new, None)?;
        std::fs::create_dir_all(&self.state_root).map_err(RuntimeError::io(&self.state_root))?;
        let bundle = new.dir.join("bundle");
        std::fs::create_dir_all(&bundle).map_err(RuntimeError::io(&bundle))?;
        let spec = self.spec(new, &root)?;
        let config = bundle.join("config.json");
        spec.save(&config)
            .map_err(|e| RuntimeError::Internal(format!("writing {}: {e}", config.display())))?;
        let pid_file = new.dir.join("init.pid");
        // With the agent as init, the host makes its listening socket (outside anything the
        // sandbox sees), a pipe holding the key and a descriptor of the agent's binary,
        // and hands them over as descriptors 3, 4 and 5.
        let passed = match &self.agent {
            Some(agent) => {
                let sock = crate::agent::socket_path(new.dir);
                let _ = std::fs::remove_file(&sock);
                let listener = strata_host::unix::bind(&sock).map_err(RuntimeError::io(&sock))?;
                let (key_r, key_w) =
                    nix::unistd::pipe().map_err(|e| RuntimeError::Setup(format!("pipe: {e}")))?;
                let key = crate::agent::read_key(new.dir)?;
                std::fs::File::from(key_w)
                    .write_all(key.to_hex().as_bytes())
                    .map_err(|e| RuntimeError::Setup(format!("passing the sandbox key: {e}")))?;
                let exe = std::fs::File::open(agent).map_err(RuntimeError::io(agent))?;
                Some((listener, key_r, exe))
            }
            None => None,
        };
        let bundle_arg = bundle.display().to_string();
        let pid_arg = pid_file.display().to_string();
        let mut args = vec![
            "run",
            "--detach",
            "--bundle",
            &bundle_arg,
            "--pid-file",
            &pid_arg,
        ];
        if passed.is_some() {
            args.extend(["--preserve-fds", "3"]);
        }
        args.push(new.id);
        let fds = passed
            .as_ref()
            .map(|(l, k, e)| vec![l.as_fd(), k.as_fd(), e.as_fd()])
            .unwrap_or_default();
        // The root (with any views mounted over it) and the network namespace to join are
        // the host's mounts this run needs in its launch namespace.
        let mut carry = vec![root.rootfs.as_path()];
        carry.extend(root.netns.as_deref());
        let t = std::time::Instant::now();
        self.run_logged(&args, "run", Some(&new.dir.join("oci.log")), &fds, &carry)?;
        tracing::debug!(
            sandbox = new.id,
            run_ms = t.elapsed().as_secs_f64() * 1e3,
            "OCI runtime ran"
        );
        drop(passed);
        let pid = std::fs::read_to_string(&pid_file)
            .map_err(RuntimeError::io(&pid_file))?
            .trim()
            .parse()
            .map_err(|_| RuntimeError::Oci {
                engine: self.runtime.name(),
                what: "run".into(),
                message: format!("bad pid in {}", pid_file.display()),
            })?;
        Ok(pid)
    }

    fn exec(
        &self,
        sb: &SandboxRef,
        env: &ExecEnv,
        req: &ExecRequest,
        sink: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<Collected, RuntimeError> {
        let (rec, dir, cgroup) = (sb.record, sb.dir, sb.cgroup);
        if crate::agent::socket_path(dir).exists() {
            return crate::agent::AgentClient::of(dir)?.exec(cgroup, env, req, sink);
        }
        let n = crate::audit::now_ms();
        let process_file = dir.join(format!("exec-{n}-{}.json", std::process::id()));
        let pid_file = process_file.with_extension("pid");
        let process = self.exec_process(env)?;
        std::fs::write(
            &process_file,
            serde_json::to_vec(&process).map_err(|e| RuntimeError::Internal(e.to_string()))?,
        )
        .map_err(RuntimeError::io(&process_file))?;
        let engine = self.engine_for(&rec.id);
        let mut cmd = engine.command();
        cmd.arg("exec")
            .arg("--process")
            .arg(&process_file)
            .arg("--pid-file")
            .arg(&pid_file)
            .arg(&rec.id)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd.stdin(match &req.stdin {
            Stdin::Null => Stdio::null(),
            Stdin::Bytes(_) | Stdin::Feed(_) => Stdio::piped(),
            Stdin::Inherit => Stdio::inherit(),
        });
        let before: std::collections::HashSet<u32> = cgroup.pids().into_iter().collect();
        let mut child = cmd.spawn().map_err(|e| {
            RuntimeError::Setup(format!(
                "cannot run {}: {e}",
                self.runtime.binary().display()
            ))
        })?;
        let (tx, rx) = mpsc::sync_channel(OUTPUT_QUEUE);
        let mut readers = Vec::new();
        for (src, stream) in [
            (
                child
                    .stdout
                    .take()
                    .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
                Stream::Stdout,
            ),
            (
                child
                    .stderr
                    .take()
                    .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
                Stream::Stderr,
            ),
        ] {
            if let Some(src) = src {
                readers.push(crate::backend::pump(src, stream, tx.clone()));
            }
        }
        match (&req.stdin, child.stdin.take()) {
            (Stdin::Bytes(data), Some(mut stdin)) => {
                let data = data.clone();
                std::thread::spawn(move || {
                    let _ = std::io::Write::write_all(&mut stdin, &data);
                });
            }
            (Stdin::Feed(feed), Some(mut stdin)) => {
                let chunks = feed.take();
                std::thread::spawn(move || {
                    for chunk in chunks.into_iter().flatten() {
                        if std::io::Write::write_all(&mut stdin, &chunk).is_err() {
                            return;
                        }
                    }
                });
            }
            _ => {}
        }
        let waiter = std::thread::spawn(move || {
            let status = child.wait();
            // Buffered output is delivered; a background process that keeps the pipe open
            // does not hold the exec open beyond a short grace.
            let grace = std::time::Instant::now() + std::time::Duration::from_millis(200);
            for r in readers {
                while !r.is_finished() && std::time::Instant::now() < grace {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
            }
            let _ = tx.send(match status {
                Ok(s) => {
                    use std::os::unix::process::ExitStatusExt;
                    Event::Exited(RawExit {
                        code: s.code(),
                        signal: s.signal(),
                        guest: None,
                    })
                }
                Err(e) => Event::Failed(format!("waiting for the exec: {e}")),
            });
        });
        // On timeout, everything this command started dies, wherever it was re-parented;
        // what earlier commands left running stays. A cancel kills its own process tree.
        let result = drive(
            rx,
            env.timeout,
            req.kept_output(),
            req.cancel.as_ref(),
            sink,
            |why| match why {
                crate::exec::Kill::Timeout => cgroup.kill_except(&before),
                crate::exec::Kill::Cancel => {
                    let pid = std::fs::read_to_string(&pid_file)
                        .ok()
                        .and_then(|p| p.trim().parse::<u32>().ok());
                    match pid {
                        Some(pid) => crate::backend::kill_tree(cgroup, pid),
                        // Not started yet: nothing of it can run beside others.
                        None => cgroup.kill_except(&before),
                    }
                }
            },
        );
        let _ = waiter.join();
        let _ = std::fs::remove_file(&process_file);
        let _ = std::fs::remove_file(&pid_file);
        let collected = result.map_err(|message| RuntimeError::Oci {
            engine: engine.runtime.name(),
            what: "exec".into(),
            message,
        })?;
        // The OCI runtime reports a failure to start the process as its own exit status
        // with a message on stderr; keep it as the command's result.
        Ok(collected)
    }

    fn stop(&self, rec: &SandboxRecord, cgroup: &Cgroup) -> Result<(), RuntimeError> {
        cgroup.kill_all();
        let engine = self.engine_for(&rec.id);
        // With every process gone, what `delete` would still do is remove the runtime's
        // state and the cgroup's directories, which the teardown removes anyway (in every
        // hierarchy, see `Cgroup::remove`): the state goes here, without another run of
        // the OCI runtime (about 5 ms of CPU a destroy, a tenth of a create-exec-destroy).
        let state = engine.state_root.join(&rec.id);
        if cgroup.pids().is_empty() && std::fs::remove_dir_all(&state).is_ok() {
            return Ok(());
        }
        // `delete --force` kills what is left with SIGKILL itself.
        let _ = engine.run_checked(&["delete", "--force", &rec.id], "delete");
        Ok(())
    }

    fn hibernates(&self) -> bool {
        self.criu.is_some() && self.agent.is_some()
    }

    fn saves_memory(&self) -> bool {
        self.hibernates()
    }

    /// See [`HostCheckpoints::snapshot`].
    fn snapshot(&self, sb: &SandboxRef, dest: &Path) -> Result<SnapshotInfo, RuntimeError> {
        self.checkpointing(sb)?.snapshot(sb, dest)
    }

    /// See [`HostCheckpoints::hibernate`].
    fn hibernate(&self, sb: &SandboxRef, to: &Path) -> Result<HibernateInfo, RuntimeError> {
        self.checkpointing(sb)?.hibernate(sb, to)
    }

    /// See [`HostCheckpoints::wake`].
    fn wake(&self, sb: &SandboxRef, from: &Path, paused: bool) -> Result<u32, RuntimeError> {
        self.checkpointing(sb)?.wake(sb, from, paused)
    }

    fn runtime_written_paths(&self, spec: &crate::SandboxSpec) -> Vec<String> {
        let mut paths = hostroot::runtime_written_paths(spec);
        if self.agent.is_none() {
            // Catatonit's bind mount point.
            paths.push(RUNTIME_DIR.trim_start_matches('/').to_string());
        }
        paths
    }

    fn forget(&self, id: &str) {
        let engine = self.engine_for(id);
        if engine.state_root.join(id).exists() {
            let _ = engine.run_checked(&["delete", "--force", id], "delete");
            let _ = std::fs::remove_dir_all(engine.state_root.join(id));
        }
    }
}

/// A memfd holding a copy of the file `binary` (a name without a slash is looked up on
/// the PATH, as a command's is), sealed the way crun checks for (its every seal: no write,
/// growth, shrinking or further seals).
fn sealed_copy(binary: &Path) -> std::io::Result<OwnedFd> {
    use nix::fcntl::{FcntlArg, SealFlag};
    use nix::sys::memfd::{memfd_create, MFdFlags};
    let path = match binary.to_str() {
        Some(name) if !name.contains('/') => crate::on_path(name)
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "not on the PATH"))?,
        _ => binary.to_path_buf(),
    };
    let fd = memfd_create(
        c"crun_cloned:/proc/self/exe",
        MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
    )?;
    let mut copy = std::fs::File::from(fd);
    std::io::copy(&mut std::fs::File::open(&path)?, &mut copy)?;
    let seals = SealFlag::F_SEAL_SEAL
        | SealFlag::F_SEAL_SHRINK
        | SealFlag::F_SEAL_GROW
        | SealFlag::F_SEAL_WRITE;
    nix::fcntl::fcntl(&copy, FcntlArg::F_ADD_SEALS(seals))?;
    Ok(copy.into())
}

/// The policy's seccomp filter in OCI terms (libseccomp builds it in crun or runc), for a
/// container without the static agent: the allowlist passes, denied syscalls are answered
/// EPERM, unlisted ones ENOSYS. libseccomp drops a syscall's rules with arguments beside
/// its unconditional allow, so `clone` and `socket` are allowed only on the complement of
/// their denied arguments (no namespace flag; another family) and refused otherwise. The
/// denied `ioctl` requests are not here: "any request but these masked patterns" is no one
/// comparison. The static agent loads the policy's own filters, all of it, on itself (its
/// `seccomp_programs`), and a container whose init it is gets no OCI filter.
fn oci_seccomp() -> Result<LinuxSeccomp, oci_spec::OciSpecError> {
    // libseccomp lets a syscall's unconditional rule shadow its conditional ones, so the
    // syscalls whose arguments are refused are allowed on the complement of the refusal
    // instead: clone without a namespace flag, socket of another family.
    const ON_ARGUMENTS: [&str; 2] = ["clone", "socket"];
    let names = |list: &'static [&'static str]| -> Vec<String> {
        policy::resolve(list)
            .map(|(n, _)| n.to_string())
            .filter(|n| !ON_ARGUMENTS.contains(&n.as_str()))
            .collect()
    };
    let mut syscalls = vec![
        LinuxSyscallBuilder::default()
            .names(names(policy::ALLOWED_SYSCALLS))
            .action(LinuxSeccompAction::ScmpActAllow)
            .build()?,
        LinuxSyscallBuilder::default()
            .names(names(policy::DENIED_SYSCALLS))
            .action(LinuxSeccompAction::ScmpActErrno)
            .errno_ret(libc::EPERM as u32)
            .build()?,
    ];
    let rule = |name: &str, allow: bool, op: LinuxSeccompOperator, value: u64, two| {
        let mut arg = LinuxSeccompArgBuilder::default()
            .index(0usize)
            .value(value)
            .op(op);
        if let Some(two) = two {
            arg = arg.value_two(two);
        }
        let mut syscall = LinuxSyscallBuilder::default()
            .names(vec![name.to_string()])
            .args(vec![arg.build()?]);
        syscall = if allow {
            syscall.action(LinuxSeccompAction::ScmpActAllow)
        } else {
            syscall
                .action(LinuxSeccompAction::ScmpActErrno)
                .errno_ret(libc::EPERM as u32)
        };
        syscall.build()
    };
    let masked = LinuxSeccompOperator::ScmpCmpMaskedEq;
    let any_namespace = policy::NAMESPACE_FLAGS.iter().fold(0, |a, f| a | f);
    syscalls.push(rule("clone", true, masked, any_namespace, Some(0))?);
    for flag in policy::NAMESPACE_FLAGS {
        syscalls.push(rule("clone", false, masked, *flag, Some(*flag))?);
    }
    // The complement of one family is one comparison; of more, it would take ranges.
    let [(_, family)] = policy::DENIED_SOCKET_FAMILIES else {
        return Err(oci_spec::OciSpecError::Other(
            "the OCI seccomp filter expresses one denied socket family".into(),
        ));
    };
    syscalls.push(rule(
        "socket",
        true,
        LinuxSeccompOperator::ScmpCmpNe,
        *family,
        None,
    )?);
    syscalls.push(rule(
        "socket",
        false,
        LinuxSeccompOperator::ScmpCmpEq,
        *family,
        None,
    )?);
    LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActErrno)
        .default_errno_ret(policy::UNLISTED_ERRNO as u32)
        .architectures(vec![if cfg!(target_arch = "aarch64") {
            oci_spec::runtime::Arch::ScmpArchAarch64
        } else {
            oci_spec::runtime::Arch::ScmpArchX86_64
        }])
        .syscalls(syscalls)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copy crun is run from carries exactly the seals crun takes for its own copy
    /// (any other set and crun copies itself again), holds the binary, and refuses writes.
    #[test]
    fn the_sealed_copy_has_cruns_seals_and_refuses_writes() {
        use nix::fcntl::{FcntlArg, SealFlag};
        let dir = tempfile::tempdir().unwrap();
        let binary = dir.path().join("tool");
        std::fs::write(&binary, b"\x7fELF not really").unwrap();
        let fd = sealed_copy(&binary).unwrap();
        let seals = nix::fcntl::fcntl(&fd, FcntlArg::F_GET_SEALS).unwrap();
        let want = SealFlag::F_SEAL_SEAL
            | SealFlag::F_SEAL_SHRINK
            | SealFlag::F_SEAL_GROW
            | SealFlag::F_SEAL_WRITE;
        assert_eq!(seals, want.bits());
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        assert_eq!(std::fs::read(&path).unwrap(), b"\x7fELF not really");
        let write = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"x"));
        assert!(write.is_err(), "a write to the sealed copy succeeded");
        let missing = sealed_copy(Path::new("no-such-tool-on-the-path"));
        assert!(missing.is_err());
    }
}
