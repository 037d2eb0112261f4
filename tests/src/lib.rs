//! Fixtures for Strata's integration tests: privileged-capability gating, sample trees,
//! whole-tree comparison, kernel EROFS mounts, the `strata` binary and private homes for
//! it, a real S3 server, and a latency-injecting proxy to put in front of it.

pub mod fixtures;
pub mod home;
pub mod proxy;
pub mod s3;
pub mod service;
pub mod treecmp;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Tests of this process that did not run for want of a capability.
static NOT_RUN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

extern "C" fn report_not_run() {
    let names = NOT_RUN.lock().map(|n| n.clone()).unwrap_or_default();
    if !names.is_empty() {
        // After the harness's own summary, which counted them as passed.
        eprintln!(
            "NOT RUN: {} privileged test(s) of {} did not run (need root, FUSE, tools or a guest kernel): {}",
            names.len(),
            std::env::args()
                .next()
                .as_deref()
                .and_then(|p| Path::new(p).file_name()?.to_str().map(str::to_string))
                .unwrap_or_default(),
            names.join(", ")
        );
    }
}

/// Records that `test` did not run, and says so (the harness will count it as passed).
pub fn not_run(test: &str, why: &str) {
    eprintln!("SKIPPED {test}: {why}");
    let mut names = NOT_RUN.lock().unwrap_or_else(|p| p.into_inner());
    if names.is_empty() {
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(report_not_run) };
    }
    if !names.iter().any(|n| n == test) {
        names.push(test.to_string());
    }
}

/// `present`, or (it is not) a failure when STRATA_REQUIRE_PRIVILEGED=1, else a loud skip
/// saying `why`.
pub fn needs(test: &str, present: bool, why: &str) -> bool {
    if !present {
        assert!(!privileged_required(), "{test}: {why}");
        not_run(test, why);
    }
    present
}

/// Whether tests must fail (not skip) when a capability is missing. `.ci/run` sets it.
pub fn privileged_required() -> bool {
    std::env::var("STRATA_REQUIRE_PRIVILEGED").is_ok_and(|v| v == "1")
}

/// True if the test may use root, mounts and FUSE. Without them: a failure when
/// STRATA_REQUIRE_PRIVILEGED=1, else a loud skip.
pub fn have_root(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        assert!(
            !privileged_required(),
            "{test}: needs root, and STRATA_REQUIRE_PRIVILEGED=1 is set"
        );
        not_run(
            test,
            "needs root (set STRATA_REQUIRE_PRIVILEGED=1 to make this a failure)",
        );
    }
    root
}

/// True if `tool` is on PATH; same failure/skip rule as [`have_root`].
pub fn have_tool(test: &str, tool: &str) -> bool {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            !privileged_required(),
            "{test}: needs `{tool}` (run scripts/setup.sh)"
        );
        not_run(
            test,
            &format!("`{tool}` not installed (run scripts/setup.sh)"),
        );
    }
    found
}

/// The `strata` binary built next to this test executable.
pub fn strata_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/strata
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target directory");
    let bin = dir.join("strata");
    assert!(
        bin.is_file(),
        "{} is missing: build it first with `cargo build -p strata` (scripts/test.sh does)",
        bin.display()
    );
    bin
}

/// Runs `strata` with a store and arguments.
pub fn strata(store: &str, args: &[&str]) -> Output {
    Command::new(strata_bin())
        .arg("--store")
        .arg(store)
        .args(args)
        .output()
        .expect("running strata")
}

/// Runs `cmd`, panicking with `what` and its output if it fails; its stdout.
pub fn run_ok(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a shell command, panicking with its output if it fails.
pub fn sh(script: &str) -> String {
    let out = Command::new("bash")
        .arg("-ec")
        .arg(script)
        .output()
        .expect("bash");
    assert!(
        out.status.success(),
        "`{script}` failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A multi-threaded runtime for tests that call async library code.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// A layer written out as files: its metadata image and (if it has data) its blob.
pub struct LayerFiles {
    pub dir: tempfile::TempDir,
    pub meta: PathBuf,
    pub blob: Option<PathBuf>,
}

/// Fetches a layer's image and blob from the store into a temp directory on local disk
/// (file-backed EROFS mounts refuse tmpfs).
pub fn fetch_layer(
    rt: &tokio::runtime::Runtime,
    store: &strata_store::Store,
    id: &strata_store::Digest,
) -> LayerFiles {
    let dir = tempfile::Builder::new()
        .prefix("strata-layer-")
        .tempdir_in(scratch_root())
        .expect("tempdir");
    let meta = dir.path().join("meta.erofs");
    let blob = dir.path().join("blob");
    rt.block_on(async {
        let m = store.get_layer(id).await.expect("manifest");
        strata_builder::export::fetch_layer_files(store, &m, &meta, &blob)
            .await
            .expect("fetch");
        let has_blob = m.blob_size > 0;
        LayerFiles {
            meta,
            blob: has_blob.then_some(blob),
            dir,
        }
    })
}

/// Where tests put scratch files: on a disk filesystem, never tmpfs.
pub fn scratch_root() -> PathBuf {
    let p = std::env::var_os("STRATA_TEST_SCRATCH")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-scratch")
        });
    std::fs::create_dir_all(&p).expect("scratch dir");
    std::fs::canonicalize(&p).expect("scratch dir")
}

/// A kernel EROFS mount, unmounted on drop.
pub struct KernelMount {
    pub target: tempfile::TempDir,
}

impl KernelMount {
    /// Mounts `meta` file-backed (no loop device) with `device=blob`, read-only.
    pub fn new(meta: &Path, blob: Option<&Path>) -> std::io::Result<KernelMount> {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        let target = tempfile::Builder::new()
            .prefix("strata-mnt-")
            .tempdir_in(scratch_root())?;
        let src = CString::new(meta.as_os_str().as_bytes())?;
        let dst = CString::new(target.path().as_os_str().as_bytes())?;
        let opts = match blob {
            Some(b) => format!("device={}", b.display()),
            None => String::new(),
        };
        let opts = CString::new(opts)?;
        let fstype = CString::new("erofs")?;
        // SAFETY: all pointers are valid NUL-terminated strings.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                dst.as_ptr(),
                fstype.as_ptr(),
                libc::MS_RDONLY,
                opts.as_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(KernelMount { target })
    }

    pub fn path(&self) -> &Path {
        self.target.path()
    }
}

impl Drop for KernelMount {
    fn drop(&mut self) {
        use std::os::unix::ffi::OsStrExt;
        if let Ok(p) = std::ffi::CString::new(self.target.path().as_os_str().as_bytes()) {
            // SAFETY: valid path.
            unsafe { libc::umount2(p.as_ptr(), libc::MNT_DETACH) };
        }
    }
}

/// Opens a local store in a fresh temp directory.
pub fn temp_store() -> (tempfile::TempDir, strata_store::Store) {
    let dir = tempfile::Builder::new()
        .prefix("strata-store-")
        .tempdir_in(scratch_root())
        .expect("tempdir");
    let store = strata_store::Store::open(&strata_store::StoreUrl::Local(dir.path().join("store")))
        .expect("store");
    (dir, store)
}

/// Builds `source` into `store`.
pub fn build(
    rt: &tokio::runtime::Runtime,
    store: &strata_store::Store,
    source: strata_builder::Source,
    kind: strata_builder::LayerKind,
) -> Result<strata_builder::BuildReport, strata_builder::BuildError> {
    let req = strata_builder::BuildRequest {
        source,
        kind,
        name: None,
        version: None,
        exclude: vec![],
        prefix: None,
        source_label: None,
        provenance: Default::default(),
        registry: Default::default(),
    };
    rt.block_on(strata_builder::build(store, &req, None))
}

/// True if /dev/fuse exists; same failure/skip rule as [`have_root`].
pub fn have_fuse(test: &str) -> bool {
    let ok = Path::new("/dev/fuse").exists();
    if !ok {
        assert!(
            !privileged_required(),
            "{test}: needs /dev/fuse, and STRATA_REQUIRE_PRIVILEGED=1 is set"
        );
        not_run(test, "/dev/fuse is missing");
    }
    ok
}

/// Registers 20 versions of one entry from 20 concurrent `strata catalog register`
/// processes against `store_url`, and checks that all 20 exist, the history has all 20,
/// and latest is one of them.
pub fn concurrent_registrations(store_url: &str, entry_toml: &Path) {
    let procs: Vec<_> = (0..20)
        .map(|_| {
            Command::new(strata_bin())
                .args(["--store", store_url, "catalog", "register"])
                .arg(entry_toml)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn strata")
        })
        .collect();
    let mut versions = Vec::new();
    for p in procs {
        let o = p.wait_with_output().expect("wait");
        assert!(
            o.status.success(),
            "register failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        versions.push(String::from_utf8_lossy(&o.stdout).trim().to_string());
    }
    versions.sort();
    versions.dedup();
    assert_eq!(
        versions.len(),
        20,
        "every concurrent registration got its own version: {versions:?}"
    );
    let o = strata(store_url, &["catalog", "history", "conc/entry", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let h: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        h.as_array().unwrap().len(),
        20,
        "no registration lost from the log"
    );
    let o = strata(store_url, &["catalog", "show", "conc/entry", "--json"]);
    let latest: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let latest = format!("conc/entry@{}", latest["version"].as_str().unwrap());
    assert!(
        versions.contains(&latest),
        "latest {latest} is one of the concurrent ones"
    );
}

/// A mount a test makes itself (`mount ARGS DIR`), unmounted when dropped (a failed
/// assertion included).
pub struct OwnMount(pub PathBuf);

impl OwnMount {
    pub fn new(args: &str, dir: &Path) -> OwnMount {
        std::fs::create_dir_all(dir).expect("the mount point");
        sh(&format!("mount {args} '{}'", dir.display()));
        OwnMount(dir.to_path_buf())
    }
}

impl Drop for OwnMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Mount points at or below `p`, as lines of /proc/self/mountinfo.
pub fn mounts_under(p: &Path) -> Vec<String> {
    let prefix = p.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split(' ').nth(4).is_some_and(|m| m.starts_with(&prefix)))
        .map(str::to_string)
        .collect()
}

/// The loop devices still attached to an upper image under `images` that no pool keeps
/// (any whose image is deleted, or not named `pool-*`): an upper some mount namespace
/// still holds after its sandbox was destroyed. Waits up to 10 s for the kernel, which
/// detaches an auto-clearing device a moment after its last unmount.
pub fn held_uppers(images: &Path) -> Vec<String> {
    let prefix = images.to_string_lossy().into_owned();
    let scan = || -> Vec<String> {
        std::fs::read_dir("/sys/block")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("loop/backing_file")).ok())
            .map(|f| f.trim().to_string())
            .filter(|f| f.starts_with(&prefix))
            .filter(|f| {
                let name = f.rsplit('/').next().unwrap_or_default();
                f.ends_with("(deleted)") || !name.starts_with("pool-")
            })
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut held = scan();
    while !held.is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
        held = scan();
    }
    held
}

/// A TCP server on every host address, on a free port, that greets each connection
/// with `hello from the host`; stops when dropped.
pub struct HostServer {
    pub port: u16,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl HostServer {
    pub fn start() -> HostServer {
        let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::spawn(move || {
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        use std::io::Write;
                        let _ = s.write_all(b"hello from the host\n");
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
                }
            }
        });
        HostServer { port, stop }
    }
}

impl Drop for HostServer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Records for the containment report (`scripts/containment-report.sh`) that `scenario`
/// made `tried` attempts on `backend` and every one was contained: called once a
/// scenario's assertions for that backend have passed. A line
/// `CONTAINED<TAB>scenario<TAB>backend<TAB>tried` goes to stderr and, when
/// `STRATA_CONTAINMENT_REPORT` names a file, is appended to it. Faults use the backend
/// `faults` and count what was injected and survived.
pub fn contained(scenario: &str, backend: &str, tried: usize) {
    let line = format!("CONTAINED\t{scenario}\t{backend}\t{tried}\n");
    eprint!("{line}");
    if let Some(path) = std::env::var_os("STRATA_CONTAINMENT_REPORT") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// What a command printed to its stdout, counted as it arrives (never held), with its
/// exit status, its stderr and its peak resident memory (VmHWM, KiB) while it ran.
pub struct Streamed {
    pub status: std::process::ExitStatus,
    pub bytes: u64,
    pub stderr: String,
    pub peak_kib: u64,
}

/// Runs `cmd`, reading its stdout as fast as it comes, watching its peak memory.
pub fn stream_and_watch(cmd: &mut Command) -> Streamed {
    use std::sync::atomic::{AtomicU64, Ordering};
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting the command");
    let status_file = format!("/proc/{}/status", child.id());
    let peak = std::sync::Arc::new(AtomicU64::new(0));
    let watcher = {
        let peak = peak.clone();
        std::thread::spawn(move || {
            // VmHWM is the peak so far: the last reading before the exit is the peak.
            while let Ok(status) = std::fs::read_to_string(&status_file) {
                let hwm = status
                    .lines()
                    .find_map(|l| l.strip_prefix("VmHWM:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok());
                match hwm {
                    Some(kib) => peak.fetch_max(kib, Ordering::Relaxed),
                    None => break,
                };
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        })
    };
    let mut stdout = child.stdout.take().expect("stdout");
    let mut bytes = 0u64;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match std::io::Read::read(&mut stdout, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => bytes += n as u64,
        }
    }
    let out = child.wait_with_output().expect("waiting for the command");
    let _ = watcher.join();
    Streamed {
        status: out.status,
        bytes,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        peak_kib: peak.load(Ordering::Relaxed),
    }
}

/// Host memory held and not reclaimable: anonymous pages (a guest's RAM, QEMU's own),
/// shared memory and the kernel's unreclaimable parts. Page cache is left out: it is
/// given back on demand, and MemAvailable's estimate of it moves by ~100 MiB with
/// unrelated file traffic.
pub fn host_used_bytes() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
            << 10
    };
    [
        "AnonPages:",
        "Shmem:",
        "SUnreclaim:",
        "PageTables:",
        "KernelStack:",
    ]
    .iter()
    .map(|f| field(f))
    .sum()
}

/// Reports a hibernation test's cycles and checks its memory: awake, the sandbox held more
/// than `awake_factor` times `slack` (so the measure sees it), hibernated at most `slack`.
pub fn assert_memory_released(
    what: &str,
    per_cycle: std::time::Duration,
    awake_max: u64,
    hibernated_max: u64,
    slack: u64,
    awake_factor: u64,
) {
    eprintln!(
        "{what}: {per_cycle:?} a cycle; memory over the start: up to {} MiB awake, {} MiB hibernated",
        awake_max >> 20,
        hibernated_max >> 20
    );
    assert!(
        awake_max > awake_factor * slack,
        "{what}: awake the sandbox held only {} MiB",
        awake_max >> 20
    );
    assert!(
        hibernated_max <= slack,
        "{what}: hibernated, {} MiB more than at the start were still held",
        hibernated_max >> 20
    );
}
