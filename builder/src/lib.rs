//! Strata's layer builder: turns a base, workspace or toolkit source (directory, tar, OCI
//! image, git revision, definition file) into a reproducible, content-addressed layer: an
//! EROFS metadata image plus file data cut into deduplicated, lz4-compressed chunks, all
//! written to the store with the manifest last.
//!
//! Data flow: [`source`] reads entries into a [`tree::Tree`], sending file bytes through the
//! [`chunker`] to the [`upload::Uploader`]; [`layout`] places file data in the blob;
//! [`erofs`] writes the metadata image; [`build`] commits the manifest.

pub mod chunker;
pub mod erofs;
pub mod export;
pub mod layout;
pub mod source;
pub mod steps;
pub mod tree;
pub mod upload;

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use serde::{Deserialize, Serialize};
use strata_store::manifest::{ChunkEntry, FORMAT_VERSION};
use strata_store::{Digest, LayerManifest, Provenance, Store, StoreError};

pub use source::registry::{RegistryCredentials, RegistrySettings};
pub use source::{Excludes, LayerDefinition, Source};

/// Version of the layer writer. Part of every provenance record: a different writer may lay
/// the same tree out differently.
pub const WRITER_VERSION: &str = concat!("strata-builder ", env!("CARGO_PKG_VERSION"), " erofs-v1");

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    BadEntry { path: String, reason: String },
    #[error("layer definition: {0}")]
    Definition(String),
    #[error("OCI image: {0}")]
    Oci(String),
    #[error("source: {0}")]
    Source(String),
    #[error("layer too large: {0}")]
    TooLarge(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("build step {step} `{command}` exited with status {status}{budget}; its output ends:\n{output}")]
    StepFailed {
        step: usize,
        command: String,
        status: i32,
        budget: String,
        output: String,
    },
    #[error("build sandbox: {0}")]
    Sandbox(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// The role of a layer in a stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    Base,
    Workspace,
    Toolkit,
    /// A sandbox's saved state (`strata sandbox snapshot --to-store`): its machine state
    /// and writable disk as files, restored, never stacked.
    Snapshot,
}

impl std::fmt::Display for LayerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LayerKind::Base => "base",
            LayerKind::Workspace => "workspace",
            LayerKind::Toolkit => "toolkit",
            LayerKind::Snapshot => "snapshot",
        })
    }
}

impl std::str::FromStr for LayerKind {
    type Err = BuildError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "base" => Ok(LayerKind::Base),
            "workspace" => Ok(LayerKind::Workspace),
            "toolkit" => Ok(LayerKind::Toolkit),
            "snapshot" => Err(BuildError::Definition(
                "a snapshot layer is made by `strata sandbox snapshot --to-store`, not built"
                    .into(),
            )),
            other => Err(BuildError::Definition(format!(
                "unknown layer kind `{other}` (base, workspace or toolkit)"
            ))),
        }
    }
}

/// What to build.
#[derive(Debug, Clone)]
pub struct BuildRequest {
    pub source: Source,
    pub kind: LayerKind,
    pub name: Option<String>,
    pub version: Option<String>,
    pub exclude: Vec<String>,
    /// Directory inside the layer that the source's root becomes, e.g. `work` for a
    /// workspace stacked on a base at `/work`. Empty: the layer root.
    pub prefix: Option<String>,
    /// What the provenance record names as the source (default: `source` itself).
    pub source_label: Option<String>,
    /// More provenance fields (a step build's inputs, steps and logs).
    pub provenance: serde_json::Map<String, serde_json::Value>,
    /// How a registry source is pulled (plain-HTTP registries, credentials).
    pub registry: RegistrySettings,
}

impl BuildRequest {
    /// A request from a definition file, with the file's directory as the base of its paths.
    pub fn from_definition(path: &std::path::Path) -> Result<BuildRequest, BuildError> {
        let def = LayerDefinition::load(path)?;
        Ok(BuildRequest {
            source: def.source(path)?,
            kind: def.kind,
            name: def.name.clone(),
            version: def.version.clone(),
            exclude: def.exclude.clone(),
            prefix: def.prefix.clone(),
            source_label: None,
            provenance: Default::default(),
            registry: RegistrySettings::default(),
        })
    }
}

/// The outcome of a build. Field names are part of `strata layer build --json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BuildReport {
    pub id: Digest,
    pub files: u64,
    /// File data in the tree.
    pub logical_bytes: u64,
    /// Bytes newly written to the store (compressed packs, metadata image excluded).
    pub uploaded_bytes: u64,
    /// Uncompressed bytes of the chunks the store did not already have.
    pub new_data_bytes: u64,
    /// Distinct chunks the layer references.
    pub chunks: u64,
    /// Of those, chunks the store already had.
    pub reused_chunks: u64,
    pub metadata_bytes: u64,
    pub blob_bytes: u64,
    /// False when a layer with this ID was already in the store.
    pub created: bool,
    pub seconds: f64,
    /// True when a step build's result came from the build cache.
    pub cache_hit: bool,
    /// A step build's key (definition, input layer IDs, steps).
    pub build_key: Option<Digest>,
    /// Build steps that ran (0 on a cache hit).
    pub steps_run: usize,
}

/// Progress callback: (bytes of file data processed so far).
pub type Progress = Arc<dyn Fn(u64) + Send + Sync>;

/// Builds a layer from `req` into `store`.
pub async fn build(
    store: &Store,
    req: &BuildRequest,
    progress: Option<Progress>,
) -> Result<BuildReport, BuildError> {
    let started = Instant::now();
    let lease = store.begin_build().await?;
    let result = build_leased(store, req, progress, started).await;
    lease.release().await;
    result
}

async fn build_leased(
    store: &Store,
    req: &BuildRequest,
    progress: Option<Progress>,
    started: Instant,
) -> Result<BuildReport, BuildError> {
    let index = store.chunk_index().await?;
    let uploader = Arc::new(upload::Uploader::start(store.clone(), index));
    let excludes = Excludes::new(&req.exclude)?;

    let ticker = progress.map(|p| {
        let stats = uploader.stats.clone();
        tokio::spawn(async move {
            loop {
                p(stats.processed_bytes.load(Ordering::Relaxed));
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        })
    });
    let read = {
        let uploader = uploader.clone();
        let source = req.source.clone();
        let kind = req.kind;
        let registry = req.registry.clone();
        tokio::task::spawn_blocking(move || {
            source.read(kind, &excludes, &registry, uploader.as_ref())
        })
        .await
        .map_err(|e| BuildError::Internal(format!("source reader panicked: {e}")))?
    };
    if let Some(t) = ticker {
        t.abort();
    }
    let mut tree = match read {
        Ok(t) => t,
        Err(e) => {
            // "The upload worker stopped early" says less than why it did.
            return Err(match (uploader.abort().await, e) {
                (Some(cause), BuildError::Internal(_)) => cause,
                (_, e) => e,
            });
        }
    };

    // Where and when the tree was unpacked must not change the layer.
    tree.node_mut(tree::ROOT).meta = tree::Meta::DEFAULT_DIR;
    if let Some(prefix) = req
        .prefix
        .as_deref()
        .filter(|p| !p.trim_matches('/').is_empty())
    {
        tree = tree.rebase(prefix.as_bytes())?;
    }
    let blob = layout::layout(&tree)?;
    let image = erofs::write_image(&tree, &blob)?;
    let referenced: HashSet<Digest> = blob.chunks.iter().map(|(_, c)| c.digest).collect();
    let placed = uploader.finish(&referenced).await?;

    let mut packs: Vec<Digest> = Vec::new();
    let mut pack_index = std::collections::HashMap::new();
    let mut chunks = Vec::with_capacity(blob.chunks.len());
    for (offset, c) in &blob.chunks {
        let loc = placed[&c.digest];
        let pack = *pack_index.entry(loc.pack).or_insert_with(|| {
            packs.push(loc.pack);
            packs.len() as u32 - 1
        });
        chunks.push(ChunkEntry {
            blob_offset: *offset,
            length: c.length,
            digest: c.digest,
            pack,
            pack_offset: loc.offset,
            stored_length: loc.stored_length,
        });
    }
    let metadata_bytes = image.len() as u64;
    let metadata = store.put_metadata(image).await?;
    let (files, logical_bytes) = tree.file_totals();
    let mut manifest = LayerManifest {
        format: FORMAT_VERSION,
        id: Digest([0; 32]),
        metadata,
        blob_size: blob.size,
        logical_bytes,
        files,
        packs,
        chunks,
    };
    manifest.id = manifest.content_id();
    let provenance = Provenance {
        kind: req.kind.to_string(),
        name: req.name.clone(),
        version: req.version.clone(),
        source: req
            .source_label
            .clone()
            .unwrap_or_else(|| req.source.to_string()),
        built_at: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        writer_version: WRITER_VERSION.to_string(),
        extra: req.provenance.clone(),
    };
    let created = store.put_layer(&manifest, &provenance).await?;
    let s = &uploader.stats;
    let new_chunks = s.new_chunks.load(Ordering::Relaxed);
    Ok(BuildReport {
        id: manifest.id,
        files,
        logical_bytes,
        uploaded_bytes: s.uploaded_bytes.load(Ordering::Relaxed),
        new_data_bytes: s.new_data_bytes.load(Ordering::Relaxed),
        chunks: referenced.len() as u64,
        reused_chunks: (referenced.len() as u64).saturating_sub(new_chunks),
        metadata_bytes,
        blob_bytes: blob.size,
        created,
        seconds: started.elapsed().as_secs_f64(),
        cache_hit: false,
        build_key: None,
        steps_run: 0,
    })
}
