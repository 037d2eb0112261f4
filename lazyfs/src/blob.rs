//! One layer's data blob as the kernel sees it: a virtual file assembled from the layer's
//! chunk table. Reads map to chunks, which come from the cache or are fetched from the
//! store, verified, with bounded retries; readahead follows the reader.
//!
//! Requests are shaped by the store's [`StoreTuning`]: a miss fetches its chunk with the
//! neighbours that follow it in the pack up to the store's range size (a few times that
//! from a store whose round trips turn out long), and bulk work
//! (readahead, the prefetch list) keeps the store's concurrency in flight (8 requests
//! against a local directory, 32 against S3). A neighbour another fetch already has in
//! flight is not asked for twice: each fetch claims the chunks it carries.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use strata_store::{
    chunk, Digest, LayerManifest, PackedAt, PrefetchList, Store, StoreError, StoreTuning,
};

use crate::cache::{ChunkAt, ChunkCache, Flight, Span};
use crate::LazyError;

/// How many fetch units past a sequential read to fetch ahead from the store, in parallel...
const READAHEAD_UNITS: u64 = 4;
/// ...and how far to load ahead from the local cache file, in reads of this size.
const LOCAL_READAHEAD: u64 = 24 << 20;
const LOCAL_RUN: u64 = 8 << 20;
/// Background prefetch waits while this many on-demand fetches are in flight.
const PREFETCH_YIELD: usize = 2;
/// A read of a layer's packed prefetch copy covers this many fetch units: every byte of
/// it is wanted, so only the time a reader may wait on a claimed chunk bounds it.
const PACKED_RANGE_UNITS: u64 = 4;
/// Reads of the packed copy in flight.
const PACKED_PARALLEL: usize = 4;
/// A store whose quickest fetch so far took at least this long is far away: its misses
/// and readahead carry [`FAR_UNITS`] ranges per request instead of one, since each saved
/// round trip is worth more than the extra bytes. Measured on the first Python start from
/// radosgw at +10 ms round trip: 4 MiB per miss took 0.95-0.97 s against 1.24-1.38 s at
/// 1 MiB; at +2 ms, 4 MiB was slower (0.71 s against 0.64-0.80) and 2 MiB no faster.
const FAR_AWAY: Duration = Duration::from_millis(8);
const FAR_UNITS: u64 = 4;
/// Upper bounds (ms) of the fetch latency histogram buckets; the last bucket is open.
pub const LATENCY_BUCKETS_MS: [u64; 10] = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000];

/// Counters of one layer since the daemon started. JSON keys are part of
/// `strata layer stats --json`.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize, Clone)]
pub struct LayerStats {
    pub id: String,
    pub blob_bytes: u64,
    pub requested_bytes: u64,
    pub fetched_bytes: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub fetch_errors: u64,
    /// Counts per bucket of [`LATENCY_BUCKETS_MS`], plus one for slower fetches.
    pub fetch_latency_ms: Vec<u64>,
    pub prefetched_chunks: u64,
}

#[derive(Default)]
struct Counters {
    requested: AtomicU64,
    fetched: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    errors: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS_MS.len() + 1],
    prefetched: AtomicU64,
}

/// How long a read waits for an unreachable store before failing with EIO.
#[derive(Debug, Clone, Copy)]
pub struct FetchPolicy {
    pub timeout: Duration,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy {
            timeout: Duration::from_secs(30),
        }
    }
}

pub struct LayerBlob {
    pub manifest: Arc<LayerManifest>,
    store: Store,
    tuning: StoreTuning,
    cache: Arc<ChunkCache>,
    policy: FetchPolicy,
    counters: Counters,
    /// Chunk indexes of this layer per pack, sorted by offset in the pack.
    by_pack: HashMap<u32, Vec<usize>>,
    /// First-touch order of chunks, recorded for the prefetch list.
    access: Mutex<(Vec<u32>, Vec<bool>)>,
    /// On-demand fetches in flight; background prefetch yields to them.
    pub(crate) foreground: AtomicUsize,
    /// The chunks this attach's prefetch list names (by chunk index): readahead leaves
    /// them to the prefetch rather than fetch them a second way, and a reader that keeps
    /// to them is following the recorded run, which the list already predicts.
    prefetch_set: std::sync::RwLock<Option<Arc<Vec<bool>>>>,
    /// The quickest fetch from the store so far, in microseconds: about its round trip.
    quickest_fetch_us: AtomicU64,
    /// End of the previous read, to recognize sequential reading.
    last_end: AtomicU64,
    /// Where the readahead already started for a sequential reader ends, from the cache
    /// file and from the store.
    ahead_local: AtomicU64,
    ahead_store: AtomicU64,
    rt: tokio::runtime::Handle,
}

impl LayerBlob {
    pub fn new(
        manifest: LayerManifest,
        store: Store,
        cache: Arc<ChunkCache>,
        policy: FetchPolicy,
        rt: tokio::runtime::Handle,
    ) -> LayerBlob {
        let mut by_pack: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, c) in manifest.chunks.iter().enumerate() {
            by_pack.entry(c.pack).or_default().push(i);
        }
        for v in by_pack.values_mut() {
            v.sort_by_key(|&i| manifest.chunks[i].pack_offset);
        }
        let n = manifest.chunks.len();
        LayerBlob {
            manifest: Arc::new(manifest),
            tuning: store.tuning(),
            store,
            cache,
            policy,
            counters: Counters::default(),
            by_pack,
            access: Mutex::new((Vec::new(), vec![false; n])),
            foreground: AtomicUsize::new(0),
            prefetch_set: std::sync::RwLock::new(None),
            quickest_fetch_us: AtomicU64::new(u64::MAX),
            last_end: AtomicU64::new(u64::MAX),
            ahead_local: AtomicU64::new(0),
            ahead_store: AtomicU64::new(0),
            rt,
        }
    }

    /// Chunk `i` as the cache names it.
    fn at(&self, i: usize) -> ChunkAt {
        ChunkAt::of(&self.manifest, i)
    }

    pub fn id(&self) -> Digest {
        self.manifest.id
    }

    pub fn size(&self) -> u64 {
        self.manifest.blob_size
    }

    /// Reads `len` bytes at `offset` of the blob (short at the end). Blocks; call from a
    /// thread that may block (FUSE workers). A read inside one chunk is a view of the
    /// cached chunk, not a copy.
    pub fn read(self: &Arc<Self>, offset: u64, len: u32) -> Result<Bytes, LazyError> {
        let end = (offset + len as u64).min(self.size());
        if offset >= end {
            return Ok(Bytes::new());
        }
        self.counters
            .requested
            .fetch_add(end - offset, Ordering::Relaxed);
        let want = (end - offset) as usize;
        // The parts of chunks the read covers, and the cache-file read they all came from,
        // if they did.
        let mut parts: Vec<(u64, Bytes)> = Vec::new();
        let mut shared: Option<Arc<Span>> = None;
        let chunks = &self.manifest.chunks;
        let first = self.manifest.chunk_at(offset);
        let mut i = first;
        while i < chunks.len() && chunks[i].blob_offset < end {
            let c = &chunks[i];
            self.record_access(i);
            let from = offset.max(c.blob_offset);
            let to = end.min(c.blob_offset + c.length as u64);
            let (lo, n) = ((from - c.blob_offset) as usize, (to - from) as usize);
            let at = self.at(i);
            let (chunk, span) = match self.cache.get_hot(&at) {
                Some(hot) => {
                    self.counters.hits.fetch_add(1, Ordering::Relaxed);
                    (hot.data, hot.span)
                }
                None => (self.load_for_read(i)?, None),
            };
            if chunk.len() < lo + n {
                return Err(LazyError::Chunk(format!(
                    "chunk {} is shorter than its manifest says",
                    c.digest
                )));
            }
            shared = match (parts.is_empty(), shared, span) {
                (true, _, span) => span,
                (false, Some(a), Some(b)) if Arc::ptr_eq(&a, &b) => Some(a),
                _ => None,
            };
            parts.push((from, chunk.slice(lo..lo + n)));
            self.cache.persist(at, chunk, &self.rt);
            i += 1;
        }
        // Read ahead only for sequential readers (the kernel reading a large file in
        // order); scattered small-file reads would drag in data nobody asked for.
        let sequential = self.last_end.swap(end, Ordering::Relaxed) == offset;
        if sequential {
            self.readahead(first..i, end);
        }
        if let [(_, view)] = parts.as_slice() {
            if view.len() == want {
                return Ok(view.clone());
            }
        }
        if let Some(s) = shared.filter(|s| {
            s.layer == self.id() && s.offset <= offset && end <= s.offset + s.bytes.len() as u64
        }) {
            // The span holds the padding between its chunks too, as zeros.
            return Ok(s
                .bytes
                .slice((offset - s.offset) as usize..(end - s.offset) as usize));
        }
        let mut out: Vec<u8> = Vec::with_capacity(want);
        for (from, view) in parts {
            // Bytes between chunks (padding) read as zeros.
            out.resize((from - offset) as usize, 0);
            out.extend_from_slice(&view);
        }
        out.resize(want, 0);
        Ok(Bytes::from(out))
    }

    fn record_access(&self, i: usize) {
        if let Ok(mut a) = self.access.lock() {
            let (order, seen) = &mut *a;
            if !seen[i] {
                seen[i] = true;
                order.push(i as u32);
            }
        }
    }

    /// Chunk indexes in first-touch order so far.
    pub fn access_order(&self) -> Vec<u32> {
        self.access.lock().map(|a| a.0.clone()).unwrap_or_default()
    }

    /// A read missed the memory cache: load chunk `i` from the disk cache or the store
    /// (once, however many readers and readaheads want it), blocking the calling FUSE thread.
    fn load_for_read(self: &Arc<Self>, i: usize) -> Result<Bytes, LazyError> {
        self.foreground.fetch_add(1, Ordering::Relaxed);
        let this = self.clone();
        let r = self.rt.block_on(async move { this.load(i).await });
        self.foreground.fetch_sub(1, Ordering::Relaxed);
        let (data, from) = r?;
        let counter = match from {
            Origin::Cache => &self.counters.hits,
            Origin::Store => &self.counters.misses,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(data)
    }

    /// Chunk `i` from the cache or the store, loaded once however many readers want it.
    pub(crate) async fn load(self: &Arc<Self>, i: usize) -> Result<(Bytes, Origin), LazyError> {
        self.load_with(i, &Along::Neighbours).await
    }

    /// [`Self::load`], a fetch carrying along what `along` says.
    async fn load_with(
        self: &Arc<Self>,
        i: usize,
        along: &Along,
    ) -> Result<(Bytes, Origin), LazyError> {
        let d = self.manifest.chunks[i].digest;
        let flight = self.cache.flight(&d);
        let _guard = flight.lock().await;
        let cached = tokio::task::block_in_place(|| self.cache.get(&self.at(i)));
        let r = match cached {
            Some(b) => Ok((b, Origin::Cache)),
            None => self.fetch(i, along).await.map(|b| (b, Origin::Store)),
        };
        drop(_guard);
        self.cache.land(&d, flight);
        r
    }

    /// Fetches chunk `i` and the neighbours `along` names in the same pack (up to the
    /// store's range size in one request), caching every chunk that verifies; retries
    /// transient failures until the policy's timeout, and refetches a corrupt chunk once.
    async fn fetch(self: &Arc<Self>, i: usize, along: &Along) -> Result<Bytes, LazyError> {
        let started = Instant::now();
        let deadline = started + self.policy.timeout;
        let mut delay = Duration::from_millis(50);
        let mut corrupt_retry = false;
        loop {
            let along = if corrupt_retry {
                &Along::Nothing
            } else {
                along
            };
            // Each attempt gets what is left of the deadline: one request the store never
            // answers (its client's own timeout is far longer) must not hold a read past
            // the bound an outage fails it within.
            let left = deadline.saturating_duration_since(Instant::now());
            match within(left, self.fetch_once(i, along)).await {
                Ok(b) => {
                    self.observe(started.elapsed());
                    return Ok(b);
                }
                Err(FetchError::Corrupt(msg)) if !corrupt_retry => {
                    tracing::warn!(layer = %self.id(), "{msg}; fetching it again");
                    corrupt_retry = true;
                }
                Err(FetchError::Corrupt(msg)) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(layer = %self.id(), "{msg}; failing the read with EIO");
                    return Err(LazyError::Chunk(msg));
                }
                Err(e @ (FetchError::Store(_) | FetchError::NoAnswer(_))) => {
                    if Instant::now() + delay > deadline {
                        self.counters.errors.fetch_add(1, Ordering::Relaxed);
                        let c = &self.manifest.chunks[i];
                        tracing::error!(layer = %self.id(), chunk = %c.digest, error = %e, "store unreachable; failing the read with EIO");
                        return Err(LazyError::Unavailable(format!(
                            "store unavailable: chunk {} of layer {}: {e} (gave up after {:?})",
                            c.digest,
                            self.id(),
                            self.policy.timeout
                        )));
                    }
                    tracing::debug!(error = %e, "fetch failed; retrying in {delay:?}");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    fn observe(&self, took: Duration) {
        self.quickest_fetch_us
            .fetch_min(took.as_micros() as u64, Ordering::Relaxed);
        let ms = took.as_millis() as u64;
        let b = LATENCY_BUCKETS_MS
            .iter()
            .position(|&u| ms <= u)
            .unwrap_or(LATENCY_BUCKETS_MS.len());
        self.counters.latency[b].fetch_add(1, Ordering::Relaxed);
    }

    /// How much one fetch for a miss or readahead carries: the store's range size, or
    /// [`FAR_UNITS`] of them from a store whose round trip is long.
    fn fetch_unit(&self) -> u64 {
        fetch_unit(
            self.tuning.range_bytes,
            self.quickest_fetch_us.load(Ordering::Relaxed),
        )
    }

    /// One attempt: a range GET over the pack covering chunk `i` and the chunks of this
    /// layer that follow it in the pack and `along` admits, up to the fetch unit,
    /// that nobody else is fetching (they are claimed for the time of the fetch, so a
    /// reader of one waits for this fetch instead of asking again).
    async fn fetch_once(&self, i: usize, along: &Along) -> Result<Bytes, FetchError> {
        let chunks = &self.manifest.chunks;
        let c = &chunks[i];
        let pack = self.manifest.packs[c.pack as usize];
        let unit = self.fetch_unit().max(c.stored_length as u64);
        let mut claims = Claims::new(&self.cache);
        let mut group = vec![i];
        let order = &self.by_pack[&c.pack];
        let pos = order.iter().position(|&j| j == i).unwrap_or(0);
        let mut end = c.pack_offset + c.stored_length as u64;
        for &j in order.get(pos + 1..).unwrap_or_default() {
            let cj = &chunks[j];
            let j_end = cj.pack_offset + cj.stored_length as u64;
            if j_end - c.pack_offset > unit {
                break;
            }
            match along {
                Along::Nothing => break,
                // Neighbours must also be near in the blob (the same directory, roughly):
                // pack order follows the source's order, and a pack neighbour from another
                // part of the tree is bytes nobody asked for.
                Along::Neighbours => {
                    if cj.blob_offset.abs_diff(c.blob_offset) > unit
                        || cj.digest == c.digest
                        || self.cache.contains(&self.at(j))
                        || !claims.claim(&cj.digest)
                    {
                        break;
                    }
                }
                // Listed chunks only, skipping over others while the bytes between stay
                // small: a prefetch list fetches what the first run read, not its
                // neighbourhood.
                Along::Listed(listed) => {
                    if cj.pack_offset > end + LISTED_GAP {
                        break;
                    }
                    if !listed.get(j).copied().unwrap_or(false)
                        || cj.digest == c.digest
                        || self.cache.contains(&self.at(j))
                        || !claims.claim(&cj.digest)
                    {
                        continue;
                    }
                }
            }
            end = end.max(j_end);
            group.push(j);
        }
        let last = &chunks[*group.last().unwrap_or(&i)];
        let start = c.pack_offset;
        let end = last.pack_offset + last.stored_length as u64;
        let bytes = self
            .store
            .read_pack_range(&pack, start, end - start)
            .await
            .map_err(|e| match e {
                StoreError::Corrupt { .. } => FetchError::Corrupt(e.to_string()),
                e => FetchError::Store(e),
            })?;
        self.counters
            .fetched
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        // Every chunk of the group is verified before it is served or cached (a neighbour
        // decoded later would let a concurrent reader fetch it again); a chunk reaches the
        // disk when a reader is served it (`ChunkCache::persist`), off the read path.
        let mut wanted = None;
        for &j in &group {
            let cj = &chunks[j];
            let s = (cj.pack_offset - start) as usize;
            match chunk::decode(
                &bytes[s..s + cj.stored_length as usize],
                cj.length,
                &cj.digest,
            ) {
                Ok(data) => {
                    let data = Bytes::from(data);
                    self.cache.put_hot(cj.digest, data.clone());
                    if j == i {
                        wanted = Some(data);
                    }
                }
                Err(e) if j == i => {
                    return Err(FetchError::Corrupt(format!(
                        "chunk {} (pack {pack}, layer {}) is corrupt: {e}",
                        cj.digest,
                        self.id()
                    )))
                }
                Err(e) => {
                    tracing::warn!(chunk = %cj.digest, error = %e, "neighbouring chunk is corrupt; not cached")
                }
            }
        }
        wanted.ok_or_else(|| {
            FetchError::Corrupt(format!("chunk {} missing from its fetch", c.digest))
        })
    }

    /// Starts background loads of the chunks after a sequential read: from this layer's
    /// cache file up to [`LOCAL_READAHEAD`] ahead, from the store up to
    /// [`READAHEAD_UNITS`] fetch units ahead, that many fetches in flight; from the store
    /// unless the chunks `read` lay wholly in the prefetch list.
    fn readahead(self: &Arc<Self>, read: Range<usize>, read_end: u64) {
        let next = read.end;
        // Chunks in this layer's cache file: far ahead, in reads of a few MiB issued at
        // once, the readahead a local block device would get from the kernel.
        let mut local: Vec<ChunkAt> = Vec::new();
        let mut local_bytes = 0u64;
        for j in self.window(&self.ahead_local, next, read_end, LOCAL_READAHEAD) {
            let c = self.at(j);
            if self.cache.is_hot(&c.digest) || !self.cache.on_disk(&c) {
                continue;
            }
            local_bytes += c.len as u64;
            local.push(c);
            if local_bytes >= LOCAL_RUN {
                self.load_local(std::mem::take(&mut local));
                local_bytes = 0;
            }
        }
        self.load_local(local);
        // From the store: the next few fetch units, nearest first, in parallel (each
        // fetch claims what it carries, so they do not overlap). Not while the reader
        // keeps to the prefetch list's chunks: the list knows what comes next, and
        // reading ahead past it fetched more than the list itself (a first Python start
        // from radosgw at +2 ms: 34 MB instead of 16, 0.38 s instead of 0.28).
        if !read.is_empty() && read.clone().all(|j| self.prefetching(j)) {
            return;
        }
        let todo: Vec<usize> = self
            .window(
                &self.ahead_store,
                next,
                read_end,
                READAHEAD_UNITS * self.fetch_unit(),
            )
            .filter(|&j| {
                let c = self.at(j);
                !self.cache.is_hot(&c.digest) && !self.cache.on_disk(&c) && !self.prefetching(j)
            })
            .collect();
        if todo.is_empty() {
            return;
        }
        let this = self.clone();
        self.rt.spawn(async move {
            use futures::StreamExt;
            futures::stream::iter(todo)
                .map(|j| {
                    let this = this.clone();
                    async move {
                        if !this.cache.contains(&this.at(j)) {
                            let _ = this.load(j).await;
                        }
                    }
                })
                .buffered(READAHEAD_UNITS as usize)
                .collect::<()>()
                .await;
        });
    }

    fn load_local(&self, run: Vec<ChunkAt>) {
        if !run.is_empty() {
            let cache = self.cache.clone();
            self.rt.spawn_blocking(move || cache.load_run(&run));
        }
    }

    /// The chunks of a readahead window of `size` past `read_end` that an earlier read's
    /// window (ending at `marker`) did not already cover: each read extends the window
    /// instead of asking for the same chunks again.
    fn window(&self, marker: &AtomicU64, next: usize, read_end: u64, size: u64) -> Range<usize> {
        let chunks = &self.manifest.chunks;
        let end = read_end + size;
        let ahead = marker.swap(end, Ordering::Relaxed);
        let mut from = next;
        if ahead > read_end && ahead <= end {
            from = from.max(chunks.partition_point(|c| c.blob_offset < ahead));
        }
        let to = chunks.partition_point(|c| c.blob_offset < end);
        from..to.max(from)
    }

    /// Fetches a prefetch list in the background: from its packed copy when there is one
    /// (ranges of a few fetch units, the store's concurrency in flight, in list order),
    /// then whatever is still missing from the layer's packs (all of it, without a packed
    /// copy). Both hold back while several on-demand fetches are in flight, so reads a
    /// sandbox waits for go first.
    pub fn prefetch(self: &Arc<Self>, list: PrefetchList) {
        let this = self.clone();
        let n = self.manifest.chunks.len();
        let mut listed = vec![false; n];
        for &i in &list.order {
            if let Some(l) = listed.get_mut(i as usize) {
                *l = true;
            }
        }
        let listed = Arc::new(listed);
        if let Ok(mut p) = self.prefetch_set.write() {
            *p = Some(listed.clone());
        }
        self.rt.spawn(async move {
            if !list.packed.is_empty() {
                this.prefetch_packed(&list.packed).await;
            }
            this.prefetch_listed(list.order, listed).await;
        });
    }

    /// Whether the prefetch list names chunk `i` (its prefetch brings it, or has).
    fn prefetching(&self, i: usize) -> bool {
        self.prefetch_set
            .read()
            .ok()
            .and_then(|p| p.as_ref().and_then(|l| l.get(i).copied()))
            .unwrap_or(false)
    }

    /// Waits while several on-demand fetches are in flight.
    async fn yield_to_readers(&self) {
        while self.foreground.load(Ordering::Relaxed) >= PREFETCH_YIELD {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// The packed copy of the prefetch list, in ranges of [`PACKED_RANGE_UNITS`] fetch
    /// units started in list order.
    async fn prefetch_packed(self: &Arc<Self>, packed: &[PackedAt]) {
        use futures::StreamExt;
        let span = PACKED_RANGE_UNITS * self.tuning.range_bytes;
        let mut runs: Vec<Vec<PackedAt>> = Vec::new();
        let mut start = 0;
        for k in 1..=packed.len() {
            if k == packed.len()
                || packed[k].offset + packed[k].stored_length as u64 - packed[start].offset > span
            {
                runs.push(packed[start..k].to_vec());
                start = k;
            }
        }
        // A few at a time, not the store's whole concurrency: the reader needs the first
        // ranges first, and ranges sharing a saturated store all finish late together.
        futures::stream::iter(runs)
            .map(|run| {
                let this = self.clone();
                async move { this.fetch_packed_run(&run).await }
            })
            .buffered(self.tuning.concurrency.min(PACKED_PARALLEL))
            .collect::<()>()
            .await;
    }

    /// One range of the packed copy: the chunks of `run` nobody has or is fetching, claimed
    /// while they come, each checked against the manifest (one that does not match is left
    /// to the layer's packs).
    async fn fetch_packed_run(self: &Arc<Self>, run: &[PackedAt]) {
        self.yield_to_readers().await;
        let n = self.manifest.chunks.len();
        let mut claims = Claims::new(&self.cache);
        let wanted: Vec<PackedAt> = run
            .iter()
            .filter(|p| (p.index as usize) < n)
            .filter(|p| {
                let at = self.at(p.index as usize);
                !self.cache.contains(&at) && claims.claim(&at.digest)
            })
            .copied()
            .collect();
        let (Some(first), Some(last)) = (wanted.first(), wanted.last()) else {
            return;
        };
        let start = first.offset;
        let end = last.offset + last.stored_length as u64;
        let started = Instant::now();
        // Bounded like a reader's fetch: a reader of a chunk claimed here waits for this.
        let id = self.id();
        let read = self
            .store
            .read_prefetch_pack(&id, start, end.saturating_sub(start));
        let bytes = match within(self.policy.timeout, async {
            read.await.map_err(FetchError::Store)
        })
        .await
        {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(layer = %self.id(), error = %e, "prefetch copy unreadable; fetching from the layer's packs");
                return;
            }
        };
        self.observe(started.elapsed());
        self.counters
            .fetched
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        for p in wanted {
            let c = &self.manifest.chunks[p.index as usize];
            let s = (p.offset - start) as usize;
            let decoded = bytes
                .get(s..s + p.stored_length as usize)
                .ok_or_else(|| "outside the range read".to_string())
                .and_then(|stored| {
                    chunk::decode(stored, c.length, &c.digest).map_err(|e| e.to_string())
                });
            match decoded {
                Ok(data) => {
                    self.cache.put_hot(c.digest, Bytes::from(data));
                    self.counters.prefetched.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::warn!(layer = %self.id(), chunk = %c.digest, error = %e, "the prefetch copy does not match the layer; fetching from its packs")
                }
            }
        }
    }

    /// Fetches `order` (chunk indexes) from the layer's packs, the store's concurrency in
    /// flight, started in list order (the order a first run needed them), listed
    /// neighbours coalesced.
    async fn prefetch_listed(self: &Arc<Self>, order: Vec<u32>, listed: Arc<Vec<bool>>) {
        use futures::StreamExt;
        let n = self.manifest.chunks.len();
        let along = Arc::new(Along::Listed(listed));
        futures::stream::iter(
            order
                .into_iter()
                .map(|i| i as usize)
                .filter(move |&i| i < n),
        )
        .map(|i| {
            let (this, along) = (self.clone(), along.clone());
            async move {
                this.yield_to_readers().await;
                // Cached, or coming with an earlier fetch: nothing to wait for here.
                let at = this.at(i);
                if this.cache.contains(&at) || this.cache.in_flight(&at.digest) {
                    return;
                }
                if this.load_with(i, &along).await.is_ok() {
                    this.counters.prefetched.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
        .buffer_unordered(self.tuning.concurrency)
        .collect::<()>()
        .await;
    }

    /// The listed chunks' contents, from the cache, in list order; None if one is not
    /// cached any more (or they exceed what a packed copy holds).
    pub fn cached_chunks(&self, order: &[u32]) -> Option<Vec<Bytes>> {
        let mut total = 0u64;
        let mut out = Vec::with_capacity(order.len());
        for &i in order {
            let i = i as usize;
            if i >= self.manifest.chunks.len() {
                return None;
            }
            total += self.manifest.chunks[i].length as u64;
            if total > strata_store::prefetch::MAX_PACKED_BYTES {
                return None;
            }
            out.push(self.cache.get(&self.at(i))?);
        }
        Some(out)
    }

    pub fn stats(&self) -> LayerStats {
        let c = &self.counters;
        LayerStats {
            id: self.id().to_hex(),
            blob_bytes: self.size(),
            requested_bytes: c.requested.load(Ordering::Relaxed),
            fetched_bytes: c.fetched.load(Ordering::Relaxed),
            cache_hits: c.hits.load(Ordering::Relaxed),
            cache_misses: c.misses.load(Ordering::Relaxed),
            fetch_errors: c.errors.load(Ordering::Relaxed),
            fetch_latency_ms: c
                .latency
                .iter()
                .map(|a| a.load(Ordering::Relaxed))
                .collect(),
            prefetched_chunks: c.prefetched.load(Ordering::Relaxed),
        }
    }
}

/// What a fetch carries along with the chunk it is for.
enum Along {
    /// Just the chunk (refetching a corrupt one).
    Nothing,
    /// The layer's chunks that follow it in the pack and are near it in the blob.
    Neighbours,
    /// The following chunks marked in this table (by chunk index): a prefetch list's.
    Listed(Arc<Vec<bool>>),
}

/// Bytes of unlisted chunks a prefetch fetch may carry between two listed ones rather
/// than split into two requests.
const LISTED_GAP: u64 = 64 << 10;

/// Chunks a fetch carries, claimed (their flight locks held) until it has cached them, so
/// a concurrent reader of one waits for this fetch rather than fetching it again.
struct Claims<'a> {
    cache: &'a ChunkCache,
    held: Vec<(Digest, Flight, tokio::sync::OwnedMutexGuard<()>)>,
}

impl<'a> Claims<'a> {
    fn new(cache: &'a ChunkCache) -> Claims<'a> {
        Claims {
            cache,
            held: Vec::new(),
        }
    }

    /// Claims chunk `d` unless another fetch (or a reader loading it) holds it.
    fn claim(&mut self, d: &Digest) -> bool {
        let flight = self.cache.flight(d);
        match flight.clone().try_lock_owned() {
            Ok(guard) => {
                self.held.push((*d, flight, guard));
                true
            }
            Err(_) => {
                self.cache.land(d, flight);
                false
            }
        }
    }
}

impl Drop for Claims<'_> {
    fn drop(&mut self) {
        for (d, flight, guard) in self.held.drain(..) {
            drop(guard);
            self.cache.land(&d, flight);
        }
    }
}

/// Where a loaded chunk came from.
pub(crate) enum Origin {
    Cache,
    Store,
}

enum FetchError {
    Corrupt(String),
    Store(StoreError),
    /// The store did not answer within this (what was left of the fetch's deadline).
    NoAnswer(Duration),
}

/// What one fetch carries from a store with ranges of `range_bytes` whose quickest fetch
/// so far took `quickest_us` (`u64::MAX`: none yet).
fn fetch_unit(range_bytes: u64, quickest_us: u64) -> u64 {
    let far = quickest_us != u64::MAX && quickest_us >= FAR_AWAY.as_micros() as u64;
    range_bytes * if far { FAR_UNITS } else { 1 }
}

/// `fetch`'s result, or [`FetchError::NoAnswer`] once `limit` has passed.
async fn within<T>(
    limit: Duration,
    fetch: impl std::future::Future<Output = Result<T, FetchError>>,
) -> Result<T, FetchError> {
    tokio::time::timeout(limit, fetch)
        .await
        .unwrap_or(Err(FetchError::NoAnswer(limit)))
}

impl std::fmt::Display for FetchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FetchError::Corrupt(msg) => f.write_str(msg),
            FetchError::Store(e) => e.fmt(f),
            FetchError::NoAnswer(d) => write!(f, "no answer within {d:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_store_whose_quickest_fetch_is_slow_gets_wider_fetches() {
        const MIB: u64 = 1 << 20;
        assert_eq!(fetch_unit(MIB, u64::MAX), MIB, "nothing fetched yet");
        assert_eq!(fetch_unit(MIB, 300), MIB, "a local directory");
        assert_eq!(fetch_unit(MIB, 3_000), MIB, "an object store nearby");
        assert_eq!(fetch_unit(MIB, 7_999), MIB);
        assert_eq!(fetch_unit(MIB, 8_000), FAR_UNITS * MIB, "a distant one");
        assert_eq!(fetch_unit(MIB, 25_000), FAR_UNITS * MIB);
    }
}
