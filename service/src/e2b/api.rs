//! E2B's control plane (the REST API `api.e2b.app` serves) on the node: `X-API-KEY` is
//! a project token, `templateID` a catalog ID, `timeout` the sandbox's lifetime from now
//! (and its idle TTL: E2B sandboxes do not end early for being idle), `envVars` its
//! environment, `metadata` its labels, `network` its egress allowlist. Creates go
//! through the node's admission like any other, as do a fork's children and sandboxes
//! started from a snapshot. A snapshot (`create_snapshot`) is a store snapshot of the
//! project (see [`crate::snapshot`]): its ID is a `templateID` any node sharing the store
//! creates from, listed under `/snapshots` and removed as a template.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Value};
use strata_catalog::{Backend, Budgets};

use super::{api_error, blocking, error_response, header, E2b, ENVD_VERSION};
use crate::error::ServiceError;
use crate::node::{now_ms, CreateArgs};
use crate::projects::Caller;
use crate::state::Meta;

/// E2B's default lifetime when a create gives none.
const DEFAULT_TIMEOUT: u64 = 300;
/// The longest `timeout` taken (E2B's own cap for its largest plan is a day).
const MAX_TIMEOUT: u64 = 24 * 3600;
/// A list page's size unless asked (and at most).
const PAGE: usize = 100;
/// The label that picks a backend (E2B's create has no field for it).
pub const BACKEND_LABEL: &str = "strata.backend";
/// The largest control-plane request body.
const MAX_BODY: usize = 1 << 20;

/// A refused request: the status and message of its `{"code", "message"}` answer.
struct Refused(StatusCode, String);

impl Refused {
    fn new(status: StatusCode, message: impl Into<String>) -> Refused {
        Refused(status, message.into())
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        api_error(self.0, self.1)
    }
}

fn json_reply(status: StatusCode, v: Value) -> Response {
    (
        status,
        [("content-type", "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// The request with its whole body read (at most [`MAX_BODY`]) into memory.
async fn read_whole(req: Request) -> Result<Request, Refused> {
    let (parts, body) = req.into_parts();
    let raw = read_body(body).await?;
    Ok(Request::from_parts(parts, axum::body::Body::from(raw)))
}

async fn body_json(req: Request) -> Result<Value, Refused> {
    let raw = read_body(req.into_body()).await?;
    parse_json(&raw)
}

async fn read_body(body: axum::body::Body) -> Result<Vec<u8>, Refused> {
    let mut body = body.into_data_stream();
    let mut raw = Vec::new();
    while let Some(c) = body.next().await {
        match c {
            Ok(c) if raw.len() + c.len() <= MAX_BODY => raw.extend_from_slice(&c),
            Ok(_) => {
                return Err(Refused::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "the request body is over 1 MiB",
                ))
            }
            Err(e) => {
                return Err(Refused::new(
                    StatusCode::BAD_REQUEST,
                    format!("the request body: {e}"),
                ))
            }
        }
    }
    Ok(raw)
}

fn parse_json(raw: &[u8]) -> Result<Value, Refused> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(raw).map_err(|e| {
        Refused::new(
            StatusCode::BAD_REQUEST,
            format!("the request body is not JSON: {e}"),
        )
    })
}

fn iso(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// The `timeout` field, in seconds, checked.
fn timeout_of(v: &Value) -> Result<Option<u64>, Refused> {
    match v.get("timeout") {
        None | Some(Value::Null) => Ok(None),
        Some(t) => match t.as_u64() {
            Some(s) if (1..=MAX_TIMEOUT).contains(&s) => Ok(Some(s)),
            _ => Err(Refused::new(
                StatusCode::BAD_REQUEST,
                format!("timeout: give whole seconds from 1 to {MAX_TIMEOUT}"),
            )),
        },
    }
}

fn string_map(v: Option<&Value>) -> Result<BTreeMap<String, String>, Refused> {
    match v {
        None | Some(Value::Null) => Ok(BTreeMap::new()),
        Some(Value::Object(m)) => m
            .iter()
            .map(|(k, v)| match v.as_str() {
                Some(s) => Ok((k.clone(), s.to_string())),
                None => Err(Refused::new(
                    StatusCode::BAD_REQUEST,
                    format!("`{k}`: values must be strings"),
                )),
            })
            .collect(),
        Some(_) => Err(Refused::new(
            StatusCode::BAD_REQUEST,
            "expected an object of strings",
        )),
    }
}

/// E2B's `templateID` as a catalog ID: `name:tag` is `name@tag`.
fn catalog_id(template: &str) -> String {
    match template.rsplit_once(':') {
        Some((name, tag)) if !tag.contains('/') && !name.contains('@') => format!("{name}@{tag}"),
        _ => template.to_string(),
    }
}

/// An `allowOut` destination as allowlist rules: `HOST:PORT` as given; a host, address
/// or CIDR without a port opens it on HTTPS and HTTP.
fn allow_rules(dest: &str) -> Vec<String> {
    let has_port = dest
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && !h.ends_with(':') && p.parse::<u16>().is_ok());
    if has_port {
        vec![dest.to_string()]
    } else {
        vec![format!("{dest}:443"), format!("{dest}:80")]
    }
}

/// The egress allowlist and inbound permission a create (or a network update) asks for.
fn network_of(caller: &Caller, v: &Value) -> Result<(Vec<String>, bool), Refused> {
    let net = v.get("network").filter(|n| !n.is_null());
    let list = |name: &str| -> Vec<String> {
        net.and_then(|n| n.get(name))
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let inbound = net
        .and_then(|n| n.get("allowPublicTraffic"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut rules: Vec<String> = list("allowOut")
        .iter()
        .flat_map(|d| allow_rules(d))
        .collect();
    let open = v.get("allow_internet_access").and_then(Value::as_bool) == Some(true);
    if open {
        if !caller.project.allow_internet {
            return Err(Refused::new(
                StatusCode::FORBIDDEN,
                format!(
                    "project `{}` may not open sandboxes to the internet: pass allow_internet_access=False and name destinations in network.allowOut (or make the project with `strata project create --allow-internet`)",
                    caller.project.name
                ),
            ));
        }
        // The public internet on the web ports, less what denyOut names (allowOut wins
        // over it, as in E2B); never the host's network or a metadata service.
        let public = strata_runtime::public_ranges(&list("denyOut"))
            .map_err(|e| Refused::new(StatusCode::BAD_REQUEST, format!("network.denyOut: {e}")))?;
        for range in public {
            rules.extend([format!("{range}:443"), format!("{range}:80")]);
        }
    }
    // Without open internet everything not allowed is denied already: denyOut adds
    // nothing.
    Ok((rules, inbound))
}

/// The `Sandbox` body of create and connect.
fn sandbox_json(e: &E2b, m: &Meta) -> Value {
    json!({
        "templateID": m.catalog_ref,
        "sandboxID": m.id,
        "clientID": e.node.config().node,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": e.access_token(&m.id),
        "trafficAccessToken": null,
        "domain": e.cfg.domain,
        "alias": null,
    })
}

/// The `SandboxDetail` / `ListedSandbox` body.
fn detail_json(e: &E2b, m: &Meta) -> Value {
    let end = m.expires_ms.unwrap_or_else(|| {
        now_ms()
            + m.idle_ttl_ms
                .saturating_sub(e.node.rt.idle_for(&m.local).as_millis() as u64)
    });
    json!({
        "templateID": m.catalog_ref,
        "alias": null,
        "sandboxID": m.id,
        "clientID": e.node.config().node,
        "startedAt": iso(m.created_ms),
        "endAt": iso(end),
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": e.access_token(&m.id),
        "cpuCount": m.cpus.ceil().max(1.0) as u64,
        "memoryMB": m.memory_bytes >> 20,
        "diskSizeMB": m.disk_bytes >> 20,
        "metadata": m.labels,
        // Frozen or hibernated: both are E2B's paused (resumed by a connect).
        "state": if m.paused || m.hibernated { "paused" } else { "running" },
        "domain": e.cfg.domain,
    })
}

pub(super) async fn handle(e: &Arc<E2b>, req: Request) -> Response {
    // Every answer comes after the whole request is read. Answering before (a refused key,
    // an unknown sandbox) left the body unread, so hyper closed the connection after the
    // answer; a client reusing it at once (httpx in the e2b SDK) got "Server disconnected
    // without sending a response" on its next call (CI, e2b 2.20.0: a create right after a
    // connect to an unknown sandbox). Control-plane bodies are small JSON.
    let req = match read_whole(req).await {
        Ok(r) => r,
        Err(r) => return r.into_response(),
    };
    let Some(key) = header(req.headers(), "x-api-key").map(str::to_string) else {
        return api_error(
            StatusCode::UNAUTHORIZED,
            "no API key: set E2B_API_KEY to a Strata project token (`strata token create --project NAME`)",
        );
    };
    let caller = match e.node.projects.authenticate(&key).await {
        Ok(c) => c,
        Err(err) => return error_response(&err),
    };
    let method = req.method().clone();
    let path = req.uri().path().trim_end_matches('/').to_string();
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    match (&method, parts.as_slice()) {
        (&Method::POST, ["sandboxes"] | ["v2", "sandboxes"]) => create(e, &caller, req).await,
        (&Method::GET, ["sandboxes"]) => list(e, &caller, &req, true),
        (&Method::GET, ["v2", "sandboxes"]) => list(e, &caller, &req, false),
        (&Method::GET, ["sandboxes", id]) => with(e, &caller, id, |m| {
            json_reply(StatusCode::OK, detail_json(e, &m))
        }),
        (&Method::DELETE, ["sandboxes", id]) => kill(e, &caller, id).await,
        (&Method::POST, ["sandboxes", id, "timeout"]) => set_timeout(e, &caller, id, req).await,
        (&Method::POST, ["sandboxes", id, "pause"]) => pause(e, &caller, id).await,
        (
            &Method::POST,
            ["sandboxes", id, "connect" | "resume"] | ["v2", "sandboxes", id, "connect"],
        ) => connect(e, &caller, id, req).await,
        (&Method::GET, ["sandboxes", id, "metrics"]) => metrics(e, &caller, id).await,
        (&Method::PUT, ["sandboxes", id, "network"]) => update_network(e, &caller, id, req).await,
        (&Method::POST, ["sandboxes", id, "fork"]) => fork(e, &caller, id, req).await,
        (&Method::POST, ["sandboxes", id, "snapshots"]) => {
            create_snapshot(e, &caller, id, req).await
        }
        (&Method::GET, ["snapshots"]) => list_snapshots(e, &caller, query(&req)).await,
        (&Method::DELETE, ["templates", id]) => delete_snapshot(e, &caller, id).await,
        _ => api_error(
            StatusCode::NOT_FOUND,
            format!("the E2B API has no {method} {path} here"),
        ),
    }
}

/// Runs `f` on the caller's sandbox `id`, or answers not found.
fn with(e: &E2b, caller: &Caller, id: &str, f: impl FnOnce(Meta) -> Response) -> Response {
    match e.node.meta_for(caller, id) {
        Ok(m) => f(m),
        Err(err) => error_response(&err),
    }
}

async fn create(e: &Arc<E2b>, caller: &Caller, req: Request) -> Response {
    let v = match body_json(req).await {
        Ok(v) => v,
        Err(r) => return r.into_response(),
    };
    let Some(template) = v
        .get("templateID")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
    else {
        return api_error(
            StatusCode::BAD_REQUEST,
            "templateID: give a catalog ID (namespace/name[@version])",
        );
    };
    let timeout = match timeout_of(&v) {
        Ok(t) => t.unwrap_or(DEFAULT_TIMEOUT),
        Err(r) => return r.into_response(),
    };
    let (env, labels) = match (string_map(v.get("envVars")), string_map(v.get("metadata"))) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(r), _) | (_, Err(r)) => return r.into_response(),
    };
    let backend = match labels.get(BACKEND_LABEL).map(|b| b.parse::<Backend>()) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(err)) => {
            return api_error(
                StatusCode::BAD_REQUEST,
                format!("metadata.{BACKEND_LABEL}: {err} (fncall, container, microvm or vm)"),
            )
        }
    };
    let (network, inbound) = match network_of(caller, &v) {
        Ok(n) => n,
        Err(r) => return r.into_response(),
    };
    if crate::snapshot::is_id(template) {
        // A snapshot's stack, budgets, environment and network are its own.
        let args = CreateArgs {
            lifetime: Some(Duration::from_secs(timeout)),
            labels,
            inbound,
            ..Default::default()
        };
        return match e.node.restore(caller, template, args).await {
            Ok(m) => json_reply(StatusCode::CREATED, sandbox_json(e, &m)),
            Err(err) => error_response(&err),
        };
    }
    let args = CreateArgs {
        catalog_id: catalog_id(template),
        backend,
        budgets: Budgets {
            idle_ttl: Some(format!("{timeout}s")),
            ..Default::default()
        },
        env,
        network: (!network.is_empty()).then_some(network),
        lifetime: Some(Duration::from_secs(timeout)),
        labels,
        inbound,
    };
    match e.node.create(caller, args).await {
        Ok(m) => json_reply(StatusCode::CREATED, sandbox_json(e, &m)),
        Err(err) => {
            if err.is_store() {
                e.node.metrics.store_error();
            }
            let err = match err {
                // The SDK shows the message of the 404 as its error.
                ServiceError::Catalog(
                    c @ (strata_catalog::CatalogError::NotFound(_)
                    | strata_catalog::CatalogError::Removed { .. }
                    | strata_catalog::CatalogError::AllRemoved(_)),
                ) => ServiceError::NotFound(format!(
                    "template `{template}`: {c} (templateID is a catalog ID)"
                )),
                other => other,
            };
            error_response(&err)
        }
    }
}

/// The caller's sandbox `id` and the request's JSON body, or the answer refusing either.
async fn meta_and_body(
    e: &E2b,
    caller: &Caller,
    id: &str,
    req: Request,
) -> Result<(Meta, Value), Response> {
    let meta = e
        .node
        .meta_for(caller, id)
        .map_err(|err| error_response(&err))?;
    let v = body_json(req).await.map_err(IntoResponse::into_response)?;
    Ok((meta, v))
}

/// `POST /sandboxes/{id}/snapshots`: a store snapshot of the sandbox (`name` lists it).
async fn create_snapshot(e: &Arc<E2b>, caller: &Caller, id: &str, req: Request) -> Response {
    let (meta, v) = match meta_and_body(e, caller, id, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let names = match v.get("name") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(n)) if !n.is_empty() && n.len() <= 128 => vec![n.clone()],
        Some(_) => return api_error(StatusCode::BAD_REQUEST, "name: give a short text"),
    };
    // `mode="filesystem"` sends `memory: false`.
    let files_only = v.get("memory").and_then(Value::as_bool) == Some(false);
    match e
        .node
        .snapshot_to_store(caller, &meta, names, files_only)
        .await
    {
        Ok(s) => json_reply(
            StatusCode::CREATED,
            json!({"snapshotID": s.id, "names": s.names}),
        ),
        Err(err) => error_response(&err),
    }
}

/// `GET /snapshots?sandboxID=&name=&limit=&nextToken=`: the project's, oldest first.
async fn list_snapshots(e: &Arc<E2b>, caller: &Caller, q: Vec<(String, String)>) -> Response {
    let get = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let snaps = match crate::snapshot::list(e.node.store(), Some(&caller.project.name)).await {
        Ok(s) => s,
        Err(err) => return error_response(&err),
    };
    let (of, name) = (get("sandboxID"), get("name"));
    let snaps: Vec<_> = snaps
        .into_iter()
        .filter(|s| of.as_ref().is_none_or(|id| &s.sandbox == id))
        .filter(|s| {
            name.as_ref()
                .is_none_or(|n| &s.id == n || s.names.contains(n))
        })
        .collect();
    page(
        &snaps,
        |s| &s.id,
        get("limit"),
        get("nextToken"),
        |s| json!({"snapshotID": s.id, "names": s.names}),
    )
}

/// One page of `items` (in their order) as E2B lists answer: at most `limit` (default
/// and cap [`PAGE`]) from the one whose ID is `after`, the next one's ID in `x-next-token`.
fn page<T>(
    items: &[T],
    id: impl Fn(&T) -> &String,
    limit: Option<String>,
    after: Option<String>,
    show: impl Fn(&T) -> Value,
) -> Response {
    let limit = limit
        .and_then(|l| l.parse::<usize>().ok())
        .unwrap_or(PAGE)
        .clamp(1, PAGE);
    let start = match &after {
        Some(t) => items.iter().position(|i| id(i) == t).unwrap_or(items.len()),
        None => 0,
    };
    let shown: Vec<Value> = items.iter().skip(start).take(limit).map(show).collect();
    let mut r = json_reply(StatusCode::OK, Value::Array(shown));
    if let Some(next) = items.get(start + limit) {
        if let Ok(v) = id(next).parse() {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    r
}

/// `DELETE /templates/{id}`: removes the project's snapshot `id` (templates proper are
/// catalog entries, removed through the catalog).
async fn delete_snapshot(e: &Arc<E2b>, caller: &Caller, id: &str) -> Response {
    // Snapshot IDs need no URL-decoding; anything else is no snapshot of ours.
    if !crate::snapshot::is_id(id) {
        return api_error(
            StatusCode::NOT_FOUND,
            format!("no snapshot `{id}` (catalog entries are removed with `strata catalog rm`)"),
        );
    }
    let removed = match e.node.snapshot_of(caller, id).await {
        Ok(s) => crate::snapshot::remove(e.node.store(), &s).await,
        Err(err) => Err(err),
    };
    match removed {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => error_response(&err),
    }
}

fn query(req: &Request) -> Vec<(String, String)> {
    serde_urlencoded::from_str(req.uri().query().unwrap_or("")).unwrap_or_default()
}

fn list(e: &E2b, caller: &Caller, req: &Request, v1: bool) -> Response {
    let q = query(req);
    let get = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    // `metadata` is itself url-encoded `k=v&k2=v2`.
    let want: Vec<(String, String)> = get("metadata")
        .map(|m| serde_urlencoded::from_str(&m).unwrap_or_default())
        .unwrap_or_default();
    let states: Vec<String> = match get("state") {
        Some(s) => s
            .split(',')
            .map(|x| x.trim().to_string())
            .filter(|x| !x.is_empty())
            .collect(),
        None if v1 => vec!["running".into()],
        None => vec![],
    };
    let limit = get("limit");
    let desc = get("order").is_some_and(|o| o.eq_ignore_ascii_case("desc"));
    let after = get("nextToken");
    let mut metas: Vec<Meta> = e
        .node
        .metas()
        .into_iter()
        .filter(|m| {
            !m.pending
                && m.project == caller.project.name
                && want.iter().all(|(k, v)| m.labels.get(k) == Some(v))
                && (states.is_empty() || states.iter().any(|s| s == m.state()))
        })
        .collect();
    metas.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
    if desc {
        metas.reverse();
    }
    page(&metas, |m| &m.id, limit, after, |m| detail_json(e, m))
}

async fn kill(e: &Arc<E2b>, caller: &Caller, id: &str) -> Response {
    let meta = match e.node.meta_for(caller, id) {
        Ok(m) => m,
        Err(err) => return error_response(&err),
    };
    e.procs.kill_all(&meta.local);
    e.watchers.remove_sandbox(&meta.local);
    let node = e.node.clone();
    match blocking(move || node.end(&meta, strata_runtime::EndReason::Destroyed)).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => error_response(&err),
    }
}

/// Sets the lifetime (and idle TTL) to `secs` from now.
/// Sets the lifetime (and idle TTL) to `secs` from now; with `only_longer`, never
/// shortens a lifetime.
async fn extend(
    e: &Arc<E2b>,
    meta: &Meta,
    secs: u64,
    only_longer: bool,
) -> Result<Meta, ServiceError> {
    if only_longer && meta.expires_ms.is_some_and(|x| x >= now_ms() + secs * 1000) {
        return Ok(meta.clone());
    }
    let (node, m) = (e.node.clone(), meta.clone());
    let t = Some(Duration::from_secs(secs));
    blocking(move || node.extend(&m, t, t)).await
}

async fn set_timeout(e: &Arc<E2b>, caller: &Caller, id: &str, req: Request) -> Response {
    let (meta, v) = match meta_and_body(e, caller, id, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let secs = match timeout_of(&v) {
        Ok(Some(s)) => s,
        Ok(None) => return api_error(StatusCode::BAD_REQUEST, "timeout: required, in seconds"),
        Err(r) => return r.into_response(),
    };
    match extend(e, &meta, secs, false).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => error_response(&err),
    }
}

async fn set_paused(e: &Arc<E2b>, meta: &Meta, paused: bool) -> Result<Meta, ServiceError> {
    let (node, m) = (e.node.clone(), meta.clone());
    blocking(move || node.set_paused(&m, paused)).await
}

/// Pause keeps memory (E2B's default mode, `full`): the sandbox hibernates (its state
/// to disk, its memory and CPUs back to the node) where it can; where it cannot (no CRIU
/// or static agent on this node for a host sandbox; a command still streaming, such as a
/// background `commands.run`, would lose its stream) it is frozen with its memory held. A `filesystem` pause is served the same way: it keeps more than asked.
async fn pause(e: &Arc<E2b>, caller: &Caller, id: &str) -> Response {
    let meta = match e.node.meta_for(caller, id) {
        Ok(m) => m,
        Err(err) => return error_response(&err),
    };
    if meta.paused || meta.hibernated {
        return api_error(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        );
    }
    let (node, m) = (e.node.clone(), meta.clone());
    // A streaming command makes it busy at once: frozen instead, with no wait.
    match blocking(move || node.hibernate(&m, Some(Duration::ZERO))).await {
        Ok(_) => return StatusCode::NO_CONTENT.into_response(),
        Err(ServiceError::Runtime(
            strata_runtime::RuntimeError::Unsupported(_) | strata_runtime::RuntimeError::Busy(_),
        )) => {}
        Err(err) => return error_response(&err),
    }
    match set_paused(e, &meta, true).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => error_response(&err),
    }
}

/// Fork: `count` (default 1) children of the sandbox (see [`crate::fork`]), all or none,
/// each given `timeout` as its lifetime from now when one is sent.
async fn fork(e: &Arc<E2b>, caller: &Caller, id: &str, req: Request) -> Response {
    let (meta, v) = match meta_and_body(e, caller, id, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let timeout = match timeout_of(&v) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    let count = match v.get("count") {
        None | Some(Value::Null) => 1,
        Some(c) => match c.as_u64() {
            Some(n) if (1..=crate::fork::MAX_FORK as u64).contains(&n) => n as usize,
            _ => {
                return api_error(
                    StatusCode::BAD_REQUEST,
                    format!("count: give 1 to {} children", crate::fork::MAX_FORK),
                )
            }
        },
    };
    let children = match e.node.fork(caller, &meta, count).await {
        Ok((children, _, _)) => children,
        Err(err) => return error_response(&err),
    };
    let mut out = Vec::new();
    for mut child in children {
        if let Some(secs) = timeout {
            match extend(e, &child, secs, false).await {
                Ok(m) => child = m,
                Err(err) => return error_response(&err),
            }
        }
        out.push(json!({ "sandbox": sandbox_json(e, &child) }));
    }
    json_reply(StatusCode::CREATED, Value::Array(out))
}

/// Connect: resumes a paused sandbox; a timeout extends a shorter lifetime.
async fn connect(e: &Arc<E2b>, caller: &Caller, id: &str, req: Request) -> Response {
    let (mut meta, v) = match meta_and_body(e, caller, id, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let timeout = match timeout_of(&v) {
        Ok(t) => t,
        Err(r) => return r.into_response(),
    };
    if meta.hibernated {
        if let Err(err) = e.node.running(&meta).await {
            return error_response(&err);
        }
        meta = match e.node.meta_for(caller, id) {
            Ok(m) => m,
            Err(err) => return error_response(&err),
        };
    }
    if meta.paused {
        meta = match set_paused(e, &meta, false).await {
            Ok(m) => m,
            Err(err) => return error_response(&err),
        };
    }
    if let Some(secs) = timeout {
        meta = match extend(e, &meta, secs, true).await {
            Ok(m) => m,
            Err(err) => return error_response(&err),
        };
    }
    json_reply(StatusCode::OK, sandbox_json(e, &meta))
}

async fn metrics(e: &Arc<E2b>, caller: &Caller, id: &str) -> Response {
    let meta = match e.node.meta_for(caller, id) {
        Ok(m) => m,
        Err(err) => return error_response(&err),
    };
    let node = e.node.clone();
    let m = meta.clone();
    let seen = e.cpu_seen.clone();
    let cpus = meta.cpus.ceil().max(1.0) as u64;
    if meta.hibernated {
        // Nothing of it runs, and asking must not wake it.
        return json_reply(StatusCode::OK, json!([]));
    }
    let sample = blocking(move || {
        let sb = node.sandbox(&m)?;
        let mem = sb.cgroup().memory_usage();
        let cpu = sb.cgroup().cpu_usage();
        let (disk_used, disk_total) = sb.disk_usage().unwrap_or((0, m.disk_bytes));
        // Over the time since the last call; at the first, since the sandbox started.
        let now = std::time::Instant::now();
        let started = Duration::from_millis(now_ms().saturating_sub(m.created_ms));
        let pct = match seen.get(&m.id) {
            Some((at, before)) if now - at >= Duration::from_millis(100) => {
                cpu_used_pct(cpu.saturating_sub(before), now - at, cpus)
            }
            _ => cpu_used_pct(cpu, started, cpus),
        };
        seen.insert(m.id.clone(), (now, cpu));
        Ok((mem, pct, disk_used, disk_total))
    })
    .await;
    match sample {
        Ok((mem, pct, disk_used, disk_total)) => {
            let now = now_ms();
            json_reply(
                StatusCode::OK,
                json!([{
                    "timestamp": iso(now),
                    "timestampUnix": now / 1000,
                    "cpuCount": cpus,
                    "cpuUsedPct": pct,
                    "memUsed": mem,
                    "memTotal": meta.memory_bytes,
                    "memCache": 0,
                    "diskUsed": disk_used,
                    "diskTotal": disk_total,
                }]),
            )
        }
        Err(err) => error_response(&err),
    }
}

/// CPU time `used` over `wall` as a percentage of `cpus` whole CPUs (E2B's
/// `cpuUsedPct`), rounded to two decimals and capped at 100.
fn cpu_used_pct(used: Duration, wall: Duration, cpus: u64) -> f64 {
    if wall.is_zero() || cpus == 0 {
        return 0.0;
    }
    let pct = used.as_secs_f64() / (wall.as_secs_f64() * cpus as f64) * 100.0;
    (pct.min(100.0) * 100.0).round() / 100.0
}

/// Replaces a running sandbox's egress policy, checked as a create's would be; the
/// body holds everything (what it leaves out is no longer allowed).
async fn update_network(e: &Arc<E2b>, caller: &Caller, id: &str, req: Request) -> Response {
    let (meta, v) = match meta_and_body(e, caller, id, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let (rules, _) = match network_of(
        caller,
        &json!({"network": v, "allow_internet_access": v.get("allow_internet_access")}),
    ) {
        Ok(n) => n,
        Err(r) => return r.into_response(),
    };
    let node = e.node.clone();
    match blocking(move || node.set_network(&meta, &rules)).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(err) => error_response(&err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_are_catalog_ids() {
        assert_eq!(catalog_id("datasets/sample"), "datasets/sample");
        assert_eq!(catalog_id("datasets/sample:3"), "datasets/sample@3");
        assert_eq!(catalog_id("datasets/sample@3"), "datasets/sample@3");
    }

    #[test]
    fn cpu_use_is_a_share_of_the_sandbox_cpus() {
        let s = Duration::from_secs;
        assert_eq!(cpu_used_pct(s(1), s(2), 1), 50.0);
        assert_eq!(cpu_used_pct(s(1), s(2), 2), 25.0);
        assert_eq!(cpu_used_pct(s(9), s(2), 2), 100.0);
        assert_eq!(cpu_used_pct(s(1), Duration::ZERO, 1), 0.0);
        assert_eq!(cpu_used_pct(Duration::from_millis(1), s(3), 1), 0.03);
    }

    #[test]
    fn allow_out_without_a_port_opens_web_ports() {
        assert_eq!(allow_rules("pypi.org:443"), vec!["pypi.org:443"]);
        assert_eq!(
            allow_rules("10.0.0.0/8"),
            vec!["10.0.0.0/8:443", "10.0.0.0/8:80"]
        );
        assert_eq!(
            allow_rules("example.com"),
            vec!["example.com:443", "example.com:80"]
        );
    }
}
