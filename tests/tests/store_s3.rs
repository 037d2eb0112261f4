//! The store on a real S3 server (Ceph radosgw on 127.0.0.1, started by the test):
//! builds, verify, gc, export, concurrent registrations, and removal of versions and layers.

use strata_builder::{LayerKind, Source};
use strata_store::{Store, StoreUrl};
use strata_tests::s3::S3Server;
use strata_tests::*;

#[test]
fn builds_verify_gc_and_export_against_radosgw() {
    let Some(server) = S3Server::start("builds_against_radosgw") else {
        return;
    };
    let rt = runtime();
    let store = Store::open(&StoreUrl::parse(&server.url).unwrap()).unwrap();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("ws");
    fixtures::workspace_tree(&src, 300, 21);
    let first = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Workspace).unwrap();
    assert!(first.uploaded_bytes > 0);
    let again = build(&rt, &store, Source::Dir(src.clone()), LayerKind::Workspace).unwrap();
    assert_eq!(
        (again.id, again.new_data_bytes, again.created),
        (first.id, 0, false)
    );

    // Read everything back through the store and compare with the source.
    let out = work.path().join("export");
    let m = rt.block_on(store.get_layer(&first.id)).unwrap();
    rt.block_on(strata_builder::export::export_layer(
        &store,
        &m,
        &out,
        work.path(),
    ))
    .unwrap();
    treecmp::assert_same_tree(
        &src,
        &out,
        treecmp::Ignore {
            root_meta: true,
            ..Default::default()
        },
    );

    let v = rt.block_on(store.verify()).unwrap();
    assert!(v.problems.is_empty(), "{:?}", v.problems);

    // An orphan pack (as a crashed build leaves) is collected; live data is not.
    let mut pb = strata_store::pack::PackBuilder::new();
    pb.push(&strata_store::chunk::encode(b"orphaned chunk"));
    let orphan = pb.finish();
    rt.block_on(store.put_pack(&orphan)).unwrap();
    let g = rt.block_on(store.gc(std::time::Duration::ZERO)).unwrap();
    assert_eq!(g.deleted_packs, 1);
    assert!(rt.block_on(store.read_pack(&orphan.id)).is_err());
    let v = rt.block_on(store.verify()).unwrap();
    assert!(v.problems.is_empty() && v.chunks > 0, "{:?}", v.problems);

    // The catalog refuses nothing here: radosgw honours conditional create, and 20
    // concurrent registrations all land.
    let conc = work.path().join("conc.toml");
    std::fs::write(
        &conc,
        format!("id = \"conc/entry\"\nbase = \"{}\"\n", first.id),
    )
    .unwrap();
    concurrent_registrations(&server.url, &conc);

    // The CLI talks to the same store by URL.
    let o = strata(&server.url, &["store", "stats", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["layers"], 1);

    // Retention on S3: the layer is refused while the entry's versions use it; once they
    // are all tombstoned, it goes and gc leaves nothing stored.
    let id = first.id.to_hex();
    let o = strata(&server.url, &["layer", "rm", &id]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("conc/entry@v"), "{err}");
    let o = strata(&server.url, &["catalog", "rm", "conc/entry"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 20);
    let o = strata(&server.url, &["layer", "rm", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = strata(&server.url, &["store", "gc", "--grace", "0s"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = strata(&server.url, &["store", "stats", "--json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (j["layers"].as_u64(), j["stored_bytes"].as_u64()),
        (Some(0), Some(0))
    );
}
