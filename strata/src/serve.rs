//! `strata serve` (the node service), `strata project ...` and `strata token ...`: wiring
//! of `strata-service` to this host's settings, runtime and store.

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use strata_catalog::Backend;
use strata_service::{Node, Project, Projects, ServiceConfig};
use strata_store::Store;

use crate::config::Settings;
use crate::output::print_json;

#[derive(Args)]
pub struct ServeArgs {
    /// Address of the gRPC API (default 127.0.0.1:7600; `listen` in strata.toml).
    #[arg(long)]
    listen: Option<String>,
    /// Address of the Prometheus `/metrics` endpoint (`metrics_listen`); default: none.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// The node's name, the first part of every sandbox ID (STRATA_NODE_NAME,
    /// `node_name`); default: the host name.
    #[arg(long)]
    node_name: Option<String>,
    /// Also serve the E2B-compatible API here (`e2b_listen`), e.g. 127.0.0.1:3000; off
    /// unless given.
    #[arg(long)]
    e2b_listen: Option<String>,
    /// With wildcard DNS: serve the E2B API at `api.<domain>` and sandboxes at
    /// `<port>-<id>.<domain>` (`e2b_domain`); clients set E2B_DOMAIN to it.
    #[arg(long)]
    e2b_domain: Option<String>,
    /// Serve the E2B API over TLS with this certificate chain (PEM; `e2b_tls_cert`).
    #[arg(long, requires = "e2b_tls_key")]
    e2b_tls_cert: Option<std::path::PathBuf>,
    /// The private key of --e2b-tls-cert (PEM; `e2b_tls_key`).
    #[arg(long, requires = "e2b_tls_cert")]
    e2b_tls_key: Option<std::path::PathBuf>,
}

/// The host name as a DNS label (what a node is called unless told).
fn host_label() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let mut label: String = raw
        .trim()
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    label.truncate(40);
    let label = label.trim_matches('-').to_string();
    if label.is_empty() {
        "node".into()
    } else {
        label
    }
}

fn addr(what: &str, text: &str) -> Result<std::net::SocketAddr> {
    text.parse().with_context(|| {
        format!("{what} `{text}` is not an address: give IP:PORT, e.g. 127.0.0.1:7600")
    })
}

/// SIGTERM or SIGINT, taken from the moment this is called: one that comes while the
/// node starts (recovering its sandboxes) stops it once it has started, instead of being
/// lost (a SIGINT to a process a script started in the background is ignored until a
/// handler is set) or killing it half way.
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("handling SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("handling SIGINT")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("stopping; sandboxes stay for the next start");
    })
}

pub async fn serve(store: Store, settings: &Settings, args: ServeArgs) -> Result<i32> {
    let stop = shutdown_signal()?;
    let s = &settings.serve;
    let listen = addr("--listen", args.listen.as_deref().unwrap_or(&s.listen))?;
    let metrics = args
        .metrics_listen
        .as_deref()
        .or(s.metrics_listen.as_deref())
        .map(|m| addr("--metrics-listen", m))
        .transpose()?;
    let node_name = args
        .node_name
        .or_else(|| s.node_name.clone())
        .unwrap_or_else(host_label);
    let mut rcfg = crate::sandbox::runtime_config(settings)?;
    rcfg.reap_at_open = false;
    let rt = tokio::task::spawn_blocking(move || strata_runtime::Runtime::open(rcfg)).await??;
    let mut cfg = ServiceConfig::new(listen, node_name);
    cfg.metrics_listen = metrics;
    cfg.output_cap = s.exec_output_cap as usize;
    cfg.memory_overcommit = s.memory_overcommit;
    cfg.cpu_overcommit = s.cpu_overcommit;
    cfg.reap_every = s.reap_every;
    cfg.default_lifetime = s.default_lifetime;
    cfg.journal_retention = s.journal_retention;
    cfg.hibernate_concurrency = s.hibernate_concurrency;
    cfg.pool = settings.pool;
    cfg.registry = settings.registry.clone();
    let e2b_listen = args.e2b_listen.or_else(|| s.e2b_listen.clone());
    if let Some(e2b) = e2b_listen {
        let tls = match (
            args.e2b_tls_cert.or_else(|| s.e2b_tls_cert.clone()),
            args.e2b_tls_key.or_else(|| s.e2b_tls_key.clone()),
        ) {
            (Some(cert), Some(key)) => Some(strata_service::e2b::TlsFiles { cert, key }),
            (None, None) => None,
            _ => anyhow::bail!("e2b_tls_cert and e2b_tls_key go together: give both or neither"),
        };
        let domain = args
            .e2b_domain
            .or_else(|| s.e2b_domain.clone())
            .map(|d| d.trim_matches('.').to_ascii_lowercase());
        cfg.e2b = Some(strata_service::e2b::E2bConfig {
            listen: addr("--e2b-listen", &e2b)?,
            domain,
            tls,
        });
    }
    let e2b_shown = cfg.e2b.as_ref().map(|c| {
        format!(
            ", E2B API on {}://{}",
            if c.tls.is_some() { "https" } else { "http" },
            c.listen
        )
    });
    let node = Node::start(cfg, rt, store, settings.registrant.clone()).await?;
    let name = node.config().node.clone();
    strata_service::serve(node, stop, || {
        eprintln!(
            "strata: node `{name}` serving on {listen}{}{}",
            metrics
                .map(|m| format!(", metrics on http://{m}/metrics"))
                .unwrap_or_default(),
            e2b_shown.unwrap_or_default()
        )
    })
    .await?;
    Ok(0)
}

#[derive(Subcommand)]
pub enum ProjectCommand {
    /// Make a project: who may use which backends and catalog namespaces, and how much.
    Create {
        name: String,
        /// Live sandboxes at once.
        #[arg(long)]
        max_sandboxes: Option<u32>,
        /// Memory budgets of its live sandboxes together (64G).
        #[arg(long)]
        max_memory: Option<String>,
        /// CPU budgets of its live sandboxes together.
        #[arg(long)]
        max_cpus: Option<f64>,
        /// Bytes its snapshots in the store may hold together (100G).
        #[arg(long)]
        max_snapshot_storage: Option<String>,
        /// Catalog namespaces it may register in, comma-separated.
        #[arg(long, value_delimiter = ',')]
        namespaces: Vec<String>,
        /// Backends it may use, comma-separated (default: all).
        #[arg(long, value_delimiter = ',')]
        backends: Vec<Backend>,
        /// Its sandboxes may ask for open internet (E2B's `allow_internet_access`).
        #[arg(long)]
        allow_internet: bool,
        #[arg(long)]
        json: bool,
    },
    /// Every project.
    Ls {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum TokenCommand {
    /// Make a token for a project; it is printed once, as the last line.
    Create {
        #[arg(long)]
        project: String,
    },
    /// Revoke a token, given as the token or its ID (see `token ls`).
    Revoke { token: String },
    /// Tokens (their IDs; the tokens themselves are not kept).
    Ls {
        #[arg(long)]
        project: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

fn since(ms: u64) -> String {
    crate::output::human_time(ms / 1000)
}

pub async fn project(store: &Store, cmd: ProjectCommand) -> Result<i32> {
    let projects = Projects::new(store);
    match cmd {
        ProjectCommand::Create {
            name,
            max_sandboxes,
            max_memory,
            max_cpus,
            max_snapshot_storage,
            namespaces,
            backends,
            allow_internet,
            json,
        } => {
            for ns in &namespaces {
                strata_catalog::entry::validate_id(&format!("{ns}/x"))
                    .with_context(|| format!("--namespaces: `{ns}` is not a catalog namespace"))?;
            }
            if let Some(c) = max_cpus {
                anyhow::ensure!(
                    c > 0.0 && c.is_finite(),
                    "--max-cpus must be a positive number"
                );
            }
            let p = Project {
                name,
                max_sandboxes,
                max_memory: max_memory
                    .as_deref()
                    .map(strata_catalog::parse_size)
                    .transpose()
                    .context("--max-memory")?,
                max_cpus,
                max_snapshot_storage: max_snapshot_storage
                    .as_deref()
                    .map(strata_catalog::parse_size)
                    .transpose()
                    .context("--max-snapshot-storage")?,
                namespaces,
                backends,
                allow_internet,
                created_ms: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
            };
            projects.create(&p).await?;
            if json {
                print_json(&p)?;
            } else {
                println!("{}", p.name);
            }
        }
        ProjectCommand::Ls { json } => {
            let all = projects.list().await?;
            if json {
                print_json(&all)?;
            } else {
                println!(
                    "{:<20} {:>9} {:>10} {:>6} {:>10}  {:<24} BACKENDS",
                    "PROJECT", "SANDBOXES", "MEMORY", "CPUS", "SNAPSHOTS", "NAMESPACES"
                );
                for p in all {
                    let or_any = |v: Option<String>| v.unwrap_or_else(|| "-".into());
                    println!(
                        "{:<20} {:>9} {:>10} {:>6} {:>10}  {:<24} {}",
                        p.name,
                        or_any(p.max_sandboxes.map(|n| n.to_string())),
                        or_any(p.max_memory.map(crate::output::human_bytes)),
                        or_any(p.max_cpus.map(|c| c.to_string())),
                        or_any(p.max_snapshot_storage.map(crate::output::human_bytes)),
                        if p.namespaces.is_empty() {
                            "-".into()
                        } else {
                            p.namespaces.join(",")
                        },
                        if p.backends.is_empty() {
                            "all".into()
                        } else {
                            p.backends
                                .iter()
                                .map(|b| b.as_str())
                                .collect::<Vec<_>>()
                                .join(",")
                        }
                    );
                }
            }
        }
    }
    Ok(0)
}

pub async fn token(store: &Store, cmd: TokenCommand) -> Result<i32> {
    let projects = Projects::new(store);
    match cmd {
        TokenCommand::Create { project } => {
            let (token, rec) = projects.create_token(&project).await?;
            eprintln!(
                "token {} for project {} (shown once: keep it)",
                rec.id, rec.project
            );
            println!("{token}");
        }
        TokenCommand::Revoke { token } => {
            let rec = projects.revoke(&token).await?;
            println!("{}", rec.id);
            eprintln!(
                "revoked; nodes refuse it within {}",
                humantime::format_duration(strata_service::projects::AUTH_CACHE)
            );
        }
        TokenCommand::Ls { project, json } => {
            let all = projects.tokens(project.as_deref()).await?;
            if json {
                print_json(&all)?;
            } else {
                println!(
                    "{:<14} {:<20} {:<22} STATE",
                    "TOKEN ID", "PROJECT", "CREATED"
                );
                for t in all {
                    println!(
                        "{:<14} {:<20} {:<22} {}",
                        t.id,
                        t.project,
                        since(t.created_ms),
                        match t.revoked_ms {
                            Some(r) => format!("revoked {}", since(r)),
                            None => "live".into(),
                        }
                    );
                }
            }
        }
    }
    Ok(0)
}
