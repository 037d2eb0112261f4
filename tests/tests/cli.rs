//! The `strata` command line: the names, flags, JSON keys and exit codes other tools rely on.

use strata_tests::*;

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn layer_and_store_commands() {
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("ws");
    fixtures::workspace_tree(&src, 120, 5);
    let store = work.path().join("store");
    let store = store.to_str().unwrap();
    let src_s = src.to_str().unwrap();

    let o = strata(
        store,
        &[
            "layer",
            "build",
            "--kind",
            "workspace",
            "--name",
            "demo",
            "--version",
            "1",
            "--json",
            src_s,
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("one JSON object");
    for key in [
        "id",
        "files",
        "logical_bytes",
        "uploaded_bytes",
        "new_data_bytes",
        "chunks",
        "reused_chunks",
        "seconds",
    ] {
        assert!(j.get(key).is_some(), "--json lacks `{key}`: {j}");
    }
    assert_eq!(j["files"], 120);
    let id = j["id"].as_str().unwrap().to_string();

    // Text mode: the layer ID is the last line of stdout.
    let o = strata(store, &["layer", "build", "--kind", "workspace", src_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().last().unwrap(), id);

    let o = strata(store, &["layer", "inspect", &id[..12], "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(j["provenance"]["name"], "demo");
    assert_eq!(j["provenance"]["kind"], "workspace");

    let o = strata(store, &["layer", "ls"]);
    assert!(
        stdout(&o).contains(&id[..16]) && stdout(&o).contains("demo"),
        "{}",
        stdout(&o)
    );

    let o = strata(store, &["store", "stats", "--json"]);
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    for key in ["chunks", "stored_bytes", "logical_bytes", "dedup_ratio"] {
        assert!(j.get(key).is_some(), "stats lacks `{key}`: {j}");
    }

    let out = work.path().join("export");
    let o = strata(store, &["layer", "export", &id, out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    treecmp::assert_same_tree(
        &src,
        &out,
        treecmp::Ignore {
            root_meta: true,
            ..Default::default()
        },
    );

    let o = strata(store, &["store", "verify"]);
    assert!(o.status.success(), "{}", stderr(&o));

    // Corrupt one pack: verify fails and names the damage.
    let pack = walkdir::WalkDir::new(work.path().join("store/packs"))
        .into_iter()
        .filter_map(|e| e.ok())
        .find(|e| e.file_type().is_file())
        .unwrap()
        .into_path();
    let mut bytes = std::fs::read(&pack).unwrap();
    bytes[10] ^= 0x40;
    std::fs::write(&pack, bytes).unwrap();
    let o = strata(store, &["store", "verify"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("corrupt") && stderr(&o).contains(&id),
        "{}",
        stderr(&o)
    );

    // Bad input: a clear error naming the path, non-zero exit.
    let o = strata(store, &["layer", "build", "/no/such/tree"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/no/such/tree"), "{}", stderr(&o));
    let o = strata(store, &["layer", "inspect", "0123456789abcdef"]);
    assert!(
        !o.status.success() && stderr(&o).contains("not in the store"),
        "{}",
        stderr(&o)
    );
    let o = strata("s3://", &["store", "stats"]);
    assert!(
        !o.status.success() && stderr(&o).contains("bucket"),
        "{}",
        stderr(&o)
    );
}
