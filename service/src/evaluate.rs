//! Evaluation: an entry's grading command run over what an agent did, where the agent's
//! doings cannot reach the grader. The agent's sandbox's changes are committed as a layer
//! (whatever it changed under the entry's protected paths or the evaluator's mount is
//! dropped); a fresh sandbox is made of the entry's own stack with that layer on top, the
//! protected paths mounted read-only from the entry's layers and the evaluator's layer
//! read-only at its mount (the agent's sandbox never had it); the grading command, from
//! the registered entry, runs there; the fresh sandbox is destroyed. The agent's sandbox is
//! left as it was, and its audit records the grade and which files the agent changed
//! (those under protected paths marked: the agent tried to change what grades it).
//!
//! Used by the node service and by the embedded CLI alike; the caller admits the
//! evaluation's sandbox and owns it while it runs.

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::time::Instant;

use serde::Serialize;
use serde_json::json;
use strata_builder::source::upper::layer_entry;
use strata_builder::LayerKind;
use strata_catalog::{Backend, Catalog};
use strata_runtime::{
    Changes, ExecRequest, Overrides, ReadonlyView, Runtime, Sandbox, SandboxSpec,
};
use strata_store::{Digest, Store};

use crate::ServiceError;

/// The most changed paths an evaluation lists (the count goes on).
pub const MAX_LISTED_CHANGES: usize = 10_000;
/// The most changed paths the agent sandbox's audit record lists.
const MAX_AUDITED_CHANGES: usize = 1_000;

/// How to evaluate (what with is a [`Grading`]).
#[derive(Debug, Clone)]
pub struct EvaluateRequest {
    /// The evaluation sandbox's backend ([`Grading::backend`]).
    pub backend: Backend,
    /// Who asked (the commit's registrant, the audit's `by`).
    pub identity: String,
    /// How much of each output stream the result keeps.
    pub keep_output: usize,
}

/// How a path differs from the agent's layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Change {
    Added,
    Modified,
    Deleted,
    /// A directory whose lower contents the agent removed and made anew (opaque).
    Replaced,
}

impl Change {
    pub fn as_str(&self) -> &'static str {
        match self {
            Change::Added => "added",
            Change::Modified => "modified",
            Change::Deleted => "deleted",
            Change::Replaced => "replaced",
        }
    }
}

impl std::str::FromStr for Change {
    type Err = String;
    fn from_str(s: &str) -> Result<Change, String> {
        match s {
            "added" => Ok(Change::Added),
            "modified" => Ok(Change::Modified),
            "deleted" => Ok(Change::Deleted),
            "replaced" => Ok(Change::Replaced),
            other => Err(format!("unknown change `{other}`")),
        }
    }
}

/// One path the agent changed. Field names are part of `strata sandbox evaluate --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ChangedPath {
    pub path: String,
    pub change: Change,
    /// Under a protected path or the evaluator's mount: dropped before grading.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub protected: bool,
}

/// An evaluation's outcome. Field names are part of `strata sandbox evaluate --json`.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Evaluation {
    /// The command's name and its line in the entry.
    pub command: String,
    pub line: String,
    /// The grading command's status (shell convention: 128 + a signal).
    pub exit_code: i32,
    /// The budget that ended it, if one did.
    pub budget: Option<String>,
    pub stdout: String,
    pub stderr: String,
    pub truncated: bool,
    /// The layer of the agent's changes the grade ran over.
    pub layer: Digest,
    pub backend: String,
    /// The evaluation sandbox (destroyed; its audit stays).
    pub sandbox: String,
    pub evaluator_layer: Option<String>,
    pub protected: Vec<String>,
    /// What the agent changed, at most [`MAX_LISTED_CHANGES`] paths.
    pub changed: Vec<ChangedPath>,
    pub changed_total: u64,
    pub seconds: f64,
}

/// Runs `grading`'s command over `agent`'s changes (see the module's comment). A grading
/// command that fails is a result, not an error.
pub async fn evaluate(
    store: &Store,
    rt: &Runtime,
    agent: &Sandbox,
    grading: &Grading,
    req: &EvaluateRequest,
) -> Result<Evaluation, ServiceError> {
    let t = Instant::now();
    let entry = &grading.reg.entry;
    let (protected, grader) = match entry.evaluator.clone() {
        Some(e) => (e.protect, e.layer.map(|layer| (layer, e.mount))),
        None => (Vec::new(), None),
    };
    // What the grade must not take from the agent: its changes there are not committed.
    let dropped: Vec<String> = protected
        .iter()
        .chain(grader.as_ref().map(|(_, at)| at))
        .cloned()
        .collect();
    let exclude: Vec<String> = dropped
        .iter()
        .map(|p| glob::Pattern::escape(p.trim_start_matches('/')))
        .collect();
    let (committed, (changed, changed_total)) = crate::commit::commit_inspecting(
        store,
        agent,
        &crate::commit::CommitRequest {
            kind: LayerKind::Toolkit,
            register: None,
            registrant: req.identity.clone(),
        },
        &exclude,
        move |changes| changed_paths(changes, &dropped, MAX_LISTED_CHANGES),
    )
    .await?;

    let mut views: Vec<ReadonlyView> = protected
        .iter()
        .map(|p| ReadonlyView {
            layers: entry.layers().into_iter().map(str::to_string).collect(),
            from: p.clone(),
            at: p.clone(),
        })
        .collect();
    views.extend(grader.as_ref().map(|(layer, at)| ReadonlyView {
        layers: vec![layer.clone()],
        from: "/".into(),
        at: at.clone(),
    }));
    let over = Overrides {
        backend: Some(req.backend),
        identity: Some(req.identity.clone()),
        ..Default::default()
    };
    let mut spec = SandboxSpec::resolve(&grading.reg, &over)?;
    spec.layers.insert(0, committed.layer.to_string());
    spec.views = views;

    let rt2 = rt.clone();
    let exec = ExecRequest {
        keep_output: Some(req.keep_output),
        ..ExecRequest::shell(&grading.line)
    };
    let (sandbox, result) = crate::blocking(move || {
        let sb = rt2.create_owned(spec)?;
        let id = sb.id().to_string();
        let result = sb.exec(&exec);
        let ended = sb.destroy();
        let result = result?;
        ended?;
        Ok((id, result))
    })
    .await?;
    let out = Evaluation {
        command: grading.command.clone(),
        line: grading.line.clone(),
        exit_code: result.status_code(),
        budget: result.budget.map(|b| b.to_string()),
        stdout: String::from_utf8_lossy(&result.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&result.stderr).into_owned(),
        truncated: result.truncated,
        layer: committed.layer,
        backend: req.backend.as_str().to_string(),
        sandbox,
        evaluator_layer: grader.map(|(layer, _)| layer),
        protected,
        changed,
        changed_total,
        seconds: t.elapsed().as_secs_f64(),
    };
    let tampered: Vec<&str> = out
        .changed
        .iter()
        .filter(|c| c.protected)
        .map(|c| c.path.as_str())
        .take(MAX_AUDITED_CHANGES)
        .collect();
    let _ = agent.audit().record(
        "evaluated",
        json!({"command": out.command, "exit_code": out.exit_code, "budget": out.budget,
               "layer": out.layer, "sandbox": out.sandbox, "backend": out.backend,
               "changed": out.changed.iter().take(MAX_AUDITED_CHANGES).collect::<Vec<_>>(),
               "changed_total": out.changed_total, "protected_changes": tampered,
               "by": req.identity}),
    );
    Ok(out)
}

/// What an evaluation grades with: the agent sandbox's registered entry and the command
/// of it to run. Found before anything is made or admitted, so a request that cannot be
/// graded is refused as such.
pub struct Grading {
    reg: std::sync::Arc<strata_catalog::Registered>,
    command: String,
    line: String,
}

impl Grading {
    /// The command `command` of the entry `catalog_ref` sandbox `id` was started from.
    pub async fn of(
        catalog: &Catalog,
        catalog_ref: &str,
        id: &str,
        command: &str,
    ) -> Result<Grading, ServiceError> {
        if catalog_ref.is_empty() {
            return Err(ServiceError::invalid(
                "id",
                format!(
                    "sandbox {id} was not started from a catalog entry: no entry names its grading commands"
                ),
            ));
        }
        let reg = catalog.get(catalog_ref).await?;
        let line = reg.entry.commands.get(command).cloned().ok_or_else(|| {
            ServiceError::invalid(
                "command",
                format!(
                    "{catalog_ref} has no command `{command}` (it has: {})",
                    names(&reg.entry.commands)
                ),
            )
        })?;
        Ok(Grading {
            reg,
            command: command.to_string(),
            line,
        })
    }

    /// The evaluation sandbox's backend: `requested`, else the agent's.
    pub fn backend(&self, agent: Backend, requested: Option<Backend>) -> Backend {
        requested.unwrap_or(agent)
    }
}

fn names(commands: &BTreeMap<String, String>) -> String {
    if commands.is_empty() {
        "none".into()
    } else {
        commands.keys().cloned().collect::<Vec<_>>().join(", ")
    }
}

/// The paths the sandbox changed over its layers, read from its upper (never following a
/// link), runtime-written paths left out; at most `max` listed, all counted. A path under
/// one of `dropped` is marked protected.
pub fn changed_paths(changes: &Changes, dropped: &[String], max: usize) -> (Vec<ChangedPath>, u64) {
    let mut listed = Vec::new();
    let mut total = 0u64;
    let runtime: Vec<&str> = changes.runtime_paths.iter().map(String::as_str).collect();
    let under = |rel: &str, roots: &[&str]| {
        roots.iter().any(|r| {
            rel == *r
                || rel
                    .strip_prefix(r)
                    .is_some_and(|rest| rest.starts_with('/'))
        })
    };
    let drops: Vec<&str> = dropped.iter().map(|d| d.trim_start_matches('/')).collect();
    let in_lowers = |rel: &str| changes.lowers.iter().any(|l| layer_entry(l, rel).is_some());
    let walk = walkdir::WalkDir::new(&changes.upper)
        .follow_links(false)
        .min_depth(1)
        .sort_by_file_name();
    for entry in walk.into_iter().flatten() {
        let Ok(rel) = entry.path().strip_prefix(&changes.upper) else {
            continue;
        };
        let rel = rel.to_string_lossy().into_owned();
        if under(&rel, &runtime) {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        let change = if meta.file_type().is_char_device() && meta.rdev() == 0 {
            Change::Deleted
        } else if meta.is_dir() {
            if opaque(entry.path()) {
                Change::Replaced
            } else if in_lowers(&rel) {
                // A directory the overlay copied up to hold a change below: not itself one.
                continue;
            } else {
                Change::Added
            }
        } else if in_lowers(&rel) {
            Change::Modified
        } else {
            Change::Added
        };
        total += 1;
        if listed.len() < max {
            listed.push(ChangedPath {
                protected: under(&rel, &drops),
                path: format!("/{rel}"),
                change,
            });
        }
    }
    (listed, total)
}

/// Whether the upper directory `dir` hides its lower contents (overlayfs's opaque mark).
fn opaque(dir: &Path) -> bool {
    ["trusted.overlay.opaque", "user.overlay.opaque"]
        .iter()
        .any(|name| matches!(xattr::get(dir, name), Ok(Some(v)) if v == b"y"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_told_apart_and_protected_ones_marked() {
        let upper = tempfile::tempdir().unwrap();
        let lower = tempfile::tempdir().unwrap();
        let u = upper.path();
        std::fs::create_dir_all(lower.path().join("work/tests")).unwrap();
        std::fs::write(lower.path().join("work/tests/test_a.py"), "x").unwrap();
        std::fs::write(lower.path().join("work/app.py"), "x").unwrap();
        std::fs::create_dir_all(u.join("work/tests")).unwrap();
        std::fs::write(u.join("work/tests/test_a.py"), "pass").unwrap();
        std::fs::write(u.join("work/app.py"), "y").unwrap();
        std::fs::write(u.join("work/new.py"), "z").unwrap();
        std::fs::create_dir_all(u.join("etc")).unwrap();
        std::fs::write(u.join("etc/hosts"), "runtime's").unwrap();
        let changes = Changes::of_dir(
            u,
            vec![lower.path().to_path_buf()],
            vec!["etc/hosts".into()],
        );
        let (listed, total) = changed_paths(&changes, &["/work/tests".into()], 10);
        let got: Vec<(&str, Change, bool)> = listed
            .iter()
            .map(|c| (c.path.as_str(), c.change, c.protected))
            .collect();
        assert_eq!(
            got,
            vec![
                ("/etc", Change::Added, false),
                ("/work/app.py", Change::Modified, false),
                ("/work/new.py", Change::Added, false),
                ("/work/tests/test_a.py", Change::Modified, true),
            ]
        );
        assert_eq!(total, 4);
        let (listed, total) = changed_paths(&changes, &[], 2);
        assert_eq!((listed.len(), total), (2, 4));
        // A link in a layer is not followed on the host: `etc` pointing at the host's /etc
        // does not make the host's /etc/hostname a file of the layer.
        let linked = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc", linked.path().join("etc")).unwrap();
        assert!(layer_entry(linked.path(), "etc/hostname").is_none());
        assert!(layer_entry(lower.path(), "work/app.py").is_some());
        assert!(layer_entry(linked.path(), "etc").is_some());
    }
}
