//! The `runtime` suite: sandbox create → first exec latency per backend against bare
//! `crun run` on a pre-extracted rootfs and against exporting the layers first; sustained
//! creations per second under concurrency against bare crun; memory per idle sandbox.
//! Uses the sample environment (datasets/sample/register.sh) in its own store and
//! STRATA_HOME, with its layers already cached (the cold path is the lazyfs suite's).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use strata_catalog::{Backend, Catalog};
use strata_runtime::{ExecRequest, LazyfsAccess, Overrides, Runtime, RuntimeConfig, SandboxSpec};
use strata_store::{Store, StoreUrl};

use crate::report::{Row, Section};

pub(crate) fn bin(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.with_file_name(name);
    if !p.is_file() {
        bail!(
            "{} is missing: build it with `cargo build --release -p strata -p strata-agent`",
            p.display()
        );
    }
    Ok(p)
}

pub(crate) fn percentile(samples: &mut [f64], p: f64) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    if samples.is_empty() {
        return 0.0;
    }
    let idx = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[idx]
}

pub(crate) struct Setup {
    pub(crate) home: PathBuf,
    pub(crate) store_url: String,
    pub(crate) spec: SandboxSpec,
    pub(crate) runtime: Runtime,
    /// The environment's layers exported and merged into one directory.
    pub(crate) rootfs: PathBuf,
}

/// A suite leaves nothing running: the runtime's pooled agents and uppers, then the
/// home's lazyfs daemon (and its mounts).
impl Drop for Setup {
    fn drop(&mut self) {
        self.runtime.drain_pool();
        stop_lazyfs(&self.home);
    }
}

/// Stops the lazyfs daemon of the STRATA_HOME `home`, if one runs.
pub(crate) fn stop_lazyfs(home: &Path) {
    if let Ok(strata) = bin("strata") {
        let _ = Command::new(strata)
            .env("STRATA_HOME", home)
            .args(["lazyfs", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

pub(crate) fn setup(rt: &tokio::runtime::Runtime, scratch: &Path, repo: &Path) -> Result<Setup> {
    std::fs::create_dir_all(scratch)?;
    let dir = std::fs::canonicalize(scratch)?.join("runtime");
    let home = dir.join("home");
    let store_dir = dir.join("store");
    std::fs::create_dir_all(&home)?;
    let strata = bin("strata")?;
    let out = Command::new("bash")
        .arg(repo.join("datasets/sample/register.sh"))
        .arg(&strata)
        .env("STRATA_HOME", &home)
        .env("STRATA_STORE", &store_dir)
        .output()?;
    if !out.status.success() {
        bail!("register.sh: {}", String::from_utf8_lossy(&out.stderr));
    }
    let reference = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .context("register.sh printed nothing")?
        .trim()
        .to_string();
    let store = Store::open(&StoreUrl::Local(store_dir.clone()))?;
    let reg = rt.block_on(async {
        let c = Catalog::open(&store).await?;
        c.get(&reference).await
    })?;
    let spec = SandboxSpec::resolve(&reg, &Overrides::default())?;
    let store_url = store_dir.display().to_string();
    let runtime = open_runtime(&home, &store_url)?;
    // The merged tree for the baselines: what `strata layer export` gives, bottom first.
    let rootfs = dir.join("rootfs");
    if !rootfs.join("work").exists() {
        let _ = std::fs::remove_dir_all(&rootfs);
        for layer in spec.layers.iter().rev() {
            export(&strata, &home, &store_url, layer, &rootfs)?;
        }
        std::fs::create_dir_all(rootfs.join(".strata"))?;
        std::fs::write(rootfs.join(".strata/init"), b"")?;
    }
    Ok(Setup {
        home,
        store_url,
        spec,
        runtime,
        rootfs,
    })
}

/// The runtime of a benchmark's own STRATA_HOME, starting its own lazyfs daemon on
/// demand, with the static agent as container init where `cargo build --target ...` put it.
pub(crate) fn open_runtime(home: &Path, store_url: &str) -> Result<Runtime> {
    Ok(Runtime::open(runtime_config(home, store_url)?)?)
}

/// The configuration [`open_runtime`] opens, for a suite that changes it first.
pub(crate) fn runtime_config(home: &Path, store_url: &str) -> Result<RuntimeConfig> {
    let starter_home = home.to_path_buf();
    let starter_store = store_url.to_string();
    let start: strata_runtime::StartDaemon = Arc::new(move || {
        let log = std::fs::File::create(starter_home.join("lazyfs.log"))
            .map_err(|e| strata_lazyfs::LazyError::Daemon(e.to_string()))?;
        let strata = bin("strata").map_err(|e| strata_lazyfs::LazyError::Daemon(e.to_string()))?;
        let mut cmd = Command::new(strata);
        cmd.env("STRATA_HOME", &starter_home)
            .args(["--store", &starter_store, "lazyfs", "serve"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .spawn()
            .map_err(|e| strata_lazyfs::LazyError::Daemon(e.to_string()))?;
        Ok(Some(child))
    });
    let mut cfg = RuntimeConfig::new(
        home.join("runtime"),
        LazyfsAccess {
            paths: strata_lazyfs::Paths::new(home.join("lazyfs")),
            start,
        },
        bin("strata-agent")?,
    );
    // The runtime's settings, from the same environment variables `strata` reads (this
    // binary is the edge here; the runtime reads none).
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(oci) = var("STRATA_OCI_RUNTIME") {
        cfg.oci_runtime = strata_runtime::OciRuntime::parse(&oci.to_string_lossy())?;
    }
    cfg.container_agent = var("STRATA_STATIC_AGENT")
        .map(PathBuf::from)
        .or_else(|| strata_runtime::static_agent_for(&std::env::current_exe().ok()?));
    cfg.criu = var("STRATA_CRIU")
        .map(PathBuf::from)
        .or_else(strata_runtime::installed_criu);
    if let Some(dir) = var("STRATA_GUEST_DIR") {
        cfg.vm.guest_dir = dir.into();
    }
    if let Some(accel) = var("STRATA_VM_ACCEL") {
        cfg.vm.accel = accel.to_string_lossy().into_owned();
    }
    if let Some(qemu) = var("STRATA_QEMU") {
        cfg.vm.qemu = qemu.into();
    }
    cfg.vm.templates = var("STRATA_VM_TEMPLATES").is_none_or(|v| v != "0");
    Ok(cfg)
}

/// Exports a layer and copies it over `into` (export wants an empty target; a stack is
/// flattened bottom first, as a user without lazy layers would).
pub(crate) fn export(
    strata: &Path,
    home: &Path,
    store: &str,
    layer: &str,
    into: &Path,
) -> Result<()> {
    let tmp = into.with_extension("layer");
    let _ = std::fs::remove_dir_all(&tmp);
    let out = Command::new(strata)
        .env("STRATA_HOME", home)
        .args(["--store", store, "layer", "export", layer])
        .arg(&tmp)
        .output()?;
    if !out.status.success() {
        bail!(
            "layer export {layer}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::create_dir_all(into)?;
    let status = Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", tmp.display()))
        .arg(into)
        .status()?;
    std::fs::remove_dir_all(&tmp)?;
    if !status.success() {
        bail!("copying layer {layer} into {}", into.display());
    }
    Ok(())
}

/// Create, run `/bin/true`, destroy; returns create → first exec done.
pub(crate) fn strata_once(s: &Setup, backend: Backend) -> Result<f64> {
    let mut spec = s.spec.clone();
    spec.backend = backend;
    let t = Instant::now();
    let sb = s.runtime.create_owned(spec)?;
    let r = sb.exec(&ExecRequest::argv(["/bin/true"]))?;
    let took = t.elapsed().as_secs_f64() * 1000.0;
    sb.destroy()?;
    // Top the pools (uppers; fncall agents) back up, outside the timed part, as the CLI
    // does after its own work.
    s.runtime.fill_uppers(s.spec.limits.disk_bytes, 2)?;
    if backend == Backend::Fncall {
        s.runtime.fill_pool(2)?;
    }
    if !r.success() {
        bail!("/bin/true failed in a {backend:?} sandbox");
    }
    Ok(took)
}

/// A bundle for bare `crun run` over `rootfs` (read-only root, the same namespaces).
pub(crate) fn bare_bundle(dir: &Path, rootfs: &Path) -> Result<PathBuf> {
    let bundle = dir.join("bare-bundle");
    std::fs::create_dir_all(&bundle)?;
    let config = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"terminal": false, "user": {"uid": 0, "gid": 0}, "args": ["/bin/true"],
                    "env": ["PATH=/usr/bin:/bin"], "cwd": "/", "noNewPrivileges": true},
        "root": {"path": rootfs, "readonly": true},
        "hostname": "bare",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                    "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                                 {"type": "uts"}, {"type": "mount"}],
                  "resources": {"memory": {"limit": 536870912}, "pids": {"limit": 256}}}
    });
    std::fs::write(
        bundle.join("config.json"),
        serde_json::to_vec_pretty(&config)?,
    )?;
    Ok(bundle)
}

/// `crun run` of /bin/true, with the hybrid-cgroup workaround the runtime uses.
pub(crate) fn bare_crun(bundle: &Path, state: &Path, id: &str) -> Result<f64> {
    let t = Instant::now();
    crun_cmd(
        state,
        &["run", "--bundle", &bundle.display().to_string(), id],
    )?;
    Ok(t.elapsed().as_secs_f64() * 1000.0)
}

pub(crate) fn sustained(
    clients: usize,
    window: Duration,
    job: Arc<dyn Fn(usize, u64) -> Result<()> + Send + Sync>,
) -> Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let done = done.clone();
            let job = job.clone();
            std::thread::spawn(move || -> Result<()> {
                let mut n = 0u64;
                while start.elapsed() < window {
                    job(c, n)?;
                    n += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("a client panicked"))??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64())
}

pub fn run(
    rt: &tokio::runtime::Runtime,
    scratch: &Path,
    repo: &Path,
    quick: bool,
) -> Result<Section> {
    let s = Arc::new(setup(rt, scratch, repo)?);
    let base = s
        .rootfs
        .parent()
        .context("the rootfs has a parent")?
        .to_path_buf();
    let samples = if quick { 20 } else { 100 };
    let mut rows = Vec::new();
    let bundle = bare_bundle(&base.clone(), &s.rootfs)?;
    let crun_state = base.join("bare-crun");
    std::fs::create_dir_all(&crun_state)?;

    // Warm the layer mounts and caches once.
    strata_once(&s, Backend::Container)?;
    let mut bare: Vec<f64> = (0..samples)
        .map(|i| bare_crun(&bundle, &crun_state, &format!("bare-{i}")))
        .collect::<Result<_>>()?;
    let (bare50, bare99) = (percentile(&mut bare, 0.5), percentile(&mut bare, 0.99));
    // Eager baseline: export the environment's layers, then crun run.
    let mut eager = Vec::new();
    let strata = bin("strata")?;
    for i in 0..3 {
        let into = base.join(format!("eager-{i}"));
        let _ = std::fs::remove_dir_all(&into);
        let t = Instant::now();
        for layer in s.spec.layers.iter().rev() {
            export(&strata, &s.home, &s.store_url, layer, &into)?;
        }
        let b = bare_bundle(&base.join(format!("eager-bundle-{i}")), &into)?;
        bare_crun(&b, &crun_state, &format!("eager-{i}"))?;
        eager.push(t.elapsed().as_secs_f64() * 1000.0);
        std::fs::remove_dir_all(&into)?;
    }
    let eager50 = percentile(&mut eager, 0.5);
    for backend in [Backend::Fncall, Backend::Container] {
        let mut lat: Vec<f64> = (0..samples)
            .map(|_| strata_once(&s, backend))
            .collect::<Result<_>>()?;
        let (p50, p99) = (percentile(&mut lat, 0.5), percentile(&mut lat, 0.99));
        let name = format!("{backend:?}").to_lowercase();
        let target = if backend == Backend::Fncall {
            "target p50 <= 10 ms"
        } else {
            "target p50 <= 30 ms"
        };
        rows.push(Row::new(
            &format!("{name} create -> first exec, p50"),
            "ms",
            p50,
            "bare crun run (pre-extracted rootfs), p50",
            bare50,
            "lower",
            target,
        ));
        rows.push(Row::new(
            &format!("{name} create -> first exec, p99"),
            "ms",
            p99,
            "bare crun run (pre-extracted rootfs), p99",
            bare99,
            "lower",
            "",
        ));
        rows.push(Row::new(
            &format!("{name} create -> first exec, p50 vs export-first"),
            "ms",
            p50,
            "strata layer export + crun run, p50",
            eager50,
            "lower",
            "layers cached locally",
        ));
    }

    let window = Duration::from_secs(if quick { 5 } else { 15 });
    for clients in [2usize, 8, 32] {
        let b = bundle.clone();
        let cs = crun_state.clone();
        let bare_rate = sustained(
            clients,
            window,
            Arc::new(move |c, n| bare_crun(&b, &cs, &format!("sus-{c}-{n}")).map(|_| ())),
        )?;
        for backend in [Backend::Container, Backend::Fncall] {
            let st = s.clone();
            let strata_rate = sustained(
                clients,
                window,
                Arc::new(move |_, _| strata_once(&st, backend).map(|_| ())),
            )?;
            let name = format!("{backend:?}").to_lowercase();
            rows.push(Row::new(
                &format!("{name} creations/s, {clients} clients"),
                "1/s",
                strata_rate,
                "bare crun run/s",
                bare_rate,
                "higher",
                if backend == Backend::Container {
                    "target >= 50/s"
                } else {
                    ""
                },
            ));
        }
    }

    // Idle density: N idle sandboxes, memory they are charged for (cgroup) plus the RSS
    // of their init processes outside it.
    let n = if quick { 20 } else { 50 };
    let mut per_backend = Vec::new();
    for backend in [Backend::Fncall, Backend::Container] {
        let mut spec = s.spec.clone();
        spec.backend = backend;
        let boxes: Vec<_> = (0..n)
            .map(|_| s.runtime.create_owned(spec.clone()))
            .collect::<Result<_, _>>()?;
        std::thread::sleep(Duration::from_millis(500));
        let mut total = 0u64;
        for b in &boxes {
            total += b.cgroup().memory_usage();
        }
        for b in boxes {
            b.destroy()?;
        }
        per_backend.push(total as f64 / n as f64 / 1_048_576.0);
    }
    let mut bare_mem = 0u64;
    {
        // Bare crun idle containers (catatonit -P) over the same rootfs, in their own cgroups.
        let b = bare_idle_bundle(&base.clone(), &s.rootfs)?;
        let ids: Vec<String> = (0..n).map(|i| format!("idle-{i}")).collect();
        for id in &ids {
            crun_detached(&b, &crun_state, id)?;
        }
        std::thread::sleep(Duration::from_millis(500));
        for id in &ids {
            bare_mem += std::fs::read_to_string(format!(
                "/sys/fs/cgroup/memory/strata-bench-idle/{id}/memory.usage_in_bytes"
            ))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .unwrap_or(0);
            let _ = crun_cmd(&crun_state, &["delete", "--force", id]);
        }
    }
    // crun leaves the parent cgroup it made in every hierarchy.
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        for e in rd.flatten() {
            let _ = std::fs::remove_dir(e.path().join("strata-bench-idle"));
        }
    }
    let bare_per = bare_mem as f64 / n as f64 / 1_048_576.0;
    rows.push(Row::new(
        "fncall idle memory per sandbox",
        "MiB",
        per_backend[0],
        "bare crun idle container",
        bare_per,
        "lower",
        &format!(
            "{n} idle sandboxes; memcg charge; {:.0} idle sandboxes per GiB",
            1024.0 / per_backend[0].max(0.001)
        ),
    ));
    rows.push(Row::new(
        "container idle memory per sandbox",
        "MiB",
        per_backend[1],
        "bare crun idle container",
        bare_per,
        "lower",
        &format!(
            "{n} idle sandboxes; memcg charge; {:.0} idle sandboxes per GiB",
            1024.0 / per_backend[1].max(0.001)
        ),
    ));
    Ok(Section {
        name: "runtime".into(),
        description: "Sandbox create -> first exec latency, sustained creation rate and idle memory, against bare crun over a pre-extracted rootfs and against exporting the layers first. Layers are cached locally; each sandbox gets its own overlay upper (ext4 image) and cgroups.".into(),
        rows,
    })
}

fn bare_idle_bundle(dir: &Path, rootfs: &Path) -> Result<PathBuf> {
    let bundle = dir.join("bare-idle-bundle");
    std::fs::create_dir_all(&bundle)?;
    let config = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"terminal": false, "user": {"uid": 0, "gid": 0}, "args": ["/.strata/init", "-P"],
                    "env": ["PATH=/usr/bin:/bin"], "cwd": "/", "noNewPrivileges": true},
        "root": {"path": rootfs, "readonly": true},
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/.strata/init", "type": "bind", "source": "/usr/bin/catatonit", "options": ["bind", "ro"]}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                                 {"type": "uts"}, {"type": "mount"}],
                  "cgroupsPath": "/strata-bench-idle/ID",
                  "resources": {"memory": {"limit": 536870912}, "pids": {"limit": 256}}}
    });
    std::fs::write(
        bundle.join("config.json"),
        serde_json::to_vec_pretty(&config)?,
    )?;
    Ok(bundle)
}

/// crun with the workaround the runtime applies on hybrid-cgroup hosts: a private mount
/// namespace without /sys/fs/cgroup/unified.
pub(crate) fn crun_cmd(state: &Path, args: &[&str]) -> Result<()> {
    crun_cmd_from(None, state, args)
}

/// [`crun_cmd`] from a fresh copy of the mount namespace pinned at `pinned` (instead of the
/// host's).
pub(crate) fn crun_cmd_from(pinned: Option<&Path>, state: &Path, args: &[&str]) -> Result<()> {
    let mut cmd = match pinned {
        Some(pin) => {
            let mut c = Command::new("nsenter");
            c.arg(format!("--mount={}", pin.display())).arg("unshare");
            c
        }
        None => Command::new("unshare"),
    };
    let status = cmd
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "umount -l /sys/fs/cgroup/unified 2>/dev/null; exec crun --root {} {}",
            state.display(),
            args.join(" ")
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        bail!("crun {args:?} failed");
    }
    Ok(())
}

fn crun_detached(bundle: &Path, state: &Path, id: &str) -> Result<()> {
    // Each container gets its own cgroup path: rewrite the bundle's config per container.
    let own = bundle.with_file_name(format!("bare-idle-{id}"));
    std::fs::create_dir_all(&own)?;
    let text =
        std::fs::read_to_string(bundle.join("config.json"))?.replace("/ID\"", &format!("/{id}\""));
    std::fs::write(own.join("config.json"), text)?;
    crun_cmd(
        state,
        &[
            "run",
            "--detach",
            "--bundle",
            &own.display().to_string(),
            id,
        ],
    )
}
