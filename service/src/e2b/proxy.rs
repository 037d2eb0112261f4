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
    if meta.paused {
        return api_error(
            StatusCode::BAD_GATEWAY,
            format!("sandbox {} is paused: connect to it to resume it", meta.id),
        );
    }
    let node = e.node.clone();
    let m = meta.clone();
    let tcp = blocking(move || {
        let sb = node.sandbox(&m)?;
        Ok(sb.connect_port(port)?)
    })
    .await;
    let tcp = match tcp {
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
    let stream = match tcp
        .set_nonblocking(true)
        .and_then(|()| tokio::net::TcpStream::from_std(tcp))
    {
        Ok(s) => s,
        Err(err) => return api_error(StatusCode::BAD_GATEWAY, format!("port {port}: {err}")),
    };
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await {
            Ok(c) => c,
            Err(err) => return api_error(StatusCode::BAD_GATEWAY, format!("port {port}: {err}")),
        };
    tokio::spawn(async move {
        if let Err(err) = conn.await {
            tracing::debug!("proxied connection: {err}");
        }
    });
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
