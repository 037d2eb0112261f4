//! Step builds end to end through the CLI: the sample's pytest toolkit, built by pip in a
//! build step over the Debian base (datasets/toolkits/pytest/toolkit.toml), runs the
//! workspace's tests; the build cache and reproducibility across stores; whiteouts and
//! opaque directories of a step that deletes base files; a failing step leaves nothing.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;
use strata_tests::home::{can_run_sandboxes, CliHome};
use strata_tests::scratch_root;

struct Env {
    cli: CliHome,
    base: String,
    toolkit: String,
}

static ENV: OnceLock<Option<Env>> = OnceLock::new();

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn toolkit_def() -> String {
    repo()
        .join("datasets/toolkits/pytest/toolkit.toml")
        .display()
        .to_string()
}

/// One home with the sample registered (register.sh builds the toolkit by its steps).
fn env(test: &str) -> Option<&'static Env> {
    if !can_run_sandboxes(test) {
        return None;
    }
    ENV.get_or_init(|| {
        let cli = CliHome::new("steps-");
        cli.register_sample();
        let shown: Value =
            serde_json::from_str(&cli.ok(&["catalog", "show", "datasets/sample", "--json"]))
                .unwrap();
        let base = shown["entry"]["base"].as_str().unwrap().to_string();
        let toolkit = shown["entry"]["toolkits"][0].as_str().unwrap().to_string();
        Some(Env { cli, base, toolkit })
    })
    .as_ref()
}

/// The names in a directory, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// Writes a step-build definition over the base and returns its path.
fn definition(dir: &Path, name: &str, base: &str, steps: &[&str]) -> String {
    let run: Vec<String> = steps.iter().map(|s| format!("{s:?}")).collect();
    let text = format!(
        "kind = \"toolkit\"\nname = \"{name}\"\nfrom = [\"{base}\"]\nrun = [{}]\n",
        run.join(", ")
    );
    let path = dir.join(format!("{}.toml", name.replace('/', "-")));
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn register(cli: &CliHome, dir: &Path, id: &str, base: &str, toolkits: &[&str]) -> String {
    let toolkits: Vec<String> = toolkits.iter().map(|t| format!("{t:?}")).collect();
    let text = format!(
        "id = \"{id}\"\nbase = \"{base}\"\ntoolkits = [{}]\nbackend = \"container\"\n",
        toolkits.join(", ")
    );
    let path = dir.join(format!("{}.toml", id.replace('/', "-")));
    std::fs::write(&path, text).unwrap();
    cli.ok(&["catalog", "register", &path.display().to_string()])
        .lines()
        .last()
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn the_pip_built_toolkit_runs_the_workspace_tests() {
    let Some(env) = env("steps_toolkit_runs_tests") else {
        return;
    };
    let cli = &env.cli;
    let out = cli.ok(&["run", "datasets/sample", "--command", "test"]);
    assert!(out.contains("4 passed"), "{out}");
    let out = cli.ok(&[
        "run",
        "datasets/sample",
        "--",
        "python3",
        "-c",
        "import pytest; print(pytest.__file__, pytest.__version__)",
    ]);
    assert_eq!(
        out.trim(),
        "/opt/strata-toolkit/site-packages/pytest/__init__.py 8.3.4"
    );

    let inspected = json(&cli.ok(&["layer", "inspect", &env.toolkit, "--json"]));
    let prov = &inspected["provenance"];
    assert!(
        prov["source"].as_str().unwrap().starts_with("steps:"),
        "{prov}"
    );
    assert_eq!(prov["extra"]["inputs"], serde_json::json!([env.base]));
    let steps = prov["extra"]["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4, "{prov}");
    assert!(steps.iter().all(|s| s["exit_code"] == 0), "{prov}");
    assert!(
        steps[3]["log"].as_str().unwrap().contains("pytest 8.3.4"),
        "the provenance keeps step logs: {prov}"
    );

    // `capture` kept the toolkit's tree and the agent tools, and nothing else apt wrote.
    let scratch = tempfile::tempdir_in(scratch_root()).unwrap();
    let tree = scratch.path().join("tree");
    cli.ok(&["layer", "export", &env.toolkit, &tree.display().to_string()]);
    let names = |dir: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&tree), ["etc", "opt", "usr"]);
    assert_eq!(
        names(&tree.join("usr/bin")),
        ["patch", "rg", "vi", "vim.tiny"]
    );
    assert!(tree.join("opt/strata-toolkit/bin/pytest").is_file());
    let out = cli.ok(&[
        "run",
        "datasets/sample",
        "--",
        "sh",
        "-c",
        "rg --version | head -1; patch --version | head -1; test -x /usr/bin/vi && echo vi",
    ]);
    assert!(
        out.starts_with("ripgrep ") && out.contains("GNU patch") && out.ends_with("vi\n"),
        "{out}"
    );
}

#[test]
fn the_same_definition_hits_the_cache_and_rebuilds_to_the_same_layer() {
    let Some(env) = env("steps_cache_and_reproducibility") else {
        return;
    };
    let again = json(&env.cli.ok(&["layer", "build", &toolkit_def(), "--json"]));
    assert_eq!(again["cache_hit"], true, "{again}");
    assert_eq!(again["steps_run"], 0, "{again}");
    assert_eq!(again["id"], env.toolkit.as_str());

    let forced = json(
        &env.cli
            .ok(&["layer", "build", &toolkit_def(), "--no-cache", "--json"]),
    );
    assert_eq!(forced["cache_hit"], false, "{forced}");
    assert_eq!(forced["steps_run"], 4, "{forced}");
    assert_eq!(forced["id"], env.toolkit.as_str(), "a rerun of the steps");

    // Another machine state: a fresh home and store, the base built again from the same
    // tar, a later time, an empty cache: the same layer.
    let other = CliHome::new("steps-other-");
    let base = other
        .ok(&[
            "layer",
            "build",
            &repo()
                .join("datasets/base/debian.toml")
                .display()
                .to_string(),
        ])
        .lines()
        .last()
        .unwrap()
        .trim()
        .to_string();
    assert_eq!(base, env.base, "the base layer is reproducible");
    let scratch = tempfile::tempdir_in(scratch_root()).unwrap();
    register(&other, scratch.path(), "datasets/debian", &base, &[]);
    let fresh = json(&other.ok(&["layer", "build", &toolkit_def(), "--json"]));
    assert_eq!(fresh["cache_hit"], false, "{fresh}");
    assert_eq!(fresh["steps_run"], 4, "{fresh}");
    assert_eq!(fresh["id"], env.toolkit.as_str(), "same inputs, same layer");
}

#[test]
fn a_step_deleting_base_files_whiteouts_them_in_the_stack_only() {
    let Some(env) = env("steps_whiteouts") else {
        return;
    };
    let cli = &env.cli;
    let scratch = tempfile::tempdir_in(scratch_root()).unwrap();
    let def = definition(
        scratch.path(),
        "steps/deleter",
        &env.base,
        &[
            "rm /etc/issue.net",
            "rm -r /etc/apt/apt.conf.d && mkdir /etc/apt/apt.conf.d && echo new > /etc/apt/apt.conf.d/99new",
            "mkdir -p /opt/added && echo hi > /opt/added/file",
        ],
    );
    let layer = json(&cli.ok(&["layer", "build", &def, "--json"]));
    let layer = layer["id"].as_str().unwrap().to_string();

    let stacked = register(cli, scratch.path(), "steps/stacked", &env.base, &[&layer]);
    let out = cli.ok(&[
        "run",
        &stacked,
        "--",
        "sh",
        "-c",
        "test -e /etc/debian_version && ! test -e /etc/issue.net && ls -A /etc/apt/apt.conf.d \
         && cat /opt/added/file",
    ]);
    assert_eq!(
        out, "99new\nhi\n",
        "base file gone, replaced directory opaque"
    );

    // Alone (no shell to run): look at the sandbox's root from the host.
    let alone = register(cli, scratch.path(), "steps/alone", &layer, &[]);
    let id = cli
        .ok(&["sandbox", "create", &alone])
        .lines()
        .last()
        .unwrap()
        .trim()
        .to_string();
    let _remove = RemoveOnDrop(cli, id.clone());
    let root = cli.runtime_dir().join("sandboxes").join(&id).join("rootfs");
    let etc = names(&root.join("etc"));
    assert!(
        !etc.contains(&"issue.net".to_string()),
        "the whiteout shows as a file: {etc:?}"
    );
    assert_eq!(
        names(&root.join("etc/apt/apt.conf.d")),
        vec!["99new".to_string()]
    );
    assert_eq!(
        std::fs::read_to_string(root.join("opt/added/file")).unwrap(),
        "hi\n"
    );
}

/// Destroys a sandbox when the test ends, whether its assertions held or not.
struct RemoveOnDrop<'a>(&'a CliHome, String);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.cli(&["sandbox", "rm", &self.1]);
    }
}

#[test]
fn a_failing_step_fails_the_build_and_leaves_nothing() {
    let Some(env) = env("steps_failing") else {
        return;
    };
    let cli = &env.cli;
    let scratch = tempfile::tempdir_in(scratch_root()).unwrap();
    let def = definition(
        scratch.path(),
        "steps/failing",
        &env.base,
        &[
            "echo made > /made",
            "echo marker-output; echo marker-error >&2; exit 3",
            "echo never-run",
        ],
    );
    let o = cli.cli(&["layer", "build", &def]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(
        stderr.contains("step 2") && stderr.contains("status 3"),
        "{stderr}"
    );
    assert!(
        stderr.contains("marker-output") && stderr.contains("marker-error"),
        "{stderr}"
    );
    assert!(!stderr.contains("never-run"), "{stderr}");

    let layers = json(&cli.ok(&["layer", "ls", "--json"]));
    assert!(
        !layers
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l["name"] == "steps/failing"),
        "a failed build stored a layer: {layers}"
    );
    // The build's sandbox, found by its audit record, is gone without a trace.
    let rt = cli.runtime_dir();
    let audits: Vec<PathBuf> = std::fs::read_dir(rt.join("audit"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| std::fs::read_to_string(p).is_ok_and(|t| t.contains("\"build:steps/failing\"")))
        .collect();
    assert_eq!(audits.len(), 1, "one build sandbox: {audits:?}");
    let id = audits[0]
        .file_stem()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let audit = std::fs::read_to_string(&audits[0]).unwrap();
    assert!(audit.contains("\"ended\""), "{audit}");
    cli.assert_sandbox_gone(&id, &[]);
}
