//! Whole-tree comparison: everything a layer must preserve, path by path: type, mode,
//! owner, mtime (seconds), size, content, link target, device number, xattrs, link count
//! and hard-link grouping.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
    pub size: u64,
    pub content: Option<[u8; 32]>,
    pub target: Option<Vec<u8>>,
    pub rdev: u64,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    pub nlink: u64,
    /// First path (in walk order) of the inode this name belongs to.
    pub link_group: Vec<u8>,
}

fn hash_file(p: &Path) -> [u8; 32] {
    let mut f = std::fs::File::open(p).unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    *h.finalize().as_bytes()
}

/// Everything under `root`, keyed by relative path (the root itself is "").
pub fn snapshot(root: &Path) -> BTreeMap<Vec<u8>, Entry> {
    let mut out = BTreeMap::new();
    let mut groups: HashMap<(u64, u64), Vec<u8>> = HashMap::new();
    let mut walk: Vec<_> = walkdir::WalkDir::new(root)
        .follow_links(false)
        .sort_by(|a, b| a.file_name().as_bytes().cmp(b.file_name().as_bytes()))
        .into_iter()
        .map(|e| e.unwrap_or_else(|e| panic!("walking {}: {e}", root.display())))
        .collect();
    walk.sort_by(|a, b| {
        a.path()
            .as_os_str()
            .as_bytes()
            .cmp(b.path().as_os_str().as_bytes())
    });
    for e in walk {
        let p = e.path();
        let rel = p
            .strip_prefix(root)
            .expect("under root")
            .as_os_str()
            .as_bytes()
            .to_vec();
        let m = std::fs::symlink_metadata(p).expect("lstat");
        let ft = m.file_type();
        let mut xattrs = BTreeMap::new();
        for name in xattr::list(p).expect("listxattr") {
            let v = xattr::get(p, &name).expect("getxattr").unwrap_or_default();
            xattrs.insert(name.as_bytes().to_vec(), v);
        }
        let group = groups
            .entry((m.dev(), m.ino()))
            .or_insert_with(|| rel.clone())
            .clone();
        out.insert(
            rel,
            Entry {
                mode: m.mode(),
                uid: m.uid(),
                gid: m.gid(),
                mtime: m.mtime(),
                size: if ft.is_dir() { 0 } else { m.size() },
                content: ft.is_file().then(|| hash_file(p)),
                target: ft.is_symlink().then(|| {
                    std::fs::read_link(p)
                        .expect("readlink")
                        .as_os_str()
                        .as_bytes()
                        .to_vec()
                }),
                rdev: if ft.is_char_device_or_block() {
                    m.rdev()
                } else {
                    0
                },
                xattrs,
                nlink: m.nlink(),
                link_group: if ft.is_dir() { Vec::new() } else { group },
            },
        );
    }
    out
}

trait DevType {
    fn is_char_device_or_block(&self) -> bool;
}

impl DevType for std::fs::FileType {
    fn is_char_device_or_block(&self) -> bool {
        use std::os::unix::fs::FileTypeExt;
        self.is_char_device() || self.is_block_device()
    }
}

/// What to leave out of a comparison.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ignore {
    /// The root directory's mode, owner and time (a layer normalizes them).
    pub root_meta: bool,
    /// Owners (an unprivileged export cannot set them).
    pub owners: bool,
    /// Xattrs outside `user.` (an unprivileged export cannot set them).
    pub privileged_xattrs: bool,
}

/// Differences between two snapshots, one line each; empty when equal.
pub fn diff(
    expected: &BTreeMap<Vec<u8>, Entry>,
    actual: &BTreeMap<Vec<u8>, Entry>,
    ignore: Ignore,
) -> Vec<String> {
    let mut out = Vec::new();
    for (path, e) in expected {
        let shown = String::from_utf8_lossy(path);
        let Some(a) = actual.get(path) else {
            out.push(format!("missing: {shown}"));
            continue;
        };
        let mut e = e.clone();
        let mut a = a.clone();
        if path.is_empty() && ignore.root_meta {
            a.mode = e.mode;
            a.uid = e.uid;
            a.gid = e.gid;
            a.mtime = e.mtime;
        }
        if ignore.owners {
            a.uid = e.uid;
            a.gid = e.gid;
        }
        if ignore.privileged_xattrs {
            e.xattrs.retain(|k, _| k.starts_with(b"user."));
            a.xattrs.retain(|k, _| k.starts_with(b"user."));
        }
        if e != a {
            out.push(format!(
                "differs: {shown}\n  expected {e:?}\n  actual   {a:?}"
            ));
        }
    }
    for path in actual.keys() {
        if !expected.contains_key(path) {
            out.push(format!("unexpected: {}", String::from_utf8_lossy(path)));
        }
    }
    out
}

/// Asserts two trees are equal, printing the first differences.
pub fn assert_same_tree(expected: &Path, actual: &Path, ignore: Ignore) {
    let d = diff(&snapshot(expected), &snapshot(actual), ignore);
    assert!(
        d.is_empty(),
        "{} differs from {} in {} ways:\n{}",
        actual.display(),
        expected.display(),
        d.len(),
        d.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
}
