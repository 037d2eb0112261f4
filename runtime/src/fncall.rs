//! The function-call backend: no OCI runtime. `strata-agent` enters fresh namespaces,
//! pivots into the overlay root, confines itself (capabilities, no_new_privs, landlock,
//! seccomp, rlimits) and stays as the sandbox's pid 1. Commands are forked by the agent from
//! inside, so they inherit namespaces, confinement and cgroups without paying a cgroup
//! attach each.

use std::ffi::CString;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use strata_agent::{
    read_frame, write_control, write_frame, AgentMsg, ExecSpec, Frame, FrameKind, HostMsg,
};

use crate::cgroup::{Cgroup, CONTROLLERS};
use crate::exec::{drive, Collected, Event, ExecRequest, RawExit, Stdin, Stream};
use crate::sandbox::{ExecEnv, SandboxBackend, SandboxRecord, StartContext};
use crate::RuntimeError;

pub struct FncallBackend {
    pub agent: PathBuf,
}

pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join("agent.sock")
}

impl SandboxBackend for FncallBackend {
    fn start(&self, ctx: &StartContext) -> Result<u32, RuntimeError> {
        let l = &ctx.spec.limits;
        ctx.cgroup.create(l.memory_bytes, l.cpus, l.pids)?;
        // The agent joins the cgroups between fork and exec, so everything it starts is
        // inside from the first instruction.
        let procs: Vec<CString> = CONTROLLERS
            .iter()
            .map(|c| {
                CString::new(
                    ctx.cgroup
                        .dir(c)
                        .join("cgroup.procs")
                        .as_os_str()
                        .as_encoded_bytes(),
                )
                .map_err(|_| RuntimeError::Invalid("cgroup path has a NUL".into()))
            })
            .collect::<Result<_, _>>()?;
        let mut cmd = Command::new(&self.agent);
        cmd.arg("sandbox")
            .arg("--rootfs")
            .arg(&ctx.rootfs)
            .arg("--socket")
            .arg(socket_path(&ctx.dir))
            .arg("--hostname")
            .arg(&ctx.hostname)
            .args(
                ctx.netns
                    .iter()
                    .flat_map(|n| [std::ffi::OsStr::new("--netns"), n.as_os_str()]),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: only open/write/close between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                for p in &procs {
                    let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let r = libc::write(fd, b"0".as_ptr().cast(), 1);
                    libc::close(fd);
                    if r != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let out = cmd.output().map_err(|e| {
            RuntimeError::Setup(format!(
                "cannot run the sandbox agent {}: {e} (build it with `cargo build -p strata-agent`)",
                self.agent.display()
            ))
        })?;
        if !out.status.success() {
            return Err(RuntimeError::Backend(format!(
                "the sandbox agent failed to start: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .map_err(|_| RuntimeError::Backend("the sandbox agent printed no PID".into()))
    }

    fn exec(
        &self,
        _rec: &SandboxRecord,
        dir: &Path,
        cgroup: &Cgroup,
        env: &ExecEnv,
        req: &ExecRequest,
        sink: &mut dyn FnMut(Stream, &[u8]),
    ) -> Result<Collected, RuntimeError> {
        let sock = socket_path(dir);
        let before: std::collections::HashSet<u32> = cgroup.pids().into_iter().collect();
        let conn = UnixStream::connect(&sock).map_err(|e| {
            RuntimeError::Backend(format!(
                "connecting to the sandbox agent at {}: {e}",
                sock.display()
            ))
        })?;
        let io_err = |e: std::io::Error| RuntimeError::Backend(format!("sandbox agent: {e}"));
        let mut writer = conn.try_clone().map_err(io_err)?;
        let mut reader = conn.try_clone().map_err(io_err)?;
        write_control(
            &mut writer,
            &HostMsg::Exec(ExecSpec {
                argv: env.argv.clone(),
                env: env
                    .env
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                cwd: env.cwd.clone(),
                uid: env.uid,
                gid: env.gid,
                stdin: !matches!(req.stdin, Stdin::Null),
            }),
        )
        .map_err(io_err)?;
        match read_frame::<AgentMsg>(&mut reader).map_err(io_err)? {
            Some(Frame::Control(AgentMsg::Started { .. })) => {}
            Some(Frame::Control(AgentMsg::Error { message })) => {
                return Err(RuntimeError::Exec(message))
            }
            other => {
                return Err(RuntimeError::Backend(format!(
                    "sandbox agent answered {other:?} to exec"
                )))
            }
        }
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || loop {
            let event = match read_frame::<AgentMsg>(&mut reader) {
                Ok(Some(Frame::Data(FrameKind::Stdout, d))) => Event::Output(Stream::Stdout, d),
                Ok(Some(Frame::Data(FrameKind::Stderr, d))) => Event::Output(Stream::Stderr, d),
                Ok(Some(Frame::Control(AgentMsg::Exited { code, signal }))) => {
                    let _ = tx.send(Event::Exited(RawExit { code, signal }));
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
        match &req.stdin {
            Stdin::Null => {}
            Stdin::Bytes(data) => {
                let mut w = writer.try_clone().map_err(io_err)?;
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
                let mut w = writer.try_clone().map_err(io_err)?;
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
        }
        drive(rx, env.timeout, sink, || {
            let _ = write_control(
                &mut writer,
                &HostMsg::Signal {
                    signal: libc::SIGKILL,
                },
            );
            // Also what left the process group (setsid, daemons) since the command began.
            cgroup.kill_except(&before);
        })
        .map_err(RuntimeError::Backend)
    }

    fn stop(&self, _rec: &SandboxRecord, cgroup: &Cgroup) -> Result<(), RuntimeError> {
        cgroup.kill_all();
        Ok(())
    }

    fn forget(&self, _id: &str) {}
}

/// Waits until the agent answers a ping (it serves before its parent reports the PID, so
/// this is a check, not a wait, in the normal case).
pub fn ping(dir: &Path, timeout: Duration) -> Result<u32, RuntimeError> {
    let sock = socket_path(dir);
    let conn = UnixStream::connect(&sock)
        .map_err(|e| RuntimeError::Backend(format!("agent at {}: {e}", sock.display())))?;
    conn.set_read_timeout(Some(timeout)).ok();
    let mut w = conn
        .try_clone()
        .map_err(|e| RuntimeError::Backend(e.to_string()))?;
    let mut r = conn;
    write_control(&mut w, &HostMsg::Ping).map_err(|e| RuntimeError::Backend(e.to_string()))?;
    match read_frame::<AgentMsg>(&mut r).map_err(|e| RuntimeError::Backend(e.to_string()))? {
        Some(Frame::Control(AgentMsg::Pong { version, .. }))
            if version == strata_agent::PROTOCOL_VERSION =>
        {
            Ok(version)
        }
        other => Err(RuntimeError::Backend(format!(
            "the sandbox agent answered {other:?} to ping (expected protocol {})",
            strata_agent::PROTOCOL_VERSION
        ))),
    }
}
