//! Read-only views mounted over a sandbox's root: an evaluation's grader files and the
//! paths it protects. The host mounts them for fncall and container sandboxes, a VM
//! guest's agent for its own root, with the same rules on both sides: no path passes a
//! symlink (the root's files are the sandbox's own, and so are a committed layer's), every
//! directory on the way to a view is pinned as a mount point first (a mount point cannot
//! be renamed, so the sandbox cannot move `/work` aside and put a `/work/tests` of its own
//! where a grader's absolute paths lead), and each view ends read-only, nosuid, nodev.

use std::ffi::CString;
use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use crate::fs::{mkdir_at, open_beneath};

/// One view: the tree `from` (a path in `tree`, `/` for all of it) mounted at `at`.
pub struct View<'a> {
    /// The view's tree (a directory: a layer's mount, or several stacked).
    pub tree: &'a File,
    pub from: &'a str,
    pub at: &'a str,
}

/// Why views could not be mounted.
#[derive(Debug)]
pub enum ViewError {
    /// A path is not where it must be: a symlink on the way in the root, or `from` not in
    /// its tree without one. The sandbox's (or its layers') doing.
    Refused(String),
    /// A mount the host (or guest) made failed.
    Mount(String),
}

impl fmt::Display for ViewError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ViewError::Refused(m) | ViewError::Mount(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for ViewError {}

/// Mounts `views` over `root` (a directory descriptor of the sandbox's root), in order,
/// after pinning every ancestor of every view.
pub fn mount_views(root: &File, views: &[View<'_>]) -> Result<(), ViewError> {
    let mut ancestors: Vec<String> = views
        .iter()
        .flat_map(|v| {
            let parts: Vec<&str> = v.at.split('/').filter(|p| !p.is_empty()).collect();
            (1..parts.len())
                .map(|n| format!("/{}", parts[..n].join("/")))
                .collect::<Vec<_>>()
        })
        .collect();
    ancestors.sort_by_key(|a| (a.matches('/').count(), a.clone()));
    ancestors.dedup();
    for at in &ancestors {
        let dir = mount_target(root, at, true)?;
        bind(&dir, &dir).map_err(|e| ViewError::Mount(format!("pinning {at} in place: {e}")))?;
    }
    for view in views {
        let from = view.from.trim_start_matches('/');
        let source = if from.is_empty() {
            view.tree.try_clone().map(OwnedFd::from)
        } else {
            open_beneath(view.tree, from, libc::O_PATH, 0)
        }
        .map_err(|e| {
            ViewError::Refused(format!(
                "{} is not in the layers of the view at {} without a symlink: {e}",
                view.from, view.at
            ))
        })?;
        let is_dir = is_dir(&source)
            .map_err(|e| ViewError::Mount(format!("the view at {}: {e}", view.at)))?;
        let target = mount_target(root, view.at, is_dir)?;
        bind(&source, &target)
            .map_err(|e| ViewError::Mount(format!("binding the view at {}: {e}", view.at)))?;
        // The path now crosses into the bind: its root is what is made read-only.
        let mounted = open_beneath(root, view.at.trim_start_matches('/'), libc::O_PATH, 0)
            .map_err(|e| ViewError::Mount(format!("the view at {}: {e}", view.at)))?;
        read_only(&mounted).map_err(|e| {
            ViewError::Mount(format!("making the view at {} read-only: {e}", view.at))
        })?;
    }
    Ok(())
}

/// Opens (making what is missing) the path `at` under `root` as a mount target: a
/// directory, or an empty file when the source is one. No symlink is followed on the way.
fn mount_target(root: &File, at: &str, is_dir: bool) -> Result<OwnedFd, ViewError> {
    let refused = |e: io::Error, part: &str| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            ViewError::Refused(format!(
                "cannot mount at {at}: the sandbox's root has a symlink at {part} on the way"
            ))
        } else {
            ViewError::Refused(format!("cannot mount at {at} ({part}): {e}"))
        }
    };
    let parts: Vec<&str> = at.split('/').filter(|p| !p.is_empty()).collect();
    let mut cur: OwnedFd = root
        .try_clone()
        .map(OwnedFd::from)
        .map_err(|e| ViewError::Mount(format!("{at}: {e}")))?;
    for (n, part) in parts.iter().enumerate() {
        let last = n + 1 == parts.len();
        let so_far = format!("/{}", parts[..=n].join("/"));
        if last && !is_dir {
            return open_beneath(&cur, part, libc::O_PATH, 0)
                .or_else(|e| {
                    if e.kind() != io::ErrorKind::NotFound {
                        return Err(e);
                    }
                    open_beneath(&cur, part, libc::O_CREAT | libc::O_WRONLY, 0o644)
                })
                .map_err(|e| refused(e, &so_far));
        }
        let open = |cur: &OwnedFd| open_beneath(cur, part, libc::O_PATH | libc::O_DIRECTORY, 0);
        cur = match open(&cur) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                mkdir_at(&cur, part).map_err(|e| refused(e, &so_far))?;
                open(&cur).map_err(|e| refused(e, &so_far))?
            }
            Err(e) => return Err(refused(e, &so_far)),
        };
    }
    Ok(cur)
}

/// How a descriptor is named in mount calls: `/proc/self/fd/N`, so nothing of where it
/// lives shows in the sandbox's mountinfo.
pub fn fd_path(fd: &impl AsRawFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

fn is_dir(fd: &OwnedFd) -> io::Result<bool> {
    // SAFETY: fstat on a descriptor we own into a zeroed stat of our own.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st.st_mode & libc::S_IFMT == libc::S_IFDIR)
    }
}

fn mount_call(source: Option<&str>, target: &str, flags: libc::c_ulong) -> io::Result<()> {
    let cstr = |s: &str| CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput));
    let source = source.map(cstr).transpose()?;
    let target = cstr(target)?;
    // SAFETY: mount(2) with NUL-terminated strings that outlive the call (or a null
    // source), no file system type and no data: a bind or a remount of one.
    let r = unsafe {
        libc::mount(
            source.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            target.as_ptr(),
            std::ptr::null(),
            flags,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Binds `source` onto `target`, both descriptors.
fn bind(source: &impl AsRawFd, target: &impl AsRawFd) -> io::Result<()> {
    mount_call(Some(&fd_path(source)), &fd_path(target), libc::MS_BIND)
}

/// Makes the bind mount `mounted` read-only, nosuid and nodev.
fn read_only(mounted: &impl AsRawFd) -> io::Result<()> {
    mount_call(
        None,
        &fd_path(mounted),
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mount_target_never_passes_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("real")).unwrap();
        std::os::unix::fs::symlink("/real", root.join("work")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("etc")).unwrap();
        let r = std::fs::File::open(&root).unwrap();
        let err = mount_target(&r, "/work/tests", true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("symlink at /work"), "{err}");
        let err = mount_target(&r, "/etc/passwd", false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("symlink at /etc"), "{err}");
        // Missing directories are made, a file target is made empty.
        mount_target(&r, "/real/a/b", true).unwrap();
        assert!(root.join("real/a/b").is_dir());
        mount_target(&r, "/real/f", false).unwrap();
        assert_eq!(std::fs::read(root.join("real/f")).unwrap(), b"");
    }
}
