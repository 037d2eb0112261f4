//! The function-call backend: no OCI runtime. `strata-agent` enters fresh namespaces,
//! pivots into the overlay root, confines itself (capabilities, no_new_privs, landlock,
//! seccomp, rlimits) and stays as the sandbox's pid 1. Commands are forked by the agent from
//! inside, so they inherit namespaces, confinement and cgroups without paying a cgroup
//! attach each.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use strata_agent::{
    read_frame, write_control, write_frame, AgentMsg, ExecSpec, Frame, FrameKind, HostMsg,
};

use crate::cgroup::Cgroup;
use crate::exec::{drive, Collected, Event, ExecRequest, RawExit, Stdin, Stream};
use crate::sandbox::{process_start, ExecEnv, SandboxBackend, StartContext};
use crate::spec::{DEFAULT_MEMORY, DEFAULT_PIDS};
use crate::RuntimeError;

pub struct FncallBackend {
    pub agent: PathBuf,
    /// Pooled agents: `ready/<slot>/` (socket + pid), `filling/`, `claimed/<sandbox>/`.
    pub pool: PathBuf,
    pub cgroup_parent: String,
}

pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join("agent.sock")
}

impl FncallBackend {
    fn pool_dir(&self, state: &str) -> PathBuf {
        self.pool.join(state)
    }

    fn pool_cgroup(&self, slot: &str) -> Cgroup {
        Cgroup::for_sandbox(&self.cgroup_parent, &format!("pool-{slot}"))
    }

    /// Starts the agent inside `cgroup` (joined between fork and exec, so everything it
    /// starts is inside from its first instruction); returns its host PID.
    fn spawn_agent(&self, cgroup: &Cgroup, args: &[&std::ffi::OsStr]) -> Result<u32, RuntimeError> {
        let mut cmd = Command::new(&self.agent);
        cmd.arg("sandbox")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cgroup.join_on_exec(&mut cmd)?;
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

    /// Ready pooled agents.
    pub fn pooled(&self) -> Vec<String> {
        std::fs::read_dir(self.pool_dir("ready"))
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Starts pooled agents until `target` wait; returns how many it started.
    pub fn fill(&self, target: usize) -> Result<usize, RuntimeError> {
        for d in ["ready", "filling", "claimed"] {
            let p = self.pool_dir(d);
            std::fs::create_dir_all(&p).map_err(RuntimeError::io(&p))?;
        }
        let mut started = 0;
        while self.pooled().len() < target {
            let slot = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
            let dir = self.pool_dir("filling").join(&slot);
            std::fs::create_dir_all(&dir).map_err(RuntimeError::io(&dir))?;
            let cgroup = self.pool_cgroup(&slot);
            let made = cgroup
                .create(DEFAULT_MEMORY, None, DEFAULT_PIDS)
                .and_then(|()| {
                    let sock = socket_path(&dir);
                    self.spawn_agent(
                        &cgroup,
                        &["--pooled".as_ref(), "--socket".as_ref(), sock.as_os_str()],
                    )
                })
                .and_then(|pid| {
                    let start = process_start(pid).unwrap_or(0);
                    let f = dir.join("pid");
                    std::fs::write(&f, format!("{pid} {start}")).map_err(RuntimeError::io(&f))?;
                    let ready = self.pool_dir("ready").join(&slot);
                    std::fs::rename(&dir, &ready).map_err(RuntimeError::io(&ready))
                });
            if let Err(e) = made {
                cgroup.kill_all();
                let _ = cgroup.remove();
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
            started += 1;
        }
        Ok(started)
    }

    /// Kills every pooled agent and removes its slot and cgroup; also slots whose agent
    /// died.
    pub fn drain(&self, only_dead: bool) -> usize {
        let mut n = 0;
        for state in ["ready", "filling", "claimed"] {
            let Ok(rd) = std::fs::read_dir(self.pool_dir(state)) else {
                continue;
            };
            for e in rd.flatten() {
                let slot = e.file_name().to_string_lossy().into_owned();
                let alive = read_pid(&e.path())
                    .is_some_and(|(pid, start)| process_start(pid) == Some(start));
                // Filling and claimed slots belong to a create in progress, unless stale.
                let busy = state != "ready" && crate::age(&e.path()) < Duration::from_secs(60);
                if (only_dead && alive) || busy {
                    continue;
                }
                let cgroup = self.pool_cgroup(&slot);
                cgroup.kill_all();
                let _ = cgroup.remove();
                let _ = std::fs::remove_dir_all(e.path());
                n += 1;
            }
        }
        n
    }

    /// Hands a pooled agent to sandbox `ctx.id`; `None` when the pool is empty or the
    /// agent it took fails (the caller then starts one cold).
    fn claim(&self, ctx: &StartContext) -> Option<u32> {
        for slot in self.pooled() {
            let claimed = self.pool_dir("claimed").join(&ctx.id);
            if std::fs::rename(self.pool_dir("ready").join(&slot), &claimed).is_err() {
                continue; // another create took it
            }
            let pool_cgroup = self.pool_cgroup(&slot);
            match self.adopt(ctx, &claimed, &pool_cgroup) {
                Ok(pid) => {
                    let _ = std::fs::remove_dir_all(&claimed);
                    return Some(pid);
                }
                Err(e) => {
                    tracing::warn!("pooled agent {slot} failed ({e}); trying another");
                    for cg in [&pool_cgroup, &ctx.cgroup] {
                        cg.kill_all();
                        let _ = cg.remove();
                    }
                    let _ = std::fs::remove_dir_all(&claimed);
                }
            }
        }
        None
    }

    fn adopt(
        &self,
        ctx: &StartContext,
        claimed: &Path,
        pool_cgroup: &Cgroup,
    ) -> Result<u32, RuntimeError> {
        let (pid, start) = read_pid(claimed)
            .ok_or_else(|| RuntimeError::Backend("pool slot without a pid".into()))?;
        if process_start(pid) != Some(start) {
            return Err(RuntimeError::Backend("pooled agent is gone".into()));
        }
        pool_cgroup.rename(&ctx.cgroup)?;
        let l = &ctx.spec.limits;
        ctx.cgroup.set_limits(l.memory_bytes, l.cpus, l.pids)?;
        let sock = socket_path(claimed);
        let conn = UnixStream::connect(&sock)
            .map_err(|e| RuntimeError::Backend(format!("pooled agent: {e}")))?;
        conn.set_read_timeout(Some(Duration::from_secs(30))).ok();
        let io = |e: std::io::Error| RuntimeError::Backend(format!("pooled agent: {e}"));
        let mut w = conn.try_clone().map_err(io)?;
        let mut r = conn;
        write_control(
            &mut w,
            &HostMsg::Setup {
                rootfs: ctx.rootfs.display().to_string(),
                hostname: ctx.hostname.clone(),
                netns: ctx.netns.as_ref().map(|n| n.display().to_string()),
            },
        )
        .map_err(io)?;
        match read_frame::<AgentMsg>(&mut r).map_err(io)? {
            Some(Frame::Control(AgentMsg::Ready)) => {}
            Some(Frame::Control(AgentMsg::Error { message })) => {
                return Err(RuntimeError::Backend(format!("sandbox setup: {message}")))
            }
            other => {
                return Err(RuntimeError::Backend(format!(
                    "pooled agent answered {other:?}"
                )))
            }
        }
        let dest = socket_path(&ctx.dir);
        std::fs::rename(&sock, &dest).map_err(RuntimeError::io(&dest))?;
        Ok(pid)
    }
}

fn read_pid(dir: &Path) -> Option<(u32, u64)> {
    let text = std::fs::read_to_string(dir.join("pid")).ok()?;
    let (p, s) = text.trim().split_once(' ')?;
    Some((p.parse().ok()?, s.parse().ok()?))
}

impl SandboxBackend for FncallBackend {
    fn start(&self, ctx: &StartContext) -> Result<u32, RuntimeError> {
        if let Some(pid) = self.claim(ctx) {
            return Ok(pid);
        }
        let l = &ctx.spec.limits;
        ctx.cgroup.create(l.memory_bytes, l.cpus, l.pids)?;
        let sock = socket_path(&ctx.dir);
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "--rootfs".as_ref(),
            ctx.rootfs.as_os_str(),
            "--socket".as_ref(),
            sock.as_os_str(),
            "--hostname".as_ref(),
            ctx.hostname.as_ref(),
        ];
        if let Some(n) = &ctx.netns {
            args.extend(["--netns".as_ref(), n.as_os_str()]);
        }
        self.spawn_agent(&ctx.cgroup, &args)
    }
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

/// Runs a command through the agent listening at `sock` (the init of a fncall sandbox or
/// of a container): output streams back in frames; on timeout the command's process group
/// and whatever else it started in the sandbox's cgroup is killed.
pub(crate) fn agent_exec(
    sock: &Path,
    cgroup: &Cgroup,
    env: &ExecEnv,
    req: &ExecRequest,
    sink: &mut dyn FnMut(Stream, &[u8]),
) -> Result<Collected, RuntimeError> {
    let before: std::collections::HashSet<u32> = cgroup.pids().into_iter().collect();
    let conn = UnixStream::connect(sock).map_err(|e| {
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
