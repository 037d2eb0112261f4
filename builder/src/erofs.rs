//! The EROFS metadata image writer: every inode, directory, symlink and xattr of a tree,
//! with regular files chunk-indexed into one external blob device (device 1). Classic
//! 32-bit on-disk format (mounts on Linux 5.16 and later), extended inodes throughout so
//! each file keeps its own mtime, 4 KiB blocks, superblock checksum, and a UUID derived
//! from the image content so that equal trees give byte-identical images.
//! Format reference: `shared/erofs-format.md` (section numbers below point into it).

use std::collections::HashMap;

use crate::layout::{BlobLayout, FileMap};
use crate::tree::{NodeId, NodeKind, Tree, ROOT};
use crate::BuildError;

const BS: usize = 4096;
const SB_OFFSET: usize = 1024;
const MAGIC: u32 = 0xE0F5_E1E2;
const COMPAT_SB_CHKSUM: u32 = 0x1;
const COMPAT_MTIME: u32 = 0x2;
const INCOMPAT_CHUNKED_FILE: u32 = 0x4;
const INCOMPAT_DEVICE_TABLE: u32 = 0x8;
/// Device slot 9 = byte 1152, right after the superblock (section 9).
const DEVT_SLOTOFF: u16 = 9;
const DEVICE_SLOT_SIZE: usize = 128;
const INODE_SIZE: usize = 64;
const LAYOUT_FLAT_PLAIN: u16 = 0;
const LAYOUT_FLAT_INLINE: u16 = 2;
const LAYOUT_CHUNK_BASED: u16 = 4;
const CHUNK_FORMAT_INDEXES: u16 = 0x20;
const DIRENT_SIZE: usize = 12;
const NO_BLOCK: u32 = u32::MAX;

const S_IFREG: u16 = 0o100000;
const S_IFDIR: u16 = 0o040000;
const S_IFLNK: u16 = 0o120000;
const S_IFCHR: u16 = 0o020000;
const S_IFBLK: u16 = 0o060000;
const S_IFIFO: u16 = 0o010000;
const S_IFSOCK: u16 = 0o140000;

/// How an inode's data is stored.
enum Data {
    /// No data (special files, empty files).
    None,
    /// Bytes in the image: full blocks in the data area, the tail inline if it fits.
    Bytes { bytes: Vec<u8>, inline_tail: bool },
    /// Chunk index into the blob device.
    Chunks(FileMap),
}

struct Inode {
    node: NodeId,
    parent: NodeId,
    mode: u16,
    size: u64,
    nlink: u32,
    xattrs: Vec<u8>,
    data: Data,
    /// Filled during placement.
    offset: usize,
    first_block: u32,
}

impl Inode {
    fn nid(&self) -> u64 {
        (self.offset / 32) as u64
    }

    /// Bytes that must sit in one block: the inode, its xattrs and an inline tail.
    fn head_len(&self) -> usize {
        let tail = match &self.data {
            Data::Bytes {
                bytes,
                inline_tail: true,
            } => bytes.len() % BS,
            _ => 0,
        };
        INODE_SIZE + self.xattrs.len() + tail
    }

    fn full_blocks(&self) -> usize {
        match &self.data {
            Data::Bytes { bytes, inline_tail } => {
                if *inline_tail {
                    bytes.len() / BS
                } else {
                    bytes.len().div_ceil(BS)
                }
            }
            _ => 0,
        }
    }
}

/// Encodes the xattrs of a node into an inline xattr area (section 12), or an empty vector.
fn xattr_area(
    path: &[u8],
    xattrs: &std::collections::BTreeMap<Vec<u8>, Vec<u8>>,
) -> Result<Vec<u8>, BuildError> {
    if xattrs.is_empty() {
        return Ok(Vec::new());
    }
    let mut entries: Vec<(u8, &[u8], &[u8])> = Vec::new();
    for (name, value) in xattrs {
        let (index, suffix): (u8, &[u8]) = if name == b"system.posix_acl_access" {
            (2, b"")
        } else if name == b"system.posix_acl_default" {
            (3, b"")
        } else if let Some(s) = name.strip_prefix(b"user.") {
            (1, s)
        } else if let Some(s) = name.strip_prefix(b"trusted.") {
            (4, s)
        } else if let Some(s) = name.strip_prefix(b"lustre.") {
            (5, s)
        } else if let Some(s) = name.strip_prefix(b"security.") {
            (6, s)
        } else {
            return Err(BuildError::BadEntry {
                path: String::from_utf8_lossy(path).into_owned(),
                reason: format!(
                    "xattr `{}` has a namespace EROFS cannot store (user., trusted., security., system.posix_acl_*); exclude it or drop the attribute",
                    String::from_utf8_lossy(name)
                ),
            });
        };
        if suffix.len() > 255 || value.len() > u16::MAX as usize {
            return Err(BuildError::BadEntry {
                path: String::from_utf8_lossy(path).into_owned(),
                reason: format!("xattr `{}` is too large", String::from_utf8_lossy(name)),
            });
        }
        entries.push((index, suffix, value));
    }
    entries.sort();
    // Header: name filter (unused), shared count 0, reserved.
    let mut out = vec![0u8; 12];
    for (index, suffix, value) in entries {
        out.push(suffix.len() as u8);
        out.push(index);
        out.extend_from_slice(&(value.len() as u16).to_le_bytes());
        out.extend_from_slice(suffix);
        out.extend_from_slice(value);
        out.resize(out.len().next_multiple_of(4), 0);
    }
    Ok(out)
}

fn file_type(kind: &NodeKind) -> u8 {
    match kind {
        NodeKind::File(_) => 1,
        NodeKind::Dir(_) => 2,
        NodeKind::CharDev { .. } => 3,
        NodeKind::BlockDev { .. } => 4,
        NodeKind::Fifo => 5,
        NodeKind::Socket => 6,
        NodeKind::Symlink(_) => 7,
    }
}

fn rdev(major: u32, minor: u32) -> u32 {
    (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)
}

/// Splits directory entries into blocks (section 10). Returns the byte length of each block.
fn dir_block_sizes(names: &[&[u8]]) -> Vec<usize> {
    let mut blocks = vec![0usize];
    for name in names {
        let need = DIRENT_SIZE + name.len();
        let last = blocks.last_mut().expect("blocks is never empty");
        if *last + need > BS {
            blocks.push(need);
        } else {
            *last += need;
        }
    }
    blocks
}

/// Writes the metadata image for `tree` whose file data is laid out as `blob`.
pub fn write_image(tree: &Tree, blob: &BlobLayout) -> Result<Vec<u8>, BuildError> {
    // 1. Inodes in tree order (root first, so its nid fits the superblock's 16 bits).
    let mut inodes: Vec<Inode> = Vec::new();
    let mut index_of: HashMap<NodeId, usize> = HashMap::new();
    let mut nlink: HashMap<NodeId, u32> = HashMap::new();
    let mut parent_of: HashMap<NodeId, NodeId> = HashMap::from([(ROOT, ROOT)]);
    let mut paths: HashMap<NodeId, Vec<u8>> = HashMap::new();
    tree.walk(|path, id, node| {
        index_of.insert(id, index_of.len());
        paths.insert(id, path.to_vec());
        if let NodeKind::Dir(children) = &node.kind {
            for &c in children.values() {
                *nlink.entry(c).or_default() += 1;
                if tree.node(c).is_dir() {
                    parent_of.insert(c, id);
                }
            }
        }
    });
    let mut order: Vec<NodeId> = vec![0; index_of.len()];
    for (&id, &i) in &index_of {
        order[i] = id;
    }
    let mut has_chunks = false;
    for &id in &order {
        let node = tree.node(id);
        let path = &paths[&id];
        let perm = node.meta.mode & 0o7777;
        let (mode, size, data, links) = match &node.kind {
            NodeKind::Dir(children) => {
                let subdirs = children
                    .values()
                    .filter(|&&c| tree.node(c).is_dir())
                    .count() as u32;
                // Size only: nids are filled in after placement.
                let mut names: Vec<&[u8]> = vec![b".", b".."];
                names.extend(children.keys().map(|k| k.as_slice()));
                names.sort();
                let blocks = dir_block_sizes(&names);
                let size = (blocks.len() - 1) * BS + blocks[blocks.len() - 1];
                (
                    S_IFDIR | perm,
                    size as u64,
                    Data::Bytes {
                        bytes: vec![0; size],
                        inline_tail: true,
                    },
                    2 + subdirs,
                )
            }
            NodeKind::File(f) => {
                let data = if f.size == 0 {
                    Data::None
                } else {
                    has_chunks = true;
                    Data::Chunks(blob.files[&id].clone())
                };
                (S_IFREG | perm, f.size, data, nlink[&id])
            }
            NodeKind::Symlink(target) => {
                if target.is_empty() || target.len() > 4095 {
                    return Err(BuildError::BadEntry {
                        path: String::from_utf8_lossy(path).into_owned(),
                        reason: format!(
                            "symlink target of {} bytes (must be 1..4095)",
                            target.len()
                        ),
                    });
                }
                (
                    S_IFLNK | perm,
                    target.len() as u64,
                    Data::Bytes {
                        bytes: target.clone(),
                        inline_tail: true,
                    },
                    nlink[&id],
                )
            }
            NodeKind::CharDev { .. } => (S_IFCHR | perm, 0, Data::None, nlink[&id]),
            NodeKind::BlockDev { .. } => (S_IFBLK | perm, 0, Data::None, nlink[&id]),
            NodeKind::Fifo => (S_IFIFO | perm, 0, Data::None, nlink[&id]),
            NodeKind::Socket => (S_IFSOCK | perm, 0, Data::None, nlink[&id]),
        };
        let mut inode = Inode {
            node: id,
            parent: parent_of.get(&id).copied().unwrap_or(ROOT),
            mode,
            size,
            nlink: links,
            xattrs: xattr_area(path, &node.xattrs)?,
            data,
            offset: 0,
            first_block: 0,
        };
        // A tail can be inline only if it is partial and fits in one block with the inode.
        if let Data::Bytes { bytes, inline_tail } = &mut inode.data {
            let tail = bytes.len() % BS;
            *inline_tail = tail != 0 && INODE_SIZE + inode.xattrs.len() + tail <= BS;
        }
        inodes.push(inode);
    }

    // 2. Place inodes (section 14.2), then the data blocks after them.
    let device = blob.size > 0;
    let mut cursor = SB_OFFSET + 128 + if device { DEVICE_SLOT_SIZE } else { 0 };
    for inode in &mut inodes {
        cursor = cursor.next_multiple_of(32);
        let head = inode.head_len();
        if head <= BS && cursor % BS + head > BS {
            cursor = cursor.next_multiple_of(BS);
        }
        inode.offset = cursor;
        cursor += head;
        if let Data::Chunks(map) = &inode.data {
            cursor = cursor.next_multiple_of(8) + 8 * map.addrs.len();
        }
    }
    let mut next_block = cursor.div_ceil(BS);
    for inode in &mut inodes {
        let blocks = inode.full_blocks();
        if blocks > 0 {
            inode.first_block = next_block as u32;
            next_block += blocks;
        } else {
            inode.first_block = match inode.data {
                Data::Bytes { .. } => NO_BLOCK,
                _ => 0,
            };
        }
    }
    let total_blocks = next_block;
    if inodes[0].nid() > u16::MAX as u64 {
        return Err(BuildError::TooLarge(
            "root inode is out of the superblock's reach".into(),
        ));
    }
    if total_blocks as u64 + blob.size / BS as u64 >= u32::MAX as u64 {
        return Err(BuildError::TooLarge(
            "image and blob exceed 2^32 blocks".into(),
        ));
    }

    // 3. Directory contents, now that every nid is known.
    for i in 0..inodes.len() {
        let NodeKind::Dir(children) = &tree.node(inodes[i].node).kind else {
            continue;
        };
        let mut entries: Vec<(&[u8], u64, u8)> = vec![
            (b".", inodes[i].nid(), 2),
            (b"..", inodes[index_of[&inodes[i].parent]].nid(), 2),
        ];
        for (name, &c) in children {
            entries.push((
                name,
                inodes[index_of[&c]].nid(),
                file_type(&tree.node(c).kind),
            ));
        }
        entries.sort_by(|a, b| a.0.cmp(b.0));
        let names: Vec<&[u8]> = entries.iter().map(|e| e.0).collect();
        let sizes = dir_block_sizes(&names);
        let mut bytes = vec![0u8; inodes[i].size as usize];
        let mut e = 0;
        for (b, &used) in sizes.iter().enumerate() {
            let block = &mut bytes[b * BS..];
            let mut n = 0;
            let mut len = 0;
            while e + n < entries.len() && len + DIRENT_SIZE + entries[e + n].0.len() <= used {
                len += DIRENT_SIZE + entries[e + n].0.len();
                n += 1;
            }
            let mut nameoff = n * DIRENT_SIZE;
            for k in 0..n {
                let (name, nid, ft) = entries[e + k];
                let d = &mut block[k * DIRENT_SIZE..(k + 1) * DIRENT_SIZE];
                d[0..8].copy_from_slice(&nid.to_le_bytes());
                d[8..10].copy_from_slice(&(nameoff as u16).to_le_bytes());
                d[10] = ft;
                block[nameoff..nameoff + name.len()].copy_from_slice(name);
                nameoff += name.len();
            }
            e += n;
        }
        debug_assert_eq!(e, entries.len());
        if let Data::Bytes { bytes: b, .. } = &mut inodes[i].data {
            *b = bytes;
        }
    }

    // 4. Serialize.
    let mut img = vec![0u8; total_blocks * BS];
    for (ino, inode) in inodes.iter().enumerate() {
        let layout = match &inode.data {
            Data::None => LAYOUT_FLAT_PLAIN,
            Data::Bytes {
                inline_tail: true, ..
            } => LAYOUT_FLAT_INLINE,
            Data::Bytes { .. } => LAYOUT_FLAT_PLAIN,
            Data::Chunks(_) => LAYOUT_CHUNK_BASED,
        };
        let node = tree.node(inode.node);
        let i_u: u32 = match (&node.kind, &inode.data) {
            (NodeKind::CharDev { major, minor }, _) | (NodeKind::BlockDev { major, minor }, _) => {
                rdev(*major, *minor)
            }
            (_, Data::Chunks(map)) => ((map.chunk_bits - 12) as u16 | CHUNK_FORMAT_INDEXES) as u32,
            _ => inode.first_block,
        };
        let icount: u16 = if inode.xattrs.is_empty() {
            0
        } else {
            ((inode.xattrs.len() - 12) / 4 + 1) as u16
        };
        let o = inode.offset;
        let h = &mut img[o..o + INODE_SIZE];
        h[0..2].copy_from_slice(&(1 | (layout << 1)).to_le_bytes());
        h[2..4].copy_from_slice(&icount.to_le_bytes());
        h[4..6].copy_from_slice(&inode.mode.to_le_bytes());
        h[8..16].copy_from_slice(&inode.size.to_le_bytes());
        h[16..20].copy_from_slice(&i_u.to_le_bytes());
        h[20..24].copy_from_slice(&(ino as u32).to_le_bytes());
        h[24..28].copy_from_slice(&node.meta.uid.to_le_bytes());
        h[28..32].copy_from_slice(&node.meta.gid.to_le_bytes());
        h[32..40].copy_from_slice(&node.meta.mtime.to_le_bytes());
        h[44..48].copy_from_slice(&inode.nlink.to_le_bytes());
        let mut p = o + INODE_SIZE;
        img[p..p + inode.xattrs.len()].copy_from_slice(&inode.xattrs);
        p += inode.xattrs.len();
        match &inode.data {
            Data::None => {}
            Data::Bytes { bytes, inline_tail } => {
                let full = inode.full_blocks();
                let in_blocks = if *inline_tail { full * BS } else { bytes.len() };
                if in_blocks > 0 {
                    let start = inode.first_block as usize * BS;
                    img[start..start + in_blocks].copy_from_slice(&bytes[..in_blocks]);
                }
                if *inline_tail {
                    let tail = &bytes[full * BS..];
                    img[p..p + tail.len()].copy_from_slice(tail);
                }
            }
            Data::Chunks(map) => {
                p = p.next_multiple_of(8);
                for &addr in &map.addrs {
                    // startblk_hi 0, device 1 (the blob), block address or hole.
                    img[p + 2..p + 4].copy_from_slice(&1u16.to_le_bytes());
                    img[p + 4..p + 8].copy_from_slice(&addr.to_le_bytes());
                    p += 8;
                }
            }
        }
    }

    // Superblock (section 1) and the blob's device slot (section 9).
    let sb = &mut img[SB_OFFSET..SB_OFFSET + 128];
    sb[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    sb[8..12].copy_from_slice(&(COMPAT_SB_CHKSUM | COMPAT_MTIME).to_le_bytes());
    sb[12] = 12;
    sb[14..16].copy_from_slice(&(inodes[0].nid() as u16).to_le_bytes());
    sb[16..24].copy_from_slice(&(inodes.len() as u64).to_le_bytes());
    sb[36..40].copy_from_slice(&(total_blocks as u32).to_le_bytes());
    sb[64..70].copy_from_slice(b"strata");
    let mut incompat = 0;
    if has_chunks {
        incompat |= INCOMPAT_CHUNKED_FILE;
    }
    if device {
        incompat |= INCOMPAT_DEVICE_TABLE;
        sb[86..88].copy_from_slice(&1u16.to_le_bytes());
        sb[88..90].copy_from_slice(&DEVT_SLOTOFF.to_le_bytes());
        let slot = DEVT_SLOTOFF as usize * DEVICE_SLOT_SIZE;
        let d = &mut img[slot..slot + DEVICE_SLOT_SIZE];
        d[64..68].copy_from_slice(&((blob.size / BS as u64) as u32).to_le_bytes());
        d[68..72].copy_from_slice(&(total_blocks as u32).to_le_bytes());
    }
    img[SB_OFFSET + 80..SB_OFFSET + 84].copy_from_slice(&incompat.to_le_bytes());

    // The UUID is derived from the content (so overlay's copy-up records are stable),
    // then the checksum covers everything after the superblock start in block 0.
    let uuid = blake3::hash(&img);
    img[SB_OFFSET + 48..SB_OFFSET + 64].copy_from_slice(&uuid.as_bytes()[..16]);
    let crc = !crc32c::crc32c(&img[SB_OFFSET..BS]);
    img[SB_OFFSET + 4..SB_OFFSET + 8].copy_from_slice(&crc.to_le_bytes());
    Ok(img)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::layout;
    use crate::tree::{ChunkRef, FileData, Meta, Node, Segment};
    use strata_store::Digest;

    fn meta(mode: u16) -> Meta {
        Meta {
            mode,
            uid: 0,
            gid: 0,
            mtime: 1_700_000_000,
        }
    }

    fn sample_tree() -> Tree {
        let mut t = Tree::new();
        let data = FileData {
            size: 10,
            segments: vec![Segment {
                first: 0,
                count: 1,
                chunks: vec![ChunkRef {
                    digest: Digest::of(b"0123456789"),
                    length: 10,
                }],
            }],
        };
        t.insert(b"dir/file", Node::new(meta(0o644), NodeKind::File(data)))
            .unwrap();
        t.insert(
            b"link",
            Node::new(meta(0o777), NodeKind::Symlink(b"dir/file".to_vec())),
        )
        .unwrap();
        t
    }

    #[test]
    fn superblock_fields_and_checksum() {
        let t = sample_tree();
        let img = write_image(&t, &layout(&t).unwrap()).unwrap();
        assert_eq!(img.len() % BS, 0);
        let sb = &img[SB_OFFSET..];
        assert_eq!(u32::from_le_bytes(sb[0..4].try_into().unwrap()), MAGIC);
        assert_eq!(u16::from_le_bytes(sb[14..16].try_into().unwrap()), 40);
        assert_eq!(u64::from_le_bytes(sb[16..24].try_into().unwrap()), 4);
        let stored = u32::from_le_bytes(sb[4..8].try_into().unwrap());
        let mut copy = img[SB_OFFSET..BS].to_vec();
        copy[4..8].fill(0);
        assert_eq!(stored, !crc32c::crc32c(&copy));
        // The standard CRC-32C check value, to pin the polynomial and the final XOR.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(write_image(&t, &layout(&t).unwrap()).unwrap(), img);
    }

    #[test]
    fn rdev_encoding_matches_linux() {
        assert_eq!(rdev(259, 300), 0x0011_032C);
        assert_eq!(rdev(0, 0), 0);
    }

    #[test]
    fn directory_blocks_never_split_an_entry() {
        let long = vec![b'n'; 255];
        let names: Vec<&[u8]> = (0..40).map(|_| long.as_slice()).collect();
        let sizes = dir_block_sizes(&names);
        assert!(sizes.iter().all(|&s| s <= BS));
        assert_eq!(sizes.iter().sum::<usize>(), 40 * (12 + 255));
    }
}
