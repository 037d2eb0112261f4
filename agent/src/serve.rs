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
    read_frame, write_control, write_frame, AgentMsg, ExecSpec, Frame, FrameKind, HostMsg,
    ProcessEntry, PROTOCOL_VERSION,
};

/// Exit statuses of our own commands, collected by the reaper.
#[derive(Default)]
struct Children {
    /// Commands being spawned right now: the reaper leaves zombies alone meanwhile, since
    /// one of them may be a command whose PID is not registered yet.
    spawning: usize,
    owned: HashSet<i32>,
    exited: HashMap<i32, i32>,
}

type Shared = Arc<(Mutex<Children>, Condvar)>;

pub fn serve(listener: UnixListener) {
    let shared: Shared = Arc::default();
    {
        let shared = shared.clone();
        std::thread::spawn(move || reap(shared));
    }
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
    let mut c = lock.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        // While a command is being spawned the reaper keeps off: std reaps a child whose
        // exec failed itself, and a fast-exiting command is not registered yet.
        if c.spawning == 0 {
            let mut status = 0;
            // SAFETY: waitpid on any child; WNOHANG never blocks.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid > 0 {
                if c.owned.contains(&pid) {
                    c.exited.insert(pid, status);
                    cv.notify_all();
                }
                continue;
            }
        }
        // Poll fast while a command runs (its exit ends an exec), slowly when idle; a new
        // command wakes the reaper through the condvar.
        let wait = if c.owned.is_empty() && c.spawning == 0 {
            50
        } else {
            1
        };
        c = cv
            .wait_timeout(c, Duration::from_millis(wait))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

fn handle(conn: UnixStream, shared: Shared) -> std::io::Result<()> {
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
                drop(c);
                return send(&AgentMsg::Error {
                    message: format!("cannot run `{program}`: {e}"),
                });
            }
        }
    };
    let pid = child.id() as i32;
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
    send(&AgentMsg::Exited {
        code: st.code(),
        signal: st.signal(),
    })
}

/// Every process in the sandbox, read from /proc (the sandbox's own pid namespace).
pub fn processes() -> Vec<ProcessEntry> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
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
