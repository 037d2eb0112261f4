//! What the service keeps about each of its sandboxes beyond the runtime's record: the
//! owning project and token, labels, the end of the lifetime, and whether it is paused or
//! hibernated.
//! One JSON file per sandbox under `<runtime state>/service/sandboxes/`, written before a
//! create answers, so a restarted service takes its sandboxes back.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use strata_catalog::Backend;

use crate::error::ServiceError;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// The ID clients use: `<node>-<local>`.
    pub id: String,
    /// The runtime's ID.
    pub local: String,
    pub project: String,
    pub token: String,
    pub catalog_ref: String,
    pub backend: Backend,
    pub labels: BTreeMap<String, String>,
    pub created_ms: u64,
    /// Unix milliseconds after which the reaper ends it; `None`: no lifetime.
    pub expires_ms: Option<u64>,
    /// Budgets admission counted for it.
    pub memory_bytes: u64,
    pub cpus: f64,
    pub disk_bytes: u64,
    /// Idle time after which the reaper ends it, milliseconds.
    #[serde(default)]
    pub idle_ttl_ms: u64,
    #[serde(default)]
    pub paused: bool,
    /// Its state is on disk and nothing of it runs: its memory and CPUs are not counted
    /// by admission until it wakes.
    #[serde(default)]
    pub hibernated: bool,
    /// Connections from outside may reach its ports (through the E2B API's port proxy).
    #[serde(default)]
    pub inbound: bool,
    /// Admitted, being created: counted, not yet usable.
    #[serde(skip)]
    pub pending: bool,
}

impl Meta {
    pub fn state(&self) -> &'static str {
        match (self.pending, self.hibernated, self.paused) {
            (true, ..) => "creating",
            (false, true, _) => "hibernated",
            (false, false, true) => "paused",
            (false, false, false) => "running",
        }
    }
}

/// The directory of the records.
pub struct MetaDir {
    dir: PathBuf,
}

impl MetaDir {
    pub fn open(dir: &Path) -> Result<MetaDir, ServiceError> {
        std::fs::create_dir_all(dir).map_err(|source| ServiceError::Io {
            what: format!("creating {}", dir.display()),
            source,
        })?;
        Ok(MetaDir {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, local: &str) -> PathBuf {
        self.dir.join(format!("{local}.json"))
    }

    pub fn save(&self, meta: &Meta) -> Result<(), ServiceError> {
        let path = self.path(&meta.local);
        let tmp = path.with_extension("json.tmp");
        let body =
            serde_json::to_vec_pretty(meta).map_err(|e| ServiceError::Internal(e.to_string()))?;
        std::fs::write(&tmp, body)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|source| ServiceError::Io {
                what: format!("writing {}", path.display()),
                source,
            })
    }

    pub fn remove(&self, local: &str) {
        let _ = std::fs::remove_file(self.path(local));
    }

    /// Every record; unreadable ones are logged and skipped (their sandboxes, if alive,
    /// are then the runtime's alone, as if made by the CLI).
    pub fn load_all(&self) -> Vec<Meta> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "tmp") {
                let _ = std::fs::remove_file(&p);
                continue;
            }
            match std::fs::read(&p)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Meta>(&b).map_err(|e| e.to_string()))
            {
                Ok(m) => out.push(m),
                Err(e) => tracing::warn!("skipping service record {}: {e}", p.display()),
            }
        }
        out
    }
}
