//! Launch mount namespaces: where the runtime's OCI runtime calls run, so that what they
//! copy and read does not grow with the sandboxes on the node.
//!
//! A new mount namespace starts as a copy of its creator's whole mount table (crun's
//! container namespace included), and crun reads that table as it works. Every sandbox
//! leaves about five mounts in the host's namespace (its layer binds, its upper, its
//! overlay), so with 1,000 sandboxes alive each `crun run` copied and read 5,000 mounts
//! (measured: 42 ms → 125 ms a run with 5,000 mounts). A [`Template`] is made once per
//! process: a private copy of the host's table without any sandbox's mounts. Each call
//! then runs in a fresh copy of the template ([`enter`]), into which the host carries
//! only the mounts that call needs ([`Carried`]: a sandbox's root, its network namespace)
//! with `open_tree` and `move_mount`.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `open_tree`'s flags (linux/mount.h): a detached copy, closed on exec.
const OPEN_TREE_CLONE: libc::c_uint = 1;
/// `move_mount`'s flag: the source is the descriptor itself.
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 4;

/// A private mount namespace holding the host's mounts but no sandbox's, kept by a
/// descriptor (it ends with the last one).
#[derive(Debug)]
pub struct Template {
    ns: OwnedFd,
}

/// A detached copy of a mount tree, to be attached at the same path inside a launch
/// namespace.
#[derive(Debug)]
pub struct Carried {
    tree: OwnedFd,
    at: CString,
}

impl Template {
    /// Makes the template: a thread moves into a copy of this process's mount namespace,
    /// makes every mount in it private (so nothing the host mounts later arrives, and
    /// nothing done in it leaves), detaches the mounts [`is_sandbox_mount`] names (those
    /// under `state_dir` and every overlay, EROFS, FUSE, namespace pin and loop-backed
    /// filesystem, whoever made them: a copy would keep their devices and daemons busy),
    /// keeps a descriptor of the namespace and ends.
    pub fn new(state_dir: &Path) -> io::Result<Template> {
        let state_dir = state_dir.to_path_buf();
        std::thread::Builder::new()
            .name("strata-mountns".into())
            .spawn(move || Template::made_here(&state_dir))?
            .join()
            .map_err(|_| io::Error::other("the thread making the launch namespace panicked"))?
    }

    /// Runs on a thread of its own: unshare(CLONE_NEWNS) gives this thread alone a new
    /// namespace (and its own filesystem context); the process's other threads stay.
    fn made_here(state_dir: &Path) -> io::Result<Template> {
        // SAFETY: unshare takes no pointers; it changes only this thread's namespace.
        if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a null source and type with MS_REC|MS_PRIVATE only changes propagation.
        let r = unsafe {
            libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let table = std::fs::read_to_string("/proc/thread-self/mountinfo")?;
        for at in sandbox_mounts(&table, state_dir) {
            let Ok(c) = CString::new(at.as_os_str().as_bytes()) else {
                continue;
            };
            // SAFETY: a valid path; a mount already gone with its parent answers EINVAL.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let ns = std::fs::File::open("/proc/thread-self/ns/mnt")?;
        Ok(Template { ns: ns.into() })
    }

    /// Makes `cmd` receive a descriptor of the template as its descriptor `fd` (for a
    /// process that enters it itself later, with [`enter_now`]).
    pub fn pass(&self, cmd: &mut Command, fd: RawFd) -> io::Result<()> {
        let ns = self.ns.try_clone()?;
        // SAFETY: only fcntl and dup2 between fork and exec, of a descriptor the closure
        // owns.
        unsafe {
            cmd.pre_exec(move || {
                let source = ns.as_raw_fd();
                // The copy may already be descriptor `fd` (the lowest free number when it
                // was made): dup2 onto itself does nothing and would leave it
                // close-on-exec, so the flag is cleared instead.
                let placed = if source == fd {
                    libc::fcntl(fd, libc::F_SETFD, 0)
                } else {
                    // dup2 leaves the copy open across exec.
                    libc::dup2(source, fd)
                };
                if placed < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }
}

/// A detached copy of the mount tree at `path` (with everything mounted under it), to be
/// attached at the same path in a launch namespace.
pub fn carry(path: &Path) -> io::Result<Carried> {
    let at = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let tree = open_tree(&at, libc::AT_RECURSIVE as libc::c_uint)?;
    Ok(Carried { tree, at })
}

/// Whether this host lets mounts be carried (`open_tree`, which a seccomp profile may
/// refuse): a copy of the root mount alone, whatever is mounted under it.
pub fn can_carry() -> io::Result<()> {
    open_tree(c"/", 0).map(drop)
}

/// A detached copy of the mount at `at`, with `flags` (AT_RECURSIVE: everything under it).
fn open_tree(at: &CStr, flags: libc::c_uint) -> io::Result<OwnedFd> {
    // SAFETY: open_tree with a valid path; it returns a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            at.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | flags,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the descriptor was just returned to us and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Makes `cmd` run in a fresh copy of `template` with `carried` attached where they were
/// on the host, and, when `hide` names a mount point, with that mount detached (see
/// `exec::pass_fds_and_hide`). Register it before any hook that moves descriptors to
/// fixed numbers: it uses its own descriptors first.
pub fn enter(
    cmd: &mut Command,
    template: &Template,
    carried: Vec<Carried>,
    hide: Option<CString>,
) -> io::Result<()> {
    let ns = template.ns.try_clone()?;
    // SAFETY: `enter_raw` makes only system calls (setns, unshare, umount2, move_mount)
    // on descriptors and strings this closure owns; nothing is allocated.
    unsafe {
        cmd.pre_exec(move || enter_raw(ns.as_raw_fd(), &carried, hide.as_deref()));
    }
    Ok(())
}

/// What a command started by [`spawn_in`] gets besides its launch namespace.
#[derive(Debug)]
pub struct Launch<'a> {
    /// Mount trees brought in from the host's namespace, at the same paths.
    pub carry: &'a [&'a Path],
    /// A mount point to detach (see `exec::pass_fds_and_hide`).
    pub hide: Option<&'a CStr>,
    /// Become the command's descriptors 3, 4, ... in order.
    pub pass: &'a [BorrowedFd<'a>],
    /// The command's stderr (its stdin and stdout are /dev/null).
    pub stderr: BorrowedFd<'a>,
}

/// Starts `cmd` in a fresh copy of `template` as [`enter`] does, but without a hook
/// between fork and exec: a short-lived thread with a filesystem context and descriptor
/// table of its own enters the namespace, attaches the carried mounts and places the
/// descriptors, then spawns. With no hook the standard library spawns with posix_spawn
/// (a vfork that shares the memory until exec) instead of fork, which copies the page
/// tables of the whole process: for a long-lived service that is most of a start's
/// overhead and copy-on-write faults after it.
///
/// `cmd`'s stdio is replaced (see [`Launch::stderr`]). Descriptors the thread opens live
/// in its own table and close with it, so every descriptor this takes is borrowed.
pub fn spawn_in(
    cmd: &mut Command,
    template: &Template,
    launch: &Launch<'_>,
) -> io::Result<std::process::Child> {
    if launch.pass.len() > 32 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "at most 32 descriptors may be passed",
        ));
    }
    // Set here, on the caller's table: whatever stdio `cmd` held is closed where it was
    // opened.
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let ns = template.ns.as_fd();
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("strata-launch".into())
            .spawn_scoped(scope, || spawn_here(cmd, ns, launch))?
            .join()
            .map_err(|_| io::Error::other("the thread starting a command panicked"))?
    })
}

/// Runs on [`spawn_in`]'s thread.
fn spawn_here(
    cmd: &mut Command,
    ns: BorrowedFd<'_>,
    launch: &Launch<'_>,
) -> io::Result<std::process::Child> {
    // SAFETY: unshare takes no pointers; it changes only this thread's filesystem context
    // and descriptor table (now a copy of the process's).
    if unsafe { libc::unshare(libc::CLONE_FS | libc::CLONE_FILES) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // Opened on this thread's table, in the host's namespace; closed when attached.
    let carried = launch
        .carry
        .iter()
        .map(|p| carry(p))
        .collect::<io::Result<Vec<_>>>()?;
    enter_raw(ns.as_raw_fd(), &carried, launch.hide)?;
    drop(carried);
    // Copied out of the way first (to 64 and up), so no placement overwrites a source
    // still to be placed, nor the stderr.
    let high = |fd: BorrowedFd<'_>| -> io::Result<OwnedFd> {
        // SAFETY: fcntl(F_DUPFD_CLOEXEC) on a borrowed, open descriptor returns a new one.
        let copy = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 64) };
        if copy < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the descriptor was just returned to us and is owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(copy) })
    };
    let stderr = high(launch.stderr)?;
    let sources = launch
        .pass
        .iter()
        .map(|fd| high(*fd))
        .collect::<io::Result<Vec<_>>>()?;
    for (i, source) in sources.iter().enumerate() {
        // SAFETY: dup2 between descriptors of this thread's own table; the copy is left
        // open across exec.
        if unsafe { libc::dup2(source.as_raw_fd(), 3 + i as RawFd) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    drop(sources);
    cmd.stderr(stderr);
    let child = cmd.spawn();
    // Drops this thread's copy of the stderr here, on its own table.
    cmd.stderr(std::process::Stdio::null());
    child
}

/// Moves this process, which must be single-threaded, into a fresh copy of the template
/// `ns` (a descriptor [`Template::pass`] gave it) with `carried` attached, and closes
/// `ns`.
pub fn enter_now(ns: OwnedFd, carried: &[Carried]) -> io::Result<()> {
    enter_raw(ns.as_raw_fd(), carried, None)
}

/// setns into `ns`, a copy of it of our own (what is attached stays out of the template),
/// `hide` detached, `carried` attached: system calls only, so it may run between fork and
/// exec.
fn enter_raw(ns: RawFd, carried: &[Carried], hide: Option<&CStr>) -> io::Result<()> {
    // SAFETY: setns and unshare take no pointers.
    if unsafe { libc::setns(ns, libc::CLONE_NEWNS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if let Some(path) = hide {
        // SAFETY: a valid NUL-terminated path; a mount already absent answers EINVAL.
        unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
    }
    for c in carried {
        // SAFETY: move_mount of a descriptor we own onto a valid NUL-terminated path.
        let r = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                c.tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_FDCWD,
                c.at.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The mount points in `table` (a mountinfo) that a launch namespace must not hold,
/// deepest first: everything strictly under `state_dir`, and every overlay, EROFS, FUSE,
/// namespace pin (nsfs) and loop-backed filesystem, but never a mount `state_dir` itself
/// lives on (a home on a disk of its own).
fn sandbox_mounts(table: &str, state_dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = table
        .lines()
        .filter_map(|line| {
            let (mount, fs) = line.split_once(" - ")?;
            let at = PathBuf::from(unescape(mount.split_whitespace().nth(4)?));
            let mut fs = fs.split_whitespace();
            let (kind, source) = (fs.next()?, fs.next().unwrap_or(""));
            let sandboxy = matches!(kind, "overlay" | "erofs" | "nsfs" | "fuse" | "fuseblk")
                || kind.starts_with("fuse.")
                || source.starts_with("/dev/loop");
            let under = at.starts_with(state_dir) && at != state_dir;
            ((under || sandboxy) && !state_dir.starts_with(&at)).then_some(at)
        })
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found.dedup();
    found
}

/// A mountinfo path field with its octal escapes (`\040` for a space) undone.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = |c: &u8| (b'0'..=b'7').contains(c);
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(octal) {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 1 0:21 / / rw,relatime - ext4 /dev/vda1 rw
23 22 0:5 / /proc rw - proc proc rw
30 22 0:40 / /run/netns rw shared:5 - tmpfs tmpfs rw
31 30 0:4 net:[4026532] /run/netns/strata-a rw shared:5 - nsfs nsfs rw
40 22 7:1 / /var/lib/strata rw - ext4 /dev/loop1 rw
41 40 0:50 / /var/lib/strata/runtime/uppers/a rw - ext4 /dev/loop2 rw
42 40 0:51 / /var/lib/strata/runtime/sandboxes/a/rootfs rw - overlay overlay rw
43 42 0:52 / /var/lib/strata/runtime/sandboxes/a/rootfs/views/0 ro - tmpfs tmpfs rw
44 22 0:53 / /tmp/other\\040home/lazyfs/l rw - fuse.strata strata rw
45 22 0:54 / /mnt/usb rw - vfat /dev/sdb1 rw
46 22 0:55 / /tmp/other/erofs rw - erofs /tmp/other/layer.img ro
";

    #[test]
    fn sandbox_mounts_leave_the_host_and_the_homes_own_disk() {
        let found = sandbox_mounts(TABLE, Path::new("/var/lib/strata/runtime"));
        assert_eq!(
            found,
            vec![
                PathBuf::from("/var/lib/strata/runtime/sandboxes/a/rootfs/views/0"),
                PathBuf::from("/var/lib/strata/runtime/sandboxes/a/rootfs"),
                PathBuf::from("/var/lib/strata/runtime/uppers/a"),
                PathBuf::from("/tmp/other home/lazyfs/l"),
                PathBuf::from("/run/netns/strata-a"),
                PathBuf::from("/tmp/other/erofs"),
            ]
        );
    }

    /// The descriptor arrives open in the child whichever number the template's copy got
    /// in the parent: a copy that already had the target number (dup2 onto itself does
    /// nothing) once stayed close-on-exec, and a pooled fncall agent aborted closing it.
    #[test]
    fn a_passed_template_is_open_in_the_child_whatever_its_number_was() {
        if !crate::testing::root("unshare of a mount namespace") {
            return;
        }
        let dir = std::env::temp_dir();
        let template = Template::new(&dir).unwrap();
        let ns_id =
            std::fs::read_link(format!("/proc/self/fd/{}", template.ns.as_raw_fd())).unwrap();
        // The next descriptor number this process hands out is the one the copy gets
        // (the test threads open no descriptors between the probe and the copy).
        let next = std::fs::File::open("/dev/null").unwrap().as_raw_fd();
        for target in [next, 100] {
            let mut cmd = Command::new("readlink");
            cmd.arg(format!("/proc/self/fd/{target}"));
            template.pass(&mut cmd, target).unwrap();
            let out = cmd.output().unwrap();
            assert!(
                out.status.success(),
                "descriptor {target} not open in the child: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(
                String::from_utf8_lossy(&out.stdout).trim(),
                ns_id.to_string_lossy(),
                "descriptor {target}"
            );
        }
    }

    /// A command started by `spawn_in` runs in the launch namespace with the carried mount
    /// and the passed descriptors, writes its stderr to the given file, and leaves the
    /// caller's namespace as it was.
    #[test]
    fn a_spawned_command_gets_its_namespace_mounts_and_descriptors() {
        if !crate::testing::root("mounts") {
            return;
        }
        let state = tempfile::tempdir().unwrap();
        let carried = state.path().join("m");
        std::fs::create_dir(&carried).unwrap();
        let at = CString::new(carried.as_os_str().as_bytes()).unwrap();
        // SAFETY: valid NUL-terminated strings; a tmpfs of this test's own.
        let r = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                at.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "{}", io::Error::last_os_error());
        std::fs::write(carried.join("probe"), b"carried").unwrap();
        let template = Template::new(state.path()).unwrap();
        let log_path = state.path().join("stderr");
        let log = std::fs::File::create(&log_path).unwrap();
        let (pass_r, pass_w) = {
            let mut fds = [0; 2];
            // SAFETY: pipe2 fills two descriptors we then own.
            assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
            // SAFETY: just returned, owned by nothing else.
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
        };
        let ours = std::fs::read_link("/proc/thread-self/ns/mnt").unwrap();
        // spawn_in makes stdout /dev/null: the script writes to its stderr.
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(format!(
            "exec 1>&2; cat {}/probe; echo; readlink /proc/self/fd/3 /proc/self/fd/4 /proc/self/ns/mnt",
            carried.display()
        ));
        let launch = Launch {
            carry: &[carried.as_path()],
            hide: None,
            pass: &[pass_w.as_fd(), pass_r.as_fd()],
            stderr: log.as_fd(),
        };
        let status = spawn_in(&mut cmd, &template, &launch)
            .unwrap()
            .wait()
            .unwrap();
        let out = std::fs::read_to_string(&log_path).unwrap();
        // SAFETY: a valid NUL-terminated path of the tmpfs mounted above.
        unsafe { libc::umount2(at.as_ptr(), libc::MNT_DETACH) };
        assert!(status.success(), "{out}");
        let lines: Vec<&str> = out.lines().collect();
        let link = |fd: &OwnedFd| {
            std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .unwrap()
                .to_string_lossy()
                .into_owned()
        };
        assert_eq!(lines.first(), Some(&"carried"), "{out}");
        assert_eq!(lines.get(1), Some(&link(&pass_w).as_str()), "{out}");
        assert_eq!(lines.get(2), Some(&link(&pass_r).as_str()), "{out}");
        assert_ne!(
            lines.get(3),
            Some(&ours.to_string_lossy().as_ref()),
            "{out}"
        );
        assert_eq!(
            std::fs::read_link("/proc/thread-self/ns/mnt").unwrap(),
            ours,
            "the caller's namespace changed"
        );
    }

    #[test]
    fn unescape_undoes_octal_escapes() {
        assert_eq!(unescape("/a\\040b\\011c"), "/a b\tc");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/odd\\04"), "/odd\\04");
    }
}
