//! envd, served on the host side: `/health`, `/files`, and the Connect RPC services
//! `process.Process` and `filesystem.Filesystem`, each call on the runtime's `Sandbox`
//! of the sandbox the router found (its access token already checked).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Value};
use strata_runtime::Sandbox;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::connect::{self, field, int, RpcError, STREAM_CONTENT_TYPE};
use super::procs::{EndInfo, ProcConfig, ProcEvent, Start};
use super::{api_error, files, header, watch, E2b};
use crate::error::ServiceError;
use crate::state::Meta;

/// The keepalive interval when a client asks for none (envd's default).
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);

fn is_rpc(path: &str) -> bool {
    path.starts_with("/process.Process/") || path.starts_with("/filesystem.Filesystem/")
}

/// The answer to a call without the sandbox's access token.
pub(super) fn unauthenticated(path: &str) -> Response {
    let msg = "missing or wrong X-Access-Token: use the envdAccessToken the create or connect call returned";
    if is_rpc(path) {
        RpcError::new("unauthenticated", msg).unary()
    } else {
        api_error(StatusCode::UNAUTHORIZED, msg)
    }
}

/// A 200 `application/connect+json` reply whose frames come from `rx`.
pub(super) fn stream_reply(rx: mpsc::Receiver<Result<Bytes, Infallible>>) -> Response {
    super::streamed(
        StatusCode::OK,
        STREAM_CONTENT_TYPE,
        Body::from_stream(ReceiverStream::new(rx)),
    )
}

/// A stream that fails before its first message: the error rides in the end frame.
pub(super) fn stream_error(e: RpcError) -> Response {
    super::streamed(
        StatusCode::OK,
        STREAM_CONTENT_TYPE,
        Body::from(connect::end_frame(Some(&e))),
    )
}

pub(super) async fn handle(e: &Arc<E2b>, meta: Meta, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    if meta.paused || meta.hibernated {
        let msg = format!(
            "sandbox {} is paused: connect to it (Sandbox.connect) to resume it",
            meta.id
        );
        return if is_rpc(&path) {
            RpcError::new("unavailable", msg).unary()
        } else {
            api_error(StatusCode::BAD_GATEWAY, msg)
        };
    }
    let sb = match e.node.running(&meta).await {
        Ok(sb) => sb,
        // Ended between the record's lookup and now (its TTL, a destroy): as if it had
        // not been found (e2b 2.20's `is_running()` raises on anything but that 502).
        Err(ServiceError::NotFound(_)) => return super::sandbox_not_found(&meta.id),
        Err(err) => {
            return if is_rpc(&path) {
                RpcError::from(err).unary()
            } else {
                super::error_response(&err)
            }
        }
    };
    match (method, path.as_str()) {
        (Method::GET, "/health") => StatusCode::NO_CONTENT.into_response(),
        (Method::GET, "/files") => files::download(sb, req).await,
        (Method::POST, "/files") => files::upload(e, sb, req).await,
        (Method::POST, p) if is_rpc(p) => rpc(e, meta, sb, &path, req).await,
        (_, p) => api_error(
            StatusCode::NOT_FOUND,
            format!("envd has no {p}: the RPCs are POST /process.Process/* and /filesystem.Filesystem/*"),
        ),
    }
}

/// A client-stream's messages as they arrive.
async fn next_message(
    body: &mut (impl futures::Stream<Item = Result<Bytes, axum::Error>> + Unpin),
    de: &mut connect::Deframer,
) -> Result<Option<Value>, RpcError> {
    loop {
        if let Some(v) = de.next_message()? {
            return Ok(Some(v));
        }
        match body.next().await {
            Some(Ok(chunk)) => de.push(&chunk),
            Some(Err(e)) => {
                return Err(RpcError::new("canceled", format!("the request body: {e}")))
            }
            None if de.pending() => {
                return Err(RpcError::invalid("the request ended inside a message"))
            }
            None => return Ok(None),
        }
    }
}

async fn rpc(e: &Arc<E2b>, meta: Meta, sb: Sandbox, path: &str, req: Request) -> Response {
    let streaming =
        header(req.headers(), "content-type").is_some_and(|t| t.starts_with(STREAM_CONTENT_TYPE));
    let timeout = header(req.headers(), "connect-timeout-ms")
        .and_then(|t| t.parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis);
    let keepalive = header(req.headers(), "keepalive-ping-interval")
        .and_then(|t| t.parse::<u64>().ok())
        .map(|s| Duration::from_secs(s.clamp(1, 600)))
        .unwrap_or(DEFAULT_KEEPALIVE);
    let method = path.rsplit('/').next().unwrap_or_default().to_string();
    let mut body = req.into_body().into_data_stream();
    if method == "StreamInput" {
        return stream_input(e, &meta, &mut body).await;
    }
    // Every other call sends one message: a unary body, or one enveloped message.
    let mut raw = Vec::new();
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(c) if raw.len() + c.len() <= connect::MAX_MESSAGE + 5 => raw.extend_from_slice(&c),
            Ok(_) => {
                let err = RpcError::new("resource_exhausted", "the request is over 4 MiB");
                return if streaming {
                    stream_error(err)
                } else {
                    err.unary()
                };
            }
            Err(err) => return RpcError::new("canceled", err.to_string()).unary(),
        }
    }
    let msg = if streaming {
        let mut de = connect::Deframer::default();
        de.push(&raw);
        de.next_message().map(|m| m.unwrap_or_else(|| json!({})))
    } else if raw.iter().all(u8::is_ascii_whitespace) {
        Ok(json!({}))
    } else {
        serde_json::from_slice(&raw)
            .map_err(|err| RpcError::invalid(format!("the request is not JSON: {err}")))
    };
    let msg = match msg {
        Ok(m) => m,
        Err(err) => {
            return if streaming {
                stream_error(err)
            } else {
                err.unary()
            }
        }
    };
    let out = match method.as_str() {
        "Start" => return start(e, &meta, sb, &msg, timeout, keepalive),
        "Connect" => return attach(e, &meta, &msg, keepalive),
        "WatchDir" => return watch::watch_dir(sb, &msg, keepalive).await,
        "List" => Ok(list(e, &meta)),
        "SendInput" => send_input(e, &meta, &msg).await,
        "SendSignal" => select(e, &meta, &msg).map(|p| {
            p.kill();
            json!({})
        }),
        "CloseStdin" => select(e, &meta, &msg).map(|p| {
            p.close_stdin();
            json!({})
        }),
        "Update" => Err(RpcError::new(
            "unimplemented",
            "PTY sessions are not supported by Strata's envd; run commands without a PTY",
        )),
        "Stat" => files::stat(sb, &msg).await,
        "ListDir" => files::list_dir(sb, &msg).await,
        "MakeDir" => files::make_dir(sb, &msg).await,
        "Move" => files::rename(sb, &msg).await,
        "Remove" => files::remove(sb, &msg).await,
        "CreateWatcher" => watch::create(e, &meta, sb, &msg).await,
        "GetWatcherEvents" => watch::events(e, &meta, &msg),
        "RemoveWatcher" => watch::remove(e, &meta, &msg),
        other => Err(RpcError::new(
            "unimplemented",
            format!("envd has no method {other}"),
        )),
    };
    match out {
        Ok(v) if streaming => {
            let body = [connect::frame(&v), connect::end_frame(None)].concat();
            super::streamed(StatusCode::OK, STREAM_CONTENT_TYPE, Body::from(body))
        }
        Ok(v) => connect::unary_ok(v),
        Err(err) if streaming => stream_error(err),
        Err(err) => err.unary(),
    }
}

/// The process a request's `process` selector names.
fn select(e: &E2b, meta: &Meta, msg: &Value) -> Result<Arc<super::procs::Proc>, RpcError> {
    let sel = field(msg, "process", "process")
        .ok_or_else(|| RpcError::invalid("process: select the process by pid or tag"))?;
    let pid = int(sel.get("pid")).and_then(|p| u32::try_from(p).ok());
    let tag = sel.get("tag").and_then(Value::as_str);
    e.procs.find(&meta.local, pid, tag)
}

fn start(
    e: &Arc<E2b>,
    meta: &Meta,
    sb: Sandbox,
    msg: &Value,
    timeout: Option<Duration>,
    keepalive: Duration,
) -> Response {
    let Some(process) = field(msg, "process", "process") else {
        return stream_error(RpcError::invalid("process: give the command to start"));
    };
    if field(msg, "pty", "pty").is_some() {
        return stream_error(RpcError::new(
            "unimplemented",
            "PTY sessions are not supported by Strata's envd; run the command without a PTY",
        ));
    }
    let Some(cmd) = connect::text(process, "cmd").filter(|c| !c.is_empty()) else {
        return stream_error(RpcError::invalid("process.cmd: give the program to run"));
    };
    let args = process
        .get("args")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let config = ProcConfig {
        cmd,
        args,
        envs: connect::string_map(process.get("envs")),
        cwd: connect::text(process, "cwd").filter(|c| !c.is_empty()),
    };
    let start = Start {
        config,
        tag: connect::text(msg, "tag"),
        // Unset means open (older SDKs, PTYs).
        stdin: connect::boolean(msg.get("stdin")).unwrap_or(true),
        timeout,
    };
    let node = e.node.clone();
    let backend = meta.backend;
    let began = Instant::now();
    let started = e.procs.start(&meta.local, sb, start, move |_| {
        node.metrics.observe_exec(backend.as_str(), began.elapsed());
    });
    match started {
        Ok((proc, events)) => stream_events(proc.pid, events, keepalive),
        Err(err) => stream_error(err),
    }
}

fn attach(e: &Arc<E2b>, meta: &Meta, msg: &Value, keepalive: Duration) -> Response {
    match select(e, meta, msg) {
        Ok(proc) => stream_events(proc.pid, proc.subscribe(), keepalive),
        Err(err) => stream_error(err),
    }
}

/// `start` at once, then output, keepalives while idle, the end, and the end frame.
fn stream_events(pid: u32, mut events: mpsc::Receiver<ProcEvent>, keepalive: Duration) -> Response {
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(Ok(connect::frame(&v))).await.is_ok() }
        };
        if !send(json!({"event": {"start": {"pid": pid}}})).await {
            return;
        }
        let idle = tokio::time::sleep(keepalive);
        tokio::pin!(idle);
        loop {
            tokio::select! {
                ev = events.recv() => {
                    let ok = match ev {
                        Some(ProcEvent::Stdout(b)) => {
                            send(json!({"event": {"data": {"stdout": connect::b64(&b)}}})).await
                        }
                        Some(ProcEvent::Stderr(b)) => {
                            send(json!({"event": {"data": {"stderr": connect::b64(&b)}}})).await
                        }
                        Some(ProcEvent::End(end)) => {
                            let _ = send(json!({"event": {"end": end_json(&end)}})).await;
                            let _ = tx.send(Ok(connect::end_frame(None))).await;
                            return;
                        }
                        None => {
                            let err = RpcError::new("internal", "lost the process's output");
                            let _ = tx.send(Ok(connect::end_frame(Some(&err)))).await;
                            return;
                        }
                    };
                    if !ok {
                        // The client went away: dropping `events` unsubscribes.
                        return;
                    }
                    idle.as_mut().reset(tokio::time::Instant::now() + keepalive);
                }
                _ = &mut idle => {
                    if !send(json!({"event": {"keepalive": {}}})).await {
                        return;
                    }
                    idle.as_mut().reset(tokio::time::Instant::now() + keepalive);
                }
            }
        }
    });
    stream_reply(rx)
}

/// proto3 JSON leaves zero values out: `exitCode` 0 and `exited` false are absent.
fn end_json(end: &EndInfo) -> Value {
    let mut v = serde_json::Map::new();
    if end.exit_code != 0 {
        v.insert("exitCode".into(), json!(end.exit_code));
    }
    if end.exited {
        v.insert("exited".into(), json!(true));
    }
    v.insert("status".into(), json!(end.status));
    if let Some(err) = &end.error {
        v.insert("error".into(), json!(err));
    }
    Value::Object(v)
}

fn list(e: &E2b, meta: &Meta) -> Value {
    let procs: Vec<Value> = e
        .procs
        .list(&meta.local)
        .iter()
        .map(|p| {
            let mut config =
                json!({"cmd": p.config.cmd, "args": p.config.args, "envs": p.config.envs});
            if let Some(cwd) = &p.config.cwd {
                config["cwd"] = json!(cwd);
            }
            let mut v = json!({"pid": p.pid, "config": config});
            if let Some(tag) = &p.tag {
                v["tag"] = json!(tag);
            }
            v
        })
        .collect();
    json!({"processes": procs})
}

fn input_bytes(input: Option<&Value>) -> Result<Vec<u8>, RpcError> {
    let input = input.ok_or_else(|| RpcError::invalid("input: give stdin bytes"))?;
    if input.get("pty").is_some() {
        return Err(RpcError::new(
            "unimplemented",
            "PTY input: PTY sessions are not supported by Strata's envd",
        ));
    }
    connect::bytes_field(input.get("stdin"))
}

async fn send_input(e: &E2b, meta: &Meta, msg: &Value) -> Result<Value, RpcError> {
    let proc = select(e, meta, msg)?;
    let data = input_bytes(msg.get("input"))?;
    if !data.is_empty() {
        proc.send_input(data).await?;
    }
    Ok(json!({}))
}

/// `StreamInput`: `start` naming the process, then `data` messages for its stdin.
async fn stream_input(
    e: &E2b,
    meta: &Meta,
    body: &mut (impl futures::Stream<Item = Result<Bytes, axum::Error>> + Unpin),
) -> Response {
    let mut de = connect::Deframer::default();
    let mut proc = None;
    let result: Result<(), RpcError> = async {
        while let Some(msg) = next_message(body, &mut de).await? {
            if let Some(start) = field(&msg, "start", "start") {
                proc = Some(select(e, meta, start)?);
            } else if let Some(data) = field(&msg, "data", "data") {
                let p = proc
                    .as_ref()
                    .ok_or_else(|| RpcError::invalid("StreamInput: send `start` first"))?;
                let bytes = input_bytes(data.get("input"))?;
                if !bytes.is_empty() {
                    p.send_input(bytes).await?;
                }
            }
        }
        Ok(())
    }
    .await;
    match result {
        Ok(()) => {
            let body = [connect::frame(&json!({})), connect::end_frame(None)].concat();
            super::streamed(StatusCode::OK, STREAM_CONTENT_TYPE, Body::from(body))
        }
        Err(err) => stream_error(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_events_leave_zeros_out() {
        let ok = end_json(&EndInfo {
            exit_code: 0,
            exited: true,
            status: "exit status 0".into(),
            error: None,
        });
        assert_eq!(ok, json!({"exited": true, "status": "exit status 0"}));
        let killed = end_json(&EndInfo {
            exit_code: -1,
            exited: false,
            status: "signal: killed".into(),
            error: None,
        });
        assert_eq!(killed, json!({"exitCode": -1, "status": "signal: killed"}));
    }
}
