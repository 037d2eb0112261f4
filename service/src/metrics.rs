//! Prometheus metrics of the node, served as text on `GET /metrics` of the metrics
//! listener. Counters and histograms are updated as calls happen; gauges (sandboxes by
//! backend and state, lazyfs bytes and hit ratio) are read fresh at each scrape.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::error::ServiceError;
use crate::node::Node;

type Labels = Vec<(String, String)>;

fn latency() -> Histogram {
    // 1 ms to ~65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

pub struct Metrics {
    registry: Mutex<Registry>,
    sandboxes: Family<Labels, Gauge>,
    create_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    exec_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    hibernate_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    wake_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    refused: Family<Labels, Counter>,
    ended: Family<Labels, Counter>,
    store_errors: Counter,
    lazyfs_requested: Gauge<u64, AtomicU64>,
    lazyfs_fetched: Gauge<u64, AtomicU64>,
    lazyfs_hit_ratio: Gauge<f64, AtomicU64>,
    committed_memory: Gauge<u64, AtomicU64>,
    committed_cpus: Gauge<f64, AtomicU64>,
    builds: Family<Labels, Counter>,
    build_seconds: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let m = Metrics {
            registry: Mutex::new(Registry::with_prefix("strata")),
            sandboxes: Family::default(),
            create_seconds: Family::new_with_constructor(latency),
            exec_seconds: Family::new_with_constructor(latency),
            hibernate_seconds: Family::new_with_constructor(latency),
            wake_seconds: Family::new_with_constructor(latency),
            refused: Family::default(),
            ended: Family::default(),
            store_errors: Counter::default(),
            lazyfs_requested: Gauge::default(),
            lazyfs_fetched: Gauge::default(),
            lazyfs_hit_ratio: Gauge::default(),
            committed_memory: Gauge::default(),
            committed_cpus: Gauge::default(),
            builds: Family::default(),
            build_seconds: latency(),
        };
        {
            let mut r = m.registry.lock().unwrap_or_else(|p| p.into_inner());
            r.register(
                "sandboxes",
                "Sandboxes of this node's service, by backend and state",
                m.sandboxes.clone(),
            );
            r.register(
                "sandbox_create_seconds",
                "Time from a create request to a usable sandbox, by backend",
                m.create_seconds.clone(),
            );
            r.register(
                "exec_seconds",
                "Time of commands run through the API, by backend",
                m.exec_seconds.clone(),
            );
            r.register(
                "hibernate_seconds",
                "Time to save a sandbox's state and stop it, by backend",
                m.hibernate_seconds.clone(),
            );
            r.register(
                "wake_seconds",
                "Time to start a hibernated sandbox again, by backend",
                m.wake_seconds.clone(),
            );
            r.register(
                "admissions_refused",
                "Creates refused at admission, by reason",
                m.refused.clone(),
            );
            r.register(
                "sandboxes_ended",
                "Sandboxes ended, by reason",
                m.ended.clone(),
            );
            r.register(
                "store_errors",
                "Calls that failed because the store did",
                m.store_errors.clone(),
            );
            r.register(
                "lazyfs_requested_bytes",
                "Bytes read from lazily loaded layers of live sandboxes",
                m.lazyfs_requested.clone(),
            );
            r.register(
                "lazyfs_fetched_bytes",
                "Bytes fetched from the store for layers of live sandboxes",
                m.lazyfs_fetched.clone(),
            );
            r.register(
                "lazyfs_cache_hit_ratio",
                "Share of chunk reads served from the node's cache",
                m.lazyfs_hit_ratio.clone(),
            );
            r.register(
                "committed_memory_bytes",
                "Memory budgets committed on this node",
                m.committed_memory.clone(),
            );
            r.register(
                "builds",
                "Layer builds through the API, by result (ok, failed)",
                m.builds.clone(),
            );
            r.register(
                "build_seconds",
                "Time of layer builds through the API",
                m.build_seconds.clone(),
            );
            r.register(
                "committed_cpus",
                "CPU budgets committed on this node",
                m.committed_cpus.clone(),
            );
        }
        m
    }

    pub fn observe_create(&self, backend: &str, took: Duration) {
        self.create_seconds
            .get_or_create(&vec![("backend".into(), backend.into())])
            .observe(took.as_secs_f64());
    }

    pub fn observe_exec(&self, backend: &str, took: Duration) {
        self.exec_seconds
            .get_or_create(&vec![("backend".into(), backend.into())])
            .observe(took.as_secs_f64());
    }

    pub fn observe_hibernate(&self, backend: &str, took: Duration) {
        self.hibernate_seconds
            .get_or_create(&vec![("backend".into(), backend.into())])
            .observe(took.as_secs_f64());
    }

    pub fn observe_wake(&self, backend: &str, took: Duration) {
        self.wake_seconds
            .get_or_create(&vec![("backend".into(), backend.into())])
            .observe(took.as_secs_f64());
    }

    pub fn refused(&self, reason: &str) {
        self.refused
            .get_or_create(&vec![("reason".into(), reason.into())])
            .inc();
    }

    pub fn ended(&self, reason: &str) {
        self.ended
            .get_or_create(&vec![("reason".into(), reason.into())])
            .inc();
    }

    pub fn observe_build(&self, ok: bool, took: Duration) {
        let result = if ok { "ok" } else { "failed" };
        self.builds
            .get_or_create(&vec![("result".into(), result.into())])
            .inc();
        self.build_seconds.observe(took.as_secs_f64());
    }

    pub fn store_error(&self) {
        self.store_errors.inc();
    }

    /// The text exposition, gauges refreshed from `node` first.
    fn render(&self, node: &Node) -> String {
        self.sandboxes.clear();
        let metas = node.metas();
        for m in &metas {
            self.sandboxes
                .get_or_create(&vec![
                    ("backend".into(), m.backend.as_str().into()),
                    ("state".into(), m.state().into()),
                ])
                .inc();
        }
        let (mem, cpus, _) = crate::admission::on_node(metas.iter());
        self.committed_memory.set(mem);
        self.committed_cpus.set(cpus);
        let (requested, fetched, hits, misses) = lazyfs_totals(node);
        self.lazyfs_requested.set(requested);
        self.lazyfs_fetched.set(fetched);
        self.lazyfs_hit_ratio.set(if hits + misses == 0 {
            0.0
        } else {
            hits as f64 / (hits + misses) as f64
        });
        let mut text = String::new();
        let r = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = encode(&mut text, &r) {
            tracing::warn!("encoding metrics: {e}");
        }
        text
    }
}

/// Requested and fetched bytes, cache hits and misses, summed over the layers of the live
/// sandboxes (each layer once), from the lazyfs daemon.
fn lazyfs_totals(node: &Node) -> (u64, u64, u64, u64) {
    let Some(mut client) = node.rt.lazyfs().running_client() else {
        return (0, 0, 0, 0);
    };
    let mut layers: Vec<String> = node
        .rt
        .list()
        .into_iter()
        .flat_map(|r| r.spec.layers)
        .collect();
    layers.sort();
    layers.dedup();
    let mut t = (0, 0, 0, 0);
    for id in layers {
        if let Ok(strata_lazyfs::Response::Stats(s)) =
            client.call(&strata_lazyfs::Request::Stats { id })
        {
            t.0 += s.requested_bytes;
            t.1 += s.fetched_bytes;
            t.2 += s.cache_hits;
            t.3 += s.cache_misses;
        }
    }
    t
}

/// Serves `/metrics` on `addr` until the returned task is aborted.
pub async fn listen(
    addr: SocketAddr,
    node: Arc<Node>,
) -> Result<tokio::task::JoinHandle<()>, ServiceError> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServiceError::Io {
            what: format!("listening for metrics on {addr} (choose another with --metrics-listen)"),
            source,
        })?;
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let node = node.clone();
            async move {
                let text = tokio::task::spawn_blocking(move || node.metrics.render(&node))
                    .await
                    .unwrap_or_default();
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    text,
                )
            }
        }),
    );
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("metrics listener: {e}");
        }
    }))
}
