//! The catalog: maps `namespace/name[@version]` to an environment (layer stack, backend,
//! budgets, env, commands), stored in the same store as the layers so one store is all a
//! cluster shares.
//!
//! Layout under `catalog/<namespace>/<name>/`:
//! - `versions/<version>.json`: a registered entry, created once (conditional create);
//! - `log/<seq>`: one record per registration, `seq` zero-padded and increasing. The
//!   highest is "latest". Appending is a compare-and-swap built only on conditional create
//!   (`If-None-Match: *` on S3, an atomic link on a local directory): a writer that loses
//!   the race for `seq` re-reads and takes the next one, so no registration is lost, on
//!   either backend, without locks.

pub mod entry;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use strata_store::Store;

pub use entry::{parse_ref, parse_size, Backend, Budgets, DiskImage, Entry};

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("{0}")]
    Invalid(String),
    #[error("catalog entry `{0}` does not exist (see `strata catalog ls`)")]
    NotFound(String),
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

/// One line of an entry's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogRecord {
    pub seq: u64,
    pub version: String,
    pub at: u64,
    pub by: String,
}

const MAX_ATTEMPTS: usize = 10_000;

pub struct Catalog {
    store: Store,
    backend: Arc<dyn ObjectStore>,
    versions: moka::future::Cache<String, Arc<Registered>>,
    latest: moka::future::Cache<String, String>,
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Who is registering: the local user for now (identity comes with the service).
fn who() -> String {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| format!("uid {uid}"));
    format!("{user} (pid {})", std::process::id())
}

impl Catalog {
    /// Opens the catalog in `store`, checking that the store honours conditional create.
    pub async fn open(store: &Store) -> Result<Catalog, CatalogError> {
        let backend = store.backend().clone();
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
        backend
            .put_opts(&probe, PutPayload::from_static(b"1"), create())
            .await
            .map_err(be(&probe))?;
        let second = backend
            .put_opts(&probe, PutPayload::from_static(b"2"), create())
            .await;
        let _ = backend.delete(&probe).await;
        match second {
            Err(object_store::Error::AlreadyExists { .. }) => {}
            Ok(_) => return Err(CatalogError::NoConditionalPut(store.describe())),
            Err(e) => return Err(be(&probe)(e)),
        }
        Ok(Catalog {
            store: store.clone(),
            backend,
            versions: moka::future::Cache::builder().max_capacity(10_000).build(),
            latest: moka::future::Cache::builder()
                .max_capacity(10_000)
                .time_to_live(Duration::from_secs(2))
                .build(),
        })
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

    /// Registers `entry`: checks its layers exist (resolving ID prefixes to full IDs),
    /// assigns the next `vN` unless it names a version, then appends to the log.
    pub async fn register(&self, mut entry: Entry) -> Result<Registered, CatalogError> {
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
        for layer in entry.layers() {
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

        let by = who();
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
        self.append_log(&id, &registered.version, at, &by).await?;
        self.latest.invalidate(&id).await;
        Ok(registered)
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

    /// The registration log, oldest first.
    pub async fn history(&self, id: &str) -> Result<Vec<LogRecord>, CatalogError> {
        entry::validate_id(id)?;
        let mut out = Vec::new();
        for seq in self.log_seqs(id).await? {
            let key = Self::log_key(id, seq);
            if let Some(r) = self.get_json::<LogRecord>(&key).await? {
                out.push(r);
            }
        }
        if out.is_empty() {
            return Err(CatalogError::NotFound(id.to_string()));
        }
        Ok(out)
    }

    /// Resolves `namespace/name` (latest) or `namespace/name@version`.
    pub async fn get(&self, reference: &str) -> Result<Arc<Registered>, CatalogError> {
        let (id, version) = parse_ref(reference)?;
        let version = match version {
            Some(v) => v,
            None => match self.latest.get(&id).await {
                Some(v) => v,
                None => {
                    let seqs = self.log_seqs(&id).await?;
                    let last = seqs
                        .last()
                        .ok_or_else(|| CatalogError::NotFound(id.clone()))?;
                    let rec: LogRecord = self
                        .get_json(&Self::log_key(&id, *last))
                        .await?
                        .ok_or_else(|| CatalogError::NotFound(id.clone()))?;
                    self.latest.insert(id.clone(), rec.version.clone()).await;
                    rec.version
                }
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

    /// Entry IDs starting with `prefix`, sorted.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, CatalogError> {
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
