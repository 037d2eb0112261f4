//! Reads a directory tree from the local filesystem: metadata by `lstat`, xattrs without
//! following symlinks, hard links by (device, inode), file data chunked in parallel.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use rayon::prelude::*;

use crate::chunker::{chunk_file, ChunkSink};
use crate::source::PathFilter;
use crate::tree::{FileData, Meta, Node, NodeId, NodeKind, Tree};
use crate::BuildError;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> BuildError + '_ {
    move |source| BuildError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn meta_of(m: &std::fs::Metadata) -> Meta {
    Meta {
        mode: (m.mode() & 0o7777) as u16,
        uid: m.uid(),
        gid: m.gid(),
        mtime: m.mtime(),
    }
}

fn read_xattrs(path: &Path, node: &mut Node) -> Result<(), BuildError> {
    let names = match xattr::list(path) {
        Ok(n) => n,
        // Filesystems without xattr support have none to copy.
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(()),
        Err(e) => return Err(io_err(path)(e)),
    };
    for name in names {
        if let Some(value) = xattr::get(path, &name).map_err(io_err(path))? {
            node.xattrs.insert(name.as_bytes().to_vec(), value);
        }
    }
    Ok(())
}

/// Reads `root` into a tree. The root directory itself is normalized (0755, 0:0, time 0):
/// where a tree was unpacked must not change the layer.
pub fn read_dir(
    root: &Path,
    filter: &dyn PathFilter,
    sink: &dyn ChunkSink,
) -> Result<Tree, BuildError> {
    let meta = std::fs::symlink_metadata(root).map_err(io_err(root))?;
    if !meta.is_dir() {
        return Err(BuildError::BadEntry {
            path: root.display().to_string(),
            reason: "not a directory".into(),
        });
    }
    let mut tree = Tree::new();
    let mut inodes: HashMap<(u64, u64), Vec<u8>> = HashMap::new();
    let mut files: Vec<(NodeId, std::path::PathBuf, String, u64)> = Vec::new();
    let walker = walkdir::WalkDir::new(root)
        .follow_links(false)
        .sort_by(|a, b| a.file_name().as_bytes().cmp(b.file_name().as_bytes()))
        .min_depth(1);
    let mut it = walker.into_iter();
    while let Some(entry) = it.next() {
        let entry = entry.map_err(|e| {
            let path = e
                .path()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            BuildError::Io {
                path,
                source: e
                    .into_io_error()
                    .unwrap_or_else(|| std::io::Error::other("directory loop")),
            }
        })?;
        let full = entry.path();
        let rel = full
            .strip_prefix(root)
            .map_err(|_| BuildError::Internal("walk left the root".into()))?
            .as_os_str()
            .as_bytes()
            .to_vec();
        if filter.skip(&rel, entry.file_type().is_dir()) {
            if entry.file_type().is_dir() {
                it.skip_current_dir();
            }
            continue;
        }
        let m = entry.metadata().map_err(|e| BuildError::Io {
            path: full.display().to_string(),
            source: e
                .into_io_error()
                .unwrap_or_else(|| std::io::Error::other("stat failed")),
        })?;
        let ft = m.file_type();
        if !ft.is_dir() && m.nlink() > 1 {
            if let Some(first) = inodes.get(&(m.dev(), m.ino())) {
                tree.link(&rel, &first.clone())?;
                continue;
            }
            inodes.insert((m.dev(), m.ino()), rel.clone());
        }
        let kind = if ft.is_dir() {
            NodeKind::Dir(Default::default())
        } else if ft.is_file() {
            NodeKind::File(FileData {
                size: m.len(),
                segments: vec![],
            })
        } else if ft.is_symlink() {
            let target = std::fs::read_link(full).map_err(io_err(full))?;
            NodeKind::Symlink(target.as_os_str().as_bytes().to_vec())
        } else if ft.is_char_device() || ft.is_block_device() {
            let rdev = m.rdev();
            let (major, minor) = (libc::major(rdev), libc::minor(rdev));
            if ft.is_char_device() {
                NodeKind::CharDev { major, minor }
            } else {
                NodeKind::BlockDev { major, minor }
            }
        } else if ft.is_fifo() {
            NodeKind::Fifo
        } else if ft.is_socket() {
            NodeKind::Socket
        } else {
            return Err(BuildError::BadEntry {
                path: full.display().to_string(),
                reason: "unknown file type".into(),
            });
        };
        let mut node = Node::new(meta_of(&m), kind);
        read_xattrs(full, &mut node)?;
        let size = m.len();
        let is_file = ft.is_file();
        let id = tree.insert(&rel, node)?;
        if is_file && size > 0 {
            files.push((id, full.to_path_buf(), full.display().to_string(), size));
        }
    }
    let data: Vec<(NodeId, FileData)> = files
        .par_iter()
        .map(|(id, full, shown, size)| {
            let mut f = File::open(full).map_err(io_err(full))?;
            let data = chunk_file(shown, &mut f, *size, sink)?;
            Ok((*id, data))
        })
        .collect::<Result<_, BuildError>>()?;
    for (id, d) in data {
        tree.node_mut(id).kind = NodeKind::File(d);
    }
    Ok(tree)
}
