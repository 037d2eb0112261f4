//! The `strata` binary's settings, built once at start and passed down: the library crates
//! read no environment variables. Each setting comes from, in this order of precedence, a
//! command-line flag (where it has one), an environment variable, the settings file, and
//! its default; the README's "Settings" table lists them all.
//!
//! The settings file is `--config FILE` (or `STRATA_CONFIG`), which must exist, else
//! `$STRATA_HOME/strata.toml` when it exists. Its keys are the environment variables'
//! names without `STRATA_`, in lower case (`store`, `cache_max`, `vm_accel`, ...); an
//! unknown key is refused with the file, the key and the valid keys named. Relative paths
//! in it are relative to the file's directory.
//!
//! This module is also the only place the binary reads the environment, apart from what
//! `object_store` reads itself (S3 credentials and endpoints, `AWS_*`) and `PATH`, through
//! which tools are found.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use strata_builder::{RegistryCredentials, RegistrySettings};
use strata_runtime::OciRuntime;
use strata_runtime::VmConfig;
use strata_store::{StoreOptions, StoreUrl};

/// The flags every subcommand takes.
#[derive(clap::Args, Debug, Default, Clone)]
pub struct GlobalFlags {
    /// Settings file (env STRATA_CONFIG). Default: $STRATA_HOME/strata.toml if it exists.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Store URL: a directory, file:///dir, or s3://bucket?endpoint=http://host:port
    /// (env STRATA_STORE). Default: a local store under STRATA_HOME.
    #[arg(long, global = true, value_name = "URL")]
    pub store: Option<String>,
    /// A node service (`strata serve`) to send `layer`, `catalog`, `run` and `sandbox`
    /// commands to, http://HOST:PORT (env STRATA_SERVER), with STRATA_TOKEN.
    #[arg(long, global = true, value_name = "URL")]
    pub server: Option<String>,
}

/// The flags of `strata lazyfs serve`, which override the daemon's settings.
#[derive(Debug, Default, Clone)]
pub struct DaemonFlags {
    pub cache_max: Option<u64>,
    pub fetch_timeout: Option<Duration>,
    pub idle_detach: Option<Duration>,
    pub erofs_mount: Option<ErofsMount>,
}

/// How the daemon mounts layer images (`erofs_mount`, `--erofs-mount`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ErofsMount {
    Auto,
    File,
    Loop,
}

impl ErofsMount {
    fn parse(text: &str) -> Result<ErofsMount, String> {
        match text {
            "auto" => Ok(ErofsMount::Auto),
            "file" => Ok(ErofsMount::File),
            "loop" => Ok(ErofsMount::Loop),
            _ => Err("use auto, file or loop".into()),
        }
    }

    pub fn source(self) -> Option<strata_lazyfs::mounts::ErofsSource> {
        use strata_lazyfs::mounts::ErofsSource;
        match self {
            ErofsMount::Auto => None,
            ErofsMount::File => Some(ErofsSource::File),
            ErofsMount::Loop => Some(ErofsSource::Loop),
        }
    }
}

/// The VM accelerator (`vm_accel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum VmAccel {
    Auto,
    Kvm,
    Tcg,
}

impl VmAccel {
    fn parse(text: &str) -> Result<VmAccel, String> {
        match text {
            "auto" => Ok(VmAccel::Auto),
            "kvm" => Ok(VmAccel::Kvm),
            "tcg" => Ok(VmAccel::Tcg),
            _ => Err("use auto, kvm or tcg".into()),
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            VmAccel::Auto => "auto",
            VmAccel::Kvm => "kvm",
            VmAccel::Tcg => "tcg",
        }
    }
}

/// Which CA bundle build steps trust.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaBundle {
    /// `none`: the base layer's own.
    Keep,
    /// The first of these that is a file (none: the base's own).
    FirstOf(Vec<PathBuf>),
}

impl CaBundle {
    /// The host bundle to place in build sandboxes, if any.
    pub fn host_bundle(&self) -> Option<PathBuf> {
        match self {
            CaBundle::Keep => None,
            CaBundle::FirstOf(paths) => paths.iter().find(|p| p.is_file()).cloned(),
        }
    }
}

/// Where the system CA bundle is on Debian and its derivatives.
const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Every setting of the binary, resolved.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The settings file that was read, if any (absolute).
    pub file: Option<PathBuf>,
    /// Strata's state directory.
    pub home: PathBuf,
    /// The store.
    pub store: StoreUrl,
    /// The store as given (flag, environment or file), when not the default.
    pub store_given: Option<String>,
    /// How the store is opened (the S3 region default).
    pub store_options: StoreOptions,
    /// The log filter, when set; the CLI logs `warn` and the daemon `info` without.
    pub log: Option<String>,
    /// The lazyfs daemon's chunk cache bound, in bytes.
    pub cache_max: u64,
    pub erofs_mount: ErofsMount,
    pub fetch_timeout: Duration,
    pub idle_detach: Duration,
    /// Ready uppers and fncall agents kept waiting after `run` and `sandbox create`.
    pub pool: usize,
    pub oci_runtime: OciRuntime,
    /// The `strata-agent` binary; default: beside this one.
    pub agent: Option<PathBuf>,
    /// The static `strata-agent`; default: where `cargo build --target ...` put it.
    pub static_agent: Option<PathBuf>,
    /// The CRIU binary containers hibernate with; default: scripts/criu.sh's, if built.
    pub criu: Option<PathBuf>,
    pub vm: VmConfig,
    pub registry: RegistrySettings,
    pub build_ca_bundle: CaBundle,
    /// Who catalog registrations and removals are recorded as.
    pub registrant: String,
    /// The node service's own settings (`strata serve`).
    pub serve: ServeSettings,
    /// A node service to send commands to instead of the local runtime (`--server`,
    /// STRATA_SERVER), and the token to send (STRATA_TOKEN).
    pub server: Option<String>,
    pub token: Option<String>,
}

/// `strata serve`'s settings; its flags override them.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeSettings {
    pub listen: String,
    pub metrics_listen: Option<String>,
    /// The node's name (STRATA_NODE_NAME); default: the host name, made a DNS label.
    pub node_name: Option<String>,
    /// The most a unary exec keeps of each output stream.
    pub exec_output_cap: u64,
    pub memory_overcommit: f64,
    pub cpu_overcommit: f64,
    pub reap_every: Duration,
    /// The lifetime of a sandbox created without one; `None`: unlimited.
    pub default_lifetime: Option<Duration>,
    /// How long a sandbox's command journal is kept after it ends (embedded and served).
    pub journal_retention: Duration,
    /// Sandboxes a bulk hibernate saves at once.
    pub hibernate_concurrency: usize,
    /// Where the E2B-compatible API is served; `None`: it is not.
    pub e2b_listen: Option<String>,
    /// With wildcard DNS, the domain of `api.<domain>` and `<port>-<id>.<domain>`.
    pub e2b_domain: Option<String>,
    /// A certificate chain and key (PEM) to serve the E2B API over TLS.
    pub e2b_tls_cert: Option<PathBuf>,
    pub e2b_tls_key: Option<PathBuf>,
}

/// The settings file. Keys are the environment variables' names without `STRATA_`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    home: Option<PathBuf>,
    store: Option<String>,
    store_concurrency: Option<usize>,
    store_range: Option<Size>,
    store_timeout: Option<String>,
    log: Option<String>,
    cache_max: Option<Size>,
    erofs_mount: Option<ErofsMount>,
    fetch_timeout: Option<String>,
    idle_detach: Option<String>,
    pool: Option<usize>,
    oci_runtime: Option<String>,
    agent: Option<PathBuf>,
    static_agent: Option<PathBuf>,
    criu: Option<PathBuf>,
    qemu: Option<PathBuf>,
    guest_dir: Option<PathBuf>,
    vm_accel: Option<VmAccel>,
    vm_templates: Option<bool>,
    registry_user: Option<String>,
    registry_password: Option<String>,
    insecure_registries: Option<Vec<String>>,
    build_ca_bundle: Option<PathBuf>,
    listen: Option<String>,
    metrics_listen: Option<String>,
    node_name: Option<String>,
    exec_output_cap: Option<Size>,
    memory_overcommit: Option<f64>,
    cpu_overcommit: Option<f64>,
    reap_every: Option<String>,
    default_lifetime: Option<String>,
    journal_retention: Option<String>,
    hibernate_concurrency: Option<usize>,
    e2b_listen: Option<String>,
    e2b_domain: Option<String>,
    e2b_tls_cert: Option<PathBuf>,
    e2b_tls_key: Option<PathBuf>,
    server: Option<String>,
}

/// A size in the file: bytes, or text such as `10G`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Size {
    Bytes(u64),
    Text(String),
}

/// Reads one environment variable; empty counts as unset.
pub type EnvLookup<'a> = &'a dyn Fn(&str) -> Option<OsString>;

/// This process's environment.
pub fn process_env(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}

/// Whether this process runs as root (the default home depends on it).
pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The default state directory: `/var/lib/strata` for root, else the user's data
/// directory (`$XDG_DATA_HOME/strata`, else `~/.local/share/strata`).
fn default_home(env: EnvLookup, root: bool) -> PathBuf {
    if root {
        return PathBuf::from("/var/lib/strata");
    }
    let get = |n: &str| env(n).filter(|v| !v.is_empty());
    if let Some(d) = get("XDG_DATA_HOME") {
        return Path::new(&d).join("strata");
    }
    let home = get("HOME").unwrap_or_else(|| "/tmp".into());
    Path::new(&home).join(".local/share/strata")
}

/// The sources of settings below the flags.
struct Layers<'a> {
    env: EnvLookup<'a>,
    file: FileSettings,
    /// The file read, for messages and relative paths.
    path: Option<PathBuf>,
}

impl Layers<'_> {
    fn env_os(&self, name: &str) -> Option<OsString> {
        (self.env)(name).filter(|v| !v.is_empty())
    }

    fn env_str(&self, name: &str) -> Result<Option<String>> {
        self.env_os(name)
            .map(|v| {
                v.into_string()
                    .map_err(|v| anyhow!("{name}={}: not valid UTF-8", v.to_string_lossy()))
            })
            .transpose()
    }

    /// An environment variable parsed by `parse`; a bad value names the variable.
    fn env_parse<T>(
        &self,
        name: &str,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<Option<T>> {
        self.env_str(name)?
            .map(|v| parse(&v).map_err(|e| anyhow!("{name}={v}: {e}")))
            .transpose()
    }

    /// A value of the file parsed by `parse`; a bad value names the file and the key.
    fn file_parse<T>(
        &self,
        key: &str,
        value: Option<&str>,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Result<Option<T>> {
        value
            .map(|v| parse(v).map_err(|e| anyhow!("{}: {key} = {v:?}: {e}", self.file_name())))
            .transpose()
    }

    fn file_name(&self) -> String {
        self.path
            .as_deref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    }

    /// A path of the file, relative to the file's directory.
    fn file_path(&self, p: &Option<PathBuf>) -> Option<PathBuf> {
        let p = p.as_ref()?;
        let dir = self.path.as_deref().and_then(Path::parent);
        Some(match dir {
            Some(d) if p.is_relative() => d.join(p),
            _ => p.clone(),
        })
    }

    fn env_path(&self, name: &str) -> Option<PathBuf> {
        self.env_os(name).map(PathBuf::from)
    }
}

fn parse_size(text: &str) -> Result<u64, String> {
    strata_catalog::parse_size(text).map_err(|e| e.to_string())
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (examples: 30s, 5m)"))
}

/// Reads the settings file at `path`; `explicit` says where its name came from, for
/// the message when it cannot be read.
fn read_file(path: &Path, explicit: Option<&str>) -> Result<Option<FileSettings>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && explicit.is_none() => {
            return Ok(None)
        }
        Err(e) => {
            let from = explicit.map(|f| format!(" (from {f})")).unwrap_or_default();
            bail!("settings file {}{from}: {e}", path.display());
        }
    };
    toml::from_str(&text)
        .map(Some)
        .with_context(|| format!("settings file {}", path.display()))
}

impl Settings {
    /// Builds the settings from `flags`, `daemon` (the flags of `lazyfs serve`), the
    /// environment `env`, the settings file and the defaults; `root` is whether this
    /// process runs as root.
    pub fn load(
        flags: &GlobalFlags,
        daemon: &DaemonFlags,
        env: EnvLookup,
        root: bool,
    ) -> Result<Settings> {
        let mut layers = Layers {
            env,
            file: FileSettings::default(),
            path: None,
        };
        let env_home = layers.env_path("STRATA_HOME");
        let (file_path, explicit) = match (&flags.config, layers.env_path("STRATA_CONFIG")) {
            (Some(f), _) => (Some(f.clone()), Some("--config")),
            (None, Some(f)) => (Some(f), Some("STRATA_CONFIG")),
            (None, None) => {
                let home = env_home.clone().unwrap_or_else(|| default_home(env, root));
                (Some(home.join("strata.toml")), None)
            }
        };
        if let Some(path) = file_path {
            let path = std::path::absolute(&path).unwrap_or(path);
            if let Some(file) = read_file(&path, explicit)? {
                layers.file = file;
                layers.path = Some(path);
            }
        }
        let l = &layers;
        let f = &l.file;

        let home = env_home
            .or_else(|| l.file_path(&f.home))
            .unwrap_or_else(|| default_home(env, root));
        // Absolute: the runtime names files to processes that run elsewhere (QEMU runs in
        // a machine's directory, an agent after its pivot).
        let home = std::path::absolute(&home).unwrap_or(home);

        let store_given = match (&flags.store, l.env_str("STRATA_STORE")?, &f.store) {
            (Some(s), _, _) => Some((s.clone(), "--store".to_string())),
            (None, Some(s), _) => Some((s, "STRATA_STORE".to_string())),
            (None, None, Some(s)) => Some((s.clone(), format!("{}: store", l.file_name()))),
            (None, None, None) => None,
        };
        let store = match &store_given {
            Some((text, from)) => StoreUrl::parse(text).with_context(|| from.clone())?,
            None => StoreUrl::Local(home.join("store")),
        };
        let store_given = store_given.map(|(text, _)| text);
        let positive = |what: &'static str| {
            move |v: &str| match v.parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("not a positive number of {what}")),
            }
        };
        let file_range = match &f.store_range {
            Some(Size::Bytes(n)) => Some(*n),
            Some(Size::Text(t)) => l.file_parse("store_range", Some(t), parse_size)?,
            None => None,
        };
        let store_range = l
            .env_parse("STRATA_STORE_RANGE", parse_size)?
            .or(file_range);
        if let Some(r) = store_range.filter(|&r| !(4096..=(256 << 20)).contains(&r)) {
            bail!("the store range size {r} is out of bounds: give between 4K and 256M (STRATA_STORE_RANGE or store_range)");
        }
        let file_concurrency = match f.store_concurrency {
            Some(0) => bail!(
                "{}: store_concurrency = 0: give a positive number of requests",
                l.file_name()
            ),
            n => n,
        };
        let store_options = StoreOptions {
            region: match l.env_str("AWS_REGION")? {
                Some(r) => Some(r),
                None => l.env_str("AWS_DEFAULT_REGION")?,
            },
            concurrency: l
                .env_parse("STRATA_STORE_CONCURRENCY", positive("requests"))?
                .or(file_concurrency),
            range_bytes: store_range,
            request_timeout: match l.env_parse("STRATA_STORE_TIMEOUT", parse_duration)? {
                Some(d) => Some(d),
                None => {
                    l.file_parse("store_timeout", f.store_timeout.as_deref(), parse_duration)?
                }
            },
        };

        let file_cache_max = match &f.cache_max {
            Some(Size::Bytes(n)) => Some(*n),
            Some(Size::Text(t)) => l.file_parse("cache_max", Some(t), parse_size)?,
            None => None,
        };
        let cache_max = match daemon.cache_max {
            Some(n) => n,
            None => l
                .env_parse("STRATA_CACHE_MAX", parse_size)?
                .or(file_cache_max)
                .unwrap_or(10 << 30),
        };
        let erofs_mount = match daemon.erofs_mount {
            Some(m) => m,
            None => l
                .env_parse("STRATA_EROFS_MOUNT", ErofsMount::parse)?
                .or(f.erofs_mount)
                .unwrap_or(ErofsMount::Auto),
        };
        let fetch_timeout = match daemon.fetch_timeout {
            Some(d) => d,
            None => l
                .file_parse("fetch_timeout", f.fetch_timeout.as_deref(), parse_duration)?
                .unwrap_or(Duration::from_secs(30)),
        };
        let idle_detach = match daemon.idle_detach {
            Some(d) => d,
            None => l
                .file_parse("idle_detach", f.idle_detach.as_deref(), parse_duration)?
                .unwrap_or(Duration::from_secs(60)),
        };

        let pool = l
            .env_parse("STRATA_POOL", |v| {
                v.parse::<usize>()
                    .map_err(|_| "not a number of pieces (default 2)".to_string())
            })?
            .or(f.pool)
            .unwrap_or(2);
        let oci_runtime = match l.env_str("STRATA_OCI_RUNTIME")? {
            Some(v) => OciRuntime::parse(&v).map_err(|e| anyhow!("STRATA_OCI_RUNTIME: {e}"))?,
            None => match &f.oci_runtime {
                Some(v) => OciRuntime::parse(v)
                    .map_err(|e| anyhow!("{}: oci_runtime: {e}", l.file_name()))?,
                None => OciRuntime::Crun(PathBuf::from("crun")),
            },
        };

        let defaults = VmConfig::default();
        let vm = VmConfig {
            guest_dir: l
                .env_path("STRATA_GUEST_DIR")
                .or_else(|| l.file_path(&f.guest_dir))
                .unwrap_or(defaults.guest_dir),
            accel: l
                .env_parse("STRATA_VM_ACCEL", VmAccel::parse)?
                .or(f.vm_accel)
                .map_or(defaults.accel, |a| a.as_str().to_string()),
            templates: match l.env_os("STRATA_VM_TEMPLATES") {
                Some(v) => v != "0",
                None => f.vm_templates.unwrap_or(defaults.templates),
            },
            qemu: l
                .env_path("STRATA_QEMU")
                .or_else(|| f.qemu.clone())
                .unwrap_or(defaults.qemu),
        };

        let user = l
            .env_str("STRATA_REGISTRY_USER")?
            .or_else(|| f.registry_user.clone());
        let password = l
            .env_str("STRATA_REGISTRY_PASSWORD")?
            .or_else(|| f.registry_password.clone());
        let credentials = match (user, password) {
            (Some(user), Some(password)) => Some(RegistryCredentials { user, password }),
            (None, None) => None,
            (Some(_), None) => bail!(
                "a registry user is set (STRATA_REGISTRY_USER or registry_user) but no password (STRATA_REGISTRY_PASSWORD or registry_password)"
            ),
            (None, Some(_)) => bail!(
                "a registry password is set (STRATA_REGISTRY_PASSWORD or registry_password) but no user (STRATA_REGISTRY_USER or registry_user)"
            ),
        };
        let insecure = match l.env_str("STRATA_INSECURE_REGISTRIES")? {
            Some(v) => v
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
            None => f.insecure_registries.clone().unwrap_or_default(),
        };

        let bundle = match l.env_path("STRATA_BUILD_CA_BUNDLE") {
            Some(p) => Some(p),
            None => match &f.build_ca_bundle {
                Some(p) if p.as_os_str() == "none" => Some(p.clone()),
                other => l.file_path(other),
            },
        };
        let build_ca_bundle = match bundle {
            Some(p) if p.as_os_str() == "none" => CaBundle::Keep,
            given => CaBundle::FirstOf(
                given
                    .into_iter()
                    .chain(l.env_path("SSL_CERT_FILE"))
                    .chain([PathBuf::from(SYSTEM_CA_BUNDLE)])
                    .collect(),
            ),
        };

        let user = match l.env_str("USER")? {
            Some(u) => u,
            None => match l.env_str("LOGNAME")? {
                Some(u) => u,
                None => {
                    // SAFETY: getuid has no preconditions and cannot fail.
                    let uid = unsafe { libc::getuid() };
                    format!("uid {uid}")
                }
            },
        };
        let registrant = format!("{user} (pid {})", std::process::id());

        let exec_output_cap = match &f.exec_output_cap {
            Some(Size::Bytes(n)) => Some(*n),
            Some(Size::Text(t)) => l.file_parse("exec_output_cap", Some(t), parse_size)?,
            None => None,
        };
        let factor = |key: &str, v: Option<f64>| -> Result<Option<f64>> {
            match v {
                Some(x) if !(x > 0.0 && x.is_finite()) => {
                    bail!("{}: {key} = {x}: must be a positive number", l.file_name())
                }
                v => Ok(v),
            }
        };
        let serve = ServeSettings {
            listen: f.listen.clone().unwrap_or_else(|| "127.0.0.1:7600".into()),
            metrics_listen: f.metrics_listen.clone(),
            node_name: l
                .env_str("STRATA_NODE_NAME")?
                .or_else(|| f.node_name.clone()),
            exec_output_cap: exec_output_cap.unwrap_or(16 << 20),
            memory_overcommit: factor("memory_overcommit", f.memory_overcommit)?.unwrap_or(1.0),
            cpu_overcommit: factor("cpu_overcommit", f.cpu_overcommit)?.unwrap_or(4.0),
            reap_every: l
                .file_parse("reap_every", f.reap_every.as_deref(), parse_duration)?
                .unwrap_or(Duration::from_secs(5)),
            default_lifetime: l.file_parse(
                "default_lifetime",
                f.default_lifetime.as_deref(),
                parse_duration,
            )?,
            journal_retention: l
                .file_parse(
                    "journal_retention",
                    f.journal_retention.as_deref(),
                    parse_duration,
                )?
                .unwrap_or(Duration::from_secs(24 * 3600)),
            hibernate_concurrency: match f.hibernate_concurrency {
                Some(0) => bail!(
                    "{}: hibernate_concurrency = 0: give at least 1",
                    l.file_name()
                ),
                Some(n) => n,
                None => 4,
            },
            e2b_listen: f.e2b_listen.clone(),
            e2b_domain: f.e2b_domain.clone(),
            e2b_tls_cert: f.e2b_tls_cert.clone(),
            e2b_tls_key: f.e2b_tls_key.clone(),
        };
        let server = match &flags.server {
            Some(s) => Some(s.clone()),
            None => l.env_str("STRATA_SERVER")?.or_else(|| f.server.clone()),
        };
        let token = l.env_str("STRATA_TOKEN")?;

        Ok(Settings {
            file: layers.path.clone(),
            log: l.env_str("STRATA_LOG")?.or_else(|| f.log.clone()),
            agent: l.env_path("STRATA_AGENT").or_else(|| l.file_path(&f.agent)),
            static_agent: l
                .env_path("STRATA_STATIC_AGENT")
                .or_else(|| l.file_path(&f.static_agent)),
            criu: l
                .env_path("STRATA_CRIU")
                .or_else(|| l.file_path(&f.criu))
                .or_else(strata_runtime::installed_criu),
            home,
            store,
            store_given,
            store_options,
            cache_max,
            erofs_mount,
            fetch_timeout,
            idle_detach,
            pool,
            oci_runtime,
            vm,
            registry: RegistrySettings {
                insecure,
                credentials,
            },
            build_ca_bundle,
            registrant,
            serve,
            server,
            token,
        })
    }

    /// The lazyfs daemon's directory.
    pub fn lazyfs_dir(&self) -> PathBuf {
        self.home.join("lazyfs")
    }

    /// The local runtime's state directory.
    pub fn runtime_dir(&self) -> PathBuf {
        self.home.join("runtime")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A fake environment.
    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<String, OsString> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |name| map.get(name).cloned()
    }

    fn load(flags: &GlobalFlags, daemon: &DaemonFlags, vars: &[(&str, &str)]) -> Result<Settings> {
        Settings::load(flags, daemon, &env_of(vars), false)
    }

    /// A home holding `strata.toml` with `text`.
    fn home_with(text: &str) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("strata.toml"), text).unwrap();
        let home = dir.path().display().to_string();
        (dir, home)
    }

    #[test]
    fn a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default() {
        let (_dir, home) = home_with(
            "store = \"/from/file\"\ncache_max = \"3G\"\npool = 5\nvm_accel = \"kvm\"\nfetch_timeout = \"2m\"\n",
        );
        let none = GlobalFlags::default();
        let flag = GlobalFlags {
            config: None,
            store: Some("/from/flag".into()),
            server: None,
        };
        let daemon = DaemonFlags {
            cache_max: Some(7),
            ..Default::default()
        };
        let env = [
            ("STRATA_HOME", home.as_str()),
            ("STRATA_STORE", "/from/env"),
            ("STRATA_CACHE_MAX", "2G"),
            ("STRATA_POOL", "4"),
        ];
        let only_home = [("STRATA_HOME", home.as_str())];

        // Flags over everything.
        let s = load(&flag, &daemon, &env).unwrap();
        assert_eq!(s.store, StoreUrl::Local("/from/flag".into()));
        assert_eq!(s.cache_max, 7);
        // The environment over the file.
        let s = load(&none, &DaemonFlags::default(), &env).unwrap();
        assert_eq!(s.store, StoreUrl::Local("/from/env".into()));
        assert_eq!(s.store_given.as_deref(), Some("/from/env"));
        assert_eq!(s.cache_max, 2 << 30);
        assert_eq!(s.pool, 4);
        // The file over the defaults.
        let s = load(&none, &DaemonFlags::default(), &only_home).unwrap();
        assert_eq!(s.file, Some(Path::new(&home).join("strata.toml")));
        assert_eq!(s.store, StoreUrl::Local("/from/file".into()));
        assert_eq!(s.cache_max, 3 << 30);
        assert_eq!(s.pool, 5);
        assert_eq!(s.vm.accel, "kvm");
        assert_eq!(s.fetch_timeout, Duration::from_secs(120));
        // The defaults: nothing set, no file in the home.
        let empty = tempfile::tempdir().unwrap();
        let empty_home = empty.path().display().to_string();
        let s = load(
            &none,
            &DaemonFlags::default(),
            &[("STRATA_HOME", &empty_home)],
        )
        .unwrap();
        assert_eq!(s.file, None);
        assert_eq!(s.home, empty.path());
        assert_eq!(s.store, StoreUrl::Local(empty.path().join("store")));
        assert_eq!(s.store_given, None);
        assert_eq!(s.cache_max, 10 << 30);
        assert_eq!(s.erofs_mount, ErofsMount::Auto);
        assert_eq!(s.fetch_timeout, Duration::from_secs(30));
        assert_eq!(s.idle_detach, Duration::from_secs(60));
        assert_eq!(s.pool, 2);
        assert_eq!(s.oci_runtime, OciRuntime::Crun("crun".into()));
        assert_eq!(s.vm.accel, "auto");
        assert!(s.vm.templates);
        assert_eq!(s.vm.qemu, Path::new("qemu-system-x86_64"));
        assert_eq!(s.vm.guest_dir, Path::new("/usr/local/lib/strata/guest"));
        assert_eq!(s.registry, RegistrySettings::default());
        assert_eq!(s.log, None);
        assert_eq!(s.store_options, StoreOptions::default());
    }

    #[test]
    fn every_key_of_the_file_is_read_and_its_relative_paths_are_the_files() {
        let (dir, home) = home_with(
            r#"
home = "state"
log = "debug"
erofs_mount = "loop"
idle_detach = "5m"
oci_runtime = "/usr/sbin/runc"
agent = "bin/strata-agent"
static_agent = "/opt/static-agent"
qemu = "/opt/qemu/bin/qemu-system-x86_64"
guest_dir = "guest"
vm_templates = false
registry_user = "bot"
registry_password = "secret"
insecure_registries = ["registry.lan:5000"]
build_ca_bundle = "proxy-ca.pem"
cache_max = 4096
store_concurrency = 12
store_range = "8M"
store_timeout = "1m"
"#,
        );
        let d = dir.path();
        // Given by --config, so the file's `home` counts (STRATA_HOME would beat it).
        let flags = GlobalFlags {
            config: Some(Path::new(&home).join("strata.toml")),
            store: None,
            server: None,
        };
        let s = load(&flags, &DaemonFlags::default(), &[]).unwrap();
        assert_eq!(s.home, d.join("state"));
        assert_eq!(s.store, StoreUrl::Local(d.join("state/store")));
        assert_eq!(s.log.as_deref(), Some("debug"));
        assert_eq!(s.erofs_mount, ErofsMount::Loop);
        assert_eq!(s.idle_detach, Duration::from_secs(300));
        assert_eq!(
            (
                s.store_options.concurrency,
                s.store_options.range_bytes,
                s.store_options.request_timeout
            ),
            (Some(12), Some(8 << 20), Some(Duration::from_secs(60)))
        );
        assert_eq!(s.oci_runtime, OciRuntime::Runc("/usr/sbin/runc".into()));
        assert_eq!(s.agent, Some(d.join("bin/strata-agent")));
        assert_eq!(s.static_agent, Some("/opt/static-agent".into()));
        assert_eq!(s.vm.qemu, Path::new("/opt/qemu/bin/qemu-system-x86_64"));
        assert_eq!(s.vm.guest_dir, d.join("guest"));
        assert!(!s.vm.templates);
        assert_eq!(
            s.registry,
            RegistrySettings {
                insecure: vec!["registry.lan:5000".into()],
                credentials: Some(RegistryCredentials {
                    user: "bot".into(),
                    password: "secret".into()
                }),
            }
        );
        assert_eq!(s.cache_max, 4096);
        assert_eq!(
            s.build_ca_bundle,
            CaBundle::FirstOf(vec![
                d.join("proxy-ca.pem"),
                PathBuf::from(SYSTEM_CA_BUNDLE)
            ])
        );
        // `none` is a word, not a path of the file's directory.
        let (_d2, home2) = home_with("build_ca_bundle = \"none\"\n");
        let s = load(
            &GlobalFlags::default(),
            &DaemonFlags::default(),
            &[("STRATA_HOME", &home2), ("SSL_CERT_FILE", "/x.pem")],
        )
        .unwrap();
        assert_eq!(s.build_ca_bundle, CaBundle::Keep);
    }

    #[test]
    fn an_unknown_key_is_refused_naming_the_file_the_key_and_the_valid_keys() {
        let (dir, home) = home_with("stroe = \"/srv/strata\"\n");
        let err = load(
            &GlobalFlags::default(),
            &DaemonFlags::default(),
            &[("STRATA_HOME", &home)],
        )
        .unwrap_err();
        let msg = format!("{err:#}");
        let file = dir.path().join("strata.toml").display().to_string();
        assert!(msg.contains(&file), "{msg}");
        assert!(msg.contains("unknown field `stroe`"), "{msg}");
        for key in ["`store`", "`cache_max`", "`vm_accel`", "`build_ca_bundle`"] {
            assert!(msg.contains(key), "{key} missing from: {msg}");
        }
        // A value of the wrong kind names its key too.
        let (_d, home) = home_with("vm_accel = \"fast\"\n");
        let msg = format!(
            "{:#}",
            load(
                &GlobalFlags::default(),
                &DaemonFlags::default(),
                &[("STRATA_HOME", &home)]
            )
            .unwrap_err()
        );
        assert!(msg.contains("vm_accel") && msg.contains("`tcg`"), "{msg}");
    }

    #[test]
    fn an_explicit_file_must_exist_and_wins_over_the_homes() {
        let (_dir, home) = home_with("store = \"/from/home-file\"\n");
        let missing = GlobalFlags {
            config: Some("/no/such/strata.toml".into()),
            store: None,
            server: None,
        };
        let msg = format!(
            "{:#}",
            load(&missing, &DaemonFlags::default(), &[("STRATA_HOME", &home)]).unwrap_err()
        );
        assert!(
            msg.contains("/no/such/strata.toml") && msg.contains("--config"),
            "{msg}"
        );
        let msg = format!(
            "{:#}",
            load(
                &GlobalFlags::default(),
                &DaemonFlags::default(),
                &[("STRATA_CONFIG", "/no/such/other.toml")]
            )
            .unwrap_err()
        );
        assert!(
            msg.contains("/no/such/other.toml") && msg.contains("STRATA_CONFIG"),
            "{msg}"
        );

        let other = tempfile::tempdir().unwrap();
        let file = other.path().join("site.toml");
        std::fs::write(&file, "store = \"/from/explicit\"\n").unwrap();
        let given = GlobalFlags {
            config: Some(file.clone()),
            store: None,
            server: None,
        };
        let s = load(&given, &DaemonFlags::default(), &[("STRATA_HOME", &home)]).unwrap();
        assert_eq!(s.file, Some(file.clone()));
        assert_eq!(s.store, StoreUrl::Local("/from/explicit".into()));
        // --config over STRATA_CONFIG.
        let s = load(
            &given,
            &DaemonFlags::default(),
            &[("STRATA_CONFIG", "/no/such/other.toml")],
        )
        .unwrap();
        assert_eq!(s.file, Some(file));
    }

    #[test]
    fn bad_environment_values_are_refused_naming_the_variable() {
        let empty = tempfile::tempdir().unwrap();
        let home = empty.path().display().to_string();
        for (var, value, needle) in [
            ("STRATA_POOL", "lots", "STRATA_POOL=lots"),
            (
                "STRATA_VM_ACCEL",
                "fast",
                "STRATA_VM_ACCEL=fast: use auto, kvm or tcg",
            ),
            ("STRATA_EROFS_MOUNT", "nfs", "STRATA_EROFS_MOUNT=nfs"),
            ("STRATA_CACHE_MAX", "big", "STRATA_CACHE_MAX=big"),
            ("STRATA_OCI_RUNTIME", "docker", "STRATA_OCI_RUNTIME"),
            (
                "STRATA_STORE",
                "relative/dir",
                "STRATA_STORE: store URL `relative/dir`",
            ),
            ("STRATA_REGISTRY_USER", "bot", "no password"),
            (
                "STRATA_STORE_CONCURRENCY",
                "0",
                "STRATA_STORE_CONCURRENCY=0: not a positive number of requests",
            ),
            (
                "STRATA_STORE_RANGE",
                "1",
                "store range size 1 is out of bounds",
            ),
            ("STRATA_STORE_TIMEOUT", "soon", "STRATA_STORE_TIMEOUT=soon"),
        ] {
            let msg = format!(
                "{:#}",
                load(
                    &GlobalFlags::default(),
                    &DaemonFlags::default(),
                    &[("STRATA_HOME", &home), (var, value)]
                )
                .unwrap_err()
            );
            assert!(msg.contains(needle), "{var}={value}: {msg}");
        }
        // Empty counts as unset; STRATA_VM_TEMPLATES=0 turns templates off.
        let s = load(
            &GlobalFlags::default(),
            &DaemonFlags::default(),
            &[
                ("STRATA_HOME", &home),
                ("STRATA_POOL", ""),
                ("STRATA_VM_TEMPLATES", "0"),
                ("STRATA_INSECURE_REGISTRIES", "a:5000, b"),
                ("STRATA_BUILD_CA_BUNDLE", "none"),
                ("AWS_DEFAULT_REGION", "eu-north-1"),
                ("USER", "alice"),
                ("STRATA_STORE_CONCURRENCY", "64"),
                ("STRATA_STORE_RANGE", "2M"),
                ("STRATA_STORE_TIMEOUT", "5s"),
            ],
        )
        .unwrap();
        assert_eq!(
            (
                s.store_options.concurrency,
                s.store_options.range_bytes,
                s.store_options.request_timeout
            ),
            (Some(64), Some(2 << 20), Some(Duration::from_secs(5)))
        );
        assert_eq!(s.pool, 2);
        assert!(!s.vm.templates);
        assert_eq!(s.registry.insecure, vec!["a:5000", "b"]);
        assert_eq!(s.build_ca_bundle, CaBundle::Keep);
        assert_eq!(s.store_options.region.as_deref(), Some("eu-north-1"));
        assert_eq!(s.registrant, format!("alice (pid {})", std::process::id()));
    }

    #[test]
    fn the_default_home_is_root_s_else_the_users_data_directory() {
        let env = env_of(&[("XDG_DATA_HOME", "/xdg"), ("HOME", "/home/u")]);
        assert_eq!(default_home(&env, true), Path::new("/var/lib/strata"));
        assert_eq!(default_home(&env, false), Path::new("/xdg/strata"));
        let env = env_of(&[("XDG_DATA_HOME", ""), ("HOME", "/home/u")]);
        assert_eq!(
            default_home(&env, false),
            Path::new("/home/u/.local/share/strata")
        );
        // The default file is looked for in the default home.
        let data = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(data.path().join("strata")).unwrap();
        std::fs::write(data.path().join("strata/strata.toml"), "pool = 9\n").unwrap();
        let xdg = data.path().display().to_string();
        let s = load(
            &GlobalFlags::default(),
            &DaemonFlags::default(),
            &[("XDG_DATA_HOME", &xdg)],
        )
        .unwrap();
        assert_eq!(s.home, data.path().join("strata"));
        assert_eq!(s.pool, 9);
    }

    #[test]
    fn the_ca_bundle_is_the_first_file_of_its_candidates() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("ca.pem");
        std::fs::write(&real, "pem").unwrap();
        let b = CaBundle::FirstOf(vec![dir.path().join("missing.pem"), real.clone()]);
        assert_eq!(b.host_bundle(), Some(real));
        assert_eq!(CaBundle::Keep.host_bundle(), None);
        assert_eq!(CaBundle::FirstOf(vec![]).host_bundle(), None);
    }

    #[test]
    fn the_service_settings_come_from_the_file_the_environment_and_the_flag() {
        let (_dir, home) = home_with(
            "listen = \"0.0.0.0:7000\"\nmetrics_listen = \"127.0.0.1:7001\"\nnode_name = \"file-node\"\nexec_output_cap = \"1M\"\nmemory_overcommit = 1.5\ncpu_overcommit = 8.0\nreap_every = \"2s\"\ndefault_lifetime = \"1h\"\njournal_retention = \"2h\"\nhibernate_concurrency = 8\ne2b_listen = \"127.0.0.1:3000\"\ne2b_domain = \"strata.test\"\nserver = \"http://file:7600\"\n",
        );
        let none = GlobalFlags::default();
        let s = load(&none, &DaemonFlags::default(), &[("STRATA_HOME", &home)]).unwrap();
        assert_eq!(
            s.serve,
            ServeSettings {
                listen: "0.0.0.0:7000".into(),
                metrics_listen: Some("127.0.0.1:7001".into()),
                node_name: Some("file-node".into()),
                exec_output_cap: 1 << 20,
                memory_overcommit: 1.5,
                cpu_overcommit: 8.0,
                reap_every: Duration::from_secs(2),
                default_lifetime: Some(Duration::from_secs(3600)),
                journal_retention: Duration::from_secs(7200),
                hibernate_concurrency: 8,
                e2b_listen: Some("127.0.0.1:3000".into()),
                e2b_domain: Some("strata.test".into()),
                e2b_tls_cert: None,
                e2b_tls_key: None,
            }
        );
        assert_eq!(s.server.as_deref(), Some("http://file:7600"));
        assert_eq!(s.token, None);
        let env = [
            ("STRATA_HOME", home.as_str()),
            ("STRATA_SERVER", "http://env:7600"),
            ("STRATA_TOKEN", "strata_x"),
            ("STRATA_NODE_NAME", "env-node"),
        ];
        let s = load(&none, &DaemonFlags::default(), &env).unwrap();
        assert_eq!(s.server.as_deref(), Some("http://env:7600"));
        assert_eq!(s.token.as_deref(), Some("strata_x"));
        assert_eq!(s.serve.node_name.as_deref(), Some("env-node"));
        let flag = GlobalFlags {
            server: Some("http://flag:7600".into()),
            ..Default::default()
        };
        let s = load(&flag, &DaemonFlags::default(), &env).unwrap();
        assert_eq!(s.server.as_deref(), Some("http://flag:7600"));
        // The defaults, and a refused factor.
        let empty = tempfile::tempdir().unwrap();
        let s = load(
            &none,
            &DaemonFlags::default(),
            &[("STRATA_HOME", &empty.path().display().to_string())],
        )
        .unwrap();
        assert_eq!(s.serve.listen, "127.0.0.1:7600");
        assert_eq!(s.serve.exec_output_cap, 16 << 20);
        assert_eq!(
            (s.serve.memory_overcommit, s.serve.cpu_overcommit),
            (1.0, 4.0)
        );
        assert_eq!(s.server, None);
        let (_bad, bad_home) = home_with("cpu_overcommit = -1.0\n");
        let e = load(
            &none,
            &DaemonFlags::default(),
            &[("STRATA_HOME", &bad_home)],
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("cpu_overcommit"), "{e:#}");
    }
}
