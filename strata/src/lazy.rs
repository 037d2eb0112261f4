//! `strata layer mount|umount|stats`, `strata cache ...` and `strata lazyfs serve`: the
//! client side of the lazyfs daemon, and starting it when nothing answers.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use strata_lazyfs::{connect_or_start, Client, LazyError, Paths, Request, Response};
use strata_store::{strata_home, Store};

use strata_catalog::parse_size;

use crate::output::{human_bytes, print_json};

pub fn paths() -> Paths {
    Paths::new(strata_home().join("lazyfs"))
}

/// Starts `strata [--store URL] lazyfs serve` in the background, logging to the daemon's
/// log file.
pub fn daemon_starter(store_url: Option<String>) -> strata_runtime::StartDaemon {
    std::sync::Arc::new(move || -> Result<(), LazyError> {
        let paths = paths();
        // Private to root before the log (and then the daemon's socket) is made in it.
        strata_lazyfs::prepare_run_dir(&paths)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(paths.log_file())
            .map_err(|e| LazyError::Daemon(format!("{}: {e}", paths.log_file().display())))?;
        let exe = std::env::current_exe().map_err(|e| LazyError::Daemon(e.to_string()))?;
        let mut cmd = Command::new(exe);
        if let Some(u) = &store_url {
            cmd.arg("--store").arg(u);
        }
        cmd.args(["lazyfs", "serve"])
            .stdin(Stdio::null())
            .stdout(
                log.try_clone()
                    .map_err(|e| LazyError::Daemon(e.to_string()))?,
            )
            .stderr(log)
            .env(
                "STRATA_LOG",
                std::env::var("STRATA_LOG").unwrap_or_else(|_| "info".into()),
            );
        // Its own process group: the daemon outlives this command and its terminal.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        cmd.spawn()
            .map_err(|e| LazyError::Daemon(format!("starting the daemon: {e}")))?;
        Ok(())
    })
}

/// Connects to the daemon, starting it if none is running.
pub fn client(store_url: Option<&str>) -> Result<Client> {
    let start = daemon_starter(store_url.map(str::to_string));
    Ok(connect_or_start(
        &paths(),
        Duration::from_secs(15),
        move || start(),
    )?)
}

#[derive(Subcommand)]
pub enum CacheCommand {
    /// Size and contents of the local chunk cache.
    Stats {
        #[arg(long)]
        json: bool,
    },
    /// Evict least recently used chunks down to a size.
    Prune {
        /// Target size, e.g. 2G or 500M (default: empty the cache).
        #[arg(long, default_value = "0", value_parser = parse_size)]
        max_size: u64,
    },
}

#[derive(Subcommand)]
pub enum LazyfsCommand {
    /// Run the lazyfs daemon in the foreground (normally started on demand).
    Serve {
        /// Local chunk cache bound.
        #[arg(long, env = "STRATA_CACHE_MAX", default_value = "10G", value_parser = parse_size)]
        cache_max: u64,
        /// How long a read waits for an unreachable store before failing with EIO.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        fetch_timeout: Duration,
        /// How long a layer stays mounted after the last sandbox using it goes.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        idle_detach: Duration,
        /// How layer images are mounted: `file` (straight from the image file, Linux
        /// 6.12+), `loop` (through loop devices, any kernel), or `auto` (probe once).
        #[arg(long, env = "STRATA_EROFS_MOUNT", value_enum, default_value_t = ErofsMount::Auto)]
        erofs_mount: ErofsMount,
    },
    /// Stop the daemon, unmounting everything it serves.
    Stop,
}

/// How the daemon mounts layer images (`--erofs-mount`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ErofsMount {
    Auto,
    File,
    Loop,
}

impl ErofsMount {
    pub fn source(self) -> Option<strata_lazyfs::mounts::ErofsSource> {
        use strata_lazyfs::mounts::ErofsSource;
        match self {
            ErofsMount::Auto => None,
            ErofsMount::File => Some(ErofsSource::File),
            ErofsMount::Loop => Some(ErofsSource::Loop),
        }
    }
}

pub async fn serve(
    store: Store,
    cache_max: u64,
    fetch_timeout: Duration,
    idle_detach: Duration,
    erofs: Option<strata_lazyfs::mounts::ErofsSource>,
) -> Result<i32> {
    let cfg = strata_lazyfs::daemon::DaemonConfig {
        paths: paths(),
        cache_max_bytes: cache_max,
        policy: strata_lazyfs::FetchPolicy {
            timeout: fetch_timeout,
        },
        idle_detach,
        erofs,
    };
    strata_lazyfs::daemon::serve(cfg, store).await?;
    Ok(0)
}

/// Which daemon a call talks to. Only `layer mount` starts one; queries, unmounts and
/// stop talk to a running daemon or fail, so they never leave a daemon behind.
enum Reach {
    StartIfNeeded(Option<String>),
    Running,
}

fn running_client() -> Result<Client> {
    Client::connect(&paths().socket())
        .context("no lazyfs daemon is running (`strata layer mount` starts one)")
}

/// Runs a blocking client call off the async runtime.
async fn call(reach: Reach, req: Request) -> Result<Response> {
    tokio::task::spawn_blocking(move || -> Result<Response> {
        let mut c = match reach {
            Reach::StartIfNeeded(url) => client(url.as_deref())?,
            Reach::Running => running_client()?,
        };
        Ok(c.call(&req)?)
    })
    .await
    .context("control call")?
}

/// `dir` as the daemon must get it: absolute (its working directory is not ours).
fn absolute(dir: &std::path::Path) -> Result<PathBuf> {
    std::path::absolute(dir).with_context(|| format!("{}", dir.display()))
}

pub async fn mount(store_url: Option<String>, id: String, dir: PathBuf) -> Result<i32> {
    let dir = absolute(&dir)?;
    match call(
        Reach::StartIfNeeded(store_url),
        Request::Mount {
            id,
            dir: dir.clone(),
        },
    )
    .await?
    {
        Response::Attached(a) => {
            eprintln!("layer {} mounted at {}", a.id, dir.display());
            Ok(0)
        }
        other => bail!("unexpected reply {other:?}"),
    }
}

/// Releases a bind `layer mount` made; the daemon refuses any other directory
/// ([`LazyError::NotBound`]), whatever is mounted there.
pub async fn umount(dir: PathBuf) -> Result<i32> {
    let dir = absolute(&dir)?;
    call(Reach::Running, Request::Umount { dir }).await?;
    Ok(0)
}

pub async fn stats(id: String, json: bool) -> Result<i32> {
    match call(Reach::Running, Request::Stats { id }).await? {
        Response::Stats(s) => {
            if json {
                print_json(&s)?;
            } else {
                println!("layer            {}", s.id);
                println!(
                    "blob bytes       {} ({})",
                    s.blob_bytes,
                    human_bytes(s.blob_bytes)
                );
                println!(
                    "requested bytes  {} ({})",
                    s.requested_bytes,
                    human_bytes(s.requested_bytes)
                );
                println!(
                    "fetched bytes    {} ({})",
                    s.fetched_bytes,
                    human_bytes(s.fetched_bytes)
                );
                println!("cache hits       {}", s.cache_hits);
                println!("cache misses     {}", s.cache_misses);
                println!("fetch errors     {}", s.fetch_errors);
                println!("prefetched       {} chunks", s.prefetched_chunks);
            }
            Ok(0)
        }
        other => bail!("unexpected reply {other:?}"),
    }
}

pub async fn cache(cmd: CacheCommand) -> Result<i32> {
    let (req, json) = match cmd {
        CacheCommand::Stats { json } => (Request::CacheStats, json),
        CacheCommand::Prune { max_size } => (
            Request::Prune {
                max_bytes: max_size,
            },
            false,
        ),
    };
    match call(Reach::Running, req).await? {
        Response::CacheStats(s) => {
            if json {
                print_json(&s)?;
            } else {
                println!("cache     {}", s.dir);
                println!("chunks    {}", s.chunks);
                println!(
                    "bytes     {} ({}) of {}",
                    s.bytes,
                    human_bytes(s.bytes),
                    human_bytes(s.max_bytes)
                );
                println!("evicted   {} chunks", s.evicted_chunks);
            }
            Ok(0)
        }
        other => bail!("unexpected reply {other:?}"),
    }
}

pub async fn stop() -> Result<i32> {
    if Client::connect(&paths().socket()).is_err() {
        eprintln!("no lazyfs daemon is running");
        return Ok(0);
    }
    call(Reach::Running, Request::Shutdown).await?;
    // Returns once the daemon is gone, so a caller may clear its directories or start
    // another at once.
    strata_lazyfs::wait_stopped(&paths(), Duration::from_secs(120))?;
    Ok(0)
}
