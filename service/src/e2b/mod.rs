//! The E2B-compatible API (`strata serve --e2b-listen`): the control plane E2B's SDKs
//! call (`api.rs`), the in-sandbox daemon's protocol (envd: Connect RPC with the JSON
//! codec, `/files`, `/health`) served on the host side over the runtime's `Sandbox` API
//! (`envd.rs`, `files.rs`, `procs.rs`, `watch.rs`), and other sandbox ports proxied into
//! the sandbox (`proxy.rs`). One listener serves all of it, routed the way E2B's own
//! proxy routes (see [`route`]); sandboxes, projects, tokens, quotas and audit are the
//! node's, exactly as through gRPC.
//!
//! Everything a sandbox sends back (output, file data, listings) crosses in bounded
//! pieces; everything a client sends is parsed as untrusted JSON with size limits.

mod api;
pub mod connect;
mod envd;
mod files;
mod procs;
mod proxy;
mod watch;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::error::ServiceError;
use crate::node::Node;
use crate::state::Meta;

/// The port the SDK addresses envd on.
pub const ENVD_PORT: u16 = 49983;

/// The envd version reported to clients: every feature the SDK gates at or below it is
/// implemented here (no file metadata headers, 0.6.2, nor watch `include_entry`, 0.6.3).
pub const ENVD_VERSION: &str = "0.5.7";

/// Where and how the E2B API is served.
#[derive(Debug, Clone)]
pub struct E2bConfig {
    pub listen: SocketAddr,
    /// With wildcard DNS: the API at `api.<domain>`, sandboxes at `<port>-<id>.<domain>`.
    pub domain: Option<String>,
    /// Serves TLS (h2 and HTTP/1.1) with this certificate chain and key (PEM files).
    pub tls: Option<TlsFiles>,
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The E2B front of one node.
pub(crate) struct E2b {
    node: Arc<Node>,
    cfg: E2bConfig,
    /// Derives each sandbox's envd access token (kept in the node's state, 0600).
    key: [u8; 32],
    procs: Arc<procs::Table>,
    watchers: watch::Table,
    /// Each sandbox's CPU time at its last metrics call, so `cpuUsedPct` is over the
    /// interval between two calls (bounded; entries of gone sandboxes age out).
    cpu_seen: moka::sync::Cache<String, (std::time::Instant, Duration)>,
}

impl E2b {
    /// The envd access token of sandbox `id`: a keyed hash, so it is never stored and a
    /// restarted service answers the same one.
    fn access_token(&self, id: &str) -> String {
        blake3::keyed_hash(&self.key, id.as_bytes())
            .to_hex()
            .to_string()
    }

    /// A live sandbox by its ID, whoever owns it (envd calls prove the sandbox's access
    /// token instead of a project's key).
    fn meta(&self, id: &str) -> Option<Meta> {
        self.node.meta_by_id(id)
    }

    /// The sandbox whose access token this is (older SDKs send only the token).
    fn meta_by_token(&self, token: &str) -> Option<Meta> {
        self.node
            .metas()
            .into_iter()
            .find(|m| !m.pending && constant_eq(&self.access_token(&m.id), token))
    }
}

fn constant_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Reads (or makes, on first start) the node's key for access tokens.
fn load_key(node: &Node) -> Result<[u8; 32], ServiceError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = node.state_dir().join("service").join("e2b.key");
    let io = |what: &str, source| ServiceError::Io {
        what: format!("{what} {}", path.display()),
        source,
    };
    match std::fs::read(&path) {
        Ok(bytes) if bytes.len() == 32 => {
            let mut key = [0u8; 32];
            key.copy_from_slice(&bytes);
            return Ok(key);
        }
        Ok(_) => {
            return Err(ServiceError::Internal(format!(
                "{} is not a 32-byte key: remove it (every E2B access token changes)",
                path.display()
            )))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("reading", e)),
    }
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).map_err(|e| ServiceError::Internal(format!("entropy: {e}")))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io("creating the directory of", e))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| io("creating", e))?;
    f.write_all(&key).map_err(|e| io("writing", e))?;
    Ok(key)
}

/// A JSON body the SDK's generated client reads: `{"code": <int>, "message": <str>}`.
pub(crate) fn api_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"code": status.as_u16(), "message": message.into()});
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The HTTP status of a service error, for the control plane and `/files`.
pub(crate) fn status_of(e: &ServiceError) -> StatusCode {
    use tonic::Code;
    match e.code_and_reason().0 {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
            StatusCode::BAD_REQUEST
        }
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A service error as the control plane answers it (with `Retry-After` on a refusal
/// that waiting can cure).
pub(crate) fn error_response(e: &ServiceError) -> Response {
    let mut r = api_error(status_of(e), e.to_string());
    if let ServiceError::Exhausted { retry_after, .. } = e {
        if let Ok(v) = retry_after.as_secs().max(1).to_string().parse() {
            r.headers_mut().insert("retry-after", v);
        }
    }
    r
}

pub(crate) use crate::blocking;

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// Where a request goes.
#[derive(Debug, PartialEq)]
pub(crate) enum Route {
    /// The control plane (`/sandboxes`, `/v2/...`, `/snapshots`, `/templates`).
    Api,
    /// A sandbox's port: envd on [`ENVD_PORT`], anything else proxied. The sandbox is
    /// named by the host or a header, or else found by the access token.
    Sandbox { id: Option<String>, port: u16 },
}

fn is_api_path(path: &str) -> bool {
    ["/sandboxes", "/v2/", "/v1/", "/snapshots", "/templates"]
        .iter()
        .any(|p| path == *p || path.starts_with(&format!("{}/", p.trim_end_matches('/'))))
}

/// E2B's proxy rules: a host `<port>-<id>.<domain>` names a sandbox's port and
/// `api.<domain>` the control plane; otherwise (an IP, `localhost`, one URL for all) the
/// path decides between the control plane and a sandbox, a sandbox is named by the
/// `E2b-Sandbox-Id` header and its port by `E2b-Sandbox-Port`. A port other than envd's
/// always goes to the sandbox (an app's own `/sandboxes` path included); SDKs that send
/// the sandbox headers on control-plane calls (2.20 on connect) name envd's port there.
pub(crate) fn route(
    host: Option<&str>,
    path: &str,
    headers: &HeaderMap,
    domain: Option<&str>,
) -> Route {
    if let (Some(host), Some(domain)) = (host, domain) {
        let name = host.rsplit_once(':').map_or(host, |(h, p)| {
            if p.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                host
            }
        });
        let name = name.to_ascii_lowercase();
        if name == format!("api.{domain}") {
            return Route::Api;
        }
        if let Some(label) = name.strip_suffix(&format!(".{domain}")) {
            if let Some((port, id)) = label.split_once('-') {
                if let (Ok(port), false) = (port.parse::<u16>(), id.is_empty() || id.contains('.'))
                {
                    return Route::Sandbox {
                        id: Some(id.to_string()),
                        port,
                    };
                }
            }
        }
    }
    let port = header(headers, "e2b-sandbox-port").and_then(|p| p.parse::<u16>().ok());
    let id = header(headers, "e2b-sandbox-id").map(str::to_string);
    match port {
        Some(p) if p != ENVD_PORT => Route::Sandbox { id, port: p },
        _ if is_api_path(path) => Route::Api,
        _ => Route::Sandbox {
            id,
            port: ENVD_PORT,
        },
    }
}

/// E2B's proxy answer for a sandbox that is not there (never was, or has ended), which
/// the SDKs map to "sandbox not running" (`is_running()` is false).
pub(super) fn sandbox_not_found(id: &str) -> Response {
    let body = serde_json::json!({"sandboxId": id,
        "message": "The sandbox was not found", "code": 502});
    (
        StatusCode::BAD_GATEWAY,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn handle(State(e): State<Arc<E2b>>, req: Request) -> Response {
    let host = header(req.headers(), "host")
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    let r = route(
        host.as_deref(),
        req.uri().path(),
        req.headers(),
        e.cfg.domain.as_deref(),
    );
    match r {
        Route::Api => api::handle(&e, req).await,
        Route::Sandbox { id, port } => {
            let token = header(req.headers(), "x-access-token").map(str::to_string);
            let meta = match &id {
                Some(id) => e.meta(id),
                None => token.as_deref().and_then(|t| e.meta_by_token(t)),
            };
            let Some(meta) = meta else {
                return sandbox_not_found(&id.unwrap_or_default());
            };
            if port == ENVD_PORT {
                let ok = token
                    .as_deref()
                    .is_some_and(|t| constant_eq(&e.access_token(&meta.id), t));
                if !ok {
                    return envd::unauthenticated(req.uri().path());
                }
                envd::handle(&e, meta, req).await
            } else {
                proxy::handle(&e, meta, port, req).await
            }
        }
    }
}

/// Starts serving the E2B API; the task ends when `shutdown` fires.
pub async fn listen(
    node: Arc<Node>,
    cfg: E2bConfig,
) -> Result<tokio::task::JoinHandle<()>, ServiceError> {
    let tls = match &cfg.tls {
        Some(files) => Some(tls_acceptor(files)?),
        None => None,
    };
    let key = load_key(&node)?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ServiceError::Io {
            what: format!(
                "listening for the E2B API on {} (choose another with --e2b-listen)",
                cfg.listen
            ),
            source,
        })?;
    tracing::info!(listen = %cfg.listen, tls = cfg.tls.is_some(), domain = ?cfg.domain, "serving the E2B API");
    let state = Arc::new(E2b {
        node,
        cfg,
        key,
        procs: Arc::new(procs::Table::default()),
        watchers: watch::Table::default(),
        cpu_seen: moka::sync::Cache::builder()
            .max_capacity(100_000)
            .time_to_idle(Duration::from_secs(3600))
            .build(),
    });
    // Bodies are bounded where they are read (uploads by max_write_bytes).
    let app = axum::Router::new()
        .fallback(handle)
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(state);
    Ok(tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("E2B API accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let app = app.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let service = hyper_util::service::TowerToHyperService::new(app);
                let builder = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                );
                let result = match tls {
                    Some(acceptor) => match acceptor.accept(tcp).await {
                        Ok(stream) => {
                            builder
                                .serve_connection_with_upgrades(
                                    hyper_util::rt::TokioIo::new(stream),
                                    service,
                                )
                                .await
                        }
                        Err(e) => {
                            tracing::debug!(%peer, "TLS handshake: {e}");
                            return;
                        }
                    },
                    None => {
                        builder
                            .serve_connection_with_upgrades(
                                hyper_util::rt::TokioIo::new(tcp),
                                service,
                            )
                            .await
                    }
                };
                if let Err(e) = result {
                    tracing::debug!(%peer, "E2B connection: {e}");
                }
            });
        }
    }))
}

fn tls_acceptor(files: &TlsFiles) -> Result<tokio_rustls::TlsAcceptor, ServiceError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let bad = |what: &str, path: &PathBuf, e: String| {
        ServiceError::invalid(what, format!("{}: {e} (give a PEM file)", path.display()))
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| bad("e2b-tls-cert", &files.cert, e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| bad("e2b-tls-cert", &files.cert, e.to_string()))?;
    if certs.is_empty() {
        return Err(bad(
            "e2b-tls-cert",
            &files.cert,
            "no certificate in it".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| bad("e2b-tls-key", &files.key, e.to_string()))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::aws_lc_rs::default_provider());
    let mut config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServiceError::Internal(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| bad("e2b-tls-key", &files.key, e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// A response with `body` streamed.
pub(crate) fn streamed(status: StatusCode, content_type: &'static str, body: Body) -> Response {
    (status, [("content-type", content_type)], body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn routes_like_e2bs_proxy() {
        let none = HeaderMap::new();
        assert_eq!(
            route(Some("127.0.0.1:3000"), "/v2/sandboxes", &none, None),
            Route::Api
        );
        assert_eq!(
            route(None, "/sandboxes/n-1/connect", &none, None),
            Route::Api
        );
        // 2.20 sends the sandbox headers on connect: the path wins for envd's port.
        let leaked = headers(&[("e2b-sandbox-id", "n-1"), ("e2b-sandbox-port", "49983")]);
        assert_eq!(
            route(None, "/sandboxes/n-1/connect", &leaked, None),
            Route::Api
        );
        assert_eq!(
            route(None, "/files", &leaked, None),
            Route::Sandbox {
                id: Some("n-1".into()),
                port: ENVD_PORT
            }
        );
        // Only the access token: the sandbox is found by it.
        assert_eq!(
            route(None, "/process.Process/Start", &none, None),
            Route::Sandbox {
                id: None,
                port: ENVD_PORT
            }
        );
        // Another port goes to the sandbox, whatever the path.
        let app = headers(&[("e2b-sandbox-id", "n-1"), ("e2b-sandbox-port", "8000")]);
        assert_eq!(
            route(None, "/sandboxes", &app, None),
            Route::Sandbox {
                id: Some("n-1".into()),
                port: 8000
            }
        );
        // Wildcard DNS.
        let d = Some("strata.test");
        assert_eq!(
            route(Some("api.strata.test"), "/health", &none, d),
            Route::Api
        );
        assert_eq!(
            route(Some("8000-node-abc.strata.test:443"), "/", &none, d),
            Route::Sandbox {
                id: Some("node-abc".into()),
                port: 8000
            }
        );
        assert_eq!(
            route(Some("49983-node-abc.STRATA.test"), "/files", &none, d),
            Route::Sandbox {
                id: Some("node-abc".into()),
                port: ENVD_PORT
            }
        );
        // A host of another domain falls back to the path.
        assert_eq!(
            route(Some("8000-x.other.test"), "/v2/sandboxes", &none, d),
            Route::Api
        );
    }

    #[test]
    fn compares_tokens_whole() {
        assert!(constant_eq("abc", "abc"));
        assert!(!constant_eq("abc", "abd"));
        assert!(!constant_eq("abc", "ab"));
    }
}
