//! What a sandbox changed over its layers, held still and readable on the host, so the
//! caller can turn it into a new layer (`strata sandbox commit`): the overlayfs upper, the
//! layers it lies over, and what the runtime itself wrote there.
//!
//! A host-root sandbox (fncall, container) is frozen while the view lives, so nothing
//! writes to the upper as it is read, and thawed when the view is dropped (unless it was
//! paused before). A VM's upper is an ext4 image its guest has mounted: the guest flushes
//! its page cache, the machine stops for a sparse copy of the image, runs on, and the copy
//! is checked (`e2fsck`: the guest wrote it) and mounted read-only on the host under the
//! sandbox's `changes/` (which teardown unmounts, so a commit that died midway leaks
//! nothing past the sandbox's end).

use std::path::{Path, PathBuf};

use crate::cgroup::Cgroup;
use crate::RuntimeError;

/// A frozen, host-readable view of a sandbox's changes; released on drop.
pub struct Changes {
    /// The overlayfs upper: added and changed files, whiteouts, opaque directories.
    pub upper: PathBuf,
    /// The sandbox's layers on the host, top-most first (read-only).
    pub lowers: Vec<PathBuf>,
    /// Paths (relative to the root) the runtime wrote into the upper, not the sandbox.
    pub runtime_paths: Vec<String>,
    pub(crate) release: Release,
}

impl Changes {
    /// The changes an upper directory holds over `lowers` with nothing held still and
    /// nothing to give back: an upper no sandbox writes any more, or a test's.
    pub fn of_dir(
        upper: &std::path::Path,
        lowers: Vec<PathBuf>,
        runtime_paths: Vec<String>,
    ) -> Changes {
        Changes {
            upper: upper.to_path_buf(),
            lowers,
            runtime_paths,
            release: Release::Nothing,
        }
    }
}

/// How a view is given back.
pub(crate) enum Release {
    /// Nothing to undo (the sandbox was paused already).
    Nothing,
    /// Thaw the cgroup the view froze.
    Thaw(Cgroup),
    /// Unmount and delete the copy of a VM's upper image in this directory.
    Copy(PathBuf),
}

impl Drop for Changes {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.release, Release::Nothing) {
            Release::Nothing => {}
            Release::Thaw(cgroup) => {
                if let Err(e) = cgroup.freeze(false) {
                    tracing::warn!("thawing the sandbox after reading its changes: {e}");
                }
            }
            Release::Copy(dir) => {
                if let Err(e) = remove_copy(&dir) {
                    tracing::warn!("removing {}: {e}", dir.display());
                }
            }
        }
    }
}

/// A new directory of a sandbox to hold one VM upper's copy while it is read (one per
/// view, so two commits of one sandbox do not meet).
pub(crate) fn copy_dir(sandbox_dir: &Path) -> PathBuf {
    sandbox_dir
        .join(COPIES)
        .join(format!("copy-{}", crate::unique_suffix()))
}

/// Where a sandbox's copies live.
const COPIES: &str = "changes";

/// Removes every copy a sandbox's views left (its teardown).
pub(crate) fn remove_copies(sandbox_dir: &Path) -> Result<(), RuntimeError> {
    let copies = sandbox_dir.join(COPIES);
    for entry in std::fs::read_dir(&copies).into_iter().flatten().flatten() {
        remove_copy(&entry.path())?;
    }
    Ok(())
}

/// Copies ext4 image `image` (sparse) to `dir/upper.img`, for [`mount_copy`].
pub(crate) fn take_copy(image: &Path, dir: &Path) -> Result<(), RuntimeError> {
    remove_copy(dir)?;
    std::fs::create_dir_all(dir).map_err(RuntimeError::io(dir))?;
    let len = std::fs::metadata(image)
        .map_err(RuntimeError::io(image))?
        .len();
    crate::quota::copy_sparse(image, &dir.join("upper.img"), len)
}

/// Mounts the copy [`take_copy`] made on `dir/mnt`, read-only; the mounted directory.
///
/// The image was written by the guest's kernel, which the sandbox may control: before the
/// host's ext4 driver sees it, `e2fsck -fy` replays its journal (the guest's last
/// transactions) and repairs whatever is inconsistent, or refuses it.
pub(crate) fn mount_copy(dir: &Path) -> Result<PathBuf, RuntimeError> {
    let (copy, mnt) = (dir.join("upper.img"), dir.join("mnt"));
    let checked = std::process::Command::new("e2fsck")
        .args(["-f", "-y"])
        .arg(&copy)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| {
            RuntimeError::Setup(format!(
                "cannot run e2fsck: {e} (install e2fsprogs with scripts/setup.sh)"
            ))
        })?;
    // 0: clean, 1: errors corrected, 2: corrected (a mounted root would reboot).
    if !matches!(checked.status.code(), Some(0..=2)) {
        return Err(RuntimeError::Invalid(format!(
            "the guest's writable disk is damaged beyond repair (e2fsck {:?}: {}); its changes cannot be read",
            checked.status.code(),
            String::from_utf8_lossy(&checked.stderr).trim()
        )));
    }
    std::fs::create_dir_all(&mnt).map_err(RuntimeError::io(&mnt))?;
    let device = strata_host::loopdev::attach(
        &copy,
        strata_host::loopdev::Options {
            read_only: true,
            ..Default::default()
        },
    )
    .map_err(|e| RuntimeError::Setup(format!("loop device for {}: {e}", copy.display())))?;
    use nix::mount::MsFlags;
    nix::mount::mount(
        Some(&device.path),
        &mnt,
        Some("ext4"),
        MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV
            | MsFlags::MS_NOEXEC
            | MsFlags::MS_NOATIME,
        None::<&str>,
    )
    .map_err(|e| {
        RuntimeError::Setup(format!(
            "mounting {} at {}: {e}",
            copy.display(),
            mnt.display()
        ))
    })?;
    Ok(mnt)
}

/// Undoes [`take_copy`] and [`mount_copy`] (also what a crashed commit left).
pub(crate) fn remove_copy(dir: &Path) -> Result<(), RuntimeError> {
    if !dir.exists() {
        return Ok(());
    }
    crate::rootfs::unmount_below(&dir.join("mnt"))?;
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(RuntimeError::io(dir)(e)),
    }
}
