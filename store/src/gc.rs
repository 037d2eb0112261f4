//! Garbage collection: deletes every chunk pack and metadata image no remaining layer
//! manifest references, and the records of layers that are gone (provenance, prefetch
//! lists and their packed copies without a manifest, build-cache records naming a missing layer), once they are
//! older than a grace period.
//!
//! A run holds the `gc/running` marker of the build/GC handshake (see
//! [`crate::maintenance`]) from start to end and renews it while it runs, so a build
//! waiting on it never takes a long GC for a dead one:
//! 1. take the marker (refused while another GC's marker is live);
//! 2. expire dead build leases, and stop if a live one exists;
//! 3. read every manifest (a manifest that cannot be read stops the run: it may
//!    reference anything) and list packs, images and records: the unreferenced ones are
//!    the candidates;
//! 4. re-read the leases and stop, deleting nothing, if a build began meanwhile;
//! 5. delete the candidates, each only while the marker is known to be renewed.
//!
//! Packs are kept or deleted whole: a pack still referenced by one chunk of one layer
//! stays, dead chunks and all (reported as `dead_bytes_in_live_packs`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::Serialize;
use tokio::time::Instant;

use crate::maintenance::{age, LEASE_TTL};
use crate::{backend_err, Digest, Result, Store, StoreError};

/// The marker a running GC holds.
pub(crate) const GC_MARKER: &str = "gc/running";
/// A GC marker not renewed for this long belongs to a GC that died.
pub(crate) const GC_MARKER_TTL: Duration = Duration::from_secs(600);
/// How often a running GC renews its marker.
const GC_MARKER_RENEW: Duration = Duration::from_secs(60);
/// A GC stops deleting once its marker has gone unrenewed for this long (half the TTL:
/// well before a build could take it for dead).
const GC_MARKER_SAFE: Duration = Duration::from_secs(300);
const PARALLEL_DELETES: usize = 16;

/// What `gc` removed and kept.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GcReport {
    pub layers: u64,
    pub deleted_packs: u64,
    pub deleted_metadata: u64,
    /// Bytes of the deleted packs and metadata images.
    pub deleted_bytes: u64,
    /// Provenance and prefetch records of missing layers, build records naming one.
    pub deleted_records: u64,
    pub expired_leases: u64,
    /// Unreferenced objects kept because they are younger than the grace period.
    pub kept_young: u64,
    /// Bytes of the referenced packs and metadata images (what the layers use).
    pub kept_bytes: u64,
    /// Bytes of dead chunks inside packs that still hold live ones.
    pub dead_bytes_in_live_packs: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Pack,
    Metadata,
    Record,
}

/// What a run found to delete.
struct Plan {
    doomed: Vec<(Kind, ObjectMeta)>,
}

/// The `gc/running` marker, renewed by a background task until released.
pub(crate) struct GcMarker {
    store: Store,
    renew: tokio::task::JoinHandle<()>,
    renewed: Arc<Mutex<Instant>>,
}

impl GcMarker {
    /// Takes the marker, or fails if another GC holds a live one.
    pub(crate) async fn take(store: &Store, renew_every: Duration) -> Result<GcMarker> {
        let key = ObjectPath::from(GC_MARKER);
        let body = format!("pid {}", std::process::id());
        let create = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match store
            .backend
            .put_opts(&key, PutPayload::from(body.clone()), create)
            .await
        {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. }) => {
                match store.backend.head(&key).await {
                    Ok(m) if age(&m) < GC_MARKER_TTL => {
                        return Err(StoreError::Busy(format!(
                            "another garbage collection is running on {} (`{GC_MARKER}` renewed {} s ago); run gc again when it finishes",
                            store.describe(),
                            age(&m).as_secs()
                        )))
                    }
                    Ok(_) | Err(object_store::Error::NotFound { .. }) => {
                        tracing::warn!("taking over the marker `{GC_MARKER}` of a GC that died");
                        store
                            .backend
                            .put(&key, PutPayload::from(body.clone()))
                            .await
                            .map_err(backend_err("put", &key))?;
                    }
                    Err(e) => return Err(backend_err("head", &key)(e)),
                }
            }
            Err(e) => return Err(backend_err("put", &key)(e)),
        }
        let renewed = Arc::new(Mutex::new(Instant::now()));
        let renew = {
            let backend = store.backend.clone();
            let renewed = renewed.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(renew_every).await;
                    match backend.put(&key, PutPayload::from(body.clone())).await {
                        Ok(_) => {
                            *renewed.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now()
                        }
                        Err(e) => tracing::warn!(error = %e, "could not renew `{GC_MARKER}`"),
                    }
                }
            })
        };
        Ok(GcMarker {
            store: store.clone(),
            renew,
            renewed,
        })
    }

    /// Fails once the marker has gone unrenewed for long enough that a build could soon
    /// take this GC for dead and go ahead.
    fn check(&self) -> Result<()> {
        let since = self
            .renewed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed();
        if since > GC_MARKER_SAFE {
            return Err(StoreError::Busy(format!(
                "the GC marker `{GC_MARKER}` could not be renewed for {} s; stopped so that no build takes this GC for dead",
                since.as_secs()
            )));
        }
        Ok(())
    }

    /// Stops renewing and deletes the marker.
    pub(crate) async fn release(self) {
        self.renew.abort();
        let key = ObjectPath::from(GC_MARKER);
        if let Err(e) = self.store.backend.delete(&key).await {
            tracing::warn!(error = %e, "could not remove the GC marker `{GC_MARKER}`");
        }
    }
}

impl Drop for GcMarker {
    fn drop(&mut self) {
        self.renew.abort();
    }
}

impl Store {
    /// Deletes every pack and metadata image no manifest references, and the records of
    /// layers that are gone, if older than `grace`. Refuses to run while a build holds a
    /// live lease or another GC runs; stops without deleting anything if a build began
    /// while it was marking.
    pub async fn gc(&self, grace: Duration) -> Result<GcReport> {
        let marker = GcMarker::take(self, GC_MARKER_RENEW).await?;
        let mut report = GcReport::default();
        let result = async {
            self.expire_leases(&mut report).await?;
            let plan = self.gc_plan(grace, &mut report).await?;
            self.gc_sweep(plan, &marker, &mut report).await
        }
        .await;
        marker.release().await;
        result.map(|()| report)
    }

    /// Deletes expired build leases; fails if a live one exists.
    async fn expire_leases(&self, report: &mut GcReport) -> Result<()> {
        let mut live = Vec::new();
        for lease in self.list_prefix("leases").await? {
            if age(&lease) < LEASE_TTL {
                live.push(lease.location.to_string());
            } else if self.delete_if_present(&lease.location).await? {
                report.expired_leases += 1;
            }
        }
        if !live.is_empty() {
            return Err(StoreError::Busy(format!(
                "{} build(s) in progress ({}); run gc again when they finish",
                live.len(),
                live.join(", ")
            )));
        }
        Ok(())
    }

    /// Marks: every object no manifest references, older than `grace`.
    async fn gc_plan(&self, grace: Duration, report: &mut GcReport) -> Result<Plan> {
        let layers = self.all_layers().await?;
        report.layers = layers.len() as u64;
        let ids: HashSet<Digest> = layers.iter().map(|m| m.id).collect();
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
            // A layer without chunks still names its packs (none, normally).
            for p in &m.packs {
                live_packs.entry(*p).or_default();
            }
        }
        let mut plan = Plan { doomed: Vec::new() };
        let mut consider = |kind: Kind, obj: ObjectMeta, report: &mut GcReport| {
            if age(&obj) < grace {
                report.kept_young += 1;
            } else {
                plan.doomed.push((kind, obj));
            }
        };
        for obj in self.list_prefix("packs").await? {
            let Some(d) = digest_of(&obj) else { continue };
            match live_packs.get(&d) {
                Some(live) => {
                    report.kept_bytes += obj.size;
                    report.dead_bytes_in_live_packs += obj.size.saturating_sub(*live);
                }
                None => consider(Kind::Pack, obj, report),
            }
        }
        for obj in self.list_prefix("meta").await? {
            let Some(d) = digest_of(&obj) else { continue };
            if live_meta.contains(&d) {
                report.kept_bytes += obj.size;
            } else {
                consider(Kind::Metadata, obj, report);
            }
        }
        for obj in self.list_prefix("layers").await? {
            let Some(name) = obj.location.filename() else {
                continue;
            };
            let owner = name
                .strip_suffix(".provenance.json")
                .or_else(|| name.strip_suffix(".prefetch.json"))
                .or_else(|| name.strip_suffix(".prefetch.pack"))
                .and_then(|id| id.parse::<Digest>().ok());
            if owner.is_some_and(|id| !ids.contains(&id)) {
                consider(Kind::Record, obj, report);
            }
        }
        for (obj, layer) in self.build_records().await? {
            if layer.is_some_and(|id| !ids.contains(&id)) {
                consider(Kind::Record, obj, report);
            }
        }
        Ok(plan)
    }

    /// Sweeps what `gc_plan` marked, unless a build began meanwhile.
    async fn gc_sweep(&self, plan: Plan, marker: &GcMarker, report: &mut GcReport) -> Result<()> {
        let live: Vec<String> = self
            .list_prefix("leases")
            .await?
            .into_iter()
            .filter(|l| age(l) < LEASE_TTL)
            .map(|l| l.location.to_string())
            .collect();
        if !live.is_empty() {
            return Err(StoreError::Busy(format!(
                "{} build(s) began while the GC was marking ({}); nothing was deleted, run gc again when they finish",
                live.len(),
                live.join(", ")
            )));
        }
        let results: Vec<Result<Option<(Kind, u64)>>> = futures::stream::iter(plan.doomed)
            .map(|(kind, obj)| async move {
                marker.check()?;
                Ok(self
                    .delete_if_present(&obj.location)
                    .await?
                    .then_some((kind, obj.size)))
            })
            .buffer_unordered(PARALLEL_DELETES)
            .collect()
            .await;
        let mut first_error = None;
        for r in results {
            match r {
                Ok(Some((kind, size))) => match kind {
                    Kind::Pack => {
                        report.deleted_packs += 1;
                        report.deleted_bytes += size;
                    }
                    Kind::Metadata => {
                        report.deleted_metadata += 1;
                        report.deleted_bytes += size;
                    }
                    Kind::Record => report.deleted_records += 1,
                },
                Ok(None) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    pub(crate) async fn list_prefix(&self, prefix: &str) -> Result<Vec<ObjectMeta>> {
        let p = ObjectPath::from(prefix);
        self.backend
            .list(Some(&p))
            .try_collect()
            .await
            .map_err(backend_err("list", &p))
    }
}

fn digest_of(obj: &ObjectMeta) -> Option<Digest> {
    obj.location.filename()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::sample_layer;
    use crate::{chunk, pack::PackBuilder, StoreUrl};

    fn local_store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&StoreUrl::Local(dir.path().into())).unwrap();
        (dir, store)
    }

    fn stored_objects(dir: &std::path::Path, prefix: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![dir.join(prefix)];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.file_type().unwrap().is_dir() {
                    stack.push(e.path());
                } else {
                    out.push(e.file_name().to_string_lossy().into_owned());
                }
            }
        }
        out.sort();
        out
    }

    #[tokio::test]
    async fn gc_keeps_what_remaining_layers_reference_and_collects_a_removed_layer() {
        let (dir, store) = local_store();
        // a and b share a metadata image (sample_layer writes the same one); c has its own
        // image and reuses a's chunk, so it references a's pack.
        let a = sample_layer(&store, &b"first layer ".repeat(300)).await;
        let b = sample_layer(&store, &b"second layer ".repeat(300)).await;
        let mut c = a.clone();
        c.metadata = store.put_metadata(vec![8u8; 4096]).await.unwrap();
        c.blob_size += 4096;
        c.id = c.content_id();
        store
            .put_layer(&c, &crate::Provenance::default())
            .await
            .unwrap();
        let data = [bytes::Bytes::from(b"second layer ".repeat(300))];
        store.put_prefetch(&b.id, &[0], Some(&data)).await.unwrap();
        let key = Digest::of(b"a build key");
        store.put_build_record(&key, &b.id).await.unwrap();
        let size = |key: ObjectPath| {
            std::fs::metadata(dir.path().join(key.to_string()))
                .unwrap()
                .len()
        };
        let (pack_a, pack_b) = (
            size(Store::pack_key(&a.packs[0])),
            size(Store::pack_key(&b.packs[0])),
        );

        // b goes: its manifest, provenance, prefetch list and build record with it.
        let removed = store.remove_layers(&[b.id]).await.unwrap();
        assert_eq!((removed.layers, removed.build_records), (vec![b.id], 1));
        assert!(!store.has_layer(&b.id).await.unwrap());
        assert_eq!(store.get_build_record(&key).await.unwrap(), None);
        assert!(store.get_prefetch(&b.id).await.unwrap().is_none());
        assert!(matches!(
            store.remove_layers(&[b.id]).await,
            Err(StoreError::LayerNotFound(_))
        ));
        let g = store.gc(Duration::ZERO).await.unwrap();
        assert_eq!((g.layers, g.deleted_packs, g.deleted_metadata), (2, 1, 0));
        assert_eq!(g.deleted_bytes, pack_b);
        assert_eq!(
            stored_objects(dir.path(), "packs"),
            vec![a.packs[0].to_hex()]
        );
        assert!(store.read_pack(&b.packs[0]).await.is_err());

        // a goes too: its image is collected, its pack stays for c.
        store.remove_layers(&[a.id]).await.unwrap();
        let g = store.gc(Duration::ZERO).await.unwrap();
        assert_eq!((g.layers, g.deleted_packs, g.deleted_metadata), (1, 0, 1));
        assert_eq!(g.kept_bytes, pack_a + 4096);
        assert_eq!(store.stats().await.unwrap().stored_bytes, g.kept_bytes);
        assert_eq!(store.read_chunk(&c, 0).await.unwrap().len(), 12 * 300);

        // The last one goes: nothing is left.
        store.remove_layers(&[c.id]).await.unwrap();
        let g = store.gc(Duration::ZERO).await.unwrap();
        assert_eq!((g.deleted_packs, g.deleted_metadata), (1, 1));
        assert_eq!(g.deleted_bytes, pack_a + 4096);
        for prefix in ["packs", "meta", "layers", "gc"] {
            assert!(stored_objects(dir.path(), prefix).is_empty(), "{prefix}");
        }
        assert_eq!(store.stats().await.unwrap().stored_bytes, 0);
    }

    #[tokio::test]
    async fn gc_keeps_young_orphans_and_sweeps_records_of_missing_layers() {
        let (dir, store) = local_store();
        let m = sample_layer(&store, b"kept").await;
        let ghost = Digest::of(b"a layer that never committed");
        let data = [
            bytes::Bytes::from_static(b"one"),
            bytes::Bytes::from_static(b"two"),
        ];
        store
            .put_prefetch(&ghost, &[1, 2], Some(&data))
            .await
            .unwrap();
        store
            .put_build_record(&Digest::of(b"key"), &ghost)
            .await
            .unwrap();
        store
            .put_build_record(&Digest::of(b"live key"), &m.id)
            .await
            .unwrap();
        let mut b = PackBuilder::new();
        b.push(&chunk::encode(b"orphan"));
        let orphan = b.finish();
        store.put_pack(&orphan).await.unwrap();

        let g = store.gc(Duration::from_secs(3600)).await.unwrap();
        assert_eq!(
            (g.deleted_packs, g.deleted_records, g.kept_young),
            (0, 0, 4)
        );
        assert!(store.read_pack(&orphan.id).await.is_ok());

        // The prefetch list, its packed copy and the build record of the missing layer.
        let g = store.gc(Duration::ZERO).await.unwrap();
        assert_eq!((g.deleted_packs, g.deleted_records), (1, 3));
        assert!(store.get_prefetch(&ghost).await.unwrap().is_none());
        assert!(stored_objects(dir.path(), "layers")
            .iter()
            .all(|o| !o.contains(&ghost.to_hex())));
        assert_eq!(
            store
                .get_build_record(&Digest::of(b"live key"))
                .await
                .unwrap(),
            Some(m.id)
        );
        assert_eq!(stored_objects(dir.path(), "builds").len(), 1);
    }

    #[tokio::test]
    async fn a_build_that_began_while_gc_was_marking_stops_the_sweep() {
        let (_dir, store) = local_store();
        let mut b = PackBuilder::new();
        b.push(&chunk::encode(
            b"uploaded by a build that has not committed",
        ));
        let pack = b.finish();
        store.put_pack(&pack).await.unwrap();

        let mut report = GcReport::default();
        let plan = store.gc_plan(Duration::ZERO, &mut report).await.unwrap();
        assert_eq!(plan.doomed.len(), 1);
        // The build takes its lease after the GC's first look at the leases.
        let lease = store.begin_build().await.unwrap();
        let marker = GcMarker::take(&store, GC_MARKER_RENEW).await.unwrap();
        let err = store
            .gc_sweep(plan, &marker, &mut report)
            .await
            .unwrap_err();
        marker.release().await;
        assert!(
            err.to_string().contains("began while the GC was marking"),
            "{err}"
        );
        assert!(store.read_pack(&pack.id).await.is_ok(), "nothing deleted");
        lease.release().await;
    }

    #[tokio::test]
    async fn the_marker_is_renewed_while_gc_runs_and_excludes_a_second_gc() {
        let (_dir, store) = local_store();
        let key = ObjectPath::from(GC_MARKER);
        let marker = GcMarker::take(&store, Duration::from_millis(100))
            .await
            .unwrap();
        let first = store.backend.head(&key).await.unwrap().last_modified;
        tokio::time::sleep(Duration::from_millis(450)).await;
        let later = store.backend.head(&key).await.unwrap().last_modified;
        assert!(later > first, "renewed: {first} -> {later}");
        marker.check().unwrap();

        let err = store.gc(Duration::ZERO).await.unwrap_err();
        assert!(
            matches!(&err, StoreError::Busy(m) if m.contains("another garbage collection")),
            "{err}"
        );
        // The refused GC left the running one's marker alone.
        assert!(store.backend.head(&key).await.is_ok());
        marker.release().await;
        assert!(store.backend.head(&key).await.is_err());
        store.gc(Duration::ZERO).await.unwrap();
    }
}
