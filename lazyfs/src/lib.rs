//! lazyfs: serves layers from the store lazily. Each layer's metadata image is fetched whole
//! to local disk; its data blob is a FUSE file assembled on demand from verified chunks
//! through a bounded local cache. The kernel mounts EROFS file-backed on the image with the
//! blob as its device, once per layer per host; sandboxes get read-only binds of that mount.
//!
//! [`daemon`] owns the mounts and answers [`control`] requests; [`blob`] maps reads to
//! chunks; [`cache`] keeps chunks on disk; [`fuse`] exposes blobs; [`mounts`] wraps mount(2).

pub mod blob;
pub mod cache;
pub mod control;
pub mod daemon;
pub mod fuse;
pub mod mounts;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use strata_store::Digest;

pub use blob::{FetchPolicy, LayerStats};
pub use cache::CacheStats;
pub use control::{Attached, Client, Request, Response};

#[derive(Debug, thiserror::Error)]
pub enum LazyError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] strata_store::StoreError),
    #[error("{0}")]
    Chunk(String),
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("mount failed: {0}")]
    Mount(String),
    #[error("lazyfs configuration: {0}")]
    Config(String),
    #[error("lazyfs daemon: {0}")]
    Daemon(String),
    #[error("lazyfs control protocol: {0}")]
    Protocol(String),
}

impl LazyError {
    pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LazyError + '_ {
        move |source| LazyError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

/// Where the daemon keeps its files, all under one directory (`$STRATA_HOME/lazyfs`).
#[derive(Debug, Clone)]
pub struct Paths {
    pub root: PathBuf,
}

impl Paths {
    pub fn new(root: impl Into<PathBuf>) -> Paths {
        Paths { root: root.into() }
    }

    pub fn run_dir(&self) -> PathBuf {
        self.root.join("run")
    }
    pub fn socket(&self) -> PathBuf {
        self.run_dir().join("control.sock")
    }
    pub fn state_file(&self) -> PathBuf {
        self.run_dir().join("state.json")
    }
    pub fn log_file(&self) -> PathBuf {
        self.run_dir().join("daemon.log")
    }
    /// Held (flock) by the running daemon for as long as its process lives.
    pub fn lock_file(&self) -> PathBuf {
        self.run_dir().join("daemon.lock")
    }
    /// The FUSE mount point; blob files are `<fuse_dir>/<layer id>`.
    pub fn fuse_dir(&self) -> PathBuf {
        self.root.join("fuse")
    }
    pub fn blob_file(&self, id: &Digest) -> PathBuf {
        self.fuse_dir().join(id.to_hex())
    }
    pub fn mnt_dir(&self) -> PathBuf {
        self.root.join("mnt")
    }
    /// The layer's shared EROFS mount.
    pub fn layer_mount(&self, id: &Digest) -> PathBuf {
        self.mnt_dir().join(id.to_hex())
    }
    pub fn meta_dir(&self) -> PathBuf {
        self.root.join("meta")
    }
    pub fn meta_file(&self, digest: &Digest) -> PathBuf {
        self.meta_dir().join(format!("{digest}.erofs"))
    }
    pub fn cache_dir(&self) -> PathBuf {
        self.root.join("cache")
    }
}

/// Waits up to `wait` until no daemon holds the lock (one asked to shut down has finished
/// unmounting, saving and writing, and exited).
pub fn wait_stopped(paths: &Paths, wait: Duration) -> Result<(), LazyError> {
    use std::os::fd::AsRawFd;
    let lock = paths.lock_file();
    let deadline = Instant::now() + wait;
    loop {
        let Ok(f) = std::fs::File::open(&lock) else {
            return Ok(());
        };
        // SAFETY: flock on a valid fd; the probe's lock goes with `f`.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(LazyError::Daemon(format!(
                "the daemon holding {} did not exit within {wait:?}; see {}",
                lock.display(),
                paths.log_file().display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Connects to the daemon, starting it with `start` if nothing answers, and waits up to
/// `wait` for it to come up.
pub fn connect_or_start(
    paths: &Paths,
    wait: Duration,
    start: impl FnOnce() -> Result<(), LazyError>,
) -> Result<Client, LazyError> {
    if let Ok(mut c) = Client::connect(&paths.socket()) {
        if c.call(&Request::Ping).is_ok() {
            return Ok(c);
        }
    }
    start()?;
    let deadline = Instant::now() + wait;
    loop {
        if let Ok(mut c) = Client::connect(&paths.socket()) {
            if c.call(&Request::Ping).is_ok() {
                return Ok(c);
            }
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(paths.log_file()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(10).collect();
            return Err(LazyError::Daemon(format!(
                "did not come up within {wait:?}; last log lines:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
