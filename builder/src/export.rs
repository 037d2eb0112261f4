//! Materializing a layer: its data blob as one file (for tests and the eager baseline), and
//! its whole tree as a directory (`strata layer export`), read back through erofs-rs, an
//! EROFS reader independent of our writer.

use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};

use erofs_rs::backend::MmapImage;
use erofs_rs::EroFS;
use futures::TryStreamExt;
use strata_store::{LayerManifest, Store};

use crate::BuildError;

const S_IFMT: u32 = 0o170000;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> BuildError + '_ {
    move |source| BuildError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Writes a layer's metadata image and data blob to `meta_path` and `blob_path`, every
/// chunk verified. The blob keeps its padding as holes.
pub async fn fetch_layer_files(
    store: &Store,
    m: &LayerManifest,
    meta_path: &Path,
    blob_path: &Path,
) -> Result<(), BuildError> {
    let meta = store.get_metadata(&m.metadata).await?;
    std::fs::write(meta_path, &meta).map_err(io_err(meta_path))?;
    let blob = std::fs::File::create(blob_path).map_err(io_err(blob_path))?;
    blob.set_len(m.blob_size).map_err(io_err(blob_path))?;
    let mut batches = std::pin::pin!(store.layer_chunks(m));
    while let Some(batch) = batches.try_next().await? {
        for (i, data) in batch {
            blob.write_all_at(&data, m.chunks[i].blob_offset)
                .map_err(io_err(blob_path))?;
        }
    }
    Ok(())
}

/// Counts of what an export wrote.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct ExportReport {
    pub entries: u64,
    pub bytes: u64,
}

/// Opens a metadata image (and its blob, if the layer has data) with erofs-rs.
pub fn open_image(
    meta_path: &Path,
    blob_path: Option<&Path>,
) -> Result<EroFS<MmapImage>, BuildError> {
    let bad =
        |e: erofs_rs::Error| BuildError::Source(format!("reading {}: {e}", meta_path.display()));
    // SAFETY: the files are ours, written above or by the caller, and not modified while mapped.
    let meta = unsafe { MmapImage::new_from_path(meta_path) }.map_err(io_err(meta_path))?;
    match blob_path {
        Some(b) => {
            // SAFETY: as for the image: our file, not modified while mapped.
            let blob = unsafe { MmapImage::new_from_path(b) }.map_err(io_err(b))?;
            EroFS::new_with_devices(meta, vec![blob]).map_err(bad)
        }
        None => EroFS::new(meta).map_err(bad),
    }
}

/// Writes the tree of an EROFS image into `dest` (which must be empty or missing):
/// contents, modes, owners (when run as root), xattrs, hard links, devices and times.
pub fn export_image(fs: &EroFS<MmapImage>, dest: &Path) -> Result<ExportReport, BuildError> {
    std::fs::create_dir_all(dest).map_err(io_err(dest))?;
    if std::fs::read_dir(dest)
        .map_err(io_err(dest))?
        .next()
        .is_some()
    {
        return Err(BuildError::BadEntry {
            path: dest.display().to_string(),
            reason: "export target is not empty".into(),
        });
    }
    let root = nix::unistd::geteuid().is_root();
    let bad = |e: erofs_rs::Error| BuildError::Source(format!("reading image: {e}"));
    let mut report = ExportReport::default();
    let mut first_path: HashMap<u64, PathBuf> = HashMap::new();
    let mut dirs: Vec<(PathBuf, erofs_rs::types::Inode)> = Vec::new();
    let root_inode = fs
        .get_inode(fs.super_block().root_inode_id())
        .map_err(bad)?;
    dirs.push((dest.to_path_buf(), root_inode));
    for entry in fs.walk_dir("/").map_err(bad)? {
        let entry = entry.map_err(bad)?;
        let rel = entry.dir_entry.path();
        let target = dest.join(std::ffi::OsStr::from_bytes(
            rel.as_bytes().strip_prefix(b"/").unwrap_or(rel.as_bytes()),
        ));
        let ino = entry.inode;
        report.entries += 1;
        if !ino.is_dir() {
            if let Some(first) = first_path.get(&ino.id()) {
                std::fs::hard_link(first, &target).map_err(io_err(&target))?;
                continue;
            }
            if ino.nlink() > 1 {
                first_path.insert(ino.id(), target.clone());
            }
        }
        let mode = ino.file_type().as_raw_mode() & S_IFMT;
        let perm = ino.permissions().mode() & 0o7777;
        match mode {
            m if m == libc::S_IFDIR => {
                std::fs::create_dir(&target).map_err(io_err(&target))?;
                dirs.push((target.clone(), ino));
                continue;
            }
            m if m == libc::S_IFREG => {
                let file = fs.open_inode_file(ino).map_err(bad)?;
                let out = std::fs::File::create(&target).map_err(io_err(&target))?;
                let size = file.size();
                out.set_len(size).map_err(io_err(&target))?;
                let mut buf = vec![0u8; 1 << 20];
                let mut off = 0u64;
                while off < size {
                    let want = buf.len().min((size - off) as usize);
                    let n = file
                        .read_at(&mut buf[..want], off)
                        .map_err(io_err(&target))?;
                    if n == 0 {
                        return Err(BuildError::Source(format!(
                            "{}: image data ends early",
                            target.display()
                        )));
                    }
                    // Keep zero runs as holes, as the layer stored them.
                    if buf[..n].iter().any(|&b| b != 0) {
                        out.write_all_at(&buf[..n], off).map_err(io_err(&target))?;
                    }
                    off += n as u64;
                }
                report.bytes += size;
            }
            m if m == libc::S_IFLNK => {
                let link = fs.read_link_inode(ino).map_err(bad)?;
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(link.as_bytes()), &target)
                    .map_err(io_err(&target))?;
            }
            _ => {
                let dev = ino
                    .device()
                    .map(|(ma, mi)| libc::makedev(ma, mi))
                    .unwrap_or(0);
                nix::sys::stat::mknod(
                    &target,
                    nix::sys::stat::SFlag::from_bits_truncate(mode),
                    nix::sys::stat::Mode::from_bits_truncate(perm),
                    dev,
                )
                .map_err(|e| io_err(&target)(std::io::Error::from_raw_os_error(e as i32)))?;
            }
        }
        apply_meta(fs, &target, &ino, root)?;
    }
    // Directories last, deepest first, so adding entries does not reset their times.
    for (path, ino) in dirs.iter().rev() {
        apply_meta(fs, path, ino, root)?;
    }
    Ok(report)
}

fn apply_meta(
    fs: &EroFS<MmapImage>,
    path: &Path,
    ino: &erofs_rs::types::Inode,
    root: bool,
) -> Result<(), BuildError> {
    let bad = |e: erofs_rs::Error| BuildError::Source(format!("reading image: {e}"));
    let is_link = ino.is_symlink();
    // chown clears setuid bits and file capabilities: owner first, then mode, then xattrs.
    if root {
        std::os::unix::fs::lchown(path, Some(ino.uid()), Some(ino.gid())).map_err(io_err(path))?;
    }
    if !is_link {
        let perm = ino.permissions().mode() & 0o7777;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(perm))
            .map_err(io_err(path))?;
    }
    for (name, value) in fs.xattrs_inode(*ino).map_err(bad)? {
        if !root && !name.starts_with(b"user.") {
            continue;
        }
        // Set on the entry itself, never through a symlink.
        xattr::set(path, std::ffi::OsStr::from_bytes(&name), &value).map_err(io_err(path))?;
    }
    let (secs, nsec) = ino.modified_unix();
    let t = nix::sys::time::TimeSpec::new(secs, nsec as _);
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &t,
        &t,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| io_err(path)(std::io::Error::from_raw_os_error(e as i32)))
}

/// Exports layer `m` from the store into `dest`, using `scratch` for its image files.
pub async fn export_layer(
    store: &Store,
    m: &LayerManifest,
    dest: &Path,
    scratch: &Path,
) -> Result<ExportReport, BuildError> {
    let meta_path = scratch.join(format!("{}.meta", m.id));
    let blob_path = scratch.join(format!("{}.blob", m.id));
    fetch_layer_files(store, m, &meta_path, &blob_path).await?;
    let has_blob = m.blob_size > 0;
    let dest = dest.to_path_buf();
    let (mp, bp) = (meta_path.clone(), blob_path.clone());
    let result = tokio::task::spawn_blocking(move || {
        let fs = open_image(&mp, has_blob.then_some(bp.as_path()))?;
        export_image(&fs, &dest)
    })
    .await
    .map_err(|e| BuildError::Internal(format!("export panicked: {e}")))?;
    let _ = std::fs::remove_file(&meta_path);
    let _ = std::fs::remove_file(&blob_path);
    result
}
