//! The `build` suite: layer build throughput from a warm page cache (against reading the same
//! bytes, and against mkfs.erofs on the same tree), rebuild cost after a 1 % change, and bytes
//! stored for several versions of one workspace against the same versions kept as full
//! compressed images.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result};
use strata_builder::{LayerKind, Source};
use strata_store::{Store, StoreUrl};
use strata_tests::fixtures;

use crate::report::{Row, Section};

const MB: f64 = 1_000_000.0;

fn read_all(root: &Path) -> Result<u64> {
    let mut total = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for e in walkdir::WalkDir::new(root) {
        let e = e?;
        if e.file_type().is_file() {
            let mut f = std::fs::File::open(e.path())?;
            loop {
                let n = std::io::Read::read(&mut f, &mut buf)?;
                if n == 0 {
                    break;
                }
                total += n as u64;
            }
        }
    }
    Ok(total)
}

fn build(
    rt: &tokio::runtime::Runtime,
    store: &Store,
    dir: &Path,
) -> Result<strata_builder::BuildReport> {
    Ok(strata_tests::build(
        rt,
        store,
        Source::Dir(dir.to_path_buf()),
        LayerKind::Workspace,
    )?)
}

/// Changes 1 % of the files under `root`: edits that insert bytes, additions, deletions.
fn change_one_percent(root: &Path, round: u64) -> Result<()> {
    let mut files: Vec<_> = walkdir::WalkDir::new(root)
        .into_iter()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_file() && e.path().extension().is_some_and(|x| x == "rs"))
        .map(|e| e.into_path())
        .collect();
    files.sort();
    let n = (files.len() / 100).max(3);
    for f in files
        .iter()
        .skip(round as usize)
        .step_by(files.len() / n)
        .take(n / 2)
    {
        let mut data = std::fs::read(f)?;
        let at = data.len() / 2;
        data.splice(at..at, format!("// edit {round}\n").bytes());
        std::fs::write(f, data)?;
    }
    for f in files
        .iter()
        .skip(round as usize + 3)
        .step_by(files.len() / n)
        .take(n / 4)
    {
        std::fs::remove_file(f)?;
    }
    for i in 0..n / 4 {
        std::fs::write(
            root.join(format!("pkg00/added-{round}-{i}.rs")),
            fixtures::text_bytes(6000, round * 100 + i as u64),
        )?;
    }
    Ok(())
}

fn zstd_tar_size(dir: &Path) -> Result<u64> {
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "tar -C '{}' -cf - . | zstd -3 -q -c | wc -c",
            dir.display()
        ))
        .output()?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .context("tar | zstd | wc")
}

pub fn run(rt: &tokio::runtime::Runtime, scratch: &Path) -> Result<Section> {
    let work = tempfile::tempdir_in(scratch)?;
    let corpus = work.path().join("corpus");
    fixtures::workspace_tree(&corpus, 3000, 1);
    std::fs::create_dir_all(corpus.join("assets"))?;
    for i in 0..4 {
        std::fs::write(
            corpus.join(format!("assets/blob{i}.bin")),
            fixtures::random_bytes(64 << 20, 100 + i),
        )?;
    }
    let mut rows = Vec::new();

    // Warm the page cache, then time a plain read of every byte: the ceiling.
    read_all(&corpus)?;
    let t = Instant::now();
    let bytes = read_all(&corpus)? as f64;
    let read_mbps = bytes / MB / t.elapsed().as_secs_f64();

    let store = Store::open(&StoreUrl::Local(work.path().join("store")))?;
    let r = build(rt, &store, &corpus)?;
    let build_mbps = r.logical_bytes as f64 / MB / r.seconds;
    rows.push(Row::new(
        "build throughput, cold store",
        "MB/s",
        build_mbps,
        "read every byte",
        read_mbps,
        "higher",
        &format!("{:.0} MB of file data, {} files", bytes / MB, r.files),
    ));

    let again = build(rt, &store, &corpus)?;
    rows.push(Row::new(
        "rebuild of an unchanged tree",
        "MB/s",
        again.logical_bytes as f64 / MB / again.seconds,
        "read every byte",
        read_mbps,
        "higher",
        "every chunk already stored",
    ));

    let mkfs = work.path().join("mkfs.img");
    let t = Instant::now();
    let ok = Command::new("mkfs.erofs")
        .arg("-T0")
        .arg(&mkfs)
        .arg(&corpus)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if ok {
        let mkfs_mbps = bytes / MB / t.elapsed().as_secs_f64();
        rows.push(Row::new(
            "build throughput, cold store",
            "MB/s",
            build_mbps,
            "mkfs.erofs 1.5 (local image, no dedup)",
            mkfs_mbps,
            "higher",
            "",
        ));
    }

    // Rebuild after a 1 % change.
    change_one_percent(&corpus, 1)?;
    let changed = build(rt, &store, &corpus)?;
    rows.push(Row::new(
        "new data after a 1% change",
        "MB",
        changed.new_data_bytes as f64 / MB,
        "full rebuild",
        r.new_data_bytes as f64 / MB,
        "lower",
        &format!(
            "target ≤ 5% of the first build: {:.2}%",
            100.0 * changed.new_data_bytes as f64 / r.new_data_bytes as f64
        ),
    ));

    // Five versions: stored bytes vs five zstd-compressed full images.
    let versions = work.path().join("versions-store");
    let vstore = Store::open(&StoreUrl::Local(versions))?;
    let mut full_images = 0u64;
    for v in 0..5 {
        if v > 0 {
            change_one_percent(&corpus, 10 + v)?;
        }
        build(rt, &vstore, &corpus)?;
        full_images += zstd_tar_size(&corpus)?;
    }
    let stats = rt.block_on(vstore.stats())?;
    rows.push(Row::new(
        "bytes stored for 5 versions",
        "MB",
        stats.stored_bytes as f64 / MB,
        "5 full images (tar | zstd -3)",
        full_images as f64 / MB,
        "lower",
        "",
    ));

    Ok(Section {
        name: "build".into(),
        description: "Layer builds of a synthetic workspace (3,000 source files plus four 64 MiB binaries, ~320 MB) from a warm page cache into a local store.".into(),
        rows,
    })
}
