//! The node service (`strata serve`): one long-lived process per node that owns the
//! runtime (sandbox records, pools, the reaper on a timer), the catalog and the store, and
//! serves them over gRPC (`proto/strata/v1/`) to the CLI, the Python SDK and other
//! clients, each call authenticated by a project's token. Admission (`admission.rs`)
//! refuses what a project's quota or the node's capacity cannot take; `metrics.rs` serves
//! Prometheus text on its own listener.

pub mod admission;
mod catalog_api;
pub mod commit;
pub mod e2b;
pub mod error;
pub mod evaluate;
pub mod fork;
pub mod journal;
mod layers_api;
pub mod metrics;
mod node;
mod node_api;
pub mod projects;
mod sandboxes;
pub mod snapshot;
pub mod state;

pub mod proto {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("strata.v1");
}

use std::net::SocketAddr;
use std::time::Duration;

pub use error::ServiceError;

/// Runs blocking runtime work off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ServiceError> + Send + 'static,
) -> Result<T, ServiceError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ServiceError::Internal(e.to_string()))?
}
/// Runs `work` on a task of its own and waits for it: a caller that goes away meanwhile
/// (its deadline, a dropped connection) does not cut the work off half done.
pub(crate) async fn detached<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T, ServiceError>> + Send + 'static,
) -> Result<T, ServiceError> {
    tokio::spawn(work)
        .await
        .map_err(|e| ServiceError::Internal(e.to_string()))?
}

pub use node::{CreateArgs, Node, NodeSize};
pub use projects::{Caller, Project, Projects, TokenRecord};
pub use sandboxes::create_args;

/// Everything the service is configured with (the binary resolves it from flags,
/// `strata.toml` and the environment).
#[derive(Clone)]
pub struct ServiceConfig {
    pub listen: SocketAddr,
    /// Where `/metrics` is served; `None`: nowhere.
    pub metrics_listen: Option<SocketAddr>,
    /// The node's name: the first part of every sandbox ID it issues (a DNS label).
    pub node: String,
    /// The most a unary exec keeps of each stream.
    pub output_cap: usize,
    /// The largest file a single WriteFile takes (ReadFile streams any size).
    pub max_write_bytes: usize,
    /// How often the reaper runs (idle TTLs, lifetimes, crashed sandboxes).
    pub reap_every: Duration,
    /// The node's size admission works from; `None` probes the host.
    pub node_size: Option<NodeSize>,
    /// Admitted memory is the node's times this (1.0: no overcommit).
    pub memory_overcommit: f64,
    /// Admitted CPUs are the node's cores times this.
    pub cpu_overcommit: f64,
    /// A sandbox created without a lifetime lives at most this long; `None`: no limit.
    pub default_lifetime: Option<Duration>,
    /// What a refused create tells the client to wait before retrying.
    pub retry_after: Duration,
    /// Fills the runtime's pools after creates (uppers, fncall agents): how many wait.
    pub pool: usize,
    /// Version string reported by `Node.Version`.
    pub version: String,
    /// The largest tar a `Layers.Build` takes.
    pub max_upload_bytes: u64,
    /// How registry images are pulled for `Layers.Build`.
    pub registry: strata_builder::RegistrySettings,
    /// The E2B-compatible API; `None`: not served.
    pub e2b: Option<e2b::E2bConfig>,
    /// How long a sandbox's command journal is kept after the sandbox ends.
    pub journal_retention: Duration,
    /// Hibernations run at once (each writes its sandbox's memory to the node's disk).
    pub hibernate_concurrency: usize,
}

impl ServiceConfig {
    pub fn new(listen: SocketAddr, node: String) -> ServiceConfig {
        ServiceConfig {
            listen,
            metrics_listen: None,
            node,
            output_cap: strata_runtime::ExecRequest::default().kept_output(),
            max_write_bytes: 256 << 20,
            reap_every: Duration::from_secs(5),
            node_size: None,
            memory_overcommit: 1.0,
            cpu_overcommit: 4.0,
            default_lifetime: None,
            retry_after: Duration::from_secs(5),
            pool: 0,
            version: env!("CARGO_PKG_VERSION").to_string(),
            max_upload_bytes: 16 << 30,
            registry: Default::default(),
            e2b: None,
            journal_retention: Duration::from_secs(24 * 3600),
            hibernate_concurrency: 4,
        }
    }
}

/// A node name is a DNS label: sandbox IDs (`<node>-<id>`) appear in host names.
pub fn check_node_name(name: &str) -> Result<(), ServiceError> {
    let ok = !name.is_empty()
        && name.len() <= 40
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(ServiceError::invalid(
            "node",
            format!("node name `{name}` must be 1-40 of a-z, 0-9 and - (not first or last)"),
        ))
    }
}

/// Serves until `shutdown` completes: gRPC on `cfg.listen`, metrics on
/// `cfg.metrics_listen`, the reaper on its timer; `ready` is called once every listener
/// is bound.
pub async fn serve(
    node: std::sync::Arc<Node>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(),
) -> Result<(), ServiceError> {
    use tonic::transport::Server;
    let cfg = node.config().clone();
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ServiceError::Io {
            what: format!(
                "listening on {} (is another `strata serve` running? choose another with --listen)",
                cfg.listen
            ),
            source,
        })?;
    let metrics = match cfg.metrics_listen {
        Some(addr) => Some(metrics::listen(addr, node.clone()).await?),
        None => None,
    };
    let e2b = match cfg.e2b.clone() {
        Some(c) => Some(e2b::listen(node.clone(), c).await?),
        None => None,
    };
    let reaper = tokio::spawn(node::reaper(node.clone()));
    tracing::info!(listen = %cfg.listen, node = %cfg.node, "serving");
    // Every listener is bound: a client that waits for this connects.
    ready();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let result = Server::builder()
        .tcp_nodelay(true)
        .add_service(proto::node_server::NodeServer::new(node_api::NodeApi(
            node.clone(),
        )))
        .add_service(
            proto::sandboxes_server::SandboxesServer::new(sandboxes::SandboxesApi(node.clone()))
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20),
        )
        .add_service(proto::catalog_server::CatalogServer::new(
            catalog_api::CatalogApi(node.clone()),
        ))
        .add_service(proto::layers_server::LayersServer::new(
            layers_api::LayersApi(node.clone()),
        ))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    reaper.abort();
    if let Some(t) = e2b {
        t.abort();
    }
    if let Some(m) = metrics {
        m.abort();
    }
    result.map_err(|e| ServiceError::Unavailable(format!("gRPC server: {e}")))
}
