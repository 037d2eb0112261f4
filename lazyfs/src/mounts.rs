//! Kernel mounts: EROFS (straight from the image file where the kernel can, else through
//! loop devices), read-only bind mounts, unmounting, and reading `/proc/self/mountinfo` to
//! find what an earlier daemon left behind.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains NUL"))
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

pub use strata_host::ErofsSource;

/// Mounts the EROFS image file `meta` at `target`, read-only, with `blob` as its extra
/// device: straight from the files, or (`Loop`, kernels before 6.12) through loop devices,
/// the image's read with direct I/O (it is on local disk; cached once, by the device) and
/// the blob's buffered (the FUSE file's page cache and readahead are what make warm reads
/// fast). The loop devices detach themselves when the mount goes (autoclear).
pub fn mount_erofs(
    meta: &Path,
    blob: Option<&Path>,
    target: &Path,
    source: ErofsSource,
) -> io::Result<()> {
    if source == ErofsSource::File {
        return mount_erofs_from(meta, blob, target);
    }
    use strata_host::loopdev::{attach, Options};
    let meta_dev = attach(
        meta,
        Options {
            read_only: true,
            direct_io: true,
            block_size: 4096,
        },
    )?;
    let blob_dev = blob
        .map(|b| {
            attach(
                b,
                Options {
                    read_only: true,
                    direct_io: false,
                    block_size: 4096,
                },
            )
        })
        .transpose()?;
    // The devices stay open until the mount holds them, or autoclear would free them.
    mount_erofs_from(
        &meta_dev.path,
        blob_dev.as_ref().map(|d| d.path.as_path()),
        target,
    )
}

/// Whether an EROFS mount's source (`/proc/self/mountinfo`) is under `root`: the image
/// file itself, or a loop device bound to one.
pub fn erofs_source_under(source: &str, root: &Path) -> bool {
    let source = Path::new(source);
    source.starts_with(root)
        || strata_host::loopdev::backing_file(source).is_some_and(|f| f.starts_with(root))
}

fn mount_erofs_from(meta: &Path, blob: Option<&Path>, target: &Path) -> io::Result<()> {
    let src = cstr(meta)?;
    let dst = cstr(target)?;
    let fstype = CString::new("erofs").map_err(io::Error::other)?;
    let opts = match blob {
        Some(b) => format!("device={}", b.display()),
        None => String::new(),
    };
    let opts = CString::new(opts).map_err(io::Error::other)?;
    // SAFETY: all pointers are valid NUL-terminated strings.
    check(unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            fstype.as_ptr(),
            libc::MS_RDONLY | libc::MS_NODEV | libc::MS_NOSUID,
            opts.as_ptr().cast(),
        )
    })
}

/// Bind-mounts `src` at `dst`, read-only.
pub fn bind_readonly(src: &Path, dst: &Path) -> io::Result<()> {
    let s = cstr(src)?;
    let d = cstr(dst)?;
    // SAFETY: valid paths; null fstype/data are allowed for bind mounts.
    check(unsafe {
        libc::mount(
            s.as_ptr(),
            d.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    })?;
    // SAFETY: as above.
    check(unsafe {
        libc::mount(
            std::ptr::null(),
            d.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
            std::ptr::null(),
        )
    })
}

/// Unmounts `target`; `detach` makes it lazy (for mounts whose backing daemon is gone).
pub fn unmount(target: &Path, detach: bool) -> io::Result<()> {
    let t = cstr(target)?;
    let flags = if detach { libc::MNT_DETACH } else { 0 };
    // SAFETY: valid path.
    check(unsafe { libc::umount2(t.as_ptr(), flags) })
}

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub fstype: String,
    pub source: String,
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push(((b[i + 1] - b'0') << 6) | ((b[i + 2] - b'0') << 3) | (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Current mounts, in mount order.
pub fn mounts() -> io::Result<Vec<MountEntry>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mount_point = left.split(' ').nth(4)?;
            let mut r = right.split(' ');
            let fstype = r.next()?.to_string();
            let source = r.next().unwrap_or_default();
            Some(MountEntry {
                mount_point: PathBuf::from(unescape(mount_point)),
                fstype,
                source: unescape(source),
            })
        })
        .collect())
}

/// Whether something is mounted exactly at `path`.
pub fn is_mount_point(path: &Path) -> bool {
    mounts().is_ok_and(|m| m.iter().any(|e| e.mount_point == path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape(r"/a\040b"), "/a b");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert!(mounts()
            .unwrap()
            .iter()
            .any(|m| m.mount_point == Path::new("/")));
    }
}
