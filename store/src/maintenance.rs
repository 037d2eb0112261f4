//! Whole-store operations: the dedup index builds consult, statistics, verification, and
//! garbage collection with its handshake against builds running at the same time.
//!
//! The handshake: a build puts `leases/<uuid>.json` (renewed while it runs), then checks
//! for `gc/running` and waits while it is there. GC puts `gc/running`, then lists leases and
//! stops if any is live. Either GC sees the build's lease, or the build sees GC's marker, so
//! no chunk a build relies on (uploaded or reused) is deleted before its manifest lands.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, SystemTime};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStoreExt, PutPayload};
use serde::Serialize;

use crate::{backend_err, chunk, Digest, LayerManifest, Result, Store, StoreError};

/// A lease not renewed for this long belongs to a build that died.
pub const LEASE_TTL: Duration = Duration::from_secs(600);
const LEASE_RENEW: Duration = Duration::from_secs(60);
/// A GC marker older than this belongs to a GC that died.
const GC_MARKER_TTL: Duration = Duration::from_secs(1800);
const GC_WAIT: Duration = Duration::from_secs(600);
const GC_MARKER: &str = "gc/running";
const PARALLEL: usize = 16;

/// Where a chunk is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLocation {
    pub pack: Digest,
    pub offset: u64,
    pub stored_length: u32,
    pub length: u32,
}

fn age(meta: &ObjectMeta) -> Duration {
    let modified = SystemTime::UNIX_EPOCH
        + Duration::from_millis(meta.last_modified.timestamp_millis().max(0) as u64);
    SystemTime::now()
        .duration_since(modified)
        .unwrap_or(Duration::ZERO)
}

/// Proof that a build is in progress; GC will not run while it is held.
pub struct BuildLease {
    store: Store,
    key: ObjectPath,
    renew: tokio::task::JoinHandle<()>,
}

impl BuildLease {
    /// Ends the lease. Call after the manifest is written (or the build failed).
    pub async fn release(self) {
        self.renew.abort();
        if let Err(e) = self.store.backend.delete(&self.key).await {
            tracing::warn!(lease = %self.key, error = %e, "could not delete build lease; GC will expire it");
        }
    }
}

impl Drop for BuildLease {
    fn drop(&mut self) {
        self.renew.abort();
    }
}

/// Totals over the whole store.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StoreStats {
    pub layers: u64,
    pub packs: u64,
    /// Distinct chunks referenced by layers.
    pub chunks: u64,
    /// Bytes held by packs and metadata images.
    pub stored_bytes: u64,
    /// Sum of every layer's file data, as if each were stored alone.
    pub logical_bytes: u64,
    /// Uncompressed bytes of the distinct chunks.
    pub unique_bytes: u64,
    /// `logical_bytes / stored_bytes`.
    pub dedup_ratio: f64,
}

/// What `verify` found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyReport {
    pub layers: u64,
    pub packs: u64,
    pub chunks: u64,
    pub bytes: u64,
    pub problems: Vec<String>,
}

/// What `gc` removed.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GcReport {
    pub layers: u64,
    pub deleted_packs: u64,
    pub deleted_metadata: u64,
    pub deleted_bytes: u64,
    pub expired_leases: u64,
    /// Unreferenced objects kept because they are younger than the grace period.
    pub kept_young: u64,
    /// Bytes of dead chunks inside packs that still hold live ones.
    pub dead_bytes_in_live_packs: u64,
}

impl Store {
    async fn list_prefix(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let p = ObjectPath::from(prefix);
        self.backend
            .list(Some(&p))
            .try_collect()
            .await
            .map_err(backend_err("list", &p))
    }

    /// Every layer manifest in the store.
    pub async fn all_layers(&self) -> Result<Vec<LayerManifest>> {
        let ids = self.list_layers().await?;
        futures::stream::iter(ids)
            .map(|id| async move { self.get_layer(&id).await })
            .buffer_unordered(PARALLEL)
            .try_collect()
            .await
    }

    /// Where every chunk a committed layer references is stored, for dedup.
    pub async fn chunk_index(&self) -> Result<HashMap<Digest, ChunkLocation>> {
        let mut index = HashMap::new();
        for m in self.all_layers().await? {
            for c in &m.chunks {
                index.entry(c.digest).or_insert(ChunkLocation {
                    pack: m.packs[c.pack as usize],
                    offset: c.pack_offset,
                    stored_length: c.stored_length,
                    length: c.length,
                });
            }
        }
        Ok(index)
    }

    /// Announces a build. Waits while a GC is running.
    pub async fn begin_build(&self) -> Result<BuildLease> {
        let key = ObjectPath::from(format!("leases/{}.json", uuid::Uuid::new_v4()));
        let body = serde_json::json!({
            "pid": std::process::id(),
            "started": SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        })
        .to_string();
        self.backend
            .put(&key, PutPayload::from(body.clone()))
            .await
            .map_err(backend_err("put", &key))?;
        let renew = {
            let backend = self.backend.clone();
            let key = key.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(LEASE_RENEW).await;
                    if let Err(e) = backend.put(&key, PutPayload::from(body.clone())).await {
                        tracing::warn!(error = %e, "could not renew build lease");
                    }
                }
            })
        };
        let lease = BuildLease {
            store: self.clone(),
            key,
            renew,
        };
        let marker = ObjectPath::from(GC_MARKER);
        let deadline = tokio::time::Instant::now() + GC_WAIT;
        loop {
            match self.backend.head(&marker).await {
                Ok(m) if age(&m) < GC_MARKER_TTL => {
                    if tokio::time::Instant::now() > deadline {
                        lease.release().await;
                        return Err(StoreError::Busy(format!(
                            "a garbage collection has been running on {} for over {} s; retry later, or delete `{GC_MARKER}` if no GC is running",
                            self.describe(),
                            GC_WAIT.as_secs()
                        )));
                    }
                    tracing::info!("waiting for a running store GC to finish");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Ok(_) | Err(object_store::Error::NotFound { .. }) => return Ok(lease),
                Err(e) => {
                    lease.release().await;
                    return Err(backend_err("head", &marker)(e));
                }
            }
        }
    }

    /// Totals over the store.
    pub async fn stats(&self) -> Result<StoreStats> {
        let layers = self.all_layers().await?;
        let packs = self.list_prefix("packs").await?;
        let metas = self.list_prefix("meta").await?;
        let mut seen = HashSet::new();
        let mut s = StoreStats {
            layers: layers.len() as u64,
            packs: packs.len() as u64,
            stored_bytes: packs.iter().chain(&metas).map(|m| m.size).sum(),
            ..Default::default()
        };
        for m in &layers {
            s.logical_bytes += m.logical_bytes;
            for c in &m.chunks {
                if seen.insert(c.digest) {
                    s.chunks += 1;
                    s.unique_bytes += c.length as u64;
                }
            }
        }
        s.dedup_ratio = if s.stored_bytes == 0 {
            0.0
        } else {
            s.logical_bytes as f64 / s.stored_bytes as f64
        };
        Ok(s)
    }

    /// Reads every manifest, metadata image and chunk, and checks each against its digest.
    pub async fn verify(&self) -> Result<VerifyReport> {
        let mut report = VerifyReport::default();
        let ids = self.list_layers().await?;
        let mut layers = Vec::new();
        for id in ids {
            report.layers += 1;
            match self.get_layer(&id).await {
                Ok(m) => layers.push(m),
                Err(e) => report.problems.push(e.to_string()),
            }
        }
        struct Want {
            offset: u64,
            stored_length: u32,
            length: u32,
            digest: Digest,
            users: BTreeSet<Digest>,
        }
        let mut by_pack: HashMap<Digest, HashMap<u64, Want>> = HashMap::new();
        for m in &layers {
            if let Err(e) = self.get_metadata(&m.metadata).await {
                report.problems.push(format!("layer {}: {e}", m.id));
            }
            for c in &m.chunks {
                let w = by_pack
                    .entry(m.packs[c.pack as usize])
                    .or_default()
                    .entry(c.pack_offset)
                    .or_insert_with(|| Want {
                        offset: c.pack_offset,
                        stored_length: c.stored_length,
                        length: c.length,
                        digest: c.digest,
                        users: BTreeSet::new(),
                    });
                w.users.insert(m.id);
            }
        }
        report.packs = by_pack.len() as u64;
        let results: Vec<(u64, u64, Vec<String>)> = futures::stream::iter(by_pack)
            .map(|(pack, wants)| async move {
                let bytes = match self.read_pack(&pack).await {
                    Ok(b) => b,
                    Err(e) => {
                        let users: BTreeSet<_> =
                            wants.values().flat_map(|w| w.users.iter().copied()).collect();
                        return (0, 0, vec![format!("{e} (used by layers {})", list(&users))]);
                    }
                };
                tokio::task::spawn_blocking(move || {
                    let mut problems = Vec::new();
                    let (mut n, mut total) = (0u64, 0u64);
                    for w in wants.values() {
                        n += 1;
                        total += w.length as u64;
                        let end = w.offset + w.stored_length as u64;
                        let outcome = if end > bytes.len() as u64 {
                            Err(format!("pack has {} bytes, chunk ends at {end}", bytes.len()))
                        } else {
                            chunk::decode(&bytes[w.offset as usize..end as usize], w.length, &w.digest)
                                .map(|_| ())
                                .map_err(|e| e.to_string())
                        };
                        if let Err(reason) = outcome {
                            problems.push(format!(
                                "chunk {} in pack {pack} at offset {} is corrupt: {reason} (used by layers {})",
                                w.digest,
                                w.offset,
                                list(&w.users)
                            ));
                        }
                    }
                    (n, total, problems)
                })
                .await
                .unwrap_or_else(|e| (0, 0, vec![format!("verifying pack {pack} panicked: {e}")]))
            })
            .buffer_unordered(4)
            .collect()
            .await;
        for (n, bytes, problems) in results {
            report.chunks += n;
            report.bytes += bytes;
            report.problems.extend(problems);
        }
        report.problems.sort();
        Ok(report)
    }

    /// Deletes packs and metadata images no manifest references and that are older than
    /// `grace`. Refuses to run while a build holds a live lease.
    pub async fn gc(&self, grace: Duration) -> Result<GcReport> {
        let marker = ObjectPath::from(GC_MARKER);
        self.backend
            .put(
                &marker,
                PutPayload::from(format!("pid {}", std::process::id())),
            )
            .await
            .map_err(backend_err("put", &marker))?;
        let result = self.gc_marked(grace).await;
        if let Err(e) = self.backend.delete(&marker).await {
            tracing::warn!(error = %e, "could not remove the GC marker `{GC_MARKER}`");
        }
        result
    }

    async fn gc_marked(&self, grace: Duration) -> Result<GcReport> {
        let mut report = GcReport::default();
        let mut live_leases = Vec::new();
        for lease in self.list_prefix("leases").await? {
            if age(&lease) < LEASE_TTL {
                live_leases.push(lease.location.to_string());
            } else {
                self.backend
                    .delete(&lease.location)
                    .await
                    .map_err(backend_err("delete", &lease.location))?;
                report.expired_leases += 1;
            }
        }
        if !live_leases.is_empty() {
            return Err(StoreError::Busy(format!(
                "{} build(s) in progress ({}); run gc again when they finish",
                live_leases.len(),
                live_leases.join(", ")
            )));
        }
        // A manifest that cannot be read may still reference chunks: stop rather than guess.
        let layers = self.all_layers().await?;
        report.layers = layers.len() as u64;
        // Live stored bytes per pack (each chunk once across layers), and live images.
        let mut live_packs: HashMap<Digest, u64> = HashMap::new();
        let mut live_meta = HashSet::new();
        let mut seen = HashSet::new();
        for m in &layers {
            live_meta.insert(m.metadata.digest);
            for c in &m.chunks {
                let pack = m.packs[c.pack as usize];
                if seen.insert((pack, c.pack_offset)) {
                    *live_packs.entry(pack).or_default() += c.stored_length as u64;
                }
            }
        }
        for obj in self.list_prefix("packs").await? {
            let Some(d) = digest_of(&obj) else { continue };
            match live_packs.get(&d) {
                Some(live) => report.dead_bytes_in_live_packs += obj.size.saturating_sub(*live),
                None => {
                    if self.sweep(&obj, grace, &mut report).await? {
                        report.deleted_packs += 1;
                    }
                }
            }
        }
        for obj in self.list_prefix("meta").await? {
            let Some(d) = digest_of(&obj) else { continue };
            if !live_meta.contains(&d) && self.sweep(&obj, grace, &mut report).await? {
                report.deleted_metadata += 1;
            }
        }
        Ok(report)
    }
}

impl Store {
    /// Deletes an unreferenced object unless it is younger than `grace`.
    async fn sweep(
        &self,
        obj: &ObjectMeta,
        grace: Duration,
        report: &mut GcReport,
    ) -> Result<bool> {
        if age(obj) < grace {
            report.kept_young += 1;
            return Ok(false);
        }
        self.backend
            .delete(&obj.location)
            .await
            .map_err(backend_err("delete", &obj.location))?;
        report.deleted_bytes += obj.size;
        Ok(true)
    }
}

fn digest_of(obj: &ObjectMeta) -> Option<Digest> {
    obj.location.filename()?.parse().ok()
}

fn list(ids: &BTreeSet<Digest>) -> String {
    ids.iter()
        .map(|d| d.to_hex())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::sample_layer;
    use crate::{pack::PackBuilder, StoreUrl};

    #[tokio::test]
    async fn verify_finds_a_corrupt_chunk_and_gc_keeps_live_data() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&StoreUrl::Local(dir.path().into())).unwrap();
        let m = sample_layer(&store, &b"some layer content ".repeat(500)).await;

        // An orphan pack, as a crashed build would leave.
        let mut b = PackBuilder::new();
        b.push(&chunk::encode(b"orphan"));
        let orphan = b.finish();
        store.put_pack(&orphan).await.unwrap();

        let r = store.verify().await.unwrap();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!(r.chunks, 1);

        // A live build lease blocks GC.
        let lease = store.begin_build().await.unwrap();
        assert!(matches!(
            store.gc(Duration::ZERO).await,
            Err(StoreError::Busy(_))
        ));
        lease.release().await;

        let g = store.gc(Duration::ZERO).await.unwrap();
        assert_eq!(g.deleted_packs, 1);
        assert!(store.read_pack(&orphan.id).await.is_err());
        assert_eq!(store.read_chunk(&m, 0).await.unwrap().len(), 19 * 500);

        // Flip a byte of the live pack on disk.
        let pack_path = dir.path().join(Store::pack_key(&m.packs[0]).to_string());
        let mut bytes = std::fs::read(&pack_path).unwrap();
        bytes[3] ^= 0x55;
        std::fs::write(&pack_path, bytes).unwrap();
        let r = store.verify().await.unwrap();
        assert_eq!(r.problems.len(), 1);
        assert!(r.problems[0].contains(&m.chunks[0].digest.to_hex()));
        assert!(r.problems[0].contains(&m.id.to_hex()));
        let err = store.read_chunk(&m, 0).await.unwrap_err().to_string();
        assert!(
            err.contains("corrupt") && err.contains(&m.id.to_hex()),
            "{err}"
        );
    }
}
