//! A sandbox's root filesystem: each layer bound read-only from its one shared lazyfs
//! mount (the binds are the reference count: lazyfs detaches a layer when its last bind
//! goes), stacked with overlayfs `toolkits:workspace:base` under the sandbox's quota'd upper;
//! and the read-only views an evaluation mounts over it (`views/<i>/`).

use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use strata_lazyfs::{mounts, Attached, LazyError, Request, Response};

use crate::{LazyfsAccess, ReadonlyView, RuntimeError};

/// Paths of one sandbox's root filesystem.
#[derive(Debug, Clone)]
pub struct RootfsPaths {
    /// One bind per layer, top-most first.
    pub layers: Vec<PathBuf>,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub merged: PathBuf,
}

impl RootfsPaths {
    pub fn new(sandbox_dir: &Path, upper_dir: &Path, layers: usize) -> RootfsPaths {
        RootfsPaths {
            layers: (0..layers)
                .map(|i| sandbox_dir.join("layers").join(i.to_string()))
                .collect(),
            upper: upper_dir.join("upper"),
            work: upper_dir.join("work"),
            merged: sandbox_dir.join("rootfs"),
        }
    }
}

/// Binds each layer and mounts the overlay at `paths.merged`.
/// `facts` caches per-layer facts the assembly needs (which directories hold whiteouts).
pub fn assemble(
    lazyfs: &LazyfsAccess,
    layer_ids: &[String],
    paths: &RootfsPaths,
    facts: &Path,
) -> Result<(), RuntimeError> {
    let t = std::time::Instant::now();
    bind_layers(lazyfs, layer_ids, &paths.layers)?;
    let t_binds = t.elapsed();
    for d in [&paths.upper, &paths.work, &paths.merged] {
        std::fs::create_dir_all(d).map_err(RuntimeError::io(d))?;
    }
    for dir in merge_dirs(layer_ids, paths, facts)? {
        let target = paths.upper.join(&dir.path);
        if std::fs::symlink_metadata(&target).is_ok() {
            continue;
        }
        std::fs::create_dir(&target).map_err(RuntimeError::io(&target))?;
        std::os::unix::fs::lchown(&target, Some(dir.uid), Some(dir.gid))
            .map_err(RuntimeError::io(&target))?;
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(dir.mode))
            .map_err(RuntimeError::io(&target))?;
    }
    // The directories are named by descriptors (`/proc/self/fd/N`): the options show in
    // the sandbox's mountinfo, and must not show where anything lives on the host.
    let lower_fds = paths
        .layers
        .iter()
        .map(|p| open_dir(p))
        .collect::<Result<Vec<_>, _>>()?;
    let (upper_fd, work_fd) = (open_dir(&paths.upper)?, open_dir(&paths.work)?);
    let lower = lower_fds.iter().map(fd_path).collect::<Vec<_>>().join(":");
    let data = format!(
        "lowerdir={lower},upperdir={},workdir={}",
        fd_path(&upper_fd),
        fd_path(&work_fd)
    );
    mount_overlay(&paths.merged, &data)?;
    drop((lower_fds, upper_fd, work_fd));
    tracing::debug!(
        binds_ms = t_binds.as_secs_f64() * 1e3,
        overlay_ms = (t.elapsed() - t_binds).as_secs_f64() * 1e3,
        "root assembled"
    );
    Ok(())
}

/// Binds each layer's shared lazyfs mount read-only at `paths.layers` (the binds hold the
/// layers attached); returns where lazyfs serves each layer's files, top-most first.
pub fn bind_layers(
    lazyfs: &LazyfsAccess,
    layer_ids: &[String],
    dirs: &[PathBuf],
) -> Result<Vec<Attached>, RuntimeError> {
    if layer_ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut client = lazyfs.client()?;
    for dir in dirs {
        std::fs::create_dir_all(dir).map_err(RuntimeError::io(dir))?;
    }
    let binds = layer_ids
        .iter()
        .cloned()
        .zip(dirs.iter().cloned())
        .collect();
    match client.call(&Request::MountMany { binds })? {
        Response::AttachedMany { layers } => Ok(layers),
        other => Err(RuntimeError::Setup(format!(
            "lazyfs answered {other:?} to mounting the layers"
        ))),
    }
}

/// A directory to create in the upper before the overlay is mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeDir {
    /// Relative to the root; parents come before their children.
    pub path: PathBuf,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// The directories that must exist in the upper so every directory holding a whiteout is
/// a merged one, with the metadata of the top-most layer that has them.
///
/// overlayfs filters whiteouts only when it merges a directory from several layers; a
/// directory found in one layer alone is listed straight from it, whiteouts included (as
/// `c?????????` entries that cannot be opened). That happens when a layer with whiteouts
/// (a step-built one) is the bottom of a stack, or deletes from a directory no layer under
/// it has. Creating such directories in the sandbox's upper makes them merged, so the
/// whiteouts hide as they should.
pub fn merge_dirs(
    layer_ids: &[String],
    paths: &RootfsPaths,
    facts: &Path,
) -> Result<Vec<MergeDir>, RuntimeError> {
    let mut needed = std::collections::BTreeSet::new();
    for (id, root) in layer_ids.iter().zip(&paths.layers) {
        needed.extend(whiteout_dirs(facts, id, root)?);
    }
    let mut out: Vec<MergeDir> = Vec::new();
    for dir in needed {
        let mut rel = PathBuf::new();
        for part in dir.components() {
            rel.push(part);
            if out.iter().any(|d| d.path == rel) {
                continue;
            }
            let Some(meta) = paths
                .layers
                .iter()
                .find_map(|l| std::fs::symlink_metadata(l.join(&rel)).ok())
                .filter(|m| m.is_dir())
            else {
                break;
            };
            out.push(MergeDir {
                path: rel.clone(),
                mode: meta.mode() & 0o7777,
                uid: meta.uid(),
                gid: meta.gid(),
            });
        }
    }
    Ok(out)
}

/// The directories (relative to the layer root) holding overlayfs whiteouts in layer `id`,
/// mounted at `root`. Layers are immutable, so the walk is done once per layer per host
/// and its result kept in `facts` (NUL-separated paths).
fn whiteout_dirs(facts: &Path, id: &str, root: &Path) -> Result<Vec<PathBuf>, RuntimeError> {
    let cached = facts.join(format!("{id}.whiteout-dirs"));
    let read_cached = || {
        std::fs::read(&cached).ok().map(|bytes| {
            bytes
                .split(|b| *b == 0)
                .filter(|p| !p.is_empty())
                .map(|p| PathBuf::from(std::ffi::OsStr::from_bytes(p)))
                .collect::<Vec<_>>()
        })
    };
    if let Some(dirs) = read_cached() {
        return Ok(dirs);
    }
    // A burst of creates on a fresh host would all walk the same layer: one walks, the
    // others wait for its result (the lock holds across processes).
    std::fs::create_dir_all(facts).map_err(RuntimeError::io(facts))?;
    let lock_path = facts.join("walk.lock");
    let lock = std::fs::File::create(&lock_path).map_err(RuntimeError::io(&lock_path))?;
    // Released when `lock` is dropped.
    strata_host::fs::flock(&lock, strata_host::fs::Lock::Exclusive, true)
        .map_err(RuntimeError::io(&lock_path))?;
    if let Some(dirs) = read_cached() {
        return Ok(dirs);
    }
    let mut dirs = std::collections::BTreeSet::new();
    for entry in walkdir::WalkDir::new(root).follow_links(false).min_depth(1) {
        let entry = entry.map_err(|e| {
            RuntimeError::Setup(format!("reading layer {id} at {}: {e}", root.display()))
        })?;
        if !entry.file_type().is_char_device() {
            continue;
        }
        let meta = entry
            .metadata()
            .map_err(|e| RuntimeError::Setup(format!("reading {}: {e}", entry.path().display())))?;
        if meta.rdev() != 0 {
            continue;
        }
        if let Some(parent) = entry
            .path()
            .parent()
            .and_then(|p| p.strip_prefix(root).ok())
        {
            dirs.insert(parent.to_path_buf());
        }
    }
    let mut bytes = Vec::new();
    for d in &dirs {
        bytes.extend_from_slice(d.as_os_str().as_bytes());
        bytes.push(0);
    }
    let tmp = facts.join(format!("{id}.whiteout-dirs.{}", crate::unique_suffix()));
    std::fs::write(&tmp, &bytes).map_err(RuntimeError::io(&tmp))?;
    std::fs::rename(&tmp, &cached).map_err(RuntimeError::io(&cached))?;
    Ok(dirs.into_iter().collect())
}

/// Mounts each of `views` over the root at `merged`, in order: the view's layers bound
/// under `<sandbox_dir>/views/<i>/` (one layer is its own tree, several are stacked by an
/// overlay without an upper, so read-only), its `from` bound at `at`, then made read-only,
/// nosuid and nodev. Neither path may pass a symlink: the root's files are the sandbox's
/// (an agent's committed changes), and a symlink there must not move the mount, least of
/// all out of the root. Missing directories on the way to `at` are made.
pub fn mount_views(
    lazyfs: &LazyfsAccess,
    sandbox_dir: &Path,
    merged: &Path,
    views: &[ReadonlyView],
) -> Result<(), RuntimeError> {
    if views.is_empty() {
        return Ok(());
    }
    let dir = |i: usize| sandbox_dir.join("views").join(i.to_string());
    let mut binds = Vec::new();
    for (i, view) in views.iter().enumerate() {
        if view.layers.is_empty() {
            return Err(RuntimeError::Invalid(format!(
                "the read-only view at {} has no layers",
                view.at
            )));
        }
        for (j, layer) in view.layers.iter().enumerate() {
            let d = dir(i).join(j.to_string());
            std::fs::create_dir_all(&d).map_err(RuntimeError::io(&d))?;
            binds.push((layer.clone(), d));
        }
    }
    let mut client = lazyfs.client()?;
    match client.call(&Request::MountMany { binds })? {
        Response::AttachedMany { .. } => {}
        other => {
            return Err(RuntimeError::Setup(format!(
                "lazyfs answered {other:?} to mounting the views' layers"
            )))
        }
    }
    let mut trees = Vec::new();
    for (i, view) in views.iter().enumerate() {
        let tree = if view.layers.len() == 1 {
            dir(i).join("0")
        } else {
            let lowers = (0..view.layers.len())
                .map(|j| open_dir(&dir(i).join(j.to_string())))
                .collect::<Result<Vec<_>, _>>()?;
            let data = format!(
                "lowerdir={}",
                lowers.iter().map(fd_path).collect::<Vec<_>>().join(":")
            );
            let target = dir(i).join("root");
            std::fs::create_dir_all(&target).map_err(RuntimeError::io(&target))?;
            // Without an upper, overlayfs mounts read-only.
            mount_overlay(&target, &data)?;
            target
        };
        trees.push(open_dir(&tree)?);
    }
    let root = open_dir(merged)?;
    let views: Vec<strata_host::views::View<'_>> = views
        .iter()
        .zip(&trees)
        .map(|(v, tree)| strata_host::views::View {
            tree,
            from: &v.from,
            at: &v.at,
        })
        .collect();
    strata_host::views::mount_views(&root, &views).map_err(|e| match e {
        strata_host::views::ViewError::Refused(m) => RuntimeError::Invalid(m),
        strata_host::views::ViewError::Mount(m) => RuntimeError::Setup(m),
    })
}

/// How a descriptor is named in mount options and calls: `/proc/self/fd/N`, so nothing
/// of where it lives on the host shows in the sandbox's mountinfo.
fn fd_path(fd: &impl AsRawFd) -> String {
    strata_host::views::fd_path(fd)
}

/// A directory as a path descriptor (to name as [`fd_path`], or to resolve beneath).
fn open_dir(p: &Path) -> Result<std::fs::File, RuntimeError> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(p)
        .map_err(RuntimeError::io(p))
}

fn mount_overlay(target: &Path, data: &str) -> Result<(), RuntimeError> {
    nix::mount::mount(
        Some("strata"),
        target,
        Some("overlay"),
        nix::mount::MsFlags::empty(),
        Some(data),
    )
    .map_err(|e| {
        RuntimeError::Setup(format!(
            "overlay mount at {}: {e} (options {data})",
            target.display()
        ))
    })
}

/// Undoes [`assemble`]: unmounts the overlay and releases each layer bind. Tolerates
/// half-built states (a crash between steps). `false` when the overlay was busy and
/// detached lazily: something may still write through it to the upper.
pub fn disassemble(lazyfs: &LazyfsAccess, sandbox_dir: &Path) -> Result<bool, RuntimeError> {
    let merged = sandbox_dir.join("rootfs");
    let clean = unmount_below(&merged)?;
    let entries = |dir: &Path| -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default()
    };
    let mut binds = entries(&sandbox_dir.join("layers"));
    // A view's stacked overlay, then its layer binds (`views/<i>/<j>`).
    for view in entries(&sandbox_dir.join("views")) {
        unmount_below(&view.join("root"))?;
        binds.extend(entries(&view).into_iter().filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        }));
    }
    let mounted: Vec<PathBuf> = binds
        .into_iter()
        .filter(|b| mounts::is_mount_point(b))
        .collect();
    if !mounted.is_empty() {
        match lazyfs.running_client() {
            Some(mut client) => {
                for b in &mounted {
                    match client.call(&Request::Umount { dir: b.clone() }) {
                        Ok(_) => {}
                        // A daemon that lost its state does not know the bind: ours to drop.
                        Err(LazyError::NotBound(_)) => {
                            tracing::debug!("{} is no lazyfs bind; detaching it", b.display());
                            let _ = mounts::unmount(b, true);
                        }
                        Err(e) => {
                            tracing::warn!("lazyfs umount {}: {e}; detaching it here", b.display());
                            let _ = mounts::unmount(b, true);
                        }
                    }
                }
            }
            // No daemon: its binds are dead anyway; a restarted daemon forgets them.
            None => {
                for b in &mounted {
                    let _ = mounts::unmount(b, true);
                }
            }
        }
    }
    Ok(clean)
}

/// Unmounts `dir` and anything mounted beneath it, deepest first; `false` when a mount
/// was busy and had to be detached lazily (it lives on wherever it is still used).
pub fn unmount_below(dir: &Path) -> Result<bool, RuntimeError> {
    // Usually one mount is there (the overlay, an upper) with nothing on it: unmount it
    // after a `statx`, without reading the host's mount table, whose size grows with the
    // sandboxes on the node. A mount beneath makes the unmount EBUSY: then the scan.
    // Nothing is mounted beneath a directory that is no mount root: what this runtime
    // mounts under a sandbox's directories, it mounts on the overlay or the upper.
    loop {
        match strata_host::fs::mount_root(dir) {
            Ok((false, _)) => return Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
            Ok((true, _)) => match mounts::unmount(dir, false) {
                Ok(()) => continue,
                Err(_) => break,
            },
            Err(_) => break,
        }
    }
    let all = mounts::mounts().map_err(RuntimeError::io(Path::new("/proc/self/mountinfo")))?;
    let mut targets: Vec<PathBuf> = all
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|m| m.starts_with(dir))
        .collect();
    targets.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    targets.dedup();
    let mut clean = true;
    for t in targets {
        if let Err(e) = mounts::unmount(&t, false) {
            tracing::debug!("unmount {}: {e}; detaching", t.display());
            mounts::unmount(&t, true).map_err(RuntimeError::io(&t))?;
            clean = false;
        }
    }
    Ok(clean)
}
