//! Every fuzz target over its seed corpus (`fuzz/corpus/<target>/`) and over every input
//! that once made it fail (`fuzz/regressions/<target>/`, kept as found): each returns. A
//! plain test, no fuzzer needed; `scripts/fuzz.sh` is the fuzzing.

use std::path::Path;

fn inputs(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Vec<u8>)> = entries
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| {
            let data = std::fs::read(e.path()).expect("reading an input");
            (e.path().display().to_string(), data)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn every_target_returns_on_its_corpus_and_past_failures() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (name, target) in strata_fuzz::TARGETS {
        let seeds = inputs(&root.join("corpus").join(name));
        assert!(!seeds.is_empty(), "target {name} has no seed corpus");
        for (path, data) in seeds
            .iter()
            .chain(inputs(&root.join("regressions").join(name)).iter())
        {
            eprintln!("{name}: {path}");
            target(data);
        }
    }
}

/// The seeds reach past the first checks: what they hold parses.
#[test]
fn the_seeds_are_well_formed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let frames = std::fs::read(root.join("agent_frame/exec")).expect("seed");
    let mut r = &frames[..];
    let mut n = 0;
    while let Some(f) =
        strata_agent_proto::read_frame::<strata_agent_proto::AgentMsg>(&mut r).expect("a frame")
    {
        let _ = f;
        n += 1;
    }
    assert_eq!(n, 5);
    let m: strata_store::LayerManifest =
        serde_json::from_slice(&std::fs::read(root.join("manifest/workspace")).expect("seed"))
            .expect("a manifest");
    m.validate().expect("a valid manifest");
    let toml = std::fs::read_to_string(root.join("catalog_entry/sample.toml")).expect("seed");
    strata_catalog::Entry::from_toml(&toml, "seed").expect("an entry");
}
