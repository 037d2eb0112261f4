//! Property: any directory tree built into a layer reads back the same through erofs-rs
//! (an EROFS reader that is not ours and not the kernel's, so no root is needed): names,
//! types, permission bits, times, file contents (holes and all), symlink targets, hard
//! links and user extended attributes.

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use proptest::prelude::*;
use strata_builder::{BuildRequest, LayerKind, Source};
use strata_store::{Store, StoreUrl};

/// What an entry of a generated tree is.
#[derive(Debug, Clone)]
enum Entry {
    Dir(u32),
    /// Mode, then runs of content: (zero run?, length, seed).
    File(u32, Vec<(bool, usize, u8)>),
    Symlink(String),
    /// A second name for the file at this (generated) path, if it is one.
    HardLink(String),
}

/// A generated entry: its path, what it is, and a user xattr to set on it.
type Generated = (String, Entry, Option<(String, Vec<u8>)>);

fn path() -> impl Strategy<Value = String> {
    proptest::collection::vec(prop_oneof!["a", "b", "c", "dé", "x.py"], 1..=3)
        .prop_map(|p| p.join("/"))
}

fn entry() -> impl Strategy<Value = Generated> {
    let kind = prop_oneof![
        (0o700u32..0o1000).prop_map(Entry::Dir),
        (
            0o400u32..0o1000,
            proptest::collection::vec((any::<bool>(), 0usize..1_500_000, any::<u8>()), 0..3)
        )
            .prop_map(|(m, runs)| Entry::File(m, runs)),
        "[a-z/.]{1,20}".prop_map(Entry::Symlink),
        path().prop_map(Entry::HardLink),
    ];
    let xattr = proptest::option::of((
        "user\\.[a-z]{1,8}",
        proptest::collection::vec(any::<u8>(), 0..40),
    ));
    (path(), kind, xattr)
}

fn content(runs: &[(bool, usize, u8)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (zero, len, seed) in runs {
        let start = out.len();
        out.resize(start + len, 0);
        if !zero {
            let mut x = (*seed as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            for b in &mut out[start..] {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = (x >> 24) as u8;
            }
        }
    }
    out
}

/// Writes what of `entries` fits (an entry under a non-directory, or over an existing
/// name, is skipped) under `root`, with fixed times.
fn materialize(root: &Path, entries: &[Generated]) {
    for (rel, kind, xattr) in entries {
        let p = root.join(rel);
        if std::fs::symlink_metadata(&p).is_ok() {
            continue;
        }
        let parent = p.parent().expect("a parent");
        if std::fs::create_dir_all(parent).is_err() {
            continue;
        }
        let made = match kind {
            Entry::Dir(mode) => std::fs::create_dir(&p)
                .and_then(|_| std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode))),
            Entry::File(mode, runs) => std::fs::write(&p, content(runs))
                .and_then(|_| std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode))),
            Entry::Symlink(target) => std::os::unix::fs::symlink(target, &p),
            Entry::HardLink(to) => match std::fs::symlink_metadata(root.join(to)) {
                Ok(m) if m.is_file() => std::fs::hard_link(root.join(to), &p),
                _ => continue,
            },
        };
        if made.is_err() {
            continue;
        }
        if let (Some((name, value)), false) = (xattr, matches!(kind, Entry::Symlink(_))) {
            let _ = xattr::set(&p, name, value);
        }
    }
    // Owner-writable directories, so the tree can be read and removed; fixed times.
    for e in walkdir::WalkDir::new(root).contents_first(true) {
        let e = e.expect("walking the tree");
        if e.file_type().is_dir() {
            let mode = e.metadata().expect("metadata").mode() & 0o7777;
            std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(mode | 0o700))
                .expect("chmod");
        }
        let t = nix::sys::time::TimeSpec::new(1_700_000_000 + e.depth() as i64, 0);
        nix::sys::stat::utimensat(
            nix::fcntl::AT_FDCWD,
            e.path(),
            &t,
            &t,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .expect("utimensat");
    }
}

/// Everything the round trip must keep, per path.
fn describe(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut inodes: BTreeMap<u64, String> = BTreeMap::new();
    for e in walkdir::WalkDir::new(root).min_depth(1).sort_by_file_name() {
        let e = e.expect("walking");
        let rel = e
            .path()
            .strip_prefix(root)
            .expect("under root")
            .display()
            .to_string();
        let m = e.metadata().expect("metadata");
        let mut xattrs: Vec<String> = xattr::list(e.path())
            .map(|names| {
                names
                    .filter(|n| n.to_string_lossy().starts_with("user."))
                    .map(|n| {
                        let v = xattr::get(e.path(), &n).ok().flatten().unwrap_or_default();
                        format!("{}={}", n.to_string_lossy(), hex(&v))
                    })
                    .collect()
            })
            .unwrap_or_default();
        xattrs.sort();
        let what = if e.file_type().is_symlink() {
            let target = std::fs::read_link(e.path()).expect("readlink");
            format!("link {}", target.display())
        } else if e.file_type().is_dir() {
            format!("dir {:o} {} {:?}", m.mode() & 0o7777, m.mtime(), xattrs)
        } else {
            let data = std::fs::read(e.path()).expect("read");
            let linked = match inodes.get(&m.ino()) {
                Some(first) => format!(" same as {first}"),
                None => {
                    inodes.insert(m.ino(), rel.clone());
                    String::new()
                }
            };
            format!(
                "file {:o} {} {} {}{} {:?}",
                m.mode() & 0o7777,
                m.mtime(),
                data.len(),
                blake3::hash(&data),
                linked,
                xattrs
            )
        };
        out.insert(rel, what);
    }
    out
}

fn hex(v: &[u8]) -> String {
    v.iter().map(|b| format!("{b:02x}")).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn a_tree_built_into_a_layer_reads_back_the_same_through_erofs_rs(
        entries in proptest::collection::vec(entry(), 1..24)
    ) {
        let scratch = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-scratch");
        std::fs::create_dir_all(&scratch).unwrap();
        let work = tempfile::tempdir_in(&scratch).unwrap();
        let (src, out, store_dir) = (work.path().join("src"), work.path().join("out"), work.path().join("store"));
        std::fs::create_dir_all(&src).unwrap();
        materialize(&src, &entries);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let store = Store::open(&StoreUrl::Local(store_dir)).unwrap();
        let req = BuildRequest {
            source: Source::Dir(src.clone()),
            kind: LayerKind::Workspace,
            name: None,
            version: None,
            exclude: Vec::new(),
            prefix: None,
            source_label: None,
            provenance: Default::default(),
            registry: Default::default(),
        };
        let exported = rt.block_on(async {
            let report = strata_builder::build(&store, &req, None).await.unwrap();
            let m = store.get_layer(&report.id).await.unwrap();
            strata_builder::export::export_layer(&store, &m, &out, work.path()).await.unwrap()
        });
        let (want, got) = (describe(&src), describe(&out));
        prop_assert_eq!(exported.entries as usize, want.len());
        prop_assert_eq!(got, want);
    }
}
