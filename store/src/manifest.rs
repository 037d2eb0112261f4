//! The layer manifest: what a layer is (its content, which fixes its ID) and where its chunks
//! live in the store (placement, which does not), plus the provenance record kept beside it.

use serde::{Deserialize, Serialize};

use crate::Digest;

/// Version of the manifest and of the canonical encoding the layer ID is computed over.
pub const FORMAT_VERSION: u32 = 1;

/// Size of an EROFS block; blob offsets of file data are multiples of it.
pub const BLOCK_SIZE: u64 = 4096;

/// One stretch of the data blob: `length` bytes at `blob_offset`, whose content has
/// `digest`, stored in `packs[pack]` at `pack_offset` as `stored_length` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkEntry {
    pub blob_offset: u64,
    pub length: u32,
    pub digest: Digest,
    pub pack: u32,
    pub pack_offset: u64,
    pub stored_length: u32,
}

// Serialized as a tuple: a manifest has one entry per chunk and tens of thousands of them
// for a workspace, so field names would dominate its size.
impl Serialize for ChunkEntry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (
            self.blob_offset,
            self.length,
            &self.digest,
            self.pack,
            self.pack_offset,
            self.stored_length,
        )
            .serialize(s)
    }
}

impl<'de> Deserialize<'de> for ChunkEntry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (blob_offset, length, digest, pack, pack_offset, stored_length) =
            <(u64, u32, Digest, u32, u64, u32)>::deserialize(d)?;
        Ok(ChunkEntry {
            blob_offset,
            length,
            digest,
            pack,
            pack_offset,
            stored_length,
        })
    }
}

/// The metadata image of a layer: an EROFS image stored whole under its digest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MetadataRef {
    pub digest: Digest,
    pub size: u64,
}

/// A layer manifest as stored at `layers/<id>.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LayerManifest {
    pub format: u32,
    pub id: Digest,
    pub metadata: MetadataRef,
    /// Length of the data blob; a multiple of [`BLOCK_SIZE`]. Bytes not covered by a chunk
    /// read as zeros (padding between files).
    pub blob_size: u64,
    /// Logical bytes of file data in the tree (sum of regular file sizes, hard links once).
    pub logical_bytes: u64,
    pub files: u64,
    /// Pack object IDs that `chunks[].pack` indexes into.
    pub packs: Vec<Digest>,
    /// Sorted by `blob_offset`, non-overlapping.
    pub chunks: Vec<ChunkEntry>,
}

/// Why a manifest is not acceptable.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest format {0} is not supported (this build reads format {FORMAT_VERSION}); upgrade strata")]
    Format(u32),
    #[error("manifest claims ID {claimed} but its content hashes to {actual}")]
    IdMismatch { claimed: Digest, actual: Digest },
    #[error("manifest chunk table is invalid: {0}")]
    Table(String),
}

impl LayerManifest {
    /// Computes the layer ID: blake3 over a fixed binary encoding of the content (format,
    /// metadata image, blob size, and each chunk's offset, length and digest). Placement is
    /// left out, so the same tree has the same ID whatever the store already held.
    pub fn content_id(&self) -> Digest {
        let mut h = blake3::Hasher::new();
        h.update(b"strata-layer\n");
        h.update(&self.format.to_le_bytes());
        h.update(self.metadata.digest.as_bytes());
        h.update(&self.metadata.size.to_le_bytes());
        h.update(&self.blob_size.to_le_bytes());
        h.update(&(self.chunks.len() as u64).to_le_bytes());
        for c in &self.chunks {
            h.update(&c.blob_offset.to_le_bytes());
            h.update(&c.length.to_le_bytes());
            h.update(c.digest.as_bytes());
        }
        h.finalize().into()
    }

    /// Checks the format, the ID and the chunk table's shape.
    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.format != FORMAT_VERSION {
            return Err(ManifestError::Format(self.format));
        }
        let actual = self.content_id();
        if actual != self.id {
            return Err(ManifestError::IdMismatch {
                claimed: self.id,
                actual,
            });
        }
        if !self.blob_size.is_multiple_of(BLOCK_SIZE) {
            return Err(ManifestError::Table(format!(
                "blob size {} is not a multiple of {BLOCK_SIZE}",
                self.blob_size
            )));
        }
        let mut end = 0u64;
        for c in &self.chunks {
            if c.blob_offset < end {
                return Err(ManifestError::Table(format!(
                    "chunk at {} overlaps the previous one",
                    c.blob_offset
                )));
            }
            end = match c.blob_offset.checked_add(c.length as u64) {
                Some(e) => e,
                None => {
                    return Err(ManifestError::Table(format!(
                        "chunk at {} of {} bytes ends past 2^64",
                        c.blob_offset, c.length
                    )))
                }
            };
            if end > self.blob_size {
                return Err(ManifestError::Table(format!(
                    "chunk at {} runs past the blob end {}",
                    c.blob_offset, self.blob_size
                )));
            }
            if c.pack_offset.checked_add(c.stored_length as u64).is_none() {
                return Err(ManifestError::Table(format!(
                    "chunk at {} is stored at {} in its pack, which ends past 2^64",
                    c.blob_offset, c.pack_offset
                )));
            }
            if c.pack as usize >= self.packs.len() {
                return Err(ManifestError::Table(format!(
                    "chunk at {} names pack {} of {}",
                    c.blob_offset,
                    c.pack,
                    self.packs.len()
                )));
            }
        }
        Ok(())
    }

    /// Bytes of chunk data (uncompressed) the blob is made of.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.length as u64).sum()
    }

    /// Index of the first chunk that ends after `offset`.
    pub fn chunk_at(&self, offset: u64) -> usize {
        self.chunks
            .partition_point(|c| c.blob_offset + c.length as u64 <= offset)
    }
}

/// Where a layer came from. Stored beside the manifest; does not affect the layer ID.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Provenance {
    pub kind: String,
    pub name: Option<String>,
    pub version: Option<String>,
    pub source: String,
    /// Seconds since the Unix epoch.
    pub built_at: u64,
    pub writer_version: String,
    /// Free-form details a particular source kind records (build key, step logs, ...).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LayerManifest {
        let mut m = LayerManifest {
            format: FORMAT_VERSION,
            id: Digest([0; 32]),
            metadata: MetadataRef {
                digest: Digest::of(b"meta"),
                size: 8192,
            },
            blob_size: 8192,
            logical_bytes: 5000,
            files: 2,
            packs: vec![Digest::of(b"pack")],
            chunks: vec![
                ChunkEntry {
                    blob_offset: 0,
                    length: 1000,
                    digest: Digest::of(b"a"),
                    pack: 0,
                    pack_offset: 0,
                    stored_length: 10,
                },
                ChunkEntry {
                    blob_offset: 4096,
                    length: 4000,
                    digest: Digest::of(b"b"),
                    pack: 0,
                    pack_offset: 10,
                    stored_length: 20,
                },
            ],
        };
        m.id = m.content_id();
        m
    }

    #[test]
    fn id_ignores_placement_but_not_content() {
        let m = sample();
        let mut moved = m.clone();
        moved.chunks[1].pack_offset = 99;
        moved.packs[0] = Digest::of(b"other pack");
        assert_eq!(m.content_id(), moved.content_id());
        let mut changed = m.clone();
        changed.chunks[1].digest = Digest::of(b"c");
        assert_ne!(m.content_id(), changed.content_id());
    }

    #[test]
    fn json_round_trip_and_validation() {
        let m = sample();
        let json = serde_json::to_string(&m).unwrap();
        let back: LayerManifest = serde_json::from_str(&json).unwrap();
        assert_eq!(m, back);
        back.validate().unwrap();
        let mut bad = m.clone();
        bad.chunks[1].blob_offset = 500;
        bad.id = bad.content_id();
        assert!(bad.validate().is_err());
        // A chunk whose end overflows is refused, not wrapped round to fit the blob.
        let mut wraps = m.clone();
        wraps.chunks[1].blob_offset = u64::MAX - 10;
        wraps.chunks[1].length = 100;
        wraps.id = wraps.content_id();
        assert!(wraps
            .validate()
            .unwrap_err()
            .to_string()
            .contains("past 2^64"));
        let mut stored = m.clone();
        stored.chunks[1].pack_offset = u64::MAX;
        stored.id = stored.content_id();
        assert!(stored
            .validate()
            .unwrap_err()
            .to_string()
            .contains("past 2^64"));
        assert_eq!(m.chunk_at(0), 0);
        assert_eq!(m.chunk_at(1000), 1);
        assert_eq!(m.chunk_at(8191), 2);
    }
}
