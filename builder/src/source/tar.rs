//! Reads a tar stream (plain, gzip or zstd, detected by magic) straight into a tree without
//! unpacking it: metadata from headers and PAX records (xattrs as `SCHILY.xattr.*`), file
//! data chunked as it streams by. Small files are batched so they hash in parallel.

use std::io::{BufRead, BufReader, Read};

use rayon::prelude::*;

use crate::chunker::{chunk_file, ChunkSink};
use crate::source::Excludes;
use crate::tree::{FileData, Meta, Node, NodeId, NodeKind, Tree, Whiteout, Whiteouts};
use crate::BuildError;

/// Files up to this size are read into memory and chunked in parallel batches.
const SMALL_FILE: u64 = 1 << 20;
const BATCH_BYTES: usize = 32 << 20;

/// Wraps `reader` in the decompressor its first bytes call for.
pub fn decompress<'a>(
    reader: impl Read + 'a,
    what: &str,
) -> Result<Box<dyn Read + 'a>, BuildError> {
    let mut r = BufReader::with_capacity(1 << 20, reader);
    let head = r.fill_buf().map_err(|source| BuildError::Io {
        path: what.to_string(),
        source,
    })?;
    Ok(if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::MultiGzDecoder::new(r))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(
            zstd::stream::read::Decoder::with_buffer(r).map_err(|source| BuildError::Io {
                path: what.to_string(),
                source,
            })?,
        )
    } else {
        Box::new(r)
    })
}

/// Applies the tar stream `reader` (already decompressed) on top of `lower` as one layer:
/// its whiteout markers hide what is in `lower`, its entries are added. `what` names the
/// stream in errors.
pub fn apply_tar(
    lower: &mut Tree,
    reader: &mut dyn Read,
    what: &str,
    whiteouts: Whiteouts,
    excludes: &Excludes,
    sink: &dyn ChunkSink,
) -> Result<(), BuildError> {
    let mut marks = Vec::new();
    let mut layer = Tree::new();
    read_layer(&mut layer, &mut marks, lower, reader, what, excludes, sink)?;
    lower.apply_layer(layer, &marks, whiteouts)
}

fn read_layer(
    tree: &mut Tree,
    marks: &mut Vec<Whiteout>,
    lower: &Tree,
    reader: &mut dyn Read,
    what: &str,
    excludes: &Excludes,
    sink: &dyn ChunkSink,
) -> Result<(), BuildError> {
    let io = |source| BuildError::Io {
        path: what.to_string(),
        source,
    };
    let mut archive = tar::Archive::new(reader);
    let mut batch: Vec<(NodeId, String, Vec<u8>)> = Vec::new();
    let mut batch_bytes = 0usize;
    for entry in archive.entries().map_err(io)? {
        let mut entry = entry.map_err(|source| BuildError::Io {
            path: format!("{what} (a tar header)"),
            source,
        })?;
        let path = entry.path_bytes().into_owned();
        let shown = format!("{what}:{}", String::from_utf8_lossy(&path));
        if excludes.matches(&path) {
            continue;
        }
        let h = entry.header().clone();
        let bad = |reason: String| BuildError::BadEntry {
            path: shown.clone(),
            reason,
        };
        let meta = Meta {
            mode: (h.mode().map_err(|e| bad(e.to_string()))? & 0o7777) as u16,
            uid: h.uid().map_err(|e| bad(e.to_string()))? as u32,
            gid: h.gid().map_err(|e| bad(e.to_string()))? as u32,
            mtime: h.mtime().map_err(|e| bad(e.to_string()))? as i64,
        };
        let et = h.entry_type();
        let dev = || -> Result<(u32, u32), BuildError> {
            Ok((
                h.device_major()
                    .map_err(|e| bad(e.to_string()))?
                    .unwrap_or(0),
                h.device_minor()
                    .map_err(|e| bad(e.to_string()))?
                    .unwrap_or(0),
            ))
        };
        if et == tar::EntryType::XGlobalHeader {
            continue;
        }
        let mut xattrs = std::collections::BTreeMap::new();
        if let Some(exts) = entry.pax_extensions().map_err(io)? {
            for ext in exts {
                let ext = ext.map_err(io)?;
                let key = ext.key_bytes();
                if key.starts_with(b"GNU.sparse.") {
                    return Err(bad(
                        "PAX sparse entries are not supported; write the tar with --format=gnu or without --sparse".into(),
                    ));
                }
                let name = key
                    .strip_prefix(b"SCHILY.xattr.")
                    .or_else(|| key.strip_prefix(b"LIBARCHIVE.xattr."));
                if let Some(name) = name {
                    xattrs.insert(name.to_vec(), ext.value_bytes().to_vec());
                }
            }
        }
        if let Some(mark) = Whiteout::parse(&path, meta)? {
            marks.push(mark);
            continue;
        }
        let kind = match et {
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                NodeKind::File(FileData::default())
            }
            tar::EntryType::Directory => NodeKind::Dir(Default::default()),
            tar::EntryType::Symlink => NodeKind::Symlink(
                entry
                    .link_name_bytes()
                    .ok_or_else(|| bad("symlink without a target".into()))?
                    .into_owned(),
            ),
            tar::EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| bad("hard link without a target".into()))?
                    .into_owned();
                if tree.lookup(&target).is_some() {
                    tree.link(&path, &target)?;
                } else if let Some(below) = lower.lookup(&target) {
                    // A link to a file of a lower layer: the flattened tree gets a copy.
                    tree.insert(&path, lower.node(below).clone())?;
                } else {
                    tree.link(&path, &target)?;
                }
                continue;
            }
            tar::EntryType::Char => {
                let (major, minor) = dev()?;
                NodeKind::CharDev { major, minor }
            }
            tar::EntryType::Block => {
                let (major, minor) = dev()?;
                NodeKind::BlockDev { major, minor }
            }
            tar::EntryType::Fifo => NodeKind::Fifo,
            other => {
                return Err(bad(format!(
                    "unsupported tar entry type {other:?}; only files, directories, links, devices and fifos can be stored"
                )))
            }
        };
        let mut node = Node::new(meta, kind);
        node.xattrs = xattrs;
        let is_file = matches!(node.kind, NodeKind::File(_));
        let id = tree.insert(&path, node)?;
        if !is_file {
            continue;
        }
        let size = entry.size();
        if size == 0 {
            continue;
        }
        if size <= SMALL_FILE {
            let mut data = Vec::with_capacity(size as usize);
            entry
                .read_to_end(&mut data)
                .map_err(|source| BuildError::Io {
                    path: shown.clone(),
                    source,
                })?;
            batch_bytes += data.len();
            batch.push((id, shown, data));
            if batch_bytes >= BATCH_BYTES {
                flush(tree, &mut batch, sink)?;
                batch_bytes = 0;
            }
        } else {
            let data = chunk_file(&shown, &mut entry, size, sink)?;
            tree.node_mut(id).kind = NodeKind::File(data);
        }
    }
    flush(tree, &mut batch, sink)
}

fn flush(
    tree: &mut Tree,
    batch: &mut Vec<(NodeId, String, Vec<u8>)>,
    sink: &dyn ChunkSink,
) -> Result<(), BuildError> {
    let done: Vec<(NodeId, FileData)> = batch
        .par_iter()
        .map(|(id, shown, data)| {
            Ok((
                *id,
                chunk_file(shown, &mut data.as_slice(), data.len() as u64, sink)?,
            ))
        })
        .collect::<Result<_, BuildError>>()?;
    for (id, d) in done {
        tree.node_mut(id).kind = NodeKind::File(d);
    }
    batch.clear();
    Ok(())
}
