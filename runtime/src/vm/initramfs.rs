//! The guest's initramfs: the static `strata-agent` as `/init` and the kernel modules the
//! guest needs (`modules.load` order; for a VM with a display also `modules.display`, the
//! graphics driver), in the kernel's `newc` cpio format, uncompressed (a
//! TCG guest spends longer inflating than the kernel spends copying). Built once per
//! (agent, module set) and kept under a name derived from its content.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::RuntimeError;

/// One cpio member.
enum Member<'a> {
    Dir,
    File(&'a [u8], u32),
    CharDev(u32, u32),
}

struct Writer {
    out: Vec<u8>,
    ino: u32,
}

impl Writer {
    fn add(&mut self, name: &str, member: Member) {
        let (mode, data, rdev): (u32, &[u8], (u32, u32)) = match member {
            Member::Dir => (0o040755, &[], (0, 0)),
            Member::File(data, perm) => (0o100000 | perm, data, (0, 0)),
            Member::CharDev(major, minor) => (0o020600, &[], (major, minor)),
        };
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len() as u32,
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0,
        ];
        let _ = write!(self.out, "070701");
        for f in fields {
            let _ = write!(self.out, "{f:08x}");
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }
}

/// The initramfs for `agent` and the modules in `guest_dir`, built into `cache` unless
/// already there; its path. Its name derives from its inputs' identities (path, size,
/// modification time), so the check costs a few `stat`s, not reading and hashing
/// megabytes on every start.
pub fn build(
    agent: &Path,
    guest_dir: &Path,
    cache: &Path,
    display: bool,
) -> Result<PathBuf, RuntimeError> {
    let read = |p: &Path| std::fs::read(p).map_err(RuntimeError::io(p));
    let list = |file: &str| -> Result<String, RuntimeError> {
        Ok(String::from_utf8_lossy(&read(&guest_dir.join(file))?).into_owned())
    };
    let order = list("modules.load")?;
    let display_order = if display {
        list("modules.display")?
    } else {
        String::new()
    };
    let names: Vec<&str> = order
        .lines()
        .chain(display_order.lines())
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let module_paths: Vec<PathBuf> = names
        .iter()
        .map(|n| guest_dir.join("modules").join(format!("{n}.ko")))
        .collect();
    let mut hasher = blake3::Hasher::new();
    hasher.update(order.as_bytes());
    hasher.update(display_order.as_bytes());
    for p in std::iter::once(agent).chain(module_paths.iter().map(PathBuf::as_path)) {
        let meta = std::fs::metadata(p).map_err(RuntimeError::io(p))?;
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        hasher.update(p.as_os_str().as_encoded_bytes());
        hasher.update(&meta.len().to_le_bytes());
        hasher.update(&mtime.to_le_bytes());
    }
    let key = hasher.finalize().to_hex();
    let path = cache.join(format!("initramfs-{}.cpio", &key[..16]));
    if path.exists() {
        super::mark_used(&path);
        return Ok(path);
    }
    let agent_bytes = match stripped(agent, cache) {
        Some(bytes) => bytes,
        None => read(agent)?,
    };
    let modules = module_paths
        .iter()
        .map(|p| read(p))
        .collect::<Result<Vec<_>, _>>()?;
    let mut w = Writer {
        out: Vec::with_capacity(agent_bytes.len() + (8 << 20)),
        ino: 0,
    };
    for dir in ["dev", "proc", "sys", "run", "lib", "lib/modules"] {
        w.add(dir, Member::Dir);
    }
    // The kernel opens the console for init before anything is mounted.
    w.add("dev/console", Member::CharDev(5, 1));
    w.add("init", Member::File(&agent_bytes, 0o755));
    w.add(
        "lib/modules/modules.load",
        Member::File(order.as_bytes(), 0o644),
    );
    if display {
        w.add(
            "lib/modules/modules.display",
            Member::File(display_order.as_bytes(), 0o644),
        );
    }
    for (name, bytes) in names.iter().zip(&modules) {
        w.add(
            &format!("lib/modules/{name}.ko"),
            Member::File(bytes, 0o644),
        );
    }
    w.add("TRAILER!!!", Member::File(&[], 0));
    std::fs::create_dir_all(cache).map_err(RuntimeError::io(cache))?;
    let tmp = cache.join(format!("initramfs.{}.tmp", uuid::Uuid::new_v4().simple()));
    std::fs::write(&tmp, &w.out).map_err(RuntimeError::io(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(RuntimeError::io(&path))?;
    super::prune_unused(cache, ".cpio");
    Ok(path)
}

/// The agent without symbols and debug info (a third of its size or less): every byte
/// of the initramfs is copied into each guest's memory and into every template and
/// snapshot. `None` when binutils' `strip` is not there.
fn stripped(agent: &Path, cache: &Path) -> Option<Vec<u8>> {
    std::fs::create_dir_all(cache).ok()?;
    let out = cache.join(format!("agent.{}.stripped", crate::unique_suffix()));
    let ok = std::process::Command::new("strip")
        .arg("--strip-all")
        .arg("-o")
        .arg(&out)
        .arg(agent)
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let bytes = ok.then(|| std::fs::read(&out).ok()).flatten();
    let _ = std::fs::remove_file(&out);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_aligned_and_named() {
        let mut w = Writer {
            out: Vec::new(),
            ino: 0,
        };
        w.add("init", Member::File(b"abcde", 0o755));
        w.add("TRAILER!!!", Member::File(&[], 0));
        let text = String::from_utf8_lossy(&w.out);
        assert!(text.starts_with("070701"));
        // Header (110) + "init\0" padded to 116, then 5 bytes of data padded to 124.
        assert_eq!(&w.out[110..114], b"init");
        assert_eq!(&w.out[116..121], b"abcde");
        assert_eq!(&w.out[124..130], b"070701");
        assert!(w.out.len().is_multiple_of(4));
        // The mode field (second) of a regular 0755 file.
        assert_eq!(&w.out[14..22], b"000081ed");
    }
}
