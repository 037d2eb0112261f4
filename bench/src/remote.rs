//! The `remote` suite: lazy loading from an S3 store (the project's one-node radosgw,
//! `scripts/s3-server.sh`) behind the latency-injecting proxy of the test support code at 0,
//! 2 and 10 ms added round-trip time, against the same data in a local store, all in one
//! run: time to first Python work in a fresh home (lazy, lazy with the recorded prefetch
//! list, export then run), two real workspaces' cold test suites, a burst of 64 distinct
//! workspaces, and the bytes each fetched.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::{StreamExt, TryStreamExt};
use strata_store::{Store, StoreUrl};
use strata_tests::proxy::{LatencyProxy, Link};
use strata_tests::s3::S3Server;

use crate::datasets::{self, Entry, Env};
use crate::lazy::{drop_caches, FIRST_WORK};
use crate::report::{Row, Section};

/// Samples of the first-Python-work measurements (medians reported).
const ROUNDS: usize = 3;
/// The added round-trip times measured, in milliseconds.
const RTTS_MS: [u64; 3] = [0, 2, 10];
const BURST: usize = 64;
/// The Debian base, registered alone by datasets/build.py.
const DEBIAN: &str = "datasets/debian";

/// One store the suite measures against, with its own home.
struct Target {
    label: String,
    /// The added round-trip time; None for the local store.
    rtt_ms: Option<u64>,
    env: Env,
    store: Store,
    proxy: Option<LatencyProxy>,
}

/// What one target measured.
#[derive(Default)]
struct Measured {
    lazy_s: f64,
    prefetched_s: f64,
    export_s: f64,
    lazy_fetched: u64,
    prefetched_fetched: u64,
    /// Bytes through the proxy in the first run of the layer.
    wire_bytes: u64,
    workspaces: Vec<(String, f64, i32)>,
    burst_s: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(rt: &tokio::runtime::Runtime, scratch: &Path, repo: &Path) -> Result<Section> {
    let (local, refs) = datasets::setup(scratch, repo)?;
    let dir = std::fs::canonicalize(scratch)?.join("remote");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let tasks = datasets::task_layers(
        &local,
        repo,
        &refs,
        BURST,
        &scratch.join("datasets").join("tasks"),
    )?;

    let server = S3Server::start("strata-bench --suite remote")
        .context("radosgw is not installed: run scripts/setup.sh")?;
    let local_store = Store::open(&StoreUrl::parse(&local.store)?)?;
    let direct = Store::open(&StoreUrl::parse(&server.url)?)?;
    let t = Instant::now();
    let copied = rt.block_on(copy_objects(&local_store, &direct))?;
    eprintln!(
        "remote: copied {} objects ({:.0} MB) to radosgw in {:.1} s",
        copied.0,
        copied.1 as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    let base = base_layer(&local)?;
    let base_id = rt
        .block_on(local_store.resolve_layer(&base))
        .context("the Debian base's layer")?;
    let direct_ms = rt.block_on(small_get_ms(&direct, &base_id))?;

    let mut targets = vec![Target {
        label: "local store".into(),
        rtt_ms: None,
        env: local.with(dir.join("home-local"), local.store.clone()),
        store: local_store,
        proxy: None,
    }];
    let mut measured_rtt = Vec::new();
    for ms in RTTS_MS {
        let proxy = LatencyProxy::start(
            server.endpoint(),
            Link {
                rtt: Duration::from_millis(ms),
                bandwidth: None,
            },
        )?;
        let url = server.url_through(proxy.addr());
        let store = Store::open(&StoreUrl::parse(&url)?)?;
        measured_rtt.push((ms, rt.block_on(small_get_ms(&store, &base_id))?));
        targets.push(Target {
            label: format!("S3 +{ms} ms"),
            rtt_ms: Some(ms),
            env: local.with(dir.join(format!("home-s3-{ms}")), url),
            store,
            proxy: Some(proxy),
        });
    }
    for t in &targets {
        std::fs::create_dir_all(&t.env.home)?;
    }

    // Two real workspaces of different projects.
    let mut picked: Vec<String> = Vec::new();
    for r in &refs {
        let project = r.split('@').next().unwrap_or(r);
        if picked.iter().all(|p| p.split('@').next() != Some(project)) {
            picked.push(r.clone());
        }
        if picked.len() == 2 {
            break;
        }
    }

    let mut results = Vec::new();
    for t in &targets {
        eprintln!("remote: measuring against {}", t.label);
        results.push(measure(rt, t, &base, &base_id, &picked, &tasks, &dir)?);
    }
    for t in &targets {
        let _ = t.env.go_cold();
    }

    let mut rows = Vec::new();
    let local_m = &results[0];
    for (t, m) in targets.iter().zip(&results).skip(1) {
        let ms = t.rtt_ms.unwrap_or(0);
        let target = match ms {
            2 => " (target ≤ 1.5×)",
            10 => " (target ≤ 3×)",
            _ => "",
        };
        let vs_local = |what: &str, s: f64, local: f64, note: String| {
            Row::new(
                &format!("{what}, {}", t.label),
                "s",
                s,
                "the same from the local store",
                local,
                "lower",
                &note,
            )
        };
        rows.push(vs_local(
            "first python work, first run of the layer",
            m.lazy_s,
            local_m.lazy_s,
            format!(
                "median of {ROUNDS}, fresh home, no prefetch list{target}; fetched {:.1} MB (local {:.1} MB), {:.1} MB on the wire",
                m.lazy_fetched as f64 / 1e6,
                local_m.lazy_fetched as f64 / 1e6,
                m.wire_bytes as f64 / 1e6
            ),
        ));
        rows.push(vs_local(
            "first python work, with the prefetch list",
            m.prefetched_s,
            local_m.prefetched_s,
            format!(
                "median of {ROUNDS}, fresh home{target}; fetched {:.1} MB (local {:.1} MB)",
                m.prefetched_fetched as f64 / 1e6,
                local_m.prefetched_fetched as f64 / 1e6
            ),
        ));
        rows.push(Row::new(
            &format!(
                "first python work, lazy against export then run, {}",
                t.label
            ),
            "s",
            m.lazy_s,
            "export the base from the same store, then run",
            m.export_s,
            "lower",
            &format!(
                "{:.1}× faster (target ≥ 10×); local store: export then run {:.2} s",
                m.export_s / m.lazy_s,
                local_m.export_s
            ),
        ));
        for ((name, s, code), (_, local_s, local_code)) in
            m.workspaces.iter().zip(&local_m.workspaces)
        {
            rows.push(vs_local(
                &format!("{name}: cold test suite"),
                *s,
                *local_s,
                format!("cold host; tests exit {code} (local {local_code})"),
            ));
        }
        let burst_target = if ms == 2 { " (target ≤ 1.5×)" } else { "" };
        rows.push(vs_local(
            &format!("burst of {BURST} distinct workspaces, all done"),
            m.burst_s,
            local_m.burst_s,
            format!("cold host; container sandboxes each running Python over its workspace{burst_target}"),
        ));
    }
    let rtts: Vec<String> = measured_rtt
        .iter()
        .map(|(ms, got)| format!("+{ms} ms: {got:.1} ms"))
        .collect();
    Ok(Section {
        name: "remote".into(),
        description: format!(
            "Lazy loading from S3: the datasets' store copied into a one-node radosgw on \
             loopback ({} objects, {:.0} MB), read through a latency-injecting proxy at \
             0, 2 and 10 ms added round-trip time (a small GET took {direct_ms:.1} ms \
             straight to radosgw and {} through the proxy), against the same store as a \
             local directory. Every Strata row's baseline is the local \
             store's figure from this run, except the export row, whose baseline is \
             exporting from the same S3 store.",
            copied.0,
            copied.1 as f64 / 1e6,
            rtts.join(", ")
        ),
        rows,
    })
}

/// Every measurement against one store.
fn measure(
    rt: &tokio::runtime::Runtime,
    t: &Target,
    base: &str,
    base_id: &strata_store::Digest,
    workspaces: &[String],
    tasks: &[(String, String)],
    dir: &Path,
) -> Result<Measured> {
    let env = &t.env;
    let mut m = Measured::default();
    // One start from a cold host: (seconds, bytes fetched, bytes through the proxy).
    let python = || -> Result<(f64, u64, u64)> {
        env.go_cold()?;
        drop_caches();
        let wire = t.proxy.as_ref().map_or(0, |p| p.bytes_down());
        let start = Instant::now();
        env.ok(&[
            "run",
            DEBIAN,
            "--backend",
            "fncall",
            "--",
            "python3",
            "-c",
            FIRST_WORK,
        ])?;
        let took = start.elapsed().as_secs_f64();
        let wire = t.proxy.as_ref().map_or(0, |p| p.bytes_down()) - wire;
        let fetched = env.json(&["layer", "stats", base, "--json"])?["fetched_bytes"]
            .as_u64()
            .unwrap_or(0);
        Ok((took, fetched, wire))
    };
    let (mut lazy, mut pre) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        rt.block_on(t.store.remove_prefetch(base_id))?;
        let (s, fetched, wire) = python()?;
        lazy.push(s);
        (m.lazy_fetched, m.wire_bytes) = (fetched, wire);
        // Stopping the daemon saves the order this run read in.
        env.go_cold()?;
        if rt.block_on(t.store.get_prefetch(base_id))?.is_none() {
            bail!("{}: the first run saved no prefetch list", t.label);
        }
        let (s, fetched, _) = python()?;
        pre.push(s);
        m.prefetched_fetched = fetched;
    }
    m.lazy_s = median(lazy);
    m.prefetched_s = median(pre);

    // Export the base, then the same Python in a chroot of the tree.
    env.go_cold()?;
    drop_caches();
    let out = dir.join("export");
    let _ = std::fs::remove_dir_all(&out);
    let start = Instant::now();
    env.ok(&["layer", "export", base, &out.display().to_string()])?;
    let status = Command::new("chroot")
        .arg(&out)
        .args(["/usr/bin/python3", "-c", FIRST_WORK])
        .stdout(std::process::Stdio::null())
        .status()?;
    if !status.success() {
        bail!("python in the exported base failed");
    }
    m.export_s = start.elapsed().as_secs_f64();
    std::fs::remove_dir_all(&out)?;

    for reference in workspaces {
        env.go_cold()?;
        drop_caches();
        let start = Instant::now();
        let o = env.cmd(&["run", reference, "--command", "test"]).output()?;
        let s = start.elapsed().as_secs_f64();
        m.workspaces
            .push((reference.clone(), s, o.status.code().unwrap_or(-1)));
    }

    env.go_cold()?;
    drop_caches();
    m.burst_s = datasets::burst_strata(env, tasks)?.0;
    Ok(m)
}

/// The Debian base's layer, as its catalog entry names it.
fn base_layer(env: &Env) -> Result<String> {
    let shown = env.json(&["catalog", "show", DEBIAN, "--json"])?;
    let entry: Entry = serde_json::from_value(shown["entry"].clone())?;
    Ok(entry.base)
}

/// Copies every object of `from` to `to`, 16 at a time; returns (objects, bytes).
async fn copy_objects(from: &Store, to: &Store) -> Result<(u64, u64)> {
    use object_store::ObjectStoreExt;
    let (src, dst) = (from.backend().clone(), to.backend().clone());
    let metas: Vec<object_store::ObjectMeta> = src.list(None).try_collect().await?;
    let mut objects = 0u64;
    let mut bytes = 0u64;
    let mut copies = futures::stream::iter(metas)
        .map(|meta| {
            let (src, dst) = (src.clone(), dst.clone());
            async move {
                let data = src.get(&meta.location).await?.bytes().await?;
                let n = data.len() as u64;
                dst.put(&meta.location, data.into()).await?;
                Ok::<u64, object_store::Error>(n)
            }
        })
        .buffer_unordered(16);
    while let Some(n) = copies.next().await {
        objects += 1;
        bytes += n?;
    }
    Ok((objects, bytes))
}

/// The median time of a small GET (the base's manifest) through `store`, in milliseconds.
async fn small_get_ms(store: &Store, id: &strata_store::Digest) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..21 {
        let t = Instant::now();
        store.get_provenance(id).await?;
        v.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(median(v))
}
