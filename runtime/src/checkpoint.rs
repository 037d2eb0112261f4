//! Process checkpoints of a container sandbox with CRIU: what a hibernation saves of its
//! process tree (the agent as the tree's root, every process under it, their memory,
//! descriptors, namespaces and mounts) and how a wake restores it over the same root, in
//! a fresh PID namespace.
//!
//! What lives outside the sandbox is named to CRIU rather than saved: the sandbox's root
//! (its overlay mount stays mounted on the host while it hibernates), the named network
//! namespace of a networked sandbox, the `/dev/null` binds over masked kernel files, and
//! the agent's own executable (a host file, handed back at the restore). The agent holds
//! nothing else of the host's when it is saved: it parks first (see
//! `strata_agent_proto::HostMsg::Park`), and after the restore its parked socket is bound
//! and made to listen again from here ([`rebind_agent`]).
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

/// Where a hibernating container's own network namespace (one without an allowlist, made
/// by the OCI runtime) is pinned: a bind of its nsfs file in the sandbox's directory, so it
/// outlives the tree and the wake restores into it as into a named one, instead of CRIU
/// rebuilding it with `ip` and `iptables-restore` (about 40 ms of every wake).
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
    /// Masked kernel files (binds of `/dev/null`), inside the sandbox.
    masked_files: Vec<String>,
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

/// The masked files of the sandbox whose init is `pid`: mounts over files (binds of
/// `/dev/null`), as its mount table shows them.
fn masked_files(pid: u32) -> Vec<String> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    table
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Field 4 is the mount's root within its filesystem, 5 its mount point.
            (f.len() > 5 && f[3] == "/null").then(|| f[4].to_string())
        })
        .filter(|p| strata_agent_proto::policy::MASKED_PATHS.contains(&p.as_str()))
        .collect()
}

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
            masked_files: masked_files(d.init_pid),
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
        for m in &plan.masked_files {
            cmd.arg("--ext-mount-map").arg(format!("{m}:{m}"));
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
        if plan.external_netns && r.netns.is_none() {
            return Err(RuntimeError::Checkpoint(
                "the sandbox's network namespace is gone".into(),
            ));
        }
        let exe = File::open(r.agent).map_err(RuntimeError::io(r.agent))?;
        let netns = match r.netns.filter(|_| plan.external_netns) {
            Some(p) => Some(File::open(p).map_err(RuntimeError::io(p))?),
            None => None,
        };
        let log = images.join("restore.log");
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
        for m in &plan.masked_files {
            cmd.arg("--ext-mount-map").arg(format!("{m}:/dev/null"));
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

/// Makes a parked container agent serve again: its parked socket, bound at `socket` and
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
