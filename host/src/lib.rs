//! The host-call layer of lazyfs and the runtime: the system calls Strata makes that no
//! well-kept library wraps (or only with build-time bindgen, or not as needed): loop
//! devices ([`loopdev`]), locks, extents, in-kernel copies and root-confined opens
//! ([`fs`]), what a child does between fork and exec ([`exec`]),
//! launch mount namespaces that hold no sandbox's mounts ([`mountns`]),
//! Unix sockets at paths longer than an address holds ([`unix`]), read-only views over a
//! sandbox's root, shared by the host and a VM guest's agent ([`views`]),
//! whether the kernel mounts EROFS from a file ([`erofs_file_backed`]) and its Landlock
//! ABI. Every `unsafe` block of those crates is here, each with its reason; where `nix`
//! has the call, callers use `nix`.

pub mod exec;
pub mod fs;
pub mod loopdev;
pub mod mountns;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;
pub mod unix;
pub mod views;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// How this kernel mounts an EROFS image that is a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErofsSource {
    /// Straight from the file (Linux 6.12+, `CONFIG_EROFS_FS_BACKED_BY_FILE`).
    File,
    /// Through a loop device: the kernel refuses a file as the source.
    Loop,
}

/// Probes, with a scratch file in `dir`, whether the kernel mounts EROFS from a regular
/// file: it asks for a mount of a zero-filled file, which a kernel with file-backed EROFS
/// rejects as a bad image (EINVAL) and one without rejects as not a block device
/// (ENOTBLK). Nothing is ever mounted.
pub fn erofs_file_backed(dir: &Path) -> std::io::Result<ErofsSource> {
    let scratch = tempfile::NamedTempFile::new_in(dir)?;
    scratch.as_file().set_len(4096)?;
    let target = tempfile::tempdir_in(dir)?;
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    let (src, dst) = (c(scratch.path())?, c(target.path())?);
    // SAFETY: valid NUL-terminated strings; a zero-filled file is never a valid image, so
    // the call cannot succeed and mount anything.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            c"erofs".as_ptr(),
            libc::MS_RDONLY | libc::MS_NODEV | libc::MS_NOSUID,
            std::ptr::null(),
        )
    };
    if r == 0 {
        // SAFETY: umount2 of the path just (unexpectedly) mounted.
        unsafe { libc::umount2(dst.as_ptr(), libc::MNT_DETACH) };
        return Ok(ErofsSource::File);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOTBLK) => Ok(ErofsSource::Loop),
        // A file it read and found no image in.
        Some(libc::EINVAL) | Some(libc::EUCLEAN) => Ok(ErofsSource::File),
        Some(libc::ENODEV) => Err(std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "the kernel has no EROFS (modprobe erofs, or a kernel with CONFIG_EROFS_FS)",
        )),
        _ => Err(e),
    }
}

/// The Landlock ABI version this kernel offers (0: none, or disabled at boot).
pub fn landlock_abi() -> i64 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: landlock_create_ruleset with a null attribute and the VERSION flag only
    // returns the ABI version (or an error); it reads no memory.
    let abi = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    abi.max(0)
}
