//! The `strata` binary: parses the command line and wires the library crates together.
//! Nothing here decides how layers or stores work; it only calls into the crates that do.

mod build_steps;
mod catalog;
mod doctor;
mod layer;
mod layer_rm;
mod lazy;
mod output;
mod sandbox;
mod store;

use anyhow::Result;
use clap::{Parser, Subcommand};
use strata_store::{default_store_url, Store, StoreUrl};

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "Layered, lazily loaded sandbox environments for agents"
)]
struct Cli {
    /// Store URL: a directory, file:///dir, or s3://bucket?endpoint=http://host:port.
    /// Default: a local store under STRATA_HOME.
    #[arg(long, global = true, env = "STRATA_STORE")]
    store: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build, inspect, list and export layers.
    #[command(subcommand)]
    Layer(layer::LayerCommand),
    /// Store statistics, verification and garbage collection.
    #[command(subcommand)]
    Store(store::StoreCommand),
    /// Catalog entries: environments by ID.
    #[command(subcommand)]
    Catalog(catalog::CatalogCommand),
    /// The local chunk cache of the lazyfs daemon.
    #[command(subcommand)]
    Cache(lazy::CacheCommand),
    /// The lazyfs daemon itself.
    #[command(subcommand)]
    Lazyfs(lazy::LazyfsCommand),
    /// Run a command in a fresh sandbox of a catalog entry, then destroy it.
    Run(sandbox::RunArgs),
    /// Stateful sandboxes: create, exec, cp, ps, ls, rm.
    #[command(subcommand)]
    Sandbox(sandbox::SandboxCommand),
    /// Check everything this host needs to run sandboxes, with the fix for each missing
    /// piece; exits 1 if a sandbox cannot run here.
    Doctor {
        #[arg(long)]
        json: bool,
    },
}

pub fn open_store(url: Option<&str>) -> Result<Store> {
    let url = match url {
        Some(u) => StoreUrl::parse(u)?,
        None => default_store_url(),
    };
    Ok(Store::open(&url)?)
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(async {
        let url = cli.store.clone();
        match cli.command {
            Command::Layer(c) => layer::run(url, c).await,
            Command::Store(c) => store::run(&open_store(url.as_deref())?, c).await,
            Command::Catalog(c) => catalog::run(&open_store(url.as_deref())?, c).await,
            Command::Cache(c) => lazy::cache(c).await,
            Command::Lazyfs(lazy::LazyfsCommand::Serve {
                cache_max,
                fetch_timeout,
                idle_detach,
                erofs_mount,
            }) => {
                lazy::serve(
                    open_store(url.as_deref())?,
                    cache_max,
                    fetch_timeout,
                    idle_detach,
                    erofs_mount.source(),
                )
                .await
            }
            Command::Lazyfs(lazy::LazyfsCommand::Stop) => lazy::stop().await,
            Command::Run(a) => sandbox::run(&open_store(url.as_deref())?, url, a).await,
            Command::Sandbox(c) => sandbox::sandbox(&open_store(url.as_deref())?, url, c).await,
            Command::Doctor { json } => doctor::run(url, json),
        }
    });
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}
