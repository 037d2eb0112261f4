//! Snapshots in the store: a sandbox's state as a durable object any node sharing the
//! store can restore. Where the backend saves processes and memory (microvm, vm; a
//! container with CRIU), the sandbox's snapshot (a machine's memory and device state or a
//! container's CRIU images, its writable disk, the key its agent proves) becomes a layer
//! of kind `snapshot`: content-addressed, deduplicated chunks like any layer, the disk's
//! unwritten space left as holes. Elsewhere (fncall, or a container without CRIU) the
//! snapshot is the sandbox's committed files, restored as a
//! new sandbox of the same stack with that layer on top.
//!
//! A record per snapshot (`snapshots/<id>.json`) names the layer, the sandbox's spec
//! (stack, budgets, environment), the project it belongs to and its sizes; restoring on
//! another node fetches the layer (in parallel, verified) into the node's state directory,
//! restores from it and removes the copy. Used by the node service and the embedded CLI.

use std::path::{Path, PathBuf};
use std::time::Instant;

use object_store::path::Path as ObjectPath;
use object_store::ObjectStoreExt;
use serde::{Deserialize, Serialize};
use serde_json::json;
use strata_builder::{BuildRequest, LayerKind, Source};
use strata_catalog::Backend;
use strata_runtime::{Runtime, Sandbox, SandboxSpec};
use strata_store::{Digest, Store};

use crate::projects::{list_keys, read_json, write_json};
use crate::{blocking, ServiceError};

/// The record format this build writes and reads.
pub const FORMAT: u32 = 1;
const PREFIX: &str = "snapshots";

/// One snapshot in the store. Field names are part of `strata snapshot ls --json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredSnapshot {
    pub format: u32,
    /// `snap-` and 16 hex digits.
    pub id: String,
    /// The layer holding it: the machine's files, or the committed files.
    pub layer: Digest,
    /// It keeps the sandbox's processes and memory (else: its files only).
    pub memory: bool,
    pub backend: Backend,
    /// The sandbox it was taken of.
    pub sandbox: String,
    /// The project it belongs to (empty: taken without a service).
    pub project: String,
    /// Names given at snapshot time (E2B's snapshot names).
    #[serde(default)]
    pub names: Vec<String>,
    pub taken_by: String,
    pub taken_ms: u64,
    /// The sandbox's spec when it was taken: its stack, budgets, environment.
    pub spec: SandboxSpec,
    /// Bytes of the machine state (0 for files only).
    pub state_bytes: u64,
    /// Bytes the writable disk's copy held (memory snapshots), or the committed files.
    pub disk_bytes: u64,
    /// Bytes a restore fetches (before compression; a disk's holes are not stored).
    pub stored_bytes: u64,
    /// Bytes the store did not already have when it was taken.
    pub uploaded_bytes: u64,
    pub seconds: f64,
}

impl StoredSnapshot {
    /// The snapshot as the API (and `strata snapshot ls --json`) shows it.
    pub fn to_proto(&self) -> crate::proto::SnapshotInfo {
        crate::proto::SnapshotInfo {
            id: self.id.clone(),
            layer: self.layer.to_string(),
            memory: self.memory,
            backend: self.backend.as_str().to_string(),
            sandbox: self.sandbox.clone(),
            catalog_ref: self.spec.catalog_ref.clone(),
            project: self.project.clone(),
            names: self.names.clone(),
            taken_ms: self.taken_ms,
            state_bytes: self.state_bytes,
            disk_bytes: self.disk_bytes,
            stored_bytes: self.stored_bytes,
            uploaded_bytes: self.uploaded_bytes,
            seconds: self.seconds,
            taken_by: self.taken_by.clone(),
        }
    }
}

/// Who takes a snapshot, and what it is called.
#[derive(Debug, Clone, Default)]
pub struct TakeRequest {
    /// The sandbox's ID as its callers know it (the service's names its node).
    pub sandbox: String,
    pub project: String,
    pub taken_by: String,
    pub names: Vec<String>,
    /// Its files only, even where the backend could keep processes and memory.
    pub files_only: bool,
}

fn key(id: &str) -> ObjectPath {
    ObjectPath::from(format!("{PREFIX}/{id}.json"))
}

/// Refuses text that is not a snapshot ID (so it never becomes a stray store key).
pub fn check_id(id: &str) -> Result<(), ServiceError> {
    let hex = id.strip_prefix("snap-").unwrap_or("");
    if hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(ServiceError::invalid(
            "snapshot",
            format!("`{id}` is not a snapshot ID (`snap-` and 16 hex digits, as `strata sandbox snapshot --to-store` printed)"),
        ))
    }
}

/// Whether `text` names a snapshot in the store (rather than a directory or catalog ID).
pub fn is_id(text: &str) -> bool {
    check_id(text).is_ok()
}

/// A new work directory in `parent`, which only root may read (a snapshot holds a
/// machine's memory). Its name carries this process's ID, so the next one made there
/// removes what a process that died mid-way left.
pub(crate) fn private_dir(parent: &Path, name: &str) -> Result<PathBuf, ServiceError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(parent)
        .and_then(|()| std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o700)))
        .map_err(|source| ServiceError::Io {
            what: format!("making {}", parent.display()),
            source,
        })?;
    if let Ok(entries) = std::fs::read_dir(parent) {
        for e in entries.flatten() {
            let file = e.file_name();
            let dead = file
                .to_string_lossy()
                .split('.')
                .nth(1)
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
            if dead {
                tracing::info!(
                    "removing {}, left by a process that died",
                    e.path().display()
                );
                remove_work(&e.path());
            }
        }
    }
    Ok(parent.join(format!(
        "{name}.{}.{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    )))
}

/// Removes a work directory, saying so if it cannot. Tried three times: a removal that
/// meets an entry made meanwhile fails (ENOTEMPTY) where the next succeeds; what is left
/// after that the next [`private_dir`] of a later process reaps.
pub(crate) fn remove_work(dir: &Path) {
    for attempt in 1..=3 {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) if attempt == 3 => {
                tracing::warn!("removing {}: {e}", dir.display());
            }
            Err(e) => {
                tracing::info!("removing {}: {e}; trying again", dir.display());
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}

/// Takes a snapshot of `sandbox` into `store` (see the module's comment); the sandbox
/// runs on. `work` is a node-local directory for the machine's files meanwhile.
pub async fn take(
    store: &Store,
    sandbox: &Sandbox,
    work: &Path,
    req: &TakeRequest,
) -> Result<StoredSnapshot, ServiceError> {
    let t = Instant::now();
    let memory = sandbox.saves_memory() && !req.files_only;
    let (layer, state_bytes, disk_bytes, stored_bytes, uploaded_bytes) = if memory {
        let dir = private_dir(work, sandbox.id())?;
        let (sb, d) = (sandbox.clone(), dir.clone());
        let built = async {
            let info = blocking(move || Ok(sb.snapshot(&d)?)).await?;
            let mut provenance = serde_json::Map::new();
            provenance.insert("snapshot_of".into(), json!(sandbox.id()));
            provenance.insert("layers_below".into(), json!(sandbox.spec().layers));
            let build = BuildRequest {
                source: Source::Dir(dir.clone()),
                kind: LayerKind::Snapshot,
                name: None,
                version: None,
                exclude: Vec::new(),
                prefix: None,
                source_label: Some(format!("snapshot:{}", sandbox.id())),
                provenance,
                registry: Default::default(),
            };
            let report = strata_builder::build(store, &build, None)
                .await
                .map_err(|e| match e {
                    strata_builder::BuildError::Store(s) => ServiceError::Store(s),
                    e => ServiceError::Internal(format!("storing the snapshot: {e}")),
                })?;
            Ok::<_, ServiceError>((
                report.id,
                info.state_bytes,
                info.disk_bytes,
                // The disk's unwritten space is holes: neither stored nor fetched.
                info.state_bytes + info.disk_bytes,
                report.uploaded_bytes,
            ))
        }
        .await;
        remove_work(&dir);
        built?
    } else {
        let c = crate::commit::commit(
            store,
            sandbox,
            &crate::commit::CommitRequest {
                kind: LayerKind::Toolkit,
                register: None,
                registrant: req.taken_by.clone(),
            },
        )
        .await?;
        (
            c.layer,
            0,
            c.logical_bytes,
            c.logical_bytes,
            c.uploaded_bytes,
        )
    };
    let record = StoredSnapshot {
        format: FORMAT,
        id: format!("snap-{}", &uuid::Uuid::new_v4().simple().to_string()[..16]),
        layer,
        memory,
        backend: sandbox.spec().backend,
        sandbox: req.sandbox.clone(),
        project: req.project.clone(),
        names: req.names.clone(),
        taken_by: req.taken_by.clone(),
        taken_ms: crate::node::now_ms(),
        spec: sandbox.spec().clone(),
        state_bytes,
        disk_bytes,
        stored_bytes,
        uploaded_bytes,
        seconds: t.elapsed().as_secs_f64(),
    };
    write_json(store.backend().as_ref(), &key(&record.id), &record, true).await?;
    let _ = sandbox.audit().record(
        "snapshot-stored",
        json!({"snapshot": record.id, "layer": record.layer, "memory": memory,
               "by": req.taken_by}),
    );
    Ok(record)
}

/// The snapshot `id`.
pub async fn get(store: &Store, id: &str) -> Result<StoredSnapshot, ServiceError> {
    check_id(id)?;
    let rec: StoredSnapshot = read_json(store.backend().as_ref(), &key(id))
        .await?
        .ok_or_else(|| {
            ServiceError::NotFound(format!(
                "no snapshot {id} in the store (`strata snapshot ls` lists them)"
            ))
        })?;
    if rec.format != FORMAT {
        return Err(ServiceError::Corrupt {
            key: key(id).to_string(),
            reason: format!(
                "format {} (this build reads {FORMAT}): upgrade Strata",
                rec.format
            ),
        });
    }
    Ok(rec)
}

/// Every snapshot in the store (of `project` only, when given), oldest first.
pub async fn list(
    store: &Store,
    project: Option<&str>,
) -> Result<Vec<StoredSnapshot>, ServiceError> {
    let mut out = Vec::new();
    for k in list_keys(store.backend().as_ref(), &ObjectPath::from(PREFIX)).await? {
        let Some(id) = k.filename().and_then(|f| f.strip_suffix(".json")) else {
            continue;
        };
        if !is_id(id) {
            continue;
        }
        match get(store, id).await {
            Ok(s) if project.is_none_or(|p| p == s.project) => out.push(s),
            Ok(_) | Err(ServiceError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
    }
    out.sort_by_key(|s| s.taken_ms);
    Ok(out)
}

/// Removes a snapshot: its record and, for a memory snapshot, its layer (its chunks go at
/// the next `store gc`). That layer is the snapshot's own: its `snapshot.json` carries the
/// time it was taken, so no two snapshots have one layer. A files-only snapshot's layer is
/// a commit like any other and stays.
pub async fn remove(store: &Store, snap: &StoredSnapshot) -> Result<bool, ServiceError> {
    let k = key(&snap.id);
    store
        .backend()
        .delete(&k)
        .await
        .map_err(|source| ServiceError::Backend {
            key: k.to_string(),
            source,
        })?;
    if !snap.memory {
        return Ok(false);
    }
    store.remove_layers(&[snap.layer]).await?;
    Ok(true)
}

/// Starts a new sandbox from `snap` on this node (see the module's comment), as
/// `identity`. `work` is a node-local directory for the fetched machine files.
pub async fn restore(
    store: &Store,
    rt: &Runtime,
    snap: &StoredSnapshot,
    identity: &str,
    work: &Path,
) -> Result<Sandbox, ServiceError> {
    if !snap.memory {
        let mut spec = snap.spec.clone();
        spec.layers.insert(0, snap.layer.to_string());
        spec.identity = identity.to_string();
        let rt = rt.clone();
        return blocking(move || Ok(rt.create(spec)?)).await;
    }
    let dir = private_dir(work, &snap.id)?;
    let files = dir.join("files");
    let made = async {
        let manifest = store.get_layer(&snap.layer).await?;
        let scratch = dir.join("scratch");
        std::fs::create_dir_all(&scratch).map_err(|source| ServiceError::Io {
            what: format!("making {}", scratch.display()),
            source,
        })?;
        strata_builder::export::export_layer(store, &manifest, &files, &scratch)
            .await
            .map_err(|e| ServiceError::Internal(format!("fetching snapshot {}: {e}", snap.id)))?;
        // The layer's image files are not needed once its files are out.
        remove_work(&scratch);
        let rt = rt.clone();
        let f = files.clone();
        blocking(move || Ok(rt.restore(&f, false)?)).await
    }
    .await;
    remove_work(&dir);
    let sb = made?;
    let _ = sb
        .audit()
        .record("restored", json!({"snapshot": snap.id, "by": identity}));
    Ok(sb)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_snapshot_ids_are_ids() {
        assert!(is_id("snap-0123456789abcdef"));
        assert!(!is_id("snap-0123456789abcde"));
        assert!(!is_id("snap-0123456789abcdeg"));
        assert!(!is_id("datasets/sample"));
        assert!(!is_id("snap-../../etc/passwdxx"));
        assert!(matches!(
            check_id("/tmp/snap"),
            Err(ServiceError::InvalidArgument { .. })
        ));
    }

    #[test]
    fn a_work_directory_a_dead_process_left_is_removed_by_the_next() {
        let root = tempfile::tempdir().unwrap();
        let parent = root.path().join("work");
        let mine = private_dir(&parent, "s1").unwrap();
        std::fs::create_dir_all(&mine).unwrap();
        // PIDs above the kernel's pid_max never run.
        let dead = parent.join("s2.4194305.0123");
        std::fs::create_dir_all(dead.join("files")).unwrap();
        let again = private_dir(&parent, "s3").unwrap();
        assert!(mine.exists() && !dead.exists());
        assert_ne!(again, mine);
    }
}
