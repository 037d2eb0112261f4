//! Per-sandbox cgroups on this kind of host: cgroup v1 hierarchies under /sys/fs/cgroup
//! (hybrid mode, no systemd), one directory `strata/<sandbox>` in each controller. The
//! container backend lets the OCI runtime create them at the same path; the fncall backend
//! creates them itself. Both read the budget counters from here.

use std::path::{Path, PathBuf};

use crate::RuntimeError;

const ROOT: &str = "/sys/fs/cgroup";
/// The controllers a sandbox is limited by.
pub const CONTROLLERS: [&str; 4] = ["memory", "cpu", "pids", "freezer"];
/// Parent directory of one runtime's sandbox cgroups in each hierarchy: `strata-<hash of
/// the runtime's state directory>`, so two runtimes on one host (a test's and the
/// default one) never reap each other's sandboxes.
pub fn parent_for(state_dir: &Path) -> String {
    // FNV-1a: stable across builds and platforms, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in state_dir.as_os_str().as_encoded_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    format!("strata-{:08x}", h as u32)
}

/// Counters that say whether a budget was hit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub oom_kills: u64,
    pub pids_max_hits: u64,
    pub memory_peak: u64,
}

#[derive(Debug, Clone)]
pub struct Cgroup {
    name: String,
}

fn controller_dir(ctrl: &str) -> PathBuf {
    Path::new(ROOT).join(ctrl)
}

impl Cgroup {
    pub fn for_sandbox(parent: &str, id: &str) -> Cgroup {
        Cgroup {
            name: format!("{parent}/{id}"),
        }
    }

    /// The OCI `cgroupsPath` for this cgroup.
    pub fn oci_path(&self) -> String {
        format!("/{}", self.name)
    }

    pub fn dir(&self, ctrl: &str) -> PathBuf {
        controller_dir(ctrl).join(&self.name)
    }

    /// Whether this host has the v1 hierarchies we use.
    pub fn host_supported() -> bool {
        CONTROLLERS
            .iter()
            .all(|c| controller_dir(c).join("cgroup.procs").exists())
    }

    /// Creates the directories and writes the limits (fncall; crun does this itself).
    pub fn create(&self, memory: u64, cpus: Option<f64>, pids: u32) -> Result<(), RuntimeError> {
        for c in CONTROLLERS {
            let d = self.dir(c);
            std::fs::create_dir_all(&d).map_err(RuntimeError::io(&d))?;
        }
        self.set_limits(memory, cpus, pids)
    }

    /// Renames the cgroup in every hierarchy (v1 allows it within one parent); processes
    /// inside stay inside, which is what makes a pooled init cheap to hand out.
    pub fn rename(&self, to: &Cgroup) -> Result<(), RuntimeError> {
        for c in CONTROLLERS {
            let (from, dest) = (self.dir(c), to.dir(c));
            std::fs::rename(&from, &dest).map_err(RuntimeError::io(&from))?;
        }
        Ok(())
    }

    /// Writes the memory, CPU and process limits.
    pub fn set_limits(
        &self,
        memory: u64,
        cpus: Option<f64>,
        pids: u32,
    ) -> Result<(), RuntimeError> {
        let mem = self.dir("memory");
        write(&mem.join("memory.limit_in_bytes"), &memory.to_string())?;
        // memsw exists only with swap accounting; without it there is no swap to escape to.
        let memsw = mem.join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            write(&memsw, &memory.to_string())?;
        }
        write(&mem.join("memory.swappiness"), "0").ok();
        let cpu = self.dir("cpu");
        write(&cpu.join("cpu.cfs_period_us"), "100000")?;
        let quota = match cpus {
            Some(c) => ((c * 100_000.0).round().max(1000.0) as i64).to_string(),
            None => "-1".to_string(),
        };
        write(&cpu.join("cpu.cfs_quota_us"), &quota)?;
        write(&self.dir("pids").join("pids.max"), &pids.to_string())?;
        Ok(())
    }

    /// Makes `cmd` join this cgroup between fork and exec, so everything it starts is
    /// inside from its first instruction.
    pub fn join_on_exec(&self, cmd: &mut std::process::Command) -> Result<(), RuntimeError> {
        use std::os::unix::process::CommandExt;
        let procs: Vec<std::ffi::CString> = CONTROLLERS
            .iter()
            .map(|c| {
                std::ffi::CString::new(
                    self.dir(c)
                        .join("cgroup.procs")
                        .as_os_str()
                        .as_encoded_bytes(),
                )
                .map_err(|_| RuntimeError::Invalid("cgroup path has a NUL".into()))
            })
            .collect::<Result<_, _>>()?;
        // SAFETY: only open/write/close between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                for p in &procs {
                    let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let r = libc::write(fd, b"0".as_ptr().cast(), 1);
                    libc::close(fd);
                    if r != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// Stops (`true`) or resumes every process inside through the freezer.
    pub fn freeze(&self, frozen: bool) -> Result<(), RuntimeError> {
        write(
            &self.dir("freezer").join("freezer.state"),
            if frozen { "FROZEN" } else { "THAWED" },
        )
    }

    /// Moves a process in (costs an RCU grace period per hierarchy on v1).
    pub fn attach(&self, pid: u32) -> Result<(), RuntimeError> {
        for c in CONTROLLERS {
            write(&self.dir(c).join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    pub fn counters(&self) -> Counters {
        let mem = self.dir("memory");
        let oom_kills = std::fs::read_to_string(mem.join("memory.oom_control"))
            .ok()
            .and_then(|t| field(&t, "oom_kill"))
            .unwrap_or(0);
        let pids_max_hits = std::fs::read_to_string(self.dir("pids").join("pids.events"))
            .ok()
            .and_then(|t| field(&t, "max"))
            .unwrap_or(0);
        let memory_peak = std::fs::read_to_string(mem.join("memory.max_usage_in_bytes"))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        Counters {
            oom_kills,
            pids_max_hits,
            memory_peak,
        }
    }

    pub fn memory_usage(&self) -> u64 {
        std::fs::read_to_string(self.dir("memory").join("memory.usage_in_bytes"))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Every process in the sandbox, by host PID.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.dir("pids").join("cgroup.procs"))
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }

    /// Kills everything inside: freeze, SIGKILL all, thaw, so nothing forks away meanwhile.
    pub fn kill_all(&self) {
        let freezer = self.dir("freezer");
        let frozen = write(&freezer.join("freezer.state"), "FROZEN").is_ok();
        for _ in 0..50 {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                // SAFETY: plain kill(2).
                unsafe { libc::kill(p as i32, libc::SIGKILL) };
            }
            if frozen {
                let _ = write(&freezer.join("freezer.state"), "THAWED");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        if frozen {
            let _ = write(&freezer.join("freezer.state"), "THAWED");
        }
    }

    /// Kills every process in the cgroup that is not in `keep` (a command's whole tree,
    /// including children re-parented away from it), with the cgroup frozen so nothing
    /// forks away meanwhile.
    pub fn kill_except(&self, keep: &std::collections::HashSet<u32>) {
        let state = self.dir("freezer").join("freezer.state");
        for _ in 0..20 {
            let frozen = write(&state, "FROZEN").is_ok();
            let victims: Vec<u32> = self
                .pids()
                .into_iter()
                .filter(|p| !keep.contains(p))
                .collect();
            for p in &victims {
                // SAFETY: plain kill(2).
                unsafe { libc::kill(*p as i32, libc::SIGKILL) };
            }
            if frozen {
                let _ = write(&state, "THAWED");
            }
            if victims.is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Removes the directories (they must be empty of processes).
    pub fn remove(&self) -> Result<(), RuntimeError> {
        let mut last = None;
        for c in CONTROLLERS {
            let d = self.dir(c);
            // Up to 10 s: a killed init stays a zombie until the host's init reaps it, and
            // a zombie keeps a v1 cgroup busy (some inits reap only every second or two).
            for _ in 0..500 {
                match std::fs::remove_dir(&d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    // EBUSY while the last exited task is still being torn down.
                    Err(e) => {
                        last = Some(RuntimeError::io(&d)(e));
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        continue;
                    }
                }
            }
            if d.exists() {
                return Err(last.unwrap_or_else(|| {
                    RuntimeError::Setup(format!("{} stays busy", d.display()))
                }));
            }
        }
        Ok(())
    }

    /// Removes a runtime's parent directory from every hierarchy where it is empty (the
    /// OCI runtimes create it in all of them), so a runtime home that goes away leaves no
    /// cgroup behind.
    pub fn remove_parent(parent: &str) {
        if let Ok(rd) = std::fs::read_dir(ROOT) {
            for e in rd.flatten() {
                let _ = std::fs::remove_dir(e.path().join(parent));
            }
        }
    }

    /// Sandbox IDs that have a cgroup on this host (for reaping).
    pub fn existing(parent: &str) -> Vec<String> {
        let mut ids = std::collections::BTreeSet::new();
        for c in CONTROLLERS {
            if let Ok(rd) = std::fs::read_dir(controller_dir(c).join(parent)) {
                for e in rd.flatten() {
                    if e.path().is_dir() {
                        if let Ok(n) = e.file_name().into_string() {
                            ids.insert(n);
                        }
                    }
                }
            }
        }
        ids.into_iter().collect()
    }
}

fn field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

fn write(path: &Path, value: &str) -> Result<(), RuntimeError> {
    std::fs::write(path, value).map_err(RuntimeError::io(path))
}
