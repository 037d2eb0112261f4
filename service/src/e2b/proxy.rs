//! Other ports of a sandbox (`get_host(port)`: a web server, a code interpreter an agent
//! or a template started inside): each request is forwarded over HTTP/1.1 to the port on
//! the sandbox's own loopback, through a connection the runtime makes from inside its
//! network namespace, when the sandbox was created to take inbound traffic; refused
//! otherwise. The response streams back as the sandbox sends it.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};

use strata_runtime::PortStream;
use tokio::io::{AsyncRead, AsyncWrite};

use super::{api_error, blocking, E2b};
use crate::state::Meta;

/// Headers of one hop, not forwarded (RFC 9110 §7.6.1), and E2B's routing headers.
const HOP: [&str; 11] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
    "x-access-token",
    "e2b-traffic-access-token",
];

pub(super) async fn handle(e: &Arc<E2b>, meta: Meta, port: u16, req: Request) -> Response {
    if !meta.inbound {
        return api_error(
            StatusCode::FORBIDDEN,
            format!(
                "sandbox {} takes no inbound traffic: create it with network.allowPublicTraffic=true to reach its port {port}",
                meta.id
            ),
        );
    }
    if meta.paused || meta.hibernated {
        return api_error(
            StatusCode::BAD_GATEWAY,
            format!("sandbox {} is paused: connect to it to resume it", meta.id),
        );
    }
    let node = e.node.clone();
    let m = meta.clone();
    let conn = blocking(move || {
        let sb = node.sandbox(&m)?;
        Ok(sb.connect_port(port)?)
    })
    .await;
    let conn = match conn {
        Ok(t) => t,
        Err(err) => {
            // The phrase the SDK maps to "sandbox unreachable".
            let body = serde_json::json!({"sandboxId": meta.id, "port": port,
                "message": format!("The sandbox is running but port is not open ({err})"), "code": 502});
            return (
                StatusCode::BAD_GATEWAY,
                [("content-type", "application/json")],
                body.to_string(),
            )
                .into_response();
        }
    };
    let sender = match conn {
        PortStream::Tcp(s) => {
            handshake(
                port,
                s.set_nonblocking(true)
                    .and_then(|()| tokio::net::TcpStream::from_std(s)),
            )
            .await
        }
        PortStream::Relayed(s) => {
            handshake(
                port,
                s.set_nonblocking(true)
                    .and_then(|()| tokio::net::UnixStream::from_std(s)),
            )
            .await
        }
    };
    let mut sender = match sender {
        Ok(s) => s,
        Err(r) => return r,
    };
    let (mut parts, body) = req.into_parts();
    for h in HOP {
        parts.headers.remove(HeaderName::from_static(h));
    }
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    parts.uri = match path.parse() {
        Ok(u) => u,
        Err(_) => return api_error(StatusCode::BAD_REQUEST, "a path that cannot be forwarded"),
    };
    parts.version = axum::http::Version::HTTP_11;
    if !parts.headers.contains_key("host") {
        // HTTP/2 carries the authority apart; HTTP/1.1 needs it as a header.
        if let Ok(v) = format!("localhost:{port}").parse() {
            parts.headers.insert("host", v);
        }
    }
    match sender.send_request(Request::from_parts(parts, body)).await {
        Ok(resp) => resp.map(Body::new),
        Err(err) => api_error(StatusCode::BAD_GATEWAY, format!("port {port}: {err}")),
    }
}

/// An HTTP/1.1 client connection over `stream`, driven on a task of its own.
async fn handshake<S>(
    port: u16,
    stream: std::io::Result<S>,
) -> Result<hyper::client::conn::http1::SendRequest<Body>, Response>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let bad = |err: &dyn std::fmt::Display| {
        api_error(StatusCode::BAD_GATEWAY, format!("port {port}: {err}"))
    };
    let stream = stream.map_err(|e| bad(&e))?;
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| bad(&e))?;
    tokio::spawn(async move {
        if let Err(err) = conn.await {
            tracing::debug!("proxied connection: {err}");
        }
    });
    Ok(sender)
}
