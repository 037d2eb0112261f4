//! The `e2b` suite: create → first command result through the unmodified `e2b` Python
//! SDK (pinned, from PyPI) against `strata serve --e2b-listen`, next to the same through
//! Strata's own Python SDK against the same service, in one run. E2B's cloud publishes
//! 0.44–0.49 s p50 for this measure (independent harnesses); the report shows it beside.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::report::{Row, Section};
use crate::runtime::{percentile, setup};
use crate::service::{drive, python, serve, venv, Served};

/// The `e2b` release measured (the newest the tests pin).
const E2B: &str = "2.63.0";

const DRIVER: &str = r#"
import json, sys, time
from e2b import Sandbox
ref, n = sys.argv[1], int(sys.argv[2])
def once():
    t = time.perf_counter()
    sb = Sandbox.create(ref, metadata={"strata.backend": "container"}, allow_internet_access=False)
    r = sb.commands.run("/bin/true")
    took = (time.perf_counter() - t) * 1000
    sb.kill()
    assert r.exit_code == 0, r
    return took
once()
print(json.dumps([once() for _ in range(n)]))
"#;

fn e2b_python(dir: &Path) -> Result<PathBuf> {
    venv(
        dir,
        &format!("e2b-{E2B}"),
        &[std::ffi::OsStr::new(&format!("e2b=={E2B}"))],
    )
}

fn e2b_latency(py: &Path, s: &Served, reference: &str, n: usize) -> Result<Vec<f64>> {
    let url = s.e2b.as_deref().context("the service serves no E2B API")?;
    let o = Command::new(py)
        .args(["-c", DRIVER, reference, &n.to_string()])
        .env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .env("E2B_API_KEY", &s.token)
        .output()?;
    if !o.status.success() {
        bail!("e2b driver: {}", String::from_utf8_lossy(&o.stderr));
    }
    let out = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(out.trim()).with_context(|| format!("e2b driver printed {out}"))
}

pub fn run(rt: &tokio::runtime::Runtime, scratch: &Path, repo: &Path) -> Result<Section> {
    let s = setup(rt, scratch, repo)?;
    let base = s.rootfs.parent().context("rootfs parent")?.to_path_buf();
    let py = python(&base, repo)?;
    let e2b = e2b_python(&base)?;
    let served = serve(&base, &s.store_url, true)?;
    let reference = s.spec.catalog_ref.clone();
    let samples = 60;
    let mut ours: Vec<f64> = drive(&py, &served, &reference, &["latency", &samples.to_string()])?;
    let mut theirs = e2b_latency(&e2b, &served, &reference, samples)?;
    let (o50, o95) = (percentile(&mut ours, 0.5), percentile(&mut ours, 0.95));
    let (e50, e95) = (percentile(&mut theirs, 0.5), percentile(&mut theirs, 0.95));
    let rows = vec![
        Row::new(
            &format!("container create -> first command via the e2b SDK {E2B}, p50"),
            "ms",
            e50,
            "Strata's Python SDK, p50",
            o50,
            "lower",
            "E2B's cloud, published: 440-490 ms p50",
        ),
        Row::new(
            &format!("container create -> first command via the e2b SDK {E2B}, p95"),
            "ms",
            e95,
            "Strata's Python SDK, p95",
            o95,
            "lower",
            "",
        ),
    ];
    drop(served);
    Ok(Section {
        name: "e2b".into(),
        description: "Create -> first command result through the unmodified e2b Python SDK against strata serve --e2b-listen, and through Strata's own Python SDK against the same service, in one run; container backend, layers cached locally.".into(),
        rows,
    })
}
