//! Running one command in a sandbox: the request, the result, and the loop that streams
//! output to the caller while it also collects it, and enforces the wall-clock limit.

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// A command, fully resolved against the sandbox's defaults.
pub struct ExecEnv {
    pub argv: Vec<String>,
    pub env: std::collections::BTreeMap<String, String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    pub timeout: std::time::Duration,
}

/// Where a command's stdin comes from.
#[derive(Debug, Clone, Default)]
pub enum Stdin {
    #[default]
    Null,
    Bytes(Vec<u8>),
    /// The calling process's own stdin (the CLI).
    Inherit,
}

#[derive(Debug, Clone, Default)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    pub stdin: Stdin,
    /// Added to (and overriding) the sandbox's environment.
    pub env: BTreeMap<String, String>,
    /// Defaults to the entry's workdir.
    pub cwd: Option<String>,
    /// Defaults to the sandbox's per-command limit.
    pub timeout: Option<Duration>,
}

impl ExecRequest {
    pub fn argv<S: Into<String>>(argv: impl IntoIterator<Item = S>) -> ExecRequest {
        ExecRequest {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Default::default()
        }
    }

    /// A shell command line, run by `/bin/sh -c`.
    pub fn shell(line: &str) -> ExecRequest {
        ExecRequest::argv(["/bin/sh", "-c", line])
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    Stdout,
    Stderr,
}

/// The budget that ended (or crippled) a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Budget {
    Memory,
    Pids,
    Disk,
    Timeout,
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Budget::Memory => "memory",
            Budget::Pids => "pids",
            Budget::Disk => "disk",
            Budget::Timeout => "timeout",
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExecResult {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    #[serde(skip)]
    pub stdout: Vec<u8>,
    #[serde(skip)]
    pub stderr: Vec<u8>,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub duration_ms: u64,
    /// The budget that ended the command, when one did.
    pub budget: Option<Budget>,
    /// Every budget exhausted while the command ran (a fork bomb hits `pids` and then,
    /// spinning, `timeout`).
    pub budgets: Vec<Budget>,
}

impl ExecResult {
    /// The shell convention: the exit code, or 128 + signal.
    pub fn status_code(&self) -> i32 {
        match (self.exit_code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => 255,
        }
    }

    pub fn success(&self) -> bool {
        self.exit_code == Some(0)
    }
}

/// How a backend's process ended, before budgets are attributed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RawExit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// A VM guest's own budget counters over the run (see `AgentMsg::Exited`).
    pub guest: Option<strata_agent_proto::GuestStats>,
}

/// What a backend's reader threads report.
pub enum Event {
    Output(Stream, Vec<u8>),
    Exited(RawExit),
    Failed(String),
}

/// Output so far, plus whether the wall-clock limit fired.
pub struct Collected {
    pub exit: RawExit,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub timed_out: bool,
}

/// Streams events to `sink` and collects them until the command exits. When `timeout`
/// passes, `kill` is called once and the loop waits for the exit it causes.
pub fn drive(
    events: Receiver<Event>,
    timeout: Duration,
    sink: &mut dyn FnMut(Stream, &[u8]),
    mut kill: impl FnMut(),
) -> Result<Collected, String> {
    let deadline = Instant::now() + timeout;
    let mut timed_out = false;
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    loop {
        let wait = if timed_out {
            Duration::from_secs(30)
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        match events.recv_timeout(wait) {
            Ok(Event::Output(s, data)) => {
                sink(s, &data);
                match s {
                    Stream::Stdout => stdout.extend_from_slice(&data),
                    Stream::Stderr => stderr.extend_from_slice(&data),
                }
            }
            Ok(Event::Exited(exit)) => {
                // Output that raced the exit notice is still in the channel.
                while let Ok(Event::Output(s, data)) = events.try_recv() {
                    sink(s, &data);
                    match s {
                        Stream::Stdout => stdout.extend_from_slice(&data),
                        Stream::Stderr => stderr.extend_from_slice(&data),
                    }
                }
                return Ok(Collected {
                    exit,
                    stdout,
                    stderr,
                    timed_out,
                });
            }
            Ok(Event::Failed(e)) => return Err(e),
            Err(RecvTimeoutError::Timeout) if !timed_out => {
                timed_out = true;
                kill();
            }
            Err(RecvTimeoutError::Timeout) => {
                return Err("the command did not exit 30 s after it was killed".into())
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err("lost the command's output before it exited".into())
            }
        }
    }
}
