//! `strata layer ...`: build, inspect, list, export and remove layers.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use std::io::Write;

use strata_builder::steps::StepOptions;
use strata_builder::{BuildReport, BuildRequest, LayerDefinition, LayerKind, Source};
use strata_store::Store;

use crate::config::Settings;
use crate::output::{byte_progress, human_bytes, print_json};

#[derive(Subcommand)]
pub enum LayerCommand {
    #[command(flatten)]
    Stored(StoredLayerCommand),
    /// Mount a layer read-only at DIR, lazily loaded (starts the lazyfs daemon if needed).
    Mount { id: String, dir: PathBuf },
    /// Unmount a layer mounted with `layer mount` (any other directory is refused).
    Umount { dir: PathBuf },
    /// Read counters of a mounted layer since the daemon started.
    Stats {
        id: String,
        #[arg(long)]
        json: bool,
    },
}

/// Layer commands that work on the store directly.
#[derive(Subcommand)]
pub enum StoredLayerCommand {
    /// Build a layer from a directory, tar (plain/gzip/zstd, `-` for stdin), OCI layout
    /// (`oci:DIR[:REF]`), registry image (`docker://REF`), git revision (`git:REPO[@REV]`)
    /// or a layer definition file (`*.toml`: a `[source]`, or `run` steps over `from`
    /// layers, run in a container sandbox). Prints the layer ID last.
    Build {
        /// Role of the layer; a definition file's `kind` wins.
        #[arg(long, default_value = "base")]
        kind: String,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        version: Option<String>,
        /// Leave out paths matching this glob (repeatable).
        #[arg(long)]
        exclude: Vec<String>,
        /// Put the source's root at this directory inside the layer (e.g. /work).
        #[arg(long)]
        prefix: Option<String>,
        /// Run a definition's build steps even when the build cache has their result.
        #[arg(long)]
        no_cache: bool,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        source: String,
    },
    /// Show a layer's manifest summary and provenance.
    Inspect {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// List layers in the store.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Write a layer's tree into a directory.
    Export { id: String, dir: PathBuf },
    /// Remove layers from the store (their manifests and records; `strata store gc` then
    /// frees their data). Refused while a catalog version or a live sandbox on this host
    /// uses one of them, naming those, unless --force.
    Rm {
        /// Layer IDs or unique prefixes of 8+ hex digits.
        #[arg(required = true)]
        ids: Vec<String>,
        /// Remove them even though catalog versions or sandboxes use them.
        #[arg(long)]
        force: bool,
    },
}

pub async fn run(settings: &Settings, cmd: LayerCommand) -> Result<i32> {
    match cmd {
        LayerCommand::Mount { id, dir } => crate::lazy::mount(settings, id, dir).await,
        LayerCommand::Umount { dir } => crate::lazy::umount(settings, dir).await,
        LayerCommand::Stats { id, json } => crate::lazy::stats(settings, id, json).await,
        LayerCommand::Stored(c) => {
            let store = crate::open_store(settings)?;
            run_stored(&store, settings, c).await
        }
    }
}

async fn run_stored(store: &Store, settings: &Settings, cmd: StoredLayerCommand) -> Result<i32> {
    match cmd {
        StoredLayerCommand::Build {
            kind,
            name,
            version,
            exclude,
            prefix,
            no_cache,
            json,
            source,
        } => {
            let is_definition =
                source.ends_with(".toml") && std::path::Path::new(&source).is_file();
            if is_definition {
                let mut def = LayerDefinition::load(source.as_ref())?;
                if def.is_step_build() {
                    def.exclude.extend(exclude);
                    def.name = name.or(def.name);
                    def.version = version.or(def.version);
                    let report = build_steps(store, settings, &def, no_cache).await?;
                    print_report(&report, json)?;
                    return Ok(0);
                }
            }
            let req = if is_definition {
                let mut r = BuildRequest::from_definition(source.as_ref())?;
                r.exclude.extend(exclude);
                r.name = name.or(r.name);
                r.version = version.or(r.version);
                r.prefix = prefix.or(r.prefix);
                r.registry = settings.registry.clone();
                r
            } else {
                BuildRequest {
                    source: Source::parse(&source)?,
                    kind: kind.parse::<LayerKind>()?,
                    name,
                    version,
                    exclude,
                    prefix,
                    source_label: None,
                    provenance: Default::default(),
                    registry: settings.registry.clone(),
                }
            };
            let (bar, progress) = byte_progress(&format!("building {}", req.source));
            let report = strata_builder::build(store, &req, Some(progress)).await;
            bar.finish_and_clear();
            print_report(&report?, json)?;
            Ok(0)
        }
        StoredLayerCommand::Inspect { id, json } => {
            let id = store.resolve_layer(&id).await?;
            let m = store.get_layer(&id).await?;
            let p = store.get_provenance(&id).await.ok();
            print_inspect(&m, p.as_ref(), json)?;
            Ok(0)
        }
        StoredLayerCommand::Ls { json } => {
            let mut rows = Vec::new();
            for m in store.all_layers().await? {
                let p = store.get_provenance(&m.id).await.unwrap_or_default();
                rows.push((m, p));
            }
            print_ls(rows, json)?;
            Ok(0)
        }
        StoredLayerCommand::Rm { ids, force } => {
            crate::layer_rm::remove(store, &settings.runtime_dir(), &ids, force).await
        }
        StoredLayerCommand::Export { id, dir } => {
            let id = store.resolve_layer(&id).await?;
            let m = store.get_layer(&id).await?;
            let scratch = tempfile::tempdir().context("creating a scratch directory")?;
            let r = strata_builder::export::export_layer(store, &m, &dir, scratch.path()).await?;
            eprintln!(
                "exported {} entries, {} to {}",
                r.entries,
                human_bytes(r.bytes),
                dir.display()
            );
            Ok(0)
        }
    }
}

pub fn print_report(report: &BuildReport, json: bool) -> Result<()> {
    if json {
        return print_json(report);
    }
    if report.cache_hit {
        eprintln!(
            "build cache hit (key {}): no step run; {} files, {} of data",
            report.build_key.map(|k| k.to_hex()).unwrap_or_default(),
            report.files,
            human_bytes(report.logical_bytes),
        );
    } else {
        eprintln!(
            "{} files, {} of data; {} new ({} uploaded), {}/{} chunks reused; {:.2} s{}",
            report.files,
            human_bytes(report.logical_bytes),
            human_bytes(report.new_data_bytes),
            human_bytes(report.uploaded_bytes),
            report.reused_chunks,
            report.chunks,
            report.seconds,
            if report.created {
                ""
            } else {
                " (layer already in store)"
            }
        );
    }
    println!("{}", report.id);
    Ok(())
}

/// Runs a definition's build steps in a container sandbox of the local runtime.
async fn build_steps(
    store: &Store,
    settings: &Settings,
    def: &LayerDefinition,
    no_cache: bool,
) -> Result<BuildReport> {
    strata_builder::steps::validate(def)?;
    let inputs = crate::build_steps::resolve_inputs(store, &def.from).await?;
    let rt = crate::sandbox::open_runtime(settings)?;
    let runner = std::sync::Arc::new(crate::build_steps::RuntimeStepRunner {
        rt,
        ca_bundle: settings.build_ca_bundle.host_bundle(),
    });
    let opts = StepOptions {
        no_cache,
        output: Some(std::sync::Arc::new(|data: &[u8]| {
            let mut err = std::io::stderr().lock();
            let _ = err.write_all(data).and_then(|_| err.flush());
        })),
        progress: None,
    };
    Ok(strata_builder::steps::build_steps(store, def, inputs, runner, opts).await?)
}

/// `layer inspect`'s output (embedded or through a node service).
pub fn print_inspect(
    m: &strata_store::LayerManifest,
    p: Option<&strata_store::Provenance>,
    json: bool,
) -> Result<()> {
    if json {
        print_json(&serde_json::json!({
            "id": m.id,
            "format": m.format,
            "files": m.files,
            "logical_bytes": m.logical_bytes,
            "blob_bytes": m.blob_size,
            "metadata": m.metadata,
            "chunks": m.chunks.len(),
            "packs": m.packs.len(),
            "provenance": p,
        }))?;
    } else {
        println!("id             {}", m.id);
        if let Some(p) = &p {
            println!("kind           {}", p.kind);
            println!("name           {}", p.name.as_deref().unwrap_or("-"));
            println!("version        {}", p.version.as_deref().unwrap_or("-"));
            println!("source         {}", p.source);
            println!("writer         {}", p.writer_version);
        }
        println!("files          {}", m.files);
        println!(
            "logical bytes  {} ({})",
            m.logical_bytes,
            human_bytes(m.logical_bytes)
        );
        println!("blob bytes     {}", m.blob_size);
        println!(
            "metadata       {} ({} bytes)",
            m.metadata.digest, m.metadata.size
        );
        println!(
            "chunks         {} in {} packs",
            m.chunks.len(),
            m.packs.len()
        );
    }
    Ok(())
}

/// `layer ls`'s output.
pub fn print_ls(
    mut rows: Vec<(strata_store::LayerManifest, strata_store::Provenance)>,
    json: bool,
) -> Result<()> {
    rows.sort_by_key(|(m, _)| m.id);
    if json {
        let v: Vec<_> = rows
            .iter()
            .map(|(m, p)| {
                serde_json::json!({
                    "id": m.id, "kind": p.kind, "name": p.name, "version": p.version,
                    "files": m.files, "logical_bytes": m.logical_bytes,
                })
            })
            .collect();
        print_json(&v)?;
    } else {
        println!(
            "{:<16} {:<10} {:<24} {:<12} {:>8} {:>10}",
            "ID", "KIND", "NAME", "VERSION", "FILES", "SIZE"
        );
        for (m, p) in rows {
            println!(
                "{:<16} {:<10} {:<24} {:<12} {:>8} {:>10}",
                &m.id.to_hex()[..16],
                p.kind,
                p.name.as_deref().unwrap_or("-"),
                p.version.as_deref().unwrap_or("-"),
                m.files,
                human_bytes(m.logical_bytes)
            );
        }
    }
    Ok(())
}
