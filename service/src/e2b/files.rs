//! envd's filesystem: the `filesystem.Filesystem` unary calls (Stat, ListDir with depth,
//! MakeDir, Move, Remove) and the `/files` endpoint (download streamed; upload as
//! multipart, raw or gzip), on the sandbox's own file calls. Relative paths are the
//! sandbox's working directory's. Operations the runtime has no call for (make a
//! directory, move, remove) run the sandbox's own `mkdir`, `mv`, `rm`.

use std::collections::HashMap;
use std::io::Read;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Value};
use strata_runtime::{FileEntry, RuntimeError, Sandbox};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::connect::{self, RpcError};
use super::{api_error, blocking, header, E2b};
use crate::error::ServiceError;
use crate::node::run_tool;

/// Entries one ListDir returns at most (a deep listing of `/` is bounded).
const MAX_ENTRIES: usize = 100_000;
/// The most of /etc/passwd or /etc/group read for owner names.
const MAX_NAMES_FILE: usize = 1 << 20;

/// `path` inside the sandbox: absolute as given, relative to its working directory.
pub(super) fn resolve(sb: &Sandbox, path: &str) -> Result<String, RpcError> {
    if path.contains('\0') {
        return Err(RpcError::invalid("path: contains a NUL byte"));
    }
    let p = if path.starts_with('/') {
        path.to_string()
    } else {
        let base = sb.spec().workdir.trim_end_matches('/');
        let rel = path.strip_prefix("~/").unwrap_or(path);
        if rel.is_empty() || rel == "~" || rel == "." {
            base.to_string()
        } else {
            format!("{base}/{rel}")
        }
    };
    // Lexically normal: no `.`, `..` past the root (the sandbox confines the rest).
    let mut parts: Vec<&str> = Vec::new();
    for part in p.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            x => parts.push(x),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

fn path_of(msg: &Value, name: &str) -> Result<String, RpcError> {
    connect::text(msg, name)
        .filter(|p| !p.is_empty())
        .ok_or_else(|| RpcError::invalid(format!("{name}: give a path")))
}

fn split(path: &str) -> (String, String) {
    match path.rsplit_once('/') {
        Some(("", name)) => ("/".into(), name.into()),
        Some((parent, name)) => (parent.into(), name.into()),
        None => ("/".into(), path.into()),
    }
}

/// User and group names from the sandbox's own files (an unknown ID is shown as a number).
#[derive(Default)]
pub(super) struct Names {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl Names {
    pub(super) fn load(sb: &Sandbox) -> Names {
        let read = |path: &str| -> HashMap<u32, String> {
            let mut data = Vec::new();
            let _ = sb.read_file_with(path, &mut |part| {
                if data.len() + part.len() > MAX_NAMES_FILE {
                    return Err(RuntimeError::Invalid("too large".into()));
                }
                data.extend_from_slice(part);
                Ok(())
            });
            String::from_utf8_lossy(&data)
                .lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split(':').collect();
                    Some((f.get(2)?.parse().ok()?, f.first()?.to_string()))
                })
                .collect()
        };
        Names {
            users: read("/etc/passwd"),
            groups: read("/etc/group"),
        }
    }

    fn user(&self, uid: u32) -> String {
        self.users
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }

    fn group(&self, gid: u32) -> String {
        self.groups
            .get(&gid)
            .cloned()
            .unwrap_or_else(|| gid.to_string())
    }
}

/// Go's `FileMode.String()`, as envd reports `permissions`.
fn permissions(kind: &str, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        "dir" => 'd',
        "symlink" => 'L',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn rfc3339(secs: i64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// envd's `EntryInfo` of `e`, found at `path`.
pub(super) fn entry_info(e: &FileEntry, path: &str, names: &Names) -> Value {
    let kind = match e.kind.as_str() {
        "file" => "FILE_TYPE_FILE",
        "dir" => "FILE_TYPE_DIRECTORY",
        "symlink" => "FILE_TYPE_SYMLINK",
        _ => "FILE_TYPE_UNSPECIFIED",
    };
    let mut v = json!({
        "name": e.name,
        "type": kind,
        "path": path,
        "size": e.size.to_string(),
        "mode": e.mode,
        "permissions": permissions(&e.kind, e.mode),
        "owner": names.user(e.uid),
        "group": names.group(e.gid),
        "modifiedTime": rfc3339(e.mtime),
    });
    if let Some(t) = &e.target {
        v["symlinkTarget"] = json!(t);
    }
    v
}

/// The entry at `path`, from its parent's listing; `None` when nothing is there.
pub(super) fn lookup(sb: &Sandbox, path: &str) -> Result<Option<FileEntry>, ServiceError> {
    if path == "/" {
        return Ok(Some(FileEntry {
            name: "/".into(),
            kind: "dir".into(),
            size: 0,
            mode: 0o755,
            mtime: 0,
            uid: 0,
            gid: 0,
            target: None,
        }));
    }
    let (parent, name) = split(path);
    match sb.list_dir(&parent) {
        Ok(list) => Ok(list.into_iter().find(|e| e.name == name)),
        Err(e) if is_missing(&e) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn is_missing(e: &RuntimeError) -> bool {
    match e {
        RuntimeError::NotFound(_) => true,
        RuntimeError::File { source, .. } => matches!(
            source.raw_os_error(),
            Some(libc::ENOENT) | Some(libc::ENOTDIR)
        ),
        _ => e.to_string().contains("No such file"),
    }
}

fn not_found(path: &str) -> RpcError {
    RpcError::not_found(format!("{path}: no such file or directory in the sandbox"))
}

pub(super) async fn stat(sb: Sandbox, msg: &Value) -> Result<Value, RpcError> {
    let path = resolve(&sb, &path_of(msg, "path")?)?;
    blocking(move || {
        let found = lookup(&sb, &path)?;
        Ok(found.map(|e| json!({"entry": entry_info(&e, &path, &Names::load(&sb))})))
    })
    .await?
    .ok_or_else(|| not_found(&connect::text(msg, "path").unwrap_or_default()))
}

pub(super) async fn list_dir(sb: Sandbox, msg: &Value) -> Result<Value, RpcError> {
    let path = resolve(&sb, &path_of(msg, "path")?)?;
    let depth = connect::int(msg.get("depth")).unwrap_or(1).clamp(1, 64) as usize;
    let entries =
        blocking(
            move || -> Result<Result<Vec<Value>, RpcError>, ServiceError> {
                match lookup(&sb, &path)? {
                    None => return Ok(Err(not_found(&path))),
                    Some(e) if e.kind != "dir" => {
                        return Ok(Err(RpcError::invalid(format!("{path} is not a directory"))))
                    }
                    Some(_) => {}
                }
                let names = Names::load(&sb);
                let mut out = Vec::new();
                let mut level = vec![path];
                for _ in 0..depth {
                    let mut next = Vec::new();
                    for dir in level {
                        let list = match sb.list_dir(&dir) {
                            Ok(l) => l,
                            // A directory that went away meanwhile, or one it may not read.
                            Err(_) => continue,
                        };
                        for e in list {
                            let p = if dir == "/" {
                                format!("/{}", e.name)
                            } else {
                                format!("{dir}/{}", e.name)
                            };
                            if out.len() >= MAX_ENTRIES {
                                return Ok(Err(RpcError::new(
                            "resource_exhausted",
                            format!("more than {MAX_ENTRIES} entries: list with a smaller depth"),
                        )));
                            }
                            out.push(entry_info(&e, &p, &names));
                            if e.kind == "dir" {
                                next.push(p);
                            }
                        }
                    }
                    level = next;
                }
                Ok(Ok(out))
            },
        )
        .await??;
    Ok(json!({"entries": entries}))
}

pub(super) async fn make_dir(sb: Sandbox, msg: &Value) -> Result<Value, RpcError> {
    let path = resolve(&sb, &path_of(msg, "path")?)?;
    blocking(move || -> Result<Result<Value, RpcError>, ServiceError> {
        if lookup(&sb, &path)?.is_some() {
            return Ok(Err(RpcError::new(
                "already_exists",
                format!("{path} already exists"),
            )));
        }
        run_tool(
            &sb,
            vec!["mkdir".into(), "-p".into(), "--".into(), path.clone()],
            &format!("making {path}"),
        )?;
        let e = lookup(&sb, &path)?.ok_or_else(|| ServiceError::NotFound(path.clone()))?;
        Ok(Ok(
            json!({"entry": entry_info(&e, &path, &Names::load(&sb))}),
        ))
    })
    .await?
}

pub(super) async fn rename(sb: Sandbox, msg: &Value) -> Result<Value, RpcError> {
    let from = resolve(&sb, &path_of(msg, "source")?)?;
    let to = resolve(&sb, &path_of(msg, "destination")?)?;
    blocking(move || -> Result<Result<Value, RpcError>, ServiceError> {
        if lookup(&sb, &from)?.is_none() {
            return Ok(Err(not_found(&from)));
        }
        run_tool(
            &sb,
            vec![
                "mv".into(),
                "-T".into(),
                "--".into(),
                from.clone(),
                to.clone(),
            ],
            &format!("moving {from} to {to}"),
        )?;
        let e = lookup(&sb, &to)?.ok_or_else(|| ServiceError::NotFound(to.clone()))?;
        Ok(Ok(json!({"entry": entry_info(&e, &to, &Names::load(&sb))})))
    })
    .await?
}

pub(super) async fn remove(sb: Sandbox, msg: &Value) -> Result<Value, RpcError> {
    let path = resolve(&sb, &path_of(msg, "path")?)?;
    if path == "/" {
        return Err(RpcError::invalid(
            "path: will not remove the sandbox's root",
        ));
    }
    blocking(move || -> Result<Result<Value, RpcError>, ServiceError> {
        if lookup(&sb, &path)?.is_none() {
            return Ok(Err(not_found(&path)));
        }
        run_tool(
            &sb,
            vec!["rm".into(), "-rf".into(), "--".into(), path.clone()],
            &format!("removing {path}"),
        )?;
        Ok(Ok(json!({})))
    })
    .await?
}

fn query(req: &Request) -> HashMap<String, String> {
    serde_urlencoded::from_str::<Vec<(String, String)>>(req.uri().query().unwrap_or(""))
        .unwrap_or_default()
        .into_iter()
        .collect()
}

fn file_error(e: RpcError) -> Response {
    let status = match e.code {
        "not_found" => StatusCode::NOT_FOUND,
        "invalid_argument" => StatusCode::BAD_REQUEST,
        "resource_exhausted" => StatusCode::INSUFFICIENT_STORAGE,
        "unauthenticated" => StatusCode::UNAUTHORIZED,
        _ => e.http_status(),
    };
    api_error(status, e.message)
}

/// `GET /files?path=`: the file's bytes, streamed in parts as the sandbox reads them.
pub(super) async fn download(sb: Sandbox, req: Request) -> Response {
    let q = query(&req);
    let Some(raw) = q.get("path").filter(|p| !p.is_empty()) else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "path: give the file to download (?path=)",
        );
    };
    let path = match resolve(&sb, raw) {
        Ok(p) => p,
        Err(e) => return file_error(e),
    };
    let (tx, mut rx) = mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(4);
    tokio::task::spawn_blocking(move || {
        match lookup(&sb, &path) {
            Ok(Some(e)) if e.kind == "dir" => {
                let _ = tx.blocking_send(Err(std::io::Error::other(format!(
                    "400:{path} is a directory"
                ))));
                return;
            }
            Ok(None) => {
                let _ = tx.blocking_send(Err(std::io::Error::other(format!(
                    "404:{path}: no such file in the sandbox"
                ))));
                return;
            }
            _ => {}
        }
        let mut sink = |part: &[u8]| {
            tx.blocking_send(Ok(bytes::Bytes::copy_from_slice(part)))
                .map_err(|_| RuntimeError::Invalid("the client went away".into()))
        };
        if let Err(e) = sb.read_file_with(&path, &mut sink) {
            let code = if is_missing(&e) { 404 } else { 500 };
            let _ = tx.blocking_send(Err(std::io::Error::other(format!("{code}:{e}"))));
        }
    });
    // An error before any data answers the request; a later one cuts the body short.
    let head = match rx.recv().await {
        Some(Err(e)) => {
            let text = e.to_string();
            let (code, msg) = text.split_once(':').unwrap_or(("500", &text));
            let status = code
                .parse()
                .ok()
                .and_then(|c| StatusCode::from_u16(c).ok())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return api_error(status, msg);
        }
        Some(Ok(b)) => vec![Ok(b)],
        None => vec![],
    };
    let body = futures::stream::iter(head).chain(ReceiverStream::new(rx));
    (
        StatusCode::OK,
        [("content-type", "application/octet-stream")],
        Body::from_stream(body),
    )
        .into_response()
}

/// One file of an upload.
struct Upload {
    path: String,
    data: Vec<u8>,
}

/// `POST /files`: multipart (one part a file, each named by `?path=` or its filename), or
/// the raw bytes of one file (`application/octet-stream`, gzip-encoded or not).
pub(super) async fn upload(e: &Arc<E2b>, sb: Sandbox, req: Request) -> Response {
    let max = e.node.config().max_write_bytes;
    let q = query(&req);
    let query_path = q.get("path").filter(|p| !p.is_empty()).cloned();
    let content_type = header(req.headers(), "content-type")
        .unwrap_or("")
        .to_string();
    let gzip = header(req.headers(), "content-encoding").is_some_and(|c| c.contains("gzip"));
    let too_big = || {
        api_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "a file over this node's limit of {} MiB for one write (max_write_bytes)",
                max >> 20
            ),
        )
    };
    let mut uploads = Vec::new();
    if content_type.starts_with("multipart/form-data") {
        let mut form = match axum::extract::Multipart::from_request(req, &()).await {
            Ok(f) => f,
            Err(err) => return api_error(StatusCode::BAD_REQUEST, format!("multipart: {err}")),
        };
        loop {
            let mut field = match form.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(err) => return api_error(StatusCode::BAD_REQUEST, format!("multipart: {err}")),
            };
            let name = query_path
                .clone()
                .or_else(|| field.file_name().map(str::to_string))
                .filter(|p| !p.is_empty());
            let Some(name) = name else {
                return api_error(
                    StatusCode::BAD_REQUEST,
                    "path: give ?path= or a filename on each part",
                );
            };
            let mut data = Vec::new();
            loop {
                match field.chunk().await {
                    Ok(Some(c)) if data.len() + c.len() <= max => data.extend_from_slice(&c),
                    Ok(Some(_)) => return too_big(),
                    Ok(None) => break,
                    Err(err) => {
                        return api_error(StatusCode::BAD_REQUEST, format!("multipart: {err}"))
                    }
                }
            }
            uploads.push(Upload { path: name, data });
        }
    } else {
        let Some(name) = query_path else {
            return api_error(
                StatusCode::BAD_REQUEST,
                "path: give the file to write (?path=)",
            );
        };
        let mut body = req.into_body().into_data_stream();
        let mut data = Vec::new();
        // A compressed body is bounded too, before and after decoding.
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(c) if data.len() + c.len() <= max => data.extend_from_slice(&c),
                Ok(_) => return too_big(),
                Err(err) => return api_error(StatusCode::BAD_REQUEST, format!("the body: {err}")),
            }
        }
        if gzip {
            let mut out = Vec::new();
            let mut dec = flate2::read::GzDecoder::new(&data[..]).take(max as u64 + 1);
            if let Err(err) = dec.read_to_end(&mut out) {
                return api_error(StatusCode::BAD_REQUEST, format!("the gzip body: {err}"));
            }
            if out.len() > max {
                return too_big();
            }
            data = out;
        }
        uploads.push(Upload { path: name, data });
    }
    if uploads.is_empty() {
        return api_error(StatusCode::BAD_REQUEST, "no file in the upload");
    }
    let written = blocking(
        move || -> Result<Result<Vec<Value>, RpcError>, ServiceError> {
            let mut out = Vec::new();
            for u in uploads {
                let path = match resolve(&sb, &u.path) {
                    Ok(p) => p,
                    Err(e) => return Ok(Err(e)),
                };
                if let Err(e) = sb.write_file(&path, &u.data, 0o644) {
                    let full = matches!(&e, RuntimeError::File { source, .. }
                    if matches!(source.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT)));
                    return Ok(Err(if full {
                        RpcError::new(
                            "resource_exhausted",
                            format!("{path}: the sandbox's disk budget is full"),
                        )
                    } else {
                        RpcError::from(ServiceError::from(e))
                    }));
                }
                let name = split(&path).1;
                out.push(json!({"path": path, "name": name, "type": "file"}));
            }
            Ok(Ok(out))
        },
    )
    .await;
    match written {
        Ok(Ok(list)) => (
            StatusCode::OK,
            [("content-type", "application/json")],
            Value::Array(list).to_string(),
        )
            .into_response(),
        Ok(Err(e)) => file_error(e),
        Err(e) => super::error_response(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permissions_read_like_go() {
        assert_eq!(permissions("file", 0o644), "-rw-r--r--");
        assert_eq!(permissions("dir", 0o755), "drwxr-xr-x");
        assert_eq!(permissions("symlink", 0o777), "Lrwxrwxrwx");
    }

    #[test]
    fn splits_paths() {
        assert_eq!(split("/a"), ("/".into(), "a".into()));
        assert_eq!(split("/a/b/c"), ("/a/b".into(), "c".into()));
    }
}
