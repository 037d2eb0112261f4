//! `strata-bench`: runs a benchmark suite and writes `results/<suite>-<date>.json` plus a
//! Markdown report. Every Strata number is reported next to a baseline measured in the same
//! run on the same data, because this machine is shared and noisy.

mod build;
mod datasets;
mod e2b;
mod lazy;
mod machine;
mod remote;
mod report;
mod runtime;
mod service;
mod state;
mod vm;

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;

#[derive(Parser)]
#[command(name = "strata-bench")]
struct Args {
    /// Which suite to run: `build`, `lazyfs`, `runtime`, `datasets`, `vm`, `remote` (lazy
    /// loading from S3 through added latency), `service` (the node service from the Python
    /// SDK and the CLI), `e2b`, `state` (hibernate, wake, fork), or `quick` (every suite
    /// but remote and service, small sizes).
    /// Run from the repository root, as root (mounts, drop_caches).
    #[arg(long, default_value = "quick")]
    suite: String,
    /// Where results and reports go.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Scratch space on a disk filesystem (not tmpfs).
    #[arg(long, default_value = "target/bench-scratch")]
    scratch: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out)?;
    std::fs::create_dir_all(&args.scratch)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut sections = Vec::new();
    let repo = std::env::current_dir()?;
    match args.suite.as_str() {
        "build" => sections.push(build::run(&rt, &args.scratch)?),
        "lazyfs" => sections.push(lazy::run(&rt, &args.scratch, &repo)?),
        "runtime" => sections.push(runtime::run(&rt, &args.scratch, &repo, false)?),
        "datasets" => sections.push(datasets::run(&args.scratch, &repo, false)?),
        "vm" => sections.push(vm::run(&rt, &args.scratch, &repo, false)?),
        "remote" => sections.push(remote::run(&rt, &args.scratch, &repo)?),
        "service" => sections.push(service::run(&rt, &args.scratch, &repo)?),
        "e2b" => sections.push(e2b::run(&rt, &args.scratch, &repo)?),
        "state" => sections.push(state::run(&rt, &args.scratch, &repo, false)?),
        "quick" => {
            sections.push(build::run(&rt, &args.scratch)?);
            sections.push(lazy::run(&rt, &args.scratch, &repo)?);
            sections.push(runtime::run(&rt, &args.scratch, &repo, true)?);
            sections.push(datasets::run(&args.scratch, &repo, true)?);
            sections.push(vm::run(&rt, &args.scratch, &repo, true)?);
        }
        other => {
            anyhow::bail!(
                "unknown suite `{other}` (build, lazyfs, runtime, datasets, vm, remote, service, e2b, state, quick)"
            )
        }
    }
    let results = report::Results {
        suite: args.suite.clone(),
        date: report::today(),
        machine: machine::facts(),
        sections,
    };
    let (json, md) = report::write(&args.out, &results)?;
    eprintln!("wrote {} and {}", json.display(), md.display());
    Ok(())
}
