//! Retention: three versions of an entry registered, two removed from the catalog, their
//! layers removed, `store gc`: the store's stored bytes fall to what the remaining
//! version's layers reference (computed here from their manifests and the files on
//! disk), the remaining layer still exports intact, and `layer rm` of a layer a
//! registered entry uses is refused with the entry named. No root needed.

use std::collections::{BTreeSet, HashSet};
use std::path::Path;

use strata_builder::{LayerKind, Source};
use strata_tests::*;

/// What the layers left in a local store reference, read from the files themselves.
struct Referenced {
    layers: BTreeSet<String>,
    /// Names of the packs and metadata images.
    objects: BTreeSet<String>,
    /// Bytes of those packs and images.
    bytes: u64,
    /// Bytes of the chunks the layers use inside those packs, plus the images.
    used_bytes: u64,
}

fn referenced(store: &Path) -> Referenced {
    let size = |prefix: &str, hex: &str| {
        std::fs::metadata(store.join(prefix).join(&hex[..2]).join(hex))
            .unwrap_or_else(|e| panic!("{prefix}/{hex}: {e}"))
            .len()
    };
    let mut ids = BTreeSet::new();
    let (mut packs, mut metas, mut chunks) = (BTreeSet::new(), BTreeSet::new(), HashSet::new());
    let mut meta_bytes = 0;
    for e in std::fs::read_dir(store.join("layers")).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(id) = name.strip_suffix(".json").filter(|s| !s.contains('.')) else {
            continue;
        };
        ids.insert(id.to_string());
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(e.path()).unwrap()).unwrap();
        let layer_packs: Vec<String> = m["packs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap().to_string())
            .collect();
        let meta = m["metadata"]["digest"].as_str().unwrap().to_string();
        if metas.insert(meta.clone()) {
            meta_bytes += size("meta", &meta);
        }
        // [blob_offset, length, digest, pack_index, pack_offset, stored_length]
        for c in m["chunks"].as_array().unwrap() {
            let pack = &layer_packs[c[3].as_u64().unwrap() as usize];
            chunks.insert((pack.clone(), c[4].as_u64().unwrap(), c[5].as_u64().unwrap()));
        }
        packs.extend(layer_packs);
    }
    let pack_bytes: u64 = packs.iter().map(|p| size("packs", p)).sum();
    let chunk_bytes: u64 = chunks.iter().map(|(_, _, len)| len).sum();
    Referenced {
        layers: ids,
        objects: packs.into_iter().chain(metas).collect(),
        bytes: pack_bytes + meta_bytes,
        used_bytes: chunk_bytes + meta_bytes,
    }
}

/// Every object under `store/prefix`, by file name.
fn objects(store: &Path, prefix: &str) -> BTreeSet<String> {
    walkdir::WalkDir::new(store.join(prefix))
        .into_iter()
        .flatten()
        .filter(|e| e.file_type().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn removed_versions_and_layers_are_collected_and_used_layers_are_refused() {
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    // A private STRATA_HOME (no sandboxes in it) and store.
    let cli = strata_tests::home::CliHome::new("retention-");
    let store =
        strata_store::Store::open(&strata_store::StoreUrl::Local(cli.store.clone())).unwrap();

    // A shared base, and three versions of a workspace: each has files of its own, and
    // all share one set of files (so later versions reuse chunks of the first one's packs).
    let base_src = work.path().join("base");
    fixtures::workspace_tree(&base_src, 80, 1);
    std::fs::write(
        base_src.join("tool.bin"),
        fixtures::random_bytes(1 << 20, 2),
    )
    .unwrap();
    let base = build(&rt, &store, Source::Dir(base_src), LayerKind::Base)
        .unwrap()
        .id
        .to_hex();
    let mut sources = Vec::new();
    let mut workspaces = Vec::new();
    for v in 1..=3u64 {
        let src = work.path().join(format!("ws{v}"));
        fixtures::workspace_tree(&src.join("shared"), 60, 7);
        fixtures::workspace_tree(&src.join("own"), 60, 100 + v);
        std::fs::write(
            src.join("own/data.bin"),
            fixtures::random_bytes(3 << 19, 200 + v),
        )
        .unwrap();
        let r = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Workspace).unwrap();
        if v > 1 {
            assert!(r.reused_chunks > 0, "v{v} reuses the shared files' chunks");
        }
        workspaces.push(r.id.to_hex());
        sources.push(src);
    }
    for (v, ws) in workspaces.iter().enumerate() {
        let entry = work.path().join(format!("entry{v}.toml"));
        std::fs::write(
            &entry,
            format!("id = \"demo/app\"\nbase = \"{base}\"\nworkspace = \"{ws}\"\n"),
        )
        .unwrap();
        let reference = cli.ok(&["catalog", "register", entry.to_str().unwrap()]);
        assert_eq!(reference.trim(), format!("demo/app@v{}", v + 1));
    }
    let before = cli.json(&["store", "stats", "--json"])["stored_bytes"]
        .as_u64()
        .unwrap();

    // Two versions go. History keeps them; resolution does not.
    let out = cli.ok(&["catalog", "rm", "demo/app@v1", "demo/app@v2"]);
    assert_eq!(out, "removed demo/app@v1\nremoved demo/app@v2\n");
    let err = cli.refused(&["catalog", "show", "demo/app@v1"]);
    assert!(err.contains("demo/app@v1 was removed"), "{err}");
    assert_eq!(
        cli.json(&["catalog", "show", "demo/app", "--json"])["version"],
        "v3"
    );
    assert_eq!(cli.ok(&["catalog", "ls", "demo/"]).trim(), "demo/app");
    let h = cli.json(&["catalog", "history", "demo/app", "--json"]);
    let h: Vec<(String, String)> = h
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let f = |k: &str| r[k].as_str().unwrap().to_string();
            (f("version"), f("action"))
        })
        .collect();
    let expect = [("v1", "register"), ("v2", "register"), ("v3", "register")]
        .into_iter()
        .chain([("v1", "remove"), ("v2", "remove")]);
    assert_eq!(
        h,
        expect
            .map(|(v, a)| (v.to_string(), a.to_string()))
            .collect::<Vec<_>>()
    );

    // Layers a registered version uses are refused, naming it; the removed ones' go.
    for used in [&workspaces[2], &base] {
        let err = cli.refused(&["layer", "rm", &used[..12]]);
        assert!(
            err.contains(&format!("layer {used} is used by demo/app@v3"))
                && err.contains("strata catalog rm")
                && err.contains("--force"),
            "{err}"
        );
    }
    let err = cli.refused(&["layer", "rm", &workspaces[0], &workspaces[2]]);
    assert!(err.contains("demo/app@v3"), "{err}");
    assert!(
        objects(&cli.store, "layers").contains(&format!("{}.json", workspaces[0])),
        "a refused rm removes none of its layers"
    );
    let out = cli.ok(&["layer", "rm", &workspaces[0], &workspaces[1]]);
    assert_eq!(
        out,
        format!(
            "removed layer {}\nremoved layer {}\n",
            workspaces[0], workspaces[1]
        )
    );
    assert_eq!(
        cli.json(&["store", "stats", "--json"])["stored_bytes"],
        before,
        "removal alone frees nothing"
    );

    let gc = cli.json(&["store", "gc", "--grace", "0s", "--json"]);
    let after = cli.json(&["store", "stats", "--json"])["stored_bytes"]
        .as_u64()
        .unwrap();
    let kept = referenced(&cli.store);
    assert_eq!(
        kept.layers,
        BTreeSet::from([base.clone(), workspaces[2].clone()]),
        "the remaining version's layers"
    );
    assert_eq!(after, kept.bytes, "stored bytes: {before} -> {after}");
    assert_eq!(gc["kept_bytes"], after);
    assert_eq!(gc["deleted_bytes"], before - after);
    assert_eq!(gc["dead_bytes_in_live_packs"], kept.bytes - kept.used_bytes);
    assert!(after < before);
    eprintln!(
        "stored bytes: {before} with 3 versions, {after} after removing 2 and gc \
         ({} packs and {} images deleted; the remaining layers' chunks and images: {} \
         bytes, plus {} bytes of dead chunks in packs they share)",
        gc["deleted_packs"],
        gc["deleted_metadata"],
        kept.used_bytes,
        gc["dead_bytes_in_live_packs"]
    );
    // Nothing is left that no layer references, nor a record of a removed layer, and what
    // is left is intact.
    let on_disk: BTreeSet<String> = objects(&cli.store, "packs")
        .into_iter()
        .chain(objects(&cli.store, "meta"))
        .collect();
    assert_eq!(on_disk, kept.objects);
    for ws in &workspaces[..2] {
        assert!(
            !objects(&cli.store, "layers")
                .iter()
                .any(|n| n.starts_with(ws.as_str())),
            "records of {ws} are gone"
        );
    }
    cli.ok(&["store", "verify"]);
    let out = work.path().join("export");
    cli.ok(&["layer", "export", &workspaces[2], out.to_str().unwrap()]);
    treecmp::assert_same_tree(
        &sources[2],
        &out,
        treecmp::Ignore {
            root_meta: true,
            ..Default::default()
        },
    );

    // --force removes a used layer anyway, and says who used it.
    let o = cli.cli(&["layer", "rm", "--force", &workspaces[2]]);
    assert!(o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("demo/app@v3") && err.contains("--force"),
        "{err}"
    );
    cli.ok(&["catalog", "rm", "demo/app"]);
    assert_eq!(cli.ok(&["catalog", "ls"]), "");
    let err = cli.refused(&["catalog", "show", "demo/app"]);
    assert!(err.contains("no versions left"), "{err}");
    assert_eq!(
        cli.json(&["catalog", "history", "demo/app", "--json"])
            .as_array()
            .unwrap()
            .len(),
        6
    );
    cli.ok(&["store", "gc", "--grace", "0s"]);
    let kept = referenced(&cli.store);
    assert_eq!(kept.layers, BTreeSet::from([base]));
    assert_eq!(
        cli.json(&["store", "stats", "--json"])["stored_bytes"],
        kept.bytes
    );
}
