//! Binding a file to a free loop device with `LOOP_CONFIGURE` (one ioctl: backing file,
//! flags and block size at once; Linux 5.8+). With autoclear the device detaches itself
//! once the filesystem on it is unmounted and the last descriptor is closed, so nothing
//! is left to clean up. The loop ioctls are a small, stable kernel ABI; the crates
//! wrapping them need libclang at build time for bindgen.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// `struct loop_info64` (linux/loop.h).
#[repr(C)]
struct LoopInfo64 {
    device: u64,
    inode: u64,
    rdevice: u64,
    offset: u64,
    sizelimit: u64,
    number: u32,
    encrypt_type: u32,
    encrypt_key_size: u32,
    flags: u32,
    file_name: [u8; 64],
    crypt_name: [u8; 64],
    encrypt_key: [u8; 32],
    init: [u64; 2],
}

/// `struct loop_config` (linux/loop.h, Linux 5.8+).
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// How to bind a file.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    pub read_only: bool,
    /// The device reads and writes the file with direct I/O, so its data is cached once
    /// (in the device's page cache), not twice.
    pub direct_io: bool,
    /// Block size of the device (0: 512).
    pub block_size: u32,
}

/// A loop device bound to a file; the kernel frees it once nothing has it open or
/// mounted (autoclear).
#[derive(Debug)]
pub struct LoopDevice {
    pub path: PathBuf,
    _device: File,
}

fn context(what: String) -> impl FnOnce(io::Error) -> io::Error {
    move |e| io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Binds `file` to a free loop device.
pub fn attach(file: &Path, opts: Options) -> io::Result<LoopDevice> {
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .map_err(context(
            "/dev/loop-control (load the loop module: modprobe loop)".into(),
        ))?;
    let backing = OpenOptions::new()
        .read(true)
        .write(!opts.read_only)
        .open(file)
        .map_err(context(file.display().to_string()))?;
    // Concurrent attaches would all be handed the same free device: take turns (the lock
    // is on the control device's inode, so it holds across processes), and still retry
    // should a process that does not take it (losetup) win the race.
    // SAFETY: flock on an owned descriptor; released when `control` is closed.
    if unsafe { libc::flock(control.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(context("locking /dev/loop-control".into())(
            io::Error::last_os_error(),
        ));
    }
    let mut flags = LO_FLAGS_AUTOCLEAR;
    if opts.read_only {
        flags |= LO_FLAGS_READ_ONLY;
    }
    if opts.direct_io {
        flags |= LO_FLAGS_DIRECT_IO;
    }
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let number = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if number < 0 {
            return Err(context("LOOP_CTL_GET_FREE".into())(
                io::Error::last_os_error(),
            ));
        }
        let path = PathBuf::from(format!("/dev/loop{number}"));
        let device = OpenOptions::new()
            .read(true)
            .write(!opts.read_only)
            .open(&path)
            .map_err(context(path.display().to_string()))?;
        // SAFETY: an all-zero loop_config is valid; the fields set below are plain data.
        let mut config: LoopConfig = unsafe { std::mem::zeroed() };
        config.fd = backing.as_raw_fd() as u32;
        config.block_size = opts.block_size;
        config.info.flags = flags;
        // SAFETY: LOOP_CONFIGURE reads a loop_config that outlives the call.
        let r = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE, &config) };
        if r == 0 {
            return Ok(LoopDevice {
                path,
                _device: device,
            });
        }
        let err = io::Error::last_os_error();
        // Direct I/O the backing filesystem cannot do: bind it buffered instead.
        if opts.direct_io && err.raw_os_error() == Some(libc::EINVAL) {
            return attach(
                file,
                Options {
                    direct_io: false,
                    ..opts
                },
            );
        }
        if err.raw_os_error() != Some(libc::EBUSY) {
            return Err(context(format!(
                "binding {} to {}",
                file.display(),
                path.display()
            ))(err));
        }
    }
    Err(io::Error::other(format!(
        "no free loop device for {} after 16 tries",
        file.display()
    )))
}

impl LoopDevice {
    /// Sets how far the kernel reads ahead on the device (`queue/read_ahead_kb`).
    pub fn set_read_ahead(&self, kib: u32) -> io::Result<()> {
        let name = self
            .path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        std::fs::write(
            format!("/sys/block/{name}/queue/read_ahead_kb"),
            kib.to_string(),
        )
    }
}

/// The file loop device `dev` (`/dev/loopN`) is bound to, if it is bound.
pub fn backing_file(dev: &Path) -> Option<PathBuf> {
    let name = dev.file_name()?.to_str()?;
    if !name.starts_with("loop") {
        return None;
    }
    let text = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(PathBuf::from(text.trim_end_matches('\n')))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structs_match_the_kernel_abi() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }
}
