//! Building layers: reproducibility across runs and source forms, dedup across versions,
//! content-defined chunking, OCI flattening and whiteouts, git sources, and clear errors
//! that leave nothing behind.

use std::path::Path;

use strata_builder::{BuildError, LayerKind, Source};
use strata_tests::fixtures::{header, simple_tar, write_oci_layout};
use strata_tests::*;

fn tar_of(src: &Path, out: &Path, compress: &str) {
    sh(&format!(
        "tar --sort=name --format=pax --xattrs --xattrs-include='*' --numeric-owner -C '{}' -cf - . {} > '{}'",
        src.display(),
        compress,
        out.display()
    ));
}

#[test]
fn same_tree_gives_same_id_from_any_source_form() {
    if !have_root("same_tree_same_id") {
        return;
    }
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("src");
    fixtures::full_tree(&src, false);
    let (_sd, store) = temp_store();
    let a = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Base).unwrap();
    let b = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Base).unwrap();
    assert_eq!(a.id, b.id);
    assert!(a.created && !b.created);
    assert_eq!(b.new_data_bytes, 0, "a rebuild stores nothing new");

    // A copy elsewhere, and name-sorted tars (plain, gzip, zstd) built into a fresh store.
    let copy = work.path().join("copy");
    sh(&format!("cp -a '{}' '{}'", src.display(), copy.display()));
    let (_sd2, store2) = temp_store();
    assert_eq!(
        build(&rt, &store2, Source::Dir(copy), LayerKind::Base)
            .unwrap()
            .id,
        a.id
    );
    for (name, filter) in [
        ("plain.tar", ""),
        ("gz.tar.gz", "| gzip -1"),
        ("zst.tar.zst", "| zstd -q"),
    ] {
        let t = work.path().join(name);
        tar_of(&src, &t, filter);
        let r = build(&rt, &store2, Source::Tar(t), LayerKind::Base).unwrap();
        assert_eq!(
            r.id, a.id,
            "{name} gives a different layer than the directory"
        );
    }
}

#[test]
fn a_one_percent_change_stores_under_five_percent_new_data() {
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("ws");
    fixtures::workspace_tree(&src, 2000, 7);
    let (_sd, store) = temp_store();
    let first = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Workspace).unwrap();

    // 1 % of 2000 files: 10 edits that insert bytes, 5 additions, 5 deletions.
    let mut files: Vec<_> = walkdir::WalkDir::new(&src)
        .into_iter()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_file())
        .map(|e| e.into_path())
        .collect();
    files.sort();
    for (i, f) in files.iter().step_by(200).take(10).enumerate() {
        let mut data = std::fs::read(f).unwrap();
        let at = data.len() / 3;
        data.splice(at..at, format!("// inserted line {i}\n").bytes());
        std::fs::write(f, data).unwrap();
    }
    for f in files.iter().skip(7).step_by(397).take(5) {
        std::fs::remove_file(f).unwrap();
    }
    for i in 0..5 {
        std::fs::write(
            src.join(format!("pkg00/new{i}.rs")),
            fixtures::text_bytes(8000, 900 + i),
        )
        .unwrap();
    }
    let second = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Workspace).unwrap();
    assert_ne!(first.id, second.id);
    let fraction = second.new_data_bytes as f64 / first.new_data_bytes as f64;
    eprintln!(
        "1% change: first build {} new bytes, second {} ({:.2}%), {}/{} chunks reused",
        first.new_data_bytes,
        second.new_data_bytes,
        fraction * 100.0,
        second.reused_chunks,
        second.chunks
    );
    assert!(
        fraction <= 0.05,
        "second build stored {:.2}% new data",
        fraction * 100.0
    );
}

#[test]
fn one_byte_inserted_at_the_start_of_100_mib_costs_under_2_mib() {
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let data = fixtures::random_bytes(100 << 20, 42);
    std::fs::write(src.join("blob.bin"), &data).unwrap();
    let (_sd, store) = temp_store();
    let first = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Workspace).unwrap();
    let mut edited = vec![0x5a];
    edited.extend_from_slice(&data);
    std::fs::write(src.join("blob.bin"), &edited).unwrap();
    let second = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Workspace).unwrap();
    eprintln!(
        "insertion: {} new bytes of {}",
        second.new_data_bytes, second.logical_bytes
    );
    assert_eq!(first.new_data_bytes, 100 << 20);
    assert!(
        second.new_data_bytes <= 2 << 20,
        "{} new bytes",
        second.new_data_bytes
    );
}

#[test]
fn a_corrupt_chunk_fails_verify_and_every_read_of_it() {
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("src");
    fixtures::workspace_tree(&src, 50, 3);
    let (sd, store) = temp_store();
    let r = build(&rt, &store, Source::Dir(src), LayerKind::Workspace).unwrap();
    let m = rt.block_on(store.get_layer(&r.id)).unwrap();
    let pack = m.packs[m.chunks[0].pack as usize];
    let path = sd
        .path()
        .join("store")
        .join(strata_store::Store::pack_key(&pack).to_string());
    let mut bytes = std::fs::read(&path).unwrap();
    let at = m.chunks[0].pack_offset as usize + 1;
    bytes[at] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();

    let v = rt.block_on(store.verify()).unwrap();
    assert!(!v.problems.is_empty());
    assert!(
        v.problems
            .iter()
            .any(|p| p.contains(&m.chunks[0].digest.to_hex()) && p.contains(&r.id.to_hex())),
        "{:?}",
        v.problems
    );
    let err = rt
        .block_on(store.read_chunk(&m, 0))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("corrupt") && err.contains(&m.chunks[0].digest.to_hex()),
        "{err}"
    );
    let out = tempfile::tempdir_in(scratch_root()).unwrap();
    let e = rt
        .block_on(strata_builder::export::export_layer(
            &store,
            &m,
            &out.path().join("x"),
            out.path(),
        ))
        .unwrap_err()
        .to_string();
    assert!(e.contains("corrupt"), "{e}");
}

fn assert_nothing_committed(rt: &tokio::runtime::Runtime, store: &strata_store::Store) {
    assert!(
        rt.block_on(store.list_layers()).unwrap().is_empty(),
        "a failed build left a layer"
    );
}

#[test]
fn bad_inputs_fail_clearly_and_commit_nothing() {
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let (_sd, store) = temp_store();

    let e = Source::parse(work.path().join("missing").to_str().unwrap()).unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");

    // A tar whose path escapes the root.
    let t = work.path().join("escape.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&t).unwrap());
        let mut h = header(1);
        h.as_gnu_mut().unwrap().name[..12].copy_from_slice(b"../evil.txt\0");
        h.set_cksum();
        b.append(&h, &b"x"[..]).unwrap();
        b.finish().unwrap();
    }
    let e = build(&rt, &store, Source::Tar(t), LayerKind::Base).unwrap_err();
    assert!(
        matches!(e, BuildError::BadEntry { .. }) && e.to_string().contains("evil.txt"),
        "{e}"
    );

    // A 256-byte name (GNU long name).
    let t = work.path().join("long.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&t).unwrap());
        let mut h = header(1);
        b.append_data(&mut h, "n".repeat(256), &b"x"[..]).unwrap();
        b.finish().unwrap();
    }
    let e = build(&rt, &store, Source::Tar(t), LayerKind::Base)
        .unwrap_err()
        .to_string();
    assert!(e.contains("256 bytes") && e.contains("255"), "{e}");

    // An entry type a layer cannot hold (a GNU volume label).
    let t = work.path().join("volume.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&t).unwrap());
        let mut h = header(0);
        h.set_entry_type(tar::EntryType::new(b'V'));
        b.append_data(&mut h, "label", &b""[..]).unwrap();
        b.finish().unwrap();
    }
    let e = build(&rt, &store, Source::Tar(t), LayerKind::Base)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unsupported tar entry") && e.contains("label"),
        "{e}"
    );

    // Not a tar at all.
    let t = work.path().join("garbage.tar");
    std::fs::write(&t, fixtures::random_bytes(10_000, 1)).unwrap();
    let e = build(&rt, &store, Source::Tar(t), LayerKind::Base)
        .unwrap_err()
        .to_string();
    assert!(e.contains("garbage.tar"), "{e}");

    // An OCI layout whose layer blob does not match its digest.
    let layout = work.path().join("oci");
    let layer = simple_tar(&[("etc/hostname", b"box\n")], &[]);
    write_oci_layout(&layout, &[layer]);
    let blob = std::fs::read_dir(layout.join("blobs/sha256"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| std::fs::read(p).unwrap().len() > 1024)
        .unwrap();
    let mut bytes = std::fs::read(&blob).unwrap();
    let n = bytes.len();
    bytes[n - 2000] ^= 1;
    std::fs::write(&blob, bytes).unwrap();
    let e = build(
        &rt,
        &store,
        Source::OciLayout {
            path: layout,
            reference: None,
        },
        LayerKind::Base,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("digest mismatch"), "{e}");

    assert_nothing_committed(&rt, &store);
}

#[test]
fn oci_layers_flatten_with_whiteouts_applied_or_kept_for_overlay() {
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let layout = work.path().join("oci");
    let lower = simple_tar(
        &[
            ("etc/keep", b"keep"),
            ("etc/gone", b"gone"),
            ("opt/app/old", b"old"),
            ("opt/app/sub/older", b"older"),
        ],
        &[],
    );
    let upper = simple_tar(
        &[("opt/app/new", b"new")],
        &[
            "etc/.wh.gone",
            "opt/app/.wh..wh..opq",
            "var/.wh.never-existed",
        ],
    );
    write_oci_layout(&layout, &[lower, upper]);
    let (_sd, store) = temp_store();
    for (kind, reference) in [
        (LayerKind::Base, None),
        (LayerKind::Toolkit, Some("latest".to_string())),
    ] {
        let r = build(
            &rt,
            &store,
            Source::OciLayout {
                path: layout.clone(),
                reference,
            },
            kind,
        )
        .unwrap();
        let files = fetch_layer(&rt, &store, &r.id);
        let fs = strata_builder::export::open_image(&files.meta, files.blob.as_deref()).unwrap();
        let mut names = Vec::new();
        for e in fs.walk_dir("/").unwrap() {
            let e = e.unwrap();
            names.push(String::from_utf8_lossy(e.dir_entry.path().as_bytes()).into_owned());
        }
        names.sort();
        let opaque = fs.xattrs("/opt/app").unwrap();
        match kind {
            LayerKind::Base => {
                assert_eq!(
                    names,
                    ["/etc", "/etc/keep", "/opt", "/opt/app", "/opt/app/new"]
                );
                assert!(opaque.is_empty());
            }
            _ => {
                assert_eq!(
                    names,
                    [
                        "/etc",
                        "/etc/gone",
                        "/etc/keep",
                        "/opt",
                        "/opt/app",
                        "/opt/app/new",
                        "/var",
                        "/var/never-existed"
                    ]
                );
                let wh = fs
                    .walk_dir("/etc")
                    .unwrap()
                    .map(|e| e.unwrap())
                    .find(|e| e.dir_entry.file_name() == b"gone")
                    .unwrap();
                assert_eq!(
                    wh.inode.device(),
                    Some((0, 0)),
                    "whiteout is a 0:0 character device"
                );
                assert_eq!(
                    opaque
                        .get(b"trusted.overlay.opaque".as_slice())
                        .map(Vec::as_slice),
                    Some(b"y".as_slice())
                );
            }
        }
    }
}

#[test]
fn git_revision_is_a_source() {
    if !have_tool("git_revision_is_a_source", "git") {
        return;
    }
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let repo = work.path().join("repo");
    fixtures::workspace_tree(&repo, 20, 11);
    sh(&format!(
        "cd '{}' && git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm one && git tag v1 && \
         echo changed > pkg00/mod00/file00000.rs && git -c user.name=t -c user.email=t@t commit -qam two",
        repo.display()
    ));
    let (_sd, store) = temp_store();
    let v1 = build(
        &rt,
        &store,
        Source::parse(&format!("git:{}@v1", repo.display())).unwrap(),
        LayerKind::Workspace,
    )
    .unwrap();
    let head = build(
        &rt,
        &store,
        Source::parse(&format!("git:{}", repo.display())).unwrap(),
        LayerKind::Workspace,
    )
    .unwrap();
    assert_ne!(v1.id, head.id);
    assert_eq!(v1.files, 20);
    let files = fetch_layer(&rt, &store, &head.id);
    let fs = strata_builder::export::open_image(&files.meta, files.blob.as_deref()).unwrap();
    let f = fs.open("/pkg00/mod00/file00000.rs").unwrap();
    let mut buf = vec![0u8; 64];
    let n = f.read_at(&mut buf, 0).unwrap();
    assert_eq!(&buf[..n], b"changed\n");
    let e = build(
        &rt,
        &store,
        Source::parse(&format!("git:{}@no-such-rev", repo.display())).unwrap(),
        LayerKind::Workspace,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("no-such-rev"), "{e}");
}
