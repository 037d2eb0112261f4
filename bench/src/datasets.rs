//! The `datasets` suite, on the real workspaces of `datasets/` (built and registered by
//! `datasets/build.py` into the suite's own store): for each workspace, the share of each
//! layer's bytes fetched while its test suite runs from a cold cache (the eager baseline
//! fetches all of them), and the cold start to the test suite's end, lazily through
//! `strata run` against exporting the layers first and running the same command with bare
//! `crun run` over the exported tree.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::report::{Row, Section};
use crate::runtime::{bin, crun_cmd, export};

pub(crate) struct Env {
    pub(crate) home: PathBuf,
    /// The store's URL (a directory path for the local store).
    pub(crate) store: String,
    pub(crate) strata: PathBuf,
}

impl Env {
    /// The same store under another home.
    pub(crate) fn with(&self, home: PathBuf, store: String) -> Env {
        Env {
            home,
            store,
            strata: self.strata.clone(),
        }
    }

    pub(crate) fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.strata);
        c.args(args)
            .env("STRATA_HOME", &self.home)
            .env("STRATA_STORE", &self.store)
            .stdin(Stdio::null());
        c
    }

    pub(crate) fn ok(&self, args: &[&str]) -> Result<Output> {
        let out = self.cmd(args).output()?;
        if !out.status.success() {
            bail!(
                "strata {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(out)
    }

    pub(crate) fn json(&self, args: &[&str]) -> Result<serde_json::Value> {
        Ok(serde_json::from_slice(&self.ok(args)?.stdout)?)
    }

    /// A cold host: no daemon, no cached chunk, no metadata image.
    pub(crate) fn go_cold(&self) -> Result<()> {
        self.ok(&["sandbox", "pool", "--drain"])?;
        self.ok(&["lazyfs", "stop"])?;
        for d in ["cache", "meta"] {
            let p = self.home.join("lazyfs").join(d);
            if p.exists() {
                std::fs::remove_dir_all(&p).with_context(|| format!("clearing {}", p.display()))?;
            }
        }
        Ok(())
    }
}

#[derive(Deserialize)]
struct Built {
    workspaces: Vec<Workspace>,
}

#[derive(Deserialize)]
struct Workspace {
    #[serde(rename = "ref")]
    reference: String,
}

/// The entry as `catalog show --json` prints it (the fields used here).
#[derive(Deserialize)]
pub(crate) struct Entry {
    pub(crate) base: String,
    #[serde(default)]
    toolkits: Vec<String>,
    workspace: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    pub(crate) commands: BTreeMap<String, String>,
    workdir: Option<String>,
}

impl Entry {
    /// (role, layer ID), top-most first.
    pub(crate) fn layers(&self) -> Vec<(&'static str, &str)> {
        let mut v: Vec<(&'static str, &str)> = self
            .toolkits
            .iter()
            .map(|t| ("toolkit", t.as_str()))
            .collect();
        if let Some(w) = &self.workspace {
            v.push(("workspace", w));
        }
        v.push(("base", &self.base));
        v
    }
}

/// Builds and registers the datasets into the suite's local store (what is there already
/// is found by its build key, not built again); returns the registered workspaces.
pub(crate) fn setup(scratch: &Path, repo: &Path) -> Result<(Env, Vec<String>)> {
    let dir = std::fs::canonicalize(scratch)?.join("datasets");
    let env = Env {
        home: dir.join("home"),
        store: dir.join("store").display().to_string(),
        strata: bin("strata")?,
    };
    std::fs::create_dir_all(&env.home)?;
    let out = Command::new("python3")
        .arg(repo.join("datasets/build.py"))
        .arg("--strata")
        .arg(&env.strata)
        .env("STRATA_HOME", &env.home)
        .env("STRATA_STORE", &env.store)
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("datasets/build.py failed");
    }
    let built: Built = serde_json::from_slice(&out.stdout)?;
    Ok((
        env,
        built.workspaces.into_iter().map(|w| w.reference).collect(),
    ))
}

/// A bundle running `command` (by /bin/sh) over `rootfs` with the entry's environment.
pub(crate) fn eager_bundle(
    dir: &Path,
    rootfs: &Path,
    entry: &Entry,
    command: &str,
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let mut env: Vec<String> = entry.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    env.push("HOME=/root".into());
    let config = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"terminal": false, "user": {"uid": 0, "gid": 0},
                    "args": ["/bin/sh", "-c", command], "env": env,
                    "cwd": entry.workdir.clone().unwrap_or_else(|| "/".into()),
                    "noNewPrivileges": true},
        "root": {"path": rootfs, "readonly": false},
        "hostname": "eager",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                    "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
                   {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}],
        "linux": {"namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                                 {"type": "uts"}, {"type": "mount"}],
                  "resources": {"memory": {"limit": 1u64 << 30}, "pids": {"limit": 512}}}
    });
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&config)?)?;
    Ok(dir.to_path_buf())
}

pub fn run(scratch: &Path, repo: &Path, quick: bool) -> Result<Section> {
    let (env, refs) = setup(scratch, repo)?;
    let work = std::fs::canonicalize(scratch)?
        .join("datasets")
        .join("work");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    // Quick: one version of each multi-version project and a few more.
    let picked: Vec<&String> = if quick {
        let mut seen = std::collections::BTreeSet::new();
        refs.iter()
            .filter(|r| seen.insert(r.split('@').next().unwrap_or(r).to_string()))
            .take(6)
            .collect()
    } else {
        refs.iter().collect()
    };
    let eager_every = if quick { 3 } else { 2 };
    let mut rows = Vec::new();
    let mut totals = (0u64, 0u64);
    for (n, reference) in picked.iter().enumerate() {
        let shown = env.json(&["catalog", "show", reference, "--json"])?;
        let entry: Entry = serde_json::from_value(shown["entry"].clone())?;
        let test = entry
            .commands
            .get("test")
            .with_context(|| format!("{reference} has no test command"))?
            .clone();

        env.go_cold()?;
        let t = Instant::now();
        let lazy = env.cmd(&["run", reference, "--command", "test"]).output()?;
        let lazy_s = t.elapsed().as_secs_f64();
        let mut fetched = 0u64;
        let mut size = 0u64;
        let mut parts = Vec::new();
        for (role, layer) in entry.layers() {
            let stats = env
                .json(&["layer", "stats", layer, "--json"])
                .with_context(|| {
                    format!(
                        "after `strata run {reference}` ({}): {}",
                        lazy.status,
                        String::from_utf8_lossy(&lazy.stderr).trim()
                    )
                })?;
            let inspected = env.json(&["layer", "inspect", layer, "--json"])?;
            let f = stats["fetched_bytes"].as_u64().unwrap_or(0);
            let s = inspected["blob_bytes"].as_u64().unwrap_or(0);
            fetched += f;
            size += s;
            parts.push(format!(
                "{role} {:.1} % of {:.1} MB",
                100.0 * f as f64 / s.max(1) as f64,
                s as f64 / 1e6
            ));
        }
        totals.0 += fetched;
        totals.1 += size;
        rows.push(Row::new(
            &format!("{reference}: share of the stack's data fetched by its tests"),
            "fraction",
            fetched as f64 / size.max(1) as f64,
            "eager: every byte of the stack",
            1.0,
            "lower",
            &format!(
                "{}; tests exit {}",
                parts.join(", "),
                lazy.status.code().unwrap_or(-1)
            ),
        ));

        if n % eager_every == 0 {
            let rootfs = work.join(format!("eager-{n}"));
            let t = Instant::now();
            for (_, layer) in entry.layers().iter().rev() {
                export(&env.strata, &env.home, &env.store, layer, &rootfs)?;
            }
            let bundle = eager_bundle(&work.join(format!("bundle-{n}")), &rootfs, &entry, &test)?;
            let state = work.join("crun");
            std::fs::create_dir_all(&state)?;
            // The eager run's test status is the workspace's own; only the time counts.
            let _ = crun_cmd(
                &state,
                &[
                    "run",
                    "--bundle",
                    &bundle.display().to_string(),
                    &format!("eager-{n}"),
                ],
            );
            let eager_s = t.elapsed().as_secs_f64();
            let _ = crun_cmd(&state, &["delete", "--force", &format!("eager-{n}")]);
            rows.push(Row::new(
                &format!("{reference}: cold start to test suite done"),
                "s",
                lazy_s,
                "export the layers, then run the tests (crun)",
                eager_s,
                "lower",
                "nothing cached on the host in either run",
            ));
            rows.push(podman_row(reference, &rootfs, &work, &entry, &test, lazy_s));
            std::fs::remove_dir_all(&rootfs)?;
        }
    }
    rows.push(storage_row(&env, refs.len())?);
    rows.push(Row::new(
        "all measured workspaces: share of stack data fetched",
        "fraction",
        totals.0 as f64 / totals.1.max(1) as f64,
        "eager: every byte",
        1.0,
        "lower",
        &format!("{} workspaces", picked.len()),
    ));
    let sizes: &[usize] = if quick { &[64] } else { &[64, 256] };
    let max = sizes.iter().copied().max().unwrap_or(0);
    let tasks = task_layers(
        &env,
        repo,
        &refs,
        max,
        &scratch.join("datasets").join("tasks"),
    )?;
    for &n in sizes {
        rows.extend(burst(&env, &tasks[..n], &work)?);
    }
    env.go_cold()?;
    Ok(Section {
        name: "datasets".into(),
        description: format!(
            "The real workspaces of datasets/ ({} registered; {} measured), each run by its own \
             test command from a cold host: lazily (strata run: layers mounted through lazyfs, \
             chunks fetched on demand) against materializing the layers first. Bursts: N \
             container sandboxes of distinct workspaces (the real ones in turn, each with its \
             own task file) created at once on a cold host.",
            refs.len(),
            picked.len()
        ),
        rows,
    })
}

/// Podman, the tool a user would otherwise pick: the environment as an image tarball on
/// local disk (as a registry pull would leave it), `podman import` (extracting it into
/// podman's storage), then `podman run` of the tests. Where podman cannot run, the row says
/// why instead of a number.
fn podman_row(
    reference: &str,
    rootfs: &Path,
    work: &Path,
    entry: &Entry,
    test: &str,
    lazy_s: f64,
) -> Row {
    let name = format!("{reference}: cold start to test suite done, vs podman");
    let baseline = "podman import of the image tarball, then podman run";
    let attempt = || -> Result<f64> {
        let tarball = work.join("podman-image.tar");
        let status = Command::new("tar")
            .arg("-C")
            .arg(rootfs)
            .args(["-cf"])
            .arg(&tarball)
            .arg(".")
            .status()?;
        if !status.success() {
            bail!("tar of the exported tree failed");
        }
        let image = "strata-bench-eager:latest";
        let _ = Command::new("podman").args(["rmi", "-f", image]).output();
        let t = Instant::now();
        let import = Command::new("podman")
            .args(["import", "-q"])
            .arg(&tarball)
            .arg(image)
            .output()?;
        if !import.status.success() {
            bail!(
                "podman import: {}",
                String::from_utf8_lossy(&import.stderr).trim()
            );
        }
        // Debian's podman 4.3 needs runc on hybrid cgroups and explicit ulimits here
        // (shared/platform.md).
        let mut run = Command::new("podman");
        run.args(["run", "--rm", "--runtime", "runc", "--network", "none"])
            .args([
                "--ulimit",
                "nofile=1024:1024",
                "--ulimit",
                "nproc=1024:1024",
            ])
            .args(["-w", entry.workdir.as_deref().unwrap_or("/")]);
        for (k, v) in &entry.env {
            run.arg("-e").arg(format!("{k}={v}"));
        }
        let out = run.args([image, "/bin/sh", "-c", test]).output()?;
        let took = t.elapsed().as_secs_f64();
        let _ = Command::new("podman").args(["rmi", "-f", image]).output();
        let _ = std::fs::remove_file(&tarball);
        if out.stdout.is_empty() {
            bail!(
                "podman run printed nothing: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(took)
    };
    match attempt() {
        Ok(s) => Row::new(
            &name,
            "s",
            lazy_s,
            baseline,
            s,
            "lower",
            "image already on local disk",
        ),
        Err(e) => Row::new(
            &name,
            "s",
            lazy_s,
            baseline,
            0.0,
            "lower",
            &format!("podman could not run here: {e}"),
        ),
    }
}

/// What the store holds for the whole dataset against each environment as its own full
/// image (base, toolkit and workspace), the way N separately built images would be kept.
fn storage_row(env: &Env, environments: usize) -> Result<Row> {
    let stats = env.json(&["store", "stats", "--json"])?;
    let stored = stats["stored_bytes"].as_u64().unwrap_or(0);
    let mut full = 0u64;
    let listed =
        String::from_utf8_lossy(&env.ok(&["catalog", "ls", "datasets/"])?.stdout).into_owned();
    let mut sizes: BTreeMap<String, u64> = BTreeMap::new();
    let mut counted = 0;
    for id in listed.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if id == "datasets/debian" {
            continue;
        }
        let history = env.json(&["catalog", "history", id, "--json"])?;
        let records = history.as_array().cloned().unwrap_or_default();
        let removed: Vec<&str> = records
            .iter()
            .filter(|r| r["action"] == "remove")
            .filter_map(|r| r["version"].as_str())
            .collect();
        for record in &records {
            let Some(v) = record["version"].as_str() else {
                continue;
            };
            if record["action"] == "remove" || removed.contains(&v) {
                continue;
            }
            let shown = env.json(&["catalog", "show", &format!("{id}@{v}"), "--json"])?;
            let entry: Entry = serde_json::from_value(shown["entry"].clone())?;
            for (_, layer) in entry.layers() {
                let size = match sizes.get(layer) {
                    Some(s) => *s,
                    None => {
                        let s = env.json(&["layer", "inspect", layer, "--json"])?["logical_bytes"]
                            .as_u64()
                            .unwrap_or(0);
                        sizes.insert(layer.to_string(), s);
                        s
                    }
                };
                full += size;
            }
            counted += 1;
        }
    }
    Ok(Row::new(
        &format!("the dataset's {counted} environments in the store"),
        "MB",
        stored as f64 / 1e6,
        "each environment as its own full image (uncompressed)",
        full as f64 / 1e6,
        "lower",
        &format!(
            "{environments} workspaces registered; layers shared, chunks deduplicated and lz4-compressed"
        ),
    ))
}

/// Bytes allocated on disk under `dirs` (sparse files count only their written blocks).
fn disk_bytes(dirs: &[PathBuf]) -> u64 {
    use std::os::unix::fs::MetadataExt;
    dirs.iter()
        .flat_map(|d| walkdir::WalkDir::new(d).same_file_system(true))
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

/// `n` distinct workspaces for a burst: the real ones in turn, each with its own task file
/// (an RL dataset is many tasks over the same repositories). Built once per scratch dir.
pub(crate) fn task_layers(
    env: &Env,
    repo: &Path,
    refs: &[String],
    n: usize,
    dir: &Path,
) -> Result<Vec<(String, String)>> {
    let list = dir.join("tasks.json");
    let mut tasks: Vec<(String, String)> = std::fs::read(&list)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    std::fs::create_dir_all(dir)?;
    for i in tasks.len()..n {
        let reference = &refs[i % refs.len()];
        let (id, version) = reference.split_once('@').context("a versioned reference")?;
        let name = id.trim_start_matches("datasets/");
        let tree = repo
            .join("datasets/cache/workspaces")
            .join(format!("{name}-{version}"));
        let src = dir.join(format!("src-{i}"));
        let _ = std::fs::remove_dir_all(&src);
        let status = Command::new("cp").arg("-a").arg(&tree).arg(&src).status()?;
        if !status.success() {
            bail!("copying {} for task {i}", tree.display());
        }
        std::fs::write(src.join(".task"), format!("task {i} of {reference}\n"))?;
        let src_text = src.display().to_string();
        let built = env.json(&[
            "layer",
            "build",
            "--kind",
            "workspace",
            "--prefix",
            "work",
            "--exclude",
            ".complete",
            "--name",
            &format!("burst/task-{i}"),
            "--json",
            &src_text,
        ])?;
        std::fs::remove_dir_all(&src)?;
        let layer = built["id"]
            .as_str()
            .context("build printed an id")?
            .to_string();
        tasks.push((reference.clone(), layer));
        std::fs::write(&list, serde_json::to_vec(&tasks)?)?;
    }
    tasks.truncate(n);
    Ok(tasks)
}

const BURST_COMMAND: &str = "import os, json; print(len(os.listdir('/work')))";

/// N sandboxes of distinct workspaces started at once from a cold host, each running
/// Python over its workspace; then the same with every layer extracted first.
fn burst(env: &Env, tasks: &[(String, String)], work: &Path) -> Result<Vec<Row>> {
    let (strata_s, strata_bytes, entries) = burst_strata(env, tasks)?;
    eager_burst(env, tasks, work, &entries, (strata_s, strata_bytes))
}

/// The Strata half of a burst: a cold host, N creates at once, Python over each workspace.
/// Returns the wall time, the bytes written to local disk, and the entries used.
pub(crate) fn burst_strata(
    env: &Env,
    tasks: &[(String, String)],
) -> Result<(
    f64,
    u64,
    BTreeMap<String, std::sync::Arc<strata_catalog::Registered>>,
)> {
    use strata_catalog::Catalog;
    use strata_runtime::{ExecRequest, Overrides, SandboxSpec};
    let store_url = env.store.clone();
    let rt = tokio::runtime::Runtime::new()?;
    let store = strata_store::Store::open(&strata_store::StoreUrl::parse(&store_url)?)?;
    let mut specs = Vec::new();
    let mut entries = BTreeMap::new();
    for (reference, layer) in tasks {
        let reg = match entries.get(reference) {
            Some(r) => r,
            None => {
                let reg = rt.block_on(async {
                    let c = Catalog::open(&store).await?;
                    c.get(reference).await
                })?;
                entries.entry(reference.clone()).or_insert(reg)
            }
        };
        let mut spec = SandboxSpec::resolve(reg, &Overrides::default())?;
        let original = reg.entry.workspace.clone().context("a workspace")?;
        for l in spec.layers.iter_mut() {
            if *l == original {
                *l = layer.clone();
            }
        }
        specs.push(spec);
    }

    // Strata: a cold host, N creates at once, Python over each workspace.
    env.go_cold()?;
    let runtime = crate::runtime::open_runtime(&env.home, &store_url)?;
    let watched = [env.home.join("lazyfs"), env.home.join("runtime")];
    let before = disk_bytes(&watched);
    let t = Instant::now();
    let handles: Vec<_> = specs
        .into_iter()
        .map(|spec| {
            let runtime = runtime.clone();
            std::thread::spawn(move || -> Result<strata_runtime::Sandbox> {
                let sb = runtime.create_owned(spec)?;
                let r = sb.exec(&ExecRequest::argv(["python3", "-c", BURST_COMMAND]))?;
                if !r.success() {
                    bail!(
                        "python failed in a burst sandbox: {}",
                        String::from_utf8_lossy(&r.stderr)
                    );
                }
                Ok(sb)
            })
        })
        .collect();
    let mut boxes = Vec::new();
    for h in handles {
        boxes.push(
            h.join()
                .map_err(|_| anyhow::anyhow!("a burst client panicked"))??,
        );
    }
    let strata_s = t.elapsed().as_secs_f64();
    let strata_bytes = disk_bytes(&watched).saturating_sub(before);
    for b in boxes {
        b.destroy()?;
    }
    runtime.drain_pool();
    env.go_cold()?;
    Ok((strata_s, strata_bytes, entries))
}

/// The eager half of a burst, and both halves' rows; `strata` is the Strata half's (wall
/// time, bytes written).
fn eager_burst(
    env: &Env,
    tasks: &[(String, String)],
    work: &Path,
    entries: &BTreeMap<String, std::sync::Arc<strata_catalog::Registered>>,
    (strata_s, strata_bytes): (f64, u64),
) -> Result<Vec<Row>> {
    let (n, store_url) = (tasks.len(), env.store.as_str());
    // Eager: extract base and toolkit once (a content-addressed snapshotter shares them)
    // and each workspace, then overlay and run each with crun, all at once.
    let eager = work.join("eager-burst");
    let _ = std::fs::remove_dir_all(&eager);
    std::fs::create_dir_all(&eager)?;
    let first = &entries[&tasks[0].0].entry;
    let first_local: Entry = serde_json::from_value(serde_json::to_value(first)?)?;
    let t = Instant::now();
    let mut shared = Vec::new();
    for (name, layer) in first
        .toolkits
        .iter()
        .map(|t| ("toolkit", t))
        .chain([("base", &first.base)])
    {
        let dir = eager.join(format!("{name}-{}", &layer[..12]));
        export(&env.strata, &env.home, store_url, layer, &dir)?;
        shared.push(dir);
    }
    let mut roots = Vec::new();
    for (i, (_, layer)) in tasks.iter().enumerate() {
        let ws = eager.join(format!("ws-{i}"));
        export(&env.strata, &env.home, store_url, layer, &ws)?;
        let (up, wk, root) = (
            eager.join(format!("up-{i}")),
            eager.join(format!("wk-{i}")),
            eager.join(format!("root-{i}")),
        );
        for d in [&up, &wk, &root] {
            std::fs::create_dir_all(d)?;
        }
        let lower: Vec<String> = std::iter::once(&ws)
            .chain(shared.iter())
            .map(|p| p.display().to_string())
            .collect();
        let status = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o"])
            .arg(format!(
                "lowerdir={},upperdir={},workdir={}",
                lower.join(":"),
                up.display(),
                wk.display()
            ))
            .arg(&root)
            .status()?;
        if !status.success() {
            bail!("overlay for eager task {i}");
        }
        roots.push(root);
    }
    let state = eager.join("crun");
    std::fs::create_dir_all(&state)?;
    let handles: Vec<_> = roots
        .iter()
        .enumerate()
        .map(|(i, root)| {
            let bundle = eager_bundle(
                &eager.join(format!("bundle-{i}")),
                root,
                &first_local,
                &format!("python3 -c \"{BURST_COMMAND}\""),
            );
            let state = state.clone();
            std::thread::spawn(move || -> Result<()> {
                let bundle = bundle?;
                crun_cmd(
                    &state,
                    &[
                        "run",
                        "--bundle",
                        &bundle.display().to_string(),
                        &format!("b{i}"),
                    ],
                )?;
                let _ = crun_cmd(&state, &["delete", "--force", &format!("b{i}")]);
                Ok(())
            })
        })
        .collect();
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("an eager client panicked"))??;
    }
    let eager_s = t.elapsed().as_secs_f64();
    let eager_bytes = disk_bytes(std::slice::from_ref(&eager));
    for root in &roots {
        let _ = Command::new("umount").arg(root).status();
    }
    std::fs::remove_dir_all(&eager)?;
    Ok(vec![
        Row::new(
            &format!("burst of {n} distinct workspaces, all done"),
            "s",
            strata_s,
            "extract every layer first (base and toolkit once), then crun",
            eager_s,
            "lower",
            "cold host; each sandbox runs Python over its workspace",
        ),
        Row::new(
            &format!("burst of {n} distinct workspaces, bytes written to local disk"),
            "MB",
            strata_bytes as f64 / 1e6,
            "extracted layers and uppers",
            eager_bytes as f64 / 1e6,
            "lower",
            &format!(
                "{:.0} % fewer (DSec reports 57 %; target 90 %)",
                100.0 * (1.0 - strata_bytes as f64 / eager_bytes.max(1) as f64)
            ),
        ),
    ])
}
