//! The processes envd's `Process` service started, per sandbox: each runs as one
//! streaming exec of the runtime on a thread of its own, under a handle (the "pid" E2B
//! clients see, Strata's, not the sandbox kernel's) through which later calls reach it:
//! `Connect` adds a subscriber to its output, `SendInput`/`StreamInput` feed its stdin,
//! `CloseStdin` ends it, `SendSignal` kills it. Output goes to every subscriber through
//! bounded channels (a slow one slows the command; a gone one is dropped); none is kept.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use strata_runtime::{ExecCancel, ExecRequest, ExecResult, Sandbox, Stdin, StdinFeed, Stream};
use tokio::sync::mpsc;

use super::connect::RpcError;

/// Processes one sandbox may have running through envd at once.
const MAX_PER_SANDBOX: usize = 256;
/// Output events queued towards one subscriber before the command waits.
const SUBSCRIBER_QUEUE: usize = 32;
/// envd's own chunking of output.
const CHUNK: usize = 32 << 10;
/// First handle given out in a sandbox.
const FIRST_PID: u32 = 1000;

#[derive(Debug, Clone)]
pub enum ProcEvent {
    Stdout(Bytes),
    Stderr(Bytes),
    End(EndInfo),
}

#[derive(Debug, Clone, PartialEq)]
pub struct EndInfo {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    pub error: Option<String>,
}

impl EndInfo {
    /// What envd reports for a finished command: Go's `ExitCode()` (-1 when signalled)
    /// and `ProcessState.String()`.
    pub fn of(r: &ExecResult) -> EndInfo {
        let budget = r
            .budget
            .map(|b| format!("the sandbox's {b} budget ended it"));
        match (r.exit_code, r.signal) {
            (Some(c), _) => EndInfo {
                exit_code: c,
                exited: true,
                status: format!("exit status {c}"),
                error: budget,
            },
            (None, Some(s)) => EndInfo {
                exit_code: -1,
                exited: false,
                status: format!("signal: {}", signal_name(s)),
                error: budget,
            },
            (None, None) => EndInfo {
                exit_code: -1,
                exited: false,
                status: "unknown".into(),
                error: budget,
            },
        }
    }

    pub fn failed(message: String) -> EndInfo {
        EndInfo {
            exit_code: -1,
            exited: false,
            status: "failed".into(),
            error: Some(message),
        }
    }
}

fn signal_name(s: i32) -> String {
    match s {
        libc::SIGKILL => "killed".into(),
        libc::SIGTERM => "terminated".into(),
        libc::SIGINT => "interrupt".into(),
        libc::SIGHUP => "hangup".into(),
        libc::SIGSEGV => "segmentation fault".into(),
        libc::SIGABRT => "aborted".into(),
        libc::SIGPIPE => "broken pipe".into(),
        n => format!("signal {n}"),
    }
}

/// What a process was started with, as `List` shows it.
#[derive(Debug, Clone)]
pub struct ProcConfig {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    pub cwd: Option<String>,
}

#[derive(Default)]
struct Subscribers {
    list: Vec<mpsc::Sender<ProcEvent>>,
    end: Option<EndInfo>,
}

pub struct Proc {
    pub pid: u32,
    pub tag: Option<String>,
    pub config: ProcConfig,
    subs: Mutex<Subscribers>,
    stdin: Mutex<Option<std::sync::mpsc::SyncSender<Vec<u8>>>>,
    cancel: ExecCancel,
}

impl Proc {
    /// A receiver of its output from now on, and of its end (at once if it ended).
    pub fn subscribe(&self) -> mpsc::Receiver<ProcEvent> {
        let (tx, rx) = mpsc::channel(SUBSCRIBER_QUEUE);
        let mut subs = self.subs.lock().unwrap_or_else(|p| p.into_inner());
        match &subs.end {
            Some(end) => {
                let _ = tx.try_send(ProcEvent::End(end.clone()));
            }
            None => subs.list.push(tx),
        }
        rx
    }

    /// Hands `data` to its stdin (waiting while the command does not read).
    pub async fn send_input(&self, data: Vec<u8>) -> Result<(), RpcError> {
        let tx = self
            .stdin
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| {
                RpcError::new(
                    "failed_precondition",
                    format!(
                        "process {} has no open stdin (start it with stdin, and before close_stdin)",
                        self.pid
                    ),
                )
            })?;
        tokio::task::spawn_blocking(move || tx.send(data))
            .await
            .map_err(|e| RpcError::new("internal", e.to_string()))?
            .map_err(|_| RpcError::not_found(format!("process {} has ended", self.pid)))
    }

    pub fn close_stdin(&self) {
        self.stdin.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// Kills it and whatever it started (envd's clients only ever send SIGKILL).
    pub fn kill(&self) {
        self.cancel.cancel();
    }

    /// Sends `event` to every subscriber, dropping those that went away.
    fn publish(&self, event: ProcEvent) {
        let list: Vec<_> = self
            .subs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .list
            .clone();
        let mut gone = false;
        for tx in &list {
            // Waits while this subscriber is behind: back-pressure on the command.
            if tx.blocking_send(event.clone()).is_err() {
                gone = true;
            }
        }
        if gone {
            self.subs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .list
                .retain(|tx| !tx.is_closed());
        }
    }

    fn finish(&self, end: EndInfo) {
        let list = {
            let mut subs = self.subs.lock().unwrap_or_else(|p| p.into_inner());
            subs.end = Some(end.clone());
            std::mem::take(&mut subs.list)
        };
        for tx in list {
            let _ = tx.blocking_send(ProcEvent::End(end.clone()));
        }
    }
}

#[derive(Default)]
struct SandboxProcs {
    next: u32,
    procs: BTreeMap<u32, Arc<Proc>>,
}

/// Every sandbox's envd processes.
#[derive(Default)]
pub struct Table {
    map: Mutex<HashMap<String, SandboxProcs>>,
}

/// How a process is started.
pub struct Start {
    pub config: ProcConfig,
    pub tag: Option<String>,
    pub stdin: bool,
    pub timeout: Option<Duration>,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, SandboxProcs>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a process in `sb` (sandbox `local`); its subscriber for the caller is
    /// registered before it runs, so no output is missed.
    pub fn start(
        self: &Arc<Self>,
        local: &str,
        sb: Sandbox,
        start: Start,
        on_exit: impl FnOnce(&ExecResult) + Send + 'static,
    ) -> Result<(Arc<Proc>, mpsc::Receiver<ProcEvent>), RpcError> {
        let (stdin_tx, stdin) = if start.stdin {
            let (tx, feed) = StdinFeed::channel(16);
            (Some(tx), Stdin::Feed(feed))
        } else {
            (None, Stdin::Null)
        };
        let cancel = ExecCancel::new();
        let proc = {
            let mut map = self.lock();
            let sp = map.entry(local.to_string()).or_default();
            if sp.procs.len() >= MAX_PER_SANDBOX {
                return Err(RpcError::new(
                    "resource_exhausted",
                    format!("{MAX_PER_SANDBOX} processes already run in this sandbox through envd; wait for some or kill them"),
                ));
            }
            if sp.next == 0 {
                sp.next = FIRST_PID;
            }
            let pid = sp.next;
            sp.next = sp.next.wrapping_add(1).max(FIRST_PID);
            let proc = Arc::new(Proc {
                pid,
                tag: start.tag.clone(),
                config: start.config.clone(),
                subs: Mutex::new(Subscribers::default()),
                stdin: Mutex::new(stdin_tx),
                cancel: cancel.clone(),
            });
            sp.procs.insert(pid, proc.clone());
            proc
        };
        let rx = proc.subscribe();
        let mut argv = vec![start.config.cmd.clone()];
        argv.extend(start.config.args.iter().cloned());
        let req = ExecRequest {
            argv,
            stdin,
            env: start.config.envs.clone(),
            cwd: start.config.cwd.clone(),
            timeout: start.timeout,
            keep_output: Some(0),
            cancel: Some(cancel),
        };
        let table = self.clone();
        let (p, owner) = (proc.clone(), local.to_string());
        let spawned = std::thread::Builder::new()
            .name(format!("envd-{}", proc.pid))
            .spawn(move || {
                let mut sink = |s: Stream, data: &[u8]| {
                    for part in data.chunks(CHUNK) {
                        let part = Bytes::copy_from_slice(part);
                        p.publish(match s {
                            Stream::Stdout => ProcEvent::Stdout(part),
                            Stream::Stderr => ProcEvent::Stderr(part),
                        });
                    }
                };
                let end = match sb.exec_streaming(&req, &mut sink) {
                    Ok(r) => {
                        on_exit(&r);
                        EndInfo::of(&r)
                    }
                    Err(e) => EndInfo::failed(e.to_string()),
                };
                table.remove(&owner, p.pid);
                p.finish(end);
            });
        if let Err(e) = spawned {
            self.remove(local, proc.pid);
            return Err(RpcError::new(
                "resource_exhausted",
                format!("starting a thread: {e}"),
            ));
        }
        Ok((proc, rx))
    }

    fn remove(&self, local: &str, pid: u32) {
        let mut map = self.lock();
        if let Some(sp) = map.get_mut(local) {
            sp.procs.remove(&pid);
            if sp.procs.is_empty() {
                map.remove(local);
            }
        }
    }

    /// The process a selector names: `{"pid": N}` or `{"tag": "..."}`.
    pub fn find(
        &self,
        local: &str,
        pid: Option<u32>,
        tag: Option<&str>,
    ) -> Result<Arc<Proc>, RpcError> {
        let map = self.lock();
        let procs = map.get(local).map(|sp| &sp.procs);
        let found = match (pid, tag) {
            (Some(pid), _) => procs.and_then(|p| p.get(&pid)).cloned(),
            (None, Some(tag)) => procs
                .and_then(|p| p.values().find(|p| p.tag.as_deref() == Some(tag)))
                .cloned(),
            (None, None) => {
                return Err(RpcError::invalid("select the process by pid or tag"));
            }
        };
        found.ok_or_else(|| match (pid, tag) {
            (Some(pid), _) => RpcError::not_found(format!("process with pid {pid} not found")),
            (_, tag) => RpcError::not_found(format!(
                "process with tag {} not found",
                tag.unwrap_or_default()
            )),
        })
    }

    /// The sandbox's running processes, by pid.
    pub fn list(&self, local: &str) -> Vec<Arc<Proc>> {
        self.lock()
            .get(local)
            .map(|sp| sp.procs.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Kills every process of a sandbox that ends.
    pub fn kill_all(&self, local: &str) {
        for p in self.list(local) {
            p.kill();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(code: Option<i32>, signal: Option<i32>) -> ExecResult {
        ExecResult {
            exit_code: code,
            signal,
            stdout: vec![],
            stderr: vec![],
            stdout_bytes: 0,
            stderr_bytes: 0,
            truncated: false,
            duration_ms: 0,
            budget: None,
            budgets: vec![],
        }
    }

    #[test]
    fn ends_read_like_envds() {
        let e = EndInfo::of(&result(Some(3), None));
        assert_eq!(
            (e.exit_code, e.exited, e.status.as_str()),
            (3, true, "exit status 3")
        );
        let e = EndInfo::of(&result(None, Some(9)));
        assert_eq!(
            (e.exit_code, e.exited, e.status.as_str()),
            (-1, false, "signal: killed")
        );
    }

    #[test]
    fn a_late_subscriber_gets_the_end() {
        let p = Proc {
            pid: 1000,
            tag: None,
            config: ProcConfig {
                cmd: "x".into(),
                args: vec![],
                envs: Default::default(),
                cwd: None,
            },
            subs: Mutex::new(Subscribers::default()),
            stdin: Mutex::new(None),
            cancel: ExecCancel::new(),
        };
        p.finish(EndInfo::of(&result(Some(0), None)));
        let mut rx = p.subscribe();
        assert!(matches!(rx.try_recv(), Ok(ProcEvent::End(e)) if e.exit_code == 0));
    }
}
