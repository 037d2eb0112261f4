//! `strata-agent sandbox --rootfs DIR --socket PATH --hostname NAME [--netns PATH]`
//!
//! Becomes pid 1 of a function-call sandbox: enters fresh mount, pid, network, IPC and UTS
//! namespaces, pivots into the assembled root filesystem, locks itself down (capabilities,
//! no_new_privs, landlock, seccomp, rlimits: all inherited by what it runs) and then serves
//! the host over a Unix socket, forking each command from inside. Because the agent already
//! sits in the sandbox's cgroups, a command joins them by inheritance, without paying a
//! cgroup attach.
//!
//! The first process prints the agent's host PID on stdout once it serves, then exits.

mod confine;
mod serve;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use nix::sched::CloneFlags;
use nix::unistd::{fork, ForkResult};

struct Args {
    rootfs: PathBuf,
    socket: PathBuf,
    hostname: String,
    /// A network namespace to join instead of a fresh, empty one.
    netns: Option<PathBuf>,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    match it.next().as_deref() {
        Some("sandbox") => {}
        Some("--version") => {
            println!("strata-agent {}", env!("CARGO_PKG_VERSION"));
            std::process::exit(0);
        }
        _ => return Err(
            "usage: strata-agent sandbox --rootfs DIR --socket PATH --hostname NAME [--netns PATH]"
                .into(),
        ),
    }
    let (mut rootfs, mut socket, mut hostname, mut netns) = (None, None, None, None);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--rootfs" => rootfs = Some(PathBuf::from(value)),
            "--socket" => socket = Some(PathBuf::from(value)),
            "--hostname" => hostname = Some(value),
            "--netns" => netns = Some(PathBuf::from(value)),
            other => return Err(format!("unknown option {other}")),
        }
    }
    Ok(Args {
        rootfs: rootfs.ok_or("--rootfs is required")?,
        socket: socket.ok_or("--socket is required")?,
        hostname: hostname.unwrap_or_else(|| "sandbox".into()),
        netns,
    })
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("strata-agent: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(args) {
        eprintln!("strata-agent: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    // Bound before the pivot, in the host's view of the filesystem, so the host can reach it.
    let _ = std::fs::remove_file(&args.socket);
    let listener = UnixListener::bind(&args.socket)
        .map_err(|e| format!("listening on {}: {e}", args.socket.display()))?;
    let mut flags = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS;
    match &args.netns {
        Some(path) => {
            let ns = std::fs::File::open(path)
                .map_err(|e| format!("network namespace {}: {e}", path.display()))?;
            nix::sched::setns(ns, CloneFlags::CLONE_NEWNET)
                .map_err(|e| format!("joining {}: {e}", path.display()))?;
        }
        None => flags |= CloneFlags::CLONE_NEWNET,
    }
    nix::sched::unshare(flags).map_err(|e| format!("unshare: {e}"))?;
    let (ready_r, ready_w) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: the process is single-threaded here; the child only continues this program.
    match unsafe { fork() }.map_err(|e| format!("fork: {e}"))? {
        ForkResult::Parent { child } => {
            drop(ready_w);
            let mut report = String::new();
            let _ = std::fs::File::from(ready_r).read_to_string(&mut report);
            if report.trim() == "ok" {
                println!("{child}");
                Ok(())
            } else {
                // SAFETY: plain kill(2) of our own child.
                unsafe { libc::kill(child.as_raw(), libc::SIGKILL) };
                Err(if report.is_empty() {
                    "the sandbox init died during setup".into()
                } else {
                    report
                })
            }
        }
        ForkResult::Child => {
            drop(ready_r);
            let mut ready = std::fs::File::from(ready_w);
            match confine::enter(&args.rootfs, &args.hostname) {
                Ok(()) => {
                    let _ = ready.write_all(b"ok");
                    drop(ready);
                    close_inherited_stdio();
                    serve::serve(listener);
                    std::process::exit(0);
                }
                Err(e) => {
                    let _ = ready.write_all(e.as_bytes());
                    std::process::exit(1);
                }
            }
        }
    }
}

/// Points stdio at /dev/null so the agent holds no pipe of whoever started it.
fn close_inherited_stdio() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        let fd = OwnedFd::from(null);
        for target in 0..3 {
            // SAFETY: dup2 onto the standard descriptors.
            unsafe { libc::dup2(fd.as_raw_fd(), target) };
        }
    }
}
