//! Cuts one file's content into storage chunks: per file, from its start; all-zero EROFS
//! chunks become holes; inside each run of data, content-defined (FastCDC) boundaries so an
//! insertion re-chunks only its neighbourhood. Chunks are hashed in parallel and handed to
//! a [`ChunkSink`], which decides whether they are new.

use std::io::Read;

use fastcdc::v2020::{FastCDC, Normalization};
use rayon::prelude::*;
use strata_store::Digest;

use crate::tree::{ChunkRef, FileData, Segment};
use crate::BuildError;

/// Content-defined chunk size bounds. An average of 512 KiB keeps a one-byte insertion's
/// cost near one chunk while objects stay in the MiB range.
pub const MIN_CHUNK: usize = 128 << 10;
pub const AVG_CHUNK: usize = 512 << 10;
pub const MAX_CHUNK: usize = 2 << 20;

/// Buffered data is cut once this much has accumulated (several maximum-size chunks, so the
/// cut points found before its end are the same ones a whole-file pass would find).
const CUT_BATCH: usize = 16 << 20;

/// Receives every chunk of every file, possibly from many threads at once.
pub trait ChunkSink: Sync {
    /// `data` has content `digest`. The sink stores it unless it already has it.
    fn put(&self, data: &[u8], digest: Digest) -> Result<(), BuildError>;
}

/// Chunks the next `size` bytes of `reader`. `path` names the file in errors.
pub fn chunk_file(
    path: &str,
    reader: &mut dyn Read,
    size: u64,
    sink: &dyn ChunkSink,
) -> Result<FileData, BuildError> {
    let chunk_size = 1usize << FileData::chunk_bits(size);
    let erofs_chunks = FileData::erofs_chunks(size);
    let mut segments = Vec::new();
    let mut current: Option<Segment> = None;
    let mut buf: Vec<u8> = Vec::with_capacity(CUT_BATCH.min(size as usize) + chunk_size);
    let io = |source| BuildError::Io {
        path: path.to_string(),
        source,
    };
    for i in 0..erofs_chunks {
        let len = (size - i * chunk_size as u64).min(chunk_size as u64) as usize;
        let start = buf.len();
        buf.resize(start + len, 0);
        reader.read_exact(&mut buf[start..]).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                BuildError::BadEntry {
                    path: path.to_string(),
                    reason: format!(
                        "file is shorter than its recorded size {size} (changed while reading?)"
                    ),
                }
            } else {
                io(e)
            }
        })?;
        if is_zero(&buf[start..]) {
            buf.truncate(start);
            if let Some(mut seg) = current.take() {
                cut(&mut buf, true, &mut seg, sink)?;
                segments.push(seg);
            }
            continue;
        }
        let seg = current.get_or_insert_with(|| Segment {
            first: i,
            count: 0,
            chunks: Vec::new(),
        });
        seg.count += 1;
        if buf.len() >= CUT_BATCH {
            cut(&mut buf, false, seg, sink)?;
        }
    }
    if let Some(mut seg) = current.take() {
        cut(&mut buf, true, &mut seg, sink)?;
        segments.push(seg);
    }
    Ok(FileData { size, segments })
}

fn is_zero(data: &[u8]) -> bool {
    // An OR-fold per block vectorizes; an early-exit `all` over bytes does not.
    data.chunks(4096)
        .all(|block| block.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

/// Cuts `buf` into chunks, hands them to the sink and appends them to `seg`. Unless
/// `last`, the final piece (whose end is only the buffer's end, not a content boundary)
/// stays in `buf` for the next round.
fn cut(
    buf: &mut Vec<u8>,
    last: bool,
    seg: &mut Segment,
    sink: &dyn ChunkSink,
) -> Result<(), BuildError> {
    let mut pieces: Vec<(usize, usize)> =
        FastCDC::with_level(buf, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK, Normalization::Level2)
            .map(|c| (c.offset, c.length))
            .collect();
    if !last {
        pieces.pop();
    }
    let data: &[u8] = buf;
    let digests: Vec<Digest> = pieces
        .par_iter()
        .map(|&(off, len)| {
            let d = Digest::of(&data[off..off + len]);
            sink.put(&data[off..off + len], d).map(|_| d)
        })
        .collect::<Result<_, _>>()?;
    let consumed = pieces.last().map(|&(o, l)| o + l).unwrap_or(0);
    seg.chunks.extend(
        pieces
            .iter()
            .zip(digests)
            .map(|(&(_, len), digest)| ChunkRef {
                digest,
                length: len as u32,
            }),
    );
    buf.drain(..consumed);
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// Keeps chunks in memory.
    #[derive(Default)]
    pub struct MemSink(pub Mutex<HashMap<Digest, Vec<u8>>>);

    impl ChunkSink for MemSink {
        fn put(&self, data: &[u8], digest: Digest) -> Result<(), BuildError> {
            assert_eq!(Digest::of(data), digest);
            self.0.lock().unwrap().insert(digest, data.to_vec());
            Ok(())
        }
    }

    impl MemSink {
        pub fn reassemble(&self, f: &FileData) -> Vec<u8> {
            let map = self.0.lock().unwrap();
            let bits = FileData::chunk_bits(f.size);
            let mut out = vec![0u8; f.size as usize];
            for s in &f.segments {
                let mut pos = (s.first << bits) as usize;
                for c in &s.chunks {
                    out[pos..pos + c.length as usize].copy_from_slice(&map[&c.digest]);
                    pos += c.length as usize;
                }
                assert_eq!(
                    pos,
                    (((s.first + s.count) << bits) as usize).min(f.size as usize)
                );
            }
            out
        }
    }

    pub fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn reassembles_and_finds_holes() {
        let sink = MemSink::default();
        let mut data = noise(5 << 20, 1);
        data[(1 << 20)..(2 << 20)].fill(0); // one whole 1 MiB EROFS chunk of zeros
        let f = chunk_file("x", &mut data.as_slice(), data.len() as u64, &sink).unwrap();
        assert_eq!(f.segments.len(), 2);
        assert_eq!((f.segments[0].first, f.segments[0].count), (0, 1));
        assert_eq!((f.segments[1].first, f.segments[1].count), (2, 3));
        assert_eq!(sink.reassemble(&f), data);

        let small = b"hello".to_vec();
        let f = chunk_file("y", &mut small.as_slice(), 5, &sink).unwrap();
        assert_eq!(f.segments[0].chunks.len(), 1);
        let f = chunk_file("z", &mut [0u8; 100].as_slice(), 100, &sink).unwrap();
        assert!(f.segments.is_empty());
        assert!(chunk_file("short", &mut small.as_slice(), 10, &sink).is_err());
    }

    #[test]
    fn an_insertion_changes_few_chunks() {
        let sink = MemSink::default();
        let data = noise(40 << 20, 2);
        let a = chunk_file("a", &mut data.as_slice(), data.len() as u64, &sink).unwrap();
        let mut edited = vec![b'!'];
        edited.extend_from_slice(&data);
        let b = chunk_file("b", &mut edited.as_slice(), edited.len() as u64, &sink).unwrap();
        let old: std::collections::HashSet<_> =
            a.segments[0].chunks.iter().map(|c| c.digest).collect();
        let new_bytes: u64 = b.segments[0]
            .chunks
            .iter()
            .filter(|c| !old.contains(&c.digest))
            .map(|c| c.length as u64)
            .sum();
        assert!(new_bytes <= 2 << 20, "{new_bytes} new bytes");
        assert_eq!(sink.reassemble(&b), edited);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, ..Default::default() })]

        /// Any file of data and zero runs: its chunks put together give it back; holes
        /// are exactly its all-zero EROFS chunks; content-defined chunks keep their bounds
        /// (only a segment's last may be shorter than the minimum).
        #[test]
        fn chunks_reassemble_the_file_and_keep_their_bounds(
            runs in proptest::collection::vec((proptest::bool::ANY, 1usize..900_000, proptest::num::u64::ANY), 1..6)
        ) {
            let mut data = Vec::new();
            for (zero, len, seed) in runs {
                if zero {
                    data.resize(data.len() + len, 0);
                } else {
                    data.extend(noise(len, seed));
                }
            }
            let sink = MemSink::default();
            let f = chunk_file("p", &mut &data[..], data.len() as u64, &sink).unwrap();
            proptest::prop_assert_eq!(sink.reassemble(&f) == data, true);
            let size = 1usize << FileData::chunk_bits(f.size);
            let mut covered = vec![false; FileData::erofs_chunks(f.size) as usize];
            let mut next = 0;
            for seg in &f.segments {
                proptest::prop_assert!(seg.first >= next, "segments overlap or go back");
                next = seg.first + seg.count;
                for i in seg.first..next {
                    covered[i as usize] = true;
                }
                let (last, rest) = seg.chunks.split_last().unwrap();
                proptest::prop_assert!(last.length as usize <= MAX_CHUNK);
                for c in rest {
                    proptest::prop_assert!((MIN_CHUNK..=MAX_CHUNK).contains(&(c.length as usize)));
                }
            }
            for (i, chunk) in data.chunks(size).enumerate() {
                proptest::prop_assert_eq!(covered[i], !is_zero(chunk), "EROFS chunk {}", i);
            }
        }
    }
}
