//! Serving the host: one thread per connection, one conversation per connection, each
//! opened by the handshake (protocol version, proof of the sandbox key). As pid 1 the agent
//! also reaps every orphan in the sandbox. Commands are forked here and enter the
//! [`Jail`] between fork and exec.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::os::fd::{IntoRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use serde_json::Value;
use strata_agent_proto::{
    handshake, read_frame, write_control, write_frame, AgentError, AgentMsg, DirEntry, EntryKind,
    ErrorKind, ExecSpec, Frame, FrameKind, HostMsg, ProcessEntry, SandboxKey, MAX_FRAME,
    PROTOCOL_VERSION,
};

use crate::confine::Jail;

/// In a VM guest: the `cgroup.procs` file every command joins (the sandbox's budgets).
pub static COMMAND_CGROUP: OnceLock<std::ffi::CString> = OnceLock::new();

/// What every command enters; set when the agent starts serving a sandbox (a VM guest's at
/// its setup). No command runs before.
pub static JAIL: OnceLock<Jail> = OnceLock::new();

/// The protocol version this agent answers with: its own, unless `STRATA_AGENT_PROTOCOL`
/// makes it pretend to be another build's (how the tests check that a host refuses an
/// agent of another version, and drains a pool of them).
pub static SPEAKS: OnceLock<u32> = OnceLock::new();

fn speaks() -> u32 {
    *SPEAKS.get().unwrap_or(&PROTOCOL_VERSION)
}

/// The sandbox's key; none only in a VM guest before its setup.
static KEY: Mutex<Option<SandboxKey>> = Mutex::new(None);

pub fn set_key(key: SandboxKey) {
    *KEY.lock().unwrap_or_else(|p| p.into_inner()) = Some(key);
}

fn key() -> Option<SandboxKey> {
    KEY.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

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

fn spawn_conversation(conn: UnixStream, shared: Shared) {
    OPEN_CONVERSATIONS.fetch_add(1, Ordering::SeqCst);
    // A thread the sandbox's pids budget has no room for (its commands took it all) is a
    // refused conversation, never a panic of the accept loop: the connection closes and
    // the host reports the agent unreachable for this call only.
    let started = std::thread::Builder::new().spawn(move || {
        let _ = handle(conn, shared);
        OPEN_CONVERSATIONS.fetch_sub(1, Ordering::SeqCst);
    });
    if started.is_err() {
        OPEN_CONVERSATIONS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Conversations being served now (a park waits until it is the only one).
static OPEN_CONVERSATIONS: AtomicUsize = AtomicUsize::new(0);

/// The agent's listening descriptor: set when it serves parkably.
static LISTEN_FD: OnceLock<RawFd> = OnceLock::new();

/// A park's progress: asked for (the accept loop stops), then done (the listening socket
/// is replaced by the unbound one).
#[derive(Default)]
struct ParkState {
    asked: bool,
    parked: bool,
}

static PARK: (Mutex<ParkState>, Condvar) = (
    Mutex::new(ParkState {
        asked: false,
        parked: false,
    }),
    Condvar::new(),
);

/// How often a parked agent looks for the listening socket a restore puts in place.
const PARKED_POLL: Duration = Duration::from_millis(2);

/// Serves a sandbox whose root is in place (its commands get `jail`), as an init a
/// process checkpoint may save and restore (a container's or a fncall sandbox's): on
/// `Park` it stops accepting, replaces its listening socket (made in the host's
/// namespaces, where a checkpoint cannot follow) with an unbound socket of its own at the
/// same descriptor number, and serves again once that socket listens: the host binds it
/// at its path and makes it listen, after the restore (or after a checkpoint that
/// failed).
pub fn serve_parkable(listener: OwnedFd, jail: Jail) {
    let _ = JAIL.set(jail);
    let shared = start_reaper();
    let fd = listener.into_raw_fd();
    let _ = LISTEN_FD.set(fd);
    loop {
        let listener = crate::sys::borrow_listener(fd);
        for conn in listener.incoming() {
            match conn {
                Ok(conn) => spawn_conversation(conn, shared.clone()),
                Err(_) if PARK.0.lock().unwrap_or_else(|p| p.into_inner()).asked => break,
                // (Out of descriptors, say: no spinning on it.)
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        let placed = crate::sys::park_listener(fd);
        {
            let mut p = PARK.0.lock().unwrap_or_else(|p| p.into_inner());
            p.parked = placed.is_ok();
            if placed.is_err() {
                // The listener is still there (shut down): nothing to wait for.
                p.asked = false;
            }
            PARK.1.notify_all();
        }
        while !crate::sys::is_listening(fd) {
            std::thread::sleep(PARKED_POLL);
        }
        let mut p = PARK.0.lock().unwrap_or_else(|p| p.into_inner());
        *p = ParkState::default();
    }
}

/// Answers `Park` (see [`serve_parkable`]).
fn park() -> Result<AgentMsg, AgentError> {
    let Some(&fd) = LISTEN_FD.get() else {
        return Err(AgentError::new(
            ErrorKind::Invalid,
            "only a container's or fncall sandbox's agent parks for a checkpoint",
        ));
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // Every other conversation ends first: their descriptors are the host's too.
    while OPEN_CONVERSATIONS.load(Ordering::SeqCst) > 1 {
        if std::time::Instant::now() > deadline {
            return Err(AgentError::new(
                ErrorKind::Invalid,
                "other conversations with the agent are still open",
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut p = PARK.0.lock().unwrap_or_else(|p| p.into_inner());
    p.asked = true;
    crate::sys::shut_listener(fd);
    while !p.parked {
        let (next, timeout) = PARK
            .1
            .wait_timeout(
                p,
                deadline.saturating_duration_since(std::time::Instant::now()),
            )
            .unwrap_or_else(|e| e.into_inner());
        p = next;
        if timeout.timed_out() && !p.parked {
            return Err(AgentError::new(
                ErrorKind::Invalid,
                "the agent's accept loop did not stop",
            ));
        }
    }
    Ok(AgentMsg::Done)
}

fn send(writer: &Mutex<UnixStream>, msg: &AgentMsg) -> std::io::Result<()> {
    let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
    write_control(&mut *w, msg)
}

/// Opens a conversation: the handshake, then the request. `None` when the peer was
/// refused (another version, a wrong key) or left.
pub(crate) fn open(
    reader: &mut impl Read,
    writer: &Mutex<UnixStream>,
) -> std::io::Result<Option<HostMsg>> {
    let Some(Frame::Control(first)) = read_frame::<Value>(reader)? else {
        return Ok(None);
    };
    let answer = handshake::answer_as(speaks(), key().as_ref(), &first);
    send(writer, &answer)?;
    if !matches!(answer, AgentMsg::Welcome { .. }) {
        return Ok(None);
    }
    match read_frame::<HostMsg>(reader) {
        Ok(Some(Frame::Control(m))) => Ok(Some(m)),
        Ok(Some(Frame::Data(..))) => {
            send(
                writer,
                &AgentError::new(ErrorKind::Invalid, "expected a request, got data").into(),
            )?;
            Ok(None)
        }
        Ok(None) => Ok(None),
        Err(e) => {
            send(
                writer,
                &AgentError::new(ErrorKind::Invalid, format!("bad request: {e}")).into(),
            )?;
            Ok(None)
        }
    }
}

fn reap(shared: Shared) {
    let (lock, cv) = &*shared;
    loop {
        // Sleep in the kernel until a child has exited, without reaping it yet: polling
        // would take the CPU from the commands (in a TCG guest, a lot of it).
        let exited = crate::sys::wait_for_exit();
        let mut c = lock.lock().unwrap_or_else(|p| p.into_inner());
        let Some(pid) = exited else {
            // No child at all: wait for a command to start (its spawn notifies). A command
            // already started but not yet seen by waitid is checked for first, so its exit
            // is not missed. Idle, the wait is long: a node holds a thousand idle agents,
            // whose wakeups would otherwise take its CPUs; a process that becomes the
            // agent's child without a spawn (an orphan of a process that entered the
            // sandbox from outside) is reaped within it.
            let running = c.spawning > 0 || c.owned.iter().any(|p| !c.exited.contains_key(p));
            let wait = Duration::from_millis(if running { 1 } else { 1000 });
            let _ = cv.wait_timeout(c, wait);
            continue;
        };
        // While a command is being spawned the reaper keeps off: std reaps a child whose
        // exec failed itself, and a fast-exiting command is not registered yet.
        while c.spawning > 0 {
            c = cv.wait(c).unwrap_or_else(|p| p.into_inner());
        }
        let status = crate::sys::reap(pid);
        if let Some(status) = status.filter(|_| c.owned.contains(&pid)) {
            c.exited.insert(pid, status);
            cv.notify_all();
        }
    }
}

pub(crate) fn handle(conn: UnixStream, shared: Shared) -> std::io::Result<()> {
    let mut reader = conn.try_clone()?;
    let writer = Arc::new(Mutex::new(conn));
    let Some(request) = open(&mut reader, &writer)? else {
        return Ok(());
    };
    let reply = |msg: AgentMsg| send(&writer, &msg);
    let result = |r: Result<AgentMsg, AgentError>| r.unwrap_or_else(AgentMsg::Error);
    // A guest before its setup has no key and no sandbox: nothing but the setup and a
    // liveness check is served.
    let set_up = JAIL.get().is_some();
    match request {
        HostMsg::Ping => reply(AgentMsg::Pong {
            version: speaks(),
            pid: std::process::id(),
        }),
        HostMsg::GuestSetup(setup) => reply(result(
            crate::guest::setup(&setup).map(|()| AgentMsg::Ready),
        )),
        HostMsg::Stats => reply(result(crate::guest::stats().map(AgentMsg::Stats))),
        _ if !set_up => reply(AgentMsg::Error(AgentError::new(
            ErrorKind::Invalid,
            "this agent serves no sandbox yet",
        ))),
        HostMsg::Ps => reply(AgentMsg::Processes { list: processes() }),
        HostMsg::Exec(spec) => exec(spec, reader, writer, shared),
        HostMsg::ReadFile { path } => match read_file(&path) {
            Ok((mode, data)) => {
                reply(AgentMsg::FileFollows { mode })?;
                let mut w = writer.lock().unwrap_or_else(|p| p.into_inner());
                write_frame(&mut *w, FrameKind::Stdout, &data)
            }
            Err(e) => reply(AgentMsg::Error(e)),
        },
        HostMsg::WriteFile { path, mode } => {
            let outcome = match read_frame::<HostMsg>(&mut reader)? {
                Some(Frame::Data(FrameKind::Stdin, data)) => write_file(&path, &data, mode),
                _ => Err(AgentError::new(
                    ErrorKind::Invalid,
                    "expected the file's bytes after write-file",
                )),
            };
            reply(result(outcome.map(|()| AgentMsg::Done)))
        }
        HostMsg::ListDir { path } => reply(result(
            list_dir(&path).map(|list| AgentMsg::Entries { list }),
        )),
        HostMsg::Connect { port } => relay_port(port, reader, &writer),
        HostMsg::Park => reply(result(park())),
        HostMsg::Reseed(r) => reply(result(
            crate::guest::reseed(r.time_ns, &r.seed, r.hostname.as_deref())
                .and_then(|()| match &r.network {
                    Some(net) => {
                        crate::guest::network(net).map_err(|e| AgentError::new(ErrorKind::Other, e))
                    }
                    None => Ok(()),
                })
                .and_then(|()| SandboxKey::from_hex(&r.key).map_err(bad_key))
                .map(|k| {
                    set_key(k);
                    AgentMsg::Done
                }),
        )),
        other => reply(AgentMsg::Error(AgentError::new(
            ErrorKind::Invalid,
            format!(
                "`{}` is not a request this agent serves here",
                op_name(&other)
            ),
        ))),
    }
}

/// Joins the conversation to a TCP connection to `port` on the loopback, byte for byte,
/// until either side ends (the agent shares the sandbox's network: a VM guest's own, or
/// the namespace a function-call sandbox's agent entered).
fn relay_port(
    port: u16,
    mut from_host: UnixStream,
    writer: &Mutex<UnixStream>,
) -> std::io::Result<()> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let tcp = match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
        Ok(t) => t,
        Err(e) => {
            return send(
                writer,
                &AgentError::new(ErrorKind::of_io(&e), format!("port {port}: {e}")).into(),
            )
        }
    };
    send(writer, &AgentMsg::Connected)?;
    let mut to_port = tcp.try_clone()?;
    // Ends when the host ends the conversation (its side of the stream closes).
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from_host, &mut to_port);
        let _ = to_port.shutdown(std::net::Shutdown::Write);
    });
    // Nothing else writes in this conversation from here on.
    let mut to_host = writer.lock().unwrap_or_else(|p| p.into_inner());
    let mut from_port = tcp;
    let _ = std::io::copy(&mut from_port, &mut *to_host);
    to_host.shutdown(std::net::Shutdown::Write)
}

pub(crate) fn bad_key(e: strata_agent_proto::HandshakeError) -> AgentError {
    AgentError::new(ErrorKind::Invalid, e.to_string())
}

fn op_name(m: &HostMsg) -> String {
    serde_json::to_value(m)
        .ok()
        .and_then(|v| v.get("op").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_default()
}

fn exec(
    spec: ExecSpec,
    mut reader: UnixStream,
    writer: Arc<Mutex<UnixStream>>,
    shared: Shared,
) -> std::io::Result<()> {
    let send = |msg: &AgentMsg| self::send(&writer, msg);
    let Some(program) = spec.argv.first() else {
        return send(&AgentError::new(ErrorKind::Invalid, "empty command").into());
    };
    let Some(jail) = JAIL.get() else {
        return send(&AgentError::new(ErrorKind::Invalid, "no sandbox to run in").into());
    };
    // Every thread this exec needs runs before the command exists: a command that takes
    // its whole pids budget at once (a fork bomb) would otherwise leave the agent unable to
    // start the threads that carry its output and exit back, and the host would see the
    // agent vanish instead of the budget that ended the command.
    let pipes = (|| -> std::io::Result<_> {
        let stdin = if spec.stdin {
            Some(std::io::pipe()?)
        } else {
            None
        };
        Ok((std::io::pipe()?, std::io::pipe()?, stdin))
    })();
    let ((out_r, out_w), (err_r, err_w), stdin_pipe) = match pipes {
        Ok(p) => p,
        Err(e) => {
            return send(&AgentError::new(ErrorKind::ExecFailed, format!("pipe: {e}")).into())
        }
    };
    let (stdin_r, stdin_w) = match stdin_pipe {
        Some((r, w)) => (Stdio::from(r), Some(w)),
        None => (Stdio::null(), None),
    };
    let pid_cell: Arc<OnceLock<i32>> = Arc::default();
    // Pumps wait for `Started` to be sent before their first frame.
    let mut go = Vec::new();
    let pumps: std::io::Result<Vec<_>> = [
        (Box::new(out_r) as Box<dyn Read + Send>, FrameKind::Stdout),
        (Box::new(err_r) as Box<dyn Read + Send>, FrameKind::Stderr),
    ]
    .into_iter()
    .map(|(mut src, kind)| {
        let writer = writer.clone();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        go.push(go_tx);
        std::thread::Builder::new().spawn(move || {
            let _ = go_rx.recv();
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
    // Host frames while the command runs: stdin and signals (not waited for).
    let mut stdin = stdin_w;
    let signalled = pid_cell.clone();
    let host_frames = std::thread::Builder::new().spawn(move || loop {
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
                // The command's own process group (signals come after `Started`).
                if let Some(pid) = signalled.get() {
                    crate::sys::signal_group(*pid, signal);
                }
            }
            Ok(Some(_)) => {}
            // Host gone: the command keeps running, like a detached exec.
            Ok(None) | Err(_) => break,
        }
    });
    let pumps = match host_frames.and(pumps) {
        Ok(pumps) => pumps,
        Err(e) => {
            return send(
                &AgentError::new(
                    ErrorKind::ExecFailed,
                    format!(
                        "the agent cannot start a thread for the command ({e}): the sandbox's pids budget is taken"
                    ),
                )
                .into(),
            )
        }
    };
    let mut cmd = Command::new(program);
    cmd.args(&spec.argv[1..])
        .env_clear()
        .envs(spec.env.iter())
        .current_dir(&spec.cwd)
        .process_group(0)
        .stdin(stdin_r)
        .stdout(out_w)
        .stderr(err_w);
    let procs = COMMAND_CGROUP.get().cloned();
    let (uid, gid) = (spec.uid, spec.gid);
    let entry = match jail.prepare() {
        Ok(entry) => entry,
        Err(e) => {
            return send(
                &AgentError::new(
                    ErrorKind::ExecFailed,
                    format!("cannot confine the command: {e}"),
                )
                .into(),
            )
        }
    };
    crate::sys::before_exec(&mut cmd, move || {
        crate::sys::default_signals();
        if let Some(procs) = &procs {
            // Join the budget cgroup, and be an OOM victim again (the agent is not).
            crate::sys::write_now(procs, b"0")?;
            crate::sys::write_now(c"/proc/self/oom_score_adj", b"0")?;
        }
        entry.enter(uid, gid)
    });
    let (lock, cv) = &*shared;
    lock.lock().unwrap_or_else(|p| p.into_inner()).spawning += 1;
    let spawned = cmd.spawn();
    // Our copies of the pipes' write ends close here, so the pumps see the end of output.
    drop(cmd);
    let child = {
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
                return send(
                    &AgentError::new(
                        ErrorKind::ExecFailed,
                        format!("cannot run `{program}`: {e}"),
                    )
                    .into(),
                );
            }
        }
    };
    let pid = child.id() as i32;
    let before = COMMAND_CGROUP
        .get()
        .and_then(|_| crate::guest::stats().ok());
    let _ = pid_cell.set(pid);
    send(&AgentMsg::Started { pid: pid as u32 })?;
    for g in go {
        let _ = g.send(());
    }

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
        Some(strata_agent_proto::GuestStats {
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
fn read_file(path: &str) -> Result<(u32, Vec<u8>), AgentError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|e| AgentError::io(path, &e))?;
    if meta.len() > MAX_FRAME as u64 {
        return Err(AgentError::new(
            ErrorKind::TooLarge,
            format!(
                "{path}: {} bytes is more than the {MAX_FRAME} one read returns; copy it out with a command",
                meta.len()
            ),
        ));
    }
    let data = std::fs::read(path).map_err(|e| AgentError::io(path, &e))?;
    Ok((meta.permissions().mode() & 0o7777, data))
}

/// Writes a whole file (parent directories made as needed), replacing it atomically.
fn write_file(path: &str, data: &[u8], mode: u32) -> Result<(), AgentError> {
    use std::os::unix::fs::PermissionsExt;
    let target = std::path::Path::new(path);
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| AgentError::io(&parent.display().to_string(), &e))?;
    }
    let tmp = format!("{path}.strata-tmp");
    std::fs::write(&tmp, data).map_err(|e| AgentError::io(path, &e))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))
        .and_then(|()| std::fs::rename(&tmp, target))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            AgentError::io(path, &e)
        })
}

fn list_dir(path: &str) -> Result<Vec<DirEntry>, AgentError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mut out = Vec::new();
    for e in std::fs::read_dir(path).map_err(|e| AgentError::io(path, &e))? {
        let e = e.map_err(|e| AgentError::io(path, &e))?;
        let Ok(meta) = e.metadata() else { continue };
        out.push(DirEntry {
            name: e.file_name().to_string_lossy().into_owned(),
            kind: EntryKind::of(&meta.file_type()),
            size: meta.len(),
            mode: meta.permissions().mode() & 0o7777,
            mtime: meta.mtime(),
            uid: meta.uid(),
            gid: meta.gid(),
            target: meta
                .file_type()
                .is_symlink()
                .then(|| std::fs::read_link(e.path()).ok())
                .flatten()
                .map(|t| t.to_string_lossy().into_owned()),
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
    let fields = strata_agent_proto::proc_stat_fields(pid)?;
    let state = fields.first()?.to_string();
    let ppid = fields.get(1)?.parse().ok()?;
    let rss_pages: u64 = fields.get(21)?.parse().ok()?;
    let cmdline = strata_agent_proto::proc_cmdline(pid);
    Some(ProcessEntry {
        pid,
        ppid,
        state,
        rss_bytes: rss_pages * 4096,
        cmdline,
    })
}
