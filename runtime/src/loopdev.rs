//! Attaching an image file to a free loop device with `LOOP_CONFIGURE` (one ioctl, with
//! autoclear: the device detaches itself when the filesystem on it is unmounted), so an
//! upper mounts without spawning `mount(8)`. The loop ioctls are a small, stable kernel
//! ABI; the crates wrapping them need libclang at build time for bindgen.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::RuntimeError;

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;

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

/// A loop device bound to an image; the kernel frees it once it is unmounted and this
/// handle is dropped.
pub struct LoopDevice {
    pub path: PathBuf,
    _device: File,
}

/// Binds `image` to a free loop device.
pub fn attach(image: &Path) -> Result<LoopDevice, RuntimeError> {
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .map_err(RuntimeError::io(Path::new("/dev/loop-control")))?;
    let backing = OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .map_err(RuntimeError::io(image))?;
    // Concurrent creates would all be handed the same free device: take turns (the lock
    // is on the control device's inode, so it holds across processes), and still retry
    // should a process that does not take it (losetup) win the race.
    // SAFETY: flock on an owned descriptor; released when `control` is closed.
    if unsafe { libc::flock(control.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(RuntimeError::io(Path::new("/dev/loop-control"))(
            std::io::Error::last_os_error(),
        ));
    }
    for _ in 0..16 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let number = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if number < 0 {
            return Err(RuntimeError::io(Path::new("/dev/loop-control"))(
                std::io::Error::last_os_error(),
            ));
        }
        let path = PathBuf::from(format!("/dev/loop{number}"));
        let device = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(RuntimeError::io(&path))?;
        // SAFETY: an all-zero loop_config is valid; the fields set below are plain data.
        let mut config: LoopConfig = unsafe { std::mem::zeroed() };
        config.fd = backing.as_raw_fd() as u32;
        config.info.flags = LO_FLAGS_AUTOCLEAR;
        // SAFETY: LOOP_CONFIGURE reads a loop_config that outlives the call.
        let r = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE, &config) };
        if r == 0 {
            return Ok(LoopDevice {
                path,
                _device: device,
            });
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EBUSY) {
            return Err(RuntimeError::Setup(format!(
                "binding {} to {}: {err}",
                image.display(),
                path.display()
            )));
        }
    }
    Err(RuntimeError::Setup(format!(
        "no free loop device for {} after 16 tries",
        image.display()
    )))
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
