//! The catalog: register, resolve latest and pinned versions, refuse missing layers and
//! duplicate versions, and keep every one of 20 concurrent registrations.

use strata_builder::{LayerKind, Source};
use strata_tests::*;

#[test]
fn register_show_history_and_concurrent_writers_on_a_local_store() {
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let store_dir = work.path().join("store");
    let store_url = store_dir.to_str().unwrap();
    let store =
        strata_store::Store::open(&strata_store::StoreUrl::Local(store_dir.clone())).unwrap();
    let src = work.path().join("base");
    fixtures::workspace_tree(&src, 10, 1);
    let base = build(&rt, &store, Source::Dir(src), LayerKind::Base)
        .unwrap()
        .id
        .to_hex();

    let entry = work.path().join("entry.toml");
    std::fs::write(
        &entry,
        format!(
            "id = \"demo/hello\"\nbase = \"{}\"\nworkdir = \"/work\"\n[budgets]\nmemory = \"512M\"\ntimeout = \"60s\"\n[commands]\ntest = \"true\"\n",
            &base[..12]
        ),
    )
    .unwrap();
    let o = strata(store_url, &["catalog", "register", entry.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "demo/hello@v1");
    let o = strata(store_url, &["catalog", "register", entry.to_str().unwrap()]);
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "demo/hello@v2");

    let o = strata(store_url, &["catalog", "show", "demo/hello", "--json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["version"], "v2");
    assert_eq!(
        j["entry"]["base"], base,
        "a layer prefix is stored as the full ID"
    );
    let o = strata(store_url, &["catalog", "show", "demo/hello@v1", "--json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["version"], "v1");
    let o = strata(store_url, &["catalog", "ls", "demo/"]);
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "demo/hello");

    // Pinned versions are immutable; missing layers are named.
    let pinned = work.path().join("pinned.toml");
    std::fs::write(
        &pinned,
        std::fs::read_to_string(&entry)
            .unwrap()
            .replace("workdir", "version = \"v1\"\nworkdir"),
    )
    .unwrap();
    let o = strata(
        store_url,
        &["catalog", "register", pinned.to_str().unwrap()],
    );
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("already registered")
    );
    let missing = work.path().join("missing.toml");
    let ghost = "ab".repeat(32);
    std::fs::write(
        &missing,
        format!("id = \"demo/ghost\"\nbase = \"{ghost}\"\n"),
    )
    .unwrap();
    let o = strata(
        store_url,
        &["catalog", "register", missing.to_str().unwrap()],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains(&ghost) && err.contains("not in the store"),
        "{err}"
    );
    let o = strata(store_url, &["catalog", "show", "demo/ghost"]);
    assert!(!o.status.success());

    let conc = work.path().join("conc.toml");
    std::fs::write(&conc, format!("id = \"conc/entry\"\nbase = \"{base}\"\n")).unwrap();
    concurrent_registrations(store_url, &conc);
}

/// An entry names its layers by `NAME@VERSION` (what `layer build --name --version` put
/// in their provenance) instead of copied IDs; registration stores the full IDs, and a name
/// no layer has is refused by name.
#[test]
fn an_entry_names_its_layers_by_name_and_version() {
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let store_url = work.path().join("store");
    let store_url = store_url.to_str().unwrap();
    let build = |tree: &str, name: &str, version: &str| {
        let src = work.path().join(tree);
        fixtures::workspace_tree(&src, 5, 1);
        // Content of its own: a layer is its content, and its first build names it.
        std::fs::write(src.join("which"), tree).unwrap();
        let o = strata(
            store_url,
            &[
                "layer",
                "build",
                src.to_str().unwrap(),
                "--name",
                name,
                "--version",
                version,
            ],
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .last()
            .unwrap()
            .to_string()
    };
    let base = build("os", "os/bookworm", "12");
    let tools = build("tools", "toolkit/pytest", "8.3.4");
    let entry = work.path().join("entry.toml");
    std::fs::write(
        &entry,
        "id = \"demo/named\"\nbase = \"os/bookworm@12\"\ntoolkits = [\"toolkit/pytest@8.3.4\"]\n",
    )
    .unwrap();
    let o = strata(store_url, &["catalog", "register", entry.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = strata(store_url, &["catalog", "show", "demo/named", "--json"]);
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["entry"]["base"], base.as_str());
    assert_eq!(j["entry"]["toolkits"][0], tools.as_str());
    // Shown to people: a date, not seconds since 1970.
    let o = strata(store_url, &["catalog", "show", "demo/named"]);
    let shown = String::from_utf8_lossy(&o.stdout);
    let line = shown.lines().find(|l| l.starts_with("registered")).unwrap();
    assert!(line.contains(" UTC (") && line.contains(" ago)"), "{line}");

    std::fs::write(&entry, "id = \"demo/named\"\nbase = \"os/bookworm@13\"\n").unwrap();
    let o = strata(store_url, &["catalog", "register", entry.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("os/bookworm@13"),
        "{err}"
    );
}
