//! File access from the host into a sandbox's root filesystem. Every path is resolved with
//! `openat2(RESOLVE_IN_ROOT)`, so a symlink the sandbox planted (`/x -> /etc/shadow` of the
//! host, or `../../..`) resolves inside the sandbox's root, never outside it.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::RuntimeError;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: String,
    pub size: u64,
    pub mode: u32,
    /// Last modification, seconds since the epoch.
    pub mtime: i64,
    pub uid: u32,
    pub gid: u32,
    /// Where a symlink points.
    pub target: Option<String>,
}

fn open_in(root: &File, path: &str, flags: i32, mode: u32) -> Result<OwnedFd, RuntimeError> {
    let rel = path.trim_start_matches('/');
    let rel = if rel.is_empty() { "." } else { rel };
    if rel.contains('\0') {
        return Err(RuntimeError::Invalid(format!(
            "path {path:?} has a NUL byte"
        )));
    }
    strata_host::fs::open_in_root(root, rel, flags, mode).map_err(|source| RuntimeError::File {
        path: path.to_string(),
        source,
    })
}

fn root_dir(root: &Path) -> Result<File, RuntimeError> {
    File::open(root).map_err(RuntimeError::io(root))
}

/// How much of a file one call of a reader's sink carries.
pub const READ_PART: usize = 1 << 20;

/// Reads `path` in parts of at most [`READ_PART`] bytes, each handed to `sink` before the
/// next is read: memory stays one part whatever the file's size (a sparse file in an upper
/// can claim terabytes). A sink's error ends the read.
pub fn read_file_with(
    root: &Path,
    path: &str,
    sink: &mut dyn FnMut(&[u8]) -> Result<(), RuntimeError>,
) -> Result<(), RuntimeError> {
    let fd = open_in(&root_dir(root)?, path, libc::O_RDONLY, 0)?;
    let mut f = File::from(fd);
    let mut buf = vec![0u8; READ_PART];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(RuntimeError::File {
                    path: path.to_string(),
                    source,
                })
            }
        };
        sink(&buf[..n])?;
    }
}

/// Writes `data` to `path` (created or truncated), making missing parent directories.
pub fn write_file(root: &Path, path: &str, data: &[u8], mode: u32) -> Result<(), RuntimeError> {
    let r = root_dir(root)?;
    let parent = Path::new(path)
        .parent()
        .map(|p| p.to_string_lossy().into_owned());
    if let Some(parent) = parent {
        mkdir_all(&r, &parent)?;
    }
    let fd = open_in(
        &r,
        path,
        libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC,
        mode,
    )?;
    let mut f = File::from(fd);
    let err = |source| RuntimeError::File {
        path: path.to_string(),
        source,
    };
    f.write_all(data).map_err(err)?;
    f.set_permissions(std::fs::Permissions::from_mode(mode))
        .map_err(err)?;
    Ok(())
}

fn mkdir_all(root: &File, dir: &str) -> Result<(), RuntimeError> {
    let mut current = String::new();
    for part in dir.split('/').filter(|p| !p.is_empty()) {
        let parent = open_in(
            root,
            if current.is_empty() { "/" } else { &current },
            libc::O_PATH | libc::O_DIRECTORY,
            0,
        )?;
        if part.contains('\0') {
            return Err(RuntimeError::Invalid(format!("NUL in {dir:?}")));
        }
        if part == ".." || part == "." {
            return Err(RuntimeError::Invalid(format!(
                "path {dir:?} must not contain . or .."
            )));
        }
        if let Err(e) = strata_host::fs::mkdir_at(&parent, part) {
            if e.kind() != std::io::ErrorKind::AlreadyExists {
                return Err(RuntimeError::File {
                    path: format!("{current}/{part}"),
                    source: e,
                });
            }
        }
        current = format!("{current}/{part}");
    }
    Ok(())
}

pub fn list_dir(root: &Path, path: &str) -> Result<Vec<FileEntry>, RuntimeError> {
    let fd = open_in(
        &root_dir(root)?,
        path,
        libc::O_RDONLY | libc::O_DIRECTORY,
        0,
    )?;
    // Read the directory through /proc/self/fd so the descriptor's resolution is kept.
    let dir = std::path::PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    let rd = std::fs::read_dir(&dir).map_err(|source| RuntimeError::File {
        path: path.to_string(),
        source,
    })?;
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Ok(meta) = e.metadata() else { continue };
        let ft = meta.file_type();
        out.push(FileEntry {
            name: e.file_name().to_string_lossy().into_owned(),
            kind: if ft.is_symlink() {
                "symlink"
            } else if ft.is_dir() {
                "dir"
            } else if ft.is_file() {
                "file"
            } else {
                "other"
            }
            .into(),
            size: meta.len(),
            mode: meta.permissions().mode() & 0o7777,
            mtime: meta.mtime(),
            uid: meta.uid(),
            gid: meta.gid(),
            target: ft
                .is_symlink()
                .then(|| std::fs::read_link(e.path()).ok())
                .flatten()
                .map(|t| t.to_string_lossy().into_owned()),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_file(root: &Path, path: &str) -> Result<Vec<u8>, RuntimeError> {
        let mut data = Vec::new();
        read_file_with(root, path, &mut |part| {
            data.extend_from_slice(part);
            Ok(())
        })?;
        Ok(data)
    }

    #[test]
    fn symlinks_resolve_inside_the_root() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"host secret").unwrap();
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("etc")).unwrap();
        std::fs::write(root.path().join("etc/secret"), b"sandbox file").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), root.path().join("abs")).unwrap();
        std::os::unix::fs::symlink("../../../../../../etc/secret", root.path().join("rel"))
            .unwrap();
        // The absolute link names a host path: inside the root it does not exist.
        assert!(read_file(root.path(), "/abs").is_err());
        // `..` stops at the sandbox's root.
        assert_eq!(read_file(root.path(), "/rel").unwrap(), b"sandbox file");
        write_file(root.path(), "/a/b/c.txt", b"hi", 0o600).unwrap();
        assert_eq!(std::fs::read(root.path().join("a/b/c.txt")).unwrap(), b"hi");
        let names: Vec<_> = list_dir(root.path(), "/")
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, ["a", "abs", "etc", "rel"]);
        assert_eq!(
            std::fs::read(outside.path().join("secret")).unwrap(),
            b"host secret"
        );
    }
}
