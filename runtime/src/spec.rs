//! What a sandbox is made of once its catalog entry and the caller's overrides are
//! resolved: layer stack, backend, budgets in numbers, environment and network policy.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata_catalog::{Backend, Budgets, DiskImage, Registered};

use crate::RuntimeError;

/// Defaults for budgets an entry leaves open: a sandbox is never unbounded.
pub const DEFAULT_MEMORY: u64 = 1 << 30;
pub const DEFAULT_DISK: u64 = 2 << 30;
pub const DEFAULT_PIDS: u32 = 1024;
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
pub const DEFAULT_IDLE_TTL: Duration = Duration::from_secs(3600);

/// Resolved budgets, in numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    pub memory_bytes: u64,
    /// CPUs' worth of time per period; `None` is unthrottled.
    pub cpus: Option<f64>,
    pub disk_bytes: u64,
    pub pids: u32,
    /// Default wall-clock limit of one command.
    #[serde(with = "humantime_serde_secs")]
    pub timeout: Duration,
    /// Idle time after which a stateful sandbox is destroyed.
    #[serde(with = "humantime_serde_secs")]
    pub idle_ttl: Duration,
    /// Idle time after which a sandbox that can hibernate does; `None`: never.
    #[serde(default)]
    pub auto_hibernate: Option<Duration>,
}

mod humantime_serde_secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom)
    }
}

impl Limits {
    pub fn from_budgets(b: &Budgets) -> Result<Limits, RuntimeError> {
        let bad = |e: strata_catalog::CatalogError| RuntimeError::Invalid(e.to_string());
        b.validate().map_err(bad)?;
        let limits = Limits {
            memory_bytes: b.memory_bytes().map_err(bad)?.unwrap_or(DEFAULT_MEMORY),
            cpus: b.cpu_count().map_err(bad)?,
            disk_bytes: b.disk_bytes().map_err(bad)?.unwrap_or(DEFAULT_DISK),
            pids: b.pids.unwrap_or(DEFAULT_PIDS),
            timeout: b.timeout().map_err(bad)?.unwrap_or(DEFAULT_TIMEOUT),
            idle_ttl: b.idle_ttl().map_err(bad)?.unwrap_or(DEFAULT_IDLE_TTL),
            auto_hibernate: b.auto_hibernate().map_err(bad)?,
        };
        if limits.memory_bytes < 8 << 20 {
            return Err(RuntimeError::Invalid(format!(
                "memory budget {} bytes is below the 8M a sandbox needs to start",
                limits.memory_bytes
            )));
        }
        if limits.disk_bytes < 1 << 20 {
            return Err(RuntimeError::Invalid(
                "disk budget must be at least 1M".into(),
            ));
        }
        Ok(limits)
    }
}

/// What the caller may change per sandbox on top of the entry.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub backend: Option<Backend>,
    pub budgets: Budgets,
    pub env: BTreeMap<String, String>,
    /// Replaces the entry's network allowlist when set.
    pub network: Option<Vec<String>>,
    /// Who asked (recorded in the audit log).
    pub identity: Option<String>,
    /// A graphical display (VNC) for a full VM.
    pub display: bool,
    /// A VM whose commands keep the guest's full privileges (nesting).
    pub privileged: bool,
}

/// Everything needed to create one sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// `namespace/name@version`, or empty for an ad-hoc stack.
    pub catalog_ref: String,
    /// Layer IDs, top-most first (toolkits, workspace, base).
    pub layers: Vec<String>,
    pub backend: Backend,
    pub limits: Limits,
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    pub user: String,
    pub network: Vec<NetRule>,
    pub commands: BTreeMap<String, String>,
    pub identity: String,
    /// A full VM with a graphics card, its screen served over VNC on the Unix socket
    /// `vnc.sock` in the sandbox's directory.
    #[serde(default)]
    pub display: bool,
    /// A full VM whose root is this disk image of the base layer, not the base's tree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_image: Option<DiskImage>,
    /// A microvm or vm whose commands keep the guest's full privileges: every capability,
    /// the guest's devtmpfs, writable cgroups (for running a container engine, or Strata,
    /// inside). The agent's integrity then rests on the commands (see SECURITY.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub privileged: bool,
    /// Read-only trees mounted beside the overlay stack (an evaluation's grader files and
    /// protected paths), mounted in this order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub views: Vec<ReadonlyView>,
}

/// A read-only tree of layers (one layer, or several stacked without an upper) whose
/// `from` is mounted at `at` over the sandbox's root. Neither path may pass a symlink, in
/// the layers or in the root: the mount is where it says, whatever the sandbox's files
/// say.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadonlyView {
    /// Layer IDs, top-most first.
    pub layers: Vec<String>,
    /// Absolute path inside the view.
    pub from: String,
    /// Absolute path in the sandbox.
    pub at: String,
}

/// One allowed destination: a host name (or `*.domain`), an address or a CIDR, and a
/// port. Names are enforced by the sandbox's egress proxy (TCP), addresses by nftables.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetRule {
    pub host: String,
    pub port: u16,
}

impl NetRule {
    /// One rule: `HOST:PORT`, `*.DOMAIN:PORT`, `ADDRESS[/LEN]:PORT`, or the name of a
    /// shipped rule set (`pypi`, `npm`, `crates`, `debian`, `github`), which stands for
    /// several.
    pub fn parse(text: &str) -> Result<Vec<NetRule>, RuntimeError> {
        let bad = |why: &str| {
            RuntimeError::Invalid(format!(
                "network destination `{text}`{why} must be HOST:PORT (e.g. pypi.org:443, \
                 *.debian.org:80, 10.0.0.0/8:80) or a rule set ({})",
                strata_egress::rule_set_names()
            ))
        };
        if let Some(set) = strata_egress::rule_set(text.trim()) {
            return Ok(set
                .iter()
                .map(|(host, port)| NetRule {
                    host: host.to_string(),
                    port: *port,
                })
                .collect());
        }
        let (host, port) = text.rsplit_once(':').ok_or_else(|| bad(""))?;
        let port: u16 = port.parse().map_err(|_| bad(""))?;
        let host = host.trim_matches(['[', ']']);
        if host.is_empty() || port == 0 {
            return Err(bad(""));
        }
        let is_address = host.parse::<std::net::IpAddr>().is_ok()
            || host
                .split_once('/')
                .is_some_and(|(a, _)| a.parse::<std::net::Ipv4Addr>().is_ok());
        if !is_address && strata_egress::Pattern::parse(host).is_err() {
            return Err(bad(": not a host name, address or range;"));
        }
        Ok(vec![NetRule {
            host: host.to_string(),
            port,
        }])
    }

    /// Every rule of `texts`, rule sets expanded.
    pub fn parse_all<S: AsRef<str>>(texts: &[S]) -> Result<Vec<NetRule>, RuntimeError> {
        let mut out = Vec::new();
        for t in texts {
            out.extend(NetRule::parse(t.as_ref())?);
        }
        Ok(out)
    }
}

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

impl SandboxSpec {
    /// The entry with the caller's overrides applied and every budget resolved.
    pub fn resolve(reg: &Registered, over: &Overrides) -> Result<SandboxSpec, RuntimeError> {
        let e = &reg.entry;
        let budgets = e.budgets.overridden_by(&over.budgets);
        let mut env = base_env();
        env.extend(e.env.clone());
        env.extend(over.env.clone());
        let network = NetRule::parse_all(over.network.as_ref().unwrap_or(&e.network))?;
        let backend = over.backend.unwrap_or(e.backend);
        if let (Some(image), false) = (&e.disk_image, backend == Backend::Vm) {
            return Err(RuntimeError::Invalid(format!(
                "{} boots the disk image {} of its base layer: only a full VM runs it (--backend vm, not {})",
                reg.reference(),
                image.path,
                backend.as_str()
            )));
        }
        Ok(SandboxSpec {
            catalog_ref: reg.reference(),
            layers: e.layers().into_iter().map(str::to_string).collect(),
            backend,
            limits: Limits::from_budgets(&budgets)?,
            env,
            workdir: e.workdir.clone().unwrap_or_else(|| "/".into()),
            user: e.user.clone().unwrap_or_else(|| "root".into()),
            network,
            commands: e.commands.clone(),
            identity: over.identity.clone().unwrap_or_else(local_identity),
            display: over.display,
            disk_image: e.disk_image.clone(),
            privileged: over.privileged,
            views: Vec::new(),
        })
    }
}

/// The environment every sandbox starts from, before its entry's and caller's.
pub fn base_env() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("PATH".to_string(), DEFAULT_PATH.to_string()),
        ("HOME".to_string(), "/root".to_string()),
    ])
}

/// The local user, as `name (uid N)`.
pub fn local_identity() -> String {
    let uid = nix::unistd::getuid();
    let name = nix::unistd::User::from_uid(uid)
        .ok()
        .flatten()
        .map(|u| u.name)
        .unwrap_or_else(|| "unknown".into());
    format!("{name} (uid {uid})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_rules_parse_and_reject() {
        let rule = |host: &str, port| NetRule {
            host: host.into(),
            port,
        };
        assert_eq!(
            NetRule::parse("pypi.org:443").unwrap(),
            vec![rule("pypi.org", 443)]
        );
        assert_eq!(NetRule::parse("[::1]:80").unwrap()[0].host, "::1");
        assert_eq!(
            NetRule::parse("*.debian.org:80").unwrap(),
            vec![rule("*.debian.org", 80)]
        );
        assert_eq!(
            NetRule::parse("10.0.0.0/8:22").unwrap(),
            vec![rule("10.0.0.0/8", 22)]
        );
        assert_eq!(
            NetRule::parse_all(&["pypi", "1.2.3.4:80"]).unwrap(),
            vec![
                rule("pypi.org", 443),
                rule("files.pythonhosted.org", 443),
                rule("1.2.3.4", 80)
            ]
        );
        for bad in [
            "pypi.org",
            "pypi.org:0",
            ":80",
            "a_b.org:80",
            "*.org:443",
            "nowhere",
        ] {
            let e = NetRule::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("HOST:PORT") && e.contains("pypi, npm"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn budgets_resolve_with_defaults_and_reject_nonsense() {
        let l = Limits::from_budgets(&Budgets {
            memory: Some("256M".into()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(l.memory_bytes, 256 << 20);
        assert_eq!(l.disk_bytes, DEFAULT_DISK);
        assert_eq!(l.pids, DEFAULT_PIDS);
        let tiny = Limits::from_budgets(&Budgets {
            memory: Some("1M".into()),
            ..Default::default()
        });
        assert!(tiny.unwrap_err().to_string().contains("memory budget"));
    }
}
