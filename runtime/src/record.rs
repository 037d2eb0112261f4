//! What the runtime keeps about a live sandbox (`sandboxes/<id>/sandbox.json`), with its
//! format version: a record of an older format is read as it is, one of a newer format
//! is refused with what to do, never misread.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::spec::SandboxSpec;
use crate::RuntimeError;

/// The record format this build writes. 1: the first versioned one (the unversioned
/// records before it have the same fields and read as format 0).
pub const RECORD_FORMAT: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// The format version (see [`RECORD_FORMAT`]).
    #[serde(default)]
    pub format: u32,
    pub id: String,
    pub spec: SandboxSpec,
    pub created_ms: u64,
    /// Host PID of the sandbox's init, and its start time (guards against PID reuse).
    pub init_pid: u32,
    pub init_start: u64,
    /// For a one-shot sandbox (`strata run`): the process that owns it. When that process
    /// dies without destroying it, the next reap does.
    #[serde(default)]
    pub owner: Option<(u32, u64)>,
}

/// Why a sandbox ended (audit `ended` records).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EndReason {
    Destroyed,
    IdleTtl,
    Crashed,
    /// The process that owned a one-shot sandbox died.
    OwnerGone,
    Error,
    /// Its maximum lifetime (set by the node service) passed.
    Lifetime,
    /// The node service restarted and could not take it back.
    NodeRestart,
}

impl EndReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            EndReason::Destroyed => "destroyed",
            EndReason::IdleTtl => "idle-ttl",
            EndReason::Crashed => "crashed",
            EndReason::OwnerGone => "owner-gone",
            EndReason::Error => "error",
            EndReason::Lifetime => "lifetime",
            EndReason::NodeRestart => "node-restart",
        }
    }
}

/// Refuses a persisted file of a newer format than this build reads.
pub(crate) fn check_format(path: &Path, found: u32, reads: u32) -> Result<(), RuntimeError> {
    if found > reads {
        return Err(RuntimeError::Invalid(format!(
            "{} is of format {found}, written by a newer Strata (this one reads formats up to {reads}); manage it with that build, or remove it with that build's `strata sandbox rm`",
            path.display()
        )));
    }
    Ok(())
}

/// Decodes a persisted JSON file (`bytes` read from `path`) whose `format` field (absent:
/// 0) must be at most `reads`.
pub(crate) fn decode_versioned<T: serde::de::DeserializeOwned>(
    path: &Path,
    bytes: &[u8],
    reads: u32,
) -> Result<T, RuntimeError> {
    let bad = |e: serde_json::Error| RuntimeError::Invalid(format!("{}: {e}", path.display()));
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(bad)?;
    let format = value.get("format").and_then(|f| f.as_u64()).unwrap_or(0) as u32;
    check_format(path, format, reads)?;
    serde_json::from_value(value).map_err(bad)
}

/// What every snapshot directory's `snapshot.json` starts with, whichever backend wrote
/// it (each adds its own fields: a VM's machine shape).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotHeader {
    #[serde(default)]
    pub format: u32,
    pub spec: SandboxSpec,
    pub taken_ms: u64,
}

/// The snapshot format this build writes (and the newest it reads).
pub const SNAPSHOT_FORMAT: u32 = 1;
/// A snapshot directory's record.
pub(crate) const SNAPSHOT_RECORD: &str = "snapshot.json";

/// Reads the record of the snapshot directory `dir` as `T` (a backend's own record, or
/// the [`SnapshotHeader`] every one has), refusing one of a newer format.
pub(crate) fn read_snapshot<T: serde::de::DeserializeOwned>(dir: &Path) -> Result<T, RuntimeError> {
    let path = dir.join(SNAPSHOT_RECORD);
    let bytes = std::fs::read(&path).map_err(|e| {
        RuntimeError::Invalid(format!(
            "{} is not a sandbox snapshot ({e}); make one with `strata sandbox snapshot`",
            dir.display()
        ))
    })?;
    decode_versioned(&path, &bytes, SNAPSHOT_FORMAT)
}

impl SandboxRecord {
    /// Reads a record, refusing one of a newer format.
    pub fn load(path: &Path) -> Result<SandboxRecord, RuntimeError> {
        let text = std::fs::read(path).map_err(RuntimeError::io(path))?;
        decode_versioned(path, &text, RECORD_FORMAT)
    }

    /// Writes the record atomically (a temp file renamed over it).
    pub fn save(&self, path: &Path) -> Result<(), RuntimeError> {
        let tmp = path.with_extension("json.tmp");
        let body =
            serde_json::to_vec_pretty(self).map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        std::fs::write(&tmp, body).map_err(RuntimeError::io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(RuntimeError::io(path))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> SandboxRecord {
        SandboxRecord {
            format: RECORD_FORMAT,
            id: "abc".into(),
            spec: SandboxSpec {
                catalog_ref: "t/x@v1".into(),
                layers: vec!["ab".into()],
                backend: strata_catalog::Backend::Fncall,
                limits: crate::spec::Limits::from_budgets(&Default::default()).unwrap(),
                env: Default::default(),
                workdir: "/".into(),
                user: "root".into(),
                network: Vec::new(),
                commands: Default::default(),
                identity: "t".into(),
                display: false,
                disk_image: None,
                privileged: false,
                views: Vec::new(),
            },
            created_ms: 1,
            init_pid: 2,
            init_start: 3,
            owner: None,
        }
    }

    #[test]
    fn records_of_older_formats_read_and_newer_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sandbox.json");
        // A record from before formats were recorded: no `format` field.
        let mut old = serde_json::to_value(record()).unwrap();
        old.as_object_mut().unwrap().remove("format");
        std::fs::write(&path, old.to_string()).unwrap();
        let r = SandboxRecord::load(&path).unwrap();
        assert_eq!((r.format, r.id.as_str(), r.init_pid), (0, "abc", 2));
        // A newer build's record is refused, with what to do.
        old["format"] = (RECORD_FORMAT + 1).into();
        std::fs::write(&path, old.to_string()).unwrap();
        let e = SandboxRecord::load(&path).unwrap_err().to_string();
        assert!(
            e.contains("newer Strata") && e.contains("strata sandbox rm"),
            "{e}"
        );
        // This build's own round-trips.
        record().save(&path).unwrap();
        assert_eq!(SandboxRecord::load(&path).unwrap().format, RECORD_FORMAT);
    }
}
