//! Process checkpoints of a host sandbox (a container or a fncall sandbox) with CRIU: what
//! a hibernation saves of its process tree (the static agent as the tree's root, every
//! process under it, their memory, descriptors, namespaces and mounts) and how a wake
//! restores it over the same root, in a fresh PID namespace; and the snapshots forks and
//! store snapshots take of it ([`HostCheckpoints`]).
//!
//! What lives outside the sandbox is named to CRIU rather than saved: the sandbox's root
//! (its overlay mount stays mounted on the host while it hibernates), the named network
//! namespace of a networked sandbox, the binds of the host's device files (`/dev/null`
//! over masked kernel files, a fncall sandbox's /dev nodes), and the agent's own
//! executable (a host file, handed back at the restore). The agent holds nothing else of
//! the host's when it is saved: it parks first (see `strata_agent_proto::HostMsg::Park`),
//! and after the restore its parked socket is bound and made to listen again from here
//! ([`rebind_agent`]).
//!
//! Landlock domains are not visible to a checkpoint, so the restore runs with the build's
//! `--landlock-children` (scripts/criu/landlock-children.patch): every tree under the
//! agent comes back in a domain of its own, as each exec's tree started in one, so a
//! process that survived a hibernation still cannot reach the agent or a later exec.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

use crate::backend::{HibernateInfo, Host, NewSandbox, SandboxRef, SnapshotInfo};
use crate::cgroup::Cgroup;
use crate::RuntimeError;

/// Where `scripts/criu.sh` installs CRIU.
pub const INSTALLED_CRIU: &str = "/usr/local/lib/strata/criu/criu";

/// The CRIU `scripts/criu.sh` installed, if it did.
pub fn installed_criu() -> Option<PathBuf> {
    Some(PathBuf::from(INSTALLED_CRIU)).filter(|p| p.is_file())
}

/// Where the images go inside a hibernation directory.
const IMAGES: &str = "criu";
/// Where the CRIU that scripts/criu.sh builds keeps its cache of the kernel's features (its
/// RUNDIR, set there): CRIU keeps the cache only on a tmpfs, so that a reboot clears it,
/// and /run is not one on every host (not on this project's own); /dev/shm is. Probing
/// anew costs 30-70 ms per run.
const KDAT_DIR: &str = "/dev/shm/strata-criu";
/// What a restore needs besides the images.
const PLAN: &str = "checkpoint.json";
/// The key the named network namespace is saved under.
const NETNS_KEY: &str = "strata-netns";
/// The largest file deleted while open that a checkpoint saves (CRIU's default is 1 MiB).
const GHOST_LIMIT: &str = "64M";
/// The agent's listening descriptor (see `container::LISTEN_FD`).
pub(crate) const AGENT_LISTEN_FD: i32 = 3;

/// Where a hibernating sandbox's own network namespace (one without an allowlist, made
/// by the OCI runtime or the fncall agent) is pinned: a bind of its nsfs file in the
/// sandbox's directory, so it outlives the tree and the wake restores into it as into a
/// named one, instead of CRIU rebuilding it with `ip` and `iptables-restore` (about 40 ms
/// of every wake).
pub(crate) const NETNS_PIN: &str = "netns.pin";

/// Pins the network namespace of process `pid` at `at` (see [`NETNS_PIN`]).
pub(crate) fn pin_netns(pid: u32, at: &Path) -> Result<(), RuntimeError> {
    File::create(at).map_err(RuntimeError::io(at))?;
    let ns = PathBuf::from(format!("/proc/{pid}/ns/net"));
    nix::mount::mount(
        Some(&ns),
        at,
        None::<&str>,
        nix::mount::MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| {
        let _ = std::fs::remove_file(at);
        RuntimeError::Setup(format!("pinning {} at {}: {e}", ns.display(), at.display()))
    })
}

/// A new network namespace with its loopback up, pinned at `at` (see [`NETNS_PIN`]).
fn fresh_netns(at: &Path) -> Result<(), RuntimeError> {
    File::create(at).map_err(RuntimeError::io(at))?;
    let made = crate::run_tool(
        Command::new("unshare")
            .arg(format!("--net={}", at.display()))
            .args(["ip", "link", "set", "lo", "up"]),
        None,
    );
    if made.is_err() {
        let _ = unpin_netns(at);
    }
    made.map(|_| ())
}

/// Drops a pin [`pin_netns`] made (nothing when there is none).
pub(crate) fn unpin_netns(at: &Path) -> Result<(), RuntimeError> {
    crate::rootfs::unmount_below(at)?;
    match std::fs::remove_file(at) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(RuntimeError::io(at)(e)),
        _ => Ok(()),
    }
}

/// What a checkpoint recorded for its restore.
#[derive(Debug, Serialize, Deserialize)]
struct Plan {
    /// CRIU's key of the agent's executable (`file[MNT:INODE]`).
    exe_key: String,
    /// The agent binary's identity when saved: a restore maps the same file again, so a
    /// changed binary is refused rather than mapped under the saved code.
    agent_tag: String,
    /// Masked kernel files (binds of `/dev/null`), inside the sandbox (a plan's of an
    /// earlier build; [`Plan::device_binds`] holds them now).
    #[serde(default)]
    masked_files: Vec<String>,
    /// Binds of the host's device files inside the sandbox: where, and which device
    /// (`/dev/null` over masked kernel files; a fncall sandbox's /dev nodes).
    #[serde(default)]
    device_binds: Vec<(String, String)>,
    /// Whether the sandbox's network namespace is a named one left in place.
    external_netns: bool,
    /// A copy's checkpoint ([`DumpKind::Copy`]): its TCP connections were not saved and
    /// come back closed.
    #[serde(default)]
    tcp_closed: bool,
}

/// What a checkpoint is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DumpKind {
    /// Hibernation: the tree ends once saved, and comes back as it was, its TCP
    /// connections repaired.
    Hibernate,
    /// A snapshot or fork: the tree runs on (frozen as the caller left it), and each
    /// restored copy is a new sandbox elsewhere, in a network namespace of its own: its
    /// TCP connections (whose addresses are the original's) come back closed.
    Copy,
}

/// A CRIU binary and how this host runs it.
#[derive(Debug, Clone)]
pub struct Criu {
    pub binary: PathBuf,
}

/// What [`Criu::dump`] saves and how.
pub(crate) struct Dump<'a> {
    pub init_pid: u32,
    pub cgroup: &'a Cgroup,
    /// Where the checkpoint goes (a hibernation or snapshot directory).
    pub to: &'a Path,
    /// The sandbox's own directory (a failure's log is kept there).
    pub sandbox_dir: &'a Path,
    /// The named network namespace the sandbox is in, if it is one.
    pub netns: Option<&'a Path>,
    /// The agent binary (for its identity).
    pub agent: &'a Path,
    pub kind: DumpKind,
}

/// What [`Criu::restore`] restores and how.
pub(crate) struct Restore<'a> {
    pub from: &'a Path,
    pub root: &'a Path,
    pub cgroup: &'a Cgroup,
    pub netns: Option<&'a Path>,
    pub agent: &'a Path,
    /// Where the restored init's PID is written.
    pub pid_file: &'a Path,
    /// The directory of the sandbox restored into (a failure's log is kept there).
    pub sandbox_dir: &'a Path,
    /// A copy (a fork's child or a snapshot's restore), not a wake: a tree saved in a
    /// named network namespace (one a network update gave it) and restored into a
    /// sandbox without one gets a fresh namespace of its own, holding only loopback.
    pub copy: bool,
}

fn agent_tag(agent: &Path) -> Result<String, RuntimeError> {
    crate::agent::binary_identity(agent).map_err(RuntimeError::io(agent))
}

/// The mount ID and inode of the file behind `link` (a `/proc/PID/...` link).
fn file_key(link: &Path) -> Result<String, RuntimeError> {
    use std::os::unix::fs::MetadataExt;
    let f = File::open(link).map_err(RuntimeError::io(link))?;
    let ino = f.metadata().map_err(RuntimeError::io(link))?.ino();
    let info_path = PathBuf::from(format!("/proc/self/fdinfo/{}", f.as_raw_fd()));
    let info = std::fs::read_to_string(&info_path).map_err(RuntimeError::io(&info_path))?;
    let mnt: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("mnt_id:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| RuntimeError::Internal(format!("no mnt_id in {}", info_path.display())))?;
    Ok(format!("file[{mnt:x}:{ino:x}]"))
}

/// The device files a sandbox's init `pid` has bound from the host's /dev (mounts of
/// one of [`HOST_DEVICES`] from a devtmpfs, and the masks over kernel files, as its mount
/// table shows them): where each is inside, and the host's device. A checkpoint names them external; a restore binds
/// the host's devices there again.
fn device_binds(pid: u32) -> Vec<(String, String)> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    table
        .lines()
        .filter_map(|l| {
            let (mount, source) = l.split_once(" - ")?;
            let f: Vec<&str> = mount.split_whitespace().collect();
            // Field 4 is the mount's root within its filesystem, 5 its mount point.
            let (root, at) = (*f.get(3)?, *f.get(4)?);
            let device = root.strip_prefix('/')?;
            // The OCI runtime's masks are binds of the container's /dev/null, whatever
            // its filesystem.
            let masked = device == "null" && strata_agent_proto::policy::MASKED_PATHS.contains(&at);
            let from_host = source.split_whitespace().next() == Some("devtmpfs");
            (HOST_DEVICES.contains(&device) && (from_host || masked))
                .then(|| (at.to_string(), format!("/dev/{device}")))
        })
        .collect()
}

/// The host's device files a sandbox may have bound inside (see `confine` in the agent).
const HOST_DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

/// The last error lines of a CRIU log, as a message.
fn log_errors(log: &Path) -> String {
    let mut text = String::new();
    if let Ok(mut f) = File::open(log) {
        let mut buf = Vec::new();
        let _ = f.by_ref().take(64 << 20).read_to_end(&mut buf);
        text = String::from_utf8_lossy(&buf).into_owned();
    }
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Error") && !l.contains("RLIMIT_NOFILE"))
        .collect();
    let tail = &errors[errors.len().saturating_sub(4)..];
    if tail.is_empty() {
        format!("see {}", log.display())
    } else {
        format!("{} (log: {})", tail.join("; "), log.display())
    }
}

impl Criu {
    /// Runs CRIU; a failure's log is kept in `sandbox_dir` as `<what>-failed.log` (what a
    /// failed checkpoint or restore leaves is removed).
    fn run(
        &self,
        mut cmd: Command,
        what: &str,
        log: &Path,
        sandbox_dir: &Path,
    ) -> Result<(), RuntimeError> {
        own_kdat_dir()?;
        let out = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| {
                RuntimeError::Setup(format!(
                    "cannot run CRIU at {}: {e} (scripts/criu.sh builds it)",
                    self.binary.display()
                ))
            })?;
        if !out.status.success() {
            let kept = sandbox_dir.join(format!("{what}-failed.log"));
            if std::fs::copy(log, &kept).is_ok() {
                return Err(RuntimeError::Checkpoint(format!(
                    "{what} failed: {}",
                    log_errors(&kept)
                )));
            }
            // It stopped before it had a log: what it printed says why.
            let said = String::from_utf8_lossy(&out.stderr);
            let said = said.trim();
            let from = (said.len().saturating_sub(2000)..said.len())
                .find(|&i| said.is_char_boundary(i))
                .unwrap_or(0);
            return Err(RuntimeError::Checkpoint(format!(
                "{what} failed before CRIU wrote its log ({}): {}",
                out.status,
                &said[from..]
            )));
        }
        Ok(())
    }

    /// Saves the tree of `d.init_pid` under `d.to`; a hibernation's tree ends (its
    /// processes exit), a copy's runs on. A cgroup the caller froze stays frozen.
    pub(crate) fn dump(&self, d: &Dump) -> Result<u64, RuntimeError> {
        let images = crate::absolute(&d.to.join(IMAGES));
        std::fs::create_dir_all(&images).map_err(RuntimeError::io(&images))?;
        for p in [d.to, images.as_path()] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o700))
                .map_err(RuntimeError::io(p))?;
        }
        let exe_key = file_key(Path::new(&format!("/proc/{}/exe", d.init_pid)))?;
        let plan = Plan {
            exe_key,
            agent_tag: agent_tag(d.agent)?,
            masked_files: Vec::new(),
            device_binds: device_binds(d.init_pid),
            external_netns: d.netns.is_some(),
            tcp_closed: d.kind == DumpKind::Copy,
        };
        let log = images.join("dump.log");
        let mut cmd = Command::new(&self.binary);
        cmd.arg("dump")
            .arg("--tree")
            .arg(d.init_pid.to_string())
            .arg("--images-dir")
            .arg(&images)
            .arg("--log-file")
            .arg(&log)
            .args(["-v2", "--manage-cgroups=ignore", "--file-locks"]);
        match d.kind {
            // TCP connections are saved with TCP repair; one not yet accepted is dropped
            // (its client sees a reset).
            DumpKind::Hibernate => cmd.args([
                "--tcp-established",
                "--skip-in-flight",
                "--network-lock",
                "nftables",
            ]),
            // The original keeps its connections (nothing is locked or repaired).
            DumpKind::Copy => cmd.args(["--leave-running", "--tcp-close"]),
        };
        // Files deleted while open are saved with the images, up to this size each.
        cmd.args(["--ghost-limit", GHOST_LIMIT])
            .arg("--freeze-cgroup")
            .arg(d.cgroup.freezer_dir())
            .arg("--external")
            .arg(&plan.exe_key);
        for (at, _) in &plan.device_binds {
            cmd.arg("--ext-mount-map").arg(format!("{at}:{at}"));
        }
        if let Some(ns) = d.netns {
            use std::os::unix::fs::MetadataExt;
            let ino = std::fs::metadata(ns).map_err(RuntimeError::io(ns))?.ino();
            cmd.arg("--external").arg(format!("net[{ino}]:{NETNS_KEY}"));
        }
        // A process in uninterruptible sleep (state D: a read from lazyfs or the disk,
        // slow on a loaded host) cannot be seized within CRIU's timeout. A failed dump
        // leaves the tree running as it was, so it is tried again, into emptied images.
        let args: Vec<std::ffi::OsString> = cmd.get_args().map(|a| a.to_os_string()).collect();
        let mut tries = 1;
        loop {
            let mut cmd = Command::new(&self.binary);
            cmd.args(&args);
            match self.run(cmd, "checkpoint", &log, d.sandbox_dir) {
                Err(RuntimeError::Checkpoint(m))
                    if tries < 3
                        && m.contains("Unseizable non-zombie")
                        && m.contains("state D") =>
                {
                    tracing::info!(sandbox = %d.sandbox_dir.display(), tries, "a process was in state D; checkpointing again");
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_secs(1));
                    std::fs::remove_dir_all(&images).map_err(RuntimeError::io(&images))?;
                    std::fs::create_dir_all(&images).map_err(RuntimeError::io(&images))?;
                    std::fs::set_permissions(&images, std::fs::Permissions::from_mode(0o700))
                        .map_err(RuntimeError::io(&images))?;
                }
                result => break result?,
            }
        }
        let plan_path = d.to.join(PLAN);
        std::fs::write(
            &plan_path,
            serde_json::to_vec(&plan).map_err(|e| RuntimeError::Internal(e.to_string()))?,
        )
        .map_err(RuntimeError::io(&plan_path))?;
        Ok(dir_bytes(&images))
    }

    /// Restores what [`Criu::dump`] saved under `r.from` over the root `r.root`, inside
    /// `r.cgroup`; the restored init's PID. Its agent is parked: [`rebind_agent`] next.
    pub(crate) fn restore(&self, r: &Restore) -> Result<u32, RuntimeError> {
        let images = crate::absolute(&r.from.join(IMAGES));
        let plan_path = r.from.join(PLAN);
        let plan: Plan = serde_json::from_slice(
            &std::fs::read(&plan_path).map_err(RuntimeError::io(&plan_path))?,
        )
        .map_err(|e| RuntimeError::Invalid(format!("{}: {e}", plan_path.display())))?;
        if agent_tag(r.agent)? != plan.agent_tag {
            return Err(RuntimeError::Checkpoint(format!(
                "the agent binary {} changed since this sandbox hibernated (the saved agent maps its code from that file); wake it with the build that hibernated it, or destroy it",
                r.agent.display()
            )));
        }
        let fresh = r.sandbox_dir.join(NETNS_PIN);
        let netns = match (plan.external_netns, r.netns) {
            (false, _) => None,
            (true, Some(p)) => Some(File::open(p).map_err(RuntimeError::io(p))?),
            (true, None) if r.copy => {
                fresh_netns(&fresh)?;
                let ns = File::open(&fresh).map_err(RuntimeError::io(&fresh));
                // The restored tree (or nothing, after a failure) holds it from here.
                unpin_netns(&fresh)?;
                Some(ns?)
            }
            (true, None) => {
                return Err(RuntimeError::Checkpoint(
                    "the sandbox's network namespace is gone".into(),
                ))
            }
        };
        let exe = File::open(r.agent).map_err(RuntimeError::io(r.agent))?;
        // The sandbox's own: a fork restores one snapshot several times at once, and
        // nothing is written into the snapshot (it is removed while the copies run on).
        let log = crate::absolute(&r.sandbox_dir.join("restore.log"));
        let _ = std::fs::remove_file(r.pid_file);
        let mut cmd = Command::new(&self.binary);
        cmd.arg("restore")
            .arg("--images-dir")
            .arg(&images)
            .arg("--log-file")
            .arg(&log)
            .args(["-v2", "--manage-cgroups=ignore", "--file-locks"])
            .arg("--restore-detached")
            .arg("--root")
            .arg(crate::absolute(r.root))
            .arg("--pidfile")
            .arg(crate::absolute(r.pid_file))
            // The passed descriptors are 3 (the agent's executable) and 4 (the netns).
            .arg("--inherit-fd")
            .arg(format!("fd[3]:{}", plan.exe_key));
        // As the agent scopes each exec (Landlock ABI 2+: Linux 5.19).
        // Connections to repair lock the network meanwhile (about 15 ms): only when some
        // were saved.
        if plan.tcp_closed {
            cmd.arg("--tcp-close");
        } else if has_tcp_streams(&images) {
            cmd.args(["--tcp-established", "--network-lock", "nftables"]);
        }
        if strata_host::landlock_abi() >= 2 {
            cmd.arg("--landlock-children");
        }
        let earlier = plan
            .masked_files
            .iter()
            .map(|m| (m.clone(), "/dev/null".to_string()));
        for (at, device) in plan.device_binds.iter().cloned().chain(earlier) {
            cmd.arg("--ext-mount-map").arg(format!("{at}:{device}"));
        }
        let mut pass = vec![exe.as_raw_fd()];
        if let Some(ns) = &netns {
            pass.push(ns.as_raw_fd());
            cmd.arg("--inherit-fd").arg(format!("fd[4]:{NETNS_KEY}"));
        }
        strata_host::exec::pass_fds_and_hide(&mut cmd, pass, None);
        // Restored tasks are forked by CRIU: in the sandbox's cgroup from the start.
        r.cgroup.join_on_exec(&mut cmd)?;
        self.run(cmd, "restore", &log, r.sandbox_dir)?;
        let _ = std::fs::remove_file(&log);
        drop((exe, netns));
        let pid = std::fs::read_to_string(r.pid_file)
            .map_err(RuntimeError::io(r.pid_file))?
            .trim()
            .parse()
            .map_err(|_| {
                RuntimeError::Checkpoint(format!("bad PID in {}", r.pid_file.display()))
            })?;
        Ok(pid)
    }
}

/// A host sandbox's snapshot's copy of its writable layer; beside it are the checkpoint
/// (`criu/`, `checkpoint.json`), the key its agent proves and the record
/// (`crate::record::SnapshotHeader`).
const UPPER_COPY: &str = "upper.img";

/// The checkpoints of a host sandbox (a container or a fncall sandbox) whose init is the
/// static agent: hibernation, snapshots and forks with processes, and their restores.
/// Both backends' trees are the agent as init, parked for the checkpoint, over an overlay
/// root mounted on the host, in the sandbox's cgroup and network namespace.
pub(crate) struct HostCheckpoints<'a> {
    pub criu: &'a Criu,
    /// The static agent: every checkpointed init's executable.
    pub agent: &'a Path,
    pub networks: &'a crate::network::Networks,
}

impl<'a> HostCheckpoints<'a> {
    /// A backend's checkpoints, when it has CRIU and the static agent; `backend` names it
    /// in the refusal.
    pub(crate) fn of(
        criu: Option<&'a Criu>,
        agent: Option<&'a Path>,
        networks: &'a crate::network::Networks,
        backend: &str,
    ) -> Result<HostCheckpoints<'a>, RuntimeError> {
        let Some(criu) = criu else {
            return Err(RuntimeError::Unsupported(format!(
                "checkpointing a {backend} sandbox (hibernate, a snapshot or fork with processes) needs CRIU: build it with scripts/criu.sh (or set STRATA_CRIU to a CRIU 4.1+ built with scripts/criu/landlock-children.patch); pause it (memory kept) or commit its files meanwhile"
            )));
        };
        let Some(agent) = agent else {
            return Err(RuntimeError::Unsupported(format!(
                "checkpointing a {backend} sandbox needs the static agent as its init: build it as scripts/test.sh does"
            )));
        };
        Ok(HostCheckpoints {
            criu,
            agent,
            networks,
        })
    }

    /// Starts a new sandbox from the snapshot `snapshot` ([`HostCheckpoints::snapshot`]):
    /// a root whose upper is a copy of the snapshot's, a cgroup with the sandbox's budgets,
    /// and the saved tree restored into it, in fresh namespaces. The copy then gets its own
    /// identity: the new sandbox's key, host name and machine ID. (Its processes' own
    /// memory is the original's: a PRNG seeded in userspace continues the same stream.)
    pub(crate) fn restore_copy(
        &self,
        host: &Host,
        new: &NewSandbox,
        snapshot: &Path,
    ) -> Result<u32, RuntimeError> {
        let (criu, agent) = (self.criu, self.agent);
        let header: crate::record::SnapshotHeader = crate::record::read_snapshot(snapshot)?;
        if header.spec.backend != new.spec.backend {
            return Err(RuntimeError::Invalid(format!(
                "{} is a snapshot of a {} sandbox, not of a {} one",
                snapshot.display(),
                header.spec.backend.as_str(),
                new.spec.backend.as_str()
            )));
        }
        let root = crate::hostroot::prepare(host, new, Some(&snapshot.join(UPPER_COPY)))?;
        let l = &new.spec.limits;
        new.cgroup.create(l.memory_bytes, l.cpus, l.pids)?;
        let socket = crate::agent::socket_path(new.dir);
        let pid = criu.restore(&Restore {
            from: snapshot,
            root: &root.rootfs,
            cgroup: &new.cgroup,
            netns: root.netns.as_deref(),
            agent,
            pid_file: &new.dir.join("init.pid"),
            sandbox_dir: new.dir,
            copy: true,
        })?;
        rebind_agent(pid, &socket, std::time::Duration::from_secs(10))?;
        set_hostname(pid, &new.hostname)?;
        let machine_id = root.rootfs.join("etc/machine-id");
        if std::fs::symlink_metadata(&machine_id).is_ok() {
            let id = uuid::Uuid::new_v4().simple().to_string();
            crate::files::write_file(
                &root.rootfs,
                "/etc/machine-id",
                format!("{id}\n").as_bytes(),
                0o444,
            )?;
        }
        // The restored agent proves the key it was saved with, until it takes this one.
        crate::agent::AgentClient::at(socket, Some(crate::agent::read_key(snapshot)?))
            .rekey(&crate::agent::read_key(new.dir)?)?;
        Ok(pid)
    }

    /// Checkpoints the process tree (it runs on) and copies the writable layer, both
    /// while the tree is frozen, so the files its processes hold open are as they expect
    /// (a restore checks their sizes); see [`HostCheckpoints::restore_copy`].
    pub(crate) fn snapshot(
        &self,
        sb: &SandboxRef,
        dest: &Path,
    ) -> Result<SnapshotInfo, RuntimeError> {
        let t = std::time::Instant::now();
        let (criu, agent) = (self.criu, self.agent);
        let was_paused = sb.cgroup.is_frozen();
        if was_paused {
            sb.cgroup.freeze(false)?;
        }
        let parked = crate::agent::AgentClient::of(sb.dir).and_then(|a| a.park());
        let parked_ok = parked.is_ok();
        let saved = parked.and_then(|()| {
            sb.cgroup.freeze(true)?;
            let netns = self.named_netns(&sb.record.id);
            let state_bytes = criu.dump(&Dump {
                init_pid: sb.record.init_pid,
                cgroup: sb.cgroup,
                to: dest,
                sandbox_dir: sb.dir,
                netns: netns.as_deref(),
                agent,
                kind: DumpKind::Copy,
            })?;
            let disk_bytes = sb
                .uppers
                .copy_mounted(&sb.record.id, &dest.join(UPPER_COPY))?;
            // A restored copy's agent proves the key it holds now.
            crate::agent::write_key(dest, &crate::agent::read_key(sb.dir)?)?;
            let record = crate::record::SnapshotHeader {
                format: crate::record::SNAPSHOT_FORMAT,
                spec: sb.record.spec.clone(),
                taken_ms: crate::audit::now_ms(),
            };
            let path = dest.join(crate::record::SNAPSHOT_RECORD);
            std::fs::write(
                &path,
                serde_json::to_vec_pretty(&record)
                    .map_err(|e| RuntimeError::Internal(e.to_string()))?,
            )
            .map_err(RuntimeError::io(&path))?;
            Ok((state_bytes, disk_bytes))
        });
        // Parked, the agent serves again once its socket is bound (frozen or not).
        let rebound = if parked_ok {
            rebind_agent(
                sb.record.init_pid,
                &crate::agent::socket_path(sb.dir),
                std::time::Duration::from_secs(5),
            )
        } else {
            Ok(())
        };
        let thawed = sb.cgroup.freeze(was_paused);
        let (state_bytes, disk_bytes) = saved?;
        rebound?;
        thawed?;
        Ok(SnapshotInfo {
            dir: dest.to_path_buf(),
            state_bytes,
            disk_bytes,
            millis: t.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Checkpoints the process tree with CRIU (see [`crate::checkpoint`]): the agent
    /// parks, the tree is saved under `to` and ends; its root stays mounted. A paused
    /// sandbox is thawed for the agent to park (the checkpoint freezes it again).
    pub(crate) fn hibernate(
        &self,
        sb: &SandboxRef,
        to: &Path,
    ) -> Result<HibernateInfo, RuntimeError> {
        let t = std::time::Instant::now();
        let (criu, agent) = (self.criu, self.agent);
        let was_paused = sb.cgroup.is_frozen();
        if was_paused {
            sb.cgroup.freeze(false)?;
        }
        if let Err(e) = crate::agent::AgentClient::of(sb.dir).and_then(|a| a.park()) {
            if was_paused {
                let _ = sb.cgroup.freeze(true);
            }
            return Err(e);
        }
        let pin = sb.dir.join(NETNS_PIN);
        let netns = match self.named_netns(&sb.record.id) {
            Some(named) => Some(named),
            None => match pin_netns(sb.record.init_pid, &pin) {
                Ok(()) => Some(pin.clone()),
                Err(e) => {
                    tracing::debug!(sandbox = %sb.record.id, error = %e, "its network namespace is saved with the checkpoint");
                    None
                }
            },
        };
        let dumped = criu.dump(&Dump {
            init_pid: sb.record.init_pid,
            cgroup: sb.cgroup,
            to,
            netns: netns.as_deref(),
            agent,
            kind: DumpKind::Hibernate,
            sandbox_dir: sb.dir,
        });
        match dumped {
            Ok(state_bytes) => {
                // The checkpoint ended the tree; nothing of it may outlive it.
                sb.cgroup.kill_all();
                Ok(HibernateInfo {
                    state_bytes,
                    millis: t.elapsed().as_secs_f64() * 1e3,
                })
            }
            Err(e) => {
                if let Err(u) = unpin_netns(&pin) {
                    tracing::warn!(sandbox = %sb.record.id, error = %u, "dropping the network namespace's pin");
                }
                // The tree runs on where it was (CRIU resumes it): its agent serves again.
                if let Err(again) = rebind_agent(
                    sb.record.init_pid,
                    &crate::agent::socket_path(sb.dir),
                    std::time::Duration::from_secs(5),
                ) {
                    tracing::warn!(sandbox = %sb.record.id, error = %again, "the agent of a sandbox whose checkpoint failed does not serve again");
                }
                if was_paused {
                    let _ = sb.cgroup.freeze(true);
                }
                Err(e)
            }
        }
    }

    /// Restores the checkpointed tree over the same root, in a fresh PID namespace and
    /// the sandbox's cgroup, and makes its agent serve again.
    pub(crate) fn wake(
        &self,
        sb: &SandboxRef,
        from: &Path,
        paused: bool,
    ) -> Result<u32, RuntimeError> {
        let (criu, agent) = (self.criu, self.agent);
        let pin = sb.dir.join(NETNS_PIN);
        let netns = self
            .named_netns(&sb.record.id)
            .or_else(|| Some(pin.clone()).filter(|p| p.exists()));
        let pid = criu.restore(&Restore {
            from,
            root: &sb.rootfs(),
            cgroup: sb.cgroup,
            netns: netns.as_deref(),
            agent,
            pid_file: &sb.dir.join("init.pid"),
            sandbox_dir: sb.dir,
            copy: false,
        })?;
        // The restored tree holds its network namespace now.
        unpin_netns(&pin)?;
        rebind_agent(
            pid,
            &crate::agent::socket_path(sb.dir),
            std::time::Duration::from_secs(10),
        )?;
        if paused {
            sb.cgroup.freeze(true)?;
        }
        Ok(pid)
    }

    /// The named network namespace of networked sandbox `id`, if it has one.
    fn named_netns(&self, id: &str) -> Option<PathBuf> {
        Some(self.networks.netns_path(id)).filter(|p| p.exists())
    }
}

/// Sets the host name in the UTS namespace of process `pid` (from a thread of its own,
/// which ends with the namespace switch).
fn set_hostname(pid: u32, name: &str) -> Result<(), RuntimeError> {
    let ns = PathBuf::from(format!("/proc/{pid}/ns/uts"));
    let file = std::fs::File::open(&ns).map_err(RuntimeError::io(&ns))?;
    let name = name.to_string();
    std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWUTS)?;
        nix::unistd::sethostname(name)
    })
    .join()
    .map_err(|_| RuntimeError::Internal("the host-name thread panicked".into()))?
    .map_err(|e| RuntimeError::Setup(format!("setting the restored sandbox's host name: {e}")))
}

/// Makes a parked agent serve again: its parked socket, bound at `socket` and
/// listening. Waits (up to `within`) for the agent to have parked it.
pub(crate) fn rebind_agent(
    init_pid: u32,
    socket: &Path,
    within: std::time::Duration,
) -> Result<(), RuntimeError> {
    let deadline = std::time::Instant::now() + within;
    let _ = std::fs::remove_file(socket);
    loop {
        let sock = strata_host::unix::take_fd(init_pid, AGENT_LISTEN_FD).map_err(|e| {
            RuntimeError::AgentGone(format!("taking the parked agent's socket: {e}"))
        })?;
        match strata_host::unix::listen_at(&sock, socket) {
            Ok(()) => return Ok(()),
            // Not parked yet: its descriptor is still the old listener (bound already).
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => {
                return Err(RuntimeError::AgentGone(format!(
                    "binding the parked agent's socket at {}: {e}",
                    socket.display()
                )))
            }
        }
        if std::time::Instant::now() > deadline {
            return Err(RuntimeError::AgentGone(
                "the agent did not park its socket".into(),
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Whether the images under `dir` hold an established TCP connection.
fn has_tcp_streams(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("tcp-stream-"))
    })
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Makes [`KDAT_DIR`] root's own (a directory, 0700) before CRIU reads a cache there:
/// /dev/shm is writable by every user, and a planted cache would tell CRIU the kernel has
/// features it has not. Without /dev/shm CRIU just probes every time.
fn own_kdat_dir() -> Result<(), RuntimeError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let dir = Path::new(KDAT_DIR);
    for _ in 0..3 {
        match std::fs::symlink_metadata(dir) {
            Ok(m) if m.is_dir() && m.uid() == 0 && m.mode() & 0o7777 == 0o700 => return Ok(()),
            Ok(m) if m.is_dir() => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Ok(_) => {
                let _ = std::fs::remove_file(dir);
            }
            Err(_) => {}
        }
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            // Made by another process since: checked again.
            Err(_) => {}
        }
    }
    Err(RuntimeError::Checkpoint(format!(
        "{KDAT_DIR} (CRIU's cache of kernel features) is held by another user; remove it"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    /// A cache directory another user made (with a planted cache) is taken back before
    /// CRIU reads it. Needs root (it is root's directory).
    #[test]
    fn a_kdat_dir_made_by_another_user_is_made_again_as_roots() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/shm").is_dir() {
            // CI (.ci/run) must not pass it by skipping.
            assert!(
                std::env::var("STRATA_REQUIRE_PRIVILEGED").as_deref() != Ok("1"),
                "needs root and /dev/shm"
            );
            eprintln!("not run: needs root and /dev/shm");
            return;
        }
        let dir = Path::new(KDAT_DIR);
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir(dir).unwrap();
        std::fs::write(dir.join("criu.kdat"), b"planted").unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::os::unix::fs::chown(dir, Some(65534), Some(65534)).unwrap();
        own_kdat_dir().unwrap();
        let m = std::fs::symlink_metadata(dir).unwrap();
        assert!(m.is_dir() && m.uid() == 0 && m.mode() & 0o7777 == 0o700);
        assert!(!dir.join("criu.kdat").exists(), "the planted cache is gone");
        // Root's own already: left as it is, its cache kept.
        std::fs::write(dir.join("criu.kdat"), b"cache").unwrap();
        own_kdat_dir().unwrap();
        assert!(dir.join("criu.kdat").exists());
        std::fs::remove_file(dir.join("criu.kdat")).unwrap();
    }
}
