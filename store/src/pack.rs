//! Packs: the storage objects. Chunks are appended to a pack until it reaches about 1 MiB, so
//! a workspace of tens of thousands of small files is a few hundred objects while each file's
//! chunk keeps its own digest and still dedups. A pack is named by the digest of its bytes.

use bytes::Bytes;

use crate::chunk::EncodedChunk;
use crate::Digest;

/// Packs are closed once they hold this many stored bytes.
pub const PACK_TARGET: usize = 1 << 20;

/// Where one chunk sits in a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedChunk {
    pub digest: Digest,
    pub length: u32,
    pub offset: u64,
    pub stored_length: u32,
}

/// A finished pack, ready to upload.
#[derive(Debug, Clone)]
pub struct Pack {
    pub id: Digest,
    pub bytes: Bytes,
    pub chunks: Vec<PackedChunk>,
}

/// Accumulates encoded chunks into one pack.
#[derive(Debug, Default)]
pub struct PackBuilder {
    buf: Vec<u8>,
    chunks: Vec<PackedChunk>,
}

impl PackBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a chunk and says whether the pack is now full.
    pub fn push(&mut self, chunk: &EncodedChunk) -> bool {
        self.chunks.push(PackedChunk {
            digest: chunk.digest,
            length: chunk.length,
            offset: self.buf.len() as u64,
            stored_length: chunk.stored.len() as u32,
        });
        self.buf.extend_from_slice(&chunk.stored);
        self.buf.len() >= PACK_TARGET
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    pub fn stored_bytes(&self) -> usize {
        self.buf.len()
    }

    pub fn finish(self) -> Pack {
        Pack {
            id: Digest::of(&self.buf),
            bytes: Bytes::from(self.buf),
            chunks: self.chunks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{decode, encode};

    #[test]
    fn chunks_are_addressable_inside_a_pack() {
        let mut b = PackBuilder::new();
        let parts: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 1000 + i as usize]).collect();
        for p in &parts {
            assert!(!b.push(&encode(p)));
        }
        let pack = b.finish();
        assert_eq!(pack.id, Digest::of(&pack.bytes));
        for (p, c) in parts.iter().zip(&pack.chunks) {
            let s = &pack.bytes[c.offset as usize..(c.offset + c.stored_length as u64) as usize];
            assert_eq!(&decode(s, c.length, &c.digest).unwrap(), p);
        }
    }
}
