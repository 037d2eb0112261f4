//! The chunk sink that feeds the store: skips chunks the store (or this build) already has,
//! compresses new ones on the calling (rayon) thread, fills ~1 MiB packs and uploads them
//! from tokio tasks, with a bounded queue so reading never runs far ahead of the network.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use strata_store::maintenance::ChunkLocation;
use strata_store::pack::{Pack, PackBuilder};
use strata_store::{chunk, Digest, Store};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::chunker::ChunkSink;
use crate::BuildError;

const UPLOAD_QUEUE: usize = 8;
const PARALLEL_UPLOADS: usize = 8;

/// Counters of one build.
#[derive(Debug, Default)]
pub struct UploadStats {
    pub uploaded_bytes: AtomicU64,
    pub new_data_bytes: AtomicU64,
    pub new_chunks: AtomicU64,
    pub reused_chunks: AtomicU64,
    /// File bytes seen so far, for progress.
    pub processed_bytes: AtomicU64,
}

struct State {
    /// Chunks this build has already taken care of.
    seen: HashSet<Digest>,
    pack: PackBuilder,
}

pub struct Uploader {
    index: HashMap<Digest, ChunkLocation>,
    state: Mutex<State>,
    queue: Mutex<Option<mpsc::Sender<Pack>>>,
    placed: Arc<Mutex<HashMap<Digest, ChunkLocation>>>,
    worker: Mutex<Option<tokio::task::JoinHandle<Result<(), BuildError>>>>,
    pub stats: Arc<UploadStats>,
}

impl Uploader {
    /// Starts the upload worker on the current tokio runtime. `index` is what the store
    /// already holds.
    pub fn start(store: Store, index: HashMap<Digest, ChunkLocation>) -> Uploader {
        let (tx, rx) = mpsc::channel(UPLOAD_QUEUE);
        let placed = Arc::new(Mutex::new(HashMap::new()));
        let stats = Arc::new(UploadStats::default());
        let worker = tokio::spawn(upload_worker(store, rx, placed.clone(), stats.clone()));
        Uploader {
            index,
            state: Mutex::new(State {
                seen: HashSet::new(),
                pack: PackBuilder::new(),
            }),
            queue: Mutex::new(Some(tx)),
            placed,
            worker: Mutex::new(Some(worker)),
            stats,
        }
    }

    fn send(&self, pack: Pack) -> Result<(), BuildError> {
        let tx = self
            .queue
            .lock()
            .map_err(|_| BuildError::Internal("upload queue lock poisoned".into()))?
            .clone()
            .ok_or_else(|| BuildError::Internal("chunk added after the upload finished".into()))?;
        tx.blocking_send(pack)
            .map_err(|_| BuildError::Internal("the upload worker stopped early".into()))
    }

    /// Flushes the last pack, waits for every upload, and returns where each chunk this
    /// build referenced is stored.
    pub async fn finish(
        &self,
        referenced: &HashSet<Digest>,
    ) -> Result<HashMap<Digest, ChunkLocation>, BuildError> {
        let last = {
            let mut st = self
                .state
                .lock()
                .map_err(|_| BuildError::Internal("uploader lock poisoned".into()))?;
            std::mem::take(&mut st.pack)
        };
        let tx = self
            .queue
            .lock()
            .map_err(|_| BuildError::Internal("upload queue lock poisoned".into()))?
            .take();
        if let Some(tx) = tx {
            if !last.is_empty() {
                tx.send(last.finish())
                    .await
                    .map_err(|_| BuildError::Internal("the upload worker stopped early".into()))?;
            }
        }
        let worker = self
            .worker
            .lock()
            .map_err(|_| BuildError::Internal("uploader lock poisoned".into()))?
            .take();
        if let Some(w) = worker {
            w.await
                .map_err(|e| BuildError::Internal(format!("upload worker panicked: {e}")))??;
        }
        let placed = self
            .placed
            .lock()
            .map_err(|_| BuildError::Internal("uploader lock poisoned".into()))?;
        let mut out = HashMap::with_capacity(referenced.len());
        for d in referenced {
            let loc = placed
                .get(d)
                .or_else(|| self.index.get(d))
                .ok_or_else(|| BuildError::Internal(format!("chunk {d} was never stored")))?;
            out.insert(*d, *loc);
        }
        Ok(out)
    }

    /// Stops the worker without committing anything (a failed build), and returns the
    /// error that ended the worker, if one did: the cause when the reader failed only
    /// because the worker was gone (a full disk, an unreachable store).
    pub async fn abort(&self) -> Option<BuildError> {
        if let Ok(mut q) = self.queue.lock() {
            q.take();
        }
        let mut worker = self.worker.lock().ok().and_then(|mut w| w.take())?;
        // With the queue closed the worker ends once its uploads in flight do; it may
        // also have ended already, on an error of its own.
        match tokio::time::timeout(std::time::Duration::from_secs(2), &mut worker).await {
            Ok(Ok(Err(e))) => Some(e),
            Ok(_) => None,
            Err(_) => {
                worker.abort();
                None
            }
        }
    }
}

impl ChunkSink for Uploader {
    fn put(&self, data: &[u8], digest: Digest) -> Result<(), BuildError> {
        self.stats
            .processed_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        {
            let mut st = self
                .state
                .lock()
                .map_err(|_| BuildError::Internal("uploader lock poisoned".into()))?;
            if !st.seen.insert(digest) {
                return Ok(());
            }
        }
        if self.index.contains_key(&digest) {
            self.stats.reused_chunks.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        self.stats.new_chunks.fetch_add(1, Ordering::Relaxed);
        self.stats
            .new_data_bytes
            .fetch_add(data.len() as u64, Ordering::Relaxed);
        // Compress outside the lock: this is where the CPU goes.
        let encoded = chunk::encode(data);
        let full = {
            let mut st = self
                .state
                .lock()
                .map_err(|_| BuildError::Internal("uploader lock poisoned".into()))?;
            if st.pack.push(&encoded) {
                Some(std::mem::take(&mut st.pack).finish())
            } else {
                None
            }
        };
        match full {
            Some(pack) => self.send(pack),
            None => Ok(()),
        }
    }
}

async fn upload_worker(
    store: Store,
    mut rx: mpsc::Receiver<Pack>,
    placed: Arc<Mutex<HashMap<Digest, ChunkLocation>>>,
    stats: Arc<UploadStats>,
) -> Result<(), BuildError> {
    let mut tasks: JoinSet<Result<(), BuildError>> = JoinSet::new();
    while let Some(pack) = rx.recv().await {
        while tasks.len() >= PARALLEL_UPLOADS {
            if let Some(r) = tasks.join_next().await {
                r.map_err(|e| BuildError::Internal(format!("upload task panicked: {e}")))??;
            }
        }
        let store = store.clone();
        let placed = placed.clone();
        let stats = stats.clone();
        tasks.spawn(async move {
            if store.put_pack(&pack).await? {
                stats
                    .uploaded_bytes
                    .fetch_add(pack.bytes.len() as u64, Ordering::Relaxed);
            }
            let mut placed = placed
                .lock()
                .map_err(|_| BuildError::Internal("uploader lock poisoned".into()))?;
            for c in &pack.chunks {
                placed.insert(
                    c.digest,
                    ChunkLocation {
                        pack: pack.id,
                        offset: c.offset,
                        stored_length: c.stored_length,
                        length: c.length,
                    },
                );
            }
            Ok(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.map_err(|e| BuildError::Internal(format!("upload task panicked: {e}")))??;
    }
    Ok(())
}
