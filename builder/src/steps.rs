//! Step builds: a layer made of what shell commands changed over input layers, the way a
//! Dockerfile's `RUN` lines work but keeping only the changes, so the layer stacks on any
//! compatible base. The steps run in a sandbox the caller provides ([`StepRunner`]; the
//! runtime's container backend in the CLI); its overlayfs upper is then read as the layer
//! ([`crate::source::upper`]). A build cache keyed by the definition, the input layer IDs
//! and the step text skips the steps when the store already has their result.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use serde_json::json;
use strata_store::{Digest, Store};

use crate::source::upper::UpperFilter;
use crate::source::LayerDefinition;
use crate::{BuildError, BuildReport, BuildRequest, Progress, Source, WRITER_VERSION};

/// Build leftovers no layer wants: scratch space, package caches and indexes, logs (they
/// carry the build's time), per-user caches. `__pycache__` next to the inputs' Python
/// files is dropped by [`UpperFilter::drop_input_pycache`].
pub const DEFAULT_EXCLUDES: &[&str] = &[
    "tmp/*",
    "var/tmp/*",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/cache/ldconfig",
    "var/log",
    "root/.cache",
];

/// `SOURCE_DATE_EPOCH` the steps get unless the definition sets it (1980-01-01, the
/// earliest time zip accepts): Python's byte-compiler then writes hash-checked `.pyc`
/// files and other tools stop stamping the build time into what they write.
pub const SOURCE_DATE_EPOCH: &str = "315532800";

/// How much of each step's output the provenance record keeps (its end).
const LOG_TAIL: usize = 64 << 10;
/// How much of a failed step's output its error shows.
const ERROR_TAIL: usize = 8 << 10;

/// What the sandbox of a step build is made of.
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// Input layers, top-most first.
    pub inputs: Vec<Digest>,
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    /// Allowed destinations, HOST:PORT.
    pub network: Vec<String>,
    /// The definition's `[budgets]` table, for the runner to interpret.
    pub budgets: toml::Table,
    /// A name for the build in the runner's records.
    pub label: String,
}

/// How a step ended: the shell convention (exit code, or 128 + signal), and why when a
/// budget ended it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepExit {
    pub status: i32,
    pub budget: Option<String>,
}

/// Starts the sandboxes step builds run in.
pub trait StepRunner: Send + Sync {
    fn start(&self, plan: &StepPlan) -> Result<Box<dyn StepSandbox>, BuildError>;
}

/// A running build sandbox.
pub trait StepSandbox: Send {
    /// Runs one shell command line at the plan's workdir, streaming its combined output.
    fn run(&mut self, command: &str, output: &mut dyn FnMut(&[u8]))
        -> Result<StepExit, BuildError>;
    /// The overlayfs upper directory the steps wrote, readable while the sandbox lives.
    fn upper(&self) -> PathBuf;
    /// The input layers' roots, in plan order.
    fn lowers(&self) -> Vec<PathBuf>;
    /// Paths the sandbox machinery itself wrote into the upper (not the steps), left out.
    fn runtime_paths(&self) -> Vec<String>;
    fn destroy(self: Box<Self>) -> Result<(), BuildError>;
}

/// Receives build steps' output as it comes.
pub type StepOutput = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// Knobs of one step build.
#[derive(Clone, Default)]
pub struct StepOptions {
    /// Run the steps even when the build cache has their result.
    pub no_cache: bool,
    /// Receives every step's output as it comes.
    pub output: Option<StepOutput>,
    /// Progress of reading the result into a layer.
    pub progress: Option<Progress>,
}

/// One step in the provenance record.
#[derive(Debug, Clone, Serialize)]
pub struct StepRecord {
    pub command: String,
    pub exit_code: i32,
    pub budget: Option<String>,
    pub seconds: f64,
    /// The end of the step's output (at most 64 KiB).
    pub log: String,
}

/// Checks that `def` is a well-formed step build.
pub fn validate(def: &LayerDefinition) -> Result<(), BuildError> {
    let bad = |m: &str| Err(BuildError::Definition(m.to_string()));
    if def.source.is_some() {
        return bad("a definition has either a [source] table or `from` and `run` steps, not both");
    }
    if def.from.is_empty() {
        return bad(
            "`run` steps need `from`: the input layers (layer IDs or a catalog ID) they run over",
        );
    }
    if def.run.is_empty() {
        return bad("`from` needs at least one `run` step (a shell command)");
    }
    if def.prefix.is_some() {
        return bad(
            "`prefix` applies to [source] trees; step builds keep the paths the steps wrote",
        );
    }
    if let Some(w) = &def.workdir {
        if !w.starts_with('/') {
            return bad("`workdir` must be an absolute path");
        }
    }
    Ok(())
}

/// The build key: what the result of the steps depends on. Budgets are left out (they
/// change whether a build succeeds, not what it makes).
pub fn build_key(def: &LayerDefinition, inputs: &[Digest]) -> Digest {
    let canonical = json!({
        "writer": WRITER_VERSION,
        "kind": def.kind,
        "name": def.name,
        "version": def.version,
        "inputs": inputs,
        "run": def.run,
        "env": def.env,
        "workdir": def.workdir,
        "network": def.network,
        "capture": def.capture,
        "exclude": def.exclude,
        "default_excludes": def.default_excludes,
    });
    Digest(*blake3::hash(canonical.to_string().as_bytes()).as_bytes())
}

/// Builds the layer `def` describes over `inputs` (its `from`, resolved to layer IDs, top-most
/// first), or reuses the cached result.
pub async fn build_steps(
    store: &Store,
    def: &LayerDefinition,
    inputs: Vec<Digest>,
    runner: Arc<dyn StepRunner>,
    opts: StepOptions,
) -> Result<BuildReport, BuildError> {
    let started = Instant::now();
    validate(def)?;
    for id in &inputs {
        if !store.has_layer(id).await? {
            return Err(BuildError::Definition(format!(
                "input layer {id} is not in the store {}; build it first",
                store.describe()
            )));
        }
    }
    let key = build_key(def, &inputs);
    if !opts.no_cache {
        if let Some(id) = store.get_build_record(&key).await? {
            if store.has_layer(&id).await? {
                tracing::info!(build_key = %key, layer = %id, "build cache hit");
                return cached_report(store, id, key, started).await;
            }
        }
    }

    let mut env = def.env.clone();
    env.entry("SOURCE_DATE_EPOCH".into())
        .or_insert_with(|| SOURCE_DATE_EPOCH.into());
    let plan = StepPlan {
        inputs: inputs.clone(),
        env,
        workdir: def.workdir.clone().unwrap_or_else(|| "/".into()),
        network: def.network.clone(),
        budgets: def.budgets.clone().unwrap_or_default(),
        label: def.name.clone().unwrap_or_else(|| format!("build {key}")),
    };
    let sandbox = {
        let runner = runner.clone();
        tokio::task::spawn_blocking(move || runner.start(&plan))
            .await
            .map_err(|e| BuildError::Internal(format!("starting the build sandbox: {e}")))??
    };
    let (sandbox, outcome) = run_all(sandbox, def.run.clone(), opts.output.clone()).await;
    let result = match outcome {
        Ok(records) => make_layer(store, def, &inputs, key, sandbox.as_ref(), records, &opts).await,
        Err(e) => Err(e),
    };
    let destroyed = tokio::task::spawn_blocking(move || sandbox.destroy())
        .await
        .map_err(|e| BuildError::Internal(format!("destroying the build sandbox: {e}")))?;
    let mut report = result?;
    destroyed?;
    store.put_build_record(&key, &report.id).await?;
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Runs the steps in order, stopping at the first failure. Hands the sandbox back so it
/// is destroyed whatever happened.
async fn run_all(
    sandbox: Box<dyn StepSandbox>,
    steps: Vec<String>,
    output: Option<StepOutput>,
) -> (Box<dyn StepSandbox>, Result<Vec<StepRecord>, BuildError>) {
    let joined = tokio::task::spawn_blocking(move || {
        let mut sandbox = sandbox;
        let mut records = Vec::new();
        for (index, command) in steps.iter().enumerate() {
            tracing::info!(step = index + 1, %command, "running build step");
            if let Some(out) = &output {
                out(format!("==> step {}/{}: {command}\n", index + 1, steps.len()).as_bytes());
            }
            let started = Instant::now();
            let mut log = Vec::new();
            let exit = sandbox.run(command, &mut |data| {
                if let Some(out) = &output {
                    out(data);
                }
                log.extend_from_slice(data);
                if log.len() > 2 * LOG_TAIL {
                    log.drain(..log.len() - LOG_TAIL);
                }
            });
            let exit = match exit {
                Ok(e) => e,
                Err(e) => return (sandbox, Err(e)),
            };
            if exit.status != 0 {
                return (
                    sandbox,
                    Err(BuildError::StepFailed {
                        step: index + 1,
                        command: command.clone(),
                        status: exit.status,
                        budget: exit
                            .budget
                            .map(|b| format!(" (the {b} budget ended it)"))
                            .unwrap_or_default(),
                        output: tail_text(&log, ERROR_TAIL),
                    }),
                );
            }
            records.push(StepRecord {
                command: command.clone(),
                exit_code: exit.status,
                budget: exit.budget,
                seconds: started.elapsed().as_secs_f64(),
                log: tail_text(&log, LOG_TAIL),
            });
        }
        (sandbox, Ok(records))
    })
    .await;
    match joined {
        Ok(pair) => pair,
        // A panic is a bug here: carry it on. (The sandbox went down with the thread; the
        // runtime reaps sandboxes whose owner is gone.)
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

fn tail_text(bytes: &[u8], max: usize) -> String {
    let start = bytes.len().saturating_sub(max);
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

async fn make_layer(
    store: &Store,
    def: &LayerDefinition,
    inputs: &[Digest],
    key: Digest,
    sandbox: &dyn StepSandbox,
    records: Vec<StepRecord>,
    opts: &StepOptions,
) -> Result<BuildReport, BuildError> {
    let mut exclude = def.exclude.clone();
    if def.default_excludes {
        exclude.extend(DEFAULT_EXCLUDES.iter().map(|s| s.to_string()));
    }
    exclude.extend(sandbox.runtime_paths());
    let steps_run = records.len();
    let mut extra = serde_json::Map::new();
    extra.insert("build_key".into(), json!(key));
    extra.insert("from".into(), json!(def.from));
    extra.insert("inputs".into(), json!(inputs));
    extra.insert("env".into(), json!(def.env));
    extra.insert("workdir".into(), json!(def.workdir));
    extra.insert("network".into(), json!(def.network));
    extra.insert("steps".into(), json!(records));
    let req = BuildRequest {
        source: Source::Upper {
            dir: sandbox.upper(),
            filter: UpperFilter {
                lowers: sandbox.lowers(),
                capture: def.capture.clone(),
                drop_input_pycache: def.default_excludes,
            },
        },
        kind: def.kind,
        name: def.name.clone(),
        version: def.version.clone(),
        exclude,
        prefix: None,
        source_label: Some(format!("steps:{key}")),
        provenance: extra,
        // The upper is a local directory: nothing is pulled.
        registry: Default::default(),
    };
    let mut report = crate::build(store, &req, opts.progress.clone()).await?;
    report.build_key = Some(key);
    report.steps_run = steps_run;
    Ok(report)
}

async fn cached_report(
    store: &Store,
    id: Digest,
    key: Digest,
    started: Instant,
) -> Result<BuildReport, BuildError> {
    let m = store.get_layer(&id).await?;
    let chunks = m
        .chunks
        .iter()
        .map(|c| c.digest)
        .collect::<std::collections::HashSet<_>>()
        .len() as u64;
    Ok(BuildReport {
        id,
        files: m.files,
        logical_bytes: m.logical_bytes,
        uploaded_bytes: 0,
        new_data_bytes: 0,
        chunks,
        reused_chunks: chunks,
        metadata_bytes: m.metadata.size,
        blob_bytes: m.blob_size,
        created: false,
        seconds: started.elapsed().as_secs_f64(),
        cache_hit: true,
        build_key: Some(key),
        steps_run: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(text: &str) -> LayerDefinition {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn key_follows_steps_and_inputs_but_not_budgets() {
        let a = def("kind = \"toolkit\"\nfrom = [\"x\"]\nrun = [\"true\"]\n");
        let inputs = [Digest([1; 32])];
        let same = def(
            "kind = \"toolkit\"\nfrom = [\"x\"]\nrun = [\"true\"]\n[budgets]\nmemory = \"1G\"\n",
        );
        assert_eq!(build_key(&a, &inputs), build_key(&same, &inputs));
        let other_step = def("kind = \"toolkit\"\nfrom = [\"x\"]\nrun = [\"false\"]\n");
        assert_ne!(build_key(&a, &inputs), build_key(&other_step, &inputs));
        assert_ne!(build_key(&a, &inputs), build_key(&a, &[Digest([2; 32])]));
    }

    #[test]
    fn definitions_are_checked() {
        assert!(validate(&def(
            "kind = \"toolkit\"\nfrom = [\"x\"]\nrun = [\"true\"]\n"
        ))
        .is_ok());
        let no_run = validate(&def("kind = \"toolkit\"\nfrom = [\"x\"]\n")).unwrap_err();
        assert!(no_run.to_string().contains("run"));
        let no_from = validate(&def("kind = \"toolkit\"\nrun = [\"true\"]\n")).unwrap_err();
        assert!(no_from.to_string().contains("from"));
        let both =
            def("kind = \"toolkit\"\nfrom = [\"x\"]\nrun = [\"true\"]\n[source]\ndir = \"d\"\n");
        assert!(validate(&both)
            .unwrap_err()
            .to_string()
            .contains("not both"));
        let rel = def("kind = \"toolkit\"\nfrom = [\"x\"]\nrun = [\"true\"]\nworkdir = \"w\"\n");
        assert!(validate(&rel).is_err());
    }
}
