//! Writable uppers with a size limit. Each sandbox's upper is its own small ext4
//! filesystem in a sparse image file on the host's disk, loop-mounted: filling it gives
//! ENOSPC inside the sandbox and nothing outside notices, and only written blocks use disk.
//!
//! Why not one filesystem with project quotas: this kind of host's kernel has neither
//! XFS quota nor CONFIG_QUOTA for ext4 (both measured), so a per-sandbox filesystem is the
//! limit the kernel can enforce. The image has no journal: an upper dies with its sandbox.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::RuntimeError;

/// Where uppers are mounted and their images kept.
#[derive(Debug, Clone)]
pub struct Uppers {
    images: PathBuf,
    mounts: PathBuf,
}

impl Uppers {
    pub fn open(images: &Path, mounts: &Path) -> Result<Uppers, RuntimeError> {
        for d in [images, mounts] {
            std::fs::create_dir_all(d).map_err(RuntimeError::io(d))?;
        }
        Ok(Uppers {
            images: images.to_path_buf(),
            mounts: mounts.to_path_buf(),
        })
    }

    pub fn dir(&self, id: &str) -> PathBuf {
        self.mounts.join(id)
    }

    fn image(&self, id: &str) -> PathBuf {
        self.images.join(format!("{id}.img"))
    }

    /// Makes and mounts a fresh upper of `bytes` for sandbox `id`.
    pub fn create(&self, id: &str, bytes: u64) -> Result<PathBuf, RuntimeError> {
        let image = self.image(id);
        let dir = self.dir(id);
        self.remove(id)?;
        let f = std::fs::File::create(&image).map_err(RuntimeError::io(&image))?;
        f.set_len(bytes).map_err(RuntimeError::io(&image))?;
        drop(f);
        run(Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-O",
                "^has_journal,^resize_inode",
                "-E",
                "lazy_itable_init=1,nodiscard",
                "-m",
                "0",
                "-i",
                "8192",
            ])
            .arg(&image))?;
        std::fs::create_dir_all(&dir).map_err(RuntimeError::io(&dir))?;
        run(Command::new("mount")
            .args(["-t", "ext4", "-o", "loop,nosuid,nodev,noatime"])
            .arg(&image)
            .arg(&dir))?;
        Ok(dir)
    }

    /// Bytes used in an upper and its size.
    pub fn usage(&self, id: &str) -> Result<(u64, u64), RuntimeError> {
        let dir = self.dir(id);
        let st = nix::sys::statvfs::statvfs(&dir)
            .map_err(|e| RuntimeError::io(&dir)(std::io::Error::from(e)))?;
        let size = st.blocks() * st.fragment_size();
        let free = st.blocks_available() * st.fragment_size();
        Ok((size.saturating_sub(free), size))
    }

    /// Unmounts and deletes an upper (no-op when there is none).
    pub fn remove(&self, id: &str) -> Result<(), RuntimeError> {
        let dir = self.dir(id);
        crate::rootfs::unmount_below(&dir)?;
        for p in [self.image(id)] {
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(RuntimeError::io(&p)(e)),
            }
        }
        match std::fs::remove_dir(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError::io(&dir)(e)),
        }
    }

    /// Sandbox IDs that have an upper image or mount on this host.
    pub fn entries(&self) -> Vec<String> {
        let mut ids = std::collections::BTreeSet::new();
        for (d, suffix) in [(&self.images, ".img"), (&self.mounts, "")] {
            if let Ok(rd) = std::fs::read_dir(d) {
                for e in rd.flatten() {
                    if let Some(n) = e.file_name().to_str() {
                        if let Some(id) = n.strip_suffix(suffix) {
                            ids.insert(id.to_string());
                        }
                    }
                }
            }
        }
        ids.into_iter().collect()
    }
}

fn run(cmd: &mut Command) -> Result<String, RuntimeError> {
    let out = cmd.output().map_err(|e| {
        RuntimeError::Setup(format!(
            "cannot run {:?}: {e} (install it with scripts/setup.sh)",
            cmd.get_program()
        ))
    })?;
    if !out.status.success() {
        return Err(RuntimeError::Setup(format!(
            "{:?} {:?} failed: {}",
            cmd.get_program(),
            cmd.get_args().collect::<Vec<_>>(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
