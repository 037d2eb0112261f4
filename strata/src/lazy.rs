//! `strata layer mount|umount|stats`, `strata cache ...` and `strata lazyfs serve`: the
//! client side of the lazyfs daemon, and starting it when nothing answers.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use strata_lazyfs::{connect_or_start, Client, LazyError, Paths, Request, Response};
use strata_store::Store;

use strata_catalog::parse_size;

use crate::config::{ErofsMount, Settings};
use crate::output::{human_bytes, print_json};

pub fn paths(settings: &Settings) -> Paths {
    Paths::new(settings.lazyfs_dir())
}

/// Starts `strata lazyfs serve` in the background with the same settings as this process
/// (its home, store and settings file), logging to the daemon's log file.
pub fn daemon_starter(settings: &Settings) -> strata_runtime::StartDaemon {
    let settings = settings.clone();
    std::sync::Arc::new(move || -> Result<Option<std::process::Child>, LazyError> {
        let paths = paths(&settings);
        // Private to root before the log (and then the daemon's socket) is made in it.
        strata_lazyfs::prepare_run_dir(&paths)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(paths.log_file())
            .map_err(|e| LazyError::Daemon(format!("{}: {e}", paths.log_file().display())))?;
        let exe = std::env::current_exe().map_err(|e| LazyError::Daemon(e.to_string()))?;
        let mut cmd = Command::new(exe);
        if let Some(file) = &settings.file {
            cmd.arg("--config").arg(file);
        }
        if let Some(u) = &settings.store_given {
            cmd.arg("--store").arg(u);
        }
        cmd.args(["lazyfs", "serve"])
            .stdin(Stdio::null())
            .stdout(
                log.try_clone()
                    .map_err(|e| LazyError::Daemon(e.to_string()))?,
            )
            .stderr(log)
            .env("STRATA_HOME", &settings.home)
            .env("STRATA_LOG", settings.log.as_deref().unwrap_or("info"));
        // Its own process group: the daemon outlives this command and its terminal.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let child = cmd
            .spawn()
            .map_err(|e| LazyError::Daemon(format!("starting the daemon: {e}")))?;
        Ok(Some(child))
    })
}

/// Connects to the daemon, starting it if none is running.
pub fn client(settings: &Settings) -> Result<Client> {
    let start = daemon_starter(settings);
    Ok(connect_or_start(
        &paths(settings),
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
    /// Run the lazyfs daemon in the foreground (normally started on demand). Each flag
    /// overrides its setting (environment, strata.toml).
    Serve {
        /// Local chunk cache bound (env STRATA_CACHE_MAX; default 10G).
        #[arg(long, value_parser = parse_size)]
        cache_max: Option<u64>,
        /// How long a read waits for an unreachable store before failing with EIO
        /// (default 30s).
        #[arg(long, value_parser = humantime::parse_duration)]
        fetch_timeout: Option<Duration>,
        /// How long a layer stays mounted after the last sandbox using it goes (default
        /// 60s).
        #[arg(long, value_parser = humantime::parse_duration)]
        idle_detach: Option<Duration>,
        /// How layer images are mounted: `file` (straight from the image file, Linux
        /// 6.12+), `loop` (through loop devices, any kernel), or `auto` (probe once; the
        /// default). Env STRATA_EROFS_MOUNT.
        #[arg(long, value_enum)]
        erofs_mount: Option<ErofsMount>,
    },
    /// Stop the daemon, unmounting everything it serves.
    Stop,
}

/// Runs the daemon in the foreground with the settings' cache bound, timeouts and mount
/// path.
pub async fn serve(store: Store, settings: &Settings) -> Result<i32> {
    let cfg = strata_lazyfs::daemon::DaemonConfig {
        paths: paths(settings),
        cache_max_bytes: settings.cache_max,
        policy: strata_lazyfs::FetchPolicy {
            timeout: settings.fetch_timeout,
        },
        idle_detach: settings.idle_detach,
        erofs: settings.erofs_mount.source(),
    };
    strata_lazyfs::daemon::serve(cfg, store).await?;
    Ok(0)
}

/// Which daemon a call talks to. Only `layer mount` starts one; queries, unmounts and
/// stop talk to a running daemon or fail, so they never leave a daemon behind.
enum Reach {
    StartIfNeeded(Box<Settings>),
    Running(Paths),
}

fn running_client(paths: &Paths) -> Result<Client> {
    Client::connect(&paths.socket())
        .context("no lazyfs daemon is running (`strata layer mount` starts one)")
}

/// Runs a blocking client call off the async runtime.
async fn call(reach: Reach, req: Request) -> Result<Response> {
    tokio::task::spawn_blocking(move || -> Result<Response> {
        let mut c = match reach {
            Reach::StartIfNeeded(settings) => client(&settings)?,
            Reach::Running(paths) => running_client(&paths)?,
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

pub async fn mount(settings: &Settings, id: String, dir: PathBuf) -> Result<i32> {
    let dir = absolute(&dir)?;
    match call(
        Reach::StartIfNeeded(Box::new(settings.clone())),
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
pub async fn umount(settings: &Settings, dir: PathBuf) -> Result<i32> {
    let dir = absolute(&dir)?;
    call(Reach::Running(paths(settings)), Request::Umount { dir }).await?;
    Ok(0)
}

pub async fn stats(settings: &Settings, id: String, json: bool) -> Result<i32> {
    match call(Reach::Running(paths(settings)), Request::Stats { id }).await? {
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

pub async fn cache(settings: &Settings, cmd: CacheCommand) -> Result<i32> {
    let (req, json) = match cmd {
        CacheCommand::Stats { json } => (Request::CacheStats, json),
        CacheCommand::Prune { max_size } => (
            Request::Prune {
                max_bytes: max_size,
            },
            false,
        ),
    };
    match call(Reach::Running(paths(settings)), req).await? {
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

pub async fn stop(settings: &Settings) -> Result<i32> {
    let paths = paths(settings);
    if Client::connect(&paths.socket()).is_err() {
        eprintln!("no lazyfs daemon is running");
        return Ok(0);
    }
    call(Reach::Running(paths.clone()), Request::Shutdown).await?;
    // Returns once the daemon is gone, so a caller may clear its directories or start
    // another at once.
    strata_lazyfs::wait_stopped(&paths, Duration::from_secs(120))?;
    Ok(0)
}
