//! The audit record of a sandbox: JSON lines appended under the runtime's state directory,
//! one file per sandbox, kept after the sandbox is gone. Nothing inside a sandbox can see it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::RuntimeError;

#[derive(Debug, Clone)]
pub struct AuditLog {
    path: PathBuf,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl AuditLog {
    pub fn new(path: PathBuf) -> AuditLog {
        AuditLog { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `{"ts": ..., "event": event, ...fields}` as one line. A line is written with
    /// one `write` on an O_APPEND file, so concurrent writers never interleave.
    pub fn record(&self, event: &str, fields: Value) -> Result<(), RuntimeError> {
        let mut line = json!({ "ts": now_ms(), "event": event });
        if let (Some(obj), Value::Object(extra)) = (line.as_object_mut(), fields) {
            obj.extend(extra);
        }
        let mut text = line.to_string();
        text.push('\n');
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .map_err(RuntimeError::io(&self.path))?;
        f.write_all(text.as_bytes())
            .map_err(RuntimeError::io(&self.path))
    }

    /// Every record so far.
    pub fn read(&self) -> Result<Vec<Value>, RuntimeError> {
        let text = std::fs::read_to_string(&self.path).map_err(RuntimeError::io(&self.path))?;
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect())
    }
}
