//! Turning the agent into the confined init of a sandbox: the root filesystem, /proc,
//! /dev and /sys inside it, the pivot, then the restrictions every command inherits.

use std::collections::BTreeMap;
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use strata_agent::policy::{DENIED_SYSCALLS, KEPT_CAPS};

const LAST_CAP: u32 = 40;

const NAMESPACE_FLAGS: [u64; 8] = [
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWCGROUP as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    0x80, // CLONE_NEWTIME
];

pub fn enter(rootfs: &Path, hostname: &str) -> Result<(), String> {
    mount_filesystems(rootfs)?;
    nix::unistd::sethostname(hostname).map_err(|e| format!("sethostname: {e}"))?;
    loopback_up()?;
    limit_resources()?;
    drop_capabilities()?;
    landlock_filesystem()?;
    seccomp_filter()?;
    Ok(())
}

fn ctx<T>(what: &str, r: nix::Result<T>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

fn mount_filesystems(root: &Path) -> Result<(), String> {
    ctx(
        "making / private",
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        ),
    )?;
    ctx(
        "binding the root filesystem",
        mount(
            Some(root),
            root,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        ),
    )?;
    let sub = |p: &str| {
        let d = root.join(p);
        let _ = std::fs::create_dir_all(&d);
        d
    };
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    ctx(
        "mounting /proc",
        mount(
            Some("proc"),
            &sub("proc"),
            Some("proc"),
            nosuid,
            None::<&str>,
        ),
    )?;
    let dev = sub("dev");
    ctx(
        "mounting /dev",
        mount(
            Some("tmpfs"),
            &dev,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            Some("mode=755,size=65536k"),
        ),
    )?;
    for node in ["null", "zero", "full", "random", "urandom", "tty"] {
        let target = dev.join(node);
        std::fs::write(&target, b"").map_err(|e| format!("creating /dev/{node}: {e}"))?;
        ctx(
            &format!("binding /dev/{node}"),
            mount(
                Some(&Path::new("/dev").join(node)),
                &target,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            ),
        )?;
    }
    let pts = dev.join("pts");
    let _ = std::fs::create_dir(&pts);
    ctx(
        "mounting /dev/pts",
        mount(
            Some("devpts"),
            &pts,
            Some("devpts"),
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            Some("newinstance,ptmxmode=0666,mode=620"),
        ),
    )?;
    let shm = dev.join("shm");
    let _ = std::fs::create_dir(&shm);
    ctx(
        "mounting /dev/shm",
        mount(
            Some("shm"),
            &shm,
            Some("tmpfs"),
            nosuid,
            Some("mode=1777,size=65536k"),
        ),
    )?;
    for (link, to) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        let _ = std::os::unix::fs::symlink(to, dev.join(link));
    }
    ctx(
        "mounting /sys",
        mount(
            Some("sysfs"),
            &sub("sys"),
            Some("sysfs"),
            nosuid | MsFlags::MS_RDONLY,
            None::<&str>,
        ),
    )?;
    ctx("entering the root", nix::unistd::chdir(root))?;
    ctx("pivot_root", nix::unistd::pivot_root(".", "."))?;
    ctx("detaching the old root", umount2(".", MntFlags::MNT_DETACH))?;
    ctx("chdir /", nix::unistd::chdir("/"))?;
    Ok(())
}

fn loopback_up() -> Result<(), String> {
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

fn limit_resources() -> Result<(), String> {
    use nix::sys::resource::{setrlimit, Resource};
    ctx("RLIMIT_CORE", setrlimit(Resource::RLIMIT_CORE, 0, 0))?;
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

fn drop_capabilities() -> Result<(), String> {
    for cap in 0..=LAST_CAP {
        if KEPT_CAPS.iter().any(|(_, c)| *c == cap) {
            continue;
        }
        // SAFETY: PR_CAPBSET_DROP takes a capability number; EINVAL for caps this kernel lacks.
        let r = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
        if r != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            return Err(format!(
                "dropping capability {cap}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    let mut mask = [0u32; 2];
    for (_, cap) in KEPT_CAPS {
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
        return Err(format!("capset: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Full access to the sandbox's own tree, read-only /proc and /sys, and no device nodes
/// made anywhere.
fn landlock_filesystem() -> Result<(), String> {
    use landlock::{
        Access, AccessFs, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, ABI,
    };
    let abi = ABI::V5;
    let all = AccessFs::from_all(abi);
    let writable = all & !(AccessFs::MakeChar | AccessFs::MakeBlock);
    let read = AccessFs::from_read(abi);
    let err = |e: landlock::RulesetError| format!("landlock: {e}");
    let mut ruleset = Ruleset::default()
        .handle_access(all)
        .map_err(err)?
        .create()
        .map_err(err)?;
    let entries = std::fs::read_dir("/").map_err(|e| format!("reading /: {e}"))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let access = match name.to_str() {
            Some("proc" | "sys") => read,
            _ => writable,
        };
        let fd = match PathFd::new(entry.path()) {
            Ok(fd) => fd,
            Err(_) => continue,
        };
        ruleset = ruleset
            .add_rule(PathBeneath::new(fd, access))
            .map_err(err)?;
    }
    // The root directory itself: list and read, and create new top-level entries.
    ruleset = ruleset
        .add_rule(PathBeneath::new(
            PathFd::new("/").map_err(|e| format!("landlock: {e}"))?,
            read | AccessFs::MakeDir | AccessFs::MakeReg | AccessFs::MakeSym,
        ))
        .map_err(err)?;
    ruleset.restrict_self().map_err(err)?;
    Ok(())
}

fn seccomp_filter() -> Result<(), String> {
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
        SeccompRule, TargetArch,
    };
    let err = |e: seccompiler::Error| format!("seccomp: {e}");
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED_SYSCALLS
        .iter()
        .map(|(_, nr)| (*nr, Vec::new()))
        .collect();
    // clone with any namespace flag: new namespaces only come from the runtime.
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|flag| {
            SeccompRule::new(vec![SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(*flag),
                *flag,
            )
            .map_err(|e| format!("seccomp: {e}"))?])
            .map_err(|e| format!("seccomp: {e}"))
        })
        .collect::<Result<Vec<_>, String>>()?;
    rules.insert(libc::SYS_clone, clone_rules);
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        TargetArch::x86_64,
    )
    .map_err(|e| format!("seccomp: {e}"))?;
    // clone3 passes its flags in memory seccomp cannot read: refuse it so libc falls back
    // to clone, which the rules above inspect.
    let mut clone3 = BTreeMap::new();
    clone3.insert(libc::SYS_clone3, Vec::new());
    let clone3_filter = SeccompFilter::new(
        clone3,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        TargetArch::x86_64,
    )
    .map_err(|e| format!("seccomp: {e}"))?;
    for f in [clone3_filter, filter] {
        let prog: seccompiler::BpfProgram = f.try_into().map_err(|e| format!("seccomp: {e:?}"))?;
        seccompiler::apply_filter(&prog).map_err(err)?;
    }
    Ok(())
}
