//! A catalog entry: what an environment is made of and how it runs. Parsed from TOML,
//! stored as JSON, immutable once registered under a version.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::CatalogError;

/// The sandbox types. Switching is one parameter; the entry names the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Fncall,
    #[default]
    Container,
    Microvm,
    Vm,
}

impl Backend {
    pub fn as_str(&self) -> &'static str {
        match self {
            Backend::Fncall => "fncall",
            Backend::Container => "container",
            Backend::Microvm => "microvm",
            Backend::Vm => "vm",
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = CatalogError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fncall" => Ok(Backend::Fncall),
            "container" => Ok(Backend::Container),
            "microvm" => Ok(Backend::Microvm),
            "vm" => Ok(Backend::Vm),
            other => Err(CatalogError::Invalid(format!(
                "unknown backend `{other}` (fncall, container, microvm or vm)"
            ))),
        }
    }
}

/// Resource budgets. Sizes and durations are kept as written (`512M`, `60s`) and parsed by
/// [`Budgets::memory_bytes`] and friends, so the stored entry reads like its TOML.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budgets {
    pub memory: Option<String>,
    /// May be fractional (`0.5`).
    pub cpus: Option<f64>,
    pub disk: Option<String>,
    pub pids: Option<u32>,
    pub timeout: Option<String>,
    /// Idle time after which a stateful sandbox is reaped.
    pub idle_ttl: Option<String>,
    /// Idle time after which a sandbox that can (microvm, vm) hibernates: its state to
    /// disk, its memory and CPUs released, woken by its next call. Others ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_hibernate: Option<String>,
}

/// Parses `512M`, `1G`, `4096` (bytes; K/M/G/T are powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, CatalogError> {
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: f64 = num.trim().parse().map_err(|_| {
        CatalogError::Invalid(format!(
            "`{text}` is not a size (examples: 512M, 10G, 4096)"
        ))
    })?;
    if n.is_nan() || n < 0.0 {
        return Err(CatalogError::Invalid(format!("`{text}` is not a size")));
    }
    Ok((n * (1u64 << shift) as f64) as u64)
}

fn duration(field: &str, text: &Option<String>) -> Result<Option<Duration>, CatalogError> {
    text.as_deref()
        .map(|t| {
            humantime::parse_duration(t).map_err(|e| {
                CatalogError::Invalid(format!("budgets.{field} = `{t}`: {e} (examples: 60s, 5m)"))
            })
        })
        .transpose()
}

impl Budgets {
    pub fn memory_bytes(&self) -> Result<Option<u64>, CatalogError> {
        self.memory.as_deref().map(parse_size).transpose()
    }
    pub fn disk_bytes(&self) -> Result<Option<u64>, CatalogError> {
        self.disk.as_deref().map(parse_size).transpose()
    }
    pub fn cpu_count(&self) -> Result<Option<f64>, CatalogError> {
        match self.cpus {
            Some(c) if !(c > 0.0 && c.is_finite()) => Err(CatalogError::Invalid(format!(
                "budgets.cpus = {c} is not a positive number"
            ))),
            c => Ok(c),
        }
    }
    pub fn timeout(&self) -> Result<Option<Duration>, CatalogError> {
        duration("timeout", &self.timeout)
    }
    pub fn idle_ttl(&self) -> Result<Option<Duration>, CatalogError> {
        duration("idle_ttl", &self.idle_ttl)
    }
    pub fn auto_hibernate(&self) -> Result<Option<Duration>, CatalogError> {
        duration("auto_hibernate", &self.auto_hibernate)
    }

    /// Checks every field parses.
    pub fn validate(&self) -> Result<(), CatalogError> {
        self.memory_bytes()?;
        self.disk_bytes()?;
        self.cpu_count()?;
        self.timeout()?;
        self.idle_ttl()?;
        self.auto_hibernate()?;
        if self.pids == Some(0) {
            return Err(CatalogError::Invalid(
                "budgets.pids must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// `self` with every field `over` sets replaced.
    pub fn overridden_by(&self, over: &Budgets) -> Budgets {
        Budgets {
            memory: over.memory.clone().or_else(|| self.memory.clone()),
            cpus: over.cpus.or(self.cpus),
            disk: over.disk.clone().or_else(|| self.disk.clone()),
            pids: over.pids.or(self.pids),
            timeout: over.timeout.clone().or_else(|| self.timeout.clone()),
            idle_ttl: over.idle_ttl.clone().or_else(|| self.idle_ttl.clone()),
            auto_hibernate: over
                .auto_hibernate
                .clone()
                .or_else(|| self.auto_hibernate.clone()),
        }
    }
}

/// An entry as written by a dataset team or CI (TOML), before registration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// `namespace/name`.
    pub id: String,
    /// Assigned on registration (`v1`, `v2`, ...) unless given.
    pub version: Option<String>,
    pub base: String,
    /// Top-most first.
    #[serde(default)]
    pub toolkits: Vec<String>,
    pub workspace: Option<String>,
    #[serde(default)]
    pub backend: Backend,
    pub workdir: Option<String>,
    pub user: Option<String>,
    #[serde(default)]
    pub budgets: Budgets,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub commands: BTreeMap<String, String>,
    /// Hosts/CIDRs with ports the sandbox may reach (`pypi.org:443`); none by default.
    #[serde(default)]
    pub network: Vec<String>,
    /// A full VM's root from a whole disk image instead of the base layer's tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_image: Option<DiskImage>,
    /// How the entry's grading commands see an agent's work (`strata sandbox evaluate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluator: Option<Evaluator>,
}

/// What an evaluation adds to the agent's committed changes: the grader's own files, which
/// the agent's sandbox never has, and the paths of the stack the agent must not have
/// changed for grading (the workspace's tests). Both are mounted read-only in the
/// evaluation sandbox, so neither the agent's changes nor its code running under the
/// grader can alter them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Evaluator {
    /// A layer (ID, prefix or `name@version`, resolved at registration) holding the
    /// grader's files, mounted read-only at `mount`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<String>,
    /// Where the evaluator layer is mounted in the evaluation sandbox.
    #[serde(default = "default_evaluator_mount")]
    pub mount: String,
    /// Absolute paths whose content under grading is the entry's layers', read-only: the
    /// agent's changes under them are dropped before grading.
    #[serde(default)]
    pub protect: Vec<String>,
}

fn default_evaluator_mount() -> String {
    "/evaluator".into()
}

/// Checks `path` is absolute, normal (no `.`, `..` or empty parts) and not the root or a
/// kernel file system: something a read-only mount may cover.
fn validate_mount_path(field: &str, path: &str) -> Result<(), CatalogError> {
    let parts: Vec<&str> = path.split('/').skip(1).collect();
    let normal = path.starts_with('/')
        && !parts.is_empty()
        && parts
            .iter()
            .all(|p| !p.is_empty() && *p != "." && *p != "..");
    if !normal || path.len() > 1024 {
        return Err(CatalogError::Invalid(format!(
            "{field} `{path}` must be an absolute path without `.`, `..` or `//` (e.g. /work/tests)"
        )));
    }
    if matches!(parts[0], "proc" | "sys" | "dev") {
        return Err(CatalogError::Invalid(format!(
            "{field} `{path}` is under /{}, which the sandbox's kernel file systems cover",
            parts[0]
        )));
    }
    Ok(())
}

impl Evaluator {
    pub fn validate(&self) -> Result<(), CatalogError> {
        validate_mount_path("evaluator.mount", &self.mount)?;
        for p in &self.protect {
            validate_mount_path("evaluator.protect", p)?;
        }
        if self.protect.len() > 64 {
            return Err(CatalogError::Invalid(
                "evaluator.protect lists more than 64 paths".into(),
            ));
        }
        Ok(())
    }
}

/// A raw disk image (partition table and all) carried as a file of the base layer, for an
/// OS that is not built from layers: a `vm` sandbox attaches it read-only and its guest
/// mounts the image's root filesystem as the bottom of the stack, under the workspace and
/// toolkit layers and the writable disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskImage {
    /// Absolute path of the image inside the base layer.
    pub path: String,
    /// The partition holding the root filesystem (1 = the first); by default the first
    /// partition the guest can mount, or the whole disk when it has no partition table.
    pub partition: Option<u32>,
}

/// Splits `namespace/name[@version]`.
pub fn parse_ref(text: &str) -> Result<(String, Option<String>), CatalogError> {
    let (id, version) = match text.split_once('@') {
        Some((i, v)) if !v.is_empty() => (i, Some(v.to_string())),
        Some(_) => {
            return Err(CatalogError::Invalid(format!(
                "`{text}`: empty version after @"
            )))
        }
        None => (text, None),
    };
    validate_id(id)?;
    Ok((id.to_string(), version))
}

fn valid_part(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 128
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !p.starts_with('.')
}

pub fn validate_id(id: &str) -> Result<(), CatalogError> {
    match id.split_once('/') {
        Some((ns, name)) if valid_part(ns) && valid_part(name) => Ok(()),
        _ => Err(CatalogError::Invalid(format!(
            "catalog ID `{id}` must be namespace/name (letters, digits, - _ .)"
        ))),
    }
}

impl Entry {
    pub fn from_toml(text: &str, origin: &str) -> Result<Entry, CatalogError> {
        let e: Entry =
            toml::from_str(text).map_err(|e| CatalogError::Invalid(format!("{origin}: {e}")))?;
        e.validate()?;
        Ok(e)
    }

    /// Checks the entry's shape (not whether its layers exist: the catalog does that).
    pub fn validate(&self) -> Result<(), CatalogError> {
        validate_id(&self.id)?;
        if let Some(v) = &self.version {
            if !valid_part(v) {
                return Err(CatalogError::Invalid(format!(
                    "version `{v}` must be letters, digits, - _ ."
                )));
            }
        }
        self.budgets.validate()?;
        if let Some(d) = &self.disk_image {
            if !d.path.starts_with('/') || d.path.split('/').any(|c| c == "..") {
                return Err(CatalogError::Invalid(format!(
                    "disk_image.path `{}` must be an absolute path inside the base layer",
                    d.path
                )));
            }
            if d.partition == Some(0) {
                return Err(CatalogError::Invalid(
                    "disk_image.partition counts from 1 (leave it out to use the first that mounts)"
                        .into(),
                ));
            }
            if self.backend != Backend::Vm {
                return Err(CatalogError::Invalid(format!(
                    "a disk_image entry runs only as a full VM: set backend = \"vm\" (it is `{}`)",
                    self.backend.as_str()
                )));
            }
        }
        if let Some(e) = &self.evaluator {
            e.validate()?;
        }
        if let Some(w) = &self.workdir {
            if !w.starts_with('/') {
                return Err(CatalogError::Invalid(format!(
                    "workdir `{w}` must be an absolute path"
                )));
            }
        }
        Ok(())
    }

    /// Every layer the entry stacks, top-most first.
    pub fn layers(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.toolkits.iter().map(String::as_str).collect();
        v.extend(self.workspace.as_deref());
        v.push(&self.base);
        v
    }

    /// Every layer the entry needs: its stack, then the evaluator's layer.
    pub fn all_layers(&self) -> Vec<&str> {
        let mut v = self.layers();
        v.extend(self.evaluator.as_ref().and_then(|e| e.layer.as_deref()));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
id = "demo/hello"
base = "aaaa"
toolkits = ["cccc"]
workspace = "bbbb"
backend = "container"
workdir = "/work"
[budgets]
memory = "512M"
cpus = 1
disk = "1G"
pids = 256
timeout = "60s"
[env]
LANG = "C.UTF-8"
[commands]
test = "python3 -m pytest -q"
"#;

    #[test]
    fn the_documented_shape_parses() {
        let e = Entry::from_toml(SAMPLE, "sample").unwrap();
        assert_eq!(e.layers(), vec!["cccc", "bbbb", "aaaa"]);
        assert_eq!(e.budgets.memory_bytes().unwrap(), Some(512 << 20));
        assert_eq!(e.budgets.timeout().unwrap(), Some(Duration::from_secs(60)));
        assert_eq!(e.budgets.cpu_count().unwrap(), Some(1.0));
        assert_eq!(e.commands["test"], "python3 -m pytest -q");
    }

    #[test]
    fn bad_entries_are_refused_with_the_field_named() {
        let bad = SAMPLE.replace("512M", "lots");
        assert!(Entry::from_toml(&bad, "x")
            .unwrap_err()
            .to_string()
            .contains("lots"));
        let bad = SAMPLE.replace("demo/hello", "nohslash");
        assert!(Entry::from_toml(&bad, "x")
            .unwrap_err()
            .to_string()
            .contains("namespace/name"));
        let bad = SAMPLE.replace("backend = \"container\"", "backend = \"docker\"");
        assert!(Entry::from_toml(&bad, "x").is_err());
        let image = format!("{SAMPLE}[disk_image]\npath = \"/disk.img\"\n");
        assert!(Entry::from_toml(&image, "x")
            .unwrap_err()
            .to_string()
            .contains("backend = \"vm\""));
        let image = image.replace("\"container\"", "\"vm\"");
        let e = Entry::from_toml(&image, "x").unwrap();
        assert_eq!(e.disk_image.unwrap().path, "/disk.img");
        let graded =
            format!("{SAMPLE}[evaluator]\nlayer = \"dddd\"\nprotect = [\"/work/tests\"]\n");
        let e = Entry::from_toml(&graded, "x").unwrap();
        assert_eq!(e.all_layers(), vec!["cccc", "bbbb", "aaaa", "dddd"]);
        assert_eq!(e.evaluator.as_ref().unwrap().mount, "/evaluator");
        for bad in ["work/tests", "/work/../etc", "/work//tests", "/", "/proc/x"] {
            let t = graded.replace("/work/tests", bad);
            let err = Entry::from_toml(&t, "x").unwrap_err().to_string();
            assert!(err.contains("evaluator.protect"), "{bad}: {err}");
        }
        let relative = image.replace("/disk.img", "disk.img");
        assert!(Entry::from_toml(&relative, "x").is_err());
        assert!(parse_ref("a/b@").is_err());
        assert_eq!(
            parse_ref("a/b@v3").unwrap(),
            ("a/b".into(), Some("v3".into()))
        );
    }
}
