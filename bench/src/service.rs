//! The `service` suite: sandboxes through the node service (`strata serve`), from the
//! Python SDK and from the CLI (`--server`), against the embedded runtime and bare
//! `crun run` in the same run: create → first exec latency, creations per second with 8
//! and 32 concurrent SDK clients, and how create → first exec holds up with 1,000 idle
//! sandboxes on the node. The sample environment, layers cached (as the runtime suite).
//!
//! Everything the suite makes (store, homes, bare crun's bundle and state) lives on an ext4
//! with a journal made for the run ([`JournaledScratch`]). A host whose file system has no
//! journal (this development VM's root) skips every inode deleted in the last minute when
//! it allocates one, so a loop of creates and destroys slows every later file creation on
//! it, for minutes: back-to-back runs on it differed by 2.7× (the embedded runtime's p50,
//! 9.8 then 26.9 ms). Users' hosts journal their file systems.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use strata_catalog::Backend;

use crate::report::{Row, Section};
use crate::runtime::{
    bare_bundle, bare_crun, bin, crun_cmd_from, percentile, setup, strata_once, sustained,
};

/// The SDK's side of the measurements: one AsyncClient, as a trainer would hold.
const DRIVER: &str = r#"
import asyncio, json, sys, time, strata
ref, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
async def once(c):
    t = time.perf_counter()
    sb = await c.create(ref, backend="container")
    r = await sb.exec(["/bin/true"])
    took = (time.perf_counter() - t) * 1000
    await sb.destroy()
    assert r.exit_code == 0, r
    return took
async def main():
    async with strata.AsyncClient() as c:
        if mode == "latency":
            await once(c)
            out = [await once(c) for _ in range(n)]
        elif mode == "rate":
            window, done, t0 = float(sys.argv[4]), 0, time.perf_counter()
            async def loop():
                nonlocal done
                while time.perf_counter() - t0 < window:
                    await once(c)
                    done += 1
            await asyncio.gather(*(loop() for _ in range(n)))
            out = done / (time.perf_counter() - t0)
        elif mode == "fill":
            sem = asyncio.Semaphore(8)
            async def idle(i):
                async with sem:
                    await c.create(ref, backend="container", memory="32M", cpus=0.1, labels={"idle": "1"})
            await asyncio.gather(*(idle(i) for i in range(n)))
            out = len(await c.list(labels={"idle": "1"}))
        elif mode == "drain":
            sem = asyncio.Semaphore(8)
            async def rm(sb):
                async with sem:
                    await sb.destroy()
            idle = await c.list(labels={"idle": "1"})
            await asyncio.gather(*(rm(sb) for sb in idle))
            out = len(idle)
    print(json.dumps(out))
asyncio.run(main())
"#;

pub(crate) struct Served {
    child: Child,
    pub(crate) url: String,
    pub(crate) token: String,
    home: PathBuf,
    /// The E2B API's base URL, when served.
    pub(crate) e2b: Option<String>,
}

/// The service leaves nothing running: its pooled uppers and agents, itself, then its
/// home's lazyfs daemon.
impl Drop for Served {
    fn drop(&mut self) {
        if let Ok(strata) = bin("strata") {
            let _ = Command::new(strata)
                .env("STRATA_HOME", &self.home)
                .args(["sandbox", "pool", "--drain"])
                .output();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        crate::runtime::stop_lazyfs(&self.home);
    }
}

fn strata(home: &Path, store: &str, args: &[&str]) -> Result<String> {
    let o = Command::new(bin("strata")?)
        .env("STRATA_HOME", home)
        .env("STRATA_STORE", store)
        .args(args)
        .output()?;
    if !o.status.success() {
        bail!("strata {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// `strata serve` on its own home sharing the suite's store, with a project and token
/// (and the E2B API on a free port when `e2b`).
pub(crate) fn serve(dir: &Path, store: &str, e2b: bool) -> Result<Served> {
    let home = dir.join("service-home");
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home)?;
    let port = strata_tests::service::free_port();
    let e2b_port = e2b.then(strata_tests::service::free_port);
    // 1,000 idle sandboxes of 32 MiB and a tenth of a CPU: admission must let them in.
    std::fs::write(
        home.join("strata.toml"),
        format!(
            "listen = \"127.0.0.1:{port}\"\nmemory_overcommit = 4.0\ncpu_overcommit = 100.0\n{}",
            e2b_port
                .map(|p| format!("e2b_listen = \"127.0.0.1:{p}\"\n"))
                .unwrap_or_default()
        ),
    )?;
    let project = format!("bench{}", std::process::id());
    strata(&home, store, &["project", "create", &project])?;
    let token = strata(&home, store, &["token", "create", "--project", &project])?
        .lines()
        .last()
        .context("token create printed nothing")?
        .trim()
        .to_string();
    let log = std::fs::File::create(home.join("serve.log"))?;
    let child = Command::new(bin("strata")?)
        .env("STRATA_HOME", &home)
        .env("STRATA_STORE", store)
        .args(["serve", "--node-name", "bench"])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?;
    let s = Served {
        child,
        url: format!("http://127.0.0.1:{port}"),
        token,
        home,
        e2b: e2b_port.map(|p| format!("http://127.0.0.1:{p}")),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let ports: Vec<u16> = std::iter::once(port).chain(e2b_port).collect();
    while ports
        .iter()
        .any(|p| std::net::TcpStream::connect(("127.0.0.1", *p)).is_err())
    {
        if Instant::now() > deadline {
            bail!("strata serve did not listen");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(s)
}

/// The Python of the virtual environment `dir/name`, with `packages` (PyPI names or
/// paths) installed into it.
pub(crate) fn venv(dir: &Path, name: &str, packages: &[&std::ffi::OsStr]) -> Result<PathBuf> {
    let venv = dir.join(name);
    let py = venv.join("bin/python");
    if !py.exists() {
        let ok = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()?;
        if !ok.success() {
            bail!("python3 -m venv failed (apt-get install python3-venv)");
        }
    }
    let ok = Command::new(&py)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(packages)
        .status()?;
    if !ok.success() {
        bail!("pip install {packages:?} failed (PyPI must be reachable)");
    }
    Ok(py)
}

/// A virtual environment with the checkout's SDK.
pub(crate) fn python(dir: &Path, repo: &Path) -> Result<PathBuf> {
    venv(dir, "sdk-venv", &[repo.join("sdk/python").as_os_str()])
}

pub(crate) fn drive<T: serde::de::DeserializeOwned>(
    py: &Path,
    s: &Served,
    reference: &str,
    args: &[&str],
) -> Result<T> {
    let o = Command::new(py)
        .args(["-c", DRIVER, reference])
        .args(args)
        .env("STRATA_SERVER", &s.url)
        .env("STRATA_TOKEN", &s.token)
        .output()?;
    if !o.status.success() {
        bail!(
            "SDK driver {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let out = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(out.trim()).with_context(|| format!("SDK driver printed {out}"))
}

/// `strata --server sandbox create`, then `sandbox exec -- /bin/true`: create → first
/// exec as a script using the CLI sees it (two processes); the destroy is not timed.
fn cli_once(s: &Served, reference: &str) -> Result<f64> {
    let cli = |args: &[&str]| -> Result<String> {
        let o = Command::new(bin("strata")?)
            .env("STRATA_HOME", s.home.join("client"))
            .env("STRATA_SERVER", &s.url)
            .env("STRATA_TOKEN", &s.token)
            .args(args)
            .output()?;
        if !o.status.success() {
            bail!("strata {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        }
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let t = Instant::now();
    let id = cli(&["sandbox", "create", "--backend", "container", reference])?
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string();
    cli(&["sandbox", "exec", &id, "--", "/bin/true"])?;
    let took = t.elapsed().as_secs_f64() * 1000.0;
    cli(&["sandbox", "rm", &id])?;
    Ok(took)
}

/// A mount namespace pinned at the file `pin`, a private copy of the host's made before any
/// sandbox of the run exists (and detached with [`CleanNamespace`]'s drop): bare crun runs
/// from it see none of the sandboxes' mounts, as Strata's own starts (its launch mount
/// namespace) do not, so what they lose with 1,000 idle sandboxes on the node is the
/// node's kernel state alone.
struct CleanNamespace(PathBuf);

impl CleanNamespace {
    fn pin(pin: PathBuf) -> Result<CleanNamespace> {
        std::fs::write(&pin, b"")?;
        let ok = Command::new("unshare")
            .arg(format!("--mount={}", pin.display()))
            .args(["--propagation", "private", "true"])
            .status()?;
        if !ok.success() {
            bail!("unshare --mount={} failed", pin.display());
        }
        Ok(CleanNamespace(pin))
    }

    /// One bare `crun run` from a fresh copy of the pinned namespace, in ms.
    fn bare_crun(&self, bundle: &Path, state: &Path, id: &str) -> Result<f64> {
        let t = Instant::now();
        let bundle = bundle.display().to_string();
        crun_cmd_from(Some(&self.0), state, &["run", "--bundle", &bundle, id])?;
        Ok(t.elapsed().as_secs_f64() * 1000.0)
    }
}

impl Drop for CleanNamespace {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A fresh ext4, with a journal, loop-mounted under the scratch directory for one run;
/// unmounted and deleted when dropped (and when a killed run left one behind, at the next
/// run's start).
struct JournaledScratch {
    image: PathBuf,
    mnt: PathBuf,
}

impl JournaledScratch {
    /// Sparse: only what the run writes takes disk.
    const SIZE: &'static str = "64G";

    fn make(scratch: &Path) -> Result<JournaledScratch> {
        std::fs::create_dir_all(scratch)?;
        let scratch = std::fs::canonicalize(scratch)?;
        let fs = JournaledScratch {
            image: scratch.join("journaled.img"),
            mnt: scratch.join("journaled"),
        };
        fs.remove();
        std::fs::create_dir_all(&fs.mnt)?;
        run_ok(
            Command::new("truncate")
                .args(["-s", Self::SIZE])
                .arg(&fs.image),
        )?;
        run_ok(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-O", "has_journal"])
                .arg(&fs.image),
        )?;
        run_ok(
            Command::new("mount")
                .args(["-o", "loop"])
                .arg(&fs.image)
                .arg(&fs.mnt),
        )?;
        Ok(fs)
    }

    fn path(&self) -> &Path {
        &self.mnt
    }

    fn remove(&self) {
        if !strata_tests::mounts_under(&self.mnt).is_empty()
            && !Command::new("umount")
                .arg(&self.mnt)
                .status()
                .is_ok_and(|s| s.success())
        {
            eprintln!(
                "service: {} is busy; detaching it lazily",
                self.mnt.display()
            );
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        let _ = std::fs::remove_dir(&self.mnt);
        let _ = std::fs::remove_file(&self.image);
    }
}

impl Drop for JournaledScratch {
    fn drop(&mut self) {
        self.remove();
    }
}

fn run_ok(cmd: &mut Command) -> Result<()> {
    let o = cmd.output()?;
    if !o.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    Ok(())
}

pub fn run(rt: &tokio::runtime::Runtime, scratch: &Path, repo: &Path) -> Result<Section> {
    // Dropped last: everything below lives on it.
    let fs = JournaledScratch::make(scratch)?;
    let scratch = fs.path();
    let clean = CleanNamespace::pin(std::fs::canonicalize(scratch)?.join("clean-mntns"))?;
    let s = Arc::new(setup(rt, scratch, repo)?);
    let base = s.rootfs.parent().context("rootfs parent")?.to_path_buf();
    let py = python(&base, repo)?;
    let served = serve(&base, &s.store_url, false)?;
    let reference = s.spec.catalog_ref.clone();
    let samples = 60;
    let mut rows = Vec::new();

    let bundle = bare_bundle(&base.join("service-bare"), &s.rootfs)?;
    let crun_state = base.join("service-bare-crun");
    std::fs::create_dir_all(&crun_state)?;
    strata_once(&s, Backend::Container)?;
    let mut bare: Vec<f64> = (0..samples)
        .map(|i| bare_crun(&bundle, &crun_state, &format!("svc-bare-{i}")))
        .collect::<Result<_>>()?;
    let mut clean_empty: Vec<f64> = (0..samples / 2)
        .map(|i| clean.bare_crun(&bundle, &crun_state, &format!("svc-clean-{i}")))
        .collect::<Result<_>>()?;
    let mut embedded: Vec<f64> = (0..samples)
        .map(|_| strata_once(&s, Backend::Container))
        .collect::<Result<_>>()?;
    let mut sdk: Vec<f64> = drive(&py, &served, &reference, &["latency", &samples.to_string()])?;
    cli_once(&served, &reference)?;
    let mut cli: Vec<f64> = (0..samples / 3)
        .map(|_| cli_once(&served, &reference))
        .collect::<Result<_>>()?;
    let (bare50, bare99) = (percentile(&mut bare, 0.5), percentile(&mut bare, 0.99));
    let (emb50, emb99) = (
        percentile(&mut embedded, 0.5),
        percentile(&mut embedded, 0.99),
    );
    let (sdk50, sdk99) = (percentile(&mut sdk, 0.5), percentile(&mut sdk, 0.99));
    let (cli50, cli99) = (percentile(&mut cli, 0.5), percentile(&mut cli, 0.99));
    rows.push(Row::new(
        "container create -> first exec via the SDK, p50",
        "ms",
        sdk50,
        "embedded runtime, p50",
        emb50,
        "lower",
        &format!(
            "target: the service adds < 2 ms (adds {:.1} ms)",
            sdk50 - emb50
        ),
    ));
    rows.push(Row::new(
        "container create -> first exec via the SDK, p99",
        "ms",
        sdk99,
        "embedded runtime, p99",
        emb99,
        "lower",
        "",
    ));
    rows.push(Row::new(
        "container create -> first exec via the SDK, p50 vs bare crun",
        "ms",
        sdk50,
        "bare crun run (pre-extracted rootfs), p50",
        bare50,
        "lower",
        "target <= 1.5x",
    ));
    rows.push(Row::new(
        "container create -> first exec via the SDK, p99 vs bare crun",
        "ms",
        sdk99,
        "bare crun run, p99",
        bare99,
        "lower",
        "",
    ));
    rows.push(Row::new(
        "container create -> first exec via the CLI (--server), p50",
        "ms",
        cli50,
        "embedded runtime, p50",
        emb50,
        "lower",
        "two CLI processes: sandbox create, sandbox exec",
    ));
    rows.push(Row::new(
        "container create -> first exec via the CLI (--server), p99",
        "ms",
        cli99,
        "embedded runtime, p99",
        emb99,
        "lower",
        "",
    ));

    let window = 20.0;
    for clients in [8usize, 32] {
        let b = bundle.clone();
        let cs = crun_state.clone();
        let bare_rate = sustained(
            clients,
            Duration::from_secs_f64(window),
            Arc::new(move |c, n| bare_crun(&b, &cs, &format!("svc-sus-{c}-{n}")).map(|_| ())),
        )?;
        let rate: f64 = drive(
            &py,
            &served,
            &reference,
            &["rate", &clients.to_string(), &window.to_string()],
        )?;
        rows.push(Row::new(
            &format!("container creations/s via the SDK, {clients} clients"),
            "1/s",
            rate,
            "bare crun run/s",
            bare_rate,
            "higher",
            if clients == 32 {
                "target >= 0.6x bare crun"
            } else {
                ""
            },
        ));
    }

    // Density: the same latency with 1,000 idle sandboxes on the node.
    let idle = 1000;
    let t = Instant::now();
    let filled: u64 = drive(&py, &served, &reference, &["fill", &idle.to_string()])?;
    let fill_secs = t.elapsed().as_secs_f64();
    let mut full: Vec<f64> = drive(
        &py,
        &served,
        &reference,
        &["latency", &(samples / 2).to_string()],
    )?;
    let full50 = percentile(&mut full, 0.5);
    let mut clean_full: Vec<f64> = (0..samples / 2)
        .map(|i| clean.bare_crun(&bundle, &crun_state, &format!("svc-clean-full-{i}")))
        .collect::<Result<_>>()?;
    let drained: u64 = drive(&py, &served, &reference, &["drain", "0"])?;
    rows.push(Row::new(
        &format!("container create -> first exec via the SDK with {filled} idle sandboxes, p50"),
        "ms",
        full50,
        "on an empty node, p50",
        sdk50,
        "lower",
        &format!("target <= 1.3x; {filled} idle made in {fill_secs:.0} s, {drained} destroyed"),
    ));
    rows.push(Row::new(
        &format!("bare crun run with {filled} idle sandboxes, from a namespace without their mounts, p50"),
        "ms",
        percentile(&mut clean_full, 0.5),
        "the same on an empty node, p50",
        percentile(&mut clean_empty, 0.5),
        "lower",
        "what the node's kernel state alone costs a container start",
    ));
    drop(served);
    Ok(Section {
        name: "service".into(),
        description: "Sandboxes through the node service (strata serve) from the Python SDK and the CLI, against the embedded runtime and bare crun run over a pre-extracted rootfs, in one run; layers cached locally; everything on a fresh ext4 with a journal.".into(),
        rows,
    })
}
