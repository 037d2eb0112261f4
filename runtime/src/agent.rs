//! The one client of a sandbox's agent, for every backend: a function-call sandbox's or a
//! container's agent on its socket, a VM guest's through its relay.
//!
//! Each conversation opens with the handshake (`strata_agent_proto::handshake`): the
//! request follows the `Hello` at once, and nothing the agent says is believed before its
//! `Welcome` has proved the sandbox's key. The key is a 0600 file of the sandbox's host
//! directory, which nothing inside the sandbox can see.

use std::io::BufReader;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;
use strata_agent_proto::{
    handshake, read_frame, write_control, write_frame, AgentError, AgentMsg, ErrorKind, ExecSpec,
    Frame, FrameKind, HostMsg, SandboxKey,
};

use crate::cgroup::Cgroup;
use crate::exec::{
    drive, Collected, Event, ExecEnv, ExecRequest, RawExit, Stdin, Stream, OUTPUT_QUEUE,
};

use crate::RuntimeError;

/// The agent's socket in a sandbox's directory (a VM's: its relay's).
pub(crate) fn socket_path(dir: &Path) -> PathBuf {
    dir.join("agent.sock")
}

fn key_path(dir: &Path) -> PathBuf {
    dir.join("agent.key")
}

/// Writes `key` as the key of the sandbox (or pool slot) in `dir`, readable by root only.
pub(crate) fn write_key(dir: &Path, key: &SandboxKey) -> Result<(), RuntimeError> {
    let path = key_path(dir);
    let tmp = dir.join("agent.key.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(RuntimeError::io(&tmp))?;
    std::io::Write::write_all(&mut f, key.to_hex().as_bytes()).map_err(RuntimeError::io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(RuntimeError::io(&path))
}

/// The key of the sandbox (or pool slot, or snapshot) in `dir`.
pub(crate) fn read_key(dir: &Path) -> Result<SandboxKey, RuntimeError> {
    let path = key_path(dir);
    let text = std::fs::read_to_string(&path).map_err(RuntimeError::io(&path))?;
    SandboxKey::from_hex(&text)
        .map_err(|e| RuntimeError::Invalid(format!("{}: {e}", path.display())))
}

/// The identity of an agent binary: a hash of its contents. A pooled agent, or a
/// checkpointed one that maps its code from the file, runs exactly this file's code only
/// while it is the same; by content, so a checkpoint restores on another node with the
/// same build. Hashed once per (size, modification time, inode) of the file.
pub(crate) fn binary_identity(path: &Path) -> std::io::Result<String> {
    use std::os::unix::fs::MetadataExt;
    /// Size, modification time (s, ns) and inode of a hashed binary.
    type Stamp = (u64, i64, i64, u64);
    static SEEN: std::sync::Mutex<Vec<(Stamp, String)>> = std::sync::Mutex::new(Vec::new());
    let m = std::fs::metadata(path)?;
    let stamp = (m.len(), m.mtime(), m.mtime_nsec(), m.ino());
    let known = |seen: &[(Stamp, String)]| {
        seen.iter()
            .find(|(s, _)| *s == stamp)
            .map(|(_, h)| h.clone())
    };
    if let Some(h) = known(&SEEN.lock().unwrap_or_else(|p| p.into_inner())) {
        return Ok(h);
    }
    let mut hasher = blake3::Hasher::new();
    hasher.update_reader(std::fs::File::open(path)?)?;
    let hash = hasher.finalize().to_hex()[..32].to_string();
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    seen.retain(|(s, _)| s.3 != stamp.3);
    seen.push((stamp, hash.clone()));
    Ok(hash)
}

/// An error the agent reported, as the runtime's own.
pub(crate) fn agent_error(e: AgentError) -> RuntimeError {
    match e.kind {
        ErrorKind::ExecFailed => RuntimeError::Exec(e.message),
        ErrorKind::ProtocolVersion | ErrorKind::Unauthenticated => {
            RuntimeError::AgentRefused(e.message)
        }
        kind => RuntimeError::Agent {
            kind,
            message: e.message,
        },
    }
}

/// An agent failure on a path inside the sandbox, as a file error of that path.
pub(crate) fn file_error(path: &str, e: AgentError) -> RuntimeError {
    match e.kind {
        ErrorKind::NotFound | ErrorKind::PermissionDenied | ErrorKind::Invalid => {
            RuntimeError::File {
                path: path.to_string(),
                source: std::io::Error::new(e.kind.io_kind(), e.message),
            }
        }
        _ => agent_error(e),
    }
}

fn lost(what: &str) -> impl Fn(std::io::Error) -> RuntimeError + '_ {
    move |e| RuntimeError::AgentGone(format!("{what}: {e}"))
}

/// One conversation, past its handshake.
struct Conversation {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Conversation {
    /// Connects, sends the `Hello` and `request` together, and checks the agent's answer.
    fn open(
        socket: &Path,
        key: Option<&SandboxKey>,
        request: &HostMsg,
        timeout: Option<Duration>,
    ) -> Result<Conversation, RuntimeError> {
        Conversation::open_with(socket, key, request, timeout, 8 << 10)
    }

    /// As [`Conversation::open`], reading through a buffer of `buffer` bytes (0: none, so
    /// nothing past a reply is ever read ahead).
    fn open_with(
        socket: &Path,
        key: Option<&SandboxKey>,
        request: &HostMsg,
        timeout: Option<Duration>,
        buffer: usize,
    ) -> Result<Conversation, RuntimeError> {
        let conn = strata_host::unix::connect(socket).map_err(|e| {
            RuntimeError::AgentGone(format!("connecting to {}: {e}", socket.display()))
        })?;
        conn.set_read_timeout(timeout).ok();
        let mut writer = conn.try_clone().map_err(lost("sandbox agent"))?;
        let mut reader = BufReader::with_capacity(buffer, conn);
        let (hello, opening) = handshake::hello(key)?;
        write_control(&mut writer, &HostMsg::Hello(hello)).map_err(lost("sandbox agent"))?;
        // An agent that refuses the hello closes the connection at once, which can break
        // this write: its answer says why, so it is read first.
        let sent = write_control(&mut writer, request);
        match read_frame::<Value>(&mut reader).map_err(lost("sandbox agent"))? {
            Some(Frame::Control(answer)) => opening.check(&answer)?,
            Some(Frame::Data(..)) => {
                return Err(RuntimeError::AgentRefused(
                    "the sandbox agent answered the handshake with data".into(),
                ))
            }
            None => {
                return Err(RuntimeError::AgentGone(
                    "the sandbox agent closed the connection at the handshake".into(),
                ))
            }
        }
        sent.map_err(lost("sandbox agent"))?;
        Ok(Conversation { reader, writer })
    }

    fn next(&mut self) -> Result<Frame<AgentMsg>, RuntimeError> {
        read_frame::<AgentMsg>(&mut self.reader)
            .map_err(lost("sandbox agent"))?
            .ok_or_else(|| {
                RuntimeError::AgentGone("the sandbox agent closed the conversation".into())
            })
    }

    fn reply(&mut self) -> Result<AgentMsg, RuntimeError> {
        match self.next()? {
            Frame::Control(AgentMsg::Error(e)) => Err(agent_error(e)),
            Frame::Control(m) => Ok(m),
            Frame::Data(..) => Err(RuntimeError::Protocol(
                "the sandbox agent sent data where a reply belongs".into(),
            )),
        }
    }
}

/// The agent of one sandbox (or pool slot, or a guest before its setup).
pub(crate) struct AgentClient {
    socket: PathBuf,
    key: Option<SandboxKey>,
}

const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

impl AgentClient {
    /// The agent of the sandbox in `dir`, with the sandbox's key.
    pub(crate) fn of(dir: &Path) -> Result<AgentClient, RuntimeError> {
        Ok(AgentClient {
            socket: socket_path(dir),
            key: Some(read_key(dir)?),
        })
    }

    /// An agent at `socket` holding `key` (none: a VM guest before its setup).
    pub(crate) fn at(socket: PathBuf, key: Option<SandboxKey>) -> AgentClient {
        AgentClient { socket, key }
    }

    /// Sends `request` (and `data` as one stdin frame after it) and returns the reply,
    /// with the data frame that follows a `FileFollows`.
    pub(crate) fn request(
        &self,
        request: &HostMsg,
        data: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<(AgentMsg, Option<Vec<u8>>), RuntimeError> {
        let mut c = Conversation::open(&self.socket, self.key.as_ref(), request, Some(timeout))?;
        if let Some(d) = data {
            write_frame(&mut c.writer, FrameKind::Stdin, d).map_err(lost("sandbox agent"))?;
        }
        let reply = c.reply()?;
        let follows = match reply {
            AgentMsg::FileFollows { .. } => match c.next()? {
                Frame::Data(_, d) => Some(d),
                Frame::Control(_) => {
                    return Err(RuntimeError::Protocol(
                        "the sandbox agent sent no file data after file-follows".into(),
                    ))
                }
            },
            _ => None,
        };
        Ok((reply, follows))
    }

    /// Checks that the agent answers (and speaks this protocol, with this key); its PID.
    pub(crate) fn ping(&self, timeout: Duration) -> Result<u32, RuntimeError> {
        match self.request(&HostMsg::Ping, None, timeout)?.0 {
            AgentMsg::Pong { pid, .. } => Ok(pid),
            other => Err(unexpected("ping", &other)),
        }
    }

    /// Gives a restored container's agent (which proves this client's key) the new
    /// sandbox's `key`, which it proves from now on.
    pub(crate) fn rekey(&self, key: &SandboxKey) -> Result<(), RuntimeError> {
        let msg = HostMsg::Reseed(strata_agent_proto::Reseed {
            time_ns: 0,
            seed: Vec::new(),
            key: key.to_hex(),
            hostname: None,
            network: None,
        });
        match self.request(&msg, None, REQUEST_TIMEOUT)?.0 {
            AgentMsg::Done => Ok(()),
            other => Err(unexpected("reseed", &other)),
        }
    }

    /// Parks a container's agent for its checkpoint (see `HostMsg::Park`): returns once
    /// it has parked and closed this conversation, its last descriptor of the host's.
    pub(crate) fn park(&self) -> Result<(), RuntimeError> {
        let mut c = Conversation::open(
            &self.socket,
            self.key.as_ref(),
            &HostMsg::Park,
            Some(REQUEST_TIMEOUT),
        )?;
        match c.reply()? {
            AgentMsg::Done => {}
            other => return Err(unexpected("park", &other)),
        }
        let _ = c.writer.shutdown(std::net::Shutdown::Write);
        match c.next() {
            Err(RuntimeError::AgentGone(_)) => Ok(()),
            Ok(_) => Err(RuntimeError::Protocol(
                "the sandbox agent went on talking after it parked".into(),
            )),
            Err(e) => Err(e),
        }
    }

    pub(crate) fn read_file(&self, path: &str) -> Result<Vec<u8>, RuntimeError> {
        let msg = HostMsg::ReadFile { path: path.into() };
        match self.request(&msg, None, REQUEST_TIMEOUT) {
            Ok((AgentMsg::FileFollows { .. }, Some(data))) => Ok(data),
            Ok((other, _)) => Err(unexpected("read-file", &other)),
            Err(e) => Err(on_path(path, e)),
        }
    }

    pub(crate) fn write_file(
        &self,
        path: &str,
        data: &[u8],
        mode: u32,
    ) -> Result<(), RuntimeError> {
        if data.len() > strata_agent_proto::MAX_FRAME {
            return Err(RuntimeError::Invalid(format!(
                "{path}: the agent takes files of at most {} bytes in one write",
                strata_agent_proto::MAX_FRAME
            )));
        }
        let msg = HostMsg::WriteFile {
            path: path.into(),
            mode,
        };
        match self.request(&msg, Some(data), REQUEST_TIMEOUT) {
            Ok((AgentMsg::Done, _)) => Ok(()),
            Ok((other, _)) => Err(unexpected("write-file", &other)),
            Err(e) => Err(on_path(path, e)),
        }
    }

    pub(crate) fn list_dir(
        &self,
        path: &str,
    ) -> Result<Vec<strata_agent_proto::DirEntry>, RuntimeError> {
        let msg = HostMsg::ListDir { path: path.into() };
        match self.request(&msg, None, REQUEST_TIMEOUT) {
            Ok((AgentMsg::Entries { list }, _)) => Ok(list),
            Ok((other, _)) => Err(unexpected("list-dir", &other)),
            Err(e) => Err(on_path(path, e)),
        }
    }

    pub(crate) fn processes(&self) -> Result<Vec<strata_agent_proto::ProcessEntry>, RuntimeError> {
        match self.request(&HostMsg::Ps, None, REQUEST_TIMEOUT)?.0 {
            AgentMsg::Processes { list } => Ok(list),
            other => Err(unexpected("ps", &other)),
        }
    }

    /// A connection to `port` on the sandbox's loopback, relayed by the agent: the
    /// conversation's own stream, past the agent's `Connected`, carrying the bytes as
    /// they are.
    pub(crate) fn connect_port(&self, port: u16) -> Result<UnixStream, RuntimeError> {
        // Unbuffered: bytes the server sends at once must not be read into a buffer that
        // is dropped with the conversation.
        let mut c = Conversation::open_with(
            &self.socket,
            self.key.as_ref(),
            &HostMsg::Connect { port },
            Some(REQUEST_TIMEOUT),
            0,
        )?;
        match c.reply() {
            Ok(AgentMsg::Connected) => {}
            Ok(other) => return Err(unexpected("connect", &other)),
            Err(e) => return Err(e),
        }
        let stream = c.reader.into_inner();
        stream
            .set_read_timeout(None)
            .map_err(lost("sandbox agent"))?;
        Ok(stream)
    }

    pub(crate) fn stats(&self) -> Result<strata_agent_proto::GuestStats, RuntimeError> {
        match self.request(&HostMsg::Stats, None, REQUEST_TIMEOUT)?.0 {
            AgentMsg::Stats(s) => Ok(s),
            other => Err(unexpected("stats", &other)),
        }
    }

    /// Runs a command: output streams back in frames; on timeout the command's process
    /// group and whatever else it started in the sandbox's cgroup is killed.
    pub(crate) fn exec(
        &self,
        cgroup: &Cgroup,
        env: &ExecEnv,
        req: &ExecRequest,
        sink: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<Collected, RuntimeError> {
        let before: std::collections::HashSet<u32> = cgroup.pids().into_iter().collect();
        let spec = HostMsg::Exec(ExecSpec {
            argv: env.argv.clone(),
            env: env.env.clone(),
            cwd: env.cwd.clone(),
            uid: env.uid,
            gid: env.gid,
            stdin: !matches!(req.stdin, Stdin::Null),
        });
        let mut c = Conversation::open(&self.socket, self.key.as_ref(), &spec, None)?;
        match c.reply()? {
            AgentMsg::Started { .. } => {}
            other => return Err(unexpected("exec", &other)),
        }
        let Conversation { reader, writer } = c;
        let mut reader = reader;
        let (tx, rx) = mpsc::sync_channel(OUTPUT_QUEUE);
        std::thread::spawn(move || loop {
            let event = match read_frame::<AgentMsg>(&mut reader) {
                Ok(Some(Frame::Data(FrameKind::Stdout, d))) => Event::Output(Stream::Stdout, d),
                Ok(Some(Frame::Data(FrameKind::Stderr, d))) => Event::Output(Stream::Stderr, d),
                Ok(Some(Frame::Control(AgentMsg::Exited {
                    code,
                    signal,
                    guest,
                }))) => {
                    let _ = tx.send(Event::Exited(RawExit {
                        code,
                        signal,
                        guest,
                    }));
                    return;
                }
                Ok(Some(other)) => Event::Failed(format!("unexpected frame {other:?}")),
                Ok(None) => Event::Failed("the sandbox agent went away".into()),
                Err(e) => Event::Failed(format!("sandbox agent: {e}")),
            };
            let last = matches!(event, Event::Failed(_));
            if tx.send(event).is_err() || last {
                return;
            }
        });
        let stdin_writer = || writer.try_clone().map_err(lost("sandbox agent"));
        match &req.stdin {
            Stdin::Null => {}
            Stdin::Bytes(data) => {
                let mut w = stdin_writer()?;
                let data = data.clone();
                std::thread::spawn(move || {
                    for part in data.chunks(64 * 1024) {
                        if write_frame(&mut w, FrameKind::Stdin, part).is_err() {
                            return;
                        }
                    }
                    let _ = write_frame(&mut w, FrameKind::StdinEof, b"");
                });
            }
            Stdin::Inherit => {
                let mut w = stdin_writer()?;
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 * 1024];
                    let mut input = std::io::stdin().lock();
                    loop {
                        match std::io::Read::read(&mut input, &mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if write_frame(&mut w, FrameKind::Stdin, &buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                    let _ = write_frame(&mut w, FrameKind::StdinEof, b"");
                });
            }
            Stdin::Feed(feed) => {
                let mut w = stdin_writer()?;
                let chunks = feed.take();
                std::thread::spawn(move || {
                    for chunk in chunks.into_iter().flatten() {
                        for part in chunk.chunks(64 * 1024) {
                            if write_frame(&mut w, FrameKind::Stdin, part).is_err() {
                                return;
                            }
                        }
                    }
                    let _ = write_frame(&mut w, FrameKind::StdinEof, b"");
                });
            }
        }
        let mut writer = writer;
        drive(
            rx,
            env.timeout,
            req.kept_output(),
            req.cancel.as_ref(),
            sink,
            |why| {
                let _ = write_control(
                    &mut writer,
                    &HostMsg::Signal {
                        signal: libc::SIGKILL,
                    },
                );
                // On timeout, also what left the process group (setsid, daemons) since the
                // command began; a cancel spares what other commands started meanwhile.
                if why == crate::exec::Kill::Timeout {
                    cgroup.kill_except(&before);
                }
            },
        )
        .map_err(RuntimeError::AgentGone)
    }
}

/// A failure of a request about `path`: the agent's own error becomes a file error of it.
fn on_path(path: &str, e: RuntimeError) -> RuntimeError {
    match e {
        RuntimeError::Agent { kind, message } => file_error(path, AgentError { kind, message }),
        other => other,
    }
}

fn unexpected(what: &str, msg: &AgentMsg) -> RuntimeError {
    let shown = strata_agent_proto::shortened(format!("{msg:?}"), 200);
    RuntimeError::Protocol(format!("the sandbox agent answered {shown} to {what}"))
}
