//! envd's directory watchers: `WatchDir` (a stream, the async SDK) and the polling trio
//! `CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher` (the sync SDK). The sandbox's
//! kernel is not ours to ask for inotify on every backend, so a watcher compares
//! listings of the directory (and, recursive, what is below it, bounded) every
//! [`POLL`]: what appeared is a create, what went a remove, a changed size or time a
//! write, a changed mode a chmod. A watcher ends with its sandbox.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use strata_runtime::Sandbox;
use tokio::sync::mpsc;

use super::connect::{self, field, RpcError};
use super::envd::{stream_error, stream_reply};
use super::files::{lookup, resolve};
use super::{blocking, E2b};
use crate::state::Meta;

const POLL: Duration = Duration::from_millis(200);
/// Entries one watcher follows at most.
const MAX_WATCHED: usize = 20_000;
/// Events a polling watcher keeps until they are fetched (the oldest go first).
const MAX_QUEUED: usize = 10_000;
/// Polling watchers one sandbox may have.
const MAX_PER_SANDBOX: usize = 32;

#[derive(Debug, Clone, PartialEq)]
struct Seen {
    kind: String,
    size: u64,
    mtime: i64,
    mode: u32,
}

type Listing = BTreeMap<String, Seen>;

/// The directory's entries (relative names), descending when `recursive`.
fn snapshot(sb: &Sandbox, root: &str, recursive: bool) -> Option<Listing> {
    let mut out = Listing::new();
    let mut dirs = vec![(root.to_string(), String::new())];
    let mut first = true;
    while let Some((dir, rel)) = dirs.pop() {
        let list = match sb.list_dir(&dir) {
            Ok(l) => l,
            // The watched directory itself gone: the watch ends.
            Err(_) if first => return None,
            Err(_) => continue,
        };
        first = false;
        for e in list {
            if out.len() >= MAX_WATCHED {
                return Some(out);
            }
            let name = if rel.is_empty() {
                e.name.clone()
            } else {
                format!("{rel}/{}", e.name)
            };
            if recursive && e.kind == "dir" {
                dirs.push((
                    format!("{}/{}", dir.trim_end_matches('/'), e.name),
                    name.clone(),
                ));
            }
            out.insert(
                name,
                Seen {
                    kind: e.kind,
                    size: e.size,
                    mtime: e.mtime,
                    mode: e.mode,
                },
            );
        }
    }
    Some(out)
}

/// envd's events between two listings.
fn diff(before: &Listing, after: &Listing) -> Vec<Value> {
    let event = |name: &str, kind: &str| json!({"name": name, "type": kind});
    let mut out = Vec::new();
    for (name, seen) in after {
        match before.get(name) {
            None => out.push(event(name, "EVENT_TYPE_CREATE")),
            Some(old) if old.kind != seen.kind => {
                out.push(event(name, "EVENT_TYPE_REMOVE"));
                out.push(event(name, "EVENT_TYPE_CREATE"));
            }
            Some(old) => {
                if old.size != seen.size || old.mtime != seen.mtime {
                    out.push(event(name, "EVENT_TYPE_WRITE"));
                }
                if old.mode != seen.mode {
                    out.push(event(name, "EVENT_TYPE_CHMOD"));
                }
            }
        }
    }
    for name in before.keys() {
        if !after.contains_key(name) {
            out.push(event(name, "EVENT_TYPE_REMOVE"));
        }
    }
    out
}

/// Checks the path is a directory and takes its first listing.
async fn begin(sb: &Sandbox, msg: &Value) -> Result<(String, bool, Listing), RpcError> {
    let raw = connect::text(msg, "path").unwrap_or_default();
    if raw.is_empty() {
        return Err(RpcError::invalid("path: give the directory to watch"));
    }
    let path = resolve(sb, &raw)?;
    let recursive = connect::boolean(msg.get("recursive")).unwrap_or(false);
    let s = sb.clone();
    let p = path.clone();
    let first = blocking(move || {
        Ok(match lookup(&s, &p)? {
            Some(e) if e.kind == "dir" => snapshot(&s, &p, recursive),
            _ => None,
        })
    })
    .await?;
    let first = first
        .ok_or_else(|| RpcError::not_found(format!("{path}: no such directory in the sandbox")))?;
    Ok((path, recursive, first))
}

/// Polls until `emit` refuses more (its consumer is gone) or the directory goes.
async fn poll(
    sb: Sandbox,
    path: String,
    recursive: bool,
    mut last: Listing,
    mut emit: impl FnMut(Vec<Value>) -> bool,
) {
    loop {
        tokio::time::sleep(POLL).await;
        let (s, p) = (sb.clone(), path.clone());
        let now = match blocking(move || Ok(snapshot(&s, &p, recursive))).await {
            Ok(Some(l)) => l,
            _ => return,
        };
        let events = diff(&last, &now);
        last = now;
        if !emit(events) {
            return;
        }
    }
}

/// `WatchDir`: `start`, then each change as it is seen, keepalives while quiet.
pub(super) async fn watch_dir(
    sb: Sandbox,
    msg: &Value,
    keepalive: Duration,
) -> axum::response::Response {
    let (path, recursive, first) = match begin(&sb, msg).await {
        Ok(b) => b,
        Err(err) => return stream_error(err),
    };
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let start = connect::frame(&json!({"event": {"start": {}}}));
        if tx.send(Ok(start)).await.is_err() {
            return;
        }
        let (ev_tx, mut ev_rx) = mpsc::channel::<Vec<Value>>(16);
        let poller = tokio::spawn(poll(sb, path, recursive, first, move |events| {
            ev_tx.try_send(events).is_ok() || !ev_tx.is_closed()
        }));
        loop {
            tokio::select! {
                got = ev_rx.recv() => {
                    let Some(events) = got else {
                        let err = RpcError::not_found("the watched directory is gone");
                        let _ = tx.send(Ok(connect::end_frame(Some(&err)))).await;
                        break;
                    };
                    let mut ok = true;
                    for ev in events {
                        let f = connect::frame(&json!({"event": {"filesystem": ev}}));
                        if tx.send(Ok(f)).await.is_err() {
                            ok = false;
                            break;
                        }
                    }
                    if !ok {
                        break;
                    }
                }
                _ = tokio::time::sleep(keepalive) => {
                    let f = connect::frame(&json!({"event": {"keepalive": {}}}));
                    if tx.send(Ok(f)).await.is_err() {
                        break;
                    }
                }
            }
        }
        poller.abort();
    });
    stream_reply(rx)
}

struct Watcher {
    sandbox: String,
    events: Arc<Mutex<VecDeque<Value>>>,
    ended: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

/// The polling watchers of every sandbox.
#[derive(Default)]
pub struct Table {
    map: Mutex<HashMap<String, Watcher>>,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Watcher>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops the watchers of a sandbox that ended.
    pub fn remove_sandbox(&self, local: &str) {
        self.lock().retain(|_, w| {
            let keep = w.sandbox != local;
            if !keep {
                w.task.abort();
            }
            keep
        });
    }
}

pub(super) async fn create(
    e: &Arc<E2b>,
    meta: &Meta,
    sb: Sandbox,
    msg: &Value,
) -> Result<Value, RpcError> {
    let count = e
        .watchers
        .lock()
        .values()
        .filter(|w| w.sandbox == meta.local)
        .count();
    if count >= MAX_PER_SANDBOX {
        return Err(RpcError::new(
            "resource_exhausted",
            format!("{MAX_PER_SANDBOX} watchers already watch this sandbox; remove some"),
        ));
    }
    let (path, recursive, first) = begin(&sb, msg).await?;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let events: Arc<Mutex<VecDeque<Value>>> = Default::default();
    let ended: Arc<std::sync::atomic::AtomicBool> = Default::default();
    let (q, done) = (events.clone(), ended.clone());
    let task = tokio::spawn(async move {
        poll(sb, path, recursive, first, |new| {
            let mut q = q.lock().unwrap_or_else(|p| p.into_inner());
            for ev in new {
                if q.len() >= MAX_QUEUED {
                    q.pop_front();
                }
                q.push_back(ev);
            }
            true
        })
        .await;
        done.store(true, std::sync::atomic::Ordering::Release);
    });
    e.watchers.lock().insert(
        id.clone(),
        Watcher {
            sandbox: meta.local.clone(),
            events,
            ended,
            task,
        },
    );
    Ok(json!({"watcherId": id}))
}

fn watcher_id(msg: &Value) -> Result<String, RpcError> {
    field(msg, "watcherId", "watcher_id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| RpcError::invalid("watcherId: give the watcher's ID"))
}

pub(super) fn events(e: &E2b, meta: &Meta, msg: &Value) -> Result<Value, RpcError> {
    let id = watcher_id(msg)?;
    let map = e.watchers.lock();
    let w = map
        .get(&id)
        .filter(|w| w.sandbox == meta.local)
        .ok_or_else(|| RpcError::not_found(format!("watcher {id} not found")))?;
    let drained: Vec<Value> = w
        .events
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain(..)
        .collect();
    if drained.is_empty() && w.ended.load(std::sync::atomic::Ordering::Acquire) {
        return Err(RpcError::not_found(format!(
            "watcher {id}: the watched directory is gone"
        )));
    }
    Ok(json!({"events": drained}))
}

pub(super) fn remove(e: &E2b, meta: &Meta, msg: &Value) -> Result<Value, RpcError> {
    let id = watcher_id(msg)?;
    let mut map = e.watchers.lock();
    match map.get(&id) {
        Some(w) if w.sandbox == meta.local => {
            w.task.abort();
            map.remove(&id);
            Ok(json!({}))
        }
        _ => Err(RpcError::not_found(format!("watcher {id} not found"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(size: u64, mode: u32) -> Seen {
        Seen {
            kind: "file".into(),
            size,
            mtime: 1,
            mode,
        }
    }

    #[test]
    fn listings_differ_as_events() {
        let before: Listing = [
            ("a".to_string(), seen(1, 0o644)),
            ("b".to_string(), seen(1, 0o644)),
        ]
        .into();
        let after: Listing = [
            ("a".to_string(), seen(2, 0o600)),
            ("c".to_string(), seen(0, 0o644)),
        ]
        .into();
        let got: Vec<(String, String)> = diff(&before, &after)
            .into_iter()
            .map(|v| {
                (
                    v["name"].as_str().unwrap().into(),
                    v["type"].as_str().unwrap().into(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("a".into(), "EVENT_TYPE_WRITE".into()),
                ("a".into(), "EVENT_TYPE_CHMOD".into()),
                ("c".into(), "EVENT_TYPE_CREATE".into()),
                ("b".into(), "EVENT_TYPE_REMOVE".into()),
            ]
        );
    }
}
