//! Sample trees: one that uses every kind of inode and attribute a layer must carry, and
//! synthetic workspaces of source-like files for dedup measurements.

use std::ffi::{CString, OsStr};
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;

use sha2::Digest as _;

/// Deterministic pseudo-random bytes (xorshift), incompressible.
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Source-code-like text: compressible, distinct per seed.
pub fn text_bytes(len: usize, seed: u64) -> Vec<u8> {
    let words = [
        "fn", "let", "return", "self", "value", "index", "match", "Some", "None", "=>", "{", "}",
        "(", ")", ";", "\n", "    ",
    ];
    let r = random_bytes(len / 3 + 16, seed);
    let mut out = Vec::with_capacity(len + 16);
    let mut i = 0;
    while out.len() < len {
        out.extend_from_slice(words[r[i % r.len()] as usize % words.len()].as_bytes());
        out.push(b' ');
        if i % 7 == 0 {
            out.extend_from_slice(format!("v{}", r[(i + 1) % r.len()]).as_bytes());
        }
        i += 1;
    }
    out.truncate(len);
    out
}

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path without NUL")
}

fn mknod(p: &Path, mode: u32, major: u32, minor: u32) {
    // SAFETY: valid C path.
    let rc = unsafe { libc::mknod(c(p).as_ptr(), mode, libc::makedev(major, minor)) };
    assert_eq!(
        rc,
        0,
        "mknod {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

fn set_mtime(p: &Path, secs: i64, nsec: i64) {
    let t = [
        libc::timespec {
            tv_sec: secs,
            tv_nsec: nsec,
        },
        libc::timespec {
            tv_sec: secs,
            tv_nsec: nsec,
        },
    ];
    // SAFETY: valid path, two timespecs.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c(p).as_ptr(),
            t.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(rc, 0, "utimensat {}", p.display());
}

fn chmod(p: &Path, mode: u32) {
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).expect("chmod");
}

/// A tree with every inode type and attribute a layer must preserve. Needs root (devices,
/// owners, trusted.* xattrs). `with_socket`: tar cannot carry sockets, so trees meant to be
/// compared with a tar of themselves leave it out.
pub fn full_tree(root: &Path, with_socket: bool) {
    fs::create_dir_all(root).expect("mkdir");
    let w = |rel: &str, data: &[u8]| {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        fs::write(&p, data).expect("write");
    };
    w("empty", b"");
    w("small.txt", b"hello, layer\n");
    w("block-exact", &random_bytes(4096, 1));
    w("ten-k", &text_bytes(10 * 1024, 2));
    w("dir/nested/deeper/file.bin", &random_bytes(5000, 3));
    w("big/three-mib", &random_bytes(3 << 20, 4));
    w("big/zeros-inside", &{
        let mut v = random_bytes(3 << 20, 5);
        v[(1 << 20)..(2 << 20)].fill(0);
        v
    });
    // Sparse: a 2 MiB hole, then data.
    {
        let p = root.join("sparse");
        let f = fs::File::create(&p).expect("create");
        std::os::unix::fs::FileExt::write_all_at(&f, b"tail data", 2 << 20).expect("write");
    }
    // A directory spanning several blocks, with names that sort around '.'.
    for i in 0..300 {
        w(
            &format!("many/entry-{i:04}-{}", "x".repeat(i % 40)),
            format!("{i}").as_bytes(),
        );
    }
    for name in ["!bang", "+plus", "-minus", ".hidden", "~tilde"] {
        w(&format!("many/{name}"), name.as_bytes());
    }
    // Names of any bytes, up to 255.
    let odd = root.join(OsStr::from_bytes(b"odd-\xff\xfe-\x01name"));
    fs::write(&odd, b"odd").expect("odd name");
    let long = root.join("l".repeat(255));
    fs::write(&long, b"long name").expect("long name");
    // Symlinks: short (inline), long (3000 bytes), dangling, to a directory.
    symlink("small.txt", root.join("link-short")).expect("symlink");
    symlink("t/".repeat(1500), root.join("link-long")).expect("symlink");
    symlink("/nonexistent/target", root.join("link-dangling")).expect("symlink");
    symlink("dir/nested", root.join("link-dir")).expect("symlink");
    // Hard links: three names, one in another directory.
    w("hard/a", b"shared by three names");
    fs::hard_link(root.join("hard/a"), root.join("hard/b")).expect("link");
    fs::hard_link(root.join("hard/a"), root.join("dir/hard-c")).expect("link");
    // Special files.
    mknod(&root.join("dev-null"), libc::S_IFCHR | 0o666, 1, 3);
    mknod(&root.join("dev-blk"), libc::S_IFBLK | 0o660, 259, 300);
    mknod(&root.join("whiteout"), libc::S_IFCHR, 0, 0);
    mknod(&root.join("fifo"), libc::S_IFIFO | 0o644, 0, 0);
    if with_socket {
        let _ = std::os::unix::net::UnixListener::bind(root.join("socket")).expect("socket");
    }
    // Modes, owners.
    w("modes/setuid", b"#!/bin/sh\n");
    chmod(&root.join("modes/setuid"), 0o4755);
    w("modes/setgid", b"x");
    chmod(&root.join("modes/setgid"), 0o2711);
    fs::create_dir_all(root.join("modes/sticky")).expect("mkdir");
    chmod(&root.join("modes/sticky"), 0o1777);
    w("modes/big-ids", b"owned by 70000:70001");
    std::os::unix::fs::lchown(root.join("modes/big-ids"), Some(70000), Some(70001)).expect("chown");
    std::os::unix::fs::lchown(root.join("link-short"), Some(1000), Some(1000)).expect("lchown");
    // Xattrs: user, overlay opaque, file capability.
    xattr::set(root.join("small.txt"), "user.comment", b"a value").expect("xattr");
    xattr::set(root.join("hard/a"), "user.shared", b"on all names").expect("xattr");
    xattr::set(root.join("dir/nested"), "trusted.overlay.opaque", b"y").expect("xattr");
    // VFS_CAP_REVISION_2 with CAP_NET_RAW permitted and effective.
    let mut cap = Vec::new();
    cap.extend_from_slice(&0x0200_0001u32.to_le_bytes());
    cap.extend_from_slice(&(1u32 << 13).to_le_bytes());
    cap.extend_from_slice(&0u32.to_le_bytes());
    cap.extend_from_slice(&[0u8; 8]);
    w("modes/ping", b"\x7fELF pretend");
    xattr::set(root.join("modes/ping"), "security.capability", &cap).expect("capability xattr");
    xattr::set(root.join("ten-k"), "user.big", &vec![b'v'; 3000]).expect("xattr");
    // Times: files with sub-second parts (layers keep seconds), directories last.
    let mut paths: Vec<_> = walkdir::WalkDir::new(root)
        .min_depth(1)
        .into_iter()
        .map(|e| e.expect("walk").into_path())
        .collect();
    paths.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for (i, p) in paths.iter().enumerate() {
        set_mtime(p, 1_600_000_000 + i as i64 * 7, 123_456_789);
    }
}

/// A workspace of `files` source-like files (200 B to 40 KiB) under `root`.
pub fn workspace_tree(root: &Path, files: usize, seed: u64) {
    for i in 0..files {
        let dir = root.join(format!("pkg{:02}/mod{:02}", i % 17, i % 5));
        fs::create_dir_all(&dir).expect("mkdir");
        let len = 200 + (random_bytes(8, seed + i as u64)[0] as usize * 160);
        fs::write(
            dir.join(format!("file{i:05}.rs")),
            text_bytes(len, seed * 1_000_003 + i as u64),
        )
        .expect("write");
    }
}

/// A GNU tar header for a regular file of `size` bytes, owned by root, at time 0.
pub fn header(size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_size(size);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h
}

/// An uncompressed tar with files and whiteout markers.
pub fn simple_tar(files: &[(&str, &[u8])], markers: &[&str]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = tar::Header::new_ustar();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        b.append_data(&mut h, path, *data).unwrap();
    }
    for m in markers {
        let mut h = tar::Header::new_ustar();
        h.set_size(0);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        b.append_data(&mut h, m, &b""[..]).unwrap();
    }
    b.into_inner().unwrap()
}

fn put_blob(layout: &Path, data: &[u8]) -> (String, usize) {
    let hex = hex_of(&sha2::Sha256::digest(data));
    std::fs::write(layout.join("blobs/sha256").join(&hex), data).unwrap();
    (format!("sha256:{hex}"), data.len())
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Writes an OCI image layout with one image made of `layers` (bottom first).
pub fn write_oci_layout(layout: &Path, layers: &[Vec<u8>]) {
    std::fs::create_dir_all(layout.join("blobs/sha256")).unwrap();
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    let (cfg, cfg_size) = put_blob(
        layout,
        br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#,
    );
    let descs: Vec<_> = layers
        .iter()
        .map(|l| {
            let (d, s) = put_blob(layout, l);
            serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": s})
        })
        .collect();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg, "size": cfg_size},
        "layers": descs,
    });
    let (md, ms) = put_blob(layout, manifest.to_string().as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
                       "annotations": {"org.opencontainers.image.ref.name": "latest"}}],
    });
    std::fs::write(layout.join("index.json"), index.to_string()).unwrap();
}
