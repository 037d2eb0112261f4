//! `strata layer rm`: who still uses a layer (catalog versions not removed, and live
//! sandboxes of this host's runtime), the refusal that names them, and the removal.
//!
//! Sandboxes are found by reading the runtime's records
//! (`$STRATA_HOME/runtime/sandboxes/<id>/sandbox.json`) without opening the runtime, so
//! the check needs no root and reaps nothing. Sandboxes of other hosts sharing the store
//! are not seen.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{bail, Result};
use strata_catalog::Catalog;
use strata_runtime::process_start;
use strata_runtime::SandboxRecord;
use strata_store::{Digest, Store};

/// Removes the layers `ids` (full IDs or unique prefixes) unless a catalog version or a
/// live sandbox of the runtime at `runtime_dir` uses one of them; with `force`, removes them anyway and says who used them.
pub async fn remove(store: &Store, runtime_dir: &Path, ids: &[String], force: bool) -> Result<i32> {
    let mut layers = Vec::new();
    for text in ids {
        let id = store.resolve_layer(text).await?;
        if !layers.contains(&id) {
            layers.push(id);
        }
    }
    let mut users: BTreeMap<Digest, Vec<String>> =
        Catalog::open(store).await?.users_of(&layers).await?;
    let catalog_uses = !users.is_empty();
    let sandboxes = sandboxes_using(runtime_dir, &layers);
    let sandbox_uses = !sandboxes.is_empty();
    for (layer, names) in sandboxes {
        users.entry(layer).or_default().extend(names);
    }
    let lines: Vec<String> = users
        .iter()
        .map(|(layer, names)| format!("layer {layer} is used by {}", names.join(", ")))
        .collect();
    if !lines.is_empty() {
        if !force {
            let how = match (catalog_uses, sandbox_uses) {
                (true, true) => "strata catalog rm, strata sandbox rm",
                (true, false) => "strata catalog rm",
                _ => "strata sandbox rm",
            };
            bail!(
                "{}; remove those first ({how}) or pass --force",
                lines.join("; ")
            );
        }
        for line in &lines {
            eprintln!("warning: {line}; removing it anyway (--force)");
        }
    }
    let removed = store.remove_layers(&layers).await?;
    for id in &removed.layers {
        println!("removed layer {id}");
    }
    if removed.build_records > 0 {
        eprintln!(
            "dropped {} build-cache record(s) of the removed layers",
            removed.build_records
        );
    }
    eprintln!("their data stays until `strata store gc` finds nothing else references it");
    Ok(0)
}

/// For each of `layers` that a live sandbox under `runtime_dir` stacks, the sandboxes
/// (`sandbox ID (catalog reference)`). A record that cannot be read counts as a user of
/// every layer: what it stacks is unknown.
fn sandboxes_using(runtime_dir: &Path, layers: &[Digest]) -> BTreeMap<Digest, Vec<String>> {
    let wanted: BTreeSet<String> = layers.iter().map(Digest::to_hex).collect();
    let mut users: BTreeMap<Digest, Vec<String>> = BTreeMap::new();
    let Ok(dirs) = std::fs::read_dir(runtime_dir.join("sandboxes")) else {
        return users;
    };
    let mut dirs: Vec<_> = dirs.flatten().map(|e| e.path()).collect();
    dirs.sort();
    for dir in dirs {
        let path = dir.join("sandbox.json");
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Being created (no record yet) or gone meanwhile.
        if !path.exists() {
            continue;
        }
        let record = SandboxRecord::load(&path).map_err(|e| e.to_string());
        match record {
            Ok(r) if process_start(r.init_pid) != Some(r.init_start) => {}
            Ok(r) => {
                let label = if r.spec.catalog_ref.is_empty() {
                    format!("sandbox {}", r.id)
                } else {
                    format!("sandbox {} ({})", r.id, r.spec.catalog_ref)
                };
                for layer in &r.spec.layers {
                    if wanted.contains(layer) {
                        if let Ok(d) = layer.parse() {
                            users.entry(d).or_default().push(label.clone());
                        }
                    }
                }
            }
            Err(e) => {
                for layer in layers {
                    users.entry(*layer).or_default().push(format!(
                        "sandbox {name} (its record {} cannot be read: {e})",
                        path.display()
                    ));
                }
            }
        }
    }
    users
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_catalog::{Entry, Registered};
    use strata_runtime::{Overrides, SandboxSpec};

    /// Writes a sandbox record as the runtime does, from the runtime's own types.
    fn write_record(
        runtime_dir: &Path,
        id: &str,
        layers: [&str; 2],
        init_pid: u32,
        init_start: u64,
    ) {
        let text = format!(
            "id = \"demo/app\"\nbase = \"{}\"\nworkspace = \"{}\"\n",
            layers[1], layers[0]
        );
        let reg = Registered {
            entry: Entry::from_toml(&text, "test").unwrap(),
            version: "v3".into(),
            registered_at: 0,
            registered_by: "test".into(),
        };
        let record = SandboxRecord {
            format: strata_runtime::RECORD_FORMAT,
            id: id.into(),
            spec: SandboxSpec::resolve(&reg, &Overrides::default()).unwrap(),
            created_ms: 0,
            init_pid,
            init_start,
            owner: None,
        };
        let dir = runtime_dir.join("sandboxes").join(id);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("sandbox.json"),
            serde_json::to_vec(&record).unwrap(),
        )
        .unwrap();
    }

    #[test]
    fn live_sandboxes_on_this_host_are_named_as_users_and_dead_ones_are_not() {
        let tmp = tempfile::tempdir().unwrap();
        let rt = tmp.path();
        let (ws, base, other) = (Digest::of(b"ws"), Digest::of(b"base"), Digest::of(b"other"));
        let (ws_hex, base_hex) = (ws.to_hex(), base.to_hex());
        assert!(
            sandboxes_using(rt, &[ws]).is_empty(),
            "no runtime state at all"
        );

        // This test process stands in for the live sandbox's init.
        let me = std::process::id();
        let start = process_start(me).unwrap();
        write_record(rt, "live01", [&ws_hex, &base_hex], me, start);
        // A sandbox whose init died (its start time no longer matches): not live.
        write_record(rt, "dead01", [&ws_hex, &base_hex], me, start + 1);
        // A sandbox being created: a directory without a record yet.
        std::fs::create_dir_all(rt.join("sandboxes/new01")).unwrap();

        let users = sandboxes_using(rt, &[ws, other]);
        assert_eq!(
            users,
            BTreeMap::from([(ws, vec!["sandbox live01 (demo/app@v3)".to_string()])])
        );
        assert_eq!(sandboxes_using(rt, &[base]).len(), 1);

        // A record this binary cannot read might stack anything.
        std::fs::create_dir_all(rt.join("sandboxes/bad01")).unwrap();
        std::fs::write(rt.join("sandboxes/bad01/sandbox.json"), b"{\"id\": 7}").unwrap();
        let users = sandboxes_using(rt, &[other]);
        assert_eq!(users[&other].len(), 1);
        assert!(
            users[&other][0].starts_with("sandbox bad01 (its record"),
            "{users:?}"
        );
    }
}
