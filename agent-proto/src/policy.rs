//! The confinement every sandbox gets, whichever backend builds it: the capabilities it
//! keeps and the syscalls it is refused. One list, so fncall, containers and VM guests agree.

/// The usual container set, without MKNOD and NET_RAW (no raw-socket network scans).
pub const KEPT_CAPS: &[(&str, u32)] = &[
    ("CAP_CHOWN", 0),
    ("CAP_DAC_OVERRIDE", 1),
    ("CAP_FOWNER", 3),
    ("CAP_FSETID", 4),
    ("CAP_KILL", 5),
    ("CAP_SETGID", 6),
    ("CAP_SETUID", 7),
    ("CAP_SETPCAP", 8),
    ("CAP_NET_BIND_SERVICE", 10),
    ("CAP_SYS_CHROOT", 18),
];

/// Syscalls a sandboxed process may make: what Linux programs, language runtimes, build
/// tools and debuggers of their own children use (close to Docker's default profile).
/// Every syscall not listed here or in [`DENIED_SYSCALLS`] is answered `ENOSYS`, as if the
/// kernel had no such call, so a program takes the fallback it has for older kernels
/// (glibc does for `clone3`), and a syscall added to a later kernel is refused until it is
/// reviewed and listed. Names are per architecture: a name the build's architecture does
/// not have (`open` on aarch64) is left out there ([`resolve`]).
///
/// `ioctl`, `clone` and `socket` are listed, but some of their arguments are refused with
/// EPERM: [`DENIED_IOCTLS`], [`NAMESPACE_FLAGS`], [`DENIED_SOCKET_FAMILIES`].
#[rustfmt::skip]
pub const ALLOWED_SYSCALLS: &[&str] = &[
    // Files and descriptors.
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev",
    "preadv2", "pwritev2", "open", "openat", "openat2", "creat", "close", "close_range",
    "dup", "dup2", "dup3", "pipe", "pipe2", "lseek", "stat", "fstat", "lstat", "newfstatat",
    "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2", "fcntl", "flock",
    "fsync", "fdatasync", "sync", "syncfs", "sync_file_range", "truncate", "ftruncate",
    "fallocate", "fadvise64", "readahead", "getdents", "getdents64", "rename", "renameat",
    "renameat2", "mkdir", "mkdirat", "rmdir", "link", "linkat", "unlink", "unlinkat",
    "symlink", "symlinkat", "readlink", "readlinkat", "chmod", "fchmod", "fchmodat",
    "fchmodat2", "chown", "fchown", "lchown", "fchownat", "utime", "utimes", "utimensat",
    "futimesat", "mknod", "mknodat", "umask", "chdir", "fchdir", "getcwd", "chroot",
    "setxattr", "lsetxattr", "fsetxattr", "getxattr", "lgetxattr", "fgetxattr",
    "listxattr", "llistxattr", "flistxattr", "removexattr", "lremovexattr",
    "fremovexattr", "setxattrat", "getxattrat", "listxattrat", "removexattrat",
    "sendfile", "splice", "tee", "vmsplice", "copy_file_range", "ioctl", "memfd_create",
    "memfd_secret", "cachestat", "inotify_init", "inotify_init1", "inotify_add_watch",
    "inotify_rm_watch", "fanotify_mark",
    // Waiting on descriptors, timers and signals as descriptors.
    "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl",
    "epoll_wait", "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2", "signalfd",
    "signalfd4", "timerfd_create", "timerfd_settime", "timerfd_gettime",
    // Asynchronous I/O (not io_uring: see DENIED_SYSCALLS).
    "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    // Memory.
    "brk", "mmap", "munmap", "mprotect", "mremap", "madvise", "mincore", "msync",
    "remap_file_pages", "mlock", "mlock2", "munlock", "mlockall", "munlockall",
    "get_mempolicy", "set_mempolicy", "mbind", "set_mempolicy_home_node", "pkey_alloc",
    "pkey_free", "pkey_mprotect", "mseal", "map_shadow_stack", "membarrier",
    // Processes and threads.
    "fork", "vfork", "clone", "execve", "execveat", "exit", "exit_group", "wait4",
    "waitid", "getpid", "getppid", "gettid", "set_tid_address", "set_robust_list",
    "get_robust_list", "futex", "futex_waitv", "futex_wake", "futex_wait", "futex_requeue",
    "rseq", "arch_prctl", "set_thread_area", "get_thread_area", "prctl", "personality",
    "seccomp", "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise",
    "process_mrelease", "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "uretprobe",
    "restart_syscall",
    // Credentials (within the capabilities the policy keeps).
    "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups",
    "setgroups", "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid",
    "setfsuid", "setfsgid", "capget", "capset", "getpgid", "setpgid", "getpgrp", "getsid",
    "setsid",
    // Signals.
    "kill", "tkill", "tgkill", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn",
    "rt_sigpending", "rt_sigsuspend", "rt_sigtimedwait", "rt_sigqueueinfo",
    "rt_tgsigqueueinfo", "sigaltstack", "pause", "alarm",
    // Time and scheduling.
    "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday",
    "time", "times", "getitimer", "setitimer", "timer_create", "timer_settime",
    "timer_gettime", "timer_getoverrun", "timer_delete", "sched_yield", "sched_setparam",
    "sched_getparam", "sched_setscheduler", "sched_getscheduler",
    "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval",
    "sched_setaffinity", "sched_getaffinity", "sched_setattr", "sched_getattr",
    "getpriority", "setpriority", "ioprio_get", "ioprio_set", "getcpu",
    // System information and limits.
    "uname", "sysinfo", "getrusage", "getrlimit", "setrlimit", "prlimit64", "getrandom",
    "lsm_get_self_attr", "lsm_list_modules",
    // Sockets (no raw sockets: CAP_NET_RAW is not kept).
    "socket", "socketpair", "bind", "listen", "accept", "accept4", "connect",
    "getsockname", "getpeername", "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg",
    "recvmmsg", "setsockopt", "getsockopt", "shutdown",
    // System V and POSIX IPC (the sandbox's own IPC namespace).
    "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semctl", "semtimedop",
    "shmget", "shmat", "shmdt", "shmctl", "mq_open", "mq_unlink", "mq_timedsend",
    "mq_timedreceive", "mq_notify", "mq_getsetattr",
];

/// Syscalls that widen the attack surface or undo the confinement: refused with EPERM
/// (a clear "not allowed", where an unlisted call is ENOSYS).
#[rustfmt::skip]
pub const DENIED_SYSCALLS: &[&str] = &[
    "mount", "umount2", "pivot_root", "fsopen", "fsmount", "fsconfig", "fspick",
    "move_mount", "open_tree", "open_tree_attr", "mount_setattr", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
    "unshare", "setns", "swapon", "swapoff", "reboot", "open_by_handle_at",
    "name_to_handle_at", "userfaultfd", "acct", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "iopl", "ioperm", "quotactl", "quotactl_fd", "syslog",
    "vhangup", "sethostname", "setdomainname",
    // io_uring runs operations from kernel workers that seccomp never sees.
    "io_uring_setup", "io_uring_enter", "io_uring_register",
];

/// An `ioctl` request refused with EPERM: those whose request number's low 32 bits, masked
/// with `mask`, equal `value`. A mask of `0xffff` matches the request's type and number
/// whatever its size and direction bits say, so a variant with another size is caught too.
#[derive(Debug, Clone, Copy)]
pub struct IoctlRule {
    pub name: &'static str,
    pub mask: u32,
    pub value: u32,
}

const fn ioctl(name: &'static str, mask: u32, value: u32) -> IoctlRule {
    IoctlRule { name, mask, value }
}

/// File system ioctls that rewrite where a file's blocks are, share them, or act on a
/// whole file system: extent swaps (the XFS corruption in DSec's report), reflinks and
/// dedupe (every request of type 0x94, btrfs's and the generic `FICLONE*`), moving
/// extents, resizing, freezing, trimming, shutting down, flag and attribute changes, the
/// physical block map; and the terminal requests that push input into another process's
/// terminal.
pub const DENIED_IOCTLS: &[IoctlRule] = &[
    ioctl(
        "FICLONE, FICLONERANGE, FIDEDUPERANGE, BTRFS_IOC_*",
        0xff00,
        0x9400,
    ),
    ioctl("XFS_IOC_SWAPEXT", 0xffff, 0x586d),
    ioctl("XFS_IOC_EXCHANGE_RANGE", 0xffff, 0x5881),
    ioctl("EXT4_IOC_MOVE_EXT", 0xffff, 0x660f),
    ioctl("EXT4_IOC_SWAP_BOOT", 0xffff, 0x6611),
    ioctl("EXT4_IOC_RESIZE_FS", 0xffff, 0x6610),
    ioctl("EXT4_IOC_GROUP_EXTEND", 0xffff, 0x6607),
    ioctl("EXT4_IOC_GROUP_ADD", 0xffff, 0x6608),
    ioctl("EXT4_IOC_CHECKPOINT", 0xffff, 0x662b),
    ioctl("EXT4_IOC_SETFSUUID", 0xffff, 0x662c),
    ioctl("FS_IOC_SETFLAGS", 0xffff, 0x6602),
    ioctl("FS_IOC_FSSETXATTR", 0xffff, 0x5820),
    ioctl("FS_IOC_FIEMAP", 0xffff, 0x660b),
    ioctl("FS_IOC_SHUTDOWN", 0xffff, 0x587d),
    ioctl("FIFREEZE", 0xffff, 0x5877),
    ioctl("FITHAW", 0xffff, 0x5878),
    ioctl("FITRIM", 0xffff, 0x5879),
    ioctl("TIOCSTI", 0xffff, 0x5412),
    ioctl("TIOCLINUX", 0xffff, 0x541c),
];

/// `clone` flags that make new namespaces: refused with EPERM (namespaces come only from
/// the runtime). `clone3`, whose flags seccomp cannot read, is unlisted (ENOSYS), so libc
/// falls back to `clone`.
pub const NAMESPACE_FLAGS: &[u64] = &[
    0x0002_0000, // CLONE_NEWNS
    0x0200_0000, // CLONE_NEWCGROUP
    0x0400_0000, // CLONE_NEWUTS
    0x0800_0000, // CLONE_NEWIPC
    0x1000_0000, // CLONE_NEWUSER
    0x2000_0000, // CLONE_NEWPID
    0x4000_0000, // CLONE_NEWNET
    0x0000_0080, // CLONE_NEWTIME
];

/// Socket families refused with EPERM: vsock reaches the hypervisor's host side of a VM,
/// which no sandbox may talk to but through its agent.
pub const DENIED_SOCKET_FAMILIES: &[(&str, u64)] = &[("AF_VSOCK", 40)];

/// The errno of a syscall neither allowed nor denied by name.
pub const UNLISTED_ERRNO: i32 = libc::ENOSYS;

/// `names` with their numbers on this build's architecture; a name the architecture does
/// not have is left out.
pub fn resolve(names: &'static [&'static str]) -> impl Iterator<Item = (&'static str, i64)> {
    names.iter().filter_map(|name| {
        name.parse::<syscalls::Sysno>()
            .ok()
            .map(|s| (*name, s.id() as i64))
    })
}

/// Kernel files a sandbox must not read: unreadable (an empty file or directory is
/// mounted over them). runc's defaults, and the kernel's page tables of the host's memory
/// (`/proc/kpage*`): a recursive grep that read `/proc/kpagecgroup` crashed a host kernel
/// in DSec's report, and they show every page of the host.
/// The size of a host sandbox's /dev: device nodes and links only.
pub const DEV_TMPFS_BYTES: u64 = 1 << 20;

/// The size of a host sandbox's /dev/shm under a memory budget of `memory_bytes`: a
/// quarter of it, between 1 and 64 MiB. tmpfs pages count against the budget but belong
/// to no process, so a /dev/shm as large as the budget, filled, would leave the OOM
/// killer only the sandbox's agent to kill: the sandbox lost instead of a write refused.
pub fn shm_bytes(memory_bytes: u64) -> u64 {
    (memory_bytes / 4).clamp(1 << 20, 64 << 20)
}

pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/kpagecgroup",
    "/proc/kpageflags",
    "/proc/kpagecount",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// Kernel files a sandbox may read but not write (runc's defaults).
pub const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn on(arch: &str, name: &str) -> bool {
        match arch {
            "x86_64" => name.parse::<syscalls::x86_64::Sysno>().is_ok(),
            _ => name.parse::<syscalls::aarch64::Sysno>().is_ok(),
        }
    }

    /// A misspelt name would silently allow or deny nothing: every name is a syscall of
    /// x86_64 or aarch64, and the lists neither repeat nor overlap.
    #[test]
    fn every_name_is_a_syscall_once() {
        let mut seen = HashSet::new();
        for name in ALLOWED_SYSCALLS.iter().chain(DENIED_SYSCALLS) {
            assert!(seen.insert(*name), "{name} is listed twice");
            assert!(
                on("x86_64", name) || on("aarch64", name),
                "{name} is no syscall of x86_64 or aarch64"
            );
        }
    }

    #[test]
    fn the_everyday_calls_resolve_on_this_architecture() {
        let allowed: HashSet<&str> = resolve(ALLOWED_SYSCALLS).map(|(n, _)| n).collect();
        for name in [
            "read",
            "openat",
            "execve",
            "clone",
            "ioctl",
            "mmap",
            "exit_group",
        ] {
            assert!(allowed.contains(name), "{name}");
        }
        let denied: HashSet<&str> = resolve(DENIED_SYSCALLS).map(|(n, _)| n).collect();
        for name in ["mount", "bpf", "io_uring_setup", "unshare", "userfaultfd"] {
            assert!(denied.contains(name), "{name}");
        }
        assert!(
            !allowed.contains("clone3"),
            "clone3 must stay unlisted (ENOSYS)"
        );
    }

    #[test]
    fn ioctl_rules_match_the_requests_they_name() {
        let refused = |req: u32| DENIED_IOCTLS.iter().any(|r| req & r.mask == r.value);
        // FICLONE, FICLONERANGE, FIDEDUPERANGE, FS_IOC_FIEMAP, FS_IOC_SETFLAGS (64-bit).
        for req in [
            0x4004_9409,
            0x4020_940d,
            0xc018_9436,
            0xc020_660b,
            0x4008_6602,
        ] {
            assert!(refused(req), "{req:#x}");
        }
        // TCGETS, FIONREAD, FS_IOC_GETFLAGS stay allowed.
        for req in [0x5401, 0x541b, 0x8008_6601] {
            assert!(!refused(req), "{req:#x}");
        }
    }
}
