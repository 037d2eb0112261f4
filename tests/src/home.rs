//! A private `STRATA_HOME` and store for tests that drive the `strata` CLI end to end, and
//! the sample environment registered in it. Each home's agent pool is drained and its
//! lazyfs daemon stopped when the test process exits, and its files are removed when
//! nothing is mounted under it any more.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::{have_fuse, have_root, have_tool, mounts_under, scratch_root, strata_bin};

static HOMES: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

extern "C" fn clean_homes_at_exit() {
    let homes = HOMES.lock().map(|h| h.clone()).unwrap_or_default();
    for home in homes {
        // Sandboxes a failed test left (a VM's QEMU would otherwise run on, taking the
        // CPU from every later test, after its directory is gone).
        let left = sandboxes_in(&home);
        if !left.is_empty() {
            let _ = Command::new(strata_bin())
                .args(["sandbox", "rm"])
                .args(&left)
                .env("STRATA_HOME", &home)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        for args in [["sandbox", "pool", "--drain"], ["lazyfs", "stop", ""]] {
            let _ = Command::new(strata_bin())
                .args(args.iter().filter(|a| !a.is_empty()))
                .env("STRATA_HOME", &home)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        // The daemon unmounts its layers as it exits, after `lazyfs stop` returns.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !mounts_under(&home).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if mounts_under(&home).is_empty() {
            if let Some(root) = home.parent() {
                let _ = std::fs::remove_dir_all(root);
            }
        }
    }
}

/// The IDs of the sandboxes a home's runtime holds (their directories).
pub fn sandboxes_in(home: &Path) -> Vec<String> {
    std::fs::read_dir(home.join("runtime").join("sandboxes"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether this host can run sandboxes (root, FUSE, the container engine, the tools the
/// sample's base and uppers need); same failure/skip rule as [`crate::have_root`].
pub fn can_run_sandboxes(test: &str) -> bool {
    have_root(test)
        && have_fuse(test)
        && have_tool(test, "crun")
        && have_tool(test, "catatonit")
        && have_tool(test, "mmdebstrap")
        && have_tool(test, "mkfs.ext4")
}

/// Whether this host can run microVM and VM sandboxes too: QEMU and the guest kernel
/// `scripts/setup.sh` prepares (same failure/skip rule as [`crate::have_root`]).
pub fn can_run_vms(test: &str) -> bool {
    if !can_run_sandboxes(test) || !have_tool(test, "qemu-system-x86_64") {
        return false;
    }
    let dir = std::env::var_os("STRATA_GUEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/local/lib/strata/guest"));
    let ready = dir.join("vmlinux").is_file() && dir.join("modules.load").is_file();
    crate::needs(
        test,
        ready,
        &format!(
            "no guest kernel in {} (run scripts/setup.sh)",
            dir.display()
        ),
    )
}

/// Where the `strata` binary under test finds the static agent (`STRATA_STATIC_AGENT`, or
/// beside it in the static target's directory of the same profile).
pub fn static_agent_path() -> PathBuf {
    std::env::var_os("STRATA_STATIC_AGENT")
        .map(PathBuf::from)
        .or_else(|| {
            let bin = crate::strata_bin();
            let profile = bin.parent()?;
            Some(
                profile
                    .parent()?
                    .join("x86_64-unknown-linux-gnu")
                    .join(profile.file_name()?)
                    .join("strata-agent"),
            )
        })
        .unwrap_or_default()
}

/// The static agent, if it is built.
pub fn static_agent() -> Option<PathBuf> {
    Some(static_agent_path()).filter(|p| p.is_file())
}

/// Whether host sandboxes (containers, fncall) can hibernate here: the sandboxes' needs,
/// the CRIU that `scripts/criu.sh` builds and the static agent (same failure/skip rule as
/// [`crate::have_root`]).
pub fn can_hibernate_containers(test: &str) -> bool {
    if !can_run_sandboxes(test) {
        return false;
    }
    let criu = std::env::var_os("STRATA_CRIU")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/local/lib/strata/criu/criu"));
    // A sandbox's init must be the static agent (the one that parks) to be checkpointed.
    let agent = static_agent_path();
    crate::needs(
        test,
        criu.is_file(),
        &format!("no CRIU at {} (run scripts/setup.sh)", criu.display()),
    ) && crate::needs(
        test,
        agent.is_file(),
        &format!(
            "no static agent at {} (build it as scripts/test.sh does)",
            agent.display()
        ),
    )
}

/// A `STRATA_HOME` with its own local store.
pub struct CliHome {
    pub home: PathBuf,
    pub store: PathBuf,
}

impl CliHome {
    /// A fresh home under the scratch root, cleaned up at process exit.
    pub fn new(prefix: &str) -> CliHome {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir_in(scratch_root())
            .expect("tempdir")
            .keep();
        let home = dir.join("home");
        let store = dir.join("store");
        std::fs::create_dir_all(&home).expect("creating the test home");
        let mut homes = HOMES.lock().expect("homes lock");
        if homes.is_empty() {
            // SAFETY: registering a plain extern "C" function.
            unsafe { libc::atexit(clean_homes_at_exit) };
        }
        homes.push(home.clone());
        CliHome { home, store }
    }

    /// A fresh home whose store is `url` (an S3 store, say).
    pub fn with_store(prefix: &str, url: &str) -> CliHome {
        CliHome {
            store: PathBuf::from(url),
            ..CliHome::new(prefix)
        }
    }

    /// Another fresh home on this host that shares this one's store (as the nodes of a
    /// cluster do).
    pub fn sharing_store(&self, prefix: &str) -> CliHome {
        let other = CliHome::new(prefix);
        CliHome {
            home: other.home,
            store: self.store.clone(),
        }
    }

    /// `strata ARGS` in this home.
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(strata_bin());
        c.args(args)
            .env("STRATA_HOME", &self.home)
            .env("STRATA_STORE", &self.store);
        c
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        self.cmd(args).output().expect("running strata")
    }

    /// Runs `strata ARGS`, asserting success; returns its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.cli(args);
        assert!(
            o.status.success(),
            "strata {args:?}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    /// Makes project `name` (names are unique in a store the tests share) and a token of
    /// it; the token.
    pub fn project_token(&self, name: &str) -> String {
        self.ok(&["project", "create", name]);
        let out = self.ok(&["token", "create", "--project", name]);
        let token = out.lines().last().unwrap_or_default().trim().to_string();
        assert!(token.starts_with("strata_"), "token create printed {out}");
        token
    }

    /// Runs `strata ARGS`, asserting it fails; returns its stderr.
    pub fn refused(&self, args: &[&str]) -> String {
        let o = self.cli(args);
        assert!(!o.status.success(), "strata {args:?} succeeded");
        String::from_utf8_lossy(&o.stderr).into_owned()
    }

    /// Runs `strata ARGS`, asserting success; its stdout as JSON.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        serde_json::from_str(&self.ok(args)).expect("JSON output")
    }

    pub fn runtime_dir(&self) -> PathBuf {
        self.home.join("runtime")
    }

    /// Nothing of sandbox `id` is left on the host: no directory, upper image, mount,
    /// cgroup, process or OCI runtime state.
    pub fn assert_sandbox_gone(&self, id: &str, host_pids: &[u32]) {
        let rt = self.runtime_dir();
        // Another test's command may be the one reaping it: give it time to finish.
        let deadline = Instant::now() + Duration::from_secs(30);
        while rt.join("sandboxes").join(id).exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            !rt.join("sandboxes").join(id).exists(),
            "sandbox dir of {id} left"
        );
        assert!(
            !rt.join("upper-images").join(format!("{id}.img")).exists(),
            "upper image of {id} left"
        );
        let mounts: Vec<String> = mounts_under(&rt)
            .into_iter()
            .filter(|m| m.contains(id))
            .collect();
        assert!(mounts.is_empty(), "mounts of {id} left: {mounts:?}");
        // In every hierarchy (an OCI runtime makes the cgroup in each on cgroup v1, the
        // runtime's controllers or not), and at the root of a unified one.
        let root = Path::new("/sys/fs/cgroup");
        let hierarchies = std::iter::once(root.to_path_buf()).chain(
            std::fs::read_dir(root)
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir()),
        );
        for h in hierarchies {
            let leftover = std::fs::read_dir(&h)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("strata-"))
                .any(|e| e.path().join(id).exists());
            assert!(!leftover, "cgroup of {id} left in {}", h.display());
        }
        for pid in host_pids {
            assert!(
                !Path::new(&format!("/proc/{pid}")).exists()
                    || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                        .is_ok_and(|s| s.contains(") Z ")),
                "process {pid} of {id} still runs"
            );
        }
        assert!(
            !rt.join("crun").join(id).exists(),
            "crun state of {id} left"
        );
    }

    /// Runs datasets/sample/register.sh into this home's store; returns the registered
    /// `datasets/sample@vN`.
    pub fn register_sample(&self) -> String {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = Command::new("bash")
            .arg(repo.join("datasets/sample/register.sh"))
            .arg(strata_bin())
            .env("STRATA_HOME", &self.home)
            .env("STRATA_STORE", &self.store)
            .output()
            .expect("running register.sh");
        assert!(
            out.status.success(),
            "register.sh: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let reference = String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or_default()
            .trim()
            .to_string();
        assert!(reference.starts_with("datasets/sample@"), "{reference}");
        reference
    }
}

/// Shell that prints the fork-test counter's value and a later one: it waits (10 s at
/// most) for the counting process to move on, since a loaded host (nine machines under TCG
/// on two cores, in CI) can let a fixed pause pass without a single count.
pub const COUNTER_TWICE: &str = "a=$(cat /tmp/count); b=$a; for _ in $(seq 100); do sleep 0.1; b=$(cat /tmp/count); [ \"$b\" != \"$a\" ] && break; done; echo $a $b";

/// Checks a fork child's line "A B" of a counter the parent ran ([`COUNTER_TWICE`]): it
/// went on from `at_fork` and still counts in the child.
pub fn assert_counter_went_on(child: &str, line: Option<&str>, at_fork: u64, output: &str) {
    let counts: Vec<u64> = line
        .map(|l| {
            l.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        counts.len() == 2 && counts[0] >= at_fork && counts[1] > counts[0],
        "{child}: the parent's process did not go on from {at_fork}: {output}"
    );
}

/// A command's stdout and stderr as text.
pub fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The sample environment registered once in a private home: what a test file's tests
/// share.
pub struct SampleEnv {
    pub cli: CliHome,
    /// `datasets/sample@vN`.
    pub reference: String,
}

impl SampleEnv {
    pub fn new(prefix: &str) -> SampleEnv {
        let cli = CliHome::new(prefix);
        let reference = cli.register_sample();
        SampleEnv { cli, reference }
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        self.cli.cmd(args)
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        self.cli.cli(args)
    }

    pub fn ok(&self, args: &[&str]) -> String {
        self.cli.ok(args)
    }

    pub fn sandboxes(&self) -> Vec<serde_json::Value> {
        serde_json::from_str(&self.ok(&["sandbox", "ls", "--json"])).expect("sandbox ls --json")
    }

    /// `sandbox create EXTRA... <sample>`; the new sandbox's ID.
    pub fn create(&self, extra: &[&str]) -> String {
        let mut args = vec!["sandbox", "create"];
        args.extend_from_slice(extra);
        args.push(&self.reference);
        self.ok(&args)
            .lines()
            .last()
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    /// `sh -c SCRIPT` in a sandbox.
    pub fn sh(&self, id: &str, script: &str) -> Output {
        self.cli(&["sandbox", "exec", id, "--", "sh", "-c", script])
    }

    /// Runs `strata ARGS`, asserting it fails with `needle` in its stderr.
    pub fn refused(&self, args: &[&str], needle: &str) {
        let o = self.cli(args);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "strata {args:?} succeeded");
        assert!(err.contains(needle), "strata {args:?}: {err}");
    }

    /// `strata run FLAGS... REFERENCE -- true`, asserting it is refused with `needle`.
    pub fn refused_run(&self, flags: &[&str], reference: &str, needle: &str) {
        let mut args = vec!["run"];
        args.extend_from_slice(flags);
        args.extend([reference, "--", "true"]);
        self.refused(&args, needle);
    }

    /// The host PID of sandbox `id`'s init (a VM's QEMU), as `sandbox ls` lists it.
    /// [`SampleEnv::sh`] that must succeed; its stdout.
    pub fn sh_ok(&self, id: &str, script: &str) -> String {
        self.ok(&["sandbox", "exec", id, "--", "sh", "-c", script])
    }

    /// After `cycles` hibernate cycles that each wrote `/work/cycle-N` before the
    /// hibernation: checks the sandbox is listed hibernated, wakes it, checks every cycle's
    /// file is there, and returns its audit's counts of `hibernated` and `woken` events.
    pub fn wake_after_cycles(&self, id: &str, cycles: usize) -> (usize, usize) {
        let state = self
            .sandboxes()
            .into_iter()
            .find(|s| s["id"] == id)
            .map(|s| s["state"].clone());
        assert_eq!(state, Some("hibernated".into()));
        assert_eq!(self.ok(&["sandbox", "wake", id]).trim(), id);
        let files = self.sh_ok(
            id,
            &format!(
                "for i in $(seq 0 {}); do cat /work/cycle-$i; done | sort -n | uniq | wc -l",
                cycles - 1
            ),
        );
        assert_eq!(
            files.trim(),
            cycles.to_string(),
            "a file written between cycles was lost"
        );
        let audit = self.ok(&["sandbox", "audit", id]);
        let count = |event: &str| {
            audit
                .lines()
                .filter(|l| l.contains(&format!("\"event\":\"{event}\"")))
                .count()
        };
        (count("hibernated"), count("woken"))
    }

    pub fn init_pid(&self, id: &str) -> i32 {
        let rec = self
            .sandboxes()
            .into_iter()
            .find(|s| s["id"] == id)
            .unwrap_or_else(|| panic!("sandbox {id} is not listed"));
        rec["init_pid"].as_u64().expect("init_pid") as i32
    }

    /// Nothing of sandbox `id` is left on the host.
    pub fn assert_gone(&self, id: &str, host_pids: &[u32]) {
        self.cli.assert_sandbox_gone(id, host_pids);
    }

    /// Starts `strata run EXTRA... -e MARK=<unique> <sample> -- sleep 300` (a one-shot
    /// sandbox to kill the CLI of) and waits until its sandbox is listed; the CLI process
    /// and the sandbox's ID. Panics with the CLI's stderr if it ends first.
    pub fn spawn_marked_run(&self, extra: &[&str], within: Duration) -> (Child, String) {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let value = format!(
            "{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mark = format!("MARK={value}");
        let mut args = vec!["run"];
        args.extend_from_slice(extra);
        args.extend(["-e", &mark, &self.reference, "--", "sleep", "300"]);
        let mut child = self
            .cmd(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting strata run");
        let deadline = Instant::now() + within;
        loop {
            let found = self
                .sandboxes()
                .into_iter()
                .find(|s| s["spec"]["env"]["MARK"].as_str() == Some(value.as_str()));
            if let Some(s) = found {
                let id = s["id"].as_str().unwrap_or_default().to_string();
                return (child, id);
            }
            if let Ok(Some(status)) = child.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                panic!("strata run {extra:?} ended early ({status}): {err}");
            }
            assert!(
                Instant::now() < deadline,
                "the sandbox of strata run {extra:?} never appeared"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl SampleEnv {
    /// Registers `datasets/graded` (once): the sample's stack with a `grade` command that
    /// runs the workspace's tests and the grader's own (`tests/probes/grader/`, built as the
    /// entry's evaluator layer, mounted at /evaluator), the workspace's tests protected; its
    /// `grade` prints what the graded code logged to /tmp/tamper.log after. Its reference.
    pub fn graded(&self) -> &str {
        static GRADED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        GRADED.get_or_init(|| {
            let grader = Path::new(env!("CARGO_MANIFEST_DIR")).join("probes/grader");
            let layer = self.ok(&[
                "layer", "build", "--kind", "toolkit", "--name", "tests/grader", "--version", "1",
                &grader.display().to_string(),
            ]);
            let layer = layer.lines().last().unwrap_or_default().trim().to_string();
            let shown: serde_json::Value = serde_json::from_str(&self.ok(&[
                "catalog", "show", &self.reference, "--json",
            ]))
            .expect("catalog show --json");
            let mut entry = shown["entry"].clone();
            let e = entry.as_object_mut().expect("an entry");
            e.insert("id".into(), "datasets/graded".into());
            e.remove("version");
            e.insert(
                "commands".into(),
                serde_json::json!({"grade": "python3 -m pytest -q -p no:cacheprovider tests /evaluator; s=$?; cat /tmp/tamper.log 2>/dev/null; exit $s"}),
            );
            e.insert(
                "evaluator".into(),
                serde_json::json!({"layer": layer, "protect": ["/work/tests"]}),
            );
            e.retain(|_, v| !v.is_null());
            let toml = toml::to_string(&entry).expect("the entry as TOML");
            let file = self.cli.home.join("graded.toml");
            std::fs::write(&file, toml).expect("writing the graded entry");
            let out = self.ok(&["catalog", "register", &file.display().to_string()]);
            out.lines().last().unwrap_or_default().trim().to_string()
        })
    }
}

/// What the agent-integrity probe (`tests/probes/agent_integrity.py`) reports.
#[derive(Debug, serde::Deserialize)]
struct ProbeReport {
    passes: u64,
    findings: Vec<serde_json::Value>,
    readable: std::collections::BTreeMap<String, String>,
}

impl SampleEnv {
    /// Threat model, "the sandbox's processes" (SECURITY.md): a hostile command cannot take
    /// over the agent that reports every exec's result, nor reach another exec's
    /// processes, nor learn the host's layout. In a new `backend` sandbox the probe scans
    /// once, then attacks in the background (ptrace and /proc/PID/mem of every process not
    /// its own, signals to the agent, accept on every inherited socket, every socket it
    /// can find) while the host runs 20 execs; every exec must return its real output and
    /// status, and the probe must have found nothing.
    /// `strata run --backend BACKEND <sample> -- ARGV...`, asserting success; its stdout.
    pub fn run_once(&self, backend: &str, argv: &[&str]) -> String {
        let mut args = vec!["run", "--backend", backend, &self.reference, "--"];
        args.extend_from_slice(argv);
        self.ok(&args)
    }

    /// SECURITY.md, "the host's kernel": a sandbox's commands, root inside, read nothing of
    /// the kernel's files about the host (`/proc/kpage*`, the page tables of every page of
    /// the host's memory, whose read crashed a kernel in DSec's report; runc's masked
    /// paths) and write none of its settings (`/proc/sys`, the sysrq trigger).
    pub fn assert_kernel_files_hidden(&self, backend: &str) {
        let script = r#"
for f in /proc/kpagecgroup /proc/kpageflags /proc/kpagecount /proc/kcore /proc/timer_list /proc/keys; do
  [ -e $f ] && echo "read $f $(head -c 64 $f 2>/dev/null | wc -c)"
done
for d in /proc/acpi /proc/scsi /sys/firmware; do
  [ -d $d ] && echo "list $d $(ls -A $d | wc -l)"
done
(echo strata > /proc/sys/kernel/domainname) 2>/dev/null && echo "wrote /proc/sys/kernel/domainname"
(echo h > /proc/sysrq-trigger) 2>/dev/null && echo "wrote /proc/sysrq-trigger"
echo checked
"#;
        let out = self.run_once(backend, &["sh", "-c", script]);
        assert!(out.contains("checked"), "{backend}: {out}");
        for line in out.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["read" | "list", path, n] => {
                    assert_eq!(*n, "0", "{backend}: {path} shows something inside: {out}")
                }
                ["wrote", path] => panic!("{backend}: a command wrote {path}"),
                _ => {}
            }
        }
        // The page tables exist (the host's kernel, and the guests' Debian kernel, have
        // them), so the masked file is there and empty, not merely absent.
        if Path::new("/proc/kpagecgroup").exists() {
            assert!(
                out.contains("read /proc/kpagecgroup 0"),
                "{backend}: /proc/kpagecgroup not checked: {out}"
            );
        }
        crate::contained("host kernel files and settings", backend, 11);
    }

    /// SECURITY.md, "confinement every sandbox gets": the shared policy is an allowlist.
    /// Its dangerous syscalls (io_uring, whose operations run in kernel workers seccomp
    /// never sees; bpf; perf; keyrings; new namespaces; mounts; handles; userfaultfd;
    /// kexec; vsock) are refused with EPERM before the kernel looks at their arguments,
    /// calls outside the allowlist are answered ENOSYS, and the file system ioctls of the
    /// XFS incident (extent swaps, reflinks, dedupe, block maps, flags) EPERM on files of
    /// the writable layer (whose file system `e2fsck -fn` finds clean after), while the
    /// calls a program needs still reach the kernel. The same probe on the host,
    /// unconfined, is the control: there the calls answer on their
    /// arguments, so the sandbox's answers come from its policy.
    pub fn assert_dangerous_syscalls_refused(&self, backend: &str) {
        let probe = syscall_probe();
        let host = Command::new("python3")
            .arg(&probe)
            .arg("control")
            .output()
            .expect("running the syscall probe on the host");
        assert!(host.status.success(), "host control: {host:?}");
        let control: serde_json::Value =
            serde_json::from_slice(&host.stdout).expect("control JSON");
        let source = std::fs::read_to_string(&probe).expect("reading the syscall probe");
        // In a sandbox of its own, so that afterwards the file system the ioctls were
        // tried on (a host backend's writable layer, an ext4 image on the host) can be
        // checked: a copy taken while it is paused and synced, `e2fsck -fn`.
        let id = self.create(&["--backend", backend]);
        let out = self.ok(&[
            "sandbox", "exec", &id, "--", "python3", "-c", &source, "all",
        ]);
        if !backend.ends_with("vm") {
            self.ok(&["sandbox", "pause", &id]);
            let upper = self.cli.runtime_dir().join("uppers").join(&id);
            let image = self
                .cli
                .runtime_dir()
                .join("upper-images")
                .join(format!("{id}.img"));
            let copy = scratch_root().join(format!("fsck-{id}.img"));
            let fsck = crate::sh(&format!(
                "sync -f '{u}' && cp --sparse=always '{i}' '{c}' && e2fsck -fn '{c}' 2>&1; echo \"fsck exit $?\"; rm -f '{c}'",
                u = upper.display(),
                i = image.display(),
                c = copy.display()
            ));
            assert!(
                fsck.trim_end().ends_with("fsck exit 0"),
                "{backend}: the writable layer's file system after the ioctls: {fsck}"
            );
            self.ok(&["sandbox", "resume", &id]);
        }
        self.ok(&["sandbox", "rm", &id]);
        let got = assert_policy_answers(
            backend,
            &out,
            &[("unlisted", "ENOSYS"), ("ioctls", "EPERM")],
        );
        let section = |name: &str| got[name].as_object().cloned().unwrap_or_default();
        // Unconfined, kcmp, move_pages, modify_ldt, FICLONE, FIDEDUPERANGE, FIEMAP,
        // SETFLAGS, SWAPEXT and TIOCSTI answer otherwise (ok, ENOTSUP or ENOTTY).
        let told_apart = [("unlisted", "ENOSYS"), ("ioctls", "EPERM")]
            .iter()
            .flat_map(|(kind, refusal)| {
                section(kind)
                    .into_iter()
                    .filter(|(name, _)| control[kind][name] != *refusal)
                    .collect::<Vec<_>>()
            })
            .count();
        assert!(
            told_apart >= 8,
            "{backend}: the control tells too little apart: {control}"
        );
        let tried = section("denied").len() + section("unlisted").len() + section("ioctls").len();
        crate::contained("dangerous syscalls and ioctls", backend, tried);
    }

    /// SECURITY.md, "evaluation", on `backend`: an agent's sandbox can change neither what
    /// grades it nor how (see the runtime and vm tests that call it).
    pub fn assert_grader_untouchable(&self, backend: &str) {
        let env = self;
        let graded = env.graded().to_string();
        let tamper = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("probes/tampering_wordfreq.py")
            .display()
            .to_string();
        // The evaluation sandboxes made, by the `evaluated` records of the graded ones.
        let mut graders: Vec<String> = Vec::new();
        let evaluated = |id: &str| -> serde_json::Value {
            let audit = env.ok(&["sandbox", "audit", id]);
            audit
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .find(|l| l["event"] == "evaluated")
                .unwrap_or_else(|| panic!("no evaluated event: {audit}"))
        };
        let honest = env.ok(&["sandbox", "create", "--backend", backend, &graded]);
        let honest = honest.lines().last().unwrap_or_default().trim().to_string();
        let o = env.cli(&["sandbox", "evaluate", &honest, "--command", "grade"]);
        let (out, err) = text(&o);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{backend}: honest grade: {out}{err}"
        );
        assert!(out.contains("5 passed"), "{backend}: {out}");
        assert!(
            err.contains("the agent changed 0 paths"),
            "{backend}: {err}"
        );
        graders.extend(evaluated(&honest)["sandbox"].as_str().map(str::to_string));

        let agent = env.ok(&["sandbox", "create", "--backend", backend, &graded]);
        let agent = agent.lines().last().unwrap_or_default().trim().to_string();
        env.ok(&["sandbox", "cp", &tamper, &format!("{agent}:/tmp/tamper.py")]);
        // (The commands of fncall sandboxes and VM guests cannot write in a new top-level
        // directory: their Landlock rules keep the root's top level as it is.)
        let top_level_kept = backend != "container";
        env.sh_ok(
            &agent,
            &format!("set -e; cp /tmp/tamper.py /work/src/wordfreq/__init__.py; \
             printf 'def test_passes():\\n    pass\\n' > /work/tests/test_wordfreq.py; \
             (mkdir -p /evaluator && echo 'collect_ignore_glob = [\"*\"]' > /evaluator/conftest.py) 2>/dev/null \
               || {top_level_kept}; \
             echo tampered > /usr/lib/os-release; cp /bin/true /bin/bash"),
        );
        let o = env.cli(&[
            "sandbox",
            "evaluate",
            &agent,
            "--command",
            "grade",
            "--json",
        ]);
        let (out, err) = text(&o);
        let done: serde_json::Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("{backend}: evaluate --json: {e}: {out}{err}"));
        assert_eq!(
            o.status.code(),
            done["exit_code"].as_i64().map(|c| c as i32)
        );
        graders.extend(done["sandbox"].as_str().map(str::to_string));
        assert_eq!(
            done["backend"], backend,
            "graded on another backend: {done}"
        );
        assert_ne!(
            done["exit_code"], 0,
            "{backend}: the gamed grade passed: {done}"
        );
        let stdout = done["stdout"].as_str().unwrap_or_default();
        // The workspace's own four tests and the grader's ran (only `test_empty` holds for
        // an empty answer).
        assert!(stdout.contains("4 failed, 1 passed"), "{backend}: {stdout}");
        assert!(stdout.contains("test_hidden.py"), "{backend}: {stdout}");
        // Writes meet a read-only file system; moves a mount point (or, on fncall, the
        // Landlock rules of the root) refuses.
        for (attempt, refusal) in [
            (
                "write /work/tests/test_wordfreq.py",
                Some("Read-only file system"),
            ),
            (
                "write /evaluator/test_hidden.py",
                Some("Read-only file system"),
            ),
            ("add /evaluator/conftest.py", Some("Read-only file system")),
            (
                "remove /work/tests/test_wordfreq.py",
                Some("Read-only file system"),
            ),
            ("move /work/tests away", None),
            ("move /work away", None),
        ] {
            let line = stdout
                .lines()
                .find(|l| l.starts_with(&format!("{attempt}: ")))
                .unwrap_or_else(|| panic!("{backend}: {attempt} not tried: {stdout}"));
            assert!(!line.ends_with(": done"), "{backend}: {line}");
            if let Some(refusal) = refusal {
                assert!(line.ends_with(refusal), "{backend}: {line}");
            }
        }
        let changed: Vec<(String, bool)> = done["changed"]
            .as_array()
            .expect("changed")
            .iter()
            .map(|c| {
                (
                    c["path"].as_str().unwrap_or_default().to_string(),
                    c["protected"].as_bool().unwrap_or(false),
                )
            })
            .collect();
        let planted = (!top_level_kept).then_some(("/evaluator/conftest.py", true));
        for (path, protected) in [
            ("/work/tests/test_wordfreq.py", true),
            ("/work/src/wordfreq/__init__.py", false),
            ("/usr/lib/os-release", false),
            ("/usr/bin/bash", false),
        ]
        .into_iter()
        .chain(planted)
        {
            assert!(
                changed.contains(&(path.to_string(), protected)),
                "{backend}: {path} (protected {protected}) not in {changed:?}"
            );
        }
        let evaluated = evaluated(&agent);
        assert_eq!(evaluated["exit_code"], done["exit_code"], "{evaluated}");
        let tampered = evaluated["protected_changes"].to_string();
        assert!(
            tampered.contains("/work/tests/test_wordfreq.py"),
            "{tampered}"
        );
        // The agent's sandbox is as it left it; the next one of the entry is clean.
        assert_eq!(
            env.ok(&[
                "sandbox",
                "exec",
                &agent,
                "--",
                "cat",
                "/usr/lib/os-release"
            ]),
            "tampered\n"
        );
        let fresh = env.ok(&[
            "run", "--backend", backend, &graded, "--", "bash", "-c",
            "echo bash-works; grep -c PRETTY_NAME /usr/lib/os-release; grep -c test_lowercases tests/test_wordfreq.py",
        ]);
        assert_eq!(fresh, "bash-works\n1\n1\n", "{backend}");

        // A symlink on the way to a protected path is refused, naming it. (The commands
        // of fncall sandboxes and VM guests cannot move a top-level directory at all.)
        if !top_level_kept {
            env.sh_ok(&honest, "mv /work /work.real && ln -s /work.real /work");
            let o = env.cli(&["sandbox", "evaluate", &honest, "--command", "grade"]);
            let (_, err) = text(&o);
            assert!(
                !o.status.success(),
                "{backend}: graded through a symlinked /work"
            );
            assert!(err.contains("symlink at /work"), "{backend}: {err}");
        }

        for id in [&agent, &honest] {
            env.ok(&["sandbox", "rm", id]);
        }
        // Nothing of the evaluation sandboxes is left: no mount, no directory.
        assert_eq!(graders.len(), 2, "{graders:?}");
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for id in &graders {
            let dir = env.cli.home.join("runtime/sandboxes").join(id);
            let left: Vec<&str> = mounts
                .lines()
                .filter(|l| l.contains(&format!("/sandboxes/{id}/")))
                .collect();
            assert!(left.is_empty(), "{id}: left mounted: {left:#?}");
            assert!(!dir.exists(), "{id}: {} is left", dir.display());
        }
        // Six tries under the grader, the protected files' changes, the next sandbox; on
        // a container a symlinked /work too.
        crate::contained("game the grader", backend, 8 + usize::from(!top_level_kept));
    }

    pub fn assert_agent_integrity(&self, backend: &str) {
        let probe = Path::new(env!("CARGO_MANIFEST_DIR")).join("probes/agent_integrity.py");
        let id = self.create(&["--backend", backend]);
        let dest = format!("{id}:/tmp/probe.py");
        self.ok(&["sandbox", "cp", &probe.display().to_string(), &dest]);
        let run = |args: &[&str]| {
            let mut all = vec!["sandbox", "exec", id.as_str(), "--"];
            all.extend_from_slice(args);
            self.ok(&all)
        };
        // The control: the probe's own attacks work on a process of its own.
        let control: serde_json::Value =
            serde_json::from_str(&run(&["python3", "/tmp/probe.py", "selftest"]))
                .expect("selftest JSON");
        assert_eq!(control["ptrace"], true, "{backend}: {control}");
        assert_eq!(control["environ"], true, "{backend}: {control}");
        let host_paths: Vec<String> = [
            self.cli.home.clone(),
            self.cli.store.clone(),
            strata_bin()
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_default(),
            PathBuf::from(env!("CARGO_MANIFEST_DIR")),
        ]
        .iter()
        .map(|p| p.display().to_string())
        .collect();
        let check = |report: &ProbeReport, when: &str| {
            assert!(
                report.findings.is_empty(),
                "{backend} ({when}): the probe got through: {:#?}",
                report.findings
            );
            for (file, content) in &report.readable {
                for host in &host_paths {
                    assert!(
                        !content.contains(host.as_str()),
                        "{backend} ({when}): {file} inside shows the host path {host}: {content}"
                    );
                }
            }
        };
        let scan: ProbeReport =
            serde_json::from_str(&run(&["python3", "/tmp/probe.py", "scan"])).expect("scan JSON");
        check(&scan, "scan");
        run(&[
            "sh",
            "-c",
            "setsid python3 /tmp/probe.py attack 300 /tmp/report.json >/dev/null 2>&1 </dev/null &",
        ]);
        // The attack is under way once it has made a pass.
        std::thread::sleep(Duration::from_millis(500));
        for i in 0..20 {
            let script = format!("echo out-{i}; echo err-{i} >&2; exit {}", i % 5);
            let o = self.sh(&id, &script);
            let (out, err) = text(&o);
            assert_eq!(
                (out.as_str(), err.as_str(), o.status.code()),
                (
                    format!("out-{i}\n").as_str(),
                    format!("err-{i}\n").as_str(),
                    Some(i % 5)
                ),
                "{backend}: exec {i} under attack"
            );
        }
        run(&["touch", "/tmp/report.json.stop"]);
        let text_report = run(&[
            "sh",
            "-c",
            "for i in $(seq 600); do [ -f /tmp/report.json ] && break; sleep 0.1; done; cat /tmp/report.json",
        ]);
        let attack: ProbeReport = serde_json::from_str(&text_report).expect("attack report");
        assert!(attack.passes > 0, "{backend}: the attack never ran");
        check(&attack, "attack");
        self.ok(&["sandbox", "rm", &id]);
        // The scan, each attack pass (ptrace, memory, signals, sockets of every process
        // not its own) and the 20 execs it tried to falsify.
        crate::contained(
            "take over the agent",
            backend,
            1 + attack.passes as usize + 20,
        );
    }
}

/// The syscall probe, `tests/probes/syscalls.py` (see its docstring).
pub fn syscall_probe() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("probes/syscalls.py")
}

/// Checks the syscall probe's output `out` (its JSON on the last line) from `what` for the
/// policy's answers: the 15 denied calls EPERM, each of `refused` (a section and the
/// answer its calls get) answered so, the allowed calls `ok`. Returns the parsed output.
pub fn assert_policy_answers(what: &str, out: &str, refused: &[(&str, &str)]) -> serde_json::Value {
    let got: serde_json::Value =
        serde_json::from_str(out.lines().last().unwrap_or_default()).expect("syscall JSON");
    let section = |name: &str| {
        got[name]
            .as_object()
            .unwrap_or_else(|| panic!("{what}: no {name} in {got}"))
            .clone()
    };
    let denied = section("denied");
    assert_eq!(denied.len(), 15, "{what}: {got}");
    for (name, answer) in &denied {
        assert_eq!(answer, "EPERM", "{what}: {name} reached the kernel: {got}");
    }
    for (kind, refusal) in refused {
        let calls = section(kind);
        assert!(!calls.is_empty(), "{what}: no {kind} tried: {got}");
        for (name, answer) in calls {
            assert_eq!(
                answer, *refusal,
                "{what}: {kind} {name} reached the kernel: {got}"
            );
        }
    }
    for (name, answer) in section("allowed") {
        assert_eq!(answer, "ok", "{what}: allowed {name} was refused: {got}");
    }
    got
}
