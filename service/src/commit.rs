//! Commit (DSec's `pack_diff`): what a live sandbox changed over its layers becomes a new
//! content-addressed layer in the store, and optionally a new catalog entry, the
//! sandbox's own entry with the new layer on top, so a sandbox started from it on any node
//! sharing the store has the committed files.
//!
//! The changes are read through [`strata_runtime::Changes`] (the sandbox held still) as a
//! step build reads its upper: whiteouts and opaque directories kept, overlay bookkeeping
//! and times dropped, build noise (`DEFAULT_EXCLUDES`) and what the runtime wrote left
//! out, so committing twice with no change in between gives the same layer ID. Used by the
//! node service and by the embedded CLI alike.

use serde::Serialize;
use serde_json::json;
use strata_builder::source::upper::UpperFilter;
use strata_builder::steps::DEFAULT_EXCLUDES;
use strata_builder::{BuildError, BuildRequest, LayerKind, Source};
use strata_catalog::Catalog;
use strata_runtime::Sandbox;
use strata_store::{Digest, Store};

use crate::ServiceError;

/// What to commit and where to register it.
#[derive(Debug, Clone)]
pub struct CommitRequest {
    /// The new layer's role (provenance and `layer ls`); workspace by default.
    pub kind: LayerKind,
    /// `namespace/name` to register the new entry as; none: the layer only.
    pub register: Option<String>,
    /// Who the catalog record names.
    pub registrant: String,
}

/// A commit's outcome. Field names are part of `strata sandbox commit --json`.
#[derive(Debug, Clone, Serialize)]
pub struct Committed {
    pub layer: Digest,
    pub kind: LayerKind,
    pub files: u64,
    pub logical_bytes: u64,
    /// Bytes newly written to the store.
    pub uploaded_bytes: u64,
    /// False when the store already had this layer (nothing changed since a commit).
    pub created: bool,
    /// `namespace/name@version` of the entry registered, if one was.
    pub registered: Option<String>,
    pub seconds: f64,
}

/// Commits `sandbox`'s changes as a layer and, when asked, registers the entry.
pub async fn commit(
    store: &Store,
    sandbox: &Sandbox,
    req: &CommitRequest,
) -> Result<Committed, ServiceError> {
    commit_inspecting(store, sandbox, req, &[], |_| ())
        .await
        .map(|(c, ())| c)
}

/// [`commit`], leaving out the paths `also_exclude` matches too (glob patterns, as a layer
/// definition's), and calling `inspect` on the changes while the sandbox is held still.
pub(crate) async fn commit_inspecting<T: Send + 'static>(
    store: &Store,
    sandbox: &Sandbox,
    req: &CommitRequest,
    also_exclude: &[String],
    inspect: impl FnOnce(&strata_runtime::Changes) -> T + Send + 'static,
) -> Result<(Committed, T), ServiceError> {
    let catalog_ref = sandbox.spec().catalog_ref.clone();
    // The entry first: a registration that cannot happen fails before any work.
    let target = match &req.register {
        Some(id) => {
            strata_catalog::entry::validate_id(id)
                .map_err(|e| ServiceError::invalid("register", e.to_string()))?;
            let catalog = Catalog::open(store).await?;
            let reg = catalog.get(&catalog_ref).await?;
            Some((id.clone(), catalog, reg))
        }
        None => None,
    };
    let sb = sandbox.clone();
    let (changes, seen) = tokio::task::spawn_blocking(move || {
        sb.changes().map(|changes| {
            let seen = inspect(&changes);
            (changes, seen)
        })
    })
    .await
    .map_err(|e| ServiceError::Internal(e.to_string()))??;
    let mut exclude: Vec<String> = DEFAULT_EXCLUDES.iter().map(|s| s.to_string()).collect();
    exclude.extend(changes.runtime_paths.iter().cloned());
    exclude.extend(also_exclude.iter().cloned());
    let mut provenance = serde_json::Map::new();
    provenance.insert("committed_from".into(), json!(catalog_ref));
    provenance.insert("sandbox".into(), json!(sandbox.id()));
    provenance.insert("layers_below".into(), json!(sandbox.spec().layers));
    let build = BuildRequest {
        source: Source::Upper {
            dir: changes.upper.clone(),
            filter: UpperFilter {
                lowers: changes.lowers.clone(),
                capture: Vec::new(),
                drop_input_pycache: true,
            },
        },
        kind: req.kind,
        name: req.register.clone(),
        version: None,
        exclude,
        prefix: None,
        source_label: Some(format!("commit:{catalog_ref}")),
        provenance,
        registry: Default::default(),
    };
    let built = strata_builder::build(store, &build, None).await;
    // Thawed (or the VM's copy unmounted) before anything else can fail.
    tokio::task::spawn_blocking(move || drop(changes))
        .await
        .map_err(|e| ServiceError::Internal(e.to_string()))?;
    let report = built.map_err(build_error)?;
    let registered = match target {
        Some((id, catalog, reg)) => {
            let mut entry = reg.entry.clone();
            entry.id = id;
            entry.version = None;
            put_on_top(&mut entry, req.kind, report.id.to_string());
            Some(catalog.register(entry, &req.registrant).await?.reference())
        }
        None => None,
    };
    let out = Committed {
        layer: report.id,
        kind: req.kind,
        files: report.files,
        logical_bytes: report.logical_bytes,
        uploaded_bytes: report.uploaded_bytes,
        created: report.created,
        registered,
        seconds: report.seconds,
    };
    let _ = sandbox.audit().record(
        "committed",
        json!({"layer": out.layer, "kind": req.kind, "files": out.files,
               "registered": out.registered, "by": req.registrant}),
    );
    Ok((out, seen))
}

/// A commit's `kind` as a caller writes it: `workspace` (also empty) or `toolkit`.
pub fn parse_kind(text: &str) -> Result<LayerKind, ServiceError> {
    match text {
        "" => Ok(LayerKind::Workspace),
        k => match k.parse() {
            Ok(LayerKind::Base | LayerKind::Snapshot) | Err(_) => Err(ServiceError::invalid(
                "kind",
                format!("`{k}`: a commit is a `workspace` or a `toolkit` layer"),
            )),
            Ok(kind) => Ok(kind),
        },
    }
}

/// Puts `layer` at the top of `entry`'s stack: the workspace slot when the entry has
/// neither a workspace nor toolkits and the layer is a workspace, else the top-most
/// toolkit (the sandbox saw its changes over every layer, so they must stay above all).
fn put_on_top(entry: &mut strata_catalog::Entry, kind: LayerKind, layer: String) {
    if kind == LayerKind::Workspace && entry.workspace.is_none() && entry.toolkits.is_empty() {
        entry.workspace = Some(layer);
    } else {
        entry.toolkits.insert(0, layer);
    }
}

/// A failed build of a sandbox's changes: the store's failure, ours, or something in the
/// upper no layer can hold (the sandbox's doing).
fn build_error(e: BuildError) -> ServiceError {
    match e {
        BuildError::Store(s) => ServiceError::Store(s),
        e @ (BuildError::Io { .. } | BuildError::Internal(_)) => {
            ServiceError::Internal(format!("reading the sandbox's changes: {e}"))
        }
        e => ServiceError::invalid(
            "id",
            format!("the sandbox's changes cannot become a layer: {e}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> strata_catalog::Entry {
        serde_json::from_value(json!({"id": "a/b", "base": "B"})).unwrap()
    }

    #[test]
    fn the_new_layer_goes_above_every_layer_of_the_stack() {
        let mut e = entry();
        put_on_top(&mut e, LayerKind::Workspace, "N".into());
        assert_eq!(e.layers(), vec!["N", "B"]);
        assert_eq!(e.workspace.as_deref(), Some("N"));
        let mut e = entry();
        e.workspace = Some("W".into());
        e.toolkits = vec!["T".into()];
        put_on_top(&mut e, LayerKind::Workspace, "N".into());
        assert_eq!(e.layers(), vec!["N", "T", "W", "B"]);
        let mut e = entry();
        put_on_top(&mut e, LayerKind::Toolkit, "N".into());
        assert_eq!(e.layers(), vec!["N", "B"]);
        assert!(e.workspace.is_none());
    }
}
