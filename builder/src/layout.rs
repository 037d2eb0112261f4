//! Lays file data out in the layer's data blob: files in tree order, each segment starting
//! on a block boundary, identical file contents stored once. The result is the blob's chunk
//! table and, per file, the blob block of each EROFS chunk (or a hole).

use std::collections::HashMap;

use strata_store::manifest::BLOCK_SIZE;

use crate::tree::{ChunkRef, FileData, NodeId, NodeKind, Tree};
use crate::BuildError;

/// An EROFS chunk index entry that reads as zeros.
pub const HOLE: u32 = u32::MAX;

/// Where a file's EROFS chunks are in the blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileMap {
    pub chunk_bits: u32,
    /// Blob block address per EROFS chunk, or [`HOLE`].
    pub addrs: Vec<u32>,
}

#[derive(Debug, Default)]
pub struct BlobLayout {
    pub files: HashMap<NodeId, FileMap>,
    /// `(blob offset, chunk)`, ascending.
    pub chunks: Vec<(u64, ChunkRef)>,
    /// Blob length, a multiple of the block size.
    pub size: u64,
}

pub fn layout(tree: &Tree) -> Result<BlobLayout, BuildError> {
    let mut out = BlobLayout::default();
    let mut by_content: HashMap<&FileData, NodeId> = HashMap::new();
    let mut order = Vec::new();
    tree.walk(|_, id, node| {
        if let NodeKind::File(f) = &node.kind {
            if f.size > 0 {
                order.push((id, f));
            }
        }
    });
    for (id, f) in order {
        if let Some(&twin) = by_content.get(f) {
            let map = out.files[&twin].clone();
            out.files.insert(id, map);
            continue;
        }
        by_content.insert(f, id);
        let chunk_bits = FileData::chunk_bits(f.size);
        let mut addrs = vec![HOLE; FileData::erofs_chunks(f.size) as usize];
        for seg in &f.segments {
            let start_block = out.size / BLOCK_SIZE;
            let blocks_per_chunk = 1u64 << (chunk_bits - 12);
            for j in 0..seg.count {
                let addr = start_block + j * blocks_per_chunk;
                if addr >= HOLE as u64 {
                    return Err(BuildError::TooLarge(
                        "the data blob would exceed 16 TiB".into(),
                    ));
                }
                addrs[(seg.first + j) as usize] = addr as u32;
            }
            let mut len = 0u64;
            for c in &seg.chunks {
                out.chunks.push((out.size + len, *c));
                len += c.length as u64;
            }
            out.size += len.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
        }
        out.files.insert(id, FileMap { chunk_bits, addrs });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::{Meta, Node, Segment};
    use strata_store::Digest;

    fn file(size: u64, segments: Vec<Segment>) -> Node {
        Node::new(
            Meta {
                mode: 0o644,
                uid: 0,
                gid: 0,
                mtime: 0,
            },
            NodeKind::File(FileData { size, segments }),
        )
    }

    fn seg(first: u64, count: u64, lens: &[u32], tag: u8) -> Segment {
        Segment {
            first,
            count,
            chunks: lens
                .iter()
                .enumerate()
                .map(|(i, &l)| ChunkRef {
                    digest: Digest::of(&[tag, i as u8]),
                    length: l,
                })
                .collect(),
        }
    }

    #[test]
    fn segments_are_block_aligned_and_twins_share_data() {
        let mut t = Tree::new();
        t.insert(b"a", file(5000, vec![seg(0, 1, &[5000], 1)]))
            .unwrap();
        // 3 MiB + 10 bytes with a hole in the second MiB.
        let mib = 1u32 << 20;
        t.insert(
            b"b",
            file(
                3 * mib as u64 + 10,
                vec![seg(0, 1, &[mib], 2), seg(2, 2, &[mib / 2, mib / 2, 10], 3)],
            ),
        )
        .unwrap();
        t.insert(b"c", file(5000, vec![seg(0, 1, &[5000], 1)]))
            .unwrap();
        t.insert(b"empty", file(0, vec![])).unwrap();
        let l = layout(&t).unwrap();
        let a = t.lookup(b"a").unwrap();
        let b = t.lookup(b"b").unwrap();
        let c = t.lookup(b"c").unwrap();
        assert_eq!(l.files[&a].addrs, vec![0]);
        assert_eq!(l.files[&c], l.files[&a]);
        assert_eq!(l.files[&b].chunk_bits, 20);
        assert_eq!(l.files[&b].addrs, vec![2, HOLE, 2 + 256, 2 + 512]);
        assert_eq!(l.chunks.len(), 5);
        assert_eq!(l.chunks[1].0, 8192);
        assert_eq!(l.chunks[2].0, 8192 + mib as u64);
        assert_eq!(l.size, 8192 + 2 * mib as u64 + 4096);
        assert!(!l.files.contains_key(&t.lookup(b"empty").unwrap()));
    }
}
