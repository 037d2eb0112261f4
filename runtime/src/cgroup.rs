//! Per-sandbox cgroups, behind one small interface ([`Hierarchy`]) with two
//! implementations chosen by probing the host at start: [`V1`], one directory per
//! controller hierarchy (`<root>/<controller>/<parent>/<sandbox>`; also hybrid hosts, which
//! mount cgroup2 beside the v1 controllers), and [`V2`], the unified hierarchy every current
//! distribution boots with (`<root>/<parent>/<sandbox>`, controllers delegated to the
//! runtime's parent through `cgroup.subtree_control`). The container backend lets the OCI
//! runtime create a sandbox's cgroup at the same path; the fncall and VM backends create
//! it themselves. Budget counters read the same on both, so attribution is shared code.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::RuntimeError;

/// Parent directory of one runtime's sandbox cgroups: `strata-<hash of the runtime's
/// state directory>`, so two runtimes on one host (a test's and the default one) never
/// reap each other's sandboxes.
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

/// How a host's cgroups are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupMode {
    /// Only v1 hierarchies.
    V1,
    /// v1 controllers with a cgroup2 mount beside them (`<root>/unified`), no controllers
    /// on it. Debian's crun refuses such hosts; the container backend hides the cgroup2
    /// mount from it.
    Hybrid,
    /// The unified hierarchy.
    V2,
}

impl fmt::Display for CgroupMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CgroupMode::V1 => "v1",
            CgroupMode::Hybrid => "hybrid (v1 controllers, cgroup2 mounted beside)",
            CgroupMode::V2 => "v2 (unified)",
        })
    }
}

/// One cgroup layout: where a cgroup's files are and how its budgets are written and read.
pub(crate) trait Hierarchy: Send + Sync + fmt::Debug {
    fn mode(&self) -> CgroupMode;
    /// Every directory that makes up cgroup `name` (one per controller on v1).
    fn dirs(&self, name: &str) -> Vec<PathBuf>;
    /// The file listing every process of cgroup `name`.
    fn members(&self, name: &str) -> PathBuf;
    /// Makes `parent` a subtree the runtime owns, with the controllers it needs.
    fn prepare_parent(&self, parent: &str) -> Result<(), RuntimeError>;
    /// The directories of cgroup `name` in every hierarchy, the runtime's controllers or
    /// not (an OCI runtime makes one in each): what removing it must remove.
    fn every_dir(&self, name: &str) -> Vec<PathBuf>;
    fn set_limits(
        &self,
        name: &str,
        memory: u64,
        cpus: Option<f64>,
        pids: u32,
    ) -> Result<(), RuntimeError>;
    fn freeze(&self, name: &str, frozen: bool) -> Result<(), RuntimeError>;
    /// Whether cgroup `name` is frozen (or freezing).
    fn frozen(&self, name: &str) -> bool;
    /// The directory of cgroup `name` that freezes it (a process checkpoint freezes
    /// through it).
    fn freezer(&self, name: &str) -> PathBuf;
    fn counters(&self, name: &str) -> Counters;
    fn memory_usage(&self, name: &str) -> u64;
    /// CPU time the cgroup's processes used, dead ones included, in nanoseconds.
    fn cpu_usage_ns(&self, name: &str) -> u64;
    /// Moves cgroup `from` (and every process in it) to `to`.
    fn rename(&self, from: &str, to: &str) -> Result<(), RuntimeError>;
    /// Kills every process at once, if the kernel can (`cgroup.kill`); false otherwise.
    fn kill_at_once(&self, _name: &str) -> bool {
        false
    }
}

/// The v1 controllers a sandbox is limited by.
const V1_CONTROLLERS: [&str; 4] = ["memory", "cpu", "pids", "freezer"];
/// The v1 controller that counts CPU time; its own hierarchy on some hosts, mounted with
/// `cpu` on others.
const V1_CPUACCT: &str = "cpuacct";
/// The v2 controllers the runtime delegates to its subtree; `memory` and `pids` are
/// required, `cpu` and `io` used where the host has them.
const V2_CONTROLLERS: [&str; 4] = ["memory", "pids", "cpu", "io"];

#[derive(Debug)]
pub(crate) struct V1 {
    root: PathBuf,
    hybrid: bool,
    /// The hierarchies a sandbox's cgroup has a directory in: the limiting ones, and
    /// `cpuacct` where it is a hierarchy apart from `cpu`.
    controllers: Vec<&'static str>,
}

impl V1 {
    fn dir(&self, ctrl: &str, name: &str) -> PathBuf {
        self.root.join(ctrl).join(name)
    }
}

impl Hierarchy for V1 {
    fn mode(&self) -> CgroupMode {
        if self.hybrid {
            CgroupMode::Hybrid
        } else {
            CgroupMode::V1
        }
    }

    fn dirs(&self, name: &str) -> Vec<PathBuf> {
        self.controllers.iter().map(|c| self.dir(c, name)).collect()
    }

    fn members(&self, name: &str) -> PathBuf {
        self.dir("pids", name).join("cgroup.procs")
    }

    fn prepare_parent(&self, _parent: &str) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn every_dir(&self, name: &str) -> Vec<PathBuf> {
        // The OCI runtimes create their cgroups in every hierarchy, not just ours (a
        // hierarchy reached by two names, cpu and cpu,cpuacct, is listed twice).
        std::fs::read_dir(&self.root)
            .map(|rd| rd.flatten().map(|e| e.path().join(name)).collect())
            .unwrap_or_default()
    }

    fn set_limits(
        &self,
        name: &str,
        memory: u64,
        cpus: Option<f64>,
        pids: u32,
    ) -> Result<(), RuntimeError> {
        let mem = self.dir("memory", name);
        write(&mem.join("memory.limit_in_bytes"), &memory.to_string())?;
        // memsw exists only with swap accounting; without it there is no swap to escape to.
        let memsw = mem.join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            write(&memsw, &memory.to_string())?;
        }
        write(&mem.join("memory.swappiness"), "0").ok();
        let cpu = self.dir("cpu", name);
        write(&cpu.join("cpu.cfs_period_us"), "100000")?;
        let quota = match cpus {
            Some(c) => cpu_quota(c).to_string(),
            None => "-1".to_string(),
        };
        write(&cpu.join("cpu.cfs_quota_us"), &quota)?;
        write(&self.dir("pids", name).join("pids.max"), &pids.to_string())
    }

    fn freeze(&self, name: &str, frozen: bool) -> Result<(), RuntimeError> {
        write(
            &self.dir("freezer", name).join("freezer.state"),
            if frozen { "FROZEN" } else { "THAWED" },
        )
    }

    fn freezer(&self, name: &str) -> PathBuf {
        self.dir("freezer", name)
    }

    fn frozen(&self, name: &str) -> bool {
        std::fs::read_to_string(self.dir("freezer", name).join("freezer.state"))
            .is_ok_and(|s| s.trim() != "THAWED")
    }

    fn counters(&self, name: &str) -> Counters {
        let mem = self.dir("memory", name);
        Counters {
            oom_kills: read_field(&mem.join("memory.oom_control"), "oom_kill"),
            pids_max_hits: read_field(&self.dir("pids", name).join("pids.events"), "max"),
            memory_peak: read_number(&mem.join("memory.max_usage_in_bytes")),
        }
    }

    fn memory_usage(&self, name: &str) -> u64 {
        read_number(&self.dir("memory", name).join("memory.usage_in_bytes"))
    }

    fn cpu_usage_ns(&self, name: &str) -> u64 {
        // Through the `cpuacct` name whether it is its own hierarchy or a link to the
        // combined `cpu,cpuacct` one.
        read_number(&self.dir(V1_CPUACCT, name).join("cpuacct.usage"))
    }

    fn rename(&self, from: &str, to: &str) -> Result<(), RuntimeError> {
        // v1 renames a cgroup within its parent; processes inside stay inside.
        for c in &self.controllers {
            let (src, dest) = (self.dir(c, from), self.dir(c, to));
            std::fs::rename(&src, &dest).map_err(RuntimeError::io(&src))?;
        }
        Ok(())
    }
}

#[derive(Debug)]
pub(crate) struct V2 {
    root: PathBuf,
}

impl V2 {
    fn dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// Enables the controllers for the children of `dir` (those the host has).
    fn delegate(&self, dir: &Path) -> Result<(), RuntimeError> {
        let available = std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
        let control = dir.join("cgroup.subtree_control");
        let enabled = std::fs::read_to_string(&control).unwrap_or_default();
        for c in V2_CONTROLLERS {
            let has = |text: &str| text.split_whitespace().any(|w| w == c);
            if !has(&available) || has(&enabled) {
                continue;
            }
            let r = write(&control, &format!("+{c}"));
            if r.is_err() && matches!(c, "memory" | "pids") {
                return r;
            }
        }
        Ok(())
    }
}

impl Hierarchy for V2 {
    fn mode(&self) -> CgroupMode {
        CgroupMode::V2
    }

    fn dirs(&self, name: &str) -> Vec<PathBuf> {
        vec![self.dir(name)]
    }

    fn members(&self, name: &str) -> PathBuf {
        self.dir(name).join("cgroup.procs")
    }

    fn prepare_parent(&self, parent: &str) -> Result<(), RuntimeError> {
        self.delegate(&self.root)?;
        let dir = self.dir(parent);
        std::fs::create_dir_all(&dir).map_err(RuntimeError::io(&dir))?;
        self.delegate(&dir)
    }

    fn every_dir(&self, name: &str) -> Vec<PathBuf> {
        vec![self.dir(name)]
    }

    fn set_limits(
        &self,
        name: &str,
        memory: u64,
        cpus: Option<f64>,
        pids: u32,
    ) -> Result<(), RuntimeError> {
        let dir = self.dir(name);
        write(&dir.join("memory.max"), &memory.to_string())?;
        // No swap to escape to, as v1's memsw limit equal to the memory limit.
        let swap = dir.join("memory.swap.max");
        if swap.exists() {
            write(&swap, "0")?;
        }
        let cpu = dir.join("cpu.max");
        if cpu.exists() || cpus.is_some() {
            let quota = cpus.map_or("max".to_string(), |c| cpu_quota(c).to_string());
            write(&cpu, &format!("{quota} 100000"))?;
        }
        write(&dir.join("pids.max"), &pids.to_string())
    }

    fn freeze(&self, name: &str, frozen: bool) -> Result<(), RuntimeError> {
        let dir = self.dir(name);
        write(&dir.join("cgroup.freeze"), if frozen { "1" } else { "0" })?;
        // Freezing is asynchronous: wait (briefly) until every task has stopped.
        let events = dir.join("cgroup.events");
        let want = if frozen { 1 } else { 0 };
        let deadline = Instant::now() + Duration::from_secs(1);
        while events.exists() && read_field(&events, "frozen") != want && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    fn freezer(&self, name: &str) -> PathBuf {
        self.dir(name)
    }

    fn frozen(&self, name: &str) -> bool {
        std::fs::read_to_string(self.dir(name).join("cgroup.freeze")).is_ok_and(|s| s.trim() == "1")
    }

    fn counters(&self, name: &str) -> Counters {
        let dir = self.dir(name);
        Counters {
            oom_kills: read_field(&dir.join("memory.events"), "oom_kill"),
            pids_max_hits: read_field(&dir.join("pids.events"), "max"),
            // memory.peak exists from Linux 5.19.
            memory_peak: read_number(&dir.join("memory.peak")),
        }
    }

    fn memory_usage(&self, name: &str) -> u64 {
        read_number(&self.dir(name).join("memory.current"))
    }

    fn cpu_usage_ns(&self, name: &str) -> u64 {
        // cpu.stat's usage is there in every cgroup2 group, cpu controller or not.
        read_field(&self.dir(name).join("cpu.stat"), "usage_usec").saturating_mul(1000)
    }

    fn rename(&self, from: &str, to: &str) -> Result<(), RuntimeError> {
        // cgroup2 has no rename: make the new group and move the processes over.
        let (src, dest) = (self.dir(from), self.dir(to));
        std::fs::create_dir_all(&dest).map_err(RuntimeError::io(&dest))?;
        let procs = dest.join("cgroup.procs");
        for pid in read_pids(&src.join("cgroup.procs")) {
            write(&procs, &pid.to_string())?;
        }
        let _ = std::fs::remove_dir(&src);
        Ok(())
    }

    fn kill_at_once(&self, name: &str) -> bool {
        // cgroup.kill exists from Linux 5.14.
        let kill = self.dir(name).join("cgroup.kill");
        kill.exists() && write(&kill, "1").is_ok()
    }
}

/// The host's cgroups as the runtime uses them: the layout and the runtime's parent.
#[derive(Clone, Debug)]
pub struct Cgroups {
    h: Arc<dyn Hierarchy>,
    parent: String,
}

impl Cgroups {
    /// Probes the layout under `root` (normally `/sys/fs/cgroup`): v2 when it is a
    /// cgroup2 mount, v1 (or hybrid) when the v1 controllers are there.
    pub fn probe(root: &Path, parent: String) -> Result<Cgroups, RuntimeError> {
        let h: Arc<dyn Hierarchy> = if root.join("cgroup.controllers").exists() {
            let available =
                std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            let missing: Vec<&str> = ["memory", "pids"]
                .into_iter()
                .filter(|c| !available.split_whitespace().any(|w| w == *c))
                .collect();
            if !missing.is_empty() {
                return Err(RuntimeError::Setup(format!(
                    "cgroup v2 at {} has no {} controller (available: {}); enable it in the kernel or free it from cgroup v1",
                    root.display(),
                    missing.join(" or "),
                    available.trim()
                )));
            }
            Arc::new(V2 {
                root: root.to_path_buf(),
            })
        } else {
            let missing: Vec<&str> = V1_CONTROLLERS
                .into_iter()
                .filter(|c| !root.join(c).join("cgroup.procs").exists())
                .collect();
            if !missing.is_empty() {
                return Err(RuntimeError::Setup(format!(
                    "no cgroup v2 at {root} and no cgroup v1 {} hierarchies under it; mount cgroup2 there (`mount -t cgroup2 none {root}`) or boot a kernel with cgroups",
                    missing.join(", "),
                    root = root.display()
                )));
            }
            let mut controllers = V1_CONTROLLERS.to_vec();
            let (cpu, cpuacct) = (root.join("cpu"), root.join(V1_CPUACCT));
            let apart = cpuacct.join("cpuacct.usage").exists()
                && std::fs::canonicalize(&cpu).ok() != std::fs::canonicalize(&cpuacct).ok();
            if apart {
                controllers.push(V1_CPUACCT);
            }
            Arc::new(V1 {
                root: root.to_path_buf(),
                hybrid: root.join("unified").join("cgroup.controllers").exists(),
                controllers,
            })
        };
        Ok(Cgroups { h, parent })
    }

    pub fn mode(&self) -> CgroupMode {
        self.h.mode()
    }

    /// The cgroup of sandbox (or pool slot) `id`.
    pub fn sandbox(&self, id: &str) -> Cgroup {
        Cgroup {
            name: format!("{}/{id}", self.parent),
            h: self.h.clone(),
        }
    }

    /// Makes the runtime's parent ready for new cgroups (on v2, with its controllers
    /// delegated); a no-op on v1.
    pub fn prepare(&self) -> Result<(), RuntimeError> {
        self.h.prepare_parent(&self.parent)
    }

    /// Removes the runtime's parent wherever it is empty, so a runtime home that goes
    /// away leaves no cgroup behind.
    pub fn remove_parent(&self) {
        for d in self.h.every_dir(&self.parent) {
            let _ = std::fs::remove_dir(d);
        }
    }

    /// Sandbox IDs that have a cgroup on this host (for reaping).
    pub fn existing(&self) -> Vec<String> {
        let mut ids = std::collections::BTreeSet::new();
        for d in self.h.dirs(&self.parent) {
            if let Ok(rd) = std::fs::read_dir(d) {
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

/// One sandbox's (or pool slot's) cgroup.
#[derive(Clone, Debug)]
pub struct Cgroup {
    name: String,
    h: Arc<dyn Hierarchy>,
}

impl Cgroup {
    /// The OCI `cgroupsPath` for this cgroup.
    pub fn oci_path(&self) -> String {
        format!("/{}", self.name)
    }

    /// Creates the directories and writes the limits (fncall, VMs; crun does this itself).
    pub fn create(&self, memory: u64, cpus: Option<f64>, pids: u32) -> Result<(), RuntimeError> {
        for d in self.h.dirs(&self.name) {
            std::fs::create_dir_all(&d).map_err(RuntimeError::io(&d))?;
        }
        self.set_limits(memory, cpus, pids)
    }

    /// Renames the cgroup; processes inside stay inside, which is what makes a pooled init
    /// cheap to hand out.
    pub fn rename(&self, to: &Cgroup) -> Result<(), RuntimeError> {
        self.h.rename(&self.name, &to.name)
    }

    /// Writes the memory, CPU and process limits.
    pub fn set_limits(
        &self,
        memory: u64,
        cpus: Option<f64>,
        pids: u32,
    ) -> Result<(), RuntimeError> {
        self.h.set_limits(&self.name, memory, cpus, pids)
    }

    fn procs_files(&self) -> Vec<PathBuf> {
        self.h
            .dirs(&self.name)
            .into_iter()
            .map(|d| d.join("cgroup.procs"))
            .collect()
    }

    /// Makes `cmd` join this cgroup between fork and exec, so everything it starts is
    /// inside from its first instruction.
    pub fn join_on_exec(&self, cmd: &mut std::process::Command) -> Result<(), RuntimeError> {
        let procs: Vec<std::ffi::CString> = self
            .procs_files()
            .iter()
            .map(|p| {
                std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
                    .map_err(|_| RuntimeError::Invalid("cgroup path has a NUL".into()))
            })
            .collect::<Result<_, _>>()?;
        strata_host::exec::join_cgroups(cmd, procs);
        Ok(())
    }

    /// Stops (`true`) or resumes every process inside through the freezer.
    pub fn freeze(&self, frozen: bool) -> Result<(), RuntimeError> {
        self.h.freeze(&self.name, frozen)
    }

    pub fn is_frozen(&self) -> bool {
        self.h.frozen(&self.name)
    }

    /// The directory that freezes this cgroup.
    pub fn freezer_dir(&self) -> PathBuf {
        self.h.freezer(&self.name)
    }

    /// Moves a process in (costs an RCU grace period per hierarchy).
    pub fn attach(&self, pid: u32) -> Result<(), RuntimeError> {
        for p in self.procs_files() {
            write(&p, &pid.to_string())?;
        }
        Ok(())
    }

    pub fn counters(&self) -> Counters {
        self.h.counters(&self.name)
    }

    pub fn memory_usage(&self) -> u64 {
        self.h.memory_usage(&self.name)
    }

    /// CPU time used so far by every process the sandbox had (0 where the host does
    /// not count it).
    pub fn cpu_usage(&self) -> Duration {
        Duration::from_nanos(self.h.cpu_usage_ns(&self.name))
    }

    /// Every process in the sandbox, by host PID.
    pub fn pids(&self) -> Vec<u32> {
        read_pids(&self.h.members(&self.name))
    }

    /// Kills everything inside: at once where the kernel can, else freeze, SIGKILL all,
    /// thaw, so nothing forks away meanwhile.
    pub fn kill_all(&self) {
        if self.h.kill_at_once(&self.name) && self.emptied_within(Duration::from_secs(2)) {
            return;
        }
        let frozen = self.freeze(true).is_ok();
        for _ in 0..50 {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                kill(p);
            }
            if frozen {
                let _ = self.freeze(false);
            }
            // Killed processes are gone within a moment of the thaw (a fixed 10 ms wait
            // here was most of a destroy); another round only for what is left after it.
            self.emptied_within(Duration::from_millis(10));
        }
        if frozen {
            let _ = self.freeze(false);
        }
    }

    /// Whether the cgroup holds no process within `limit`, looked for every millisecond.
    fn emptied_within(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.pids().is_empty() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Kills every process in the cgroup that is not in `keep` (a command's whole tree,
    /// including children re-parented away from it), with the cgroup frozen so nothing
    /// forks away meanwhile.
    pub fn kill_except(&self, keep: &std::collections::HashSet<u32>) {
        for _ in 0..20 {
            let frozen = self.freeze(true).is_ok();
            let victims: Vec<u32> = self
                .pids()
                .into_iter()
                .filter(|p| !keep.contains(p))
                .collect();
            for p in &victims {
                kill(*p);
            }
            if frozen {
                let _ = self.freeze(false);
            }
            if victims.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Removes the directories, in every hierarchy (they must be empty of processes).
    pub fn remove(&self) -> Result<(), RuntimeError> {
        let mut last = None;
        for d in self.h.every_dir(&self.name) {
            // Up to 10 s: a killed init stays a zombie until the host's init reaps it, and
            // a zombie keeps a cgroup busy (some inits reap only every second or two).
            for _ in 0..500 {
                match std::fs::remove_dir(&d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    // EBUSY while the last exited task is still being torn down.
                    Err(e) => {
                        last = Some(RuntimeError::io(&d)(e));
                        std::thread::sleep(Duration::from_millis(20));
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
}

/// SIGKILL to host process `pid` (gone already is fine).
fn kill(pid: u32) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// A CPU budget as a CFS quota per 100 ms period (at least 1 ms).
fn cpu_quota(cpus: f64) -> i64 {
    (cpus * 100_000.0).round().max(1000.0) as i64
}

fn read_pids(path: &Path) -> Vec<u32> {
    std::fs::read_to_string(path)
        .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

fn read_number(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

/// A `key value` line's value in a cgroup's flat-keyed file; 0 when missing.
fn read_field(path: &Path, key: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| field(&t, key))
        .unwrap_or(0)
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

#[cfg(test)]
mod tests {
    //! The v1 and v2 logic against directories laid out like cgroupfs (no root needed).
    use super::*;

    fn put(path: &Path, text: &str) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    fn v1_host(hybrid: bool) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for c in ["memory", "cpu", "pids", "freezer", "blkio"] {
            put(&root.path().join(c).join("cgroup.procs"), "");
        }
        if hybrid {
            put(&root.path().join("unified/cgroup.controllers"), "");
        }
        root
    }

    fn v2_host(controllers: &str) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        put(&root.path().join("cgroup.controllers"), controllers);
        put(&root.path().join("cgroup.subtree_control"), "");
        root
    }

    fn read(p: PathBuf) -> String {
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    #[test]
    fn the_layout_is_probed() {
        let v1 = v1_host(false);
        let hybrid = v1_host(true);
        let v2 = v2_host("cpuset cpu io memory hugetlb pids rdma misc\n");
        let mode = |root: &Path| Cgroups::probe(root, "strata-x".into()).unwrap().mode();
        assert_eq!(mode(v1.path()), CgroupMode::V1);
        assert_eq!(mode(hybrid.path()), CgroupMode::Hybrid);
        assert_eq!(mode(v2.path()), CgroupMode::V2);
        // Missing pieces are named, with what to do.
        let bare = tempfile::tempdir().unwrap();
        let e = Cgroups::probe(bare.path(), "p".into())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("memory, cpu, pids, freezer") && e.contains("mount -t cgroup2"),
            "{e}"
        );
        let no_pids = v2_host("cpu io memory\n");
        let e = Cgroups::probe(no_pids.path(), "p".into())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no pids controller"), "{e}");
    }

    #[test]
    fn v1_writes_limits_in_each_hierarchy_and_renames_in_all() {
        let host = v1_host(true);
        let root = host.path();
        let cg = Cgroups::probe(root, "strata-x".into()).unwrap();
        let pool = cg.sandbox("pool-1");
        pool.create(512 << 20, Some(1.5), 64).unwrap();
        let d = |ctrl: &str, f: &str| root.join(ctrl).join("strata-x/pool-1").join(f);
        assert_eq!(read(d("memory", "memory.limit_in_bytes")), "536870912");
        assert_eq!(read(d("cpu", "cpu.cfs_quota_us")), "150000");
        assert_eq!(read(d("cpu", "cpu.cfs_period_us")), "100000");
        assert_eq!(read(d("pids", "pids.max")), "64");
        assert_eq!(
            pool.procs_files(),
            ["memory", "cpu", "pids", "freezer"]
                .map(|c| root.join(c).join("strata-x/pool-1/cgroup.procs"))
        );
        let sb = cg.sandbox("abc");
        pool.rename(&sb).unwrap();
        assert!(root.join("freezer/strata-x/abc").is_dir());
        assert!(!root.join("memory/strata-x/pool-1").exists());
        sb.set_limits(1 << 30, None, 10).unwrap();
        assert_eq!(read(root.join("cpu/strata-x/abc/cpu.cfs_quota_us")), "-1");
        sb.freeze(true).unwrap();
        assert_eq!(
            read(root.join("freezer/strata-x/abc/freezer.state")),
            "FROZEN"
        );
        assert_eq!(cg.existing(), vec!["abc".to_string()]);
        assert_eq!(cg.sandbox("abc").oci_path(), "/strata-x/abc");
    }

    #[test]
    fn v2_delegates_its_controllers_and_moves_processes_on_rename() {
        let host = v2_host("cpuset cpu io memory pids\n");
        let root = host.path();
        let cg = Cgroups::probe(root, "strata-x".into()).unwrap();
        cg.prepare().unwrap();
        // Each controller is enabled with its own write; the fixture keeps the last.
        assert_eq!(read(root.join("cgroup.subtree_control")), "+io");
        put(
            &root.join("strata-x/cgroup.controllers"),
            "cpu io memory pids",
        );
        cg.prepare().unwrap();
        assert!(root.join("strata-x/cgroup.subtree_control").exists());
        let pool = cg.sandbox("pool-1");
        pool.create(256 << 20, Some(0.5), 32).unwrap();
        let d = |f: &str| root.join("strata-x/pool-1").join(f);
        assert_eq!(read(d("memory.max")), "268435456");
        assert_eq!(read(d("cpu.max")), "50000 100000");
        assert_eq!(read(d("pids.max")), "32");
        assert_eq!(pool.procs_files(), vec![d("cgroup.procs")]);
        put(&d("cgroup.procs"), "4242\n");
        let sb = cg.sandbox("abc");
        pool.rename(&sb).unwrap();
        assert_eq!(read(root.join("strata-x/abc/cgroup.procs")), "4242");
        sb.set_limits(1 << 30, None, 10).unwrap();
        // No CPU budget and no cpu.max (the fixture's new group has none): nothing written.
        assert!(!root.join("strata-x/abc/cpu.max").exists());
        sb.freeze(true).unwrap();
        assert_eq!(read(root.join("strata-x/abc/cgroup.freeze")), "1");
        // cgroupfs removes the emptied group; the fixture's plain files keep it here.
        assert!(cg.existing().contains(&"abc".to_string()));
    }

    #[test]
    fn both_layouts_count_budget_hits_the_same() {
        let (v1, v2) = (v1_host(false), v2_host("memory pids cpu\n"));
        let c1 = Cgroups::probe(v1.path(), "p".into()).unwrap().sandbox("s");
        let c2 = Cgroups::probe(v2.path(), "p".into()).unwrap().sandbox("s");
        put(
            &v1.path().join("memory/p/s/memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        );
        put(&v1.path().join("pids/p/s/pids.events"), "max 5\n");
        put(
            &v1.path().join("memory/p/s/memory.max_usage_in_bytes"),
            "1048576\n",
        );
        put(
            &v2.path().join("p/s/memory.events"),
            "low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n",
        );
        put(&v2.path().join("p/s/pids.events"), "max 5\n");
        put(&v2.path().join("p/s/memory.peak"), "1048576\n");
        let want = Counters {
            oom_kills: 2,
            pids_max_hits: 5,
            memory_peak: 1 << 20,
        };
        assert_eq!(c1.counters(), want);
        assert_eq!(c2.counters(), want);
        // A cgroup without counters yet reads as nothing hit.
        let fresh = Cgroups::probe(v2.path(), "p".into())
            .unwrap()
            .sandbox("none");
        assert_eq!(fresh.counters(), Counters::default());
    }

    #[test]
    fn both_layouts_read_cpu_time_and_v1_joins_a_cpuacct_apart() {
        let (v1, v2) = (v1_host(true), v2_host("memory pids cpu\n"));
        // cpuacct as its own hierarchy (this kind of host): sandboxes get a directory
        // there too, so their CPU time is counted.
        put(&v1.path().join("cpuacct/cpuacct.usage"), "0\n");
        let g1 = Cgroups::probe(v1.path(), "p".into()).unwrap();
        let c1 = g1.sandbox("s");
        c1.create(1 << 30, None, 10).unwrap();
        assert!(v1.path().join("cpuacct/p/s").is_dir());
        put(&v1.path().join("cpuacct/p/s/cpuacct.usage"), "1500000000\n");
        let c2 = Cgroups::probe(v2.path(), "p".into()).unwrap().sandbox("s");
        put(
            &v2.path().join("p/s/cpu.stat"),
            "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n",
        );
        assert_eq!(c1.cpu_usage(), Duration::from_millis(1500));
        assert_eq!(c2.cpu_usage(), Duration::from_millis(1500));
        assert!(c1
            .procs_files()
            .contains(&v1.path().join("cpuacct/p/s/cgroup.procs")));
        // cpu and cpuacct mounted together: one directory, read through either name.
        let both = v1_host(false);
        std::os::unix::fs::symlink(both.path().join("cpu"), both.path().join("cpuacct")).unwrap();
        put(&both.path().join("cpu/cpuacct.usage"), "0\n");
        let c = Cgroups::probe(both.path(), "p".into())
            .unwrap()
            .sandbox("s");
        c.create(1 << 30, None, 10).unwrap();
        assert_eq!(c.procs_files().len(), 4);
        put(&both.path().join("cpu/p/s/cpuacct.usage"), "7\n");
        assert_eq!(c.cpu_usage(), Duration::from_nanos(7));
    }
}
