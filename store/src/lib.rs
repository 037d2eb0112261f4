//! Strata's store: chunk packs, metadata images, layer manifests and provenance records on
//! an object store (a local directory by default, any S3-compatible store by URL).
//!
//! Object layout, all content-addressed except leases and the GC marker:
//! - `packs/<aa>/<digest>`: lz4 chunks appended back to back (see [`pack`]);
//! - `meta/<aa>/<digest>`: a layer's EROFS metadata image;
//! - `layers/<id>.json`: the layer manifest, written last: a layer exists once it does;
//! - `layers/<id>.provenance.json`: where the layer came from;
//! - `layers/<id>.prefetch.json`, `layers/<id>.prefetch.pack`, `builds/<key>.json`: a
//!   layer's prefetch list and its chunks packed in that order (see [`prefetch`]), and the
//!   step builds that made it (mutable records);
//! - `leases/<uuid>.json`, `gc/running`: the build/GC handshake (see [`maintenance`]).
//!
//! Nothing is ever rewritten in place: a layer goes away only by [`Store::remove_layers`]
//! (its manifest and records), and what no remaining manifest references is deleted by
//! [`gc`].

pub mod chunk;
mod digest;
pub mod gc;
mod location;
pub mod maintenance;
pub mod manifest;
pub mod pack;
pub mod prefetch;

use std::sync::Arc;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::Serialize;

pub use digest::{Digest, ParseDigestError};
pub use location::StoreUrl;
pub use manifest::{ChunkEntry, LayerManifest, ManifestError, MetadataRef, Provenance};
pub use prefetch::{PackedAt, PrefetchList};

/// What can go wrong talking to the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store URL `{url}`: {reason}")]
    Url { url: String, reason: String },
    #[error("store {op} of `{key}` failed: {source}")]
    Backend {
        op: &'static str,
        key: String,
        #[source]
        source: object_store::Error,
    },
    #[error("store {op} of `{key}`: no space left on the store's disk; free space there (`strata store gc` deletes what no layer references) or point --store / STRATA_STORE at a larger one")]
    Full { op: &'static str, key: String },
    #[error("layer `{0}` is not in the store (see `strata layer ls`)")]
    LayerNotFound(String),
    #[error("layer prefix `{prefix}` matches {count} layers; give more digits")]
    AmbiguousLayer { prefix: String, count: usize },
    #[error("`{name}` names {} layers ({}); use a layer ID", ids.len(), ids.join(", "))]
    AmbiguousLayerName { name: String, ids: Vec<String> },
    #[error("{what} is corrupt: {reason}. Run `strata store verify` to list every damaged object, then rebuild the affected layers")]
    Corrupt { what: String, reason: String },
    #[error("{what} is missing from the store (object `{key}`); rebuild the affected layers")]
    Missing { what: String, key: String },
    #[error("layer {id}: {source}")]
    Manifest {
        id: String,
        #[source]
        source: ManifestError,
    },
    #[error("object `{key}` is not valid JSON: {source}")]
    Json {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{0}")]
    Busy(String),
    #[error("local store at {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// What [`Store::remove_layers`] deleted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RemovedLayers {
    pub layers: Vec<Digest>,
    /// Build-cache records (`builds/<key>.json`) that named a removed layer.
    pub build_records: u64,
}

/// A handle on one store. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    backend: Arc<dyn ObjectStore>,
    url: StoreUrl,
    tuning: StoreTuning,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({})", self.describe())
    }
}

fn backend_err(
    op: &'static str,
    key: &ObjectPath,
) -> impl FnOnce(object_store::Error) -> StoreError {
    let key = key.to_string();
    move |source| {
        if is_disk_full(&source) {
            StoreError::Full { op, key }
        } else {
            StoreError::Backend { op, key, source }
        }
    }
}

/// Whether an error was caused by a full disk (or a spent quota) under the backend.
fn is_disk_full(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>().is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
            )
        }) {
            return true;
        }
        cause = c.source();
    }
    false
}

fn shard(prefix: &str, d: &Digest) -> ObjectPath {
    let hex = d.to_hex();
    ObjectPath::from(format!("{prefix}/{}/{hex}", &hex[..2]))
}

/// How to open a store, beyond its URL: what the caller decided from its own settings.
/// Unset request settings take the defaults of the store's kind ([`StoreTuning::local`],
/// [`StoreTuning::remote`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreOptions {
    /// The S3 region when the URL names none (`?region=R`); without either, `us-east-1`.
    /// The `strata` binary passes `AWS_REGION` (or `AWS_DEFAULT_REGION`) here.
    pub region: Option<String>,
    /// Requests one bulk reader (a layer's prefetch, an export) keeps in flight.
    pub concurrency: Option<usize>,
    /// The least one read of a pack asks for: neighbouring chunks come along up to it.
    pub range_bytes: Option<u64>,
    /// How long one request may take, retries included, before it fails.
    pub request_timeout: Option<std::time::Duration>,
}

impl StoreOptions {
    /// The region an S3 store at `url` is opened in: the URL's, else this default, else
    /// `us-east-1` (what S3-compatible servers accept when they ignore regions).
    pub fn region_for(&self, url_region: Option<&str>) -> String {
        url_region
            .or(self.region.as_deref())
            .unwrap_or("us-east-1")
            .to_string()
    }

    /// The request shape for a store at `url`: these options over its kind's defaults.
    /// Zero values are refused by the caller's settings; here they are raised to one.
    pub fn tuning_for(&self, url: &StoreUrl) -> StoreTuning {
        let d = match url {
            StoreUrl::Local(_) => StoreTuning::local(),
            StoreUrl::S3 { .. } => StoreTuning::remote(),
        };
        StoreTuning {
            concurrency: self.concurrency.unwrap_or(d.concurrency).max(1),
            range_bytes: self.range_bytes.unwrap_or(d.range_bytes).max(4096),
            request_timeout: self.request_timeout.unwrap_or(d.request_timeout),
        }
    }
}

/// How reads of a store are shaped. A local directory answers a read in microseconds and
/// gains nothing from large or many parallel requests; an object store answers in
/// milliseconds whatever the size, so its readers ask for more at once, more often.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreTuning {
    /// Requests one bulk reader keeps in flight.
    pub concurrency: usize,
    /// The least one read of a pack asks for.
    pub range_bytes: u64,
    /// How long one request may take, retries included.
    pub request_timeout: std::time::Duration,
}

impl StoreTuning {
    /// A directory on this machine: 1 MiB reads (measured fastest for lazyfs on local
    /// disk), a few at a time.
    pub fn local() -> StoreTuning {
        StoreTuning {
            concurrency: 8,
            range_bytes: 1 << 20,
            request_timeout: std::time::Duration::from_secs(30),
        }
    }

    /// An S3-compatible store: the same 1 MiB ranges, 32 in flight. Its round trips are
    /// hidden by parallel requests; larger ranges cost more than they save (measured
    /// against radosgw: 4 MiB ranges fetched 64 MB for a first Python start where 1 MiB
    /// fetched 37 MB, and took 1.12 s against 0.91 s).
    pub fn remote() -> StoreTuning {
        StoreTuning {
            concurrency: 32,
            range_bytes: 1 << 20,
            request_timeout: std::time::Duration::from_secs(30),
        }
    }
}

/// One read of a pack: bytes `start..end` holding the layer's chunks `chunks`.
#[derive(Debug, PartialEq, Eq)]
struct PackRun {
    pack: u32,
    start: u64,
    end: u64,
    chunks: Vec<usize>,
}

/// Bytes of other layers' chunks a read may carry between two of this layer's before it is
/// cheaper to split it.
const RUN_GAP: u64 = 64 << 10;

/// The reads covering every chunk of `layer`: per pack, in pack order, neighbours merged
/// up to `range` bytes (a chunk larger than that is one read alone).
fn pack_runs(layer: &LayerManifest, range: u64) -> Vec<PackRun> {
    let mut order: Vec<usize> = (0..layer.chunks.len()).collect();
    order.sort_by_key(|&i| (layer.chunks[i].pack, layer.chunks[i].pack_offset));
    let mut runs: Vec<PackRun> = Vec::new();
    for i in order {
        let c = &layer.chunks[i];
        let end = c.pack_offset + c.stored_length as u64;
        if let Some(r) = runs.last_mut() {
            if r.pack == c.pack
                && c.pack_offset <= r.end + RUN_GAP
                && end.max(r.end) - r.start <= range
            {
                r.end = r.end.max(end);
                r.chunks.push(i);
                continue;
            }
        }
        runs.push(PackRun {
            pack: c.pack,
            start: c.pack_offset,
            end,
            chunks: vec![i],
        });
    }
    runs
}

impl Store {
    /// Opens (creating if needed, for a local directory) the store at `url`, with default
    /// [`StoreOptions`].
    pub fn open(url: &StoreUrl) -> Result<Store> {
        Store::open_with(url, &StoreOptions::default())
    }

    /// Opens the store at `url` with `options`. S3 credentials and other `AWS_*` settings
    /// are read from the environment by `object_store` itself.
    pub fn open_with(url: &StoreUrl, options: &StoreOptions) -> Result<Store> {
        let tuning = options.tuning_for(url);
        let backend: Arc<dyn ObjectStore> = match url {
            StoreUrl::Local(dir) => {
                std::fs::create_dir_all(dir).map_err(|source| StoreError::Io {
                    path: dir.display().to_string(),
                    source,
                })?;
                let fs = object_store::local::LocalFileSystem::new_with_prefix(dir).map_err(
                    |source| StoreError::Backend {
                        op: "open",
                        key: dir.display().to_string(),
                        source,
                    },
                )?;
                Arc::new(fs)
            }
            StoreUrl::S3 {
                bucket,
                endpoint,
                region,
                prefix,
            } => {
                // One key, not `with_client_options`: that would replace the client
                // options the environment and `with_allow_http` set.
                let mut b = object_store::aws::AmazonS3Builder::from_env()
                    .with_config(
                        object_store::aws::AmazonS3ConfigKey::Client(
                            object_store::ClientConfigKey::Timeout,
                        ),
                        format!("{}ms", tuning.request_timeout.as_millis().max(1)),
                    )
                    .with_bucket_name(bucket)
                    .with_conditional_put(object_store::aws::S3ConditionalPut::ETagMatch);
                if let Some(e) = endpoint {
                    let plain = e.starts_with("http://");
                    b = b
                        .with_endpoint(e)
                        .with_allow_http(plain)
                        .with_virtual_hosted_style_request(false);
                    if plain {
                        // No TLS to verify: loading the system's root certificates took
                        // 25-30 ms of every process's first request on a cold host.
                        b = b.with_config(
                            object_store::aws::AmazonS3ConfigKey::Client(
                                object_store::ClientConfigKey::NoSystemCertificates,
                            ),
                            "true",
                        );
                    }
                }
                // A request is retried a few times within its timeout, not object_store's
                // default of ten over three minutes: callers (lazyfs) bound an outage
                // themselves and must hear of it in time.
                b = b
                    .with_region(options.region_for(region.as_deref()))
                    .with_retry(object_store::RetryConfig {
                        backoff: Default::default(),
                        max_retries: 3,
                        retry_timeout: tuning.request_timeout,
                    });
                let s3 = b.build().map_err(|source| StoreError::Backend {
                    op: "open",
                    key: format!("s3://{bucket}"),
                    source,
                })?;
                if prefix.is_empty() {
                    Arc::new(s3)
                } else {
                    Arc::new(object_store::prefix::PrefixStore::new(s3, prefix.as_str()))
                }
            }
        };
        Ok(Store {
            backend,
            url: url.clone(),
            tuning,
        })
    }

    /// How reads of this store are shaped.
    pub fn tuning(&self) -> StoreTuning {
        self.tuning
    }

    pub fn url(&self) -> &StoreUrl {
        &self.url
    }

    /// A human-readable name of the store for logs and errors.
    pub fn describe(&self) -> String {
        match &self.url {
            StoreUrl::Local(p) => p.display().to_string(),
            StoreUrl::S3 {
                bucket, endpoint, ..
            } => match endpoint {
                Some(e) => format!("s3://{bucket} at {e}"),
                None => format!("s3://{bucket}"),
            },
        }
    }

    /// The underlying object store, for the catalog's records.
    pub fn backend(&self) -> &Arc<dyn ObjectStore> {
        &self.backend
    }

    /// Writes an immutable, content-addressed object; an existing object with that name
    /// already has these bytes, so it is left alone.
    async fn put_immutable(&self, key: &ObjectPath, bytes: Bytes) -> Result<bool> {
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .backend
            .put_opts(key, PutPayload::from_bytes(bytes), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(backend_err("put", key)(e)),
        }
    }

    async fn get_bytes(&self, key: &ObjectPath, what: impl FnOnce() -> String) -> Result<Bytes> {
        match self.backend.get(key).await {
            Ok(r) => r.bytes().await.map_err(backend_err("get", key)),
            Err(object_store::Error::NotFound { .. }) => Err(StoreError::Missing {
                what: what(),
                key: key.to_string(),
            }),
            Err(e) => Err(backend_err("get", key)(e)),
        }
    }

    async fn exists(&self, key: &ObjectPath) -> Result<bool> {
        match self.backend.head(key).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(backend_err("head", key)(e)),
        }
    }

    // ---- packs ----

    pub fn pack_key(id: &Digest) -> ObjectPath {
        shard("packs", id)
    }

    /// Uploads a pack unless it is already there. Returns whether bytes were written.
    pub async fn put_pack(&self, pack: &pack::Pack) -> Result<bool> {
        self.put_immutable(&Self::pack_key(&pack.id), pack.bytes.clone())
            .await
    }

    /// Reads a byte range of a pack (unverified: callers verify per chunk).
    pub async fn read_pack_range(&self, pack: &Digest, offset: u64, len: u64) -> Result<Bytes> {
        self.get_range_exact(&Self::pack_key(pack), offset, len, || {
            format!("pack {pack}")
        })
        .await
    }

    /// Exactly `len` bytes of object `key` at `offset`; fewer is [`StoreError::Corrupt`]
    /// (a truncated object), none is [`StoreError::Missing`] naming `what`.
    async fn get_range_exact(
        &self,
        key: &ObjectPath,
        offset: u64,
        len: u64,
        what: impl Fn() -> String,
    ) -> Result<Bytes> {
        match self.backend.get_range(key, offset..offset + len).await {
            Ok(b) if b.len() as u64 == len => Ok(b),
            Ok(b) => Err(StoreError::Corrupt {
                what: what(),
                reason: format!(
                    "range {offset}+{len} returned {} bytes (truncated?)",
                    b.len()
                ),
            }),
            Err(object_store::Error::NotFound { .. }) => Err(StoreError::Missing {
                what: what(),
                key: key.to_string(),
            }),
            Err(e) => Err(backend_err("get range", key)(e)),
        }
    }

    /// Reads a whole pack.
    pub async fn read_pack(&self, pack: &Digest) -> Result<Bytes> {
        self.get_bytes(&Self::pack_key(pack), || format!("pack {pack}"))
            .await
    }

    /// Reads and verifies chunk `index` of a layer.
    pub async fn read_chunk(&self, layer: &LayerManifest, index: usize) -> Result<Vec<u8>> {
        let c = &layer.chunks[index];
        let pack = &layer.packs[c.pack as usize];
        let stored = self
            .read_pack_range(pack, c.pack_offset, c.stored_length as u64)
            .await?;
        chunk::decode(&stored, c.length, &c.digest).map_err(|e| StoreError::Corrupt {
            what: format!(
                "chunk {} (pack {pack}, used by layer {})",
                c.digest, layer.id
            ),
            reason: e.to_string(),
        })
    }

    /// Every chunk of `layer`, verified, in batches and in no particular order: each batch
    /// is one read of a pack covering neighbouring chunks of the layer, up to the store's
    /// range size, with the store's concurrency in flight. For bulk readers (export),
    /// where one request per chunk would pay a round trip per chunk.
    pub fn layer_chunks<'a>(
        &'a self,
        layer: &'a LayerManifest,
    ) -> impl futures::Stream<Item = Result<Vec<(usize, Vec<u8>)>>> + 'a {
        use futures::StreamExt;
        let runs = pack_runs(layer, self.tuning.range_bytes);
        futures::stream::iter(runs)
            .map(move |run| async move {
                let pack = &layer.packs[run.pack as usize];
                let bytes = self
                    .read_pack_range(pack, run.start, run.end - run.start)
                    .await?;
                let mut out = Vec::with_capacity(run.chunks.len());
                for i in run.chunks {
                    let c = &layer.chunks[i];
                    let at = (c.pack_offset - run.start) as usize;
                    let data = chunk::decode(
                        &bytes[at..at + c.stored_length as usize],
                        c.length,
                        &c.digest,
                    )
                    .map_err(|e| StoreError::Corrupt {
                        what: format!(
                            "chunk {} (pack {pack}, used by layer {})",
                            c.digest, layer.id
                        ),
                        reason: e.to_string(),
                    })?;
                    out.push((i, data));
                }
                Ok(out)
            })
            .buffer_unordered(self.tuning.concurrency)
    }

    // ---- metadata images ----

    pub fn metadata_key(d: &Digest) -> ObjectPath {
        shard("meta", d)
    }

    pub async fn put_metadata(&self, image: Vec<u8>) -> Result<MetadataRef> {
        let r = MetadataRef {
            digest: Digest::of(&image),
            size: image.len() as u64,
        };
        self.put_immutable(&Self::metadata_key(&r.digest), Bytes::from(image))
            .await?;
        Ok(r)
    }

    /// Reads a metadata image and checks it against its digest.
    pub async fn get_metadata(&self, r: &MetadataRef) -> Result<Bytes> {
        let bytes = self
            .get_bytes(&Self::metadata_key(&r.digest), || {
                format!("metadata image {}", r.digest)
            })
            .await?;
        let actual = Digest::of(&bytes);
        if actual != r.digest {
            return Err(StoreError::Corrupt {
                what: format!("metadata image {}", r.digest),
                reason: format!("content digest is {actual}"),
            });
        }
        Ok(bytes)
    }

    // ---- layers ----

    fn manifest_key(id: &Digest) -> ObjectPath {
        ObjectPath::from(format!("layers/{id}.json"))
    }

    fn provenance_key(id: &Digest) -> ObjectPath {
        ObjectPath::from(format!("layers/{id}.provenance.json"))
    }

    pub async fn has_layer(&self, id: &Digest) -> Result<bool> {
        self.exists(&Self::manifest_key(id)).await
    }

    /// Commits a layer: provenance first, manifest last, so a layer is visible only when
    /// everything it points at is stored. An existing manifest for the same ID is kept.
    pub async fn put_layer(
        &self,
        manifest: &LayerManifest,
        provenance: &Provenance,
    ) -> Result<bool> {
        manifest.validate().map_err(|source| StoreError::Manifest {
            id: manifest.id.to_hex(),
            source,
        })?;
        if self.has_layer(&manifest.id).await? {
            return Ok(false);
        }
        let prov = serde_json::to_vec_pretty(provenance).map_err(|source| StoreError::Json {
            key: Self::provenance_key(&manifest.id).to_string(),
            source,
        })?;
        self.backend
            .put(&Self::provenance_key(&manifest.id), PutPayload::from(prov))
            .await
            .map_err(backend_err("put", &Self::provenance_key(&manifest.id)))?;
        let body = serde_json::to_vec(manifest).map_err(|source| StoreError::Json {
            key: Self::manifest_key(&manifest.id).to_string(),
            source,
        })?;
        self.put_immutable(&Self::manifest_key(&manifest.id), Bytes::from(body))
            .await
    }

    /// Reads and validates a layer manifest.
    pub async fn get_layer(&self, id: &Digest) -> Result<LayerManifest> {
        let key = Self::manifest_key(id);
        let bytes = match self.backend.get(&key).await {
            Ok(r) => r.bytes().await.map_err(backend_err("get", &key))?,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(StoreError::LayerNotFound(id.to_hex()))
            }
            Err(e) => return Err(backend_err("get", &key)(e)),
        };
        let m: LayerManifest =
            serde_json::from_slice(&bytes).map_err(|source| StoreError::Json {
                key: key.to_string(),
                source,
            })?;
        if &m.id != id {
            return Err(StoreError::Corrupt {
                what: format!("manifest of layer {id}"),
                reason: format!("it describes layer {}", m.id),
            });
        }
        m.validate().map_err(|source| StoreError::Manifest {
            id: id.to_hex(),
            source,
        })?;
        Ok(m)
    }

    pub async fn get_provenance(&self, id: &Digest) -> Result<Provenance> {
        let key = Self::provenance_key(id);
        let bytes = self
            .get_bytes(&key, || format!("provenance of layer {id}"))
            .await?;
        serde_json::from_slice(&bytes).map_err(|source| StoreError::Json {
            key: key.to_string(),
            source,
        })
    }

    /// Removes layers: each manifest first (the layer stops existing at that instant),
    /// then its provenance and prefetch list, then every build-cache record that names
    /// it. Fails before removing anything if one of `ids` is not in the store. The
    /// chunks and images stay until [`Store::gc`] finds nothing references them; who
    /// still uses a layer (catalog versions, sandboxes) is for the caller to check.
    pub async fn remove_layers(&self, ids: &[Digest]) -> Result<RemovedLayers> {
        for id in ids {
            if !self.has_layer(id).await? {
                return Err(StoreError::LayerNotFound(id.to_hex()));
            }
        }
        let mut removed = RemovedLayers::default();
        for id in ids {
            if self.delete_if_present(&Self::manifest_key(id)).await? {
                removed.layers.push(*id);
            }
            self.delete_if_present(&Self::provenance_key(id)).await?;
            self.remove_prefetch(id).await?;
        }
        for (obj, layer) in self.build_records().await? {
            if layer.is_some_and(|l| ids.contains(&l))
                && self.delete_if_present(&obj.location).await?
            {
                removed.build_records += 1;
            }
        }
        Ok(removed)
    }

    /// Deletes an object; `false` if it was not there.
    async fn delete_if_present(&self, key: &ObjectPath) -> Result<bool> {
        match self.backend.delete(key).await {
            Ok(()) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(backend_err("delete", key)(e)),
        }
    }

    /// Writes a small mutable JSON record.
    async fn put_record<T: serde::Serialize>(&self, key: &ObjectPath, value: &T) -> Result<()> {
        let body = serde_json::to_vec(value).map_err(|source| StoreError::Json {
            key: key.to_string(),
            source,
        })?;
        self.backend
            .put(key, PutPayload::from(body))
            .await
            .map_err(backend_err("put", key))?;
        Ok(())
    }

    /// Reads a small JSON record; `None` when there is none.
    async fn get_record<T: serde::de::DeserializeOwned>(
        &self,
        key: &ObjectPath,
    ) -> Result<Option<T>> {
        match self.backend.get(key).await {
            Ok(r) => {
                let bytes = r.bytes().await.map_err(backend_err("get", key))?;
                serde_json::from_slice(&bytes)
                    .map(Some)
                    .map_err(|source| StoreError::Json {
                        key: key.to_string(),
                        source,
                    })
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(backend_err("get", key)(e)),
        }
    }

    fn build_record_key(build_key: &Digest) -> ObjectPath {
        ObjectPath::from(format!("builds/{build_key}.json"))
    }

    /// Records that the step build with this key made `layer` (the build cache).
    pub async fn put_build_record(&self, build_key: &Digest, layer: &Digest) -> Result<()> {
        self.put_record(
            &Self::build_record_key(build_key),
            &serde_json::json!({ "layer": layer }),
        )
        .await
    }

    /// The layer a step build with this key made, if one is recorded.
    pub async fn get_build_record(&self, build_key: &Digest) -> Result<Option<Digest>> {
        #[derive(serde::Deserialize)]
        struct Record {
            layer: Digest,
        }
        let record: Option<Record> = self.get_record(&Self::build_record_key(build_key)).await?;
        Ok(record.map(|r| r.layer))
    }

    /// Every build-cache record with the layer it names (`None` if it cannot be read).
    pub(crate) async fn build_records(&self) -> Result<Vec<(ObjectMeta, Option<Digest>)>> {
        #[derive(serde::Deserialize)]
        struct Record {
            layer: Digest,
        }
        let prefix = ObjectPath::from("builds");
        let metas: Vec<ObjectMeta> = self
            .backend
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(backend_err("list", &prefix))?;
        let mut out = Vec::with_capacity(metas.len());
        for meta in metas {
            let record = match self.get_record::<Record>(&meta.location).await {
                Ok(r) => r.map(|r| r.layer),
                Err(StoreError::Json { .. }) => None,
                Err(e) => return Err(e),
            };
            out.push((meta, record));
        }
        Ok(out)
    }

    /// Every committed layer ID, sorted.
    pub async fn list_layers(&self) -> Result<Vec<Digest>> {
        let prefix = ObjectPath::from("layers");
        let metas: Vec<_> = self
            .backend
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(backend_err("list", &prefix))?;
        let mut ids: Vec<Digest> = metas
            .iter()
            .filter_map(|m| {
                let name = m.location.filename()?;
                let stem = name.strip_suffix(".json")?;
                stem.parse().ok()
            })
            .collect();
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    /// The layer whose provenance names it `name` at `version` (`layer build --name
    /// --version`, or a definition's own): every layer's provenance is read, a few at a
    /// time.
    async fn layer_named(&self, name: &str, version: &str) -> Result<Digest> {
        use futures::StreamExt;
        let wanted = (Some(name), Some(version));
        let found: Vec<Result<Option<Digest>>> = futures::stream::iter(self.list_layers().await?)
            .map(|id| async move {
                match self.get_provenance(&id).await {
                    Ok(p) if (p.name.as_deref(), p.version.as_deref()) == wanted => Ok(Some(id)),
                    Ok(_) | Err(StoreError::Missing { .. }) => Ok(None),
                    Err(e) => Err(e),
                }
            })
            .buffer_unordered(16)
            .collect()
            .await;
        let mut ids = Vec::new();
        for f in found {
            ids.extend(f?);
        }
        ids.sort();
        match ids.as_slice() {
            [one] => Ok(*one),
            [] => Err(StoreError::LayerNotFound(format!(
                "{name}@{version}` (no layer's provenance has that name and version; \
                 `strata layer ls` lists them`"
            ))),
            _ => Err(StoreError::AmbiguousLayerName {
                name: format!("{name}@{version}"),
                ids: ids.iter().map(Digest::to_hex).collect(),
            }),
        }
    }

    /// A layer named by its ID, a unique prefix of 8 or more hex digits, or `NAME@VERSION`.
    pub async fn resolve_layer(&self, text: &str) -> Result<Digest> {
        if let Ok(d) = text.parse::<Digest>() {
            return Ok(d);
        }
        if let Some((name, version)) = text.split_once('@') {
            return self.layer_named(name, version).await;
        }
        if text.len() < 8 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(StoreError::LayerNotFound(format!(
                "{text}` (a layer is named by its ID, 64 hex digits or a unique prefix of 8 \
                 or more, or by `NAME@VERSION` from its provenance`"
            )));
        }
        let lower = text.to_ascii_lowercase();
        let matches: Vec<Digest> = self
            .list_layers()
            .await?
            .into_iter()
            .filter(|d| d.to_hex().starts_with(&lower))
            .collect();
        match matches.len() {
            1 => Ok(matches[0]),
            0 => Err(StoreError::LayerNotFound(text.to_string())),
            count => Err(StoreError::AmbiguousLayer {
                prefix: text.to_string(),
                count,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::FORMAT_VERSION;

    pub(crate) async fn sample_layer(store: &Store, text: &[u8]) -> LayerManifest {
        sample_layer_with(store, text, &Provenance::default()).await
    }

    async fn sample_layer_with(store: &Store, text: &[u8], prov: &Provenance) -> LayerManifest {
        let mut b = pack::PackBuilder::new();
        let enc = chunk::encode(text);
        b.push(&enc);
        let p = b.finish();
        store.put_pack(&p).await.unwrap();
        let meta = store.put_metadata(vec![7u8; 4096]).await.unwrap();
        let mut m = LayerManifest {
            format: FORMAT_VERSION,
            id: Digest([0; 32]),
            metadata: meta,
            blob_size: (text.len() as u64).div_ceil(4096) * 4096,
            logical_bytes: text.len() as u64,
            files: 1,
            packs: vec![p.id],
            chunks: vec![ChunkEntry {
                blob_offset: 0,
                length: enc.length,
                digest: enc.digest,
                pack: 0,
                pack_offset: 0,
                stored_length: enc.stored.len() as u32,
            }],
        };
        m.id = m.content_id();
        store.put_layer(&m, prov).await.unwrap();
        m
    }

    #[tokio::test]
    async fn a_layers_chunks_are_read_in_few_large_verified_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open_with(
            &StoreUrl::Local(dir.path().into()),
            &StoreOptions {
                range_bytes: Some(8192),
                ..Default::default()
            },
        )
        .unwrap();
        // Two packs: 12 chunks in the first (one of another layer in the middle, and one
        // used twice), 2 in the second.
        // Incompressible, so the range bound is what splits the reads.
        let noise = |seed: u8, len: usize| {
            let mut out = Vec::new();
            let mut d = Digest::of(&[seed]);
            while out.len() < len {
                d = Digest::of(&d.0);
                out.extend_from_slice(&d.0);
            }
            out.truncate(len);
            out
        };
        let texts: Vec<Vec<u8>> = (0..14u8).map(|i| noise(i, 2000 + i as usize)).collect();
        let encoded: Vec<_> = texts.iter().map(|t| chunk::encode(t)).collect();
        let (mut a, mut b) = (pack::PackBuilder::new(), pack::PackBuilder::new());
        for (i, e) in encoded.iter().enumerate() {
            let builder = if i < 12 { &mut a } else { &mut b };
            builder.push(e);
        }
        let (a, b) = (a.finish(), b.finish());
        let at: Vec<u64> = a.chunks.iter().chain(&b.chunks).map(|c| c.offset).collect();
        store.put_pack(&a).await.unwrap();
        store.put_pack(&b).await.unwrap();
        let mut chunks = Vec::new();
        let mut blob = 0u64;
        for i in (0..14).filter(|&i| i != 5).chain([3]) {
            let e = &encoded[i];
            chunks.push(ChunkEntry {
                blob_offset: blob,
                length: e.length,
                digest: e.digest,
                pack: (i >= 12) as u32,
                pack_offset: at[i],
                stored_length: e.stored.len() as u32,
            });
            blob += (e.length as u64).div_ceil(4096) * 4096;
        }
        let m = LayerManifest {
            format: FORMAT_VERSION,
            id: Digest([1; 32]),
            metadata: store.put_metadata(vec![7u8; 4096]).await.unwrap(),
            blob_size: blob,
            logical_bytes: 0,
            files: 14,
            packs: vec![a.id, b.id],
            chunks,
        };
        let runs = pack_runs(&m, 8192);
        let covered: usize = runs.iter().map(|r| r.chunks.len()).sum();
        assert_eq!(covered, m.chunks.len());
        assert!(runs.len() < m.chunks.len() / 2, "{runs:?}");
        assert!(runs.iter().all(|r| r.end - r.start <= 8192), "{runs:?}");
        let mut got = vec![None; m.chunks.len()];
        let mut batches = std::pin::pin!(store.layer_chunks(&m));
        while let Some(batch) = batches.try_next().await.unwrap() {
            for (i, data) in batch {
                got[i] = Some(data);
            }
        }
        for (i, c) in m.chunks.iter().enumerate() {
            assert_eq!(Digest::of(got[i].as_ref().unwrap()), c.digest, "chunk {i}");
        }
    }

    #[tokio::test]
    async fn a_layer_is_found_by_the_name_and_version_of_its_provenance() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&StoreUrl::Local(dir.path().into())).unwrap();
        let named = |name: &str, version: &str| Provenance {
            name: Some(name.into()),
            version: Some(version.into()),
            ..Default::default()
        };
        let v1 = sample_layer_with(&store, b"one", &named("tools", "1")).await;
        let v2 = sample_layer_with(&store, b"two", &named("tools", "2")).await;
        sample_layer(&store, b"unnamed").await;
        assert_eq!(store.resolve_layer("tools@1").await.unwrap(), v1.id);
        assert_eq!(store.resolve_layer("tools@2").await.unwrap(), v2.id);
        let err = store.resolve_layer("tools@3").await.unwrap_err();
        assert!(matches!(err, StoreError::LayerNotFound(_)), "{err}");
        assert!(err.to_string().contains("tools@3"), "{err}");
        // Two layers built under one name and version: the name is refused, both named.
        let again = sample_layer_with(&store, b"three", &named("tools", "1")).await;
        let err = store.resolve_layer("tools@1").await.unwrap_err();
        assert!(
            matches!(err, StoreError::AmbiguousLayerName { .. }),
            "{err}"
        );
        for id in [v1.id, again.id] {
            assert!(err.to_string().contains(&id.to_hex()), "{err}");
        }
    }

    #[test]
    fn the_region_is_the_urls_else_the_callers_else_us_east_1() {
        let none = StoreOptions::default();
        let given = StoreOptions {
            region: Some("eu-west-3".into()),
            ..Default::default()
        };
        assert_eq!(none.region_for(None), "us-east-1");
        assert_eq!(given.region_for(None), "eu-west-3");
        assert_eq!(given.region_for(Some("ap-south-1")), "ap-south-1");
        let url = StoreUrl::parse("s3://bkt?endpoint=http://127.0.0.1:1&region=r1").unwrap();
        assert!(Store::open_with(&url, &given).is_ok());
    }

    #[tokio::test]
    async fn layer_round_trip_on_local_store() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&StoreUrl::Local(dir.path().into())).unwrap();
        let m = sample_layer(&store, b"hello layer").await;
        assert_eq!(store.list_layers().await.unwrap(), vec![m.id]);
        assert_eq!(store.get_layer(&m.id).await.unwrap(), m);
        assert_eq!(store.read_chunk(&m, 0).await.unwrap(), b"hello layer");
        let short = &m.id.to_hex()[..10];
        assert_eq!(store.resolve_layer(short).await.unwrap(), m.id);
        assert!(matches!(
            store.get_layer(&Digest::of(b"nope")).await,
            Err(StoreError::LayerNotFound(_))
        ));
    }
}
