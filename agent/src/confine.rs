//! Confinement: turning the agent into the confined init of a function-call sandbox (the
//! root filesystem, /proc, /dev and /sys inside it, the pivot, then the restrictions every
//! command inherits), and the [`Jail`] each command enters between fork and exec.
//!
//! The jail is what keeps a command away from the agent and from other commands: a
//! Landlock domain of its own per exec (a process may only ptrace, read the memory of, or,
//! where the kernel scopes signals, signal processes of its own domain or one nested in
//! it, so not the agent and not another exec's processes), holding the sandbox's
//! filesystem rules in a fncall sandbox or VM guest, every inherited descriptor closed at
//! exec, and, in a VM guest, where the agent itself stays privileged, the capabilities,
//! `no_new_privs` and seccomp filter a fncall agent applies to itself.

use std::os::fd::OwnedFd;
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use strata_agent_proto::policy::{self, KEPT_CAPS};

use crate::sys;

/// The symlinks of a sandbox's /dev (name, target).
pub const DEV_LINKS: [(&str, &str); 5] = [
    ("ptmx", "pts/ptmx"),
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
];

/// Enters the sandbox's root `rootfs` and confines this process; /dev/shm holds
/// `shm_bytes` (64 MiB when not given).
pub fn enter(rootfs: &Path, hostname: &str, shm_bytes: Option<u64>) -> Result<(), String> {
    mount_filesystems(rootfs, shm_bytes.unwrap_or(64 << 20))?;
    nix::unistd::sethostname(hostname).map_err(|e| format!("sethostname: {e}"))?;
    sys::loopback_up()?;
    limit_resources()?;
    drop_capabilities().map_err(|e| format!("dropping capabilities: {e}"))?;
    sys::no_new_privs().map_err(|e| format!("no_new_privs: {e}"))?;
    // The filesystem rules are each command's (`Jail::fncall`), not the agent's own: a
    // process checkpoint cannot save a Landlock domain, and a woken agent must still
    // confine every command it starts.
    apply_seccomp()
}

/// Loads the policy's seccomp filters on this process (and so on everything it forks).
/// A container's init loads them over the OCI runtime's filter, which cannot carry the
/// argument refusals.
pub fn apply_seccomp() -> Result<(), String> {
    for prog in seccomp_programs()? {
        seccompiler::apply_filter(&prog).map_err(|e| format!("seccomp: {e}"))?;
    }
    Ok(())
}

fn ctx<T>(what: &str, r: nix::Result<T>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e}"))
}

fn mount_filesystems(root: &Path, shm_bytes: u64) -> Result<(), String> {
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
            Some(format!("mode=755,size={}", policy::DEV_TMPFS_BYTES).as_str()),
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
            Some(format!("mode=1777,size={shm_bytes}").as_str()),
        ),
    )?;
    for (link, to) in DEV_LINKS {
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
    mask_kernel_files(root)?;
    ctx("entering the root", nix::unistd::chdir(root))?;
    ctx("pivot_root", nix::unistd::pivot_root(".", "."))?;
    ctx("detaching the old root", umount2(".", MntFlags::MNT_DETACH))?;
    ctx("chdir /", nix::unistd::chdir("/"))?;
    Ok(())
}

/// Hides the policy's masked kernel files under `root` (its /proc and /sys mounted): an
/// empty read-only tmpfs over a directory, the root's /dev/null over a file; and makes its
/// read-only ones so. A path this kernel does not have is skipped.
pub fn mask_kernel_files(root: &Path) -> Result<(), String> {
    let under = |p: &str| root.join(p.trim_start_matches('/'));
    let null = under("/dev/null");
    for path in policy::MASKED_PATHS {
        let target = under(path);
        let Ok(meta) = std::fs::symlink_metadata(&target) else {
            continue;
        };
        let masked = if meta.is_dir() {
            mount(
                Some("tmpfs"),
                &target,
                Some("tmpfs"),
                MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some("size=4k,mode=0555"),
            )
        } else {
            mount(
                Some(&null),
                &target,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
        };
        ctx(&format!("masking {path}"), masked)?;
    }
    for path in policy::READONLY_PATHS {
        let target = under(path);
        if std::fs::symlink_metadata(&target).is_err() {
            continue;
        }
        ctx(
            &format!("binding {path}"),
            mount(
                Some(&target),
                &target,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            ),
        )?;
        ctx(
            &format!("making {path} read-only"),
            mount(
                None::<&str>,
                &target,
                None::<&str>,
                MsFlags::MS_BIND
                    | MsFlags::MS_REMOUNT
                    | MsFlags::MS_RDONLY
                    | MsFlags::MS_NOSUID
                    | MsFlags::MS_NODEV
                    | MsFlags::MS_NOEXEC,
                None::<&str>,
            ),
        )?;
    }
    Ok(())
}

fn limit_resources() -> Result<(), String> {
    use nix::sys::resource::{setrlimit, Resource};
    ctx("RLIMIT_CORE", setrlimit(Resource::RLIMIT_CORE, 0, 0))?;
    Ok(())
}

/// Drops every capability but the shared policy's, from the bounding set too. Allocates
/// nothing, so a forked child may call it before exec.
fn drop_capabilities() -> std::io::Result<()> {
    sys::drop_bounding(KEPT_CAPS)?;
    sys::keep_caps(KEPT_CAPS)
}

/// Full access to the sandbox's own tree, read-only /proc and /sys, no device nodes made
/// anywhere; signals scoped to the domain where the kernel can (Landlock ABI 6).
fn filesystem_rules() -> Result<landlock::RulesetCreated, String> {
    use landlock::{
        Access, AccessFs, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope, ABI,
    };
    let abi = ABI::V6;
    let all = AccessFs::from_all(abi);
    let writable = all & !(AccessFs::MakeChar | AccessFs::MakeBlock);
    let read = AccessFs::from_read(abi);
    let err = |e: landlock::RulesetError| format!("landlock: {e}");
    let mut ruleset = Ruleset::default()
        .handle_access(all)
        .map_err(err)?
        .scope(Scope::Signal)
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
    ruleset
        .add_rule(PathBeneath::new(
            PathFd::new("/").map_err(|e| format!("landlock: {e}"))?,
            read | AccessFs::MakeDir | AccessFs::MakeReg | AccessFs::MakeSym,
        ))
        .map_err(err)
}

/// Whether this kernel's Landlock can confine without breaking ordinary programs: ABI 1
/// (Linux 5.13 to 5.18) refuses every rename or link across directories to a confined
/// process (EXDEV), which breaks package managers and build tools, so it is not used.
pub fn landlock_usable() -> bool {
    strata_host::landlock_abi() >= 2
}

/// A ruleset that restricts no file access but makes a new Landlock domain, which is what
/// scopes ptrace, /proc/PID/mem and (ABI 6) signals to the command's own process tree.
fn scope_rules() -> Result<landlock::RulesetCreated, String> {
    use landlock::{
        AccessFs, PathBeneath, PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope,
    };
    let err = |e: landlock::RulesetError| format!("landlock: {e}");
    // Moving a file across directories is refused by any Landlock domain unless the
    // ruleset grants it, so it is handled and granted everywhere.
    let granted = AccessFs::Execute | AccessFs::Refer;
    Ruleset::default()
        .handle_access(granted)
        .map_err(err)?
        .scope(Scope::Signal)
        .map_err(err)?
        .create()
        .map_err(err)?
        .add_rule(PathBeneath::new(
            PathFd::new("/").map_err(|e| format!("landlock: {e}"))?,
            granted,
        ))
        .map_err(err)
}

/// The policy's seccomp filter (see [`crate::filter`]): every listed syscall passes, a
/// denied one and the denied arguments of `ioctl`, `clone` and `socket` are answered EPERM,
/// an unlisted one ENOSYS.
fn seccomp_programs() -> Result<Vec<seccompiler::BpfProgram>, String> {
    Ok(vec![crate::filter::program()?])
}

/// What a VM guest's command enters on top of the scope: the agent there keeps its
/// privileges (it sets the clock, mounts, writes cgroups), so each command drops them.
struct GuestRules {
    seccomp: Vec<seccompiler::BpfProgram>,
}

/// `make`, where this kernel's Landlock is usable and `make` builds a ruleset on it.
fn usable_rules(
    make: fn() -> Result<landlock::RulesetCreated, String>,
) -> Option<fn() -> Result<landlock::RulesetCreated, String>> {
    (landlock_usable() && make().ok().and_then(Option::<OwnedFd>::from).is_some()).then_some(make)
}

/// What each command enters between fork and exec. Its Landlock ruleset is built afresh
/// for each command, in the agent before the fork ([`Jail::prepare`]), so the agent holds
/// no ruleset descriptor between commands (a process checkpoint cannot save one).
pub struct Jail {
    /// Builds the Landlock ruleset each command is restricted with (a new domain per
    /// command); none where the kernel has no usable Landlock.
    rules: Option<fn() -> Result<landlock::RulesetCreated, String>>,
    guest: Option<GuestRules>,
}

/// A [`Jail`] made ready for one command: everything that allocates or opens is done, so
/// [`JailEntry::enter`] only makes system calls.
pub struct JailEntry {
    ruleset: Option<OwnedFd>,
    jail: &'static Jail,
}

impl Jail {
    /// The jail of a container's commands: the OCI runtime confined the container, so a
    /// new domain per command is what is added.
    pub fn scope() -> Jail {
        Jail {
            rules: usable_rules(scope_rules),
            guest: None,
        }
    }

    /// The jail of a fncall sandbox's commands: a domain of their own holding the
    /// sandbox's filesystem rules (made for each command, so a top-level directory an
    /// earlier one made is writable to the next).
    pub fn fncall() -> Jail {
        Jail {
            rules: usable_rules(filesystem_rules),
            guest: None,
        }
    }

    /// The jail of a VM guest's commands, made once the sandbox's root is in place: the
    /// fncall confinement, which the privileged guest agent does not have itself.
    pub fn guest() -> Result<Jail, String> {
        Ok(Jail {
            rules: usable_rules(filesystem_rules),
            guest: Some(GuestRules {
                seccomp: seccomp_programs()?,
            }),
        })
    }

    /// The jail of a privileged VM guest's commands: none but close-on-exec descriptors
    /// (they are the guest's root with every capability, as a nesting host needs).
    pub fn privileged() -> Jail {
        Jail {
            rules: None,
            guest: None,
        }
    }

    /// Whether commands get a Landlock domain of their own (the kernel has Landlock).
    pub fn scoped(&self) -> bool {
        self.rules.is_some()
    }

    /// Readies the jail for one command; its ruleset descriptor closes with the entry.
    pub fn prepare(&'static self) -> std::io::Result<JailEntry> {
        let ruleset = match self.rules {
            Some(make) => Some(
                make()
                    .ok()
                    .and_then(Option::<OwnedFd>::from)
                    .ok_or_else(|| std::io::Error::other("cannot build the Landlock ruleset"))?,
            ),
            None => None,
        };
        Ok(JailEntry {
            ruleset,
            jail: self,
        })
    }
}

impl JailEntry {
    /// Enters the jail as `uid`:`gid`. Only system calls, nothing allocated on success: it
    /// runs in a forked child of the multi-threaded agent.
    pub fn enter(&self, uid: u32, gid: u32) -> std::io::Result<()> {
        let guest = self.jail.guest.as_ref();
        sys::cloexec_from(3)?;
        if guest.is_some() {
            sys::no_new_privs()?;
            sys::drop_bounding(KEPT_CAPS)?;
            sys::no_core_dumps();
        }
        sys::set_ids(uid, gid)?;
        if guest.is_some() && uid == 0 {
            // A non-root user lost every capability with setuid; root keeps the policy's.
            sys::keep_caps(KEPT_CAPS)?;
        }
        if let Some(fd) = &self.ruleset {
            sys::landlock_restrict(fd)?;
        }
        if let Some(g) = guest {
            for prog in &g.seccomp {
                seccompiler::apply_filter(prog).map_err(|e| match e {
                    seccompiler::Error::Seccomp(io) | seccompiler::Error::Prctl(io) => io,
                    _ => std::io::Error::from(std::io::ErrorKind::Other),
                })?;
            }
        }
        Ok(())
    }
}
