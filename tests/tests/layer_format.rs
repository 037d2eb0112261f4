//! Every image the writer produces is read back by three independent readers (the kernel's
//! EROFS driver via a file-backed mount, erofs-rs, and fsck.erofs) and compared with the
//! source tree.

use std::process::Command;

use strata_builder::{LayerKind, Source};
use strata_tests::treecmp::{assert_same_tree, Ignore};
use strata_tests::*;

fn fsck(files: &LayerFiles, extra: &[&str]) -> std::process::Output {
    let mut cmd = Command::new("fsck.erofs");
    if let Some(b) = &files.blob {
        cmd.arg(format!("--device={}", b.display()));
    }
    cmd.args(extra)
        .arg(&files.meta)
        .output()
        .expect("fsck.erofs")
}

#[test]
fn full_tree_reads_back_identically_through_three_readers() {
    if !have_root("full_tree_reads_back") || !have_tool("full_tree_reads_back", "fsck.erofs") {
        return;
    }
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("src");
    fixtures::full_tree(&src, true);
    let (_sd, store) = temp_store();
    let report = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Base).unwrap();
    let files = fetch_layer(&rt, &store, &report.id);
    let ignore = Ignore {
        root_meta: true,
        ..Default::default()
    };

    // 1. The kernel, file-backed with the blob as an extra device.
    {
        let mnt = KernelMount::new(&files.meta, files.blob.as_deref()).expect("kernel mount");
        assert_same_tree(&src, mnt.path(), ignore);
    }

    // 2. erofs-rs, through our exporter.
    let out = work.path().join("erofs-rs");
    let fs = strata_builder::export::open_image(&files.meta, files.blob.as_deref()).unwrap();
    strata_builder::export::export_image(&fs, &out).unwrap();
    assert_same_tree(&src, &out, ignore);

    // 3. fsck.erofs: integrity check, then extraction compared on content.
    let o = fsck(&files, &[]);
    assert!(
        o.status.success(),
        "fsck.erofs failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    let extracted = work.path().join("fsck");
    let o = fsck(&files, &[&format!("--extract={}", extracted.display())]);
    assert!(
        o.status.success(),
        "fsck.erofs --extract failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let want = treecmp::snapshot(&src);
    let got = treecmp::snapshot(&extracted);
    // erofs-utils 1.5 extracts chunk-index holes wrongly (it writes the next chunk's bytes
    // and truncates the file; the kernel and erofs-rs read them as zeros, as the format
    // says), so files with holes are left to the other two readers.
    let with_holes: &[&[u8]] = &[b"big/zeros-inside", b"sparse"];
    for (path, e) in &want {
        if with_holes.contains(&path.as_slice()) {
            continue;
        }
        if e.content.is_some() || e.target.is_some() {
            let g = got.get(path).unwrap_or_else(|| {
                panic!("fsck did not extract {}", String::from_utf8_lossy(path))
            });
            assert_eq!(
                (&e.content, &e.target),
                (&g.content, &g.target),
                "{}",
                String::from_utf8_lossy(path)
            );
        }
    }
}

#[test]
fn files_over_4gib_and_holes_read_back() {
    if !have_root("files_over_4gib") || !have_tool("files_over_4gib", "fsck.erofs") {
        return;
    }
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let big = std::fs::File::create(src.join("big.img")).unwrap();
    let size = (4u64 << 30) + (3 << 20) + 123;
    big.set_len(size).unwrap();
    use std::os::unix::fs::FileExt;
    let marks = [
        (0u64, b"start".as_slice()),
        (1 << 32, b"past 4 GiB"),
        (size - 4, b"end!"),
    ];
    for (off, data) in marks {
        big.write_all_at(data, off).unwrap();
    }
    drop(big);
    std::fs::write(src.join("small"), b"small").unwrap();
    let (_sd, store) = temp_store();
    let report = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Base).unwrap();
    assert_eq!(report.logical_bytes, size + 5);
    // Holes are not stored: three 1 MiB chunks of data at most, plus the small file.
    assert!(
        report.blob_bytes <= (3 << 20) + 4096,
        "blob is {} bytes",
        report.blob_bytes
    );
    let files = fetch_layer(&rt, &store, &report.id);

    let mnt = KernelMount::new(&files.meta, files.blob.as_deref()).expect("kernel mount");
    assert_same_tree(
        &src,
        mnt.path(),
        Ignore {
            root_meta: true,
            ..Default::default()
        },
    );

    let fs = strata_builder::export::open_image(&files.meta, files.blob.as_deref()).unwrap();
    let f = fs.open("/big.img").unwrap();
    assert_eq!(f.size(), size);
    for (off, data) in marks {
        let mut buf = vec![0u8; data.len()];
        let mut got = 0;
        while got < buf.len() {
            let n = f.read_at(&mut buf[got..], off + got as u64).unwrap();
            assert!(n > 0);
            got += n;
        }
        assert_eq!(buf, data, "erofs-rs at offset {off}");
    }
    let o = fsck(&files, &[]);
    assert!(
        o.status.success(),
        "fsck.erofs: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn empty_layer_and_data_free_layer_mount() {
    if !have_root("empty_layer_mounts") {
        return;
    }
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("src");
    std::fs::create_dir_all(src.join("only/dirs")).unwrap();
    std::fs::write(src.join("only/empty-file"), b"").unwrap();
    let (_sd, store) = temp_store();
    let report = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Toolkit).unwrap();
    assert_eq!(report.blob_bytes, 0);
    let files = fetch_layer(&rt, &store, &report.id);
    assert!(files.blob.is_none());
    let mnt = KernelMount::new(&files.meta, None).expect("kernel mount");
    assert_same_tree(
        &src,
        mnt.path(),
        Ignore {
            root_meta: true,
            ..Default::default()
        },
    );
}
