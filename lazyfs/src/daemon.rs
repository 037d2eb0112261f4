//! The lazyfs daemon: owns the FUSE mount, the chunk cache, the attached layers and their
//! shared EROFS mounts, and answers the control socket. On start it reaps what a crashed
//! predecessor left (dead FUSE mount, EROFS and bind mounts on it) and restores its binds.
//!
//! Its run directory is private to root (0700) before the socket is bound; `Umount` only
//! undoes binds the daemon recorded; the state file carries a format version, and a
//! journal beside it the binds made and undone since it was written.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use strata_store::{Digest, Store};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixListener;

use crate::blob::{FetchPolicy, LayerBlob};
use crate::cache::ChunkCache;
use crate::control::{Attached, Request, Response};
use crate::fuse::{BlobFs, Layers};
use crate::{mounts, LazyError, Paths};

/// The kernel reads the blob files ahead by 128 KiB by default; EROFS reading a large
/// file sequentially then costs one FUSE round trip per 128 KiB. A wider window (the
/// FUSE mount's backing device setting) lets the kernel ask for more at a time, but not
/// too wide: small files of one directory lie side by side in the blob, so a program
/// opening them (Python importing its modules) reads the blob almost in order and the
/// window grows to its maximum, asking for data nobody reads. Measured on the first
/// Python start of the Debian base (`bench` lazyfs and remote suites, alternating runs):
/// 4 MiB asked for 36-44 MB where 512 KiB asked for 24-27 MB (128 KiB: 21-22), and the
/// start took 0.40 s against 0.35 s from a local store, 0.80 s against 0.69 s from
/// radosgw at +2 ms; sequential reads of a large file were no slower (warm 767-774 MB/s
/// against 720-776).
fn widen_readahead(fuse_dir: &std::path::Path) {
    use std::os::unix::fs::MetadataExt;
    const READAHEAD_KB: u32 = 512;
    let Ok(meta) = std::fs::metadata(fuse_dir) else {
        return;
    };
    let dev = meta.dev();
    let knob = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        libc::major(dev),
        libc::minor(dev)
    );
    if let Err(e) = std::fs::write(&knob, READAHEAD_KB.to_string()) {
        tracing::debug!(%knob, error = %e, "could not widen the blob readahead");
    }
}

/// Daemon settings.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub paths: Paths,
    pub cache_max_bytes: u64,
    pub policy: FetchPolicy,
    /// How long a layer stays attached after its last bind goes: sandboxes come and go in
    /// bursts, and re-attaching a large layer (manifest, metadata check, chunk table, EROFS
    /// mount) costs milliseconds each time.
    pub idle_detach: std::time::Duration,
    /// How layers' EROFS images are mounted; `None`: probe the kernel once at start.
    pub erofs: Option<mounts::ErofsSource>,
}

/// The state file's format. 0 (no `format` field, daemons before versioning) has the same
/// shape and is read as is; a newer one is refused, never dropped.
pub const STATE_FORMAT: u64 = 1;

/// Bind mounts made for clients, per layer; persisted so a restarted daemon restores them.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct State {
    /// [`STATE_FORMAT`] when written.
    #[serde(default)]
    format: u64,
    binds: BTreeMap<String, BTreeSet<PathBuf>>,
}

/// One change to the binds: a line of the journal.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Change {
    Bind(String, PathBuf),
    Unbind(String, PathBuf),
}

impl State {
    fn apply(&mut self, change: &Change) {
        match change {
            Change::Bind(id, dir) => {
                self.binds
                    .entry(id.clone())
                    .or_default()
                    .insert(dir.clone());
            }
            Change::Unbind(id, dir) => {
                if let Some(dirs) = self.binds.get_mut(id) {
                    dirs.remove(dir);
                    if dirs.is_empty() {
                        self.binds.remove(id);
                    }
                }
            }
        }
    }

    fn len(&self) -> usize {
        self.binds.values().map(BTreeSet::len).sum()
    }
}

/// A journal shorter than this is never compacted.
const JOURNAL_MIN_LINES: usize = 256;

/// The state on disk: the state file, written whole now and then, and the journal of
/// changes since, one line appended per bind or unbind. Rewriting every bind at every
/// change cost each sandbox's create and destroy time in proportion to the sandboxes
/// already up (two rewrites of a thousand binds each with a thousand up).
struct StateLog {
    paths: Paths,
    journal: Option<std::fs::File>,
    lines: usize,
}

impl StateLog {
    /// The state on disk under `paths` (the journal opened at the first change).
    fn new(paths: Paths) -> StateLog {
        StateLog {
            paths,
            journal: None,
            lines: 0,
        }
    }

    /// Records `change`, already applied to `state`: a line appended to the journal, or
    /// the whole state written once the journal is twice as long as the state it changes.
    fn record(&mut self, change: &Change, state: &State) {
        if self.lines >= JOURNAL_MIN_LINES.max(2 * state.len()) {
            return self.write(state);
        }
        let path = self.paths.state_journal();
        if self.journal.is_none() {
            self.journal = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|e| tracing::warn!(path = %path.display(), error = %e, "could not open the state journal"))
                .ok();
        }
        let Some(file) = self.journal.as_mut() else {
            return self.write(state);
        };
        let mut line = match serde_json::to_vec(change) {
            Ok(l) => l,
            Err(e) => return tracing::warn!(error = %e, "could not encode a bind change"),
        };
        line.push(b'\n');
        // One write of an append-only file: a crash leaves the line whole or unfinished.
        match std::io::Write::write_all(file, &line) {
            Ok(()) => self.lines += 1,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not append to the state journal");
                self.write(state);
            }
        }
    }

    /// Writes the whole state, then empties the journal (whose changes it holds).
    fn write(&mut self, state: &State) {
        let path = self.paths.state_file();
        let tmp = path.with_extension("tmp");
        let written = serde_json::to_vec_pretty(state)
            .map_err(std::io::Error::other)
            .and_then(|body| std::fs::write(&tmp, body))
            .and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            // The journal still holds every change since the last state file.
            return tracing::warn!(path = %path.display(), error = %e, "could not save daemon state");
        }
        let journal = self.paths.state_journal();
        let emptied = match self.journal.as_ref() {
            Some(f) => f.set_len(0),
            None => match std::fs::remove_file(&journal) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                other => other,
            },
        };
        match emptied {
            Ok(()) => self.lines = 0,
            Err(e) => {
                tracing::warn!(path = %journal.display(), error = %e, "could not empty the state journal")
            }
        }
    }
}

impl Default for State {
    fn default() -> State {
        State {
            format: STATE_FORMAT,
            binds: BTreeMap::new(),
        }
    }
}

/// Reads the state: the state file (none, or an empty one, a crash before its first write
/// reached the disk, is an empty state) and the journal's changes since.
fn read_state(paths: &Paths) -> Result<State, LazyError> {
    let path = paths.state_file();
    let mut state = match std::fs::read(&path) {
        Ok(b) => decode_state(&path, &b)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => State::default(),
        Err(e) => {
            return Err(LazyError::State {
                path: path.display().to_string(),
                reason: e.to_string(),
            })
        }
    };
    let journal = paths.state_journal();
    match std::fs::read(&journal) {
        Ok(b) => replay(&journal, &b, &mut state)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(LazyError::State {
                path: journal.display().to_string(),
                reason: e.to_string(),
            })
        }
    }
    Ok(state)
}

/// Applies the journal's lines to `state`, in order. Replaying a change the state file
/// already holds changes nothing (a crash between a new state file and the journal's
/// truncation), and an unfinished last line is a crash midway through its write: skipped.
fn replay(path: &Path, bytes: &[u8], state: &mut State) -> Result<(), LazyError> {
    let lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    // Text after the last newline (none when the journal ends in one) is unfinished.
    let finished = lines.len() - 1;
    for (i, line) in lines.into_iter().enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<Change>(line) {
            Ok(change) => state.apply(&change),
            Err(_) if i == finished => {
                tracing::warn!(path = %path.display(), "the journal's last line is unfinished; skipped")
            }
            Err(e) => {
                return Err(LazyError::State {
                    path: path.display().to_string(),
                    reason: format!("line {} is not a bind change ({e})", i + 1),
                })
            }
        }
    }
    Ok(())
}

/// Decodes a state file of the current or the older (unversioned) format; a newer format
/// or an undecodable file is an error that says what to do.
fn decode_state(path: &Path, bytes: &[u8]) -> Result<State, LazyError> {
    #[derive(Deserialize)]
    struct Version {
        #[serde(default)]
        format: u64,
    }
    if bytes.iter().all(u8::is_ascii_whitespace) {
        tracing::warn!(path = %path.display(), "the state file is empty; no binds to restore");
        return Ok(State::default());
    }
    let bad = |e: serde_json::Error| LazyError::State {
        path: path.display().to_string(),
        reason: format!("not a lazyfs state file ({e})"),
    };
    let version: Version = serde_json::from_slice(bytes).map_err(bad)?;
    if version.format > STATE_FORMAT {
        return Err(LazyError::StateFormat {
            path: path.display().to_string(),
            found: version.format,
            supported: STATE_FORMAT,
        });
    }
    let mut state: State = serde_json::from_slice(bytes).map_err(bad)?;
    // Written back in the current format from now on.
    state.format = STATE_FORMAT;
    Ok(state)
}

fn poisoned<T>(_: T) -> LazyError {
    LazyError::Internal("state lock poisoned".into())
}

struct Daemon {
    cfg: DaemonConfig,
    store: Store,
    cache: Arc<ChunkCache>,
    layers: Arc<Layers>,
    /// Layers that had no prefetch list when attached: their access order is saved.
    recording: Mutex<BTreeSet<Digest>>,
    state: Mutex<State>,
    /// Where `state` is kept on disk; locked inside `state`'s lock.
    log: Mutex<StateLog>,
    /// Serializes attach/detach so two clients do not mount one layer twice.
    attach_lock: tokio::sync::Mutex<()>,
    /// How this kernel mounts the layers' images (probed once at start).
    erofs: mounts::ErofsSource,
    rt: tokio::runtime::Handle,
}

/// Unmounts everything under the daemon's directories and every bind recorded in `state`,
/// deepest first, lazily (their FUSE backing may be dead, and a lazy unmount never hangs).
fn reap_stale(paths: &Paths, state: &State) {
    let Ok(all) = mounts::mounts() else { return };
    let recorded: BTreeSet<&PathBuf> = state.binds.values().flatten().collect();
    let ours = |m: &mounts::MountEntry| {
        m.mount_point.starts_with(&paths.root)
            || recorded.contains(&m.mount_point)
            || (m.fstype == "erofs" && mounts::erofs_source_under(&m.source, &paths.root))
    };
    for m in all.iter().rev().filter(|m| ours(m)) {
        match mounts::unmount(&m.mount_point, true) {
            Ok(()) => {
                tracing::info!(mount = %m.mount_point.display(), fstype = %m.fstype, "reaped a stale mount")
            }
            Err(e) => {
                tracing::warn!(mount = %m.mount_point.display(), error = %e, "could not reap a stale mount")
            }
        }
    }
}

impl Daemon {
    /// Writes the whole state (and empties the journal).
    fn save_state(&self) {
        let Ok(st) = self.state.lock() else { return };
        if let Ok(mut log) = self.log.lock() {
            log.write(&st);
        }
    }

    /// Applies `change` to the binds and records it on disk.
    fn change(&self, change: Change) {
        let Ok(mut st) = self.state.lock() else {
            return;
        };
        st.apply(&change);
        if let Ok(mut log) = self.log.lock() {
            log.record(&change, &st);
        }
    }

    async fn attach(&self, text: &str) -> Result<Attached, LazyError> {
        let _g = self.attach_lock.lock().await;
        self.attach_locked(text).await
    }

    /// Attaches with `attach_lock` held by the caller: attach, bind and detach of one layer
    /// must not interleave, or a detach could pull the mount from under a new bind.
    async fn attach_locked(&self, text: &str) -> Result<Attached, LazyError> {
        let id = self.store.resolve_layer(text).await?;
        let paths = &self.cfg.paths;
        let mount = paths.layer_mount(&id);
        if let Some(b) = self.layers.get(&id) {
            if mounts::is_mount_point(&mount) {
                return Ok(self.attached(&b));
            }
        }
        // The prefetch list needs only the ID: asked for alongside the manifest, it costs
        // a remote store no round trip of its own.
        let (manifest, prefetch) =
            tokio::join!(self.store.get_layer(&id), self.store.get_prefetch(&id));
        let manifest = manifest?;
        // The metadata image is fetched whole, verified, and kept on local disk: the
        // kernel reads it synchronously in 4 KiB pieces, which must never wait on a store.
        let meta_path = paths.meta_file(&manifest.metadata.digest);
        let have =
            std::fs::read(&meta_path).is_ok_and(|b| Digest::of(&b) == manifest.metadata.digest);
        if !have {
            let bytes = self.store.get_metadata(&manifest.metadata).await?;
            let tmp = meta_path.with_extension("tmp");
            std::fs::write(&tmp, &bytes).map_err(LazyError::io(&tmp))?;
            std::fs::rename(&tmp, &meta_path).map_err(LazyError::io(&meta_path))?;
        }
        self.cache.attach(&manifest)?;
        let blob = Arc::new(LayerBlob::new(
            manifest,
            self.store.clone(),
            self.cache.clone(),
            self.cfg.policy,
            self.rt.clone(),
        ));
        let blob = self.layers.add(blob);
        match prefetch {
            Ok(Some(list)) => blob.prefetch(list),
            Ok(None) => {
                if let Ok(mut r) = self.recording.lock() {
                    r.insert(id);
                }
            }
            Err(e) => tracing::warn!(layer = %id, error = %e, "could not read the prefetch list"),
        }
        std::fs::create_dir_all(&mount).map_err(LazyError::io(&mount))?;
        if !mounts::is_mount_point(&mount) {
            let device = (blob.size() > 0).then(|| paths.blob_file(&id));
            let (m, d, t) = (meta_path.clone(), device.clone(), mount.clone());
            let source = self.erofs;
            tokio::task::spawn_blocking(move || mounts::mount_erofs(&m, d.as_deref(), &t, source))
                .await
                .map_err(|e| LazyError::Internal(format!("mount task: {e}")))?
                .map_err(|e| {
                    LazyError::Mount(format!(
                        "EROFS mount of layer {id} at {}: {e}",
                        mount.display()
                    ))
                })?;
        }
        Ok(self.attached(&blob))
    }

    /// Attaches a layer and binds it read-only at `dir` (recorded); the caller holds
    /// `attach_lock`.
    async fn bind_locked(&self, id: &str, dir: PathBuf) -> Result<Attached, LazyError> {
        std::fs::create_dir_all(&dir).map_err(LazyError::io(&dir))?;
        self.bind_existing_locked(id, dir).await
    }

    /// [`Daemon::bind_locked`] at a directory that must exist already (a restored bind:
    /// its client may have gone while no daemon ran, and its directory with it).
    async fn bind_existing_locked(&self, id: &str, dir: PathBuf) -> Result<Attached, LazyError> {
        let dir = std::fs::canonicalize(&dir).map_err(LazyError::io(&dir))?;
        let t = std::time::Instant::now();
        let a = self.attach_locked(id).await?;
        let t_attach = t.elapsed();
        mounts::bind_readonly(&a.mount, &dir)
            .map_err(|e| LazyError::Mount(format!("bind mount at {}: {e}", dir.display())))?;
        tracing::debug!(
            layer = id,
            attach_ms = t_attach.as_secs_f64() * 1e3,
            bind_ms = (t.elapsed() - t_attach).as_secs_f64() * 1e3,
            "bound"
        );
        self.change(Change::Bind(a.id.clone(), dir));
        Ok(a)
    }

    fn attached(&self, b: &LayerBlob) -> Attached {
        let id = b.id();
        let p = &self.cfg.paths;
        Attached {
            id: id.to_hex(),
            meta_path: p.meta_file(&b.manifest.metadata.digest),
            blob_path: (b.size() > 0).then(|| p.blob_file(&id)),
            mount: p.layer_mount(&id),
        }
    }

    /// Detaches a layer no bind uses any more; the caller holds `attach_lock`.
    async fn detach_locked(&self, id: &Digest) {
        let still_bound = self
            .state
            .lock()
            .map(|st| st.binds.get(&id.to_hex()).is_some_and(|d| !d.is_empty()))
            .unwrap_or(true);
        if still_bound {
            return;
        }
        let mount = self.cfg.paths.layer_mount(id);
        if let Err(e) = mounts::unmount(&mount, false) {
            // Busy (a sandbox still uses it): keep serving, try again at the next detach.
            tracing::info!(layer = %id, error = %e, "layer mount is busy; keeping it");
            return;
        }
        let _ = std::fs::remove_dir(&mount);
        self.save_prefetch(id).await;
        self.layers.remove(id);
    }

    async fn save_prefetch(&self, id: &Digest) {
        let recording = self
            .recording
            .lock()
            .map(|mut r| r.remove(id))
            .unwrap_or(false);
        if !recording {
            return;
        }
        let Some(b) = self.layers.get(id) else { return };
        let order = b.access_order();
        if order.is_empty() {
            return;
        }
        // The chunks themselves too, packed in this order, while the cache has them all.
        let data = {
            let (b, order) = (b.clone(), order.clone());
            tokio::task::spawn_blocking(move || b.cached_chunks(&order))
                .await
                .ok()
                .flatten()
        };
        let packed = data.is_some();
        match self.store.put_prefetch(id, &order, data.as_deref()).await {
            Ok(()) => {
                tracing::info!(layer = %id, chunks = order.len(), packed, "saved prefetch list")
            }
            Err(e) => tracing::warn!(layer = %id, error = %e, "could not save prefetch list"),
        }
    }

    /// Unmounts the recorded bind of layer `id` at `dir`, if the topmost mount there is
    /// still it; one already gone is fine. The check is two `statx` calls (the bind is the
    /// layer's shared EROFS mount when both are mount roots of the same device), not a scan
    /// of the host's mount table, whose cost grows with every sandbox on the node.
    fn unbind(&self, id: &str, dir: &Path) -> Result<(), LazyError> {
        let shared = id
            .parse::<Digest>()
            .ok()
            .map(|d| self.cfg.paths.layer_mount(&d));
        match (
            strata_host::fs::mount_root(dir),
            shared.map(|s| strata_host::fs::mount_root(&s)),
        ) {
            (Err(e), _) if e.kind() == std::io::ErrorKind::NotFound => {
                tracing::info!(dir = %dir.display(), "the bind is gone; forgetting it");
                return Ok(());
            }
            (Ok((false, _)), _) => {
                tracing::info!(dir = %dir.display(), "the bind is already unmounted; forgetting it");
                return Ok(());
            }
            (Ok((true, dev)), Some(Ok((true, shared_dev)))) if dev == shared_dev => {
                return self.unmount_bind(dir);
            }
            // Something else on top (refused below, naming it), a kernel without mount
            // roots in statx, or the shared mount missing: read the mount table.
            _ => {}
        }
        let all = mounts::mounts().map_err(LazyError::io(Path::new("/proc/self/mountinfo")))?;
        let Some(top) = all.into_iter().rev().find(|m| m.mount_point == dir) else {
            tracing::info!(dir = %dir.display(), "the bind is already unmounted; forgetting it");
            return Ok(());
        };
        if top.fstype != "erofs" || !mounts::erofs_source_under(&top.source, &self.cfg.paths.root) {
            return Err(LazyError::Busy(format!(
                "{}: a {} mount of {} is over the lazyfs bind; unmount it first",
                dir.display(),
                top.fstype,
                top.source
            )));
        }
        self.unmount_bind(dir)
    }

    fn unmount_bind(&self, dir: &Path) -> Result<(), LazyError> {
        mounts::unmount(dir, false).map_err(|e| {
            let msg = format!("unmounting {}: {e}", dir.display());
            if e.raw_os_error() == Some(libc::EBUSY) {
                LazyError::Busy(msg)
            } else {
                LazyError::Mount(msg)
            }
        })
    }

    async fn handle(self: &Arc<Self>, req: Request) -> Result<Response, LazyError> {
        match req {
            Request::Ping => Ok(Response::Pong {
                pid: std::process::id(),
                store: self.store.describe(),
            }),
            Request::Attach { id } => Ok(Response::Attached(self.attach(&id).await?)),
            Request::Mount { id, dir } => {
                let _g = self.attach_lock.lock().await;
                Ok(Response::Attached(self.bind_locked(&id, dir).await?))
            }
            Request::MountMany { binds } => {
                let _g = self.attach_lock.lock().await;
                let mut done = Vec::with_capacity(binds.len());
                let mut failed = None;
                for (id, dir) in binds {
                    match self.bind_locked(&id, dir).await {
                        Ok(a) => done.push(a),
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                match failed {
                    None => Ok(Response::AttachedMany { layers: done }),
                    Some(e) => Err(e),
                }
            }
            Request::Umount { dir } => {
                let _g = self.attach_lock.lock().await;
                let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
                let id = self
                    .state
                    .lock()
                    .map_err(poisoned)?
                    .binds
                    .iter()
                    .find(|(_, dirs)| dirs.contains(&dir))
                    .map(|(id, _)| id.clone())
                    .ok_or_else(|| {
                        LazyError::NotBound(format!(
                            "{} is not a lazyfs bind: this daemon bound no layer there, so \
                             it leaves whatever is mounted there alone",
                            dir.display()
                        ))
                    })?;
                self.unbind(&id, &dir)?;
                self.change(Change::Unbind(id.clone(), dir));
                let emptied = {
                    let st = self.state.lock().map_err(poisoned)?;
                    (!st.binds.contains_key(&id)).then_some(id)
                };
                if let Some(id) = emptied.and_then(|i| i.parse::<Digest>().ok()) {
                    // The access order is saved now, so the list is in the store once the
                    // last umount returns; the mount itself stays for `idle_detach`.
                    self.save_prefetch(&id).await;
                    let grace = self.cfg.idle_detach;
                    if grace.is_zero() {
                        self.detach_locked(&id).await;
                    } else {
                        let daemon = self.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(grace).await;
                            let _g = daemon.attach_lock.lock().await;
                            daemon.detach_locked(&id).await;
                        });
                    }
                }
                Ok(Response::Done)
            }
            Request::Stats { id } => {
                let id = self.store.resolve_layer(&id).await?;
                let b = self.layers.get(&id).ok_or_else(|| {
                    LazyError::NotFound(format!("layer {id} is not attached (mount it first)"))
                })?;
                Ok(Response::Stats(b.stats()))
            }
            Request::CacheStats => Ok(Response::CacheStats(self.cache.stats())),
            Request::Prune { max_bytes } => {
                self.cache.prune(max_bytes);
                Ok(Response::CacheStats(self.cache.stats()))
            }
            Request::Shutdown => Ok(Response::Done),
        }
    }

    /// Unmounts every bind and layer, saves prefetch lists. FUSE goes last (its session drop).
    async fn shutdown(&self) {
        let binds: Vec<PathBuf> = self
            .state
            .lock()
            .map(|st| st.binds.values().flatten().cloned().collect())
            .unwrap_or_default();
        for d in binds {
            if let Err(e) = mounts::unmount(&d, true) {
                tracing::warn!(dir = %d.display(), error = %e, "could not unmount");
            }
        }
        if let Ok(mut st) = self.state.lock() {
            st.binds.clear();
        }
        self.save_state();
        for b in self.layers.all() {
            let id = b.id();
            let _ = mounts::unmount(&self.cfg.paths.layer_mount(&id), true);
            let _ = std::fs::remove_dir(self.cfg.paths.layer_mount(&id));
            self.save_prefetch(&id).await;
        }
    }
}

/// Runs the daemon until it is asked to shut down or gets SIGTERM/SIGINT.
pub async fn serve(cfg: DaemonConfig, store: Store) -> Result<(), LazyError> {
    // Private before anything is made in it (lock, state, socket).
    crate::prepare_run_dir(&cfg.paths)?;
    // Mount points in /proc/self/mountinfo are canonical; so must ours be to find them.
    let mut cfg = cfg;
    cfg.paths.root =
        std::fs::canonicalize(&cfg.paths.root).map_err(LazyError::io(&cfg.paths.root))?;
    let paths = cfg.paths.clone();
    let lock = paths.lock_file();
    let lock_file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock)
        .map_err(LazyError::io(&lock))?;
    // Without waiting, so a second daemon fails at once.
    if !strata_host::fs::flock(&lock_file, strata_host::fs::Lock::Exclusive, false)
        .map_err(LazyError::io(&lock))?
    {
        return Err(LazyError::Daemon(format!(
            "another lazyfs daemon holds {}; use it or stop it first",
            lock.display()
        )));
    }
    let state = read_state(&paths)?;
    // Reap before touching the other directories: a dead FUSE mount point fails stat
    // with ENOTCONN.
    reap_stale(&paths, &state);
    for d in [paths.fuse_dir(), paths.mnt_dir(), paths.meta_dir()] {
        std::fs::create_dir_all(&d).map_err(LazyError::io(&d))?;
    }
    let erofs = match cfg.erofs {
        Some(chosen) => chosen,
        None => strata_host::erofs_file_backed(&paths.meta_dir())
            .map_err(|e| LazyError::Mount(format!("probing how this kernel mounts EROFS: {e}")))?,
    };
    tracing::info!(
        erofs = match erofs {
            mounts::ErofsSource::File => "file-backed",
            mounts::ErofsSource::Loop => "through loop devices",
        },
        "layer images mount"
    );

    let cache = Arc::new(ChunkCache::open(&paths.cache_dir(), cfg.cache_max_bytes)?);
    let layers = Arc::new(Layers::default());
    let mut fuse_cfg = fuser::Config::default();
    fuse_cfg.mount_options = vec![
        fuser::MountOption::RO,
        fuser::MountOption::FSName("strata-lazyfs".into()),
        fuser::MountOption::Subtype("strata-lazyfs".into()),
    ];
    fuse_cfg.n_threads = Some(8);
    let session = fuser::spawn_mount(BlobFs::new(layers.clone()), paths.fuse_dir(), &fuse_cfg)
        .map_err(|e| {
            LazyError::Mount(format!("FUSE mount at {}: {e}", paths.fuse_dir().display()))
        })?;

    widen_readahead(&paths.fuse_dir());

    let daemon = Arc::new(Daemon {
        cfg,
        store,
        cache,
        layers,
        recording: Mutex::new(BTreeSet::new()),
        state: Mutex::new(State::default()),
        log: Mutex::new(StateLog::new(paths.clone())),
        attach_lock: tokio::sync::Mutex::new(()),
        erofs,
        rt: tokio::runtime::Handle::current(),
    });

    // Restore the binds a crashed daemon had made, where their directories still are: a
    // client that ended while no daemon ran (a sandbox destroyed meanwhile, its binds
    // detached by its teardown) took its directory with it, and must not get it back.
    for (id, dirs) in state.binds {
        for dir in dirs {
            let restored = {
                let _g = daemon.attach_lock.lock().await;
                daemon.bind_existing_locked(&id, dir.clone()).await
            };
            match restored {
                Ok(_) => tracing::info!(layer = %id, dir = %dir.display(), "restored mount"),
                Err(e) => {
                    tracing::info!(layer = %id, dir = %dir.display(), error = %e, "not restoring a bind")
                }
            }
        }
    }
    daemon.save_state();

    let socket = paths.socket();
    let _ = std::fs::remove_file(&socket);
    let listener = strata_host::unix::bind(&socket)
        .and_then(|l| {
            l.set_nonblocking(true)?;
            UnixListener::from_std(l)
        })
        .map_err(LazyError::io(&socket))?;
    // Only root (the mounting user) may drive mounts.
    let _ = std::fs::set_permissions(&socket, std::os::unix::fs::PermissionsExt::from_mode(0o600));
    tracing::info!(socket = %socket.display(), "lazyfs daemon ready");
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| LazyError::Daemon(format!("signal handler: {e}")))?;
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((conn, _)) = accepted else { continue };
                let daemon = daemon.clone();
                let stop_tx = stop_tx.clone();
                tokio::spawn(async move {
                    let (r, mut w) = conn.into_split();
                    let mut lines = BufReader::new(r).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        let (resp, stop) = match serde_json::from_str::<Request>(&line) {
                            Ok(req) => {
                                let stop = matches!(req, Request::Shutdown);
                                let resp = daemon.handle(req).await.unwrap_or_else(|e| Response::error(&e));
                                (resp, stop)
                            }
                            Err(e) => (Response::error(&LazyError::Invalid(format!("bad request: {e}"))), false),
                        };
                        let mut out = serde_json::to_string(&resp).unwrap_or_else(|_| "{\"kind\":\"error\",\"code\":\"internal\",\"message\":\"encode\"}".into());
                        out.push('\n');
                        if w.write_all(out.as_bytes()).await.is_err() {
                            break;
                        }
                        if stop {
                            let _ = stop_tx.send(true);
                        }
                    }
                });
            }
            _ = stop_rx.changed() => break,
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    tracing::info!("lazyfs daemon stopping");
    daemon.shutdown().await;
    let _ = std::fs::remove_file(&socket);
    drop(session);
    let _ = mounts::unmount(&paths.fuse_dir(), true);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binds(state: &State) -> Vec<(String, PathBuf)> {
        state
            .binds
            .iter()
            .flat_map(|(id, dirs)| dirs.iter().map(move |d| (id.clone(), d.clone())))
            .collect()
    }

    #[test]
    fn state_files_of_the_old_and_the_current_format_are_read() {
        let path = Path::new("/run/state.json");
        // Unversioned: what daemons wrote before the format field.
        let old = br#"{"binds": {"ab12": ["/s/1/layers/0", "/s/2/layers/0"]}}"#;
        let st = decode_state(path, old).unwrap();
        assert_eq!(
            st.format, STATE_FORMAT,
            "read in, written in the current format"
        );
        assert_eq!(
            binds(&st),
            [
                ("ab12".to_string(), PathBuf::from("/s/1/layers/0")),
                ("ab12".to_string(), PathBuf::from("/s/2/layers/0"))
            ]
        );

        // What this build writes carries its format and reads back the same.
        let written = serde_json::to_vec_pretty(&st).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&written).unwrap();
        assert_eq!(v["format"], STATE_FORMAT, "{v}");
        assert_eq!(decode_state(path, &written).unwrap(), st);
        assert_eq!(
            serde_json::to_value(State::default()).unwrap()["format"],
            STATE_FORMAT
        );

        // None, or empty: nothing to restore.
        assert_eq!(decode_state(path, b" \n").unwrap(), State::default());
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            read_state(&Paths::new(dir.path())).unwrap(),
            State::default()
        );
    }

    #[test]
    fn a_newer_or_undecodable_state_file_is_refused_saying_what_to_do() {
        let path = Path::new("/h/lazyfs/run/state.json");
        let newer = format!(
            r#"{{"format": {}, "binds": {{"ab12": ["/s/1"]}}, "leases": []}}"#,
            STATE_FORMAT + 1
        );
        let e = decode_state(path, newer.as_bytes()).unwrap_err();
        assert!(
            matches!(e, LazyError::StateFormat { found, supported, .. }
                if found == STATE_FORMAT + 1 && supported == STATE_FORMAT),
            "{e:?}"
        );
        let msg = e.to_string();
        for needle in [
            "/h/lazyfs/run/state.json",
            "newer",
            "strata lazyfs stop",
            "upgrade",
            "remove the file",
        ] {
            assert!(msg.contains(needle), "`{needle}` missing from: {msg}");
        }

        for garbage in [&b"{\"binds\": 3}"[..], b"{not json", b"{\"format\": \"x\"}"] {
            let e = decode_state(path, garbage).unwrap_err();
            assert!(matches!(e, LazyError::State { .. }), "{e:?}");
            assert!(e.to_string().contains("remove the file"), "{e}");
        }
    }

    fn log_in(dir: &Path) -> StateLog {
        let paths = Paths::new(dir);
        std::fs::create_dir_all(paths.run_dir()).unwrap();
        StateLog::new(paths)
    }

    fn change(log: &mut StateLog, state: &mut State, change: Change) {
        state.apply(&change);
        log.record(&change, state);
    }

    #[test]
    fn binds_read_back_from_the_state_file_and_the_journal_after_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = log_in(dir.path());
        let mut state = State::default();
        let bind = |n: usize| Change::Bind("ab12".into(), format!("/s/{n}/layers/0").into());
        let unbind = |n: usize| Change::Unbind("ab12".into(), format!("/s/{n}/layers/0").into());
        // Up and down as sandboxes come and go, past several compactions.
        for n in 0..2000 {
            change(&mut log, &mut state, bind(n));
            if n % 3 != 0 {
                change(&mut log, &mut state, unbind(n));
            }
        }
        change(
            &mut log,
            &mut state,
            Change::Bind("cd34".into(), "/s/x/layers/1".into()),
        );
        change(
            &mut log,
            &mut state,
            Change::Unbind("cd34".into(), "/s/x/layers/1".into()),
        );
        assert_eq!(state.len(), 667);
        assert!(
            !state.binds.contains_key("cd34"),
            "an emptied layer is dropped"
        );
        let paths = Paths::new(dir.path());
        let journal = std::fs::read_to_string(paths.state_journal()).unwrap();
        let lines = journal.lines().count();
        assert!(
            lines > 0 && lines <= 2 * 667 + 1,
            "the journal is compacted once twice the state's size: {lines} lines"
        );
        assert_eq!(
            read_state(&paths).unwrap(),
            state,
            "what a restarted daemon reads"
        );

        // A crash in the middle of a line's write: the line is skipped, the rest holds.
        let mut torn = journal.clone();
        torn.push_str(r#"{"bind":["ab12","/s/torn"#);
        std::fs::write(paths.state_journal(), &torn).unwrap();
        assert_eq!(read_state(&paths).unwrap(), state);

        // A crash after a new state file, before the journal was emptied: replaying
        // changes it already holds changes nothing.
        log.write(&state);
        std::fs::write(paths.state_journal(), &journal).unwrap();
        assert_eq!(read_state(&paths).unwrap(), state);
    }

    #[test]
    fn a_damaged_journal_line_is_refused_naming_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths::new(dir.path());
        std::fs::create_dir_all(paths.run_dir()).unwrap();
        std::fs::write(
            paths.state_journal(),
            "{\"bind\":[\"ab12\",\"/s/1\"]}\nnot a change\n{\"bind\":[\"ab12\",\"/s/2\"]}\n",
        )
        .unwrap();
        let e = read_state(&paths).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, LazyError::State { .. }), "{e:?}");
        for needle in ["state.journal", "line 2", "remove the file"] {
            assert!(msg.contains(needle), "`{needle}` missing from: {msg}");
        }
    }
}
