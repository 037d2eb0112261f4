//! The catalog: maps `namespace/name[@version]` to an environment (layer stack, backend,
//! budgets, env, commands), stored in the same store as the layers so one store is all a
//! cluster shares.
//!
//! Layout under `catalog/<namespace>/<name>/`:
//! - `versions/<version>.json`: a registered entry, created once (conditional create);
//! - `log/<seq>`: one record per registration or removal of a version, `seq` zero-padded
//!   and increasing. Appending is a compare-and-swap built only on conditional create
//!   (`If-None-Match: *` on S3, an atomic link on a local directory): a writer that loses
//!   the race for `seq` re-reads and takes the next one, so no record is lost, on either
//!   backend, without locks.
//!
//! The log is the truth about what resolves: a version with a removal record anywhere in
//! the log (a tombstone) is removed, whatever the order of the records; "latest" is the
//! version of the highest registration record that is not removed. A removed version's
//! `versions/<v>.json` stays, so its name is never registered again and the history can
//! still say what it was.

pub mod entry;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use strata_store::{Digest, Store};

pub use entry::{parse_ref, parse_size, Backend, Budgets, DiskImage, Entry, Evaluator};

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("{0}")]
    Invalid(String),
    #[error("catalog entry `{0}` does not exist (see `strata catalog ls`)")]
    NotFound(String),
    #[error("{reference} was removed from the catalog (see `strata catalog history {id}`)")]
    Removed { reference: String, id: String },
    #[error("catalog entry `{0}` has no versions left: every one was removed (see `strata catalog history {0}`)")]
    AllRemoved(String),
    #[error("{id}@{version} is already registered; entries are immutable, register a new version")]
    VersionExists { id: String, version: String },
    #[error("entry {id} names layer `{layer}`, which is not in the store; build or push it first")]
    MissingLayer { id: String, layer: String },
    #[error("the store at {0} does not honour conditional create (If-None-Match); the catalog needs it to register safely")]
    NoConditionalPut(String),
    #[error(transparent)]
    Store(#[from] strata_store::StoreError),
    #[error("catalog object `{key}`: {source}")]
    Backend {
        key: String,
        #[source]
        source: object_store::Error,
    },
    #[error("catalog object `{key}` is not valid: {reason}")]
    Corrupt { key: String, reason: String },
    #[error("gave up registering {0} after many concurrent updates; retry")]
    Contended(String),
}

fn be(key: &ObjectPath) -> impl FnOnce(object_store::Error) -> CatalogError {
    let key = key.to_string();
    move |source| CatalogError::Backend { key, source }
}

/// A registered entry: the entry with its version fixed, and who registered it when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Registered {
    pub entry: Entry,
    pub version: String,
    pub registered_at: u64,
    pub registered_by: String,
}

impl Registered {
    pub fn reference(&self) -> String {
        format!("{}@{}", self.entry.id, self.version)
    }
}

/// What a log record did to its version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Records written before removal existed have no action: registrations.
    #[default]
    Register,
    /// A tombstone: the version no longer resolves.
    Remove,
}

/// One line of an entry's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogRecord {
    pub seq: u64,
    pub version: String,
    pub at: u64,
    pub by: String,
    #[serde(default)]
    pub action: Action,
}

/// An entry's whole log, oldest first, and what it resolves to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EntryLog {
    pub records: Vec<LogRecord>,
}

impl EntryLog {
    fn removed(&self) -> HashSet<&str> {
        self.records
            .iter()
            .filter(|r| r.action == Action::Remove)
            .map(|r| r.version.as_str())
            .collect()
    }

    /// Whether the log holds a tombstone for `version`.
    pub fn is_removed(&self, version: &str) -> bool {
        self.records
            .iter()
            .any(|r| r.action == Action::Remove && r.version == version)
    }

    /// Registered versions without a tombstone, oldest registration first.
    pub fn live_versions(&self) -> Vec<&str> {
        let removed = self.removed();
        let mut seen = HashSet::new();
        self.records
            .iter()
            .filter(|r| r.action == Action::Register && !removed.contains(r.version.as_str()))
            .filter(|r| seen.insert(r.version.as_str()))
            .map(|r| r.version.as_str())
            .collect()
    }

    /// The version of the newest registration that is not removed.
    pub fn latest(&self) -> Option<&str> {
        let removed = self.removed();
        self.records
            .iter()
            .rev()
            .find(|r| r.action == Action::Register && !removed.contains(r.version.as_str()))
            .map(|r| r.version.as_str())
    }
}

const MAX_ATTEMPTS: usize = 10_000;
const PARALLEL_READS: usize = 16;

pub struct Catalog {
    store: Store,
    backend: Arc<dyn ObjectStore>,
    versions: moka::future::Cache<String, Arc<Registered>>,
    logs: moka::future::Cache<String, Arc<EntryLog>>,
    /// Set once the store has shown it refuses a second conditional create.
    conditional_create: tokio::sync::OnceCell<()>,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Catalog {
    /// Opens the catalog in `store`. Nothing is read or written yet: whether the store
    /// honours conditional create is checked before the first write (a read-only use such
    /// as resolving an entry for a run pays no store writes).
    pub async fn open(store: &Store) -> Result<Catalog, CatalogError> {
        Ok(Catalog {
            store: store.clone(),
            backend: store.backend().clone(),
            versions: moka::future::Cache::builder().max_capacity(10_000).build(),
            logs: moka::future::Cache::builder()
                .max_capacity(10_000)
                .time_to_live(Duration::from_secs(2))
                .build(),
            conditional_create: tokio::sync::OnceCell::new(),
        })
    }

    /// Checks once that the store refuses a second conditional create of one object: the
    /// catalog's appends are compare-and-swaps built on it, and a store that silently
    /// overwrites would lose registrations.
    async fn check_conditional_create(&self) -> Result<(), CatalogError> {
        self.conditional_create
            .get_or_try_init(|| async {
                let probe = ObjectPath::from(format!(
                    "catalog/.probe/{}-{}",
                    std::process::id(),
                    SystemTime::now()
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map(|d| d.as_nanos())
                        .unwrap_or(0)
                ));
                let create = || PutOptions {
                    mode: PutMode::Create,
                    ..Default::default()
                };
                self.backend
                    .put_opts(&probe, PutPayload::from_static(b"1"), create())
                    .await
                    .map_err(be(&probe))?;
                let second = self
                    .backend
                    .put_opts(&probe, PutPayload::from_static(b"2"), create())
                    .await;
                let _ = self.backend.delete(&probe).await;
                match second {
                    Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
                    Ok(_) => Err(CatalogError::NoConditionalPut(self.store.describe())),
                    Err(e) => Err(be(&probe)(e)),
                }
            })
            .await
            .map(|_| ())
    }

    fn version_key(id: &str, version: &str) -> ObjectPath {
        ObjectPath::from(format!("catalog/{id}/versions/{version}.json"))
    }

    fn log_prefix(id: &str) -> ObjectPath {
        ObjectPath::from(format!("catalog/{id}/log"))
    }

    fn log_key(id: &str, seq: u64) -> ObjectPath {
        ObjectPath::from(format!("catalog/{id}/log/{seq:020}"))
    }

    async fn create(&self, key: &ObjectPath, body: Vec<u8>) -> Result<bool, CatalogError> {
        self.check_conditional_create().await?;
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .backend
            .put_opts(key, PutPayload::from(body), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(be(key)(e)),
        }
    }

    async fn list_names(&self, prefix: &ObjectPath) -> Result<Vec<String>, CatalogError> {
        let metas: Vec<_> = self
            .backend
            .list(Some(prefix))
            .try_collect()
            .await
            .map_err(be(prefix))?;
        Ok(metas
            .into_iter()
            .filter_map(|m| m.location.filename().map(str::to_string))
            .collect())
    }

    async fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        key: &ObjectPath,
    ) -> Result<Option<T>, CatalogError> {
        let bytes: Bytes = match self.backend.get(key).await {
            Ok(r) => r.bytes().await.map_err(be(key))?,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(be(key)(e)),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| CatalogError::Corrupt {
                key: key.to_string(),
                reason: e.to_string(),
            })
    }

    /// Registers `entry` on behalf of `by` (who the record and the log name as the
    /// registrant; the caller decides, e.g. the local user): checks its layers exist
    /// (resolving ID prefixes to full IDs), assigns the next `vN` unless it names a
    /// version, then appends to the log.
    pub async fn register(&self, mut entry: Entry, by: &str) -> Result<Registered, CatalogError> {
        entry.validate()?;
        let id = entry.id.clone();
        let resolve = |text: String| {
            let id = id.clone();
            async move {
                self.store
                    .resolve_layer(&text)
                    .await
                    .map(|d| d.to_hex())
                    .map_err(|e| match e {
                        strata_store::StoreError::LayerNotFound(_)
                        | strata_store::StoreError::AmbiguousLayer { .. } => {
                            CatalogError::MissingLayer { id, layer: text }
                        }
                        e => e.into(),
                    })
            }
        };
        entry.base = resolve(entry.base.clone()).await?;
        if let Some(w) = entry.workspace.take() {
            entry.workspace = Some(resolve(w).await?);
        }
        let mut toolkits = Vec::new();
        for t in std::mem::take(&mut entry.toolkits) {
            toolkits.push(resolve(t).await?);
        }
        entry.toolkits = toolkits;
        if let Some(e) = entry.evaluator.as_mut() {
            if let Some(layer) = e.layer.take() {
                e.layer = Some(resolve(layer).await?);
            }
        }
        for layer in entry.all_layers() {
            let d = layer
                .parse()
                .map_err(|_| CatalogError::Invalid(format!("bad layer ID {layer}")))?;
            if !self.store.has_layer(&d).await? {
                return Err(CatalogError::MissingLayer {
                    id: id.clone(),
                    layer: layer.to_string(),
                });
            }
        }

        let by = by.to_string();
        let at = now();
        let registered = match entry.version.clone() {
            Some(v) => {
                let r = Registered {
                    entry: entry.clone(),
                    version: v.clone(),
                    registered_at: at,
                    registered_by: by.clone(),
                };
                if !self.create(&Self::version_key(&id, &v), json(&r)?).await? {
                    return Err(CatalogError::VersionExists { id, version: v });
                }
                r
            }
            None => {
                let mut n = self.max_numbered_version(&id).await? + 1;
                let mut attempts = 0;
                loop {
                    let v = format!("v{n}");
                    let mut e = entry.clone();
                    e.version = Some(v.clone());
                    let r = Registered {
                        entry: e,
                        version: v.clone(),
                        registered_at: at,
                        registered_by: by.clone(),
                    };
                    if self.create(&Self::version_key(&id, &v), json(&r)?).await? {
                        break r;
                    }
                    n += 1;
                    attempts += 1;
                    if attempts > MAX_ATTEMPTS {
                        return Err(CatalogError::Contended(id));
                    }
                }
            }
        };
        self.append_log(&id, &registered.version, Action::Register, at, &by)
            .await?;
        self.logs.invalidate(&id).await;
        Ok(registered)
    }

    /// Removes `namespace/name@version`, or every version of `namespace/name`, on behalf
    /// of `by`, by appending a tombstone per version to the log. Returns the references
    /// removed. The layers stay in the store (see `strata layer rm`).
    pub async fn remove(&self, reference: &str, by: &str) -> Result<Vec<String>, CatalogError> {
        let (id, version) = parse_ref(reference)?;
        let log = self.read_log(&id).await?;
        let versions: Vec<String> = match version {
            Some(v) => {
                let reference = format!("{id}@{v}");
                if log.is_removed(&v) {
                    return Err(CatalogError::Removed { reference, id });
                }
                if self
                    .get_json::<Registered>(&Self::version_key(&id, &v))
                    .await?
                    .is_none()
                {
                    return Err(CatalogError::NotFound(reference));
                }
                vec![v]
            }
            None => {
                let live: Vec<String> = log
                    .live_versions()
                    .into_iter()
                    .map(str::to_string)
                    .collect();
                if live.is_empty() {
                    return Err(if log.records.is_empty() {
                        CatalogError::NotFound(id)
                    } else {
                        CatalogError::AllRemoved(id)
                    });
                }
                live
            }
        };
        let at = now();
        let mut removed = Vec::new();
        for v in versions {
            self.append_log(&id, &v, Action::Remove, at, by).await?;
            removed.push(format!("{id}@{v}"));
        }
        self.logs.invalidate(&id).await;
        Ok(removed)
    }

    async fn max_numbered_version(&self, id: &str) -> Result<u64, CatalogError> {
        let names = self
            .list_names(&ObjectPath::from(format!("catalog/{id}/versions")))
            .await?;
        Ok(names
            .iter()
            .filter_map(|n| {
                n.strip_suffix(".json")?
                    .strip_prefix('v')?
                    .parse::<u64>()
                    .ok()
            })
            .max()
            .unwrap_or(0))
    }

    async fn log_seqs(&self, id: &str) -> Result<Vec<u64>, CatalogError> {
        let mut seqs: Vec<u64> = self
            .list_names(&Self::log_prefix(id))
            .await?
            .iter()
            .filter_map(|n| n.parse().ok())
            .collect();
        seqs.sort_unstable();
        Ok(seqs)
    }

    /// The compare-and-swap: create `log/<last+1>`; if another writer took it, re-read.
    async fn append_log(
        &self,
        id: &str,
        version: &str,
        action: Action,
        at: u64,
        by: &str,
    ) -> Result<(), CatalogError> {
        let mut next = self.log_seqs(id).await?.last().map_or(1, |s| s + 1);
        for _ in 0..MAX_ATTEMPTS {
            let rec = LogRecord {
                seq: next,
                version: version.to_string(),
                at,
                by: by.to_string(),
                action,
            };
            if self.create(&Self::log_key(id, next), json(&rec)?).await? {
                return Ok(());
            }
            next = self
                .log_seqs(id)
                .await?
                .last()
                .map_or(next, |s| s + 1)
                .max(next + 1);
        }
        Err(CatalogError::Contended(id.to_string()))
    }

    /// An entry's whole log, read afresh: one list, then the records in parallel.
    async fn read_log(&self, id: &str) -> Result<EntryLog, CatalogError> {
        let records: Vec<Option<LogRecord>> = futures::stream::iter(self.log_seqs(id).await?)
            .map(|seq| async move { self.get_json::<LogRecord>(&Self::log_key(id, seq)).await })
            .buffered(PARALLEL_READS)
            .try_collect()
            .await?;
        Ok(EntryLog {
            records: records.into_iter().flatten().collect(),
        })
    }

    /// An entry's log, as read at most a couple of seconds ago.
    async fn cached_log(&self, id: &str) -> Result<Arc<EntryLog>, CatalogError> {
        if let Some(log) = self.logs.get(id).await {
            return Ok(log);
        }
        let log = Arc::new(self.read_log(id).await?);
        self.logs.insert(id.to_string(), log.clone()).await;
        Ok(log)
    }

    /// The log, oldest first: every registration and removal.
    pub async fn history(&self, id: &str) -> Result<Vec<LogRecord>, CatalogError> {
        entry::validate_id(id)?;
        let log = self.read_log(id).await?;
        if log.records.is_empty() {
            return Err(CatalogError::NotFound(id.to_string()));
        }
        Ok(log.records)
    }

    /// Resolves `namespace/name` (the newest version not removed) or
    /// `namespace/name@version` (unless removed).
    pub async fn get(&self, reference: &str) -> Result<Arc<Registered>, CatalogError> {
        let (id, version) = parse_ref(reference)?;
        let log = self.cached_log(&id).await?;
        let version = match version {
            Some(v) if log.is_removed(&v) => {
                return Err(CatalogError::Removed {
                    reference: format!("{id}@{v}"),
                    id,
                })
            }
            Some(v) => v,
            None => match log.latest() {
                Some(v) => v.to_string(),
                None if log.records.is_empty() => return Err(CatalogError::NotFound(id)),
                None => return Err(CatalogError::AllRemoved(id)),
            },
        };
        let key = format!("{id}@{version}");
        if let Some(r) = self.versions.get(&key).await {
            return Ok(r);
        }
        let r: Registered = self
            .get_json(&Self::version_key(&id, &version))
            .await?
            .ok_or_else(|| CatalogError::NotFound(key.clone()))?;
        let r = Arc::new(r);
        self.versions.insert(key, r.clone()).await;
        Ok(r)
    }

    /// IDs of the entries starting with `prefix` that have a version left, sorted.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, CatalogError> {
        let logs = self.logs_under(prefix).await?;
        Ok(logs
            .into_iter()
            .filter(|(_, log)| log.latest().is_some())
            .map(|(id, _)| id)
            .collect())
    }

    /// Every version not removed of every entry, with the layers of each that are among
    /// `layers`: for each of those layers, the references (`namespace/name@version`) of
    /// the versions whose stack holds it, sorted.
    pub async fn users_of(
        &self,
        layers: &[Digest],
    ) -> Result<BTreeMap<Digest, Vec<String>>, CatalogError> {
        let wanted: HashSet<String> = layers.iter().map(Digest::to_hex).collect();
        let mut refs = Vec::new();
        for (id, log) in self.logs_under("").await? {
            for v in log.live_versions() {
                refs.push(format!("{id}@{v}"));
            }
        }
        let entries: Vec<Arc<Registered>> = futures::stream::iter(refs)
            .map(|r| async move { self.get(&r).await })
            .buffered(PARALLEL_READS)
            .try_collect()
            .await?;
        let mut users: BTreeMap<Digest, Vec<String>> = BTreeMap::new();
        for r in entries {
            for layer in r.entry.all_layers() {
                if wanted.contains(layer) {
                    if let Ok(d) = layer.parse::<Digest>() {
                        users.entry(d).or_default().push(r.reference());
                    }
                }
            }
        }
        for refs in users.values_mut() {
            refs.sort();
            refs.dedup();
        }
        Ok(users)
    }

    /// The logs of every entry whose ID starts with `prefix`, sorted by ID.
    async fn logs_under(&self, prefix: &str) -> Result<Vec<(String, Arc<EntryLog>)>, CatalogError> {
        let ids = self.ids_under(prefix).await?;
        futures::stream::iter(ids)
            .map(|id| async move {
                let log = self.cached_log(&id).await?;
                Ok::<_, CatalogError>((id, log))
            })
            .buffered(PARALLEL_READS)
            .try_collect()
            .await
    }

    /// IDs of every entry with a log, removed or not, starting with `prefix`, sorted.
    async fn ids_under(&self, prefix: &str) -> Result<Vec<String>, CatalogError> {
        let root = ObjectPath::from("catalog");
        let metas: Vec<_> = self
            .backend
            .list(Some(&root))
            .try_collect()
            .await
            .map_err(be(&root))?;
        let mut ids: Vec<String> = metas
            .iter()
            .filter_map(|m| {
                let parts: Vec<String> =
                    m.location.parts().map(|p| p.as_ref().to_string()).collect();
                (parts.len() == 5 && parts[3] == "log")
                    .then(|| format!("{}/{}", parts[1], parts[2]))
            })
            .filter(|id| id.starts_with(prefix))
            .collect();
        ids.sort();
        ids.dedup();
        Ok(ids)
    }
}

fn json<T: Serialize>(v: &T) -> Result<Vec<u8>, CatalogError> {
    serde_json::to_vec_pretty(v).map_err(|e| CatalogError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_store::manifest::FORMAT_VERSION;
    use strata_store::{LayerManifest, Provenance, StoreUrl};

    /// A real (empty) layer in `store`, distinct per `seed`.
    async fn layer(store: &Store, seed: u8) -> String {
        let metadata = store.put_metadata(vec![seed; 4096]).await.unwrap();
        let mut m = LayerManifest {
            format: FORMAT_VERSION,
            id: Digest([0; 32]),
            metadata,
            blob_size: 0,
            logical_bytes: 0,
            files: 0,
            packs: vec![],
            chunks: vec![],
        };
        m.id = m.content_id();
        store.put_layer(&m, &Provenance::default()).await.unwrap();
        m.id.to_hex()
    }

    async fn register(catalog: &Catalog, id: &str, base: &str, workspace: &str) -> String {
        let text = format!("id = \"{id}\"\nbase = \"{base}\"\nworkspace = \"{workspace}\"\n");
        let e = Entry::from_toml(&text, "test").unwrap();
        catalog
            .register(e, "registrar (pid 1)")
            .await
            .unwrap()
            .reference()
    }

    #[tokio::test]
    async fn tombstones_hide_versions_from_resolution_but_not_from_history() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&StoreUrl::Local(dir.path().into())).unwrap();
        let catalog = Catalog::open(&store).await.unwrap();
        let base = layer(&store, 1).await;
        let ws: Vec<String> = futures::future::join_all((2..5).map(|s| layer(&store, s))).await;
        for w in &ws {
            register(&catalog, "demo/app", &base, w).await;
        }
        register(&catalog, "demo/other", &base, &ws[0]).await;
        assert_eq!(catalog.get("demo/app").await.unwrap().version, "v3");

        // Removing the newest moves "latest" back; a pinned get of it names the removal.
        assert_eq!(
            catalog.remove("demo/app@v3", "remover").await.unwrap(),
            vec!["demo/app@v3"]
        );
        assert_eq!(catalog.get("demo/app").await.unwrap().version, "v2");
        let err = catalog.get("demo/app@v3").await.unwrap_err();
        assert!(
            matches!(&err, CatalogError::Removed { reference, .. } if reference == "demo/app@v3"),
            "{err}"
        );
        assert!(err.to_string().contains("was removed"), "{err}");
        assert!(matches!(
            catalog.remove("demo/app@v3", "remover").await,
            Err(CatalogError::Removed { .. })
        ));
        assert!(matches!(
            catalog.remove("demo/app@v9", "remover").await,
            Err(CatalogError::NotFound(_))
        ));
        // The name is never handed out again.
        assert_eq!(
            register(&catalog, "demo/app", &base, &ws[2]).await,
            "demo/app@v4"
        );
        assert_eq!(catalog.get("demo/app").await.unwrap().version, "v4");

        // Who uses which layer: only versions not removed.
        let ids: Vec<Digest> = ws.iter().map(|w| w.parse().unwrap()).collect();
        let users = catalog.users_of(&ids).await.unwrap();
        assert_eq!(users[&ids[0]], vec!["demo/app@v1", "demo/other@v1"]);
        assert_eq!(users[&ids[1]], vec!["demo/app@v2"]);
        assert_eq!(users[&ids[2]], vec!["demo/app@v4"]);

        // Removing the whole entry tombstones every version left; ls drops it.
        assert_eq!(
            catalog.remove("demo/app", "remover").await.unwrap(),
            vec!["demo/app@v1", "demo/app@v2", "demo/app@v4"]
        );
        assert!(matches!(
            catalog.get("demo/app").await,
            Err(CatalogError::AllRemoved(_))
        ));
        assert!(matches!(
            catalog.remove("demo/app", "remover").await,
            Err(CatalogError::AllRemoved(_))
        ));
        assert_eq!(catalog.list("demo/").await.unwrap(), vec!["demo/other"]);
        let users = catalog.users_of(&ids).await.unwrap();
        assert_eq!(users.get(&ids[0]), Some(&vec!["demo/other@v1".to_string()]));
        assert!(!users.contains_key(&ids[1]) && !users.contains_key(&ids[2]));

        let h = catalog.history("demo/app").await.unwrap();
        let lines: Vec<(u64, &str, Action)> = h
            .iter()
            .map(|r| (r.seq, r.version.as_str(), r.action))
            .collect();
        use Action::{Register as R, Remove as X};
        assert_eq!(
            lines,
            vec![
                (1, "v1", R),
                (2, "v2", R),
                (3, "v3", R),
                (4, "v3", X),
                (5, "v4", R),
                (6, "v1", X),
                (7, "v2", X),
                (8, "v4", X)
            ]
        );
        // Each record names whom the caller said it acted for.
        assert!(h.iter().all(|r| r.by
            == if r.action == R {
                "registrar (pid 1)"
            } else {
                "remover"
            }));
        assert_eq!(
            catalog.get("demo/other").await.unwrap().registered_by,
            "registrar (pid 1)"
        );
    }

    #[test]
    fn a_tombstone_counts_wherever_it_is_in_the_log() {
        let rec = |seq, version: &str, action| LogRecord {
            seq,
            version: version.into(),
            at: 0,
            by: String::new(),
            action,
        };
        // A removal that won the race for its seq against the registration's log append.
        let log = EntryLog {
            records: vec![
                rec(1, "v1", Action::Register),
                rec(2, "v2", Action::Remove),
                rec(3, "v2", Action::Register),
            ],
        };
        assert_eq!(log.latest(), Some("v1"));
        assert_eq!(log.live_versions(), vec!["v1"]);
        assert!(log.is_removed("v2"));
        // Records written before removal existed read as registrations.
        let old: LogRecord =
            serde_json::from_str(r#"{"seq":1,"version":"v1","at":5,"by":"me"}"#).unwrap();
        assert_eq!(old.action, Action::Register);
    }
}
