//! The CLI as a client of a node service (`--server URL` / STRATA_SERVER, with
//! STRATA_TOKEN): `run`, `sandbox`, `catalog` and `layer inspect|ls` send their work to
//! the service's gRPC API instead of the local runtime and store, with the same flags,
//! output and exit codes. What only the node itself can do (building layers, snapshots to
//! its disk, its pools and reaper, lazyfs) is refused with where to run it.

use std::io::Write;

use anyhow::{bail, Context, Result};
use strata_catalog::{LogRecord, Registered};
use strata_service::proto;
use strata_service::proto::catalog_client::CatalogClient;
use strata_service::proto::layers_client::LayersClient;
use strata_service::proto::sandboxes_client::SandboxesClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::catalog::CatalogCommand;
use crate::output::{human_bytes, print_json};
use crate::sandbox::{
    parse_env, print_processes, print_sink, read_local, report_budgets, run_argv, split_remote,
    RunArgs, SandboxCommand, SandboxOptions,
};
use strata_runtime::Stream;

pub struct Remote {
    channel: Channel,
    token: String,
    url: String,
}

/// A failed call as the CLI reports it: the service's message (which names the thing and
/// the fix), and for an unreachable service, which one.
fn status(url: &str) -> impl Fn(tonic::Status) -> anyhow::Error + '_ {
    move |s| match s.code() {
        tonic::Code::Unavailable => {
            anyhow::anyhow!("the node service at {url} is unavailable: {}", s.message())
        }
        _ => anyhow::anyhow!("{}", s.message()),
    }
}

impl Remote {
    pub async fn connect(url: &str, token: Option<&str>) -> Result<Remote> {
        let token = token
            .filter(|t| !t.is_empty())
            .context("--server needs a token: set STRATA_TOKEN (make one on the node with `strata token create --project NAME`)")?;
        let channel = Channel::from_shared(url.to_string())
            .with_context(|| format!("--server {url}: not a URL (http://HOST:PORT)"))?
            .connect()
            .await
            .with_context(|| format!("cannot reach the node service at {url}"))?;
        Ok(Remote {
            channel,
            token: token.to_string(),
            url: url.to_string(),
        })
    }

    pub(crate) fn req<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Ok(v) = format!("Bearer {}", self.token).parse() {
            r.metadata_mut().insert("authorization", v);
        }
        r
    }

    pub(crate) fn sandboxes(&self) -> SandboxesClient<Channel> {
        SandboxesClient::new(self.channel.clone())
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }

    fn catalog(&self) -> CatalogClient<Channel> {
        CatalogClient::new(self.channel.clone())
    }

    fn layers(&self) -> LayersClient<Channel> {
        LayersClient::new(self.channel.clone())
    }

    pub(crate) fn err(&self) -> impl Fn(tonic::Status) -> anyhow::Error + '_ {
        status(&self.url)
    }

    async fn resolve(&self, id: &str) -> Result<Registered> {
        let e = self
            .catalog()
            .resolve(self.req(proto::CatalogRef {
                catalog_id: id.to_string(),
            }))
            .await
            .map_err(self.err())?
            .into_inner();
        serde_json::from_str(&e.json).context("the service's catalog entry")
    }

    async fn create(&self, catalog_id: &str, o: &SandboxOptions) -> Result<proto::SandboxInfo> {
        if o.display || o.privileged {
            bail!("--display and --privileged are not offered through --server: run `strata sandbox create` on the node");
        }
        let req = proto::CreateRequest {
            catalog_id: catalog_id.to_string(),
            backend: o
                .backend
                .map(|b| b.as_str().to_string())
                .unwrap_or_default(),
            budgets: Some(proto::Budgets {
                memory: o.memory.clone().unwrap_or_default(),
                cpus: o.cpus.unwrap_or(0.0),
                disk: o.disk.clone().unwrap_or_default(),
                pids: o.pids.unwrap_or(0),
                timeout: o.timeout.clone().unwrap_or_default(),
            }),
            env: parse_env(&o.env)?.into_iter().collect(),
            network_set: o.net.is_some(),
            network: o.net.clone().unwrap_or_default(),
            idle_ttl: o.idle_ttl.clone().unwrap_or_default(),
            auto_hibernate: o.auto_hibernate.clone().unwrap_or_default(),
            lifetime: String::new(),
            labels: Default::default(),
        };
        Ok(self
            .sandboxes()
            .create(self.req(req))
            .await
            .map_err(self.err())?
            .into_inner())
    }

    /// Runs a command, printing its output as it comes; its exit status.
    async fn exec(&self, req: proto::ExecRequest, stdin: bool) -> Result<i32> {
        let (tx, rx) = mpsc::channel::<proto::ExecInput>(4);
        tx.send(proto::ExecInput {
            request: Some(req),
            stdin: Vec::new(),
            close_stdin: !stdin,
        })
        .await
        .ok();
        if stdin {
            std::thread::spawn(move || {
                let mut input = std::io::stdin().lock();
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    match std::io::Read::read(&mut input, &mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            let m = proto::ExecInput {
                                stdin: buf[..n].to_vec(),
                                ..Default::default()
                            };
                            if tx.blocking_send(m).is_err() {
                                return;
                            }
                        }
                    }
                }
                let _ = tx.blocking_send(proto::ExecInput {
                    close_stdin: true,
                    ..Default::default()
                });
            });
        } else {
            drop(tx);
        }
        let mut events = self
            .sandboxes()
            .exec_stream(self.req(ReceiverStream::new(rx)))
            .await
            .map_err(self.err())?
            .into_inner();
        let mut sink = print_sink();
        while let Some(ev) = events.message().await.map_err(self.err())? {
            use proto::exec_event::Event;
            match ev.event {
                Some(Event::Stdout(d)) => sink(Stream::Stdout, &d),
                Some(Event::Stderr(d)) => sink(Stream::Stderr, &d),
                Some(Event::Exit(r)) => {
                    report_budgets(&r.budgets_hit, r.exit_code);
                    return Ok(r.exit_code);
                }
                None => {}
            }
        }
        bail!("the node service ended the command's stream without its exit")
    }

    async fn destroy(&self, id: &str) -> Result<()> {
        self.sandboxes()
            .destroy(self.req(proto::SandboxRef { id: id.to_string() }))
            .await
            .map_err(self.err())?;
        Ok(())
    }
}

pub async fn run(remote: &Remote, args: RunArgs) -> Result<i32> {
    let argv = if args.named.is_some() {
        let reg = remote.resolve(&args.catalog_id).await?;
        run_argv(&args, &reg.reference(), &reg.entry.commands)?
    } else {
        run_argv(&args, &args.catalog_id, &Default::default())?
    };
    let sb = remote.create(&args.catalog_id, &args.options).await?;
    let code = remote
        .exec(
            proto::ExecRequest {
                id: sb.id.clone(),
                argv,
                ..Default::default()
            },
            false,
        )
        .await;
    let destroyed = remote.destroy(&sb.id).await;
    let code = code?;
    destroyed?;
    Ok(code)
}

pub async fn sandbox(remote: &Remote, cmd: SandboxCommand) -> Result<i32> {
    let mut sbs = remote.sandboxes();
    let err = remote.err();
    match cmd {
        SandboxCommand::Create {
            options,
            catalog_id,
            json,
        } => {
            let sb = remote.create(&catalog_id, &options).await?;
            if json {
                print_json(&info_json(&sb))?;
            }
            println!("{}", sb.id);
        }
        SandboxCommand::Exec {
            id,
            timeout,
            cwd,
            env,
            interactive,
            cmd,
            step_id,
        } => {
            let req = proto::ExecRequest {
                id,
                argv: cmd,
                step_id: step_id.unwrap_or_default(),
                env: parse_env(&env)?.into_iter().collect(),
                cwd: cwd.unwrap_or_default(),
                timeout: timeout.unwrap_or_default(),
                ..Default::default()
            };
            return remote.exec(req, interactive).await;
        }
        SandboxCommand::Cp { src, dst } => match (split_remote(&src), split_remote(&dst)) {
            (None, Some((id, path))) => {
                let (data, mode) = read_local(&src)?;
                let mut parts: Vec<proto::WriteChunk> = data
                    .chunks(1 << 20)
                    .map(|c| proto::WriteChunk {
                        data: c.to_vec(),
                        ..Default::default()
                    })
                    .collect();
                if parts.is_empty() {
                    parts.push(proto::WriteChunk::default());
                }
                parts[0].id = id.to_string();
                parts[0].path = path.to_string();
                parts[0].mode = mode;
                sbs.write_file(remote.req(tokio_stream::iter(parts)))
                    .await
                    .map_err(&err)?;
            }
            (Some((id, path)), None) => {
                let mut s = sbs
                    .read_file(remote.req(proto::FileRef {
                        id: id.to_string(),
                        path: path.to_string(),
                    }))
                    .await
                    .map_err(&err)?
                    .into_inner();
                let mut out: Box<dyn Write> = if dst == "-" {
                    Box::new(std::io::stdout().lock())
                } else {
                    Box::new(std::fs::File::create(&dst).with_context(|| format!("writing {dst}"))?)
                };
                while let Some(c) = s.message().await.map_err(&err)? {
                    out.write_all(&c.data)
                        .with_context(|| format!("writing {dst}"))?;
                }
                out.flush()?;
            }
            _ => bail!("one side of cp must be ID:/absolute/path and the other a local path or -"),
        },
        SandboxCommand::Ps { id, json } => {
            let ps = sbs
                .processes(remote.req(proto::SandboxRef { id }))
                .await
                .map_err(&err)?
                .into_inner()
                .processes;
            let ps: Vec<strata_runtime::ProcessInfo> = ps
                .into_iter()
                .map(|p| strata_runtime::ProcessInfo {
                    pid: p.pid,
                    // Host PIDs stay on the node.
                    host_pid: 0,
                    state: p.state,
                    rss_bytes: p.rss_bytes,
                    cmdline: p.cmdline,
                })
                .collect();
            print_processes(&ps, json)?;
        }
        SandboxCommand::Ls { json } => {
            let list = sbs
                .list(remote.req(proto::ListRequest::default()))
                .await
                .map_err(&err)?
                .into_inner()
                .sandboxes;
            if json {
                print_json(&list.iter().map(info_json).collect::<Vec<_>>())?;
            } else {
                // IDs through a service name their node, so the column is wider.
                println!("{:<24} {:<10} {:>8}  CATALOG", "ID", "BACKEND", "IDLE");
                for s in list {
                    println!(
                        "{:<24} {:<10} {:>8}  {}",
                        s.id,
                        s.backend,
                        crate::output::rough_duration(std::time::Duration::from_millis(s.idle_ms)),
                        s.catalog_ref
                    );
                }
            }
        }
        SandboxCommand::Rm { ids } => {
            let mut failed = 0;
            for id in ids {
                match remote.destroy(&id).await {
                    Ok(()) => println!("{id}"),
                    Err(e) => {
                        eprintln!("error: {id}: {e}");
                        failed += 1;
                    }
                }
            }
            return Ok(if failed > 0 { 1 } else { 0 });
        }
        SandboxCommand::Pause { id } => {
            sbs.pause(remote.req(proto::SandboxRef { id }))
                .await
                .map_err(&err)?;
        }
        SandboxCommand::Resume { id } => {
            sbs.resume(remote.req(proto::SandboxRef { id }))
                .await
                .map_err(&err)?;
        }
        SandboxCommand::Network { id, net } => {
            sbs.set_network(remote.req(proto::SetNetworkRequest { id, network: net }))
                .await
                .map_err(&err)?;
        }
        SandboxCommand::Hibernate { ids, label, json } => {
            let labels = label
                .iter()
                .map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .with_context(|| format!("--label {kv}: give KEY=VALUE"))
                })
                .collect::<Result<_>>()?;
            let reply = sbs
                .hibernate(remote.req(proto::HibernateRequest { ids, labels }))
                .await
                .map_err(&err)?
                .into_inner();
            let rows: Vec<_> = reply
                .sandboxes
                .into_iter()
                .map(|h| crate::sandbox::HibernatedRow {
                    id: h.id,
                    state_bytes: h.state_bytes,
                    ms: h.ms,
                    error: (!h.error.is_empty()).then_some(h.error),
                })
                .collect();
            return crate::sandbox::print_hibernated(&rows, json);
        }
        SandboxCommand::Fork { id, count } => {
            let reply = sbs
                .fork(remote.req(proto::ForkRequest {
                    id,
                    count: count as u32,
                }))
                .await
                .map_err(&err)?
                .into_inner();
            eprintln!(
                "forked into {} in {} ({})",
                reply.children.len(),
                crate::output::took(std::time::Duration::from_millis(reply.ms)),
                if reply.processes {
                    "processes and memory"
                } else {
                    "files only"
                }
            );
            for c in reply.children {
                println!("{}", c.id);
            }
        }
        SandboxCommand::Wake { id } => {
            let info = sbs
                .wake(remote.req(proto::SandboxRef { id }))
                .await
                .map_err(&err)?
                .into_inner();
            println!("{}", info.id);
        }
        SandboxCommand::Journal { id, json } => {
            let j = sbs
                .journal(remote.req(proto::SandboxRef { id }))
                .await
                .map_err(&err)?
                .into_inner();
            let rows = j.steps.into_iter().map(journal_row).collect();
            crate::sandbox::print_journal(rows, json)?;
        }
        SandboxCommand::Audit { id } => {
            let a = sbs
                .audit(remote.req(proto::SandboxRef { id }))
                .await
                .map_err(&err)?
                .into_inner();
            print!("{}", a.jsonl);
        }
        SandboxCommand::Evaluate {
            id,
            command,
            backend,
            json,
        } => {
            let r = sbs
                .evaluate(remote.req(proto::EvaluateRequest {
                    id,
                    command,
                    backend: backend.unwrap_or_default(),
                }))
                .await
                .map_err(&err)?
                .into_inner();
            let done = strata_service::evaluate::Evaluation {
                command: r.command,
                line: r.line,
                exit_code: r.exit_code,
                budget: (!r.budget.is_empty()).then_some(r.budget),
                stdout: String::from_utf8_lossy(&r.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&r.stderr).into_owned(),
                truncated: r.truncated,
                layer: r
                    .layer
                    .parse()
                    .with_context(|| format!("the service answered layer `{}`", r.layer))?,
                backend: r.backend,
                sandbox: r.sandbox,
                evaluator_layer: (!r.evaluator_layer.is_empty()).then_some(r.evaluator_layer),
                protected: r.protected,
                changed: r
                    .changed
                    .into_iter()
                    .map(|c| {
                        Ok(strata_service::evaluate::ChangedPath {
                            change: c.change.parse().map_err(anyhow::Error::msg)?,
                            path: c.path,
                            protected: c.protected,
                        })
                    })
                    .collect::<Result<_>>()?,
                changed_total: r.changed_total,
                seconds: r.seconds,
            };
            return crate::sandbox::print_evaluation(&done, json);
        }
        SandboxCommand::Commit {
            id,
            kind,
            register,
            json,
        } => {
            let kind = strata_service::commit::parse_kind(&kind)?;
            let r = sbs
                .commit(remote.req(proto::CommitRequest {
                    id,
                    kind: kind.to_string(),
                    register: register.unwrap_or_default(),
                }))
                .await
                .map_err(&err)?
                .into_inner();
            let done = strata_service::commit::Committed {
                layer: r
                    .layer
                    .parse()
                    .with_context(|| format!("the service answered layer `{}`", r.layer))?,
                kind,
                files: r.files,
                logical_bytes: r.logical_bytes,
                uploaded_bytes: r.uploaded_bytes,
                created: r.created,
                registered: (!r.registered.is_empty()).then_some(r.registered),
                seconds: r.seconds,
            };
            crate::sandbox::print_committed(&done, json)?;
        }
        SandboxCommand::Snapshot {
            id,
            to_store: true,
            names,
            json,
            ..
        } => {
            let r = sbs
                .snapshot(remote.req(proto::SnapshotRequest {
                    id,
                    dir: String::new(),
                    to_store: true,
                    names,
                    files_only: false,
                }))
                .await
                .map_err(&err)?
                .into_inner();
            let snap = r.snapshot.context("the service answered no snapshot")?;
            crate::snapshot::print_taken(&snap, json)?;
        }
        SandboxCommand::Restore { from, json } if strata_service::snapshot::is_id(&from) => {
            let info = sbs
                .restore(remote.req(proto::RestoreRequest {
                    snapshot: from,
                    labels: Default::default(),
                    lifetime: String::new(),
                }))
                .await
                .map_err(&err)?
                .into_inner();
            if json {
                print_json(&info_json(&info))?;
            }
            println!("{}", info.id);
        }
        SandboxCommand::Snapshot { .. }
        | SandboxCommand::Restore { .. }
        | SandboxCommand::Pool { .. }
        | SandboxCommand::Reap { .. } => {
            bail!("this sandbox command works on the node's own disk and pools; run it on the node, without --server")
        }
    }
    Ok(0)
}

/// A sandbox as `--json` prints it through a service.
fn info_json(s: &proto::SandboxInfo) -> serde_json::Value {
    serde_json::json!({
        "id": s.id, "node": s.node, "project": s.project, "catalog_ref": s.catalog_ref,
        "backend": s.backend, "state": s.state, "labels": s.labels, "created_ms": s.created_ms,
        "memory_bytes": s.memory_bytes, "cpus": s.cpus, "disk_bytes": s.disk_bytes,
        "idle_ttl_ms": s.idle_ttl_ms, "expires_ms": s.expires_ms, "idle_ms": s.idle_ms,
    })
}

pub async fn catalog(remote: &Remote, cmd: CatalogCommand) -> Result<i32> {
    let mut cat = remote.catalog();
    let err = remote.err();
    match cmd {
        CatalogCommand::Register { entry, json } => {
            let toml = std::fs::read_to_string(&entry)
                .with_context(|| format!("reading {}", entry.display()))?;
            let e = cat
                .register(remote.req(proto::RegisterRequest {
                    catalog_id: String::new(),
                    toml,
                }))
                .await
                .map_err(&err)?
                .into_inner();
            if json {
                let r: Registered = serde_json::from_str(&e.json)?;
                print_json(&r)?;
            } else {
                println!("{}", e.reference);
            }
        }
        CatalogCommand::Show { id, json } => {
            crate::catalog::print_entry(&remote.resolve(&id).await?, json)?;
        }
        CatalogCommand::Ls { prefix } => {
            for id in cat
                .list(remote.req(proto::CatalogListRequest { prefix }))
                .await
                .map_err(&err)?
                .into_inner()
                .ids
            {
                println!("{id}");
            }
        }
        CatalogCommand::History { id, json } => {
            let h = cat
                .history(remote.req(proto::CatalogRef { catalog_id: id }))
                .await
                .map_err(&err)?
                .into_inner();
            let records = h
                .records
                .iter()
                .map(|r| serde_json::from_str::<LogRecord>(r))
                .collect::<Result<Vec<_>, _>>()
                .context("the service's catalog history")?;
            crate::catalog::print_history(&records, json)?;
        }
        CatalogCommand::Rm { ids } => {
            for id in ids {
                for reference in cat
                    .remove(remote.req(proto::CatalogRef { catalog_id: id }))
                    .await
                    .map_err(&err)?
                    .into_inner()
                    .removed
                {
                    println!("removed {reference}");
                }
            }
        }
    }
    Ok(0)
}

/// A layer's manifest and provenance (if recorded), from the service.
async fn inspect_layer(
    remote: &Remote,
    layer: String,
) -> Result<(
    strata_store::LayerManifest,
    Option<strata_store::Provenance>,
)> {
    let l = remote
        .layers()
        .inspect(remote.req(proto::LayerRef { layer }))
        .await
        .map_err(remote.err())?
        .into_inner();
    let m = serde_json::from_str(&l.manifest_json).context("the service's layer manifest")?;
    let p = if l.provenance_json.is_empty() {
        None
    } else {
        Some(serde_json::from_str(&l.provenance_json).context("the service's layer provenance")?)
    };
    Ok((m, p))
}

pub async fn layer(remote: &Remote, cmd: crate::layer::LayerCommand) -> Result<i32> {
    use crate::layer::{LayerCommand, StoredLayerCommand};
    match cmd {
        LayerCommand::Stored(StoredLayerCommand::Inspect { id, json }) => {
            let (m, p) = inspect_layer(remote, id).await?;
            crate::layer::print_inspect(&m, p.as_ref(), json)?;
        }
        LayerCommand::Stored(StoredLayerCommand::Ls { json }) => {
            let ids = remote
                .layers()
                .list(remote.req(proto::LayerListRequest {}))
                .await
                .map_err(remote.err())?
                .into_inner()
                .ids;
            let mut rows = Vec::new();
            for id in ids {
                let (m, p) = inspect_layer(remote, id).await?;
                rows.push((m, p.unwrap_or_default()));
            }
            crate::layer::print_ls(rows, json)?;
        }
        LayerCommand::Stored(StoredLayerCommand::Build {
            kind,
            name,
            version,
            exclude,
            prefix,
            no_cache: _,
            json,
            source,
        }) => return build(remote, kind, name, version, exclude, prefix, json, source).await,
        _ => bail!("this layer command needs the node's store and lazyfs daemon: run it on the node, without --server"),
    }
    Ok(0)
}

/// `layer build` through a node service: a directory is sent as a tar made on the fly, a
/// tar file (or `-`) as it is, `docker://` names an image the node pulls. Build steps
/// (definition files) run in the node's runtime: build them on the node.
#[allow(clippy::too_many_arguments)]
async fn build(
    remote: &Remote,
    kind: String,
    name: Option<String>,
    version: Option<String>,
    exclude: Vec<String>,
    prefix: Option<String>,
    json: bool,
    source: String,
) -> Result<i32> {
    if source.ends_with(".toml") && std::path::Path::new(&source).is_file() {
        bail!("{source}: definition files build on the node (their steps run in its runtime); run `strata layer build` there, without --server");
    }
    let image = if source.starts_with("docker://") {
        source.clone()
    } else {
        String::new()
    };
    let spec = proto::BuildSpec {
        kind,
        name: name.unwrap_or_default(),
        version: version.unwrap_or_default(),
        exclude,
        prefix: prefix.unwrap_or_default(),
        image: image.clone(),
    };
    let (tx, rx) = mpsc::channel::<proto::BuildInput>(8);
    tx.send(proto::BuildInput {
        spec: Some(spec),
        tar: Vec::new(),
    })
    .await
    .ok();
    if image.is_empty() {
        let path = std::path::PathBuf::from(&source);
        let is_dir = path.is_dir();
        if !is_dir && source != "-" && !path.is_file() {
            bail!("{source}: no such directory or tar file");
        }
        let from = source.clone();
        std::thread::spawn(move || {
            // Tar headers are small writes: gather them into 1 MiB messages.
            let mut sink = std::io::BufWriter::with_capacity(1 << 20, ChannelWriter { tx });
            let done = if is_dir {
                let mut b = tar::Builder::new(&mut sink);
                b.follow_symlinks(false);
                b.append_dir_all(".", &path).and_then(|()| b.finish())
            } else if from == "-" {
                std::io::copy(&mut std::io::stdin().lock(), &mut sink).map(|_| ())
            } else {
                std::fs::File::open(&path)
                    .and_then(|mut f| std::io::copy(&mut f, &mut sink))
                    .map(|_| ())
            };
            if let Err(e) = done.and_then(|()| sink.flush()) {
                // Ending the process drops the stream unfinished, so the node never builds
                // what it received of it.
                eprintln!("error: reading {}: {e}", path.display());
                std::process::exit(1);
            }
        });
    } else {
        drop(tx);
    }
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg} {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    bar.set_message(format!("building {source} on {}", remote.url));
    let mut events = remote
        .layers()
        .build(remote.req(ReceiverStream::new(rx)))
        .await
        .map_err(remote.err())?
        .into_inner();
    while let Some(ev) = events.message().await.map_err(remote.err())? {
        use proto::build_event::Event;
        match ev.event {
            Some(Event::ReceivedBytes(n)) => {
                bar.set_message(format!("sending {source}: {} sent", human_bytes(n)))
            }
            Some(Event::BuiltBytes(n)) => {
                bar.set_message(format!("building {source}: {} read", human_bytes(n)))
            }
            Some(Event::Done(r)) => {
                bar.finish_and_clear();
                let report: strata_builder::BuildReport =
                    serde_json::from_str(&r.report_json).context("the service's build report")?;
                crate::layer::print_report(&report, json)?;
                return Ok(0);
            }
            None => {}
        }
    }
    bar.finish_and_clear();
    bail!("the node service ended the build without its result")
}

/// Bytes written here become `BuildInput` messages (1 MiB each), sent with back-pressure.
struct ChannelWriter {
    tx: mpsc::Sender<proto::BuildInput>,
}

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len().min(1 << 20);
        self.tx
            .blocking_send(proto::BuildInput {
                spec: None,
                tar: buf[..n].to_vec(),
            })
            .map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::BrokenPipe,
                    "the service closed the build",
                )
            })?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn journal_row(s: proto::JournalStep) -> crate::sandbox::JournalRow {
    let r = s.result.as_ref();
    crate::sandbox::JournalRow {
        exit_code: r.map(|r| r.exit_code),
        signal: r.and_then(|r| r.has_signal.then_some(r.signal)),
        duration_ms: r.map(|r| r.duration_ms),
        stdout_bytes: r.map(|r| r.stdout_bytes),
        stderr_bytes: r.map(|r| r.stderr_bytes),
        truncated: r.is_some_and(|r| r.truncated),
        budgets_hit: r.map(|r| r.budgets_hit.clone()).unwrap_or_default(),
        step_id: s.step_id,
        state: s.state,
        argv: s.argv,
        cwd: (!s.cwd.is_empty()).then_some(s.cwd),
        started_ms: s.started_ms,
        finished_ms: (s.finished_ms > 0).then_some(s.finished_ms),
        error: (!s.error.is_empty()).then_some(s.error),
    }
}
