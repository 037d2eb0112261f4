//! The runtime as the builder's step runner: `strata layer build` of a definition with `run`
//! steps runs them in a container sandbox over the input layers and hands the builder the
//! sandbox's upper to read.

use std::collections::BTreeMap;
use std::path::PathBuf;

use strata_builder::steps::{StepExit, StepPlan, StepRunner, StepSandbox};
use strata_builder::BuildError;
use strata_catalog::{Backend, Budgets, Catalog};
use strata_runtime::{base_env, local_identity};
use strata_runtime::{ExecRequest, Limits, NetRule, Runtime, Sandbox, SandboxSpec};
use strata_store::{Digest, Store};

/// Budgets of a build sandbox the definition leaves open: installs are bigger and slower
/// than agent commands.
fn build_defaults() -> Budgets {
    Budgets {
        memory: Some("2G".into()),
        cpus: None,
        disk: Some("8G".into()),
        pids: Some(4096),
        timeout: Some("30m".into()),
        idle_ttl: Some("2h".into()),
        auto_hibernate: None,
    }
}

fn sandbox_err(e: impl std::fmt::Display) -> BuildError {
    BuildError::Sandbox(e.to_string())
}

/// Resolves a definition's `from` (layer IDs or unique prefixes, catalog IDs, which stand
/// for their entry's whole stack, and a layer's `NAME@VERSION` where no entry has that ID)
/// to layer IDs, top-most first.
pub async fn resolve_inputs(store: &Store, from: &[String]) -> anyhow::Result<Vec<Digest>> {
    let mut inputs = Vec::new();
    // Opened once, on the first catalog ID: opening probes the store's conditional writes.
    let mut catalog = None;
    for reference in from {
        if reference.contains('/') {
            let opened = match catalog.take() {
                Some(c) => c,
                None => Catalog::open(store).await?,
            };
            let reg = opened.get(reference).await;
            catalog = Some(opened);
            let reg = match reg {
                Err(strata_catalog::CatalogError::NotFound(_)) if reference.contains('@') => {
                    let layer = store.resolve_layer(reference).await.map_err(|e| match e {
                        strata_store::StoreError::LayerNotFound(_) => anyhow::anyhow!(
                            "`{reference}` is neither a catalog entry nor a layer's NAME@VERSION"
                        ),
                        e => e.into(),
                    })?;
                    inputs.push(layer);
                    continue;
                }
                other => other?,
            };
            for layer in reg.entry.layers() {
                inputs.push(layer.parse::<Digest>().map_err(|e| {
                    anyhow::anyhow!("catalog entry {reference} names layer `{layer}`: {e}")
                })?);
            }
        } else {
            inputs.push(store.resolve_layer(reference).await?);
        }
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = inputs.iter().find(|d| !seen.insert(**d)) {
        anyhow::bail!("`from` names layer {dup} twice; list each input layer once");
    }
    Ok(inputs)
}

/// Where a build sandbox finds the host's CA bundle (under the runtime's own directory,
/// which never becomes part of the layer).
const CA_BUNDLE_PATH: &str = "/.strata/ca-certificates.crt";

pub struct RuntimeStepRunner {
    pub rt: Runtime,
    /// The host's CA bundle the steps trust (the `build_ca_bundle` setting:
    /// `STRATA_BUILD_CA_BUNDLE`, else `SSL_CERT_FILE`, else the system bundle; none: the
    /// base's own). A host behind an egress proxy that re-signs TLS trusts the proxy's CA
    /// there; the base layer does not.
    pub ca_bundle: Option<PathBuf>,
}

impl StepRunner for RuntimeStepRunner {
    fn start(&self, plan: &StepPlan) -> Result<Box<dyn StepSandbox>, BuildError> {
        let budgets: Budgets = toml::Value::Table(plan.budgets.clone())
            .try_into()
            .map_err(|e| BuildError::Definition(format!("[budgets]: {e}")))?;
        let limits = Limits::from_budgets(&build_defaults().overridden_by(&budgets))
            .map_err(|e| BuildError::Definition(format!("[budgets]: {e}")))?;
        let network = NetRule::parse_all(&plan.network)
            .map_err(|e| BuildError::Definition(format!("network: {e}")))?;
        let mut env = base_env();
        let ca_bundle = self.ca_bundle.clone();
        if ca_bundle.is_some() {
            for var in [
                "SSL_CERT_FILE",
                "PIP_CERT",
                "REQUESTS_CA_BUNDLE",
                "CURL_CA_BUNDLE",
                "GIT_SSL_CAINFO",
                "NODE_EXTRA_CA_CERTS",
            ] {
                env.insert(var.to_string(), CA_BUNDLE_PATH.to_string());
            }
        }
        env.extend(plan.env.clone());
        let spec = SandboxSpec {
            catalog_ref: format!("build:{}", plan.label),
            layers: plan.inputs.iter().map(|d| d.to_hex()).collect(),
            backend: Backend::Container,
            limits,
            env,
            workdir: "/".into(),
            user: "root".into(),
            network,
            commands: BTreeMap::new(),
            identity: format!("{} building {}", local_identity(), plan.label),
            display: false,
            disk_image: None,
            privileged: false,
            views: Vec::new(),
        };
        let sandbox = self.rt.create_owned(spec).map_err(sandbox_err)?;
        let step_sandbox = RuntimeStepSandbox {
            sandbox: Some(sandbox),
            workdir: plan.workdir.clone(),
        };
        if let Err(e) = step_sandbox.prepare(ca_bundle.as_deref(), &plan.workdir) {
            Box::new(step_sandbox).destroy()?;
            return Err(e);
        }
        Ok(Box::new(step_sandbox))
    }
}

struct RuntimeStepSandbox {
    sandbox: Option<Sandbox>,
    workdir: String,
}

impl RuntimeStepSandbox {
    /// Puts the host's CA bundle in place and makes the steps' working directory.
    fn prepare(
        &self,
        ca_bundle: Option<&std::path::Path>,
        workdir: &str,
    ) -> Result<(), BuildError> {
        if let Some(bundle) = ca_bundle {
            let pem = std::fs::read(bundle)
                .map_err(|e| sandbox_err(format!("reading CA bundle {}: {e}", bundle.display())))?;
            self.sandbox()?
                .write_file(CA_BUNDLE_PATH, &pem, 0o644)
                .map_err(sandbox_err)?;
        }
        if workdir != "/" {
            let made = self
                .sandbox()?
                .exec(&ExecRequest::argv(["mkdir", "-p", "--", workdir]))
                .map_err(sandbox_err)?;
            if !made.success() {
                return Err(BuildError::Definition(format!(
                    "workdir {workdir}: {}",
                    String::from_utf8_lossy(&made.stderr).trim()
                )));
            }
        }
        Ok(())
    }

    fn sandbox(&self) -> Result<&Sandbox, BuildError> {
        self.sandbox
            .as_ref()
            .ok_or_else(|| BuildError::Internal("build sandbox already destroyed".into()))
    }
}

impl StepSandbox for RuntimeStepSandbox {
    fn run(
        &mut self,
        command: &str,
        output: &mut dyn FnMut(&[u8]),
    ) -> Result<StepExit, BuildError> {
        let mut req = ExecRequest::shell(command);
        req.cwd = Some(self.workdir.clone());
        // Streamed to the build's log; the result keeps none of it.
        req.keep_output = Some(0);
        let result = self
            .sandbox()?
            .exec_streaming(&req, &mut |_, data| output(data))
            .map_err(sandbox_err)?;
        Ok(StepExit {
            status: result.status_code(),
            budget: result.budget.map(|b| b.to_string()),
        })
    }

    fn upper(&self) -> PathBuf {
        self.sandbox
            .as_ref()
            .map(Sandbox::upper_dir)
            .unwrap_or_default()
    }

    fn lowers(&self) -> Vec<PathBuf> {
        self.sandbox
            .as_ref()
            .map(Sandbox::layer_dirs)
            .unwrap_or_default()
    }

    fn runtime_paths(&self) -> Vec<String> {
        self.sandbox
            .as_ref()
            .map(Sandbox::runtime_written_paths)
            .unwrap_or_default()
    }

    fn destroy(mut self: Box<Self>) -> Result<(), BuildError> {
        match self.sandbox.take() {
            Some(s) => s.destroy().map_err(sandbox_err),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn from_names_a_layer_by_name_and_version_where_no_entry_has_that_id() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&strata_store::StoreUrl::Local(dir.path().join("store"))).unwrap();
        let src = dir.path().join("tree");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("tool"), b"a tool").unwrap();
        let built = strata_builder::build(
            &store,
            &strata_builder::BuildRequest {
                source: strata_builder::Source::Dir(src),
                kind: strata_builder::LayerKind::Toolkit,
                name: Some("toolkit/demo".into()),
                version: Some("1.0".into()),
                exclude: Vec::new(),
                prefix: None,
                source_label: None,
                provenance: Default::default(),
                registry: Default::default(),
            },
            None,
        )
        .await
        .unwrap();
        let got = resolve_inputs(&store, &["toolkit/demo@1.0".to_string()])
            .await
            .unwrap();
        assert_eq!(got, vec![built.id]);
        let err = resolve_inputs(&store, &["toolkit/demo@2.0".to_string()])
            .await
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("neither a catalog entry nor a layer"),
            "{err}"
        );
    }
}
