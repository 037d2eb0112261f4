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
//!
//! As `/init` of a VM guest's initramfs it is the guest's pid 1 (see `guest`); `strata-agent
//! relay` is the host end of a VM's channel (see `relay`).
//!
//! `strata-agent sandbox --pooled --socket PATH` starts the same init ahead of time, in its
//! cgroups and fresh pid/IPC/UTS namespaces but still in the host's mount namespace, and
//! waits for one `Setup` message naming the root: a pool of these makes a sandbox start
//! without the ~10 ms-per-hierarchy cgroup attach and the process start.

mod confine;
mod guest;
mod relay;
mod serve;

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use nix::sched::CloneFlags;
use nix::unistd::{fork, ForkResult};

struct Args {
    /// Empty when pooled (the root comes with `Setup`).
    rootfs: PathBuf,
    pooled: bool,
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
    let mut pooled = false;
    while let Some(flag) = it.next() {
        if flag == "--pooled" {
            pooled = true;
            continue;
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--rootfs" => rootfs = Some(PathBuf::from(value)),
            "--socket" => socket = Some(PathBuf::from(value)),
            "--hostname" => hostname = Some(value),
            "--netns" => netns = Some(PathBuf::from(value)),
            other => return Err(format!("unknown option {other}")),
        }
    }
    if rootfs.is_none() && !pooled {
        return Err("--rootfs is required (or --pooled)".into());
    }
    Ok(Args {
        rootfs: rootfs.unwrap_or_default(),
        pooled,
        socket: socket.ok_or("--socket is required")?,
        hostname: hostname.unwrap_or_else(|| "sandbox".into()),
        netns,
    })
}

/// `strata-agent init --listen-fd N`: the init of a container the OCI runtime already
/// built and confined. It serves on a listening socket the host made and passed in
/// (`--preserve-fds`), so the socket lives where the sandbox cannot see or replace it,
/// and forks each command inside: commands inherit the container's namespaces,
/// confinement and cgroups, with no OCI runtime `exec` and no cgroup attach per command.
fn container_init() -> Result<(), String> {
    use std::os::fd::FromRawFd;
    let mut it = std::env::args().skip(2);
    let fd: i32 = match (it.next().as_deref(), it.next()) {
        (Some("--listen-fd"), Some(n)) => n.parse().map_err(|_| format!("bad fd {n}"))?,
        _ => return Err("usage: strata-agent init --listen-fd N".into()),
    };
    // SAFETY: the host passed this descriptor, a listening Unix socket, for us alone.
    let listener = unsafe { UnixListener::from_raw_fd(fd) };
    close_inherited_stdio();
    serve::serve(listener);
    Ok(())
}

/// A subcommand taking its remaining arguments.
type Helper = fn(&[String]) -> Result<(), String>;

fn main() {
    if guest::is_guest_init() {
        guest::main();
    }
    // A VM's host-side helpers.
    let helper: Option<(&str, Helper)> = match std::env::args().nth(1).as_deref() {
        Some("connect") => Some(("connect", relay::connect)),
        Some("relay") => Some(("relay", relay::main)),
        _ => None,
    };
    if let Some((name, run_helper)) = helper {
        let args: Vec<String> = std::env::args().skip(2).collect();
        if let Err(e) = run_helper(&args) {
            eprintln!("strata-agent {name}: {e}");
            std::process::exit(1);
        }
        return;
    }
    if std::env::args().nth(1).as_deref() == Some("init") {
        if let Err(e) = container_init() {
            eprintln!("strata-agent: {e}");
            std::process::exit(1);
        }
        return;
    }
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
    let flags = CloneFlags::CLONE_NEWPID | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWUTS;
    if args.pooled {
        nix::sched::unshare(flags).map_err(|e| format!("unshare: {e}"))?;
    } else {
        enter_network(args.netns.as_deref())?;
        nix::sched::unshare(flags | CloneFlags::CLONE_NEWNS)
            .map_err(|e| format!("unshare: {e}"))?;
    }
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
        ForkResult::Child if args.pooled => {
            drop(ready_r);
            let mut ready = std::fs::File::from(ready_w);
            let _ = ready.write_all(b"ok");
            drop(ready);
            close_inherited_stdio();
            if await_setup(&listener).is_ok() {
                serve::serve(listener);
            }
            std::process::exit(1);
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

/// Joins `netns`, or enters a fresh, empty network namespace.
fn enter_network(netns: Option<&std::path::Path>) -> Result<(), String> {
    match netns {
        Some(path) => {
            let ns = std::fs::File::open(path)
                .map_err(|e| format!("network namespace {}: {e}", path.display()))?;
            nix::sched::setns(ns, CloneFlags::CLONE_NEWNET)
                .map_err(|e| format!("joining {}: {e}", path.display()))
        }
        None => nix::sched::unshare(CloneFlags::CLONE_NEWNET).map_err(|e| format!("unshare: {e}")),
    }
}

/// A pooled agent's wait: the first connection must bring `Setup`; the agent then enters
/// the root (still single-threaded, as setns and unshare require) and answers `Ready`.
fn await_setup(listener: &UnixListener) -> Result<(), String> {
    use strata_agent::{read_frame, write_control, AgentMsg, Frame, HostMsg};
    loop {
        let (mut conn, _) = listener.accept().map_err(|e| e.to_string())?;
        let Ok(Some(Frame::Control(msg))) = read_frame::<HostMsg>(&mut conn) else {
            continue;
        };
        let HostMsg::Setup {
            rootfs,
            hostname,
            netns,
        } = msg
        else {
            let _ = write_control(
                &mut conn,
                &AgentMsg::Error {
                    message: "this agent waits for Setup".into(),
                },
            );
            continue;
        };
        let entered = enter_network(netns.as_deref().map(std::path::Path::new))
            .and_then(|()| {
                nix::sched::unshare(CloneFlags::CLONE_NEWNS).map_err(|e| format!("unshare: {e}"))
            })
            .and_then(|()| confine::enter(std::path::Path::new(&rootfs), &hostname));
        let reply = match &entered {
            Ok(()) => AgentMsg::Ready,
            Err(e) => AgentMsg::Error { message: e.clone() },
        };
        let _ = write_control(&mut conn, &reply);
        return entered;
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
