//! Prefetch lists: the chunks a layer's first run read, in the order it read them
//! (`layers/<id>.prefetch.json`), and the same chunks packed together in that order
//! (`layers/<id>.prefetch.pack`), so a later run fetches them from a remote store in a few
//! large reads instead of one request per pack they came from (a start's chunks are spread
//! over hundreds of ~1 MiB packs). The packed copy only speeds things up: every chunk read
//! from it is checked against the layer's manifest by its reader, and one that does not
//! match is fetched from the layer's own packs instead.
//!
//! The record is written after the packed copy, and names where each chunk sits in it; a
//! record of the first format (a bare JSON array of chunk indexes) is still read.

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutPayload};
use serde::{Deserialize, Serialize};

use crate::{backend_err, chunk, pack, Digest, Result, Store};

/// The most bytes of chunk data packed into one layer's prefetch copy: the packer holds
/// them in memory, and a list longer than this (a test suite reading gigabytes) is
/// fetched chunk by chunk as before.
pub const MAX_PACKED_BYTES: u64 = 128 << 20;

/// A layer's prefetch list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefetchList {
    /// Chunk indexes in the order the first run read them.
    pub order: Vec<u32>,
    /// Where the chunks of `order` sit in the packed copy, in the same order; empty when
    /// there is no packed copy.
    pub packed: Vec<PackedAt>,
}

/// One chunk in a layer's packed prefetch copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedAt {
    /// The chunk's index in the layer's chunk table.
    pub index: u32,
    pub offset: u64,
    pub stored_length: u32,
}

/// The record as stored: a bare array (first format) or the list with its packed copy.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum Stored {
    Order(Vec<u32>),
    Packed {
        order: Vec<u32>,
        #[serde(default)]
        packed: Vec<(u32, u64, u32)>,
    },
}

impl Store {
    pub(crate) fn prefetch_key(id: &Digest) -> ObjectPath {
        ObjectPath::from(format!("layers/{id}.prefetch.json"))
    }

    pub(crate) fn prefetch_pack_key(id: &Digest) -> ObjectPath {
        ObjectPath::from(format!("layers/{id}.prefetch.pack"))
    }

    /// Stores the order in which a first run of the layer read its chunks (chunk indexes),
    /// for later runs to prefetch; with `data` (the chunks' contents, in that order), also
    /// the packed copy of them, unless they exceed [`MAX_PACKED_BYTES`]. A later list
    /// replaces an earlier one.
    pub async fn put_prefetch(
        &self,
        id: &Digest,
        order: &[u32],
        data: Option<&[Bytes]>,
    ) -> Result<()> {
        let mut packed = Vec::new();
        let total: u64 = data.map_or(0, |d| d.iter().map(|b| b.len() as u64).sum());
        if let Some(data) = data.filter(|d| d.len() == order.len() && total <= MAX_PACKED_BYTES) {
            // Compressing up to MAX_PACKED_BYTES takes a while: not on the caller's
            // executor thread. A packing that fails (it cannot, short of a panic) leaves
            // the list without its copy, which is only an optimisation.
            let data = data.to_vec();
            let built = tokio::task::spawn_blocking(move || {
                let mut builder = pack::PackBuilder::new();
                for chunk in &data {
                    builder.push(&chunk::encode(chunk));
                }
                builder.finish()
            })
            .await;
            if let Ok(p) = built {
                let key = Self::prefetch_pack_key(id);
                self.backend
                    .put(&key, PutPayload::from_bytes(p.bytes))
                    .await
                    .map_err(backend_err("put", &key))?;
                packed = order
                    .iter()
                    .zip(&p.chunks)
                    .map(|(&i, c)| (i, c.offset, c.stored_length))
                    .collect();
            }
        }
        let record = if packed.is_empty() {
            Stored::Order(order.to_vec())
        } else {
            Stored::Packed {
                order: order.to_vec(),
                packed,
            }
        };
        self.put_record(&Self::prefetch_key(id), &record).await
    }

    /// The layer's prefetch list, if one was recorded.
    pub async fn get_prefetch(&self, id: &Digest) -> Result<Option<PrefetchList>> {
        Ok(self
            .get_record::<Stored>(&Self::prefetch_key(id))
            .await?
            .map(|s| match s {
                Stored::Order(order) => PrefetchList {
                    order,
                    packed: Vec::new(),
                },
                Stored::Packed { order, packed } => PrefetchList {
                    order,
                    packed: packed
                        .into_iter()
                        .map(|(index, offset, stored_length)| PackedAt {
                            index,
                            offset,
                            stored_length,
                        })
                        .collect(),
                },
            }))
    }

    /// Reads a byte range of the layer's packed prefetch copy (unverified: callers verify
    /// per chunk against the manifest).
    pub async fn read_prefetch_pack(&self, id: &Digest, offset: u64, len: u64) -> Result<Bytes> {
        self.get_range_exact(&Self::prefetch_pack_key(id), offset, len, || {
            format!("prefetch copy of layer {id}")
        })
        .await
    }

    /// Forgets the layer's prefetch list and its packed copy (the next first run records
    /// new ones).
    pub async fn remove_prefetch(&self, id: &Digest) -> Result<()> {
        self.delete_if_present(&Self::prefetch_key(id)).await?;
        self.delete_if_present(&Self::prefetch_pack_key(id)).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StoreUrl;

    #[tokio::test]
    async fn a_list_with_its_packed_copy_round_trips_and_the_first_format_still_reads() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&StoreUrl::Local(dir.path().into())).unwrap();
        let id = Digest::of(b"layer");
        let data: Vec<Bytes> = (0..5u8)
            .map(|i| Bytes::from(vec![i; 3000 + i as usize * 700]))
            .collect();
        let order = [4u32, 0, 3, 1, 2];
        store.put_prefetch(&id, &order, Some(&data)).await.unwrap();
        let list = store.get_prefetch(&id).await.unwrap().unwrap();
        assert_eq!(list.order, order);
        assert_eq!(list.packed.len(), 5);
        for (p, want) in list.packed.iter().zip(&data) {
            let stored = store
                .read_prefetch_pack(&id, p.offset, p.stored_length as u64)
                .await
                .unwrap();
            let got = chunk::decode(&stored, want.len() as u32, &Digest::of(want)).unwrap();
            assert_eq!(&got[..], &want[..]);
        }

        // Without data, or of the first format: the order alone.
        let other = Digest::of(b"other");
        store.put_prefetch(&other, &order, None).await.unwrap();
        let list = store.get_prefetch(&other).await.unwrap().unwrap();
        assert_eq!((list.order.as_slice(), list.packed.len()), (&order[..], 0));
        std::fs::write(
            dir.path().join(format!("layers/{other}.prefetch.json")),
            b"[7, 8]",
        )
        .unwrap();
        let list = store.get_prefetch(&other).await.unwrap().unwrap();
        assert_eq!(list.order, vec![7, 8]);

        store.remove_prefetch(&id).await.unwrap();
        assert!(store.get_prefetch(&id).await.unwrap().is_none());
        assert!(!dir
            .path()
            .join(format!("layers/{id}.prefetch.pack"))
            .exists());
    }
}
