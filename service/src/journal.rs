//! The command journal: an exec that carries a client step ID is recorded in the store
//! (`journal/<sandbox>/steps/<step>.json`) before its command starts and again when it
//! ends, request and result (output up to the exec's cap). A step asked for again is never
//! run twice: a finished one answers with its recorded result, a running one is waited for
//! (attached to), one whose runner died before recording its end is `interrupted` and
//! refused (its command may or may not have run; the client picks a new step ID). So a
//! trainer that was preempted mid-call repeats its last step and gets the one answer.
//!
//! Each record names its runner (node, process and the process's start time, so a reused
//! PID is not taken for it). A journal outlives its sandbox by the retention given to
//! [`Journal::new`] (an `ended.json` marker dates the end), then [`Journal::sweep`]
//! removes it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};
use strata_runtime::ExecResult;
use strata_store::Store;

use crate::error::ServiceError;

/// How often a waiting repeat looks at a running step's record again.
const POLL: Duration = Duration::from_millis(100);

/// The process that runs a step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Runner {
    pub node: String,
    pub pid: u32,
    /// Start time of the process in clock ticks since boot.
    pub start: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepState {
    /// Its command is running.
    Running,
    /// Its command ended; `result` is what it returned.
    Done,
    /// The exec failed (the sandbox was gone, the command could not start); `error` says why.
    Failed,
    /// Its runner ended before recording the end: whether the command ran is unknown.
    Interrupted,
}

impl StepState {
    pub fn as_str(self) -> &'static str {
        match self {
            StepState::Running => "running",
            StepState::Done => "done",
            StepState::Failed => "failed",
            StepState::Interrupted => "interrupted",
        }
    }
}

/// One step's record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Step {
    pub step_id: String,
    pub sandbox: String,
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub state: StepState,
    pub started_ms: u64,
    pub finished_ms: Option<u64>,
    pub runner: Runner,
    /// Exit, signal, sizes, budgets (without the output, kept beside it).
    pub result: Option<ExecResult>,
    /// The kept output, base64.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub stdout: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub stderr: String,
    pub error: Option<String>,
}

impl Step {
    /// The recorded result with its kept output; what a repeated step answers.
    pub fn replay(&self) -> Result<ExecResult, ServiceError> {
        match self.state {
            StepState::Done => {}
            StepState::Failed => {
                return Err(ServiceError::FailedPrecondition(format!(
                    "step `{}` of sandbox {} failed: {}; a step is not run twice: use a new step ID",
                    self.step_id,
                    self.sandbox,
                    self.error.as_deref().unwrap_or("no reason recorded")
                )))
            }
            StepState::Interrupted => {
                return Err(ServiceError::FailedPrecondition(format!(
                    "step `{}` of sandbox {} was cut off when its runner (process {} on {}) ended: whether `{}` ran is unknown, so it is not run again; check the sandbox and use a new step ID",
                    self.step_id,
                    self.sandbox,
                    self.runner.pid,
                    self.runner.node,
                    self.argv.join(" ")
                )))
            }
            StepState::Running => {
                return Err(ServiceError::Unavailable(format!(
                    "step `{}` of sandbox {} is running on node `{}`; ask that node",
                    self.step_id, self.sandbox, self.runner.node
                )))
            }
        }
        let mut r = self.result.clone().ok_or_else(|| ServiceError::Corrupt {
            key: key(&self.sandbox, &self.step_id).to_string(),
            reason: "a finished step without its result".into(),
        })?;
        let decode = |s: &str| {
            base64::engine::general_purpose::STANDARD
                .decode(s)
                .map_err(|e| ServiceError::Corrupt {
                    key: key(&self.sandbox, &self.step_id).to_string(),
                    reason: format!("recorded output: {e}"),
                })
        };
        r.stdout = decode(&self.stdout)?;
        r.stderr = decode(&self.stderr)?;
        Ok(r)
    }
}

/// The output a journaled streaming exec keeps for its record: a prefix of each stream,
/// at most `cap` bytes each.
pub struct KeptOutput {
    cap: usize,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// A stream wrote more than was kept.
    pub truncated: bool,
}

impl KeptOutput {
    pub fn new(cap: usize) -> KeptOutput {
        KeptOutput {
            cap,
            stdout: Vec::new(),
            stderr: Vec::new(),
            truncated: false,
        }
    }

    pub fn add(&mut self, s: strata_runtime::Stream, data: &[u8]) {
        let buf = match s {
            strata_runtime::Stream::Stdout => &mut self.stdout,
            strata_runtime::Stream::Stderr => &mut self.stderr,
        };
        let room = self.cap.saturating_sub(buf.len());
        if data.len() > room {
            self.truncated = true;
        }
        buf.extend_from_slice(&data[..data.len().min(room)]);
    }
}

/// What [`Journal::begin`] found.
pub enum Begun {
    /// The step is new: run it, then [`Ticket::finish`] it.
    Run(Ticket),
    /// The step ran before (or its runner died running it): its record.
    Recorded(Step),
}

/// A step this process is running; its record says `running` until finished.
pub struct Ticket {
    journal: Journal,
    step: Step,
}

impl Ticket {
    pub fn step(&self) -> &Step {
        &self.step
    }

    /// Records the command's end: its result and kept output.
    pub async fn finish(mut self, result: &ExecResult) -> Result<(), ServiceError> {
        let b64 = base64::engine::general_purpose::STANDARD;
        self.step.state = StepState::Done;
        self.step.finished_ms = Some(crate::node::now_ms());
        self.step.stdout = b64.encode(&result.stdout);
        self.step.stderr = b64.encode(&result.stderr);
        let mut kept = result.clone();
        kept.stdout = Vec::new();
        kept.stderr = Vec::new();
        self.step.result = Some(kept);
        self.journal.overwrite(&self.step).await
    }

    /// Records that the exec failed.
    pub async fn fail(mut self, error: &str) -> Result<(), ServiceError> {
        self.step.state = StepState::Failed;
        self.step.finished_ms = Some(crate::node::now_ms());
        self.step.error = Some(error.to_string());
        self.journal.overwrite(&self.step).await
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // Finished or not, this process no longer runs it: a record still `running`
        // (its end could not be written) reads as interrupted from now on.
        self.journal
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(self.step.sandbox.clone(), self.step.step_id.clone()));
    }
}

/// The journals in one store, as seen by one process (its steps in flight).
#[derive(Clone)]
pub struct Journal {
    backend: Arc<dyn ObjectStore>,
    me: Runner,
    retention: Duration,
    inflight: Arc<Mutex<HashSet<(String, String)>>>,
}

fn key(sandbox: &str, step: &str) -> ObjectPath {
    ObjectPath::from(format!("journal/{sandbox}/steps/{step}.json"))
}

fn ended_key(sandbox: &str) -> ObjectPath {
    ObjectPath::from(format!("journal/{sandbox}/ended.json"))
}

/// A step ID is a store key's last part: 1 to 128 of `A-Z a-z 0-9 . _ : @ -`, not
/// starting with a dot.
pub fn check_step_id(step: &str) -> Result<(), ServiceError> {
    let ok = !step.is_empty()
        && step.len() <= 128
        && !step.starts_with('.')
        && step
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:@-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ServiceError::invalid(
            "step_id",
            format!("`{step}` is not a step ID: use 1-128 of A-Z, a-z, 0-9, '.', '_', ':', '@' and '-' (e.g. turn-12)"),
        ))
    }
}

fn check_sandbox(sandbox: &str) -> Result<(), ServiceError> {
    if !sandbox.is_empty()
        && sandbox.len() <= 96
        && sandbox
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        Ok(())
    } else {
        Err(ServiceError::invalid(
            "id",
            format!("`{sandbox}` is not a sandbox ID"),
        ))
    }
}

#[derive(Serialize, Deserialize)]
struct Ended {
    ended_ms: u64,
}

impl Journal {
    /// The journals of `store`, written by this process as a runner on `node`; those of
    /// ended sandboxes are kept `retention` after the end.
    pub fn new(store: &Store, node: &str, retention: Duration) -> Journal {
        let pid = std::process::id();
        Journal {
            backend: store.backend().clone(),
            me: Runner {
                node: node.to_string(),
                pid,
                start: strata_runtime::process_start(pid).unwrap_or(0),
            },
            retention,
            inflight: Arc::default(),
        }
    }

    async fn get(&self, sandbox: &str, step: &str) -> Result<Option<Step>, ServiceError> {
        crate::projects::read_json(self.backend.as_ref(), &key(sandbox, step)).await
    }

    /// Writes a record; with `create`, only if there is none yet (false: there was one).
    async fn put(&self, step: &Step, create: bool) -> Result<bool, ServiceError> {
        let k = key(&step.sandbox, &step.step_id);
        crate::projects::write_json(self.backend.as_ref(), &k, step, create).await
    }

    async fn overwrite(&self, step: &Step) -> Result<(), ServiceError> {
        self.put(step, false).await.map(|_| ())
    }

    /// Whether the runner of a `running` record still runs it; `None`: another node's.
    fn runner_alive(&self, step: &Step) -> Option<bool> {
        let r = &step.runner;
        if r.node != self.me.node {
            return None;
        }
        if *r == self.me {
            let inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
            return Some(inflight.contains(&(step.sandbox.clone(), step.step_id.clone())));
        }
        Some(strata_runtime::process_start(r.pid) == Some(r.start))
    }

    /// Starts step `step` of `sandbox` running `argv` in `cwd`, or finds its record:
    /// a running one is waited for until it ends (or its runner is found gone: then it is
    /// marked interrupted). An empty `argv` only looks the step up. A step ID names one
    /// command: asking it for another is refused.
    pub async fn begin(
        &self,
        sandbox: &str,
        step: &str,
        argv: &[String],
        cwd: Option<&str>,
    ) -> Result<Begun, ServiceError> {
        check_sandbox(sandbox)?;
        check_step_id(step)?;
        if !argv.is_empty() {
            let record = Step {
                step_id: step.to_string(),
                sandbox: sandbox.to_string(),
                argv: argv.to_vec(),
                cwd: cwd.map(str::to_string),
                state: StepState::Running,
                started_ms: crate::node::now_ms(),
                finished_ms: None,
                runner: self.me.clone(),
                result: None,
                stdout: String::new(),
                stderr: String::new(),
                error: None,
            };
            // Marked in flight before the record exists, so a repeat racing this one
            // never sees a `running` record of ours that is not in flight.
            // (Already in flight here: a repeat of it, which waits below.)
            let fresh = self
                .inflight
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert((sandbox.to_string(), step.to_string()));
            if fresh {
                let ticket = Ticket {
                    journal: self.clone(),
                    step: record,
                };
                match self.put(&ticket.step, true).await {
                    Ok(true) => return Ok(Begun::Run(ticket)),
                    Ok(false) => drop(ticket),
                    Err(e) => return Err(e),
                }
            }
        }
        loop {
            let Some(mut found) = self.get(sandbox, step).await? else {
                return Err(ServiceError::NotFound(format!(
                    "no step `{step}` in the journal of sandbox {sandbox} (see `strata sandbox journal {sandbox}`); give the command to run it"
                )));
            };
            if !argv.is_empty() && found.argv != argv {
                return Err(ServiceError::AlreadyExists(format!(
                    "step `{step}` of sandbox {sandbox} already ran `{}`: a step ID names one command; use a new step ID for `{}`",
                    found.argv.join(" "),
                    argv.join(" ")
                )));
            }
            if found.state != StepState::Running {
                return Ok(Begun::Recorded(found));
            }
            match self.runner_alive(&found) {
                Some(true) => tokio::time::sleep(POLL).await,
                Some(false) => {
                    found.state = StepState::Interrupted;
                    found.finished_ms = Some(crate::node::now_ms());
                    self.overwrite(&found).await?;
                    return Ok(Begun::Recorded(found));
                }
                None => return Ok(Begun::Recorded(found)),
            }
        }
    }

    /// Every step of `sandbox`, oldest first; running ones whose runner is gone read as
    /// interrupted.
    pub async fn list(&self, sandbox: &str) -> Result<Vec<Step>, ServiceError> {
        check_sandbox(sandbox)?;
        let prefix = ObjectPath::from(format!("journal/{sandbox}/steps"));
        let keys = crate::projects::list_keys(self.backend.as_ref(), &prefix).await?;
        let mut steps = Vec::new();
        for k in keys {
            let Some(name) = k.filename().and_then(|f| f.strip_suffix(".json")) else {
                continue;
            };
            if let Some(mut s) = self.get(sandbox, name).await? {
                if s.state == StepState::Running && self.runner_alive(&s) == Some(false) {
                    s.state = StepState::Interrupted;
                }
                steps.push(s);
            }
        }
        steps.sort_by(|a, b| {
            a.started_ms
                .cmp(&b.started_ms)
                .then(a.step_id.cmp(&b.step_id))
        });
        Ok(steps)
    }

    /// Dates the end of `sandbox` (its journal is kept for the retention from now on).
    pub async fn ended(&self, sandbox: &str) -> Result<(), ServiceError> {
        check_sandbox(sandbox)?;
        let ended = Ended {
            ended_ms: crate::node::now_ms(),
        };
        // Dated once: a later end (a second destroy, a sweep) keeps the first date.
        crate::projects::write_json(self.backend.as_ref(), &ended_key(sandbox), &ended, true)
            .await
            .map(|_| ())
    }

    /// The journals this process owns (`owned`) whose sandbox no longer lives (`live`):
    /// dated as ended when they were not yet, removed once the retention has passed.
    /// Returns how many were removed.
    pub async fn sweep(
        &self,
        owned: impl Fn(&str) -> bool,
        live: impl Fn(&str) -> bool,
    ) -> Result<usize, ServiceError> {
        let root = ObjectPath::from("journal");
        let listing = self
            .backend
            .list_with_delimiter(Some(&root))
            .await
            .map_err(|source| ServiceError::Backend {
                key: root.to_string(),
                source,
            })?;
        let mut removed = 0;
        for prefix in listing.common_prefixes {
            let Some(sandbox) = prefix.filename().map(str::to_string) else {
                continue;
            };
            if !owned(&sandbox) || live(&sandbox) || check_sandbox(&sandbox).is_err() {
                continue;
            }
            let k = ended_key(&sandbox);
            let ended: Ended = match crate::projects::read_json(self.backend.as_ref(), &k).await {
                Ok(Some(ended)) => ended,
                Ok(None) => {
                    self.ended(&sandbox).await?;
                    continue;
                }
                // A marker that does not parse is dated again from now (kept, it would
                // never let the journal go).
                Err(ServiceError::Corrupt { .. }) => {
                    let now = Ended {
                        ended_ms: crate::node::now_ms(),
                    };
                    crate::projects::write_json(self.backend.as_ref(), &k, &now, false).await?;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let age = crate::node::now_ms().saturating_sub(ended.ended_ms);
            if age < self.retention.as_millis() as u64 {
                continue;
            }
            for k in crate::projects::list_keys(self.backend.as_ref(), &prefix).await? {
                match self.backend.delete(&k).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(source) => {
                        return Err(ServiceError::Backend {
                            key: k.to_string(),
                            source,
                        })
                    }
                }
            }
            removed += 1;
        }
        Ok(removed)
    }
}
