//! `strata-agent`: the in-sandbox side of Strata.
//!
//! `strata-agent sandbox` (its boot settings, [`SandboxBoot`], as JSON on stdin) becomes
//! pid 1 of a function-call sandbox: enters fresh mount, pid, network, IPC and UTS
//! namespaces, pivots into the assembled root filesystem, locks itself down (capabilities,
//! no_new_privs, seccomp, rlimits: all inherited by what it runs) and then serves the
//! host over a Unix socket, forking each command from inside, each in a Landlock domain
//! of its own holding the sandbox's filesystem rules. Because the agent already
//! sits in the sandbox's cgroups, a command joins them by inheritance, without paying a
//! cgroup attach. The first process prints the agent's host PID on stdout once it serves,
//! then exits. With no `rootfs` it is a pooled agent: the same init started ahead of time,
//! in its cgroups and fresh pid/IPC/UTS namespaces but still in the host's mount
//! namespace, waiting for one `Setup` naming the root; a pool of these makes a sandbox
//! start without the ~10 ms-per-hierarchy cgroup attach and the process start.
//!
//! `strata-agent egress CONFIG` is the host-side egress proxy of a networked sandbox with
//! rules by name (see [`egress`]).
//!
//! `strata-agent init --listen-fd N --key-fd M` is the init of a container (see
//! [`container_init`]); as `/init` of a VM guest's initramfs it is the guest's pid 1 (see
//! `guest`); `strata-agent relay` is the host-side helper of a VM (see `relay`).
//!
//! In every role the agent is not dumpable (see `sys::not_dumpable`) and holds its
//! sandbox's key only in memory.

mod confine;
mod filter;
mod guest;
mod relay;
mod serve;
mod sys;

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::sync::Mutex;

use nix::sched::CloneFlags;
use nix::unistd::ForkResult;
use strata_agent_proto::{AgentError, AgentMsg, ErrorKind, HostMsg, SandboxBoot, SandboxKey};

const USAGE: &str = "usage: strata-agent sandbox (settings as JSON on stdin) | strata-agent init --listen-fd N --key-fd M | strata-agent relay ... | strata-agent egress CONFIG";

fn read_boot() -> Result<SandboxBoot, String> {
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .map_err(|e| format!("reading the boot settings from stdin: {e}"))?;
    serde_json::from_str(&text).map_err(|e| format!("boot settings on stdin: {e}"))
}

/// Reads a whole descriptor (a pipe the host filled and closed) and closes it.
fn read_fd(fd: i32) -> Result<String, String> {
    let mut f = std::fs::File::from(
        sys::take_fd(fd).map_err(|e| format!("descriptor {fd} the host passed: {e}"))?,
    );
    let mut text = String::new();
    f.read_to_string(&mut text)
        .map_err(|e| format!("reading descriptor {fd}: {e}"))?;
    Ok(text)
}

/// `strata-agent init --listen-fd N --key-fd M`: the init of a container the OCI runtime
/// already built and confined. It serves on a listening socket the host made and passed
/// in (`--preserve-fds`), so the socket lives where the sandbox cannot see or replace it,
/// takes the sandbox key from a pipe, and forks each command inside: commands inherit the
/// container's namespaces, confinement and cgroups, with no OCI runtime `exec` and no
/// cgroup attach per command.
fn container_init() -> Result<(), String> {
    let (mut listen, mut key) = (None, None);
    let mut it = std::env::args().skip(2);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let fd: i32 = value.parse().map_err(|_| format!("bad fd {value}"))?;
        match flag.as_str() {
            "--listen-fd" => listen = Some(fd),
            "--key-fd" => key = Some(fd),
            other => return Err(format!("unknown option {other}")),
        }
    }
    let (Some(listen), Some(key)) = (listen, key) else {
        return Err(USAGE.into());
    };
    let key = SandboxKey::from_hex(&read_fd(key)?).map_err(|e| e.to_string())?;
    serve::set_key(key);
    let listener =
        sys::take_fd(listen).map_err(|e| format!("listening descriptor {listen}: {e}"))?;
    // Nothing the OCI runtime passed stays open but the listening socket (the agent's own
    // executable among them): a process checkpoint saves every descriptor.
    sys::close_all_but(listen);
    close_inherited_stdio();
    confine::apply_seccomp()?;
    serve::serve_parkable(listener, confine::Jail::scope());
    Ok(())
}

/// The descriptor a fncall agent serves on: the container init's, which the runtime takes
/// back after a checkpoint (`strata_runtime`'s `checkpoint::AGENT_LISTEN_FD`).
const LISTEN_FD: std::os::fd::RawFd = 3;

/// A subcommand taking its remaining arguments.
type Helper = fn(&[String]) -> Result<(), String>;

fn main() {
    sys::not_dumpable();
    if let Some(v) = std::env::var("STRATA_AGENT_PROTOCOL")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        let _ = serve::SPEAKS.set(v);
    }
    if guest::is_guest_init() {
        guest::main();
    }
    let role = std::env::args().nth(1).unwrap_or_default();
    // A VM's host-side helpers.
    let helper: Option<(&str, Helper)> = match role.as_str() {
        "relay" => Some(("relay", relay::main)),
        "egress" => Some(("egress", egress)),
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
    let result = match role.as_str() {
        "init" => container_init(),
        "sandbox" => read_boot().and_then(run),
        "--version" => {
            println!(
                "strata-agent {} (protocol v{})",
                env!("CARGO_PKG_VERSION"),
                strata_agent_proto::PROTOCOL_VERSION
            );
            return;
        }
        _ => {
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    };
    if let Err(e) = result {
        eprintln!("strata-agent: {e}");
        std::process::exit(1);
    }
}

/// `strata-agent egress CONFIG`: binds the proxy's sockets (so a failure is this
/// process's exit status), then serves from a child of its own session; the parent
/// prints the child's PID and exits, so whoever starts it has nothing to reap.
fn egress(args: &[String]) -> Result<(), String> {
    let [config] = args else {
        return Err("usage: strata-agent egress CONFIG".into());
    };
    let text = std::fs::read(config).map_err(|e| format!("{config}: {e}"))?;
    let cfg: strata_egress::ProxyConfig =
        serde_json::from_slice(&text).map_err(|e| format!("{config}: {e}"))?;
    let proxy = strata_egress::Proxy::bind(cfg).map_err(|e| e.to_string())?;
    match sys::fork_single_threaded().map_err(|e| format!("fork: {e}"))? {
        ForkResult::Parent { child } => {
            println!("{child}");
            Ok(())
        }
        ForkResult::Child => {
            let _ = nix::unistd::setsid();
            close_inherited_stdio();
            proxy.serve();
            std::process::exit(0);
        }
    }
}

fn run(boot: SandboxBoot) -> Result<(), String> {
    let key = SandboxKey::from_hex(&boot.key).map_err(|e| e.to_string())?;
    serve::set_key(key);
    // Bound before the pivot, in the host's view of the filesystem, so the host can reach
    // it; at the descriptor a parked agent keeps (see `serve::serve_parkable`), where the
    // host finds it again after a checkpoint.
    let _ = std::fs::remove_file(&boot.socket);
    let listener = strata_host::unix::bind(std::path::Path::new(&boot.socket))
        .map_err(|e| format!("listening on {}: {e}", boot.socket))?;
    let listener = sys::onto(OwnedFd::from(listener), LISTEN_FD)
        .map_err(|e| format!("moving the listening socket to descriptor {LISTEN_FD}: {e}"))?;
    let flags = CloneFlags::CLONE_NEWPID | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWUTS;
    let mut mountns = boot
        .mountns_fd
        .map(|fd| {
            sys::take_fd(fd)
                .map_err(|e| format!("the launch mount namespace at descriptor {fd}: {e}"))
        })
        .transpose()?;
    if let Some(rootfs) = &boot.rootfs {
        enter_network(boot.netns.as_deref())?;
        new_mount_namespace(rootfs, mountns.take())?;
    }
    nix::sched::unshare(flags).map_err(|e| format!("unshare: {e}"))?;
    let (ready_r, ready_w) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
    match sys::fork_single_threaded().map_err(|e| format!("fork: {e}"))? {
        ForkResult::Parent { child } => {
            drop(ready_w);
            let mut report = String::new();
            let _ = std::fs::File::from(ready_r).read_to_string(&mut report);
            if report.trim() == "ok" {
                println!("{child}");
                Ok(())
            } else {
                let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
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
            // Pid 1 of its namespace leads a session of its own, as a container's init
            // does: nothing of the sandbox belongs to a session outside it (which a
            // process checkpoint could not restore).
            let _ = nix::unistd::setsid();
            let entered = match &boot.rootfs {
                None => Ok(()),
                Some(rootfs) => {
                    confine::enter(std::path::Path::new(rootfs), &boot.hostname, boot.shm_bytes)
                }
            };
            match entered {
                Ok(()) => {
                    let _ = ready.write_all(b"ok");
                    drop(ready);
                    close_inherited_stdio();
                    if boot.rootfs.is_some()
                        || await_setup(&sys::borrow_listener(LISTEN_FD), mountns).is_ok()
                    {
                        // Inside its root now: stdio on the sandbox's own /dev/null, and no
                        // other descriptor of the host's (a process checkpoint saves them all).
                        close_inherited_stdio();
                        sys::close_all_but(LISTEN_FD);
                        serve::serve_parkable(listener, confine::Jail::fncall());
                    }
                    std::process::exit(1);
                }
                Err(e) => {
                    let _ = ready.write_all(e.as_bytes());
                    std::process::exit(1);
                }
            }
        }
    }
}

/// Enters a fresh mount namespace for the root `rootfs`: a copy of the host's launch
/// namespace `mountns` with the root carried in (none of the other sandboxes' mounts to
/// copy), or, without one, of the host's whole mount table.
fn new_mount_namespace(rootfs: &str, mountns: Option<OwnedFd>) -> Result<(), String> {
    match mountns {
        Some(ns) => {
            let root = strata_host::mountns::carry(std::path::Path::new(rootfs))
                .map_err(|e| format!("carrying the root {rootfs}: {e}"))?;
            strata_host::mountns::enter_now(ns, &[root])
                .map_err(|e| format!("entering the launch mount namespace: {e}"))
        }
        None => nix::sched::unshare(CloneFlags::CLONE_NEWNS).map_err(|e| format!("unshare: {e}")),
    }
}

/// Joins `netns`, or enters a fresh, empty network namespace.
fn enter_network(netns: Option<&str>) -> Result<(), String> {
    match netns {
        Some(path) => {
            let ns =
                std::fs::File::open(path).map_err(|e| format!("network namespace {path}: {e}"))?;
            nix::sched::setns(ns, CloneFlags::CLONE_NEWNET)
                .map_err(|e| format!("joining {path}: {e}"))
        }
        None => nix::sched::unshare(CloneFlags::CLONE_NEWNET).map_err(|e| format!("unshare: {e}")),
    }
}

/// A pooled agent's wait: the first conversation that opens (the handshake proves the
/// slot's key) must bring `Setup`; the agent then takes the sandbox's key, enters the root
/// (still single-threaded, as setns and unshare require) and answers `Ready`.
fn await_setup(listener: &UnixListener, mut mountns: Option<OwnedFd>) -> Result<(), String> {
    loop {
        let (conn, _) = listener.accept().map_err(|e| e.to_string())?;
        let mut reader = conn.try_clone().map_err(|e| e.to_string())?;
        let writer = Mutex::new(conn);
        let reply = |msg: AgentMsg| {
            let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
            let _ = strata_agent_proto::write_control(&mut *w, &msg);
        };
        let setup = match serve::open(&mut reader, &writer) {
            Ok(Some(HostMsg::Setup(s))) => s,
            Ok(Some(HostMsg::Ping)) => {
                reply(AgentMsg::Pong {
                    version: strata_agent_proto::PROTOCOL_VERSION,
                    pid: std::process::id(),
                });
                continue;
            }
            Ok(Some(_)) => {
                reply(AgentMsg::Error(AgentError::new(
                    ErrorKind::Invalid,
                    "this agent waits for Setup",
                )));
                continue;
            }
            Ok(None) | Err(_) => continue,
        };
        let entered = SandboxKey::from_hex(&setup.key)
            .map_err(|e| e.to_string())
            .and_then(|key| {
                enter_network(setup.netns.as_deref())?;
                new_mount_namespace(&setup.rootfs, mountns.take())?;
                confine::enter(
                    std::path::Path::new(&setup.rootfs),
                    &setup.hostname,
                    setup.shm_bytes,
                )?;
                serve::set_key(key);
                Ok(())
            });
        reply(match &entered {
            Ok(()) => AgentMsg::Ready,
            Err(e) => AgentMsg::Error(AgentError::new(ErrorKind::Setup, e.clone())),
        });
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
            sys::dup_onto(&fd, target);
        }
    }
}
