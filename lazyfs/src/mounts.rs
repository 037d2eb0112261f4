//! Kernel mounts: EROFS (straight from the image file where the kernel can, else through
//! loop devices), read-only bind mounts, unmounting, and reading `/proc/self/mountinfo` to
//! find what an earlier daemon left behind.

use std::io;
use std::path::{Path, PathBuf};

fn nix_io(e: nix::Error) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

pub use strata_host::ErofsSource;

/// The blob's loop device reads the FUSE file buffered: direct I/O measured slower (0.74×
/// against 0.83× of the file-backed path's warm reads, bench lazyfs suite).
const BLOB_DIRECT: bool = false;
/// EROFS reads a file ahead by its primary device's readahead (the image's loop device).
/// About one largest request of the blob's loop device (1280 KiB here) reads best: warm
/// reads of the lazyfs bench tree, interleaved with the file-backed path, 11 rounds each:
/// 512 KiB 508–543 MB/s, 1 MiB 508–578, 1280 KiB 526–539, against 4 MiB 263, 16 MiB
/// 299–385 and 128 KiB 452.
const FILE_READ_AHEAD_KIB: u32 = 1024;

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
                    direct_io: BLOB_DIRECT,
                    block_size: 4096,
                },
            )
        })
        .transpose()?;
    // The blob device's own readahead plays no part: EROFS reads file data from it in
    // bios, never through its page cache.
    let _ = meta_dev.set_read_ahead(FILE_READ_AHEAD_KIB);
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
    use nix::mount::{mount, MsFlags};
    let opts = blob.map(|b| format!("device={}", b.display()));
    mount(
        Some(meta),
        target,
        Some("erofs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
        opts.as_deref(),
    )
    .map_err(nix_io)
}

/// Bind-mounts `src` at `dst`, read-only.
pub fn bind_readonly(src: &Path, dst: &Path) -> io::Result<()> {
    use nix::mount::{mount, MsFlags};
    mount(Some(src), dst, None::<&str>, MsFlags::MS_BIND, None::<&str>).map_err(nix_io)?;
    mount(
        None::<&str>,
        dst,
        None::<&str>,
        MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV,
        None::<&str>,
    )
    .map_err(nix_io)
}

/// Unmounts `target`; `detach` makes it lazy (for mounts whose backing daemon is gone).
pub fn unmount(target: &Path, detach: bool) -> io::Result<()> {
    let flags = if detach {
        nix::mount::MntFlags::MNT_DETACH
    } else {
        nix::mount::MntFlags::empty()
    };
    nix::mount::umount2(target, flags).map_err(nix_io)
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

/// Whether something is mounted exactly at `path`: one `statx` (see
/// [`strata_host::fs::mount_root`]); the mount table's scan only where the kernel cannot
/// say.
pub fn is_mount_point(path: &Path) -> bool {
    match strata_host::fs::mount_root(path) {
        Ok((root, _)) => root,
        Err(e) if e.kind() == io::ErrorKind::Unsupported => {
            mounts().is_ok_and(|m| m.iter().any(|e| e.mount_point == path))
        }
        Err(_) => false,
    }
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
