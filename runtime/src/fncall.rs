//! The function-call backend: no OCI runtime. `strata-agent` enters fresh namespaces,
//! pivots into the overlay root, confines itself (capabilities, no_new_privs, landlock,
//! seccomp, rlimits) and stays as the sandbox's pid 1. Commands are forked by the agent from
//! inside, so they inherit namespaces, confinement and cgroups without paying a cgroup
//! attach each.
//!
//! The agent gets its settings and key on stdin (its command line shows no host path), and
//! a pool of agents waits ready, each with its slot's own key, for a create to hand it a
//! root and the sandbox's key. A pooled agent of another protocol version (left by an
//! older build) is refused at the handshake and the whole pool drained.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use strata_agent_proto::{
    AgentMsg, HandshakeError, HostMsg, PoolSetup, SandboxBoot, SandboxKey, PROTOCOL_VERSION,
};

use crate::agent::{read_key, socket_path, write_key, AgentClient};
use crate::backend::{
    process_start, HibernateInfo, Host, NewSandbox, SandboxBackend, SandboxRef, SnapshotInfo,
};
use crate::cgroup::{Cgroup, Cgroups};
use crate::checkpoint::HostCheckpoints;
use crate::hostroot::{self, HostRoot};
use crate::spec::{DEFAULT_MEMORY, DEFAULT_PIDS};
use crate::RuntimeError;

pub struct FncallBackend {
    /// The host's `strata-agent`, the init where there is no static one.
    pub agent: PathBuf,
    /// The statically linked `strata-agent`: when set, every sandbox's init (a process
    /// checkpoint can save it: it maps no library of the host's).
    pub static_agent: Option<PathBuf>,
    /// Checkpoints sandboxes for hibernation, snapshots and forks with processes; none:
    /// they keep files only.
    pub criu: Option<crate::checkpoint::Criu>,
    /// Where a networked sandbox's named namespace is.
    pub networks: crate::network::Networks,
    /// Pooled agents: `ready/<slot>/` (socket, key, pid, version, slot name), `filling/`,
    /// `claimed/<sandbox>/`.
    pub pool: PathBuf,
    pub cgroups: Cgroups,
    /// The mount namespace agents start from.
    pub(crate) launch: std::sync::Arc<crate::hostroot::LaunchNamespace>,
}

/// Where an agent receives the launch namespace's template (clear of the descriptors it
/// places itself: its listening socket goes to 3).
const MOUNTNS_FD: i32 = 10;

impl FncallBackend {
    /// The binary every new sandbox's init runs.
    fn init_binary(&self) -> &Path {
        self.static_agent.as_deref().unwrap_or(&self.agent)
    }

    /// CRIU and the static agent, which every checkpoint and restore takes.
    fn checkpointer(&self) -> Result<HostCheckpoints<'_>, RuntimeError> {
        HostCheckpoints::of(
            self.criu.as_ref(),
            self.static_agent.as_deref(),
            &self.networks,
            "fncall",
        )
    }

    /// What checkpointing this sandbox takes: [`Self::checkpointer`], and its init being
    /// the static agent (one started by the host's agent maps the host's libraries, which
    /// a restore could not map again).
    fn checkpointing(&self, sb: &SandboxRef) -> Result<HostCheckpoints<'_>, RuntimeError> {
        let found = self.checkpointer()?;
        use std::os::unix::fs::MetadataExt;
        let exe = PathBuf::from(format!("/proc/{}/exe", sb.record.init_pid));
        let same =
            |a: &std::fs::Metadata, b: &std::fs::Metadata| a.dev() == b.dev() && a.ino() == b.ino();
        match (std::fs::metadata(&exe), std::fs::metadata(found.agent)) {
            (Ok(init), Ok(agent)) if same(&init, &agent) => Ok(found),
            (Err(e), _) => Err(RuntimeError::io(&exe)(e)),
            _ => Err(RuntimeError::Unsupported(
                "this fncall sandbox's init is the host's agent, not the static one (it was started before the static agent was built): a new sandbox can be checkpointed; pause this one (memory kept) or commit its files".into(),
            )),
        }
    }

    fn pool_dir(&self, state: &str) -> PathBuf {
        self.pool.join(state)
    }

    /// What a pooled agent was started by: the protocol version and the agent binary's
    /// identity. A pooled agent sets up its sandbox's root only when claimed, with the code
    /// it was started with, so one started by an older build (another version, or the same
    /// version with other confinement) is drained, never handed out.
    fn build_tag(&self) -> String {
        let binary = crate::agent::binary_identity(self.init_binary()).unwrap_or_default();
        format!("{PROTOCOL_VERSION} {binary}")
    }

    fn pool_cgroup(&self, slot: &str) -> Cgroup {
        self.cgroups.sandbox(&format!("pool-{slot}"))
    }

    /// Whether pool slot `slot` exists in any state (its cgroup is then its own).
    pub(crate) fn has_slot(&self, slot: &str) -> bool {
        ["ready", "filling"]
            .iter()
            .any(|s| self.pool_dir(s).join(slot).exists())
            || std::fs::read_dir(self.pool_dir("claimed")).is_ok_and(|rd| {
                rd.flatten().any(|e| {
                    std::fs::read_to_string(e.path().join("slot")).is_ok_and(|t| t.trim() == slot)
                })
            })
    }

    /// Starts the agent inside `cgroup` (joined between fork and exec, so everything it
    /// starts is inside from its first instruction); returns its host PID.
    fn spawn_agent(&self, cgroup: &Cgroup, boot: &SandboxBoot) -> Result<u32, RuntimeError> {
        let mut cmd = Command::new(self.init_binary());
        // argv[0] without the host's path: commands can read /proc/1/cmdline.
        cmd.arg0("strata-agent")
            .arg("sandbox")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cgroup.join_on_exec(&mut cmd)?;
        let mut boot = boot.clone();
        if let Some(template) = self.launch.template() {
            template
                .pass(&mut cmd, MOUNTNS_FD)
                .map_err(|e| RuntimeError::Setup(format!("passing the launch namespace: {e}")))?;
            boot.mountns_fd = Some(MOUNTNS_FD);
        }
        let cannot = |e: std::io::Error| {
            RuntimeError::Setup(format!(
                "cannot run the sandbox agent {}: {e} (build it with `cargo build -p strata-agent`)",
                self.init_binary().display()
            ))
        };
        let mut child = cmd.spawn().map_err(cannot)?;
        if let Some(mut stdin) = child.stdin.take() {
            let settings =
                serde_json::to_vec(&boot).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
            // A write error means the agent died at once; its stderr says why.
            let _ = stdin.write_all(&settings);
        }
        let out = child.wait_with_output().map_err(cannot)?;
        if !out.status.success() {
            return Err(RuntimeError::Setup(format!(
                "the sandbox agent failed to start: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .map_err(|_| RuntimeError::Setup("the sandbox agent printed no PID".into()))
    }

    /// Ready pooled agents.
    pub fn pooled(&self) -> Vec<String> {
        std::fs::read_dir(self.pool_dir("ready"))
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Starts pooled agents until `target` wait; returns how many it started.
    pub fn fill(&self, target: usize) -> Result<usize, RuntimeError> {
        for d in ["ready", "filling", "claimed"] {
            let p = self.pool_dir(d);
            std::fs::create_dir_all(&p).map_err(RuntimeError::io(&p))?;
        }
        self.cgroups.prepare()?;
        let mut started = 0;
        while self.pooled().len() < target {
            let slot = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
            let dir = self.pool_dir("filling").join(&slot);
            std::fs::create_dir_all(&dir).map_err(RuntimeError::io(&dir))?;
            let cgroup = self.pool_cgroup(&slot);
            let made = cgroup
                .create(DEFAULT_MEMORY, None, DEFAULT_PIDS)
                .and_then(|()| {
                    let key = SandboxKey::generate()?;
                    write_key(&dir, &key)?;
                    self.spawn_agent(
                        &cgroup,
                        &SandboxBoot {
                            rootfs: None,
                            socket: socket_path(&dir).display().to_string(),
                            hostname: "sandbox".into(),
                            netns: None,
                            key: key.to_hex(),
                            shm_bytes: None,
                            mountns_fd: None,
                        },
                    )
                })
                .and_then(|pid| {
                    let start = process_start(pid).unwrap_or(0);
                    let f = dir.join("pid");
                    std::fs::write(&f, format!("{pid} {start}")).map_err(RuntimeError::io(&f))?;
                    let v = dir.join("version");
                    std::fs::write(&v, self.build_tag()).map_err(RuntimeError::io(&v))?;
                    let ready = self.pool_dir("ready").join(&slot);
                    std::fs::rename(&dir, &ready).map_err(RuntimeError::io(&ready))
                });
            if let Err(e) = made {
                cgroup.kill_all();
                let _ = cgroup.remove();
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
            started += 1;
        }
        Ok(started)
    }

    /// Kills pooled agents and removes their slots and cgroups: every one, or (`only_stale`)
    /// those whose agent died or was started by another build ([`Self::build_tag`]).
    pub fn drain(&self, only_stale: bool) -> usize {
        let mut n = 0;
        let tag = self.build_tag();
        for state in ["ready", "filling", "claimed"] {
            let Ok(rd) = std::fs::read_dir(self.pool_dir(state)) else {
                continue;
            };
            for e in rd.flatten() {
                let slot = e.file_name().to_string_lossy().into_owned();
                let alive = read_pid(&e.path())
                    .is_some_and(|(pid, start)| process_start(pid) == Some(start));
                let current = std::fs::read_to_string(e.path().join("version"))
                    .is_ok_and(|v| v.trim() == tag);
                // Filling and claimed slots belong to a create in progress, unless stale.
                let busy = state != "ready" && crate::age(&e.path()) < Duration::from_secs(60);
                if (only_stale && alive && current) || busy {
                    continue;
                }
                let cgroup = self.pool_cgroup(&slot);
                cgroup.kill_all();
                let _ = cgroup.remove();
                let _ = std::fs::remove_dir_all(e.path());
                n += 1;
            }
        }
        n
    }

    /// Hands a pooled agent to sandbox `new.id`; `None` when the pool is empty or the
    /// agent it took fails (the caller then starts one cold).
    fn claim(&self, new: &NewSandbox, root: &HostRoot) -> Option<u32> {
        for slot in self.pooled() {
            let claimed = self.pool_dir("claimed").join(new.id);
            if std::fs::rename(self.pool_dir("ready").join(&slot), &claimed).is_err() {
                continue; // another create took it
            }
            let pool_cgroup = self.pool_cgroup(&slot);
            let adopted = self.adopt(new, root, &claimed, &pool_cgroup);
            if adopted.is_err() {
                for cg in [&pool_cgroup, &new.cgroup] {
                    cg.kill_all();
                    let _ = cg.remove();
                }
            }
            let _ = std::fs::remove_dir_all(&claimed);
            match adopted {
                Ok(pid) => return Some(pid),
                Err(RuntimeError::Handshake(
                    e @ (HandshakeError::Version { .. } | HandshakeError::NotHandshake(_)),
                )) => {
                    // Left by another build: so is the rest of the pool.
                    let drained = self.drain(false);
                    tracing::warn!(
                        "pooled agent {slot} refused: {e}; drained {drained} more pooled agents"
                    );
                    return None;
                }
                Err(e) => tracing::warn!("pooled agent {slot} failed ({e}); trying another"),
            }
        }
        None
    }

    fn adopt(
        &self,
        new: &NewSandbox,
        root: &HostRoot,
        claimed: &Path,
        pool_cgroup: &Cgroup,
    ) -> Result<u32, RuntimeError> {
        let (pid, start) = read_pid(claimed)
            .ok_or_else(|| RuntimeError::Setup("pool slot without a pid".into()))?;
        if process_start(pid) != Some(start) {
            return Err(RuntimeError::AgentGone("pooled agent is gone".into()));
        }
        pool_cgroup.rename(&new.cgroup)?;
        let l = &new.spec.limits;
        new.cgroup.set_limits(l.memory_bytes, l.cpus, l.pids)?;
        let sock = socket_path(claimed);
        let slot = AgentClient::at(sock.clone(), Some(read_key(claimed)?));
        let setup = HostMsg::Setup(PoolSetup {
            rootfs: root.rootfs.display().to_string(),
            hostname: new.hostname.clone(),
            netns: root.netns.as_ref().map(|n| n.display().to_string()),
            key: read_key(new.dir)?.to_hex(),
            shm_bytes: Some(strata_agent_proto::policy::shm_bytes(
                new.spec.limits.memory_bytes,
            )),
        });
        match slot.request(&setup, None, Duration::from_secs(30))?.0 {
            AgentMsg::Ready => {}
            other => {
                return Err(RuntimeError::Protocol(format!(
                    "pooled agent answered {other:?} to setup"
                )))
            }
        }
        let dest = socket_path(new.dir);
        std::fs::rename(&sock, &dest).map_err(RuntimeError::io(&dest))?;
        Ok(pid)
    }
}

fn read_pid(dir: &Path) -> Option<(u32, u64)> {
    let text = std::fs::read_to_string(dir.join("pid")).ok()?;
    let (p, s) = text.trim().split_once(' ')?;
    Some((p.parse().ok()?, s.parse().ok()?))
}

impl SandboxBackend for FncallBackend {
    fn create(&self, host: &Host, new: &NewSandbox) -> Result<u32, RuntimeError> {
        if let Some(snapshot) = new.restore {
            return self.checkpointer()?.restore_copy(host, new, snapshot);
        }
        let root = hostroot::prepare(host, new, None)?;
        if let Some(pid) = self.claim(new, &root) {
            return Ok(pid);
        }
        let l = &new.spec.limits;
        new.cgroup.create(l.memory_bytes, l.cpus, l.pids)?;
        let boot = SandboxBoot {
            rootfs: Some(root.rootfs.display().to_string()),
            socket: socket_path(new.dir).display().to_string(),
            hostname: new.hostname.clone(),
            netns: root.netns.as_ref().map(|n| n.display().to_string()),
            key: read_key(new.dir)?.to_hex(),
            shm_bytes: Some(strata_agent_proto::policy::shm_bytes(
                new.spec.limits.memory_bytes,
            )),
            mountns_fd: None,
        };
        let pid = self.spawn_agent(&new.cgroup, &boot)?;
        // The agent serves before its parent reports the PID: this checks the handshake
        // (version and key) rather than waiting.
        AgentClient::of(new.dir)?.ping(Duration::from_secs(10))?;
        Ok(pid)
    }

    fn runtime_written_paths(&self, spec: &crate::SandboxSpec) -> Vec<String> {
        hostroot::runtime_written_paths(spec)
    }

    fn hibernates(&self) -> bool {
        self.criu.is_some() && self.static_agent.is_some()
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

    /// See [`HostCheckpoints::wake`] (which checks the agent is the one that was saved).
    fn wake(&self, sb: &SandboxRef, from: &Path, paused: bool) -> Result<u32, RuntimeError> {
        self.checkpointer()?.wake(sb, from, paused)
    }
}
