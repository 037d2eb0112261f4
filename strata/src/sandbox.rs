//! `strata run` and `strata sandbox ...`: catalog entries resolved through the catalog,
//! sandboxes made and used through the runtime.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use strata_catalog::{Backend, Budgets, Catalog};
use strata_runtime::{
    ExecRequest, ExecResult, Overrides, Runtime, RuntimeConfig, SandboxSpec, Stdin, Stream,
};
use strata_service::journal::{Begun, Journal, KeptOutput};
use strata_store::Store;

use crate::config::Settings;
use crate::lazy::daemon_starter;
use crate::output::{human_bytes, print_json};

/// Per-sandbox overrides of the catalog entry.
#[derive(Args, Clone, Default)]
pub struct SandboxOptions {
    /// fncall | container | microvm | vm (default: the entry's backend).
    #[arg(long)]
    pub(crate) backend: Option<Backend>,
    /// Memory budget (512M, 2G).
    #[arg(long)]
    pub(crate) memory: Option<String>,
    /// CPUs (may be fractional).
    #[arg(long)]
    pub(crate) cpus: Option<f64>,
    /// Disk budget of the writable layer.
    #[arg(long)]
    pub(crate) disk: Option<String>,
    /// Process budget.
    #[arg(long)]
    pub(crate) pids: Option<u32>,
    /// Wall-clock limit per command (60s, 5m).
    #[arg(long)]
    pub(crate) timeout: Option<String>,
    /// Idle time after which a sandbox is destroyed.
    #[arg(long)]
    pub(crate) idle_ttl: Option<String>,
    /// Idle time after which a microvm or vm hibernates (state to disk, memory released;
    /// its next call wakes it).
    #[arg(long)]
    pub(crate) auto_hibernate: Option<String>,
    /// Allowed network destinations, HOST:PORT, comma-separated (default: none).
    #[arg(long, value_delimiter = ',')]
    pub(crate) net: Option<Vec<String>>,
    /// Extra environment, KEY=VALUE (repeatable).
    #[arg(long = "env", short = 'e')]
    pub(crate) env: Vec<String>,
    /// Give a full VM (`--backend vm`) a graphics card; its screen is served over VNC on
    /// the Unix socket `vnc.sock` in the sandbox's directory.
    #[arg(long)]
    pub(crate) display: bool,
    /// A microvm or vm whose commands keep the guest's full privileges (every capability,
    /// the guest's devices, writable cgroups): for nesting a container engine or Strata
    /// itself. The guest kernel stays the boundary to the host, but a command can then
    /// take over the guest's agent: never for untrusted agents (see SECURITY.md).
    #[arg(long)]
    pub(crate) privileged: bool,
}

pub(crate) fn parse_env(pairs: &[String]) -> Result<BTreeMap<String, String>> {
    pairs
        .iter()
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .with_context(|| format!("--env {p}: expected KEY=VALUE"))
        })
        .collect()
}

impl SandboxOptions {
    fn overrides(&self) -> Result<Overrides> {
        Ok(Overrides {
            backend: self.backend,
            budgets: Budgets {
                memory: self.memory.clone(),
                cpus: self.cpus,
                disk: self.disk.clone(),
                pids: self.pids,
                timeout: self.timeout.clone(),
                idle_ttl: self.idle_ttl.clone(),
                auto_hibernate: self.auto_hibernate.clone(),
            },
            env: parse_env(&self.env)?,
            network: self.net.clone(),
            identity: None,
            display: self.display,
            privileged: self.privileged,
        })
    }
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub(crate) options: SandboxOptions,
    /// Run one of the entry's named commands (e.g. `test`) instead of CMD.
    #[arg(long = "command", short = 'c')]
    pub(crate) named: Option<String>,
    /// Catalog ID: namespace/name or namespace/name@version.
    pub(crate) catalog_id: String,
    /// The command and its arguments.
    #[arg(last = true)]
    pub(crate) cmd: Vec<String>,
}

#[derive(Subcommand)]
pub enum SandboxCommand {
    /// Create a sandbox from a catalog entry; prints its ID as the last line.
    Create {
        #[command(flatten)]
        options: SandboxOptions,
        catalog_id: String,
        #[arg(long)]
        json: bool,
    },
    /// Run a command in a sandbox; exits with the command's status.
    Exec {
        id: String,
        /// Wall-clock limit for this command.
        #[arg(long)]
        timeout: Option<String>,
        /// Working directory inside the sandbox.
        #[arg(long)]
        cwd: Option<String>,
        #[arg(long = "env", short = 'e')]
        env: Vec<String>,
        /// Pass this process's stdin to the command.
        #[arg(long, short = 'i')]
        interactive: bool,
        /// Record the command as step STEP of the sandbox's journal (in the store). Asked
        /// again, a finished step prints its recorded output and exits with its recorded
        /// status without running; a running one is waited for; one cut off is refused.
        /// Without a command: the recorded step only.
        #[arg(long = "step-id", value_name = "STEP")]
        step_id: Option<String>,
        #[arg(last = true, required_unless_present = "step_id")]
        cmd: Vec<String>,
    },
    /// Copy a file in or out: `cp LOCAL ID:/path` or `cp ID:/path LOCAL` (`-` is stdio).
    Cp { src: String, dst: String },
    /// Processes in a sandbox.
    Ps {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Sandboxes on this host.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Destroy sandboxes.
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Stop every process of a sandbox where it is (a VM's whole machine).
    Pause { id: String },
    /// Continue a paused sandbox.
    Resume { id: String },
    /// Save sandboxes' whole state to disk and stop them (microvm, vm): their memory and
    /// CPU go back to the host. The next call on one wakes it (or `wake`).
    Hibernate {
        /// The sandboxes (or every one of --label).
        #[arg(required_unless_present = "label", conflicts_with = "label")]
        ids: Vec<String>,
        /// Every sandbox with all these labels (K=V; through a service, which keeps labels).
        #[arg(long, value_name = "K=V")]
        label: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Start a hibernated sandbox again where it was.
    Wake { id: String },
    /// New sandboxes that start from where this one is; prints their IDs, one per line.
    /// container, microvm and vm children continue its processes and memory (a snapshot
    /// restored N times, each with a fresh identity); fncall children get its files.
    Fork {
        id: String,
        /// How many (1 to 100).
        #[arg(long, default_value_t = 1)]
        count: usize,
    },
    /// Replace a running sandbox's allowed network destinations (container and fncall).
    Network {
        id: String,
        /// HOST:PORT, comma-separated; none: nothing but the sandbox's own loopback.
        #[arg(long, value_delimiter = ',')]
        net: Vec<String>,
    },
    /// Make what a sandbox changed over its layers a new layer (and with --register a
    /// catalog entry: the sandbox's entry with the layer on top); prints the layer ID
    /// last, after the registered `namespace/name@version`. The sandbox is held still
    /// while its changes are read, then runs on.
    Commit {
        id: String,
        /// workspace | toolkit.
        #[arg(long, default_value = "workspace")]
        kind: String,
        /// Register the result as NAMESPACE/NAME.
        #[arg(long)]
        register: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Grade a sandbox: its entry's command NAME runs in a fresh sandbox of the entry's
    /// stack with what this sandbox changed on top, the entry's protected paths mounted
    /// read-only from its own layers and its evaluator layer read-only at its mount (see
    /// the entry's `[evaluator]`); what this sandbox changed under them is dropped first.
    /// This sandbox is left as it is; its audit records the grade and the files it
    /// changed. Prints the grader's output, then what the agent changed on stderr, and
    /// exits with the grader's status.
    Evaluate {
        id: String,
        /// The entry's command to grade with (e.g. test).
        #[arg(long)]
        command: String,
        /// The evaluation sandbox's backend; by default the sandbox's own (a container
        /// for a microvm or vm whose entry has read-only views).
        #[arg(long)]
        backend: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Save a sandbox; it keeps running. With --to-store: into the store, restorable on
    /// any node sharing it (container, microvm and vm: memory, processes and files;
    /// fncall: its files), printing the snapshot ID last. Else a container, microvm or vm
    /// into DIR on this host.
    Snapshot {
        id: String,
        #[arg(required_unless_present = "to_store", conflicts_with = "to_store")]
        dir: Option<PathBuf>,
        #[arg(long)]
        to_store: bool,
        /// A name to list the stored snapshot under (repeatable).
        #[arg(long = "name", requires = "to_store")]
        names: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Start a new sandbox from a snapshot: a SNAPSHOT_ID in the store (on any node
    /// sharing it) or a snapshot DIR on this host; prints its ID as the last line.
    Restore {
        /// snap-<16 hex>, or a directory.
        from: String,
        #[arg(long)]
        json: bool,
    },
    /// A sandbox's audit record (JSON lines), also after it is gone.
    Audit { id: String },
    /// A sandbox's command journal (execs given --step-id), oldest first; also after it
    /// is gone, for the `journal_retention`.
    Journal {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// The pool of function-call agents waiting in their cgroups (fast fncall starts).
    Pool {
        /// Start agents until N wait.
        #[arg(long)]
        fill: Option<usize>,
        /// Stop every waiting agent.
        #[arg(long)]
        drain: bool,
    },
    /// Destroy sandboxes whose init died or whose idle TTL passed; remove leftovers.
    Reap {
        #[arg(long)]
        json: bool,
        /// Keep reaping at this interval (30s, 1m) instead of once: the host's TTL keeper.
        #[arg(long)]
        every: Option<String>,
    },
}

/// The `strata-agent` binary: as configured, else beside this one.
fn agent_path(settings: &Settings) -> Result<PathBuf> {
    if let Some(p) = &settings.agent {
        return Ok(p.clone());
    }
    let exe = std::env::current_exe().context("locating the strata binary")?;
    Ok(exe.with_file_name("strata-agent"))
}

/// The local runtime's settings, from the binary's settings and its location.
pub fn runtime_config(settings: &Settings) -> Result<RuntimeConfig> {
    let lazyfs = strata_runtime::LazyfsAccess {
        paths: crate::lazy::paths(settings),
        start: daemon_starter(settings),
    };
    let mut cfg = RuntimeConfig::new(settings.runtime_dir(), lazyfs, agent_path(settings)?);
    cfg.oci_runtime = settings.oci_runtime.clone();
    cfg.vm = settings.vm.clone();
    cfg.criu = settings.criu.clone();
    cfg.container_agent = settings.static_agent.clone().or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|exe| strata_runtime::static_agent_for(&exe))
    });
    Ok(cfg)
}

/// The local runtime and its sandbox `id`, opened off the async threads.
async fn runtime_and_sandbox(
    settings: &Settings,
    id: &str,
) -> Result<(Runtime, strata_runtime::Sandbox)> {
    let (s, id) = (settings.clone(), id.to_string());
    tokio::task::spawn_blocking(move || -> Result<_> {
        let rt = open_runtime(&s)?;
        let sb = rt.get(&id)?;
        Ok((rt, sb))
    })
    .await?
}

pub fn open_runtime(settings: &Settings) -> Result<Runtime> {
    Ok(Runtime::open(runtime_config(settings)?)?)
}

async fn resolve(store: &Store, catalog_id: &str, options: &SandboxOptions) -> Result<SandboxSpec> {
    let catalog = Catalog::open(store).await?;
    let reg = catalog.get(catalog_id).await?;
    Ok(SandboxSpec::resolve(&reg, &options.overrides()?)?)
}

/// Streams a command's output to this process's stdout and stderr.
pub(crate) fn print_sink() -> impl FnMut(Stream, &[u8]) {
    |s, data| {
        let _ = match s {
            Stream::Stdout => {
                let mut o = std::io::stdout().lock();
                o.write_all(data).and_then(|_| o.flush())
            }
            Stream::Stderr => {
                let mut e = std::io::stderr().lock();
                e.write_all(data).and_then(|_| e.flush())
            }
        };
    }
}

/// Keeps `target` ready pieces waiting (the `pool` setting, `STRATA_POOL`), so the next
/// create on this host skips their cost: writable uppers of the disk budget just used and,
/// for fncall, agents already in their cgroups. Done after the command's own work.
fn top_up_pool(rt: &Runtime, spec: &SandboxSpec, target: usize) {
    // VMs take an unmounted disk image, not a mounted upper.
    if matches!(spec.backend, Backend::Fncall | Backend::Container) {
        if let Err(e) = rt.fill_uppers(spec.limits.disk_bytes, target) {
            tracing::warn!("filling the upper pool: {e}");
        }
    }
    if spec.backend == Backend::Fncall {
        if let Err(e) = rt.fill_pool(target) {
            tracing::warn!("filling the fncall pool: {e}");
        }
    }
}

fn report_budget(r: &ExecResult) {
    let hit: Vec<String> = r.budgets.iter().map(|b| b.to_string()).collect();
    report_budgets(&hit, r.status_code());
}

/// Says on stderr which budgets a command hit, if any (embedded or through a service).
pub(crate) fn report_budgets(hit: &[String], status: i32) {
    if !hit.is_empty() {
        eprintln!(
            "strata: budget exceeded: {} (exit status {status})",
            hit.join(", ")
        );
    }
}

/// What `run` runs: the entry's command `--command NAME` names, or the command after `--`.
pub(crate) fn run_argv(
    args: &RunArgs,
    reference: &str,
    commands: &BTreeMap<String, String>,
) -> Result<Vec<String>> {
    match (&args.named, args.cmd.is_empty()) {
        (Some(name), true) => {
            let line = commands.get(name).with_context(|| {
                format!(
                    "{reference} has no command `{name}` (it has: {})",
                    commands.keys().cloned().collect::<Vec<_>>().join(", ")
                )
            })?;
            Ok(vec!["/bin/sh".to_string(), "-c".to_string(), line.clone()])
        }
        (None, false) => Ok(args.cmd.clone()),
        (Some(_), false) => bail!("give either --command NAME or a command after --, not both"),
        (None, true) => bail!("nothing to run: add `-- CMD...` or `--command NAME`"),
    }
}

/// A local file (or stdin for `-`) to copy into a sandbox, and the mode it gets there.
pub(crate) fn read_local(src: &str) -> Result<(Vec<u8>, u32)> {
    let data = if src == "-" {
        let mut d = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut d)?;
        d
    } else {
        std::fs::read(src).with_context(|| format!("reading {src}"))?
    };
    let mode = std::fs::metadata(src)
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o7777)
        .unwrap_or(0o644);
    Ok((data, mode))
}

/// `sandbox ps`'s output.
pub(crate) fn print_processes(ps: &[strata_runtime::ProcessInfo], json: bool) -> Result<()> {
    if json {
        return print_json(&ps);
    }
    println!("{:>7} {:>8} {:>10}  COMMAND", "PID", "STATE", "RSS");
    for p in ps {
        println!(
            "{:>7} {:>8} {:>10}  {}",
            p.pid,
            p.state.split_whitespace().next().unwrap_or(""),
            human_bytes(p.rss_bytes),
            p.cmdline
        );
    }
    Ok(())
}

pub(crate) fn duration(text: &Option<String>) -> Result<Option<Duration>> {
    text.as_deref()
        .map(|t| {
            humantime::parse_duration(t)
                .with_context(|| format!("`{t}` is not a duration (60s, 5m)"))
        })
        .transpose()
}

pub async fn run(store: &Store, settings: &Settings, args: RunArgs) -> Result<i32> {
    let spec = resolve(store, &args.catalog_id, &args.options).await?;
    let argv = run_argv(&args, &spec.catalog_ref, &spec.commands)?;
    let settings = settings.clone();
    tokio::task::spawn_blocking(move || -> Result<i32> {
        let rt = open_runtime(&settings)?;
        let sandbox = rt.create_owned(spec)?;
        // The output is printed as it comes; the result keeps none of it.
        let req = ExecRequest {
            argv,
            stdin: Stdin::Null,
            keep_output: Some(0),
            ..Default::default()
        };
        let spec = sandbox.spec().clone();
        let result = sandbox.exec_streaming(&req, &mut print_sink());
        let destroyed = sandbox.destroy();
        top_up_pool(&rt, &spec, settings.pool);
        let result = result?;
        destroyed?;
        report_budget(&result);
        Ok(result.status_code())
    })
    .await?
}

/// What `sandbox commit` prints: the registered entry, then the layer ID last.
pub(crate) fn print_committed(done: &strata_service::commit::Committed, json: bool) -> Result<()> {
    if json {
        print_json(done)?;
    } else {
        eprintln!(
            "committed {} files ({}), {} new in the store, in {}",
            done.files,
            human_bytes(done.logical_bytes),
            human_bytes(done.uploaded_bytes),
            humantime::format_duration(Duration::from_millis((done.seconds * 1e3) as u64))
        );
        if let Some(r) = &done.registered {
            println!("{r}");
        }
    }
    println!("{}", done.layer);
    Ok(())
}

/// What `sandbox evaluate` prints: the grader's output on stdout and stderr, then what
/// the agent changed on stderr (or the whole evaluation as JSON); the status to exit with.
pub(crate) fn print_evaluation(
    done: &strata_service::evaluate::Evaluation,
    json: bool,
) -> Result<i32> {
    if json {
        print_json(done)?;
        return Ok(done.exit_code);
    }
    print!("{}", done.stdout);
    std::io::stdout().flush()?;
    eprint!("{}", done.stderr);
    let protected: Vec<&str> = done
        .changed
        .iter()
        .filter(|c| c.protected)
        .map(|c| c.path.as_str())
        .collect();
    eprintln!(
        "evaluated `{}` in a {} sandbox over layer {} in {}: exit {}{}; the agent changed {} paths",
        done.command,
        done.backend,
        &done.layer.to_string()[..16],
        humantime::format_duration(Duration::from_millis((done.seconds * 1e3) as u64)),
        done.exit_code,
        done.budget
            .as_ref()
            .map(|b| format!(" (budget exceeded: {b})"))
            .unwrap_or_default(),
        done.changed_total,
    );
    if !protected.is_empty() {
        eprintln!(
            "dropped before grading, under protected paths: {}",
            protected.join(", ")
        );
    }
    Ok(done.exit_code)
}

/// The journal runner name of embedded use: its sandboxes' IDs name no node.
const EMBEDDED_NODE: &str = "local";

fn embedded_journal(store: &Store, settings: &Settings) -> Journal {
    Journal::new(store, EMBEDDED_NODE, settings.serve.journal_retention)
}

/// Dates the end of embedded sandboxes' journals (IDs without a node) whose sandbox is
/// gone, and removes those past the retention.
async fn sweep_embedded(journal: &Journal, live: &std::collections::HashSet<String>) {
    let owned = |id: &str| !id.contains('-');
    if let Err(e) = journal.sweep(owned, |id| live.contains(id)).await {
        tracing::warn!("sweeping the journals: {e}");
    }
}

/// `exec --step-id`: the command as a journal step of the local sandbox `id`.
async fn exec_step(
    store: &Store,
    settings: &Settings,
    id: &str,
    step: &str,
    req: ExecRequest,
) -> Result<i32> {
    let (_, sb) = runtime_and_sandbox(settings, id).await?;
    let journal = embedded_journal(store, settings);
    let sandbox = sb.id().to_string();
    let ticket = match journal
        .begin(&sandbox, step, &req.argv, req.cwd.as_deref())
        .await?
    {
        Begun::Recorded(s) => {
            let r = s.replay()?;
            let mut print = print_sink();
            print(Stream::Stdout, &r.stdout);
            print(Stream::Stderr, &r.stderr);
            report_budget(&r);
            return Ok(r.status_code());
        }
        Begun::Run(t) => t,
    };
    let cap = settings.serve.exec_output_cap as usize;
    let (result, kept) = tokio::task::spawn_blocking(move || {
        let mut kept = KeptOutput::new(cap);
        let mut print = print_sink();
        let r = sb.exec_streaming(&req, &mut |s: Stream, d: &[u8]| {
            kept.add(s, d);
            print(s, d);
        });
        (r, kept)
    })
    .await?;
    match result {
        Ok(mut r) => {
            r.truncated = kept.truncated;
            (r.stdout, r.stderr) = (kept.stdout, kept.stderr);
            if let Err(e) = ticket.finish(&r).await {
                eprintln!("strata: step {step} ran, but its end could not be recorded in the journal: {e}");
            }
            report_budget(&r);
            Ok(r.status_code())
        }
        Err(e) => {
            let _ = ticket.fail(&e.to_string()).await;
            Err(e.into())
        }
    }
}

/// One sandbox of `strata sandbox hibernate`.
#[derive(serde::Serialize)]
pub(crate) struct HibernatedRow {
    pub id: String,
    pub state_bytes: u64,
    pub ms: u64,
    pub error: Option<String>,
}

/// Prints what `hibernate` did; exit status 1 when any sandbox could not be hibernated.
pub(crate) fn print_hibernated(rows: &[HibernatedRow], json: bool) -> Result<i32> {
    if json {
        print_json(&rows)?;
    } else {
        for r in rows {
            match &r.error {
                None => println!(
                    "{} hibernated: {} of state in {}",
                    r.id,
                    human_bytes(r.state_bytes),
                    crate::output::took(Duration::from_millis(r.ms))
                ),
                Some(e) => eprintln!("error: {}: {e}", r.id),
            }
        }
    }
    Ok(i32::from(rows.iter().any(|r| r.error.is_some())))
}

/// One journal step as `strata sandbox journal` shows it (embedded or through a service).
#[derive(serde::Serialize)]
pub(crate) struct JournalRow {
    pub step_id: String,
    pub state: String,
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    pub started_ms: u64,
    pub finished_ms: Option<u64>,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub duration_ms: Option<u64>,
    pub stdout_bytes: Option<u64>,
    pub stderr_bytes: Option<u64>,
    pub truncated: bool,
    pub budgets_hit: Vec<String>,
    pub error: Option<String>,
}

impl From<strata_service::journal::Step> for JournalRow {
    fn from(s: strata_service::journal::Step) -> JournalRow {
        let r = s.result.as_ref();
        JournalRow {
            state: s.state.as_str().to_string(),
            exit_code: r.map(|r| r.status_code()),
            signal: r.and_then(|r| r.signal),
            duration_ms: r.map(|r| r.duration_ms),
            stdout_bytes: r.map(|r| r.stdout_bytes),
            stderr_bytes: r.map(|r| r.stderr_bytes),
            truncated: r.is_some_and(|r| r.truncated),
            budgets_hit: r
                .map(|r| r.budgets.iter().map(|b| b.to_string()).collect())
                .unwrap_or_default(),
            step_id: s.step_id,
            argv: s.argv,
            cwd: s.cwd,
            started_ms: s.started_ms,
            finished_ms: s.finished_ms,
            error: s.error,
        }
    }
}

pub(crate) fn print_journal(rows: Vec<JournalRow>, json: bool) -> Result<()> {
    if json {
        return print_json(&rows);
    }
    println!(
        "{:<20} {:<12} {:>5} {:>9} {:>9}  COMMAND",
        "STEP", "STATE", "EXIT", "TOOK", "STARTED"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    for r in rows {
        let exit = r.exit_code.map_or("-".to_string(), |c| c.to_string());
        let took = r.duration_ms.map_or("-".to_string(), |ms| {
            crate::output::took(std::time::Duration::from_millis(ms))
        });
        let ago = crate::output::rough_duration(std::time::Duration::from_millis(
            now.saturating_sub(r.started_ms),
        ));
        println!(
            "{:<20} {:<12} {:>5} {:>9} {:>9}  {}",
            r.step_id,
            r.state,
            exit,
            took,
            format!("{ago} ago"),
            r.argv.join(" ")
        );
    }
    Ok(())
}

pub(crate) fn split_remote(arg: &str) -> Option<(&str, &str)> {
    let (id, path) = arg.split_once(':')?;
    (path.starts_with('/') && !id.is_empty() && !id.contains('/')).then_some((id, path))
}

pub async fn sandbox(store: &Store, settings: &Settings, cmd: SandboxCommand) -> Result<i32> {
    let settings = settings.clone();
    if let SandboxCommand::Create {
        options,
        catalog_id,
        json,
    } = &cmd
    {
        let spec = resolve(store, catalog_id, options).await?;
        let json = *json;
        return tokio::task::spawn_blocking(move || -> Result<i32> {
            let rt = open_runtime(&settings)?;
            let sb = rt.create(spec)?;
            if json {
                print_json(sb.record())?;
            }
            println!("{}", sb.id());
            top_up_pool(&rt, sb.spec(), settings.pool);
            Ok(0)
        })
        .await?;
    }
    if let SandboxCommand::Commit {
        id,
        kind,
        register,
        json,
    } = &cmd
    {
        let kind = strata_service::commit::parse_kind(kind)?;
        let (_, sb) = runtime_and_sandbox(&settings, id).await?;
        let done = strata_service::commit::commit(
            store,
            &sb,
            &strata_service::commit::CommitRequest {
                kind,
                register: register.clone(),
                registrant: settings.registrant.clone(),
            },
        )
        .await?;
        print_committed(&done, *json)?;
        return Ok(0);
    }
    if let SandboxCommand::Evaluate {
        id,
        command,
        backend,
        json,
    } = &cmd
    {
        let backend = backend.as_deref().map(str::parse::<Backend>).transpose()?;
        let (rt, sb) = runtime_and_sandbox(&settings, id).await?;
        let catalog = Catalog::open(store).await?;
        let grading = strata_service::evaluate::Grading::of(
            &catalog,
            &sb.spec().catalog_ref,
            sb.id(),
            command,
        )
        .await?;
        let done = strata_service::evaluate::evaluate(
            store,
            &rt,
            &sb,
            &grading,
            &strata_service::evaluate::EvaluateRequest {
                backend: grading.backend(sb.spec().backend, backend),
                identity: settings.registrant.clone(),
                keep_output: strata_runtime::ExecRequest::default().kept_output(),
            },
        )
        .await?;
        return print_evaluation(&done, *json);
    }
    if let SandboxCommand::Exec {
        id,
        step_id: Some(step),
        timeout,
        cwd,
        env,
        interactive,
        cmd,
    } = &cmd
    {
        let req = ExecRequest {
            argv: cmd.clone(),
            stdin: if *interactive {
                Stdin::Inherit
            } else {
                Stdin::Null
            },
            env: parse_env(env)?,
            cwd: cwd.clone(),
            timeout: duration(timeout)?,
            keep_output: Some(0),
            cancel: None,
        };
        return exec_step(store, &settings, id, step, req).await;
    }
    if let SandboxCommand::Snapshot {
        id,
        to_store: true,
        names,
        json,
        ..
    } = &cmd
    {
        let (rt, sb) = runtime_and_sandbox(&settings, id).await?;
        let snap = strata_service::snapshot::take(
            store,
            &sb,
            &rt.state_dir().join("snapshots"),
            &strata_service::snapshot::TakeRequest {
                sandbox: sb.id().to_string(),
                project: String::new(),
                taken_by: settings.registrant.clone(),
                names: names.clone(),
                files_only: false,
            },
        )
        .await?;
        crate::snapshot::print_taken(&snap.to_proto(), *json)?;
        return Ok(0);
    }
    if let SandboxCommand::Restore { from, json } = &cmd {
        if strata_service::snapshot::is_id(from) {
            let snap = strata_service::snapshot::get(store, from).await?;
            let s2 = settings.clone();
            let rt = tokio::task::spawn_blocking(move || open_runtime(&s2)).await??;
            let sb = strata_service::snapshot::restore(
                store,
                &rt,
                &snap,
                &settings.registrant,
                &rt.state_dir().join("snapshots"),
            )
            .await?;
            if *json {
                print_json(sb.record())?;
            }
            println!("{}", sb.id());
            return Ok(0);
        }
    }
    if let SandboxCommand::Fork { id, count } = &cmd {
        strata_service::fork::check_count(*count)?;
        let (rt, parent) = runtime_and_sandbox(&settings, id).await?;
        let forked =
            strata_service::fork::fork(store, &rt, &parent, *count, &settings.registrant).await?;
        eprintln!(
            "forked {} into {} in {} ({})",
            parent.id(),
            forked.children.len(),
            crate::output::took(Duration::from_secs_f64(forked.millis / 1e3)),
            if forked.processes {
                "processes and memory"
            } else {
                "files only"
            }
        );
        for child in &forked.children {
            println!("{}", child.id());
        }
        return Ok(0);
    }
    if let SandboxCommand::Journal { id, json } = &cmd {
        let (s2, id2) = (settings.clone(), id.clone());
        // The sandbox's full ID if it lives, and every live one (the sweep keeps theirs).
        let (full, live) = tokio::task::spawn_blocking(move || -> Result<_> {
            let rt = open_runtime(&s2)?;
            let full = rt.get(&id2).ok().map(|sb| sb.id().to_string());
            let live: std::collections::HashSet<String> =
                rt.list().into_iter().map(|r| r.id).collect();
            Ok((full, live))
        })
        .await??;
        let journal = embedded_journal(store, &settings);
        sweep_embedded(&journal, &live).await;
        let sandbox = full.unwrap_or_else(|| id.clone());
        let steps = journal.list(&sandbox).await?;
        if steps.is_empty() && !live.contains(&sandbox) {
            bail!("no sandbox {id} on this host and no journal of one (see `strata sandbox ls`)");
        }
        print_journal(steps.into_iter().map(JournalRow::from).collect(), *json)?;
        return Ok(0);
    }
    let store_for_rm = store.clone();
    tokio::task::spawn_blocking(move || -> Result<i32> {
        let rt = open_runtime(&settings)?;
        match cmd {
            SandboxCommand::Create { .. }
            | SandboxCommand::Commit { .. }
            | SandboxCommand::Evaluate { .. }
            | SandboxCommand::Journal { .. }
            | SandboxCommand::Fork { .. } => {
                unreachable!("handled above")
            }
            SandboxCommand::Exec {
                id,
                timeout,
                cwd,
                env,
                interactive,
                cmd,
                step_id: _,
            } => {
                let sb = rt.get(&id)?;
                let req = ExecRequest {
                    argv: cmd,
                    stdin: if interactive {
                        Stdin::Inherit
                    } else {
                        Stdin::Null
                    },
                    env: parse_env(&env)?,
                    cwd,
                    timeout: duration(&timeout)?,
                    keep_output: Some(0),
                    cancel: None,
                };
                let r = sb.exec_streaming(&req, &mut print_sink())?;
                report_budget(&r);
                Ok(r.status_code())
            }
            SandboxCommand::Cp { src, dst } => {
                match (split_remote(&src), split_remote(&dst)) {
                    (None, Some((id, path))) => {
                        let (data, mode) = read_local(&src)?;
                        rt.get(id)?.write_file(path, &data, mode)?;
                    }
                    (Some((id, path)), None) => {
                        let data = rt.get(id)?.read_file(path)?;
                        if dst == "-" {
                            std::io::stdout().write_all(&data)?;
                        } else {
                            std::fs::write(&dst, data).with_context(|| format!("writing {dst}"))?;
                        }
                    }
                    _ => bail!(
                        "one side of cp must be ID:/absolute/path and the other a local path or -"
                    ),
                }
                Ok(0)
            }
            SandboxCommand::Ps { id, json } => {
                print_processes(&rt.get(&id)?.processes(), json)?;
                Ok(0)
            }
            SandboxCommand::Ls { json } => {
                let list = rt.list();
                if json {
                    // Each record with its state (`running`, `paused`).
                    let rows = list
                        .iter()
                        .map(|r| {
                            let mut row = serde_json::to_value(r)?;
                            let state = rt.get(&r.id).map_or("running", |sb| sb.state());
                            row["state"] = state.into();
                            Ok(row)
                        })
                        .collect::<Result<Vec<_>, serde_json::Error>>()?;
                    print_json(&rows)?;
                } else {
                    println!("{:<14} {:<10} {:>8}  CATALOG", "ID", "BACKEND", "IDLE");
                    for r in list {
                        println!(
                            "{:<14} {:<10} {:>8}  {}",
                            r.id,
                            r.spec.backend.as_str(),
                            crate::output::rough_duration(rt.idle_for(&r.id)),
                            r.spec.catalog_ref
                        );
                    }
                }
                Ok(0)
            }
            SandboxCommand::Rm { ids } => {
                let mut failed = 0;
                let journal = embedded_journal(&store_for_rm, &settings);
                let handle = tokio::runtime::Handle::current();
                for id in ids {
                    let destroyed = rt.get(&id).and_then(|sb| {
                        let full = sb.id().to_string();
                        sb.destroy().map(|()| full)
                    });
                    match destroyed {
                        Ok(full) => {
                            // Its journal's retention starts now.
                            if let Err(e) = handle.block_on(journal.ended(&full)) {
                                tracing::warn!("dating the end of {full}'s journal: {e}");
                            }
                            println!("{id}");
                        }
                        Err(e) => {
                            eprintln!("error: {id}: {e}");
                            failed += 1;
                        }
                    }
                }
                Ok(if failed > 0 { 1 } else { 0 })
            }
            SandboxCommand::Pause { id } => {
                rt.get(&id)?.pause()?;
                Ok(0)
            }
            SandboxCommand::Hibernate { ids, label, json } => {
                if !label.is_empty() {
                    bail!("--label selects sandboxes by the labels a node service gave them; sandboxes made here have none: name them, or use --server");
                }
                let rows: Vec<HibernatedRow> = ids
                    .iter()
                    .map(|id| {
                        let r = rt.get(id).and_then(|sb| {
                            let full = sb.id().to_string();
                            sb.hibernate().map(|info| (full, info))
                        });
                        match r {
                            Ok((full, info)) => HibernatedRow {
                                id: full,
                                state_bytes: info.state_bytes,
                                ms: info.millis as u64,
                                error: None,
                            },
                            Err(e) => HibernatedRow {
                                id: id.clone(),
                                state_bytes: 0,
                                ms: 0,
                                error: Some(e.to_string()),
                            },
                        }
                    })
                    .collect();
                print_hibernated(&rows, json)
            }
            SandboxCommand::Wake { id } => {
                let sb = rt.get(&id)?;
                if !sb.wake()? {
                    eprintln!("{id} was not hibernated");
                }
                println!("{}", sb.id());
                Ok(0)
            }
            SandboxCommand::Resume { id } => {
                rt.get(&id)?.resume()?;
                Ok(0)
            }
            SandboxCommand::Network { id, net } => {
                let rules = strata_runtime::NetRule::parse_all(&net)?;
                rt.get(&id)?.set_network(rules)?;
                Ok(0)
            }
            SandboxCommand::Snapshot {
                id,
                dir: Some(dir),
                to_store: false,
                json,
                ..
            } => {
                let info = rt.get(&id)?.snapshot(&dir)?;
                if json {
                    print_json(&info)?;
                } else {
                    println!(
                        "{}: state {}, disk {}, {:.0} ms",
                        dir.display(),
                        human_bytes(info.state_bytes),
                        human_bytes(info.disk_bytes),
                        info.millis
                    );
                }
                Ok(0)
            }
            SandboxCommand::Snapshot { .. } => {
                bail!("give a DIR for the snapshot, or --to-store")
            }
            SandboxCommand::Restore { from, json, .. } => {
                let sb = rt.restore(std::path::Path::new(&from), false)?;
                if json {
                    print_json(sb.record())?;
                }
                println!("{}", sb.id());
                Ok(0)
            }
            SandboxCommand::Audit { id } => {
                let log = rt.audit(&id);
                let text = std::fs::read_to_string(log.path())
                    .with_context(|| format!("no audit record for sandbox {id}"))?;
                print!("{text}");
                Ok(0)
            }
            SandboxCommand::Pool { fill, drain } => {
                if drain {
                    println!("stopped {}", rt.drain_pool());
                }
                if let Some(n) = fill {
                    rt.fill_pool(n)?;
                }
                println!("pooled {}", rt.pooled());
                Ok(0)
            }
            SandboxCommand::Reap { json, every } => {
                let every = duration(&every)?;
                loop {
                    let report = rt.reap_report()?;
                    if json {
                        print_json(&report)?;
                    } else {
                        println!(
                            "crashed {} expired {} orphans {}",
                            report.crashed.len(),
                            report.expired.len(),
                            report.orphans.len()
                        );
                    }
                    match every {
                        Some(d) => std::thread::sleep(d),
                        None => return Ok(0),
                    }
                }
            }
        }
    })
    .await?
}
