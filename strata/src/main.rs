//! The `strata` binary: parses the command line and wires the library crates together.
//! Nothing here decides how layers or stores work; it only calls into the crates that do.
//! Every setting (flags, environment, `strata.toml`) is resolved once, in [`config`], and
//! passed down.

mod build_steps;
mod catalog;
mod config;
mod doctor;
mod layer;
mod layer_rm;
mod lazy;
mod output;
mod remote;
mod sandbox;
mod serve;
mod snapshot;
mod store;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use strata_store::Store;

use crate::config::{DaemonFlags, Settings};

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "Layered, lazily loaded sandbox environments for agents"
)]
struct Cli {
    #[command(flatten)]
    global: config::GlobalFlags,

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
    /// Snapshots in the store (`strata sandbox snapshot --to-store`): list, inspect,
    /// remove.
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCommand),
    /// The node service: the runtime, catalog and store behind a gRPC API for the CLI
    /// (`--server`), the Python SDK and other clients.
    Serve(serve::ServeArgs),
    /// Projects: who may use this node's sandboxes, backends and catalog namespaces.
    #[command(subcommand)]
    Project(serve::ProjectCommand),
    /// Tokens of projects, which clients of `strata serve` present.
    #[command(subcommand)]
    Token(serve::TokenCommand),
    /// Check everything this host needs to run sandboxes, with the fix for each missing
    /// piece; exits 1 if a sandbox cannot run here.
    Doctor {
        #[arg(long)]
        json: bool,
    },
}

pub fn open_store(settings: &Settings) -> Result<Store> {
    Ok(Store::open_with(&settings.store, &settings.store_options)?)
}

/// Logs to stderr at the configured level (`warn` by default).
fn init_logging(settings: &Settings) -> Result<()> {
    let filter = settings.log.as_deref().unwrap_or("warn");
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .with_context(|| format!("log filter `{filter}` (STRATA_LOG or log)"))?;
    // Colours only on a terminal: a daemon's stderr is its log file.
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        // A log that cannot be written (a daemon's log file on a full disk) loses the
        // line: reporting that on the same stderr would panic whatever logged it.
        .log_internal_errors(false)
        .init();
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let daemon = match &cli.command {
        Command::Lazyfs(lazy::LazyfsCommand::Serve {
            cache_max,
            fetch_timeout,
            idle_detach,
            erofs_mount,
        }) => DaemonFlags {
            cache_max: *cache_max,
            fetch_timeout: *fetch_timeout,
            idle_detach: *idle_detach,
            erofs_mount: *erofs_mount,
        },
        _ => DaemonFlags::default(),
    };
    let settings = match Settings::load(
        &cli.global,
        &daemon,
        &config::process_env,
        config::running_as_root(),
    )
    .and_then(|s| init_logging(&s).map(|()| s))
    {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {}", describe(&e));
            std::process::exit(1);
        }
    };
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
        let s = &settings;
        // `layer`, `catalog`, `run`, `sandbox` and `snapshot` go to the node service when one is set.
        let served = matches!(
            cli.command,
            Command::Layer(_)
                | Command::Catalog(_)
                | Command::Run(_)
                | Command::Sandbox(_)
                | Command::Snapshot(_)
        );
        if let (Some(url), true) = (&s.server, served) {
            let r = remote::Remote::connect(url, s.token.as_deref()).await?;
            return match cli.command {
                Command::Layer(c) => remote::layer(&r, c).await,
                Command::Catalog(c) => remote::catalog(&r, c).await,
                Command::Run(a) => remote::run(&r, a).await,
                Command::Sandbox(c) => remote::sandbox(&r, c).await,
                Command::Snapshot(c) => snapshot::remote(&r, c).await,
                _ => unreachable!("only served commands get here"),
            };
        }
        match cli.command {
            Command::Layer(c) => layer::run(s, c).await,
            Command::Store(c) => store::run(&open_store(s)?, c).await,
            Command::Catalog(c) => catalog::run(&open_store(s)?, &s.registrant, c).await,
            Command::Cache(c) => lazy::cache(s, c).await,
            Command::Lazyfs(lazy::LazyfsCommand::Serve { .. }) => {
                lazy::serve(open_store(s)?, s).await
            }
            Command::Lazyfs(lazy::LazyfsCommand::Stop) => lazy::stop(s).await,
            Command::Run(a) => sandbox::run(&open_store(s)?, s, a).await,
            Command::Sandbox(c) => sandbox::sandbox(&open_store(s)?, s, c).await,
            Command::Snapshot(c) => snapshot::run(&open_store(s)?, c).await,
            Command::Serve(a) => serve::serve(open_store(s)?, s, a).await,
            Command::Project(c) => serve::project(&open_store(s)?, c).await,
            Command::Token(c) => serve::token(&open_store(s)?, c).await,
            Command::Doctor { json } => doctor::run(s, json),
        }
    });
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {}", describe(&e));
            std::process::exit(1);
        }
    }
}

/// An error for people: its chain of causes, each said once (the library errors name
/// their cause in their own message already), and what to do when a disk is full.
fn describe(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let said = cause.to_string();
        if !text.contains(&said) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&said);
        }
    }
    let disk_full = e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::StorageFull)
    });
    if disk_full && !text.contains("free space") {
        text.push_str(
            " (the disk is full: free space on it, or set STRATA_HOME to a directory on a larger disk)",
        );
    }
    text
}
