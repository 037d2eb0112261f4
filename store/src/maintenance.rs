//! Whole-store operations: the dedup index builds consult, build leases, statistics and
//! verification. Garbage collection is in [`crate::gc`].
//!
//! The build/GC handshake: a build puts `leases/<uuid>.json` (renewed while it runs), then
//! checks for `gc/running` and waits while it is there and renewed. GC puts `gc/running`
//! (renewed while it runs), then lists leases and stops if any is live, and lists them
//! again after marking, just before it deletes anything. Either GC sees the build's lease,
//! or the build sees GC's marker, so no chunk a build relies on (uploaded or reused) is
//! deleted before its manifest lands.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, SystemTime};

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStoreExt, PutPayload};
use serde::Serialize;

use crate::gc::{GC_MARKER, GC_MARKER_TTL};
use crate::{backend_err, chunk, Digest, LayerManifest, Result, Store, StoreError};

/// A lease not renewed for this long belongs to a build that died.
pub const LEASE_TTL: Duration = Duration::from_secs(600);
const LEASE_RENEW: Duration = Duration::from_secs(60);
/// How long a build waits for a running GC before giving up.
const GC_WAIT: Duration = Duration::from_secs(600);
const PARALLEL: usize = 16;

/// Where a chunk is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLocation {
    pub pack: Digest,
    pub offset: u64,
    pub stored_length: u32,
    pub length: u32,
}

/// How long ago an object was last written.
pub(crate) fn age(meta: &ObjectMeta) -> Duration {
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

impl Store {
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
            // Whole packs, as many in flight as the store takes (a remote one pays a round
            // trip each).
            .buffer_unordered(self.tuning().concurrency)
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
