//! File and descriptor calls: advisory locks, sparse-file extents, in-kernel copies, and
//! opening paths confined to a root directory.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// How [`flock`] locks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    Shared,
    Exclusive,
}

/// Takes an advisory lock on `file` (held until it is closed); with `wait` false, `Ok(false)`
/// when someone else holds a conflicting one.
pub fn flock(file: &File, lock: Lock, wait: bool) -> io::Result<bool> {
    let mut op = match lock {
        Lock::Shared => libc::LOCK_SH,
        Lock::Exclusive => libc::LOCK_EX,
    };
    if !wait {
        op |= libc::LOCK_NB;
    }
    // SAFETY: flock on a descriptor the caller owns for the duration of the call.
    if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::WouldBlock {
        return Ok(false);
    }
    Err(e)
}

/// The next data extent of `file` at or after `pos`: `(start, end)`, `None` when only a
/// hole is left (`SEEK_DATA`/`SEEK_HOLE`).
pub fn next_data(file: &File, pos: u64) -> io::Result<Option<(u64, u64)>> {
    // SAFETY: lseek on a descriptor the caller owns.
    let data = unsafe { libc::lseek(file.as_raw_fd(), pos as libc::off_t, libc::SEEK_DATA) };
    if data < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            return Ok(None);
        }
        return Err(e);
    }
    // SAFETY: as above.
    let hole = unsafe { libc::lseek(file.as_raw_fd(), data, libc::SEEK_HOLE) };
    if hole < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Some((data as u64, hole as u64)))
}

/// Copies `len` bytes from `src` at `from` to `dst` at the same offset in the kernel
/// (`copy_file_range`); returns how many it copied (0 at the end of `src`).
pub fn copy_range(src: &File, dst: &File, from: u64, len: u64) -> io::Result<u64> {
    let mut off_in = from as libc::loff_t;
    let mut off_out = from as libc::loff_t;
    // SAFETY: copy_file_range between two descriptors the caller owns, with explicit
    // offsets we own.
    let n = unsafe {
        libc::copy_file_range(
            src.as_raw_fd(),
            &mut off_in,
            dst.as_raw_fd(),
            &mut off_out,
            len as usize,
            0,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as u64)
}

/// Deallocates `len` bytes at `offset` of `file`, keeping its size (the range reads as
/// zeros).
pub fn punch_hole(file: &File, offset: u64, len: u64) -> io::Result<()> {
    // SAFETY: fallocate on a descriptor the caller owns; no memory passed.
    let r = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads `len` bytes at `offset` (both multiples of `align`, a power of two) into an
/// `align`-aligned window of a fresh buffer, as direct I/O needs; returns the buffer and
/// where the bytes start in it. The bytes before the window are zeros.
pub fn read_aligned(
    file: &File,
    offset: u64,
    len: usize,
    align: usize,
) -> io::Result<(Vec<u8>, usize)> {
    let mut buf: Vec<u8> = Vec::with_capacity(len + align);
    let start = buf.as_ptr().align_offset(align);
    let mut got = 0;
    while got < len {
        // SAFETY: the destination is the buffer's own spare capacity (start + len fits in
        // it); bytes become part of the Vec only once the kernel has written them.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                buf.as_mut_ptr().add(start + got).cast(),
                len - got,
                (offset + got as u64) as libc::off_t,
            )
        };
        match n {
            n if n < 0 => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => got += n as usize,
        }
    }
    // SAFETY: bytes start..start + len were written above; the ones before `start` are
    // zeroed here, so every byte of the new length is initialized.
    unsafe {
        std::ptr::write_bytes(buf.as_mut_ptr(), 0, start);
        buf.set_len(start + len);
    }
    Ok((buf, start))
}

/// Whether `dir` is on tmpfs.
pub fn on_tmpfs(dir: &Path) -> io::Result<bool> {
    let c = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a zeroed statfs is a valid out-parameter.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is NUL-terminated and st a valid statfs to fill.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64 == libc::TMPFS_MAGIC)
}

/// Bytes used on the filesystem holding `path`, and its size (blocks an unprivileged
/// writer can use). A filesystem without a free inode is full whatever its bytes (a
/// million empty files end a disk budget as surely as one big file): it is reported as
/// using its whole size.
pub fn disk_use(path: &Path) -> io::Result<(u64, u64)> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a zeroed statvfs is a valid out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is NUL-terminated and st a valid statvfs to fill.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let size = st.f_blocks * st.f_frsize;
    if st.f_files > 0 && st.f_favail == 0 {
        return Ok((size, size));
    }
    Ok((size.saturating_sub(st.f_bavail * st.f_frsize), size))
}

/// Whether `path` is the root of a mount (`statx`'s `STATX_ATTR_MOUNT_ROOT`, Linux 5.8+),
/// and the device of the filesystem mounted there (`stx_dev`). One system call, where
/// scanning `/proc/self/mountinfo` costs as much as the host has mounts. The last
/// component is not followed if it is a symlink.
pub fn mount_root(path: &Path) -> io::Result<(bool, u64)> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a zeroed statx is a valid out-parameter.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: c is NUL-terminated, st a valid statx to fill; AT_FDCWD resolves c as given.
    let r = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW | libc::AT_NO_AUTOMOUNT,
            libc::STATX_BASIC_STATS,
            &mut st,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    if st.stx_attributes_mask & libc::STATX_ATTR_MOUNT_ROOT as u64 == 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this kernel does not report mount roots through statx (Linux 5.8+)",
        ));
    }
    let root = st.stx_attributes & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0;
    let dev = libc::makedev(st.stx_dev_major, st.stx_dev_minor);
    Ok((root, dev))
}

/// `struct open_how` (linux/openat2.h).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
const RESOLVE_NO_SYMLINKS: u64 = 0x04;
const RESOLVE_BENEATH: u64 = 0x08;
const RESOLVE_IN_ROOT: u64 = 0x10;

/// Opens `rel` as if `root` were `/` (`openat2` with `RESOLVE_IN_ROOT`): symlinks and `..`
/// never leave it, magic links are refused. Close-on-exec.
pub fn open_in_root(root: &File, rel: &str, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    openat2(
        root,
        rel,
        flags,
        mode,
        RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS,
    )
}

/// Opens `rel` beneath the directory `root` without following any symlink on the way
/// (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`): a symlink anywhere in the path
/// fails with `ELOOP`, `..` out of `root` with `EXDEV`. Close-on-exec.
pub fn open_beneath(root: &impl AsRawFd, rel: &str, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    openat2(
        root,
        rel,
        flags,
        mode,
        RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    )
}

fn openat2(
    root: &impl AsRawFd,
    rel: &str,
    flags: i32,
    mode: u32,
    resolve: u64,
) -> io::Result<OwnedFd> {
    let c = CString::new(rel).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u64,
        mode: mode as u64,
        resolve,
    };
    // SAFETY: openat2 with a valid dirfd, path and open_how of the size we pass.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            c.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openat2 returned a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Makes directory `name` (one component) in the directory `parent`, mode 0755.
pub fn mkdir_at(parent: &impl AsRawFd, name: &str) -> io::Result<()> {
    let c = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: mkdirat relative to a directory descriptor the caller owns.
    if unsafe { libc::mkdirat(parent.as_raw_fd(), c.as_ptr(), 0o755) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn extents_locks_and_root_confinement() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let mut f = File::create(&path).unwrap();
        f.set_len(8 << 20).unwrap();
        f.seek(SeekFrom::Start(4 << 20)).unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        f.sync_all().unwrap();
        let f = File::open(&path).unwrap();
        let (start, end) = next_data(&f, 0).unwrap().expect("one extent");
        assert!(
            start <= 4 << 20 && end >= (4 << 20) + 4096,
            "{start}..{end}"
        );
        let copy = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("copy"))
            .unwrap();
        copy.set_len(8 << 20).unwrap();
        assert!(copy_range(&f, &copy, start, end - start).unwrap() > 0);
        let other = File::open(&path).unwrap();
        assert!(flock(&f, Lock::Exclusive, false).unwrap());
        assert!(!flock(&other, Lock::Shared, false).unwrap());
        // A symlink pointing out of the root resolves inside it.
        std::fs::create_dir(dir.path().join("root")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", dir.path().join("root/link")).unwrap();
        let root = File::open(dir.path().join("root")).unwrap();
        let e = open_in_root(&root, "link", libc::O_RDONLY, 0).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        mkdir_at(&root, "d").unwrap();
        assert!(dir.path().join("root/d").is_dir());
        // Beneath, no symlink is followed at all, and `..` cannot leave.
        std::os::unix::fs::symlink("d", dir.path().join("root/inner")).unwrap();
        let e = open_beneath(&root, "inner", libc::O_PATH, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP));
        let e = open_beneath(&root, "../root", libc::O_PATH, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EXDEV));
        assert!(open_beneath(&root, "d", libc::O_PATH | libc::O_DIRECTORY, 0).is_ok());
        let (used, size) = disk_use(dir.path()).unwrap();
        assert!(size > 0 && used <= size, "{used} of {size}");
    }
}
