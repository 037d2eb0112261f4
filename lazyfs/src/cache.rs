//! The local chunk cache: verified, uncompressed chunks as files on the host's disk
//! (`chunks/<aa>/<digest>`), bounded in bytes with LRU eviction, plus a small in-memory
//! cache of hot chunks. Fetched chunks land in memory; only those a reader is served are
//! written to disk. Files found on disk at start-up are trusted only after they have
//! been re-hashed once.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use moka::notification::RemovalCause;
use moka::policy::EvictionPolicy;
use strata_store::Digest;

use crate::LazyError;

/// What the disk index knows about one cached chunk.
#[derive(Debug)]
struct DiskEntry {
    size: u64,
    /// Re-hashed since this process started (or written by it).
    verified: AtomicBool,
}

/// Cache counters.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize, Clone)]
pub struct CacheStats {
    pub dir: String,
    pub max_bytes: u64,
    pub bytes: u64,
    pub chunks: u64,
    pub evicted_chunks: u64,
}

pub struct ChunkCache {
    dir: PathBuf,
    max_bytes: u64,
    disk: moka::sync::Cache<Digest, Arc<DiskEntry>>,
    hot: moka::sync::Cache<Digest, Bytes>,
    evicted: Arc<AtomicU64>,
    inflight: std::sync::Mutex<std::collections::HashMap<Digest, Flight>>,
}

/// Serializes fetches of one chunk, so concurrent readers of a missing chunk fetch it once.
pub type Flight = Arc<tokio::sync::Mutex<()>>;

const TMPFS_MAGIC: i64 = 0x0102_1994;
const HOT_BYTES: u64 = 256 << 20;

fn chunk_path(dir: &Path, d: &Digest) -> PathBuf {
    let hex = d.to_hex();
    dir.join(&hex[..2]).join(hex)
}

impl ChunkCache {
    /// Opens (creating) the cache in `dir`, indexing what an earlier run left there.
    pub fn open(dir: &Path, max_bytes: u64) -> Result<ChunkCache, LazyError> {
        std::fs::create_dir_all(dir).map_err(LazyError::io(dir))?;
        let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
            .map_err(|_| LazyError::Config(format!("{}: path has a NUL byte", dir.display())))?;
        // SAFETY: zeroed statfs is a valid out-parameter; c is NUL-terminated.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0 && st.f_type as i64 == TMPFS_MAGIC {
            return Err(LazyError::Config(format!(
                "cache directory {} is on tmpfs: the cache would live in memory twice over; set STRATA_HOME to a disk (ext4/xfs) path",
                dir.display()
            )));
        }
        let evicted = Arc::new(AtomicU64::new(0));
        let listener_dir = dir.to_path_buf();
        let listener_evicted = evicted.clone();
        let disk = moka::sync::Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_: &Digest, e: &Arc<DiskEntry>| e.size.min(u32::MAX as u64) as u32)
            .eviction_policy(EvictionPolicy::lru())
            .eviction_listener(move |d: Arc<Digest>, _e, cause| {
                if matches!(cause, RemovalCause::Size | RemovalCause::Explicit) {
                    let _ = std::fs::remove_file(chunk_path(&listener_dir, &d));
                    listener_evicted.fetch_add(1, Ordering::Relaxed);
                }
            })
            .build();
        // LRU, not moka's default TinyLFU admission: a sequential scan must keep the chunk
        // it is reading, which a frequency filter would refuse as a newcomer.
        let hot = moka::sync::Cache::builder()
            .max_capacity(HOT_BYTES.min(max_bytes))
            .weigher(|_: &Digest, b: &Bytes| b.len().min(u32::MAX as usize) as u32)
            .eviction_policy(EvictionPolicy::lru())
            .build();
        let cache = ChunkCache {
            dir: dir.to_path_buf(),
            max_bytes,
            disk,
            hot,
            evicted,
            inflight: Default::default(),
        };
        cache.index_existing()?;
        Ok(cache)
    }

    fn index_existing(&self) -> Result<(), LazyError> {
        let mut found = Vec::new();
        for shard in std::fs::read_dir(&self.dir).map_err(LazyError::io(&self.dir))? {
            let shard = shard.map_err(LazyError::io(&self.dir))?.path();
            if !shard.is_dir() {
                continue;
            }
            for f in std::fs::read_dir(&shard).map_err(LazyError::io(&shard))? {
                let f = f.map_err(LazyError::io(&shard))?;
                let name = f.file_name();
                let Some(d) = name.to_str().and_then(|n| n.parse::<Digest>().ok()) else {
                    // Temp files of an interrupted write.
                    let _ = std::fs::remove_file(f.path());
                    continue;
                };
                let meta = f.metadata().map_err(LazyError::io(&f.path()))?;
                let used = meta.accessed().or_else(|_| meta.modified()).ok();
                found.push((used, d, meta.len()));
            }
        }
        // Oldest first, so LRU order survives a restart.
        found.sort_by_key(|(t, ..)| *t);
        for (_, d, size) in found {
            self.disk.insert(
                d,
                Arc::new(DiskEntry {
                    size,
                    verified: AtomicBool::new(false),
                }),
            );
        }
        self.disk.run_pending_tasks();
        Ok(())
    }

    /// The lock a fetch of `d` holds; take it, re-check the cache, fetch, then [`land`].
    pub fn flight(&self, d: &Digest) -> Flight {
        match self.inflight.lock() {
            Ok(mut m) => m.entry(*d).or_default().clone(),
            Err(_) => Flight::default(),
        }
    }

    /// Forgets a flight nobody else is waiting on.
    pub fn land(&self, d: &Digest, flight: Flight) {
        if let Ok(mut m) = self.inflight.lock() {
            // The map's reference and ours: nobody else is queued on it.
            if Arc::strong_count(&flight) <= 2 {
                m.remove(d);
            }
        }
    }

    /// A cached chunk, verified; None if not cached (or the cached copy was bad and is gone).
    pub fn get(&self, d: &Digest) -> Option<Bytes> {
        if let Some(b) = self.hot.get(d) {
            self.disk.get(d);
            return Some(b);
        }
        let entry = self.disk.get(d)?;
        let path = chunk_path(&self.dir, d);
        let data = match std::fs::read(&path) {
            Ok(data) => data,
            Err(_) => {
                self.disk.invalidate(d);
                return None;
            }
        };
        if !entry.verified.load(Ordering::Relaxed) {
            if Digest::of(&data) != *d {
                tracing::warn!(chunk = %d, path = %path.display(), "cached chunk is corrupt; dropping it");
                self.disk.invalidate(d);
                return None;
            }
            entry.verified.store(true, Ordering::Relaxed);
        }
        let bytes = Bytes::from(data);
        self.hot.insert(*d, bytes.clone());
        Some(bytes)
    }

    /// Whether a chunk is in memory.
    pub fn is_hot(&self, d: &Digest) -> bool {
        self.hot.contains_key(d)
    }

    /// Whether a chunk is cached (without reading it).
    pub fn contains(&self, d: &Digest) -> bool {
        self.hot.contains_key(d) || self.disk.contains_key(d)
    }

    /// Adds a verified chunk.
    pub fn put(&self, d: Digest, data: Bytes) -> Result<(), LazyError> {
        let path = chunk_path(&self.dir, &d);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(LazyError::io(parent))?;
        }
        // Write aside and rename, so a crash never leaves a truncated chunk under its name.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &data).map_err(LazyError::io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(LazyError::io(&path))?;
        self.disk.insert(
            d,
            Arc::new(DiskEntry {
                size: data.len() as u64,
                verified: AtomicBool::new(true),
            }),
        );
        self.hot.insert(d, data);
        Ok(())
    }

    /// Writes a chunk a reader was served to disk, once. Chunks fetched only because they
    /// lay near a wanted one, or ahead of a reader, stay in memory until somebody reads
    /// them: the disk gets what sandboxes used, not everything the store sent.
    pub fn persist(self: &Arc<Self>, d: Digest, data: Bytes, rt: &tokio::runtime::Handle) {
        // Indexed before it is written, so concurrent readers of the chunk write it once;
        // a reader finding the index entry before the file falls back to the hot copy or
        // fetches again.
        let entry = self.disk.entry(d).or_insert_with(|| {
            Arc::new(DiskEntry {
                size: data.len() as u64,
                verified: AtomicBool::new(true),
            })
        });
        if !entry.is_fresh() {
            return;
        }
        let cache = self.clone();
        rt.spawn_blocking(move || {
            if let Err(e) = cache.put(d, data) {
                tracing::warn!(error = %e, "could not write to the chunk cache");
                cache.disk.invalidate(&d);
            }
        });
    }

    /// Makes a verified chunk readable from memory before it reaches the disk.
    pub fn put_hot(&self, d: Digest, data: Bytes) {
        self.hot.insert(d, data);
    }

    /// Evicts least recently used chunks until at most `max_bytes` remain.
    pub fn prune(&self, max_bytes: u64) {
        self.disk.run_pending_tasks();
        let mut entries: Vec<(Digest, u64)> = self.disk.iter().map(|(d, e)| (*d, e.size)).collect();
        let mut total: u64 = entries.iter().map(|(_, s)| s).sum();
        if total <= max_bytes {
            return;
        }
        // moka iterates in no particular order; file access times give the LRU order.
        entries.sort_by_key(|(d, _)| {
            std::fs::metadata(chunk_path(&self.dir, d))
                .and_then(|m| m.accessed())
                .ok()
        });
        for (d, size) in entries {
            if total <= max_bytes {
                break;
            }
            self.hot.invalidate(&d);
            self.disk.invalidate(&d);
            total -= size;
        }
        self.disk.run_pending_tasks();
    }

    pub fn stats(&self) -> CacheStats {
        self.disk.run_pending_tasks();
        CacheStats {
            dir: self.dir.display().to_string(),
            max_bytes: self.max_bytes,
            bytes: self.disk.weighted_size(),
            chunks: self.disk.entry_count(),
            evicted_chunks: self.evicted.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_chunks_served_to_readers_reach_the_disk() {
        let scratch = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-scratch");
        std::fs::create_dir_all(&scratch).unwrap();
        let dir = tempfile::tempdir_in(scratch).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let c = Arc::new(ChunkCache::open(dir.path(), 1 << 20).unwrap());
        let (used, neighbour) = (Bytes::from(vec![1u8; 5000]), Bytes::from(vec![2u8; 5000]));
        c.put_hot(Digest::of(&used), used.clone());
        c.put_hot(Digest::of(&neighbour), neighbour.clone());
        c.persist(Digest::of(&used), used.clone(), rt.handle());
        c.persist(Digest::of(&used), used.clone(), rt.handle());
        drop(rt); // waits for the write
        assert!(chunk_path(dir.path(), &Digest::of(&used)).is_file());
        assert!(!chunk_path(dir.path(), &Digest::of(&neighbour)).exists());
        assert_eq!(c.get(&Digest::of(&neighbour)).unwrap(), neighbour);
        assert_eq!(walk(dir.path()), 1);
    }

    #[test]
    fn survives_restart_bounded_and_drops_corrupt_files() {
        // On the target disk: the cache refuses tmpfs, which /tmp may be.
        let scratch = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-scratch");
        std::fs::create_dir_all(&scratch).unwrap();
        let dir = tempfile::tempdir_in(scratch).unwrap();
        let chunks: Vec<Bytes> = (0..8u8).map(|i| Bytes::from(vec![i; 10_000])).collect();
        {
            let c = ChunkCache::open(dir.path(), 1 << 20).unwrap();
            for b in &chunks {
                c.put(Digest::of(b), b.clone()).unwrap();
            }
            assert_eq!(c.get(&Digest::of(&chunks[3])).unwrap(), chunks[3]);
        }
        // Corrupt one file, then reopen: it is dropped on first use, the others verify.
        let bad = Digest::of(&chunks[5]);
        std::fs::write(chunk_path(dir.path(), &bad), b"garbage").unwrap();
        let c = ChunkCache::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(c.stats().chunks, 8);
        assert!(c.get(&bad).is_none());
        assert_eq!(c.get(&Digest::of(&chunks[1])).unwrap(), chunks[1]);
        // Pruning to 30 KB keeps 3 chunks.
        c.prune(30_000);
        let s = c.stats();
        assert!(s.bytes <= 30_000 && s.chunks == 3, "{s:?}");
        let files = walk(dir.path());
        assert_eq!(files, 3, "evicted chunks leave no files");
    }

    fn walk(dir: &Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| if p.is_dir() { walk(&p) } else { 1 })
            .sum()
    }
}
