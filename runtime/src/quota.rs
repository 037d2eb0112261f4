//! Writable uppers with a size limit. Each sandbox's upper is its own small ext4
//! filesystem in a sparse image file on the host's disk, loop-mounted: filling it gives
//! ENOSPC inside the sandbox and nothing outside notices, and only written blocks use disk.
//! Because only written blocks use disk, a host disk that fills first would lose writes
//! the sandbox was told succeeded: an upper is made only while the host disk has its whole
//! size free.
//!
//! Why not one filesystem with project quotas: this kind of host's kernel has neither
//! XFS quota nor CONFIG_QUOTA for ext4 (both measured), so a per-sandbox filesystem is the
//! limit the kernel can enforce. The image has no journal: an upper dies with its sandbox.
//! A new image is a sparse copy of a formatted template (only its ~100 KiB of metadata is
//! written), which is cheaper than running `mkfs.ext4` per sandbox.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::RuntimeError;

/// Where uppers are mounted and their images kept, and the pool of ready ones:
/// `pool/<bytes>/<slot>` marks a formatted, mounted upper `pool-<slot>` of that size.
#[derive(Debug, Clone)]
pub struct Uppers {
    images: PathBuf,
    mounts: PathBuf,
    pool: PathBuf,
    /// How many uppers of each size this process keeps ready ([`Uppers::fill`]'s target):
    /// what [`Uppers::recycle`] tops up (one recycle at a time holds the lock).
    targets: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<u64, usize>>>,
}

const POOLED: &str = "pool-";

/// The most inodes an upper may use to be recycled: a fresh one uses 11 (ext4's reserved
/// ones and `lost+found`). Removing more files than this costs more than making a new one.
const RECYCLE_MAX_INODES: u64 = 512;

/// Recycled uppers are kept up to this many times the pool's target: one kept costs a
/// mount and a loop device, one made costs a format's worth of work, and creates in a
/// burst take more than the target at once.
const RECYCLE_POOL_FACTOR: usize = 4;

impl Uppers {
    pub fn open(images: &Path, mounts: &Path, pool: &Path) -> Result<Uppers, RuntimeError> {
        for d in [images, mounts, pool] {
            std::fs::create_dir_all(d).map_err(RuntimeError::io(d))?;
        }
        Ok(Uppers {
            images: images.to_path_buf(),
            mounts: mounts.to_path_buf(),
            pool: pool.to_path_buf(),
            targets: Default::default(),
        })
    }

    /// A ready upper of `bytes` for sandbox `id`, taken from the pool: its mount is moved
    /// to `uppers/<id>` and its image renamed, so from here on it is like one made fresh.
    /// `None` when the pool has none of that size (or the move fails).
    pub fn claim(&self, id: &str, bytes: u64) -> Option<PathBuf> {
        self.ensure_room(bytes).ok()?;
        let sized = self.pool.join(bytes.to_string());
        for e in std::fs::read_dir(&sized).ok()?.flatten() {
            let slot = e.file_name().to_string_lossy().into_owned();
            let claimed = self.claiming(&slot);
            if std::fs::rename(e.path(), &claimed).is_err() {
                continue; // another create took it
            }
            // Who is taking it, so a claimant killed midway (its slot no longer marked
            // ready, its upper not yet moved) leaves one the next reap knows for
            // abandoned at once.
            let _ = mark_owner(&claimed);
            let pooled = format!("{POOLED}{slot}");
            let moved = self.rename_upper(&pooled, id);
            let _ = std::fs::remove_file(&claimed);
            if moved {
                let _ = std::fs::remove_dir(self.dir(&pooled));
                return Some(self.dir(id));
            }
            // A shared parent mount refuses MS_MOVE: drop the slot, make one fresh.
            let _ = self.remove(&pooled);
            let _ = self.remove(id);
            return None;
        }
        None
    }

    /// Formats and mounts uppers of `bytes` until `target` wait.
    pub fn fill(&self, bytes: u64, target: usize) -> Result<(), RuntimeError> {
        self.targets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(bytes, target);
        let sized = self.pool.join(bytes.to_string());
        std::fs::create_dir_all(&sized).map_err(RuntimeError::io(&sized))?;
        let ready = || std::fs::read_dir(&sized).map(|rd| rd.count()).unwrap_or(0);
        while ready() < target {
            let slot = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
            // Who is making it, so a maker killed midway leaves an upper the next reap
            // knows for abandoned at once.
            let making = self.making(&slot);
            mark_owner(&making)?;
            let made = self
                .create(&format!("{POOLED}{slot}"), bytes)
                .and_then(|_| {
                    let marker = sized.join(&slot);
                    std::fs::write(&marker, b"").map_err(RuntimeError::io(&marker))
                });
            let _ = std::fs::remove_file(&making);
            made?;
        }
        Ok(())
    }

    /// Hands the upper of sandbox `id`, whose processes are gone and whose overlay is
    /// unmounted, back to the pool when the pool of its size holds fewer than
    /// [`RECYCLE_POOL_FACTOR`] times its target and the upper holds few files: its contents are removed, leaving it as a fresh one is made
    /// (an empty `lost+found` alone at its root), and its mount and image become a ready
    /// slot's. The alternative, unmounting and deleting it while a refill copies, binds and
    /// mounts a new image, was about a sixth of the node service's CPU time per container
    /// created and destroyed (ext4's mount and unmount, the loop device's configure, which
    /// syncs the image, and the image's deletion). `false` when it was not taken: the
    /// caller removes it.
    ///
    /// The next sandbox sees only the empty upper's files: the deleted ones' blocks read as
    /// zeros through the filesystem, and the loop device is in no sandbox.
    pub fn recycle(&self, id: &str) -> bool {
        let dir = self.dir(id);
        let Ok(bytes) = std::fs::metadata(self.image(id)).map(|m| m.len()) else {
            return false;
        };
        // Held until the slot is marked ready, so destroys at once do not all see room.
        let targets = self.targets.lock().unwrap_or_else(|p| p.into_inner());
        let target = targets.get(&bytes).copied().unwrap_or(0);
        let sized = self.pool.join(bytes.to_string());
        let ready = std::fs::read_dir(&sized).map_or(0, |rd| rd.count());
        // A full pool (the usual case under load) answers before the upper is looked at.
        if ready >= target.saturating_mul(RECYCLE_POOL_FACTOR) {
            return false;
        }
        let mounted = strata_host::fs::mount_root(&dir).is_ok_and(|(root, _)| root);
        let small = || {
            nix::sys::statvfs::statvfs(&dir)
                .is_ok_and(|st| st.files().saturating_sub(st.files_free()) <= RECYCLE_MAX_INODES)
        };
        if !mounted || !small() {
            return false;
        }
        let slot = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
        let making = self.making(&slot);
        if mark_owner(&making).is_err() {
            return false;
        }
        let pooled = format!("{POOLED}{slot}");
        let handed = empty_upper(&dir).is_ok()
            && self.rename_upper(id, &pooled)
            && std::fs::create_dir_all(&sized).is_ok()
            && std::fs::write(sized.join(&slot), b"").is_ok();
        if handed {
            let _ = std::fs::remove_dir(&dir);
            let _ = std::fs::remove_file(&making);
        } else {
            // Whatever moved goes; the caller removes what did not.
            let _ = self.remove(&pooled);
        }
        handed
    }

    /// Gives the upper of `from` (its mount, moved, and its image, renamed) the name `to`;
    /// `false` when a step failed (a shared parent mount refuses MS_MOVE).
    fn rename_upper(&self, from: &str, to: &str) -> bool {
        let target = self.dir(to);
        std::fs::create_dir_all(&target).is_ok()
            && nix::mount::mount(
                Some(&self.dir(from)),
                &target,
                None::<&str>,
                nix::mount::MsFlags::MS_MOVE,
                None::<&str>,
            )
            .is_ok()
            && std::fs::rename(self.image(from), self.image(to)).is_ok()
    }

    /// The file naming the process making pool slot `slot`.
    fn making(&self, slot: &str) -> PathBuf {
        self.pool.join(format!("making-{slot}"))
    }

    /// The file naming the process handing pool slot `slot` to a sandbox (the slot's
    /// ready marker, renamed: only one claimant can).
    fn claiming(&self, slot: &str) -> PathBuf {
        self.pool.join(format!("claiming-{slot}"))
    }

    /// Whether `name` is a pooled upper still waiting (or being handed out right now).
    pub fn is_pooled(&self, name: &str) -> bool {
        let Some(slot) = name.strip_prefix(POOLED) else {
            return false;
        };
        if std::fs::read_dir(&self.pool)
            .is_ok_and(|rd| rd.flatten().any(|e| e.path().join(slot).exists()))
        {
            return true;
        }
        // Being made or handed out by a live process; one killed midway left it to the
        // reaper. Neither marked ready nor named by a maker or claimant, it is no one's:
        // every step that makes or hands out a slot names its process first, so this is
        // a drain or a failed claim killed between dropping the mark and removing the
        // upper (the soak found one such slot kept mounted while its image was young).
        owner_alive(&self.making(slot))
            .or_else(|| owner_alive(&self.claiming(slot)))
            .unwrap_or(false)
    }

    /// Unmounts and deletes every pooled upper.
    pub fn drain(&self) {
        if let Ok(rd) = std::fs::read_dir(&self.pool) {
            for sized in rd.flatten() {
                if let Ok(slots) = std::fs::read_dir(sized.path()) {
                    for e in slots.flatten() {
                        let _ = std::fs::remove_file(e.path());
                        let _ =
                            self.remove(&format!("{POOLED}{}", e.file_name().to_string_lossy()));
                    }
                }
            }
        }
    }

    pub fn dir(&self, id: &str) -> PathBuf {
        self.mounts.join(id)
    }

    /// The image file of sandbox `id`'s upper.
    pub fn image(&self, id: &str) -> PathBuf {
        self.images.join(format!("{id}.img"))
    }

    /// Makes and mounts a fresh upper of `bytes` for sandbox `id`: a sparse copy of the
    /// formatted template of that size (made by `mkfs.ext4` once), bound to a loop device
    /// and mounted, without spawning anything.
    pub fn create(&self, id: &str, bytes: u64) -> Result<PathBuf, RuntimeError> {
        self.ensure_room(bytes)?;
        self.remove(id)?;
        let template = self.template(bytes)?;
        copy_sparse(&template, &self.image(id), bytes)?;
        self.mount(id)
    }

    /// Makes and mounts an upper for sandbox `id` copied from the image `from` (a
    /// container snapshot's writable layer).
    pub fn create_from(&self, id: &str, from: &Path) -> Result<PathBuf, RuntimeError> {
        self.remove(id)?;
        let len = std::fs::metadata(from)
            .map_err(RuntimeError::io(from))?
            .len();
        self.ensure_room(len)?;
        copy_sparse(from, &self.image(id), len)?;
        self.mount(id)
    }

    /// Refuses an upper of `bytes` while the disk its image would be on has less free.
    /// Images are sparse: a sandbox's writes take host blocks only as they are written
    /// back, and a host disk full by then loses them (the kernel's "lost async page
    /// write") while the sandbox was told they succeeded. Checked at every create, so a
    /// disk that is nearly full takes no new sandbox; sandboxes already running share what
    /// is left (the README's "disk full" says so).
    fn ensure_room(&self, bytes: u64) -> Result<(), RuntimeError> {
        let stat = nix::sys::statvfs::statvfs(&self.images).map_err(|e| {
            RuntimeError::io(&self.images)(std::io::Error::from_raw_os_error(e as i32))
        })?;
        let free = stat.blocks_available() as u64 * stat.fragment_size() as u64;
        if free < bytes {
            return Err(RuntimeError::Quota(format!(
                "the disk holding {} has {} MiB free, less than the sandbox's disk budget of {} MiB \
                 (its writes could not all be kept): free space there, or give the sandbox a smaller disk budget (--disk)",
                self.images.display(),
                free >> 20,
                bytes >> 20
            )));
        }
        Ok(())
    }

    /// Binds the image of `id` to a loop device and mounts it at its directory.
    fn mount(&self, id: &str) -> Result<PathBuf, RuntimeError> {
        let image = self.image(id);
        let dir = self.dir(id);
        std::fs::create_dir_all(&dir).map_err(RuntimeError::io(&dir))?;
        let device = strata_host::loopdev::attach(&image, Default::default())
            .map_err(|e| RuntimeError::Setup(e.to_string()))?;
        nix::mount::mount(
            Some(&device.path),
            &dir,
            Some("ext4"),
            nix::mount::MsFlags::MS_NOSUID
                | nix::mount::MsFlags::MS_NODEV
                | nix::mount::MsFlags::MS_NOATIME,
            None::<&str>,
        )
        .map_err(|e| {
            RuntimeError::Setup(format!(
                "mounting upper {} ({}) at {}: {e}",
                image.display(),
                device.path.display(),
                dir.display()
            ))
        })?;
        Ok(dir)
    }

    /// Copies the upper of sandbox `id`, mounted and in use, to `to` (sparse): its
    /// filesystem is synced first, so the copy holds everything written so far. The
    /// caller keeps the sandbox's processes still meanwhile.
    pub fn copy_mounted(&self, id: &str, to: &Path) -> Result<u64, RuntimeError> {
        let dir = self.dir(id);
        let f = File::open(&dir).map_err(RuntimeError::io(&dir))?;
        nix::unistd::syncfs(&f).map_err(|e| RuntimeError::io(&dir)(std::io::Error::from(e)))?;
        let image = self.image(id);
        let len = std::fs::metadata(&image)
            .map_err(RuntimeError::io(&image))?
            .len();
        copy_sparse(&image, to, len)?;
        use std::os::unix::fs::MetadataExt;
        Ok(std::fs::metadata(to).map_or(0, |m| m.blocks() * 512))
    }

    /// Makes an upper image of `bytes` for sandbox `id` without mounting it (a VM mounts
    /// it inside its guest), or one copied from `from` (a VM snapshot's disk); its path.
    pub fn create_image(
        &self,
        id: &str,
        bytes: u64,
        from: Option<&Path>,
    ) -> Result<PathBuf, RuntimeError> {
        let image = self.image(id);
        self.remove(id)?;
        match from {
            Some(src) => {
                let len = std::fs::metadata(src).map_err(RuntimeError::io(src))?.len();
                self.ensure_room(len)?;
                copy_sparse(src, &image, len)?;
            }
            None => {
                self.ensure_room(bytes)?;
                copy_sparse(&self.template(bytes)?, &image, bytes)?
            }
        }
        Ok(image)
    }

    /// The formatted, never-mounted ext4 image of `bytes` new uppers are copied from.
    fn template(&self, bytes: u64) -> Result<PathBuf, RuntimeError> {
        let template = self.images.join(format!("template-{bytes}.ext4"));
        if template.exists() {
            return Ok(template);
        }
        // A creator that died mid-format left its partial template: remove old ones.
        let prefix = format!("template-{bytes}.ext4.");
        if let Ok(rd) = std::fs::read_dir(&self.images) {
            for e in rd.flatten() {
                let stale = e.file_name().to_string_lossy().starts_with(&prefix)
                    && crate::age(&e.path()) > std::time::Duration::from_secs(60);
                if stale {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let partial = self
            .images
            .join(format!("{prefix}{}", crate::unique_suffix()));
        let f = std::fs::File::create(&partial).map_err(RuntimeError::io(&partial))?;
        f.set_len(bytes).map_err(RuntimeError::io(&partial))?;
        drop(f);
        crate::run_tool(
            Command::new("mkfs.ext4")
                .args([
                    "-q",
                    "-F",
                    "-O",
                    "^has_journal,^resize_inode",
                    "-E",
                    "lazy_itable_init=1,nodiscard",
                    "-m",
                    "0",
                    "-i",
                    "8192",
                ])
                .arg(&partial),
            None,
        )?;
        std::fs::rename(&partial, &template).map_err(RuntimeError::io(&template))?;
        Ok(template)
    }

    /// Bytes used in an upper and its size (an upper out of inodes is full:
    /// [`strata_host::fs::disk_use`]).
    pub fn usage(&self, id: &str) -> Result<(u64, u64), RuntimeError> {
        let dir = self.dir(id);
        strata_host::fs::disk_use(&dir).map_err(RuntimeError::io(&dir))
    }

    /// Unmounts and deletes an upper (no-op when there is none).
    pub fn remove(&self, id: &str) -> Result<(), RuntimeError> {
        let dir = self.dir(id);
        crate::rootfs::unmount_below(&dir)?;
        if let Some(slot) = id.strip_prefix(POOLED) {
            let _ = std::fs::remove_file(self.making(slot));
            let _ = std::fs::remove_file(self.claiming(slot));
        }
        for p in [self.image(id)] {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(RuntimeError::io(&p)(e)),
            }
        }
        match std::fs::remove_dir(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError::io(&dir)(e)),
        }
    }

    /// Sandbox IDs that have an upper image or mount on this host.
    pub fn entries(&self) -> Vec<String> {
        let mut ids = std::collections::BTreeSet::new();
        for (d, suffix) in [(&self.images, ".img"), (&self.mounts, "")] {
            if let Ok(rd) = std::fs::read_dir(d) {
                for e in rd.flatten() {
                    if let Some(n) = e.file_name().to_str() {
                        if let Some(id) = n.strip_suffix(suffix) {
                            ids.insert(id.to_string());
                        }
                    }
                }
            }
        }
        ids.into_iter().collect()
    }
}

/// Removes everything at the root of the upper filesystem mounted at `root` but an empty
/// `lost+found`; an error (a file the sandbox made immutable, a `lost+found` with
/// something in it) leaves the upper to be removed whole.
fn empty_upper(root: &Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(root)? {
        let e = e?;
        let path = e.path();
        let kind = e.file_type()?;
        if e.file_name() == "lost+found" && kind.is_dir() {
            if std::fs::read_dir(&path)?.next().is_some() {
                return Err(std::io::Error::other("lost+found is not empty"));
            }
            continue;
        }
        // Never follows a symlink: std's remove_dir_all opens each level without.
        if kind.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

/// Names this process (PID and start time) in the file at `path`.
fn mark_owner(path: &Path) -> Result<(), RuntimeError> {
    let me = std::process::id();
    let start = crate::backend::process_start(me).unwrap_or(0);
    std::fs::write(path, format!("{me} {start}\n")).map_err(RuntimeError::io(path))
}

/// How long a marker may name no process before it counts as its owner's death: the owner
/// writes its name right after making (or renaming) the file.
const UNNAMED_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether the process [`mark_owner`] named in `path` still lives (`true` too while the
/// file names none yet, for [`UNNAMED_GRACE`] after its last change: an owner killed
/// between taking the file and naming itself leaves it empty for good); `None` when there
/// is no such file.
fn owner_alive(path: &Path) -> Option<bool> {
    owner_alive_at(path, std::time::SystemTime::now())
}

/// [`owner_alive`] as of `now`.
fn owner_alive_at(path: &Path, now: std::time::SystemTime) -> Option<bool> {
    use std::os::unix::fs::MetadataExt;
    let text = std::fs::read_to_string(path).ok()?;
    let mut w = text.split_whitespace();
    Some(
        match (
            w.next().and_then(|p| p.parse::<u32>().ok()),
            w.next().and_then(|s| s.parse::<u64>().ok()),
        ) {
            (Some(pid), Some(start)) => crate::backend::process_start(pid) == Some(start),
            // The rename that takes a ready mark keeps its mtime; the change time is the
            // rename's.
            _ => {
                let meta = std::fs::metadata(path).ok()?; // removed meanwhile
                let changed = std::time::UNIX_EPOCH
                    + std::time::Duration::new(
                        meta.ctime().max(0) as u64,
                        meta.ctime_nsec().clamp(0, 999_999_999) as u32,
                    );
                now.duration_since(changed).unwrap_or_default() < UNNAMED_GRACE
            }
        },
    )
}

/// Copies the data extents of `from` into a new `to` of `size` bytes; holes stay holes.
pub(crate) fn copy_sparse(from: &Path, to: &Path, size: u64) -> Result<(), RuntimeError> {
    let src = File::open(from).map_err(RuntimeError::io(from))?;
    let dst = File::create(to).map_err(RuntimeError::io(to))?;
    dst.set_len(size).map_err(RuntimeError::io(to))?;
    let end = src.metadata().map_err(RuntimeError::io(from))?.len();
    let mut pos = 0;
    while pos < end {
        let Some((data, hole)) =
            strata_host::fs::next_data(&src, pos).map_err(RuntimeError::io(from))?
        else {
            break; // only a hole is left
        };
        let mut off = data;
        while off < hole {
            let n = strata_host::fs::copy_range(&src, &dst, off, hole - off)
                .map_err(RuntimeError::io(to))?;
            if n == 0 {
                break;
            }
            off += n;
        }
        pos = hole;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool slot is the pool's while it is marked ready or a live process is making or
    /// handing it out; one whose maker or claimant died is the reaper's at once (a node
    /// service killed in a create left a mounted upper no drain found: the soak).
    #[test]
    fn a_slot_whose_claimant_died_is_no_longer_pooled() {
        let (root, uppers) = uppers_in_tempdir();
        std::fs::write(uppers.image("pool-abc"), b"").unwrap();
        // Nothing names it: a drain or a claim was killed midway.
        assert!(!uppers.is_pooled("pool-abc"));
        // Claimed a moment ago by a process that has not named itself yet.
        std::fs::write(uppers.claiming("abc"), b"").unwrap();
        assert!(uppers.is_pooled("pool-abc"));
        // Named by none long after: its claimant died in between.
        let later = std::time::SystemTime::now() + UNNAMED_GRACE * 2;
        assert_eq!(owner_alive_at(&uppers.claiming("abc"), later), Some(false));
        // Claimed by a process that is gone (PID 0's start never matches).
        std::fs::write(uppers.claiming("abc"), "4194305 1\n").unwrap();
        assert!(!uppers.is_pooled("pool-abc"));
        // Claimed by a live one: this test.
        mark_owner(&uppers.claiming("abc")).unwrap();
        assert!(uppers.is_pooled("pool-abc"));
        // Made by a process that is gone.
        std::fs::remove_file(uppers.claiming("abc")).unwrap();
        std::fs::write(uppers.making("abc"), "4194305 1\n").unwrap();
        assert!(!uppers.is_pooled("pool-abc"));
        // Marked ready: the pool's, whoever made it.
        std::fs::create_dir_all(root.path().join("pool/1024")).unwrap();
        std::fs::write(root.path().join("pool/1024/abc"), b"").unwrap();
        assert!(uppers.is_pooled("pool-abc"));
        // Removing it takes its marks with it.
        std::fs::remove_file(root.path().join("pool/1024/abc")).unwrap();
        mark_owner(&uppers.claiming("abc")).unwrap();
        uppers.remove("pool-abc").unwrap();
        assert!(!uppers.making("abc").exists() && !uppers.claiming("abc").exists());
        assert!(!uppers.image("pool-abc").exists());
    }

    /// Uppers whose images, mounts and pool are in a new temporary directory.
    fn uppers_in_tempdir() -> (tempfile::TempDir, Uppers) {
        let root = tempfile::tempdir().unwrap();
        let uppers = Uppers::open(
            &root.path().join("images"),
            &root.path().join("uppers"),
            &root.path().join("pool"),
        )
        .unwrap();
        (root, uppers)
    }

    /// The names at the root of the upper mounted at `dir`.
    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    }

    /// A used upper goes back to the pool empty (what the sandbox wrote gone, a symlink
    /// out of it not followed) and the next claim gets it; one holding many files, one
    /// whose lost+found is not empty, and one beyond the pool's keep are not taken.
    #[test]
    fn a_used_upper_returns_to_the_pool_empty() {
        if !strata_host::testing::root("loop-mounts ext4 uppers") {
            return;
        }
        let (root, uppers) = uppers_in_tempdir();
        let outside = root.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"host file").unwrap();
        let bytes = 32 << 20;
        let ready = || {
            std::fs::read_dir(root.path().join("pool").join(bytes.to_string()))
                .map_or(0, |rd| rd.count())
        };
        let checks = || -> Result<(), String> {
            // Not recycled for a pool with no target (a process that keeps none ready).
            uppers.create("a", bytes).map_err(|e| e.to_string())?;
            if uppers.recycle("a") {
                return Err("recycled with no pool target".into());
            }
            uppers.remove("a").map_err(|e| e.to_string())?;

            uppers.fill(bytes, 1).map_err(|e| e.to_string())?;
            let dir = uppers.claim("a", bytes).ok_or("no pooled upper")?;
            assert_eq!(ready(), 0);
            for d in ["upper/etc", "work/work"] {
                std::fs::create_dir_all(dir.join(d)).unwrap();
            }
            std::fs::write(dir.join("upper/etc/secret"), b"tenant a").unwrap();
            std::os::unix::fs::symlink(&outside, dir.join("upper/out")).unwrap();
            std::os::unix::fs::symlink(&outside, dir.join("top-level-link")).unwrap();
            assert!(uppers.recycle("a"), "a used, small upper is recycled");
            assert!(
                !dir.exists() && !uppers.image("a").exists(),
                "a's names are gone"
            );
            assert_eq!(ready(), 1);
            assert_eq!(
                std::fs::read(outside.join("keep")).unwrap(),
                b"host file",
                "a symlink out of the upper is not followed"
            );
            let dir = uppers
                .claim("b", bytes)
                .ok_or("the recycled upper is not claimable")?;
            assert_eq!(names(&dir), ["lost+found"]);
            assert!(names(&dir.join("lost+found")).is_empty());

            // Many files: removed whole instead.
            std::fs::create_dir(dir.join("upper")).unwrap();
            for i in 0..RECYCLE_MAX_INODES {
                std::fs::write(dir.join(format!("upper/{i}")), b"").unwrap();
            }
            assert!(
                !uppers.recycle("b"),
                "an upper of many files is not recycled"
            );
            uppers.remove("b").map_err(|e| e.to_string())?;

            // Something in lost+found: not recycled, and the pool is left as it was.
            let dir = uppers.create("c", bytes).map_err(|e| e.to_string())?;
            std::fs::write(dir.join("lost+found/#12"), b"").unwrap();
            assert!(!uppers.recycle("c"));
            assert_eq!(ready(), 0);
            assert!(
                dir.join("lost+found/#12").exists(),
                "an upper not taken is left for the caller as it was"
            );
            uppers.remove("c").map_err(|e| e.to_string())?;

            // The pool keeps at most RECYCLE_POOL_FACTOR times its target.
            for i in 0..=RECYCLE_POOL_FACTOR {
                let id = format!("d{i}");
                uppers.create(&id, bytes).map_err(|e| e.to_string())?;
                let kept = uppers.recycle(&id);
                assert_eq!(kept, i < RECYCLE_POOL_FACTOR, "recycle {i}");
                if !kept {
                    uppers.remove(&id).map_err(|e| e.to_string())?;
                }
            }
            assert_eq!(ready(), RECYCLE_POOL_FACTOR);
            Ok(())
        };
        let result = checks();
        uppers.drain();
        for id in uppers.entries() {
            let _ = uppers.remove(&id);
        }
        result.unwrap();
        assert!(uppers.entries().is_empty(), "{:?}", uppers.entries());
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !mounts.contains(&*root.path().to_string_lossy()),
            "a mount is left under {}",
            root.path().display()
        );
    }
}
