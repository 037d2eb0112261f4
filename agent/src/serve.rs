//! Serving the host: one thread per connection, one conversation per connection. As pid 1
//! the agent also reaps every orphan in the sandbox.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use strata_agent::{
    read_frame, write_control, write_frame, AgentMsg, DirEntry, ExecSpec, Frame, FrameKind,
    HostMsg, ProcessEntry, MAX_FRAME, PROTOCOL_VERSION,
};

/// In a VM guest: the `cgroup.procs` file every command joins (the sandbox's budgets).
pub static COMMAND_CGROUP: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();

/// Exit statuses of our own commands, collected by the reaper.
#[derive(Default)]
pub(crate) struct Children {
    /// Commands being spawned right now: the reaper leaves zombies alone meanwhile, since
    /// one of them may be a command whose PID is not registered yet.
    spawning: usize,
    owned: HashSet<i32>,
    exited: HashMap<i32, i32>,
}

pub(crate) type Shared = Arc<(Mutex<Children>, Condvar)>;

/// Starts the reaper; the returned state is what every conversation shares.
pub(crate) fn start_reaper() -> Shared {
    let shared: Shared = Arc::default();
    let reaper = shared.clone();
    std::thread::spawn(move || reap(reaper));
    shared
}

pub fn serve(listener: UnixListener) {
    let shared = start_reaper();
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let shared = shared.clone();
        std::thread::spawn(move || {
            let _ = handle(conn, shared);
        });
    }
}

fn reap(shared: Shared) {
    let (lock, cv) = &*shared;
    loop {
        // Sleep in the kernel until a child has exited, without reaping it yet: polling
        // would take the CPU from the commands (in a TCG guest, a lot of it).
        // SAFETY: a zeroed siginfo_t is valid; waitid fills it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on any child with a valid out pointer; WNOWAIT leaves it waitable.
        let r = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
        let mut c = lock.lock().unwrap_or_else(|p| p.into_inner());
        if r != 0 {
            // No child at all: wait for a command to start. A command already started but
            // not yet seen by waitid is checked for first, so its exit is not missed.
            let running = c.spawning > 0 || c.owned.iter().any(|p| !c.exited.contains_key(p));
            let wait = Duration::from_millis(if running { 1 } else { 50 });
            let _ = cv.wait_timeout(c, wait);
            continue;
        }
        // While a command is being spawned the reaper keeps off: std reaps a child whose
        // exec failed itself, and a fast-exiting command is not registered yet.
        while c.spawning > 0 {
            c = cv.wait(c).unwrap_or_else(|p| p.into_inner());
        }
        // SAFETY: si_pid of a filled-in CLD_* siginfo.
        let pid = unsafe { info.si_pid() };
        let mut status = 0;
        // SAFETY: waitpid on that child; WNOHANG never blocks.
        let got = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if got == pid && c.owned.contains(&pid) {
            c.exited.insert(pid, status);
            cv.notify_all();
        }
    }
}

pub(crate) fn handle(conn: UnixStream, shared: Shared) -> std::io::Result<()> {
    let mut reader = conn.try_clone()?;
    let writer = Arc::new(Mutex::new(conn));
    let first = read_frame::<HostMsg>(&mut reader)?;
    let reply = |msg: &AgentMsg| -> std::io::Result<()> {
        let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
        write_control(&mut *w, msg)
    };
    match first {
        Some(Frame::Control(HostMsg::Ping)) => reply(&AgentMsg::Pong {
            version: PROTOCOL_VERSION,
            pid: std::process::id(),
        }),
        Some(Frame::Control(HostMsg::Ps)) => reply(&AgentMsg::Processes { list: processes() }),
        Some(Frame::Control(HostMsg::Exec(spec))) => exec(spec, reader, writer, shared),
        Some(Frame::Control(HostMsg::ReadFile { path })) => match read_file(&path) {
            Ok((mode, data)) => {
                reply(&AgentMsg::FileFollows { mode })?;
                let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
                write_frame(&mut *w, FrameKind::Stdout, &data)
            }
            Err(message) => reply(&AgentMsg::Error { message }),
        },
        Some(Frame::Control(HostMsg::WriteFile { path, mode })) => {
            let outcome = match read_frame::<HostMsg>(&mut reader)? {
                Some(Frame::Data(FrameKind::Stdin, data)) => write_file(&path, &data, mode),
                other => Err(format!("expected the file's bytes, got {other:?}")),
            };
            reply(&match outcome {
                Ok(()) => AgentMsg::Done,
                Err(message) => AgentMsg::Error { message },
            })
        }
        Some(Frame::Control(HostMsg::ListDir { path })) => reply(&match list_dir(&path) {
            Ok(list) => AgentMsg::Entries { list },
            Err(message) => AgentMsg::Error { message },
        }),
        Some(Frame::Control(HostMsg::Stats)) => reply(&match crate::guest::stats() {
            Ok(stats) => AgentMsg::Stats(stats),
            Err(message) => AgentMsg::Error { message },
        }),
        Some(Frame::Control(HostMsg::GuestSetup(setup))) => {
            reply(&match crate::guest::setup(&setup) {
                Ok(()) => AgentMsg::Ready,
                Err(message) => AgentMsg::Error { message },
            })
        }
        Some(Frame::Control(HostMsg::Reseed { time_ns, seed })) => {
            reply(&match crate::guest::reseed(time_ns, &seed) {
                Ok(()) => AgentMsg::Done,
                Err(message) => AgentMsg::Error { message },
            })
        }
        Some(other) => reply(&AgentMsg::Error {
            message: format!("unexpected first frame {other:?}"),
        }),
        None => Ok(()),
    }
}

fn exec(
    spec: ExecSpec,
    mut reader: UnixStream,
    writer: Arc<Mutex<UnixStream>>,
    shared: Shared,
) -> std::io::Result<()> {
    let send = |msg: &AgentMsg| {
        let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
        write_control(&mut *w, msg)
    };
    let Some(program) = spec.argv.first() else {
        return send(&AgentMsg::Error {
            message: "empty command".into(),
        });
    };
    let mut cmd = Command::new(program);
    cmd.args(&spec.argv[1..])
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&spec.cwd)
        .uid(spec.uid)
        .gid(spec.gid)
        .process_group(0)
        .stdin(if spec.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(procs) = COMMAND_CGROUP.get() {
        let procs = procs.clone();
        // SAFETY: between fork and exec only open/write/close run, all async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                // Join the budget cgroup, and be an OOM victim again (the agent is not).
                for (path, value) in [
                    (procs.as_ptr(), &b"0"[..]),
                    (c"/proc/self/oom_score_adj".as_ptr(), &b"0"[..]),
                ] {
                    let fd = libc::open(path, libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let ok =
                        libc::write(fd, value.as_ptr().cast(), value.len()) == value.len() as isize;
                    libc::close(fd);
                    if !ok {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }
    let (lock, cv) = &*shared;
    lock.lock().unwrap_or_else(|p| p.into_inner()).spawning += 1;
    let spawned = cmd.spawn();
    let mut child = {
        let mut c = lock.lock().unwrap_or_else(|p| p.into_inner());
        c.spawning -= 1;
        match spawned {
            Ok(child) => {
                c.owned.insert(child.id() as i32);
                cv.notify_all();
                child
            }
            Err(e) => {
                cv.notify_all();
                drop(c);
                return send(&AgentMsg::Error {
                    message: format!("cannot run `{program}`: {e}"),
                });
            }
        }
    };
    let pid = child.id() as i32;
    let before = COMMAND_CGROUP
        .get()
        .and_then(|_| crate::guest::stats().ok());
    send(&AgentMsg::Started { pid: pid as u32 })?;

    let pumps: Vec<_> = [
        (
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            FrameKind::Stdout,
        ),
        (
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            FrameKind::Stderr,
        ),
    ]
    .into_iter()
    .filter_map(|(src, kind)| src.map(|s| (s, kind)))
    .map(|(mut src, kind)| {
        let writer = writer.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match src.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
                        if write_frame(&mut *w, kind, &buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
        })
    })
    .collect();

    // Host frames while the command runs: stdin and signals.
    let mut stdin = child.stdin.take();
    std::thread::spawn(move || loop {
        match read_frame::<HostMsg>(&mut reader) {
            Ok(Some(Frame::Data(FrameKind::Stdin, data))) => {
                if let Some(s) = stdin.as_mut() {
                    if s.write_all(&data).is_err() {
                        stdin = None;
                    }
                }
            }
            Ok(Some(Frame::Data(FrameKind::StdinEof, _))) => stdin = None,
            Ok(Some(Frame::Control(HostMsg::Signal { signal }))) => {
                // SAFETY: signals the command's own process group.
                unsafe { libc::kill(-pid, signal) };
            }
            Ok(Some(_)) => {}
            // Host gone: the command keeps running, like a detached exec.
            Ok(None) | Err(_) => break,
        }
    });

    let status = {
        let mut c = lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(s) = c.exited.remove(&pid) {
                c.owned.remove(&pid);
                break s;
            }
            c = cv.wait(c).unwrap_or_else(|p| p.into_inner());
        }
    };
    // Output still buffered in the pipes is delivered; a background process that keeps a
    // pipe open does not hold the exec open beyond a short grace.
    let deadline = std::time::Instant::now() + Duration::from_millis(200);
    for p in pumps {
        while !p.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    let st = std::process::ExitStatus::from_raw(status);
    let guest = before.and_then(|b| {
        let a = crate::guest::stats().ok()?;
        Some(strata_agent::GuestStats {
            oom_kills: a.oom_kills.saturating_sub(b.oom_kills),
            pids_max_hits: a.pids_max_hits.saturating_sub(b.pids_max_hits),
            ..a
        })
    });
    send(&AgentMsg::Exited {
        code: st.code(),
        signal: st.signal(),
        guest,
    })
}

/// A whole file of the agent's root, with its permission bits.
fn read_file(path: &str) -> Result<(u32, Vec<u8>), String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("{path}: {e}"))?;
    if meta.len() > MAX_FRAME as u64 {
        return Err(format!(
            "{path}: {} bytes is more than the {MAX_FRAME} one read returns; copy it out with a command",
            meta.len()
        ));
    }
    let data = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    Ok((meta.permissions().mode() & 0o7777, data))
}

/// Writes a whole file (parent directories made as needed), replacing it atomically.
fn write_file(path: &str, data: &[u8], mode: u32) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let target = std::path::Path::new(path);
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    let tmp = format!("{path}.strata-tmp");
    std::fs::write(&tmp, data).map_err(|e| format!("{path}: {e}"))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .and_then(|()| std::fs::rename(&tmp, target))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("{path}: {e}")
        })
}

fn list_dir(path: &str) -> Result<Vec<DirEntry>, String> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    for e in std::fs::read_dir(path).map_err(|e| format!("{path}: {e}"))? {
        let e = e.map_err(|e| format!("{path}: {e}"))?;
        let Ok(meta) = e.metadata() else { continue };
        let ft = meta.file_type();
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_symlink() {
            "symlink"
        } else if ft.is_file() {
            "file"
        } else {
            "other"
        };
        out.push(DirEntry {
            name: e.file_name().to_string_lossy().into_owned(),
            kind: kind.into(),
            size: meta.len(),
            mode: meta.permissions().mode() & 0o7777,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Every process in the sandbox, read from /proc (the sandbox's own pid namespace).
///
/// In a VM guest (no pid namespace) only the sandbox cgroup's processes count.
pub fn processes() -> Vec<ProcessEntry> {
    let mut out = Vec::new();
    let pids: Vec<u32> = match COMMAND_CGROUP.get() {
        Some(procs) => std::fs::read_to_string(procs.to_string_lossy().as_ref())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect(),
        None => match std::fs::read_dir("/proc") {
            Ok(rd) => rd
                .flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
                .collect(),
            Err(_) => return out,
        },
    };
    for pid in pids {
        if let Some(p) = read_process(pid) {
            out.push(p);
        }
    }
    out.sort_by_key(|p| p.pid);
    out
}

fn read_process(pid: u32) -> Option<ProcessEntry> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces; fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let state = fields.first()?.to_string();
    let ppid = fields.get(1)?.parse().ok()?;
    let rss_pages: u64 = fields.get(21)?.parse().ok()?;
    let cmdline = strata_agent::proc_cmdline(pid);
    Some(ProcessEntry {
        pid,
        ppid,
        state,
        rss_bytes: rss_pages * 4096,
        cmdline,
    })
}
