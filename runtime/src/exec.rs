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
    /// Chunks as a caller sends them (a service's client stream); the command's stdin
    /// ends when the sender is dropped.
    Feed(StdinFeed),
}

/// The receiving end of a stdin stream; taken once, by the exec that runs.
#[derive(Debug, Clone)]
pub struct StdinFeed(std::sync::Arc<std::sync::Mutex<Option<std::sync::mpsc::Receiver<Vec<u8>>>>>);

impl StdinFeed {
    /// A feed and its sender. The channel is bounded: a sender waits (back-pressure) while
    /// `depth` chunks are queued for a command that does not read them.
    pub fn channel(depth: usize) -> (std::sync::mpsc::SyncSender<Vec<u8>>, StdinFeed) {
        let (tx, rx) = std::sync::mpsc::sync_channel(depth);
        (
            tx,
            StdinFeed(std::sync::Arc::new(std::sync::Mutex::new(Some(rx)))),
        )
    }

    /// The chunks, once; `None` when an exec already took them.
    pub(crate) fn take(&self) -> Option<std::sync::mpsc::Receiver<Vec<u8>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
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
    /// How many bytes of each stream the result keeps (default [`DEFAULT_KEPT_OUTPUT`]);
    /// what is beyond reaches the sink and the counts, never memory.
    pub keep_output: Option<usize>,
    /// Lets another thread kill the command (and what it started) before it ends.
    pub cancel: Option<ExecCancel>,
}

/// A switch that kills a running command, as its timeout would (a service's "kill this
/// process" while the exec streams elsewhere).
#[derive(Debug, Clone, Default)]
pub struct ExecCancel(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl ExecCancel {
    pub fn new() -> ExecCancel {
        ExecCancel::default()
    }

    /// Kills the command; it ends soon after with SIGKILL as its status.
    pub fn cancel(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Why a command is being killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kill {
    /// Its wall clock ran out: it and everything that appeared in the sandbox since it
    /// began dies, wherever it was re-parented.
    Timeout,
    /// A caller killed this one command (others may run beside it): its own process tree.
    Cancel,
}

/// How often a running command's cancel switch is looked at.
const CANCEL_POLL: Duration = Duration::from_millis(50);

/// How much of each stream an exec's result keeps unless asked otherwise.
pub const DEFAULT_KEPT_OUTPUT: usize = 16 << 20;

/// Output events that wait for a slow consumer before a backend's reader stops reading,
/// and so the command blocks on its full pipe (back-pressure, not memory).
pub(crate) const OUTPUT_QUEUE: usize = 16;

impl ExecRequest {
    /// How many bytes of each stream the result keeps.
    pub fn kept_output(&self) -> usize {
        self.keep_output.unwrap_or(DEFAULT_KEPT_OUTPUT)
    }

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
    /// What the command wrote to each stream, kept or not.
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    /// The kept output is a prefix: a stream wrote more than the request kept.
    pub truncated: bool,
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

/// The kept output (a prefix of each stream, up to a bound) and the counts of all of it,
/// plus whether the wall-clock limit fired.
pub struct Collected {
    pub exit: RawExit,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub stdout_bytes: u64,
    pub stderr_bytes: u64,
    pub timed_out: bool,
}

impl Collected {
    /// A stream wrote more than was kept.
    pub fn truncated(&self) -> bool {
        self.stdout_bytes > self.stdout.len() as u64 || self.stderr_bytes > self.stderr.len() as u64
    }
}

/// One stream's kept prefix and total.
#[derive(Default)]
struct Kept {
    data: Vec<u8>,
    total: u64,
}

impl Kept {
    fn add(&mut self, part: &[u8], keep: usize) {
        self.total += part.len() as u64;
        let room = keep.saturating_sub(self.data.len());
        self.data.extend_from_slice(&part[..part.len().min(room)]);
    }
}

/// Streams events to `sink` and keeps up to `keep` bytes of each stream until the command
/// exits. When `timeout` passes, or `cancel` is switched, `kill` is called once and the
/// loop waits for the exit it causes.
pub fn drive(
    events: Receiver<Event>,
    timeout: Duration,
    keep: usize,
    cancel: Option<&ExecCancel>,
    sink: &mut dyn FnMut(Stream, &[u8]),
    mut kill: impl FnMut(Kill),
) -> Result<Collected, String> {
    let deadline = Instant::now() + timeout;
    let mut timed_out = false;
    let mut killed = false;
    let (mut stdout, mut stderr) = (Kept::default(), Kept::default());
    let mut take = |s: Stream, data: &[u8], sink: &mut dyn FnMut(Stream, &[u8])| {
        sink(s, data);
        match s {
            Stream::Stdout => stdout.add(data, keep),
            Stream::Stderr => stderr.add(data, keep),
        }
    };
    loop {
        if !killed && !timed_out && cancel.is_some_and(ExecCancel::is_cancelled) {
            killed = true;
            kill(Kill::Cancel);
        }
        let mut wait = if timed_out {
            Duration::from_secs(30)
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        if cancel.is_some() && !killed {
            wait = wait.min(CANCEL_POLL);
        }
        match events.recv_timeout(wait) {
            Ok(Event::Output(s, data)) => take(s, &data, sink),
            Ok(Event::Exited(exit)) => {
                // Output that raced the exit notice is still in the channel.
                while let Ok(Event::Output(s, data)) = events.try_recv() {
                    take(s, &data, sink);
                }
                return Ok(Collected {
                    exit,
                    stdout_bytes: stdout.total,
                    stderr_bytes: stderr.total,
                    stdout: stdout.data,
                    stderr: stderr.data,
                    timed_out,
                });
            }
            Ok(Event::Failed(e)) => return Err(e),
            Err(RecvTimeoutError::Timeout) if !timed_out && Instant::now() < deadline => {}
            Err(RecvTimeoutError::Timeout) if !timed_out => {
                timed_out = true;
                kill(Kill::Timeout);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancel_kills_the_command_once_and_is_not_a_timeout() {
        let (tx, rx) = std::sync::mpsc::channel();
        let cancel = ExecCancel::new();
        let switch = cancel.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            switch.cancel();
        });
        let mut kills = Vec::new();
        let got = drive(
            rx,
            Duration::from_secs(60),
            10,
            Some(&cancel),
            &mut |_, _| {},
            |why| {
                kills.push(why);
                let _ = tx.send(exited(137));
            },
        )
        .unwrap();
        assert_eq!(kills, vec![Kill::Cancel]);
        assert!(!got.timed_out);
        assert_eq!(got.exit.code, Some(137));
    }

    fn exited(code: i32) -> Event {
        Event::Exited(RawExit {
            code: Some(code),
            signal: None,
            guest: None,
        })
    }

    #[test]
    fn output_beyond_the_kept_bound_reaches_the_sink_and_the_counts_only() {
        let (tx, rx) = std::sync::mpsc::sync_channel(OUTPUT_QUEUE);
        let writer = std::thread::spawn(move || {
            for _ in 0..100 {
                tx.send(Event::Output(Stream::Stdout, vec![b'y'; 1000]))
                    .unwrap();
            }
            tx.send(Event::Output(Stream::Stderr, b"err".to_vec()))
                .unwrap();
            tx.send(exited(0)).unwrap();
        });
        let mut sunk = 0usize;
        let got = drive(
            rx,
            Duration::from_secs(10),
            2500,
            None,
            &mut |_, d| sunk += d.len(),
            |_| {},
        )
        .unwrap();
        writer.join().unwrap();
        assert_eq!(sunk, 100_003);
        assert_eq!(got.stdout.len(), 2500);
        assert_eq!(got.stdout_bytes, 100_000);
        assert_eq!(got.stderr, b"err");
        assert!(got.truncated());
    }

    #[test]
    fn output_within_the_bound_is_kept_whole() {
        let (tx, rx) = std::sync::mpsc::sync_channel(OUTPUT_QUEUE);
        tx.send(Event::Output(Stream::Stdout, b"hello".to_vec()))
            .unwrap();
        tx.send(exited(3)).unwrap();
        let got = drive(rx, Duration::from_secs(10), 5, None, &mut |_, _| {}, |_| {}).unwrap();
        assert_eq!(got.stdout, b"hello");
        assert!(!got.truncated());
        assert_eq!(got.exit.code, Some(3));
    }
}
