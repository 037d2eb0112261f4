//! What a child process does between fork and exec, for the commands Strata starts:
//! joining cgroups, dying with its parent, receiving descriptors at fixed numbers, leaving
//! a cgroup2 mount out of its view. Each hook only makes system calls (async-signal-safe)
//! and allocates nothing.

use std::ffi::CString;
use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes `cmd` write its PID into each of `procs` (cgroup.procs files) before it execs, so
/// everything it starts is inside from its first instruction.
pub fn join_cgroups(cmd: &mut Command, procs: Vec<CString>) {
    // SAFETY: only open/write/close run between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            for p in &procs {
                let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let r = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                if r != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Makes `cmd` receive SIGKILL when the thread that started it dies.
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl(PR_SET_PDEATHSIG) between fork and exec takes no pointers.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Makes `cmd` get `fds` as its descriptors 3, 4, ... in order (for an OCI runtime's
/// `--preserve-fds`), and, when `hide` names a mount point, run in a private mount
/// namespace where that mount is detached (how Debian's crun is made to accept a hybrid
/// cgroup host, by not seeing its cgroup2 mount).
pub fn pass_fds_and_hide(cmd: &mut Command, fds: Vec<i32>, hide: Option<CString>) {
    if fds.is_empty() && hide.is_none() {
        return;
    }
    // SAFETY: only fcntl, dup2, close, unshare, mount and umount2 between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // Copied out of the way first, so no dup2 onto a target overwrites a source
            // still to be placed.
            let mut high = [0i32; 8];
            for (i, fd) in fds.iter().enumerate().take(high.len()) {
                high[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 64);
                if high[i] < 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            for (i, fd) in high.iter().take(fds.len()).enumerate() {
                // dup2 clears close-on-exec on the copy.
                if libc::dup2(*fd, 3 + i as i32) < 0 {
                    return Err(io::Error::last_os_error());
                }
                libc::close(*fd);
            }
            if let Some(path) = &hide {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    return Err(io::Error::last_os_error());
                }
                if libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
                libc::umount2(path.as_ptr(), libc::MNT_DETACH);
            }
            Ok(())
        });
    }
}
