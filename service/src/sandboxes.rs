//! `strata.v1.Sandboxes`: every call authenticated, every sandbox looked up within the
//! caller's project. Runtime calls block, so they run on the blocking pool; output and
//! file data cross to the client through bounded channels, so a slow client slows the
//! command (its pipe fills) instead of growing the service's memory.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream as FutStream;
use strata_catalog::{Backend, Budgets};
use strata_runtime::{ExecRequest, ExecResult, Sandbox, Stdin, StdinFeed, Stream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use crate::error::ServiceError;
use crate::journal::{Begun, KeptOutput, Ticket};
use crate::node::{CreateArgs, Node};
use crate::node_api::caller;
use crate::proto;
use crate::proto::sandboxes_server;
use crate::state::Meta;

pub struct SandboxesApi(pub Arc<Node>);

/// Output events queued towards one client before the command waits for it.
const EVENT_QUEUE: usize = 16;

type EventStream = Pin<Box<dyn FutStream<Item = Result<proto::ExecEvent, Status>> + Send>>;
type ChunkStream = Pin<Box<dyn FutStream<Item = Result<proto::FileChunk, Status>> + Send>>;

/// A create request as the node takes it: every field checked, sizes and durations parsed,
/// an error naming the first field that is wrong.
pub fn create_args(r: proto::CreateRequest) -> Result<CreateArgs, ServiceError> {
    if r.catalog_id.is_empty() {
        return Err(ServiceError::invalid(
            "catalog_id",
            "give a catalog ID (namespace/name[@version])",
        ));
    }
    let backend = backend_field(&r.backend)?;
    let b = r.budgets.unwrap_or_default();
    for (field, v) in [("budgets.memory", &b.memory), ("budgets.disk", &b.disk)] {
        if !v.is_empty() {
            strata_catalog::parse_size(v)
                .map_err(|e| ServiceError::invalid(field, e.to_string()))?;
        }
    }
    duration("budgets.timeout", &b.timeout)?;
    duration("idle_ttl", &r.idle_ttl)?;
    duration("auto_hibernate", &r.auto_hibernate)?;
    if b.cpus < 0.0 || !b.cpus.is_finite() {
        return Err(ServiceError::invalid(
            "budgets.cpus",
            "must be a positive number",
        ));
    }
    Ok(CreateArgs {
        catalog_id: r.catalog_id,
        backend,
        budgets: Budgets {
            memory: text(b.memory),
            cpus: (b.cpus > 0.0).then_some(b.cpus),
            disk: text(b.disk),
            pids: (b.pids > 0).then_some(b.pids),
            timeout: text(b.timeout),
            idle_ttl: text(r.idle_ttl),
            auto_hibernate: text(r.auto_hibernate),
        },
        env: r.env.into_iter().collect(),
        network: (r.network_set || !r.network.is_empty()).then_some(r.network),
        lifetime: duration("lifetime", &r.lifetime)?,
        labels: r.labels.into_iter().collect(),
        inbound: false,
    })
}

/// A request's `backend` field: empty for none.
fn backend_field(text: &str) -> Result<Option<Backend>, ServiceError> {
    match text {
        "" => Ok(None),
        b => b
            .parse::<Backend>()
            .map(Some)
            .map_err(|e| ServiceError::invalid("backend", e.to_string())),
    }
}

fn duration(field: &str, text: &str) -> Result<Option<Duration>, ServiceError> {
    if text.is_empty() {
        return Ok(None);
    }
    humantime::parse_duration(text).map(Some).map_err(|e| {
        ServiceError::invalid(field, format!("`{text}` is not a duration (60s, 5m): {e}"))
    })
}

fn text(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

/// Runs blocking runtime work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ServiceError> + Send + 'static,
) -> Result<T, Status> {
    crate::blocking(f).await.map_err(Status::from)
}

fn info(node: &Node, m: &Meta) -> proto::SandboxInfo {
    proto::SandboxInfo {
        id: m.id.clone(),
        catalog_ref: m.catalog_ref.clone(),
        backend: m.backend.as_str().to_string(),
        state: m.state().to_string(),
        labels: m.labels.clone().into_iter().collect(),
        project: m.project.clone(),
        created_ms: m.created_ms,
        memory_bytes: m.memory_bytes,
        cpus: m.cpus,
        disk_bytes: m.disk_bytes,
        idle_ttl_ms: m.idle_ttl_ms,
        expires_ms: m.expires_ms.unwrap_or(0),
        idle_ms: node.rt.idle_for(&m.local).as_millis() as u64,
        node: node.config().node.clone(),
    }
}

fn exec_reply(r: &ExecResult, stdout: Vec<u8>, stderr: Vec<u8>) -> proto::ExecReply {
    proto::ExecReply {
        exit_code: r.status_code(),
        signal: r.signal.unwrap_or(0),
        has_signal: r.signal.is_some(),
        stdout,
        stderr,
        truncated: r.truncated,
        stdout_bytes: r.stdout_bytes,
        stderr_bytes: r.stderr_bytes,
        duration_ms: r.duration_ms,
        budget: r.budget.map(|b| b.to_string()).unwrap_or_default(),
        budgets_hit: r.budgets.iter().map(|b| b.to_string()).collect(),
        replayed: false,
    }
}

/// Records a journaled step's end; a record that cannot be written leaves the step
/// `running` under a runner no longer running it, which later reads as interrupted.
async fn record_step(ticket: Ticket, result: &Result<ExecResult, ServiceError>) {
    let (sandbox, step) = (ticket.step().sandbox.clone(), ticket.step().step_id.clone());
    let written = match result {
        Ok(r) => ticket.finish(r).await,
        Err(e) => ticket.fail(&e.to_string()).await,
    };
    if let Err(e) = written {
        tracing::warn!(%sandbox, %step, "recording the step's end in the journal: {e}");
    }
}

/// A recorded step's answer as a stream: its kept output, then its end.
fn replay_events(mut done: ExecResult) -> Vec<Result<proto::ExecEvent, Status>> {
    use proto::exec_event::Event;
    const PART: usize = 64 << 10;
    let (out, err) = (
        std::mem::take(&mut done.stdout),
        std::mem::take(&mut done.stderr),
    );
    let mut events: Vec<Result<proto::ExecEvent, Status>> = Vec::new();
    for part in out.chunks(PART) {
        events.push(Ok(proto::ExecEvent {
            event: Some(Event::Stdout(part.to_vec())),
        }));
    }
    for part in err.chunks(PART) {
        events.push(Ok(proto::ExecEvent {
            event: Some(Event::Stderr(part.to_vec())),
        }));
    }
    events.push(Ok(proto::ExecEvent {
        event: Some(Event::Exit(proto::ExecReply {
            replayed: true,
            ..exec_reply(&done, Vec::new(), Vec::new())
        })),
    }));
    events
}

fn journal_step(s: crate::journal::Step) -> proto::JournalStep {
    proto::JournalStep {
        result: s
            .result
            .as_ref()
            .map(|r| exec_reply(r, Vec::new(), Vec::new())),
        step_id: s.step_id,
        argv: s.argv,
        cwd: s.cwd.unwrap_or_default(),
        state: s.state.as_str().to_string(),
        started_ms: s.started_ms,
        finished_ms: s.finished_ms.unwrap_or(0),
        error: s.error.unwrap_or_default(),
    }
}

impl SandboxesApi {
    /// The caller's sandbox and its runtime handle.
    async fn open<T>(&self, req: &Request<T>, id: &str) -> Result<(Meta, Sandbox), Status> {
        let who = caller(&self.0, req).await?;
        let meta = self.0.meta_for(&who, id)?;
        let sb = self.0.running(&meta).await?;
        Ok((meta, sb))
    }

    fn exec_request(&self, r: proto::ExecRequest, keep: usize) -> Result<ExecRequest, Status> {
        if r.argv.is_empty() {
            return Err(ServiceError::invalid(
                "argv",
                "empty command: give the program and its arguments",
            )
            .into());
        }
        Ok(ExecRequest {
            argv: r.argv,
            stdin: if r.stdin.is_empty() {
                Stdin::Null
            } else {
                Stdin::Bytes(r.stdin)
            },
            env: r.env.into_iter().collect(),
            cwd: text(r.cwd),
            timeout: duration("timeout", &r.timeout)?,
            keep_output: Some(keep),
            cancel: None,
        })
    }

    /// Pauses or resumes a sandbox, and records which it is.
    async fn set_paused(
        &self,
        req: Request<proto::SandboxRef>,
        paused: bool,
    ) -> Result<Response<proto::SandboxInfo>, Status> {
        let who = caller(&self.0, &req).await?;
        let meta = self.0.meta_for(&who, &req.get_ref().id)?;
        let node = self.0.clone();
        let m = blocking(move || node.set_paused(&meta, paused)).await?;
        Ok(Response::new(info(&self.0, &m)))
    }

    /// The caller's project's sandboxes whose labels include every one of `want`.
    fn selected(&self, who: &crate::Caller, want: BTreeMap<String, String>) -> Vec<Meta> {
        self.0
            .metas()
            .into_iter()
            .filter(|m| {
                !m.pending
                    && m.project == who.project.name
                    && want.iter().all(|(k, v)| m.labels.get(k) == Some(v))
            })
            .collect()
    }

    /// The exec `r` asks for, checked before its step (if any) is recorded as running, so
    /// a bad field cannot use the step up; `None` for a step looked up by its ID alone.
    fn checked_exec(
        &self,
        r: proto::ExecRequest,
        step: &str,
        keep: usize,
    ) -> Result<Option<ExecRequest>, Status> {
        if r.argv.is_empty() && !step.is_empty() {
            return Ok(None);
        }
        self.exec_request(r, keep).map(Some)
    }

    /// Runs the sandbox's own tool (see [`crate::node::run_tool`]) off the async threads.
    async fn tool(&self, sb: Sandbox, argv: Vec<String>, what: String) -> Result<(), Status> {
        blocking(move || crate::node::run_tool(&sb, argv, &what)).await
    }
}

#[tonic::async_trait]
impl sandboxes_server::Sandboxes for SandboxesApi {
    async fn create(
        &self,
        req: Request<proto::CreateRequest>,
    ) -> Result<Response<proto::SandboxInfo>, Status> {
        let who = caller(&self.0, &req).await?;
        let args = create_args(req.into_inner())?;
        let meta = self
            .0
            .create(&who, args)
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(info(&self.0, &meta)))
    }

    async fn get(
        &self,
        req: Request<proto::SandboxRef>,
    ) -> Result<Response<proto::SandboxInfo>, Status> {
        let who = caller(&self.0, &req).await?;
        let meta = self.0.meta_for(&who, &req.get_ref().id)?;
        Ok(Response::new(info(&self.0, &meta)))
    }

    async fn list(
        &self,
        req: Request<proto::ListRequest>,
    ) -> Result<Response<proto::ListReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let mut metas = self.selected(&who, req.into_inner().labels.into_iter().collect());
        metas.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
        Ok(Response::new(proto::ListReply {
            sandboxes: metas.iter().map(|m| info(&self.0, m)).collect(),
        }))
    }

    async fn exec(
        &self,
        req: Request<proto::ExecRequest>,
    ) -> Result<Response<proto::ExecReply>, Status> {
        let id = req.get_ref().id.clone();
        let (meta, sb) = self.open(&req, &id).await?;
        let mut r = req.into_inner();
        let cap = self.0.config().output_cap;
        let keep = match r.keep_output {
            0 => cap,
            n => (n as usize).min(cap),
        };
        let step = std::mem::take(&mut r.step_id);
        let (argv, cwd) = (r.argv.clone(), r.cwd.clone());
        let exec = self.checked_exec(r, &step, keep)?;
        let node = self.0.clone();
        // A task of its own, from the step's record on: a client that goes away then (in
        // the middle of the command, or while its step is being recorded) cancels neither,
        // so a recorded step always runs and the journal records its end.
        let run = crate::detached(async move {
            let ticket = if step.is_empty() {
                None
            } else {
                let cwd = (!cwd.is_empty()).then_some(cwd.as_str());
                match node.journal.begin(&meta.id, &step, &argv, cwd).await? {
                    Begun::Recorded(s) => return Ok((s.replay()?, true)),
                    Begun::Run(t) => Some(t),
                }
            };
            let exec = exec.ok_or_else(|| {
                ServiceError::Internal("a step looked up by its ID alone was to be run".into())
            })?;
            let started = Instant::now();
            let result = tokio::task::spawn_blocking(move || sb.exec(&exec))
                .await
                .map_err(|e| ServiceError::Internal(e.to_string()))
                .and_then(|r| r.map_err(ServiceError::from));
            node.metrics
                .observe_exec(meta.backend.as_str(), started.elapsed());
            if let Some(ticket) = ticket {
                record_step(ticket, &result).await;
            }
            result.map(|r| (r, false))
        });
        let (mut result, replayed) = run.await.map_err(|e| self.0.fail(e))?;
        let (out, err) = (
            std::mem::take(&mut result.stdout),
            std::mem::take(&mut result.stderr),
        );
        Ok(Response::new(proto::ExecReply {
            replayed,
            ..exec_reply(&result, out, err)
        }))
    }

    type ExecStreamStream = EventStream;

    async fn exec_stream(
        &self,
        req: Request<Streaming<proto::ExecInput>>,
    ) -> Result<Response<Self::ExecStreamStream>, Status> {
        let who = caller(&self.0, &req).await?;
        let mut input = req.into_inner();
        let opening = input.message().await?.unwrap_or_default();
        let (first, opening_stdin, opening_close) =
            match (opening.request, opening.stdin, opening.close_stdin) {
                (Some(r), stdin, close) => (r, stdin, close),
                (None, ..) => {
                    return Err(ServiceError::invalid(
                        "request",
                        "the first message of ExecStream must carry the request",
                    )
                    .into())
                }
            };
        let meta = self.0.meta_for(&who, &first.id)?;
        let sb = self.0.running(&meta).await?;
        let mut first = first;
        let step = std::mem::take(&mut first.step_id);
        let mut initial = first.stdin.clone();
        initial.extend_from_slice(&opening_stdin);
        let (argv, cwd) = (first.argv.clone(), first.cwd.clone());
        let checked = self.checked_exec(
            proto::ExecRequest {
                stdin: Vec::new(),
                ..first
            },
            &step,
            0,
        )?;
        let (tx, rx) = mpsc::channel::<Result<proto::ExecEvent, Status>>(EVENT_QUEUE);
        let node = self.0.clone();
        // A task of its own from the step's record on, as for `exec`: a client that goes
        // away while its step is being recorded does not leave a record nobody runs.
        tokio::spawn(async move {
            let ticket = if step.is_empty() {
                None
            } else {
                let cwd = (!cwd.is_empty()).then_some(cwd.as_str());
                match node.journal.begin(&meta.id, &step, &argv, cwd).await {
                    Ok(Begun::Run(t)) => Some(t),
                    Ok(Begun::Recorded(s)) => {
                        let events = match s.replay() {
                            Ok(done) => replay_events(done),
                            Err(e) => vec![Err(node.fail(e))],
                        };
                        for event in events {
                            if tx.send(event).await.is_err() {
                                break;
                            }
                        }
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(node.fail(e))).await;
                        return;
                    }
                }
            };
            let Some(mut exec) = checked else {
                let _ = tx
                    .send(Err(Status::internal(
                        "a step looked up by its ID alone was to be run",
                    )))
                    .await;
                return;
            };
            // Stdin: what the first message carried, then the client's later messages, until
            // it closes stdin or its stream.
            let (stdin_tx, feed) = StdinFeed::channel(EVENT_QUEUE);
            exec.stdin = Stdin::Feed(feed);
            let (done_tx, mut done_rx) = tokio::sync::oneshot::channel::<()>();
            tokio::spawn(async move {
                // The feed is a blocking channel (the runtime is synchronous): each chunk is
                // handed over on the blocking pool, and waits there while the command is not
                // reading (back-pressure on the client's stream).
                let send = |chunk: Vec<u8>| {
                    let tx = stdin_tx.clone();
                    async move {
                        tokio::task::spawn_blocking(move || tx.send(chunk).is_ok())
                            .await
                            .unwrap_or(false)
                    }
                };
                if (!initial.is_empty() && !send(initial).await) || opening_close {
                    return;
                }
                loop {
                    tokio::select! {
                        _ = &mut done_rx => return,
                        msg = input.message() => match msg {
                            Ok(Some(msg)) => {
                                if !msg.stdin.is_empty() && !send(msg.stdin).await {
                                    return;
                                }
                                if msg.close_stdin {
                                    return;
                                }
                            }
                            _ => return,
                        },
                    }
                }
            });
            let journal_cap = node.config().output_cap;
            let handle = tokio::runtime::Handle::current();
            let _ = tokio::task::spawn_blocking(move || {
                let started = Instant::now();
                let mut gone = false;
                // A journaled step keeps its output (up to the unary cap) for its record.
                let mut kept = ticket.as_ref().map(|_| KeptOutput::new(journal_cap));
                let mut sink = |s: Stream, data: &[u8]| {
                    if let Some(k) = kept.as_mut() {
                        k.add(s, data);
                    }
                    if gone {
                        return;
                    }
                    let event = match s {
                        Stream::Stdout => proto::exec_event::Event::Stdout(data.to_vec()),
                        Stream::Stderr => proto::exec_event::Event::Stderr(data.to_vec()),
                    };
                    // Waits while the client is behind: the command's pipe fills and it waits.
                    if tx
                        .blocking_send(Ok(proto::ExecEvent { event: Some(event) }))
                        .is_err()
                    {
                        gone = true;
                    }
                };
                let result = sb
                    .exec_streaming(&exec, &mut sink)
                    .map_err(ServiceError::from);
                node.metrics
                    .observe_exec(meta.backend.as_str(), started.elapsed());
                if let Some(ticket) = ticket {
                    let recorded = result.as_ref().map(|r| {
                        let mut r = r.clone();
                        if let Some(k) = kept.take() {
                            r.truncated = k.truncated;
                            (r.stdout, r.stderr) = (k.stdout, k.stderr);
                        }
                        r
                    });
                    let recorded = match recorded {
                        Ok(r) => Ok(r),
                        Err(e) => Err(ServiceError::Internal(e.to_string())),
                    };
                    handle.block_on(record_step(ticket, &recorded));
                }
                let last = match result {
                    Ok(r) => Ok(proto::ExecEvent {
                        event: Some(proto::exec_event::Event::Exit(exec_reply(
                            &r,
                            Vec::new(),
                            Vec::new(),
                        ))),
                    }),
                    Err(e) => Err(Status::from(e)),
                };
                let _ = tx.blocking_send(last);
                let _ = done_tx.send(());
            })
            .await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type ReadFileStream = ChunkStream;

    async fn read_file(
        &self,
        req: Request<proto::FileRef>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        let id = req.get_ref().id.clone();
        let (_, sb) = self.open(&req, &id).await?;
        let path = req.into_inner().path;
        let (tx, mut rx) = mpsc::channel::<Result<proto::FileChunk, Status>>(4);
        tokio::task::spawn_blocking(move || {
            let mut sink = |part: &[u8]| {
                tx.blocking_send(Ok(proto::FileChunk {
                    data: part.to_vec(),
                }))
                .map_err(|_| strata_runtime::RuntimeError::Invalid("the client went away".into()))
            };
            if let Err(e) = sb.read_file_with(&path, &mut sink) {
                let _ = tx.blocking_send(Err(Status::from(ServiceError::from(e))));
            }
        });
        // An error before any data answers the call itself (so a missing file is
        // NOT_FOUND to a unary-minded client), later ones end the stream.
        let first = rx.recv().await;
        let head: Vec<Result<proto::FileChunk, Status>> = match first {
            Some(Err(e)) => return Err(e),
            Some(ok) => vec![ok],
            None => vec![],
        };
        let rest = ReceiverStream::new(rx);
        Ok(Response::new(Box::pin(
            tokio_stream::iter(head).chain(rest),
        )))
    }

    async fn write_file(
        &self,
        req: Request<Streaming<proto::WriteChunk>>,
    ) -> Result<Response<proto::WriteReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let mut input = req.into_inner();
        let first = input.message().await?.ok_or_else(|| {
            Status::from(ServiceError::invalid(
                "id",
                "WriteFile needs a first message naming the sandbox and path",
            ))
        })?;
        if first.path.is_empty() {
            return Err(
                ServiceError::invalid("path", "give an absolute path inside the sandbox").into(),
            );
        }
        let meta = self.0.meta_for(&who, &first.id)?;
        let max = self.0.config().max_write_bytes;
        let mut data = first.data;
        while let Some(m) = input.message().await? {
            if data.len() + m.data.len() > max {
                return Err(ServiceError::invalid(
                    "data",
                    format!("{} is larger than this node's limit of {} MiB for one write (max_write_bytes)", first.path, max >> 20),
                )
                .into());
            }
            data.extend_from_slice(&m.data);
        }
        if data.len() > max {
            return Err(
                ServiceError::invalid("data", format!("larger than {} MiB", max >> 20)).into(),
            );
        }
        let node = self.0.clone();
        let (path, mode) = (
            first.path,
            if first.mode == 0 {
                0o644
            } else {
                first.mode & 0o7777
            },
        );
        let n = data.len() as u64;
        blocking(move || {
            let sb = node.sandbox(&meta)?;
            Ok(sb.write_file(&path, &data, mode)?)
        })
        .await?;
        Ok(Response::new(proto::WriteReply { bytes: n }))
    }

    async fn list_dir(
        &self,
        req: Request<proto::FileRef>,
    ) -> Result<Response<proto::ListDirReply>, Status> {
        let id = req.get_ref().id.clone();
        let (_, sb) = self.open(&req, &id).await?;
        let path = req.into_inner().path;
        let entries = blocking(move || Ok(sb.list_dir(&path)?)).await?;
        Ok(Response::new(proto::ListDirReply {
            entries: entries.into_iter().map(entry).collect(),
        }))
    }

    async fn stat(
        &self,
        req: Request<proto::FileRef>,
    ) -> Result<Response<proto::FileEntry>, Status> {
        let id = req.get_ref().id.clone();
        let (_, sb) = self.open(&req, &id).await?;
        let path = req.into_inner().path;
        let trimmed = path.trim_end_matches('/');
        let (parent, name) = match trimmed.rsplit_once('/') {
            Some(("", name)) => ("/".to_string(), name.to_string()),
            Some((p, name)) => (p.to_string(), name.to_string()),
            None => return Err(ServiceError::invalid("path", "give an absolute path").into()),
        };
        if name.is_empty() {
            return Ok(Response::new(proto::FileEntry {
                name: "/".into(),
                size: 0,
                is_dir: true,
                mode: 0o755,
                kind: "dir".into(),
            }));
        }
        let entries = blocking(move || Ok(sb.list_dir(&parent)?)).await?;
        let found = entries
            .into_iter()
            .find(|e| e.name == name)
            .ok_or_else(|| {
                Status::from(ServiceError::NotFound(format!(
                    "{path}: no such file or directory in the sandbox"
                )))
            })?;
        Ok(Response::new(entry(found)))
    }

    async fn remove(
        &self,
        req: Request<proto::RemoveRequest>,
    ) -> Result<Response<proto::Done>, Status> {
        let id = req.get_ref().id.clone();
        let (_, sb) = self.open(&req, &id).await?;
        let r = req.into_inner();
        if !r.path.starts_with('/') {
            return Err(ServiceError::invalid("path", "give an absolute path").into());
        }
        let flag = if r.recursive { "-rf" } else { "-f" };
        // `rm -f` succeeds on a missing file; a remove of nothing is an error here.
        let argv = vec!["/bin/sh".into(), "-c".into(),
            "test -e \"$1\" -o -L \"$1\" || { echo \"$1: No such file or directory\" >&2; exit 1; }; exec rm \"$2\" -- \"$1\"".into(),
            "rm".into(), r.path.clone(), flag.into()];
        self.tool(sb, argv, format!("removing {}", r.path)).await?;
        Ok(Response::new(proto::Done {}))
    }

    async fn make_dir(
        &self,
        req: Request<proto::MakeDirRequest>,
    ) -> Result<Response<proto::Done>, Status> {
        let id = req.get_ref().id.clone();
        let (_, sb) = self.open(&req, &id).await?;
        let r = req.into_inner();
        if !r.path.starts_with('/') {
            return Err(ServiceError::invalid("path", "give an absolute path").into());
        }
        let mut argv = vec!["mkdir".to_string()];
        if r.parents {
            argv.push("-p".into());
        }
        argv.extend(["--".to_string(), r.path.clone()]);
        self.tool(sb, argv, format!("making {}", r.path)).await?;
        Ok(Response::new(proto::Done {}))
    }

    async fn processes(
        &self,
        req: Request<proto::SandboxRef>,
    ) -> Result<Response<proto::ProcessList>, Status> {
        let id = req.get_ref().id.clone();
        let (_, sb) = self.open(&req, &id).await?;
        let ps = blocking(move || Ok(sb.processes())).await?;
        Ok(Response::new(proto::ProcessList {
            processes: ps
                .into_iter()
                .map(|p| proto::ProcessInfo {
                    pid: p.pid,
                    state: p.state,
                    rss_bytes: p.rss_bytes,
                    cmdline: p.cmdline,
                })
                .collect(),
        }))
    }

    async fn pause(
        &self,
        req: Request<proto::SandboxRef>,
    ) -> Result<Response<proto::SandboxInfo>, Status> {
        self.set_paused(req, true).await
    }

    async fn resume(
        &self,
        req: Request<proto::SandboxRef>,
    ) -> Result<Response<proto::SandboxInfo>, Status> {
        self.set_paused(req, false).await
    }

    async fn hibernate(
        &self,
        req: Request<proto::HibernateRequest>,
    ) -> Result<Response<proto::HibernateReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let r = req.into_inner();
        let metas = if !r.ids.is_empty() {
            r.ids
                .iter()
                .map(|id| self.0.meta_for(&who, id))
                .collect::<Result<Vec<_>, _>>()?
        } else if !r.labels.is_empty() {
            self.selected(&who, r.labels.into_iter().collect())
        } else {
            return Err(ServiceError::invalid(
                "ids",
                "name the sandboxes to hibernate, or give labels that select them",
            )
            .into());
        };
        let started = Instant::now();
        let done = self.0.hibernate_many(metas).await;
        Ok(Response::new(proto::HibernateReply {
            sandboxes: done
                .into_iter()
                .map(|(id, r)| match r {
                    Ok(info) => proto::Hibernated {
                        id,
                        state_bytes: info.state_bytes,
                        ms: info.millis as u64,
                        error: String::new(),
                    },
                    Err(e) => proto::Hibernated {
                        id,
                        error: e.to_string(),
                        ..Default::default()
                    },
                })
                .collect(),
            ms: started.elapsed().as_millis() as u64,
        }))
    }

    async fn wake(
        &self,
        req: Request<proto::SandboxRef>,
    ) -> Result<Response<proto::SandboxInfo>, Status> {
        let who = caller(&self.0, &req).await?;
        let meta = self.0.meta_for(&who, &req.get_ref().id)?;
        // The runtime handle of a hibernated sandbox is made by waking it.
        self.0.running(&meta).await?;
        let meta = self.0.meta_for(&who, &req.get_ref().id)?;
        Ok(Response::new(info(&self.0, &meta)))
    }

    async fn fork(
        &self,
        req: Request<proto::ForkRequest>,
    ) -> Result<Response<proto::ForkReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let r = req.into_inner();
        let parent = self.0.meta_for(&who, &r.id)?;
        let (children, processes, ms) = self
            .0
            .fork(&who, &parent, r.count as usize)
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(proto::ForkReply {
            children: children.iter().map(|m| info(&self.0, m)).collect(),
            processes,
            ms: ms as u64,
        }))
    }

    async fn snapshot(
        &self,
        req: Request<proto::SnapshotRequest>,
    ) -> Result<Response<proto::SnapshotReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let r = req.into_inner();
        if !r.to_store {
            // A client choosing where on the node root writes a machine's memory could
            // write over the node's own files.
            return Err(self.0.fail(ServiceError::PermissionDenied(
                "a snapshot into a directory of the node is for the node's own CLI; set to_store to keep it in the store".into(),
            )));
        }
        let meta = self.0.meta_for(&who, &r.id)?;
        let snap = self
            .0
            .snapshot_to_store(&who, &meta, r.names, r.files_only)
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(proto::SnapshotReply {
            state_bytes: snap.state_bytes,
            disk_bytes: snap.disk_bytes,
            millis: snap.seconds * 1e3,
            snapshot: Some(snap.to_proto()),
        }))
    }

    async fn restore(
        &self,
        req: Request<proto::RestoreRequest>,
    ) -> Result<Response<proto::SandboxInfo>, Status> {
        let who = caller(&self.0, &req).await?;
        let r = req.into_inner();
        let args = CreateArgs {
            lifetime: duration("lifetime", &r.lifetime)?,
            labels: r.labels.into_iter().collect(),
            ..Default::default()
        };
        let meta = self
            .0
            .restore(&who, &r.snapshot, args)
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(info(&self.0, &meta)))
    }

    async fn list_snapshots(
        &self,
        req: Request<proto::ListSnapshotsRequest>,
    ) -> Result<Response<proto::ListSnapshotsReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let snaps = crate::snapshot::list(self.0.store(), Some(&who.project.name))
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(proto::ListSnapshotsReply {
            snapshots: snaps.iter().map(|s| s.to_proto()).collect(),
        }))
    }

    async fn get_snapshot(
        &self,
        req: Request<proto::SnapshotId>,
    ) -> Result<Response<proto::SnapshotInfo>, Status> {
        let who = caller(&self.0, &req).await?;
        let snap = self
            .0
            .snapshot_of(&who, &req.get_ref().id)
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(snap.to_proto()))
    }

    async fn remove_snapshot(
        &self,
        req: Request<proto::SnapshotId>,
    ) -> Result<Response<proto::Done>, Status> {
        let who = caller(&self.0, &req).await?;
        let snap = self
            .0
            .snapshot_of(&who, &req.get_ref().id)
            .await
            .map_err(|e| self.0.fail(e))?;
        crate::snapshot::remove(self.0.store(), &snap)
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(proto::Done {}))
    }

    async fn commit(
        &self,
        req: Request<proto::CommitRequest>,
    ) -> Result<Response<proto::CommitReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let id = req.get_ref().id.clone();
        let (_, sb) = self.open(&req, &id).await?;
        let r = req.into_inner();
        let kind = crate::commit::parse_kind(&r.kind)?;
        let register = text(r.register);
        if let Some(entry) = &register {
            crate::catalog_api::CatalogApi::check_namespace(&who, entry)?;
        }
        let done = crate::commit::commit(
            self.0.store(),
            &sb,
            &crate::commit::CommitRequest {
                kind,
                register,
                registrant: self.0.registrant(&who),
            },
        )
        .await?;
        Ok(Response::new(proto::CommitReply {
            layer: done.layer.to_string(),
            registered: done.registered.unwrap_or_default(),
            files: done.files,
            logical_bytes: done.logical_bytes,
            uploaded_bytes: done.uploaded_bytes,
            created: done.created,
            seconds: done.seconds,
        }))
    }

    async fn evaluate(
        &self,
        req: Request<proto::EvaluateRequest>,
    ) -> Result<Response<proto::EvaluateReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let meta = self.0.meta_for(&who, &req.get_ref().id)?;
        let r = req.into_inner();
        if r.command.is_empty() {
            return Err(
                ServiceError::invalid("command", "name the entry's command to grade with").into(),
            );
        }
        let backend = backend_field(&r.backend)?;
        let done = self.0.evaluate(&who, &meta, &r.command, backend).await?;
        Ok(Response::new(proto::EvaluateReply {
            command: done.command,
            line: done.line,
            exit_code: done.exit_code,
            budget: done.budget.unwrap_or_default(),
            stdout: done.stdout.into_bytes(),
            stderr: done.stderr.into_bytes(),
            truncated: done.truncated,
            layer: done.layer.to_string(),
            backend: done.backend,
            sandbox: done.sandbox,
            evaluator_layer: done.evaluator_layer.unwrap_or_default(),
            protected: done.protected,
            changed: done
                .changed
                .into_iter()
                .map(|c| proto::ChangedPath {
                    path: c.path,
                    change: c.change.as_str().to_string(),
                    protected: c.protected,
                })
                .collect(),
            changed_total: done.changed_total,
            seconds: done.seconds,
        }))
    }

    async fn extend(
        &self,
        req: Request<proto::ExtendRequest>,
    ) -> Result<Response<proto::SandboxInfo>, Status> {
        let who = caller(&self.0, &req).await?;
        let meta = self.0.meta_for(&who, &req.get_ref().id)?;
        let r = req.into_inner();
        let idle = duration("idle_ttl", &r.idle_ttl)?;
        let lifetime = duration("lifetime", &r.lifetime)?;
        let node = self.0.clone();
        let m = blocking(move || node.extend(&meta, idle, lifetime)).await?;
        Ok(Response::new(info(&self.0, &m)))
    }

    async fn set_network(
        &self,
        req: Request<proto::SetNetworkRequest>,
    ) -> Result<Response<proto::SandboxInfo>, Status> {
        let who = caller(&self.0, &req).await?;
        let meta = self.0.meta_for(&who, &req.get_ref().id)?;
        let rules = req.into_inner().network;
        let node = self.0.clone();
        let m = meta.clone();
        blocking(move || node.set_network(&m, &rules)).await?;
        Ok(Response::new(info(&self.0, &meta)))
    }

    async fn destroy(
        &self,
        req: Request<proto::SandboxRef>,
    ) -> Result<Response<proto::Done>, Status> {
        let who = caller(&self.0, &req).await?;
        let meta = self.0.meta_for(&who, &req.get_ref().id)?;
        let node = self.0.clone();
        blocking(move || node.end(&meta, strata_runtime::EndReason::Destroyed)).await?;
        Ok(Response::new(proto::Done {}))
    }

    async fn journal(
        &self,
        req: Request<proto::SandboxRef>,
    ) -> Result<Response<proto::JournalReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let steps = self
            .0
            .journal_of(&who, &req.get_ref().id)
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(proto::JournalReply {
            steps: steps.into_iter().map(journal_step).collect(),
        }))
    }

    async fn audit(
        &self,
        req: Request<proto::SandboxRef>,
    ) -> Result<Response<proto::AuditReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let id = req.into_inner().id;
        let node = self.0.clone();
        let jsonl = blocking(move || node.audit_of(&who, &id)).await?;
        Ok(Response::new(proto::AuditReply { jsonl }))
    }
}

fn entry(e: strata_runtime::FileEntry) -> proto::FileEntry {
    proto::FileEntry {
        is_dir: e.kind == "dir",
        name: e.name,
        size: e.size,
        mode: e.mode,
        kind: e.kind,
    }
}
