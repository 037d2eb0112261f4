//! The agent's host-call layer: every system call it makes that needs `unsafe` (capability
//! sets, prctl, close_range, Landlock, ioctls on interfaces, disks and the entropy pool,
//! waitid, what a child does between fork and exec), each with its reason. Calls `nix`
//! wraps safely are made through `nix` where they are used instead.

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;

const LAST_CAP: u32 = 40;

/// Takes ownership of descriptor `fd`, which the host passed this process for it alone;
/// an error if no such descriptor is open (a descriptor owned twice, or not at all, is a
/// closed descriptor's double close later).
pub fn take_fd(fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: F_GETFD only reads the descriptor's flags.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the host passed this open descriptor for the agent alone; nothing else in
    // the process owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fork()` while the process has only one thread (before any is started).
pub fn fork_single_threaded() -> nix::Result<nix::unistd::ForkResult> {
    // SAFETY: the callers fork before starting any thread; the child only continues this
    // program.
    unsafe { nix::unistd::fork() }
}

/// The listening socket at `fd`, which stays open when the returned value is dropped (a
/// parked agent replaces it in place; see `serve::serve_parkable`).
pub fn borrow_listener(fd: RawFd) -> std::mem::ManuallyDrop<std::os::unix::net::UnixListener> {
    // SAFETY: `fd` is the agent's listening descriptor, owned by the serving loop for the
    // process's life; ManuallyDrop keeps this value from closing it.
    std::mem::ManuallyDrop::new(unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) })
}

/// Wakes an `accept` blocked on the listening socket `fd` (it fails from then on).
pub fn shut_listener(fd: RawFd) {
    // SAFETY: shutdown(2) on a descriptor number; no pointers.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
}

/// Replaces the listening socket at `fd` with a new unix socket, neither bound nor
/// listening: one a process checkpoint can save (it is the sandbox's own, not the host's),
/// and which the host, taking a copy of it with `pidfd_getfd`, binds at its own path and
/// makes listen, after a restore or a checkpoint that failed alike.
pub fn park_listener(fd: RawFd) -> std::io::Result<()> {
    use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
    let sock = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(std::io::Error::from)?;
    // SAFETY: dup3 onto the agent's own listening descriptor number, which only the
    // serving loop uses; the socket's original descriptor closes with `sock`.
    let done = unsafe { libc::dup3(sock.as_raw_fd(), fd, libc::O_CLOEXEC) };
    if done < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether `fd` is a listening socket.
pub fn is_listening(fd: RawFd) -> bool {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes one int into `value`, whose size `len` gives.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    r == 0 && value == 1
}

/// Closes every descriptor from 3 up but `keep`.
pub fn close_all_but(keep: RawFd) {
    let keep = keep.max(3) as libc::c_uint;
    // SAFETY: close_range takes no pointers; the descriptors closed are no one's after
    // the agent's start (what the OCI runtime passed and the agent has read).
    unsafe {
        if keep > 3 {
            libc::syscall(libc::SYS_close_range, 3u32, keep - 1, 0u32);
        }
        libc::syscall(libc::SYS_close_range, keep + 1, u32::MAX, 0u32);
    }
}

/// `fd` at descriptor number `target` (close-on-exec), the original closed.
pub fn onto(fd: OwnedFd, target: RawFd) -> std::io::Result<OwnedFd> {
    if fd.as_raw_fd() == target {
        return Ok(fd);
    }
    // SAFETY: dup3 onto a descriptor number the caller has kept free for it (the agent's
    // listening socket, before it opens anything else); the new descriptor is ours alone.
    let got = unsafe { libc::dup3(fd.as_raw_fd(), target, libc::O_CLOEXEC) };
    if got < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: dup3 made descriptor `target` for this process just now.
    Ok(unsafe { OwnedFd::from_raw_fd(target) })
}

/// Points descriptor `target` at `fd` (stdio onto /dev/null).
pub fn dup_onto(fd: &OwnedFd, target: RawFd) {
    // SAFETY: dup2 of a descriptor we own onto a standard descriptor number.
    unsafe { libc::dup2(fd.as_raw_fd(), target) };
}

/// Signals process group `pgid`.
pub fn signal_group(pgid: i32, signal: i32) {
    // SAFETY: kill(2) with a negative PID (a process group); no pointers.
    unsafe { libc::kill(-pgid, signal) };
}

/// Sleeps until a child has exited and returns its PID, leaving it waitable (`WNOWAIT`);
/// `None` when there is no child at all.
pub fn wait_for_exit() -> Option<i32> {
    // SAFETY: a zeroed siginfo_t is valid; waitid fills it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid on any child with a valid out pointer; WNOWAIT leaves it waitable.
    let r = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
    if r != 0 {
        return None;
    }
    // SAFETY: si_pid of a siginfo waitid filled in for an exited child.
    Some(unsafe { info.si_pid() })
}

/// Reaps child `pid` if it has exited; its raw wait status.
pub fn reap(pid: i32) -> Option<i32> {
    let mut status = 0;
    // SAFETY: waitpid on that child with a valid out pointer; WNOHANG never blocks.
    let got = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    (got == pid).then_some(status)
}

/// Runs `hook` in the child between fork and exec. The hook must make system calls only
/// (async-signal-safe) and allocate nothing: the agent is multi-threaded.
pub fn before_exec(
    cmd: &mut std::process::Command,
    hook: impl FnMut() -> std::io::Result<()> + Send + Sync + 'static,
) {
    // SAFETY: every hook passed here (the agent's command setup) only makes system calls
    // through this module's functions, which allocate nothing.
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// Sets every signal a process may catch back to its default action: for a forked child
/// before exec (no allocation). A signal ignored by whoever started the node (`nohup`, a
/// script's background job: SIGHUP, SIGINT, SIGQUIT; something up the chain also leaves
/// signal 32 ignored) stays ignored across every exec down to the sandbox's commands,
/// which would then not stop on Ctrl-C, a hang-up, or a runtime's own signals. The raw
/// system call: libc's wrapper refuses the signals it reserves (32, 33).
pub fn default_signals() {
    // The kernel's struct sigaction, all zero: SIG_DFL, no flags, an empty mask.
    let default = [0u64; 4];
    for sig in 1..=64 {
        if sig != libc::SIGKILL && sig != libc::SIGSTOP {
            // SAFETY: rt_sigaction reads a struct sigaction from a buffer we hold (32
            // bytes, larger than the kernel's on every architecture), writes nothing back
            // (null old action); the set size is the kernel's (64 signals, 8 bytes).
            unsafe {
                libc::syscall(
                    libc::SYS_rt_sigaction,
                    sig,
                    default.as_ptr(),
                    std::ptr::null_mut::<u64>(),
                    8usize,
                )
            };
        }
    }
}

/// Opens `path`, writes `value`, closes it: for a forked child (no allocation).
pub fn write_now(path: &CStr, value: &[u8]) -> std::io::Result<()> {
    // SAFETY: open of a NUL-terminated path; the descriptor is closed below.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: write of a buffer we hold, of its length, to the descriptor opened above.
    let ok = unsafe { libc::write(fd, value.as_ptr().cast(), value.len()) } == value.len() as isize;
    let err = std::io::Error::last_os_error();
    // SAFETY: closes the descriptor opened above, once.
    unsafe { libc::close(fd) };
    if !ok {
        return Err(err);
    }
    Ok(())
}

/// Sets no_new_privs: no exec gains privileges (set-user-ID, file capabilities).
pub fn no_new_privs() -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS, 1) takes no pointers.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// RLIMIT_CORE 0: no core dumps of the sandbox's processes.
pub fn no_core_dumps() {
    let zero = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: setrlimit with a valid rlimit struct.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &zero) };
}

/// Restricts the calling thread with a prepared Landlock ruleset (a new domain).
pub fn landlock_restrict(ruleset: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: landlock_restrict_self with a ruleset descriptor we own and no flags.
    let r = unsafe { libc::syscall(libc::SYS_landlock_restrict_self, ruleset.as_raw_fd(), 0) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

nix::ioctl_none!(blk_reread_partitions, 0x12, 95);

/// Reads disk `f`'s partition table again (BLKRRPART).
pub fn reread_partitions(f: &File) -> nix::Result<()> {
    // SAFETY: BLKRRPART takes no argument; nothing has the disk's partitions open.
    unsafe { blk_reread_partitions(f.as_raw_fd()) }.map(drop)
}

/// Credits `info` (a `struct rand_pool_info`: entropy bits, byte count, bytes) to the
/// kernel's entropy pool through `urandom`.
pub fn add_entropy(urandom: &File, info: &[u8]) -> std::io::Result<()> {
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    if info.len() < 8 {
        return Err(std::io::ErrorKind::InvalidInput.into());
    }
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of the length its header states, which
    // the caller built over exactly the bytes that follow it.
    if unsafe { libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

pub fn loopback_up() -> Result<(), String> {
    // SAFETY: a datagram socket and two SIOC*IFFLAGS ioctls on a zeroed ifreq we own.
    unsafe {
        let s = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if s < 0 {
            return Err(format!("socket: {}", std::io::Error::last_os_error()));
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (i, b) in b"lo\0".iter().enumerate() {
            req.ifr_name[i] = *b as libc::c_char;
        }
        let mut r = libc::ioctl(s, libc::SIOCGIFFLAGS, &mut req);
        if r == 0 {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            r = libc::ioctl(s, libc::SIOCSIFFLAGS, &req);
        }
        let err = std::io::Error::last_os_error();
        libc::close(s);
        if r != 0 {
            return Err(format!("bringing up lo: {err}"));
        }
    }
    Ok(())
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Removes every capability but the policy's from the bounding set: no later exec, of a
/// set-user-ID file or not, gets one back.
pub fn drop_bounding(kept: &[(&str, u32)]) -> std::io::Result<()> {
    for cap in 0..=LAST_CAP {
        if kept.iter().any(|(_, c)| *c == cap) {
            continue;
        }
        // SAFETY: PR_CAPBSET_DROP takes a capability number; EINVAL for caps this kernel lacks.
        let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Sets the effective and permitted sets to the policy's, nothing inheritable.
pub fn keep_caps(kept: &[(&str, u32)]) -> std::io::Result<()> {
    let mut mask = [0u32; 2];
    for (_, cap) in kept {
        mask[(cap / 32) as usize] |= 1 << (cap % 32);
    }
    let header = CapHeader {
        version: 0x2008_0522,
        pid: 0,
    };
    let data = [
        CapData {
            effective: mask[0],
            permitted: mask[0],
            inheritable: 0,
        },
        CapData {
            effective: mask[1],
            permitted: mask[1],
            inheritable: 0,
        },
    ];
    // SAFETY: capset with a v3 header and two data structs.
    let r = unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the agent non-dumpable: its memory, environment, descriptors and executable in
/// /proc are then closed to every process without CAP_SYS_PTRACE (no command has it), and
/// it cannot be ptraced. Inherited by a fork until the child's exec.
pub fn not_dumpable() {
    // SAFETY: prctl(PR_SET_DUMPABLE, 0) takes no pointers.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
}

/// Marks every descriptor from `from` up close-on-exec, so none of the agent's reaches a
/// command (std's own exec-error pipe is close-on-exec already).
pub fn cloexec_from(from: u32) -> std::io::Result<()> {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range takes no pointers; with CLOEXEC it only sets descriptor flags.
    let r = unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, CLOSE_RANGE_CLOEXEC) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Becomes `uid`:`gid` with no supplementary groups.
pub fn set_ids(uid: u32, gid: u32) -> std::io::Result<()> {
    let check = |r: libc::c_int| {
        if r != 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    // SAFETY: setgroups with an empty list, then setgid and setuid: no pointers read.
    unsafe {
        check(libc::setgroups(0, std::ptr::null()))?;
        check(libc::setgid(gid))?;
        check(libc::setuid(uid))
    }
}

/// Makes `gateway` the only default route (an earlier one, a restored copy's old link,
/// is removed first).
pub fn default_route(gateway: std::net::Ipv4Addr) -> Result<(), String> {
    let err = |what: &str| format!("{what} via {gateway}: {}", std::io::Error::last_os_error());
    // SAFETY: a datagram socket and SIOCDELRT/SIOCADDRT on zeroed rtentry structs we own,
    // whose sockaddrs are written as sockaddr_in (the layout the kernel reads for AF_INET).
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(err("socket for the route"));
        }
        let sockaddr = |ip: std::net::Ipv4Addr| {
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from_ne_bytes(ip.octets());
            std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sa)
        };
        let any = std::net::Ipv4Addr::UNSPECIFIED;
        let mut old: libc::rtentry = std::mem::zeroed();
        old.rt_dst = sockaddr(any);
        old.rt_genmask = sockaddr(any);
        // Until none is left (ESRCH).
        while libc::ioctl(fd, libc::SIOCDELRT, &old) == 0 {}
        let mut rt: libc::rtentry = std::mem::zeroed();
        rt.rt_dst = sockaddr(any);
        rt.rt_genmask = sockaddr(any);
        rt.rt_gateway = sockaddr(gateway);
        rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
        let result = if libc::ioctl(fd, libc::SIOCADDRT, &rt) != 0 {
            Err(err("adding the default route"))
        } else {
            Ok(())
        };
        libc::close(fd);
        result
    }
}

/// Brings an interface up, with an IPv4 address when given (`lo` needs none: programs
/// expect localhost even without a network).
pub fn interface_up(name: &str, addr: Option<(std::net::Ipv4Addr, u8)>) -> Result<(), String> {
    let err = |what: &str| format!("{what} {name}: {}", std::io::Error::last_os_error());
    // SAFETY: a datagram socket and SIOC* ioctls on zeroed ifreqs naming the interface.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(err("socket for"));
        }
        let new_req = || {
            let mut req: libc::ifreq = std::mem::zeroed();
            for (i, b) in name.bytes().take(libc::IFNAMSIZ - 1).enumerate() {
                req.ifr_name[i] = b as libc::c_char;
            }
            req
        };
        let sockaddr = |ip: std::net::Ipv4Addr| {
            let mut sa: libc::sockaddr_in = std::mem::zeroed();
            sa.sin_family = libc::AF_INET as libc::sa_family_t;
            sa.sin_addr.s_addr = u32::from_ne_bytes(ip.octets());
            std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sa)
        };
        let result = (|| {
            if let Some((ip, prefix)) = addr {
                let mut req = new_req();
                req.ifr_ifru.ifru_addr = sockaddr(ip);
                if libc::ioctl(fd, libc::SIOCSIFADDR, &req) != 0 {
                    return Err(err("setting the address of"));
                }
                let mask = u32::MAX.checked_shl(32 - prefix as u32).unwrap_or(0);
                let mut req = new_req();
                req.ifr_ifru.ifru_netmask = sockaddr(std::net::Ipv4Addr::from(mask));
                if libc::ioctl(fd, libc::SIOCSIFNETMASK, &req) != 0 {
                    return Err(err("setting the netmask of"));
                }
            }
            let mut req = new_req();
            if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) != 0 {
                return Err(err("reading the flags of"));
            }
            req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            if libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) != 0 {
                return Err(err("bringing up"));
            }
            Ok(())
        })();
        libc::close(fd);
        result
    }
}
