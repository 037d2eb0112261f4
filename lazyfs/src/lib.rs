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
pub use control::{Attached, Client, ErrorKind, Request, Response};

/// What went wrong. The variants a control reply can carry (see [`ErrorKind`]) hold the
/// whole message, so an error crosses the socket unchanged.
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
    /// The store could not be reached (within the fetch bound).
    #[error("{0}")]
    Unavailable(String),
    /// A kernel mount or unmount failed.
    #[error("{0}")]
    Mount(String),
    #[error("lazyfs configuration: {0}")]
    Config(String),
    /// Starting, finding or stopping the daemon process failed.
    #[error("lazyfs daemon: {0}")]
    Daemon(String),
    /// The conversation with the daemon broke off or made no sense.
    #[error("lazyfs control protocol: {0}")]
    Protocol(String),
    /// The layer is not in the store, or not attached.
    #[error("{0}")]
    NotFound(String),
    /// The request itself is wrong (malformed, an ambiguous layer prefix).
    #[error("{0}")]
    Invalid(String),
    /// `Umount` of a directory that is not one of the daemon's binds.
    #[error("{0}")]
    NotBound(String),
    /// The mount is in use, or something else is mounted over it.
    #[error("{0}")]
    Busy(String),
    /// Any other failure inside the daemon, as it reported it.
    #[error("lazyfs daemon: {0}")]
    Internal(String),
    /// The state file was written by a newer lazyfs, in a format this build cannot read.
    #[error(
        "{path} is in lazyfs state format {found}, newer than this build reads (format \
         {supported}): a newer strata wrote it. Serve with that newer strata (it restores \
         the binds listed there; `strata lazyfs stop` releases them), or upgrade this one; \
         or unmount the binds it lists and remove the file"
    )]
    StateFormat {
        path: String,
        found: u64,
        supported: u64,
    },
    /// The state file cannot be read or decoded.
    #[error(
        "{path}: {reason}. It lists the binds a daemon made; unmount them and remove the \
         file to start afresh"
    )]
    State { path: String, reason: String },
}

impl LazyError {
    pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> LazyError + '_ {
        move |source| LazyError::Io {
            path: path.display().to_string(),
            source,
        }
    }

    /// The error's kind, as a control reply carries it.
    pub fn kind(&self) -> ErrorKind {
        use strata_store::StoreError as S;
        match self {
            LazyError::NotFound(_) | LazyError::Store(S::LayerNotFound(_)) => ErrorKind::NotFound,
            LazyError::Invalid(_) | LazyError::Store(S::AmbiguousLayer { .. }) => {
                ErrorKind::Invalid
            }
            LazyError::NotBound(_) => ErrorKind::NotBound,
            LazyError::Unavailable(_) | LazyError::Store(S::Backend { .. }) => {
                ErrorKind::Unavailable
            }
            LazyError::Mount(_) => ErrorKind::Mount,
            LazyError::Busy(_) | LazyError::Store(S::Busy(_)) => ErrorKind::Busy,
            _ => ErrorKind::Internal,
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
    /// The binds made and undone since the state file was last written, one per line.
    pub fn state_journal(&self) -> PathBuf {
        self.run_dir().join("state.journal")
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

/// Makes the daemon's run directory (control socket, state, log, lock) private to the
/// daemon's user (root): created mode 0700, or, if it exists, checked to be a real
/// directory of that user and its mode narrowed to 0700. Called before anything in it is
/// made, so no other user can reach the control socket even for the moment between its
/// `bind` and its `chmod`. A symlink, a non-directory or another user's directory is
/// refused: whatever is in it was under someone else's control.
pub fn prepare_run_dir(paths: &Paths) -> Result<PathBuf, LazyError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
    let dir = paths.run_dir();
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(LazyError::io(parent))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(LazyError::io(&dir)(e)),
    }
    // Checked and fixed through one descriptor, so the path cannot be swapped in between.
    let handle = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&dir)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::ENOTDIR) => LazyError::Config(format!(
                "{} must be a directory, not a symlink or a file; remove it (the daemon \
                 creates it)",
                dir.display()
            )),
            _ => LazyError::io(&dir)(e),
        })?;
    let meta = handle.metadata().map_err(LazyError::io(&dir))?;
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != euid {
        return Err(LazyError::Config(format!(
            "{} belongs to uid {}, not to the daemon's user (uid {euid}), so another user \
             could reach the control socket; remove it (the daemon creates it)",
            dir.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o7777 != 0o700 {
        handle
            .set_permissions(std::fs::Permissions::from_mode(0o700))
            .map_err(LazyError::io(&dir))?;
        tracing::info!(
            dir = %dir.display(),
            was = format!("{:o}", meta.mode() & 0o7777),
            "narrowed the run directory to mode 0700"
        );
    }
    Ok(dir)
}

/// Waits up to `wait` until no daemon holds the lock (one asked to shut down has finished
/// unmounting, saving and writing, and exited).
pub fn wait_stopped(paths: &Paths, wait: Duration) -> Result<(), LazyError> {
    let lock = paths.lock_file();
    let deadline = Instant::now() + wait;
    loop {
        let Ok(f) = std::fs::File::open(&lock) else {
            return Ok(());
        };
        // The probe's lock goes with `f`.
        if strata_host::fs::flock(&f, strata_host::fs::Lock::Shared, false).unwrap_or(false) {
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
    start: impl FnOnce() -> Result<Option<std::process::Child>, LazyError>,
) -> Result<Client, LazyError> {
    if let Ok(mut c) = Client::connect(&paths.socket()) {
        if c.call(&Request::Ping).is_ok() {
            return Ok(c);
        }
    }
    let mut started = start()?;
    let mut deadline = Instant::now() + wait;
    // A daemon comes up in a few tens of milliseconds: polled often at first, so a start
    // does not wait out most of a 20 ms sleep after it is ready (a failed connect costs
    // microseconds).
    let quick_until = Instant::now() + Duration::from_millis(500);
    let mut exited = None;
    loop {
        if let Ok(mut c) = Client::connect(&paths.socket()) {
            if c.call(&Request::Ping).is_ok() {
                return Ok(c);
            }
        }
        // The daemon we started ended: another one started at the same moment may still
        // be coming up (a loser of that race exits), so wait a little for it, not the
        // whole bound.
        if exited.is_none() {
            if let Some(status) = started.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                exited = Some(status);
                deadline = deadline.min(Instant::now() + Duration::from_secs(2));
            }
        }
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(paths.log_file()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(10).collect();
            let tail = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
            return Err(LazyError::Daemon(match exited {
                Some(status) => format!(
                    "exited as it started ({status}); last lines of {}:\n{tail}",
                    paths.log_file().display()
                ),
                None => format!("did not come up within {wait:?}; last log lines:\n{tail}"),
            }));
        }
        std::thread::sleep(if Instant::now() < quick_until {
            Duration::from_millis(2)
        } else {
            Duration::from_millis(20)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn the_run_directory_is_made_private_and_a_wider_one_is_narrowed() {
        let tmp = tempfile::tempdir().unwrap();
        let paths = Paths::new(tmp.path().join("lazyfs"));
        let dir = prepare_run_dir(&paths).unwrap();
        assert_eq!(dir, paths.run_dir());
        assert_eq!(mode(&dir), 0o700);

        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        prepare_run_dir(&paths).unwrap();
        assert_eq!(mode(&dir), 0o700, "a wider mode is narrowed");
    }

    #[test]
    fn a_run_directory_that_is_a_symlink_or_a_file_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o755)).unwrap();
        let paths = Paths::new(tmp.path().join("lazyfs"));
        std::fs::create_dir(&paths.root).unwrap();
        std::os::unix::fs::symlink(&elsewhere, paths.run_dir()).unwrap();
        let e = prepare_run_dir(&paths).unwrap_err();
        assert!(matches!(e, LazyError::Config(_)), "{e:?}");
        assert!(e.to_string().contains("symlink"), "{e}");
        assert_eq!(mode(&elsewhere), 0o755, "the link's target is left alone");

        std::fs::remove_file(paths.run_dir()).unwrap();
        std::fs::write(paths.run_dir(), b"").unwrap();
        assert!(matches!(
            prepare_run_dir(&paths).unwrap_err(),
            LazyError::Config(_)
        ));
    }
}
