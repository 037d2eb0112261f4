//! The node: the runtime, catalog, store and projects one service owns, the sandboxes it
//! made (by project), admission, and the reaper. The gRPC layers (`*_api.rs`,
//! `sandboxes.rs`) translate requests into calls here; nothing here knows about gRPC.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_catalog::{Backend, Budgets, Catalog};
use strata_runtime::{EndReason, Overrides, Runtime, Sandbox, SandboxSpec};
use strata_store::Store;

use crate::admission::{self, Ask, Capacity};
use crate::error::ServiceError;
use crate::metrics::Metrics;
use crate::projects::{Caller, Projects};
use crate::state::{Meta, MetaDir};
use crate::ServiceConfig;

/// A node's size, from which admission's capacity follows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NodeSize {
    pub memory_bytes: u64,
    pub cores: u32,
}

impl NodeSize {
    /// This host's memory (`MemTotal`) and online cores.
    pub fn probe() -> NodeSize {
        let memory_bytes = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
            .map(|kb| kb << 10)
            .unwrap_or(0);
        let cores = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        NodeSize {
            memory_bytes,
            cores,
        }
    }
}

/// What a create asks for, beyond the catalog ID.
#[derive(Debug, Clone, Default)]
pub struct CreateArgs {
    pub catalog_id: String,
    pub backend: Option<Backend>,
    pub budgets: Budgets,
    pub env: BTreeMap<String, String>,
    pub network: Option<Vec<String>>,
    pub lifetime: Option<Duration>,
    pub labels: BTreeMap<String, String>,
    /// Its ports may be reached from outside (see [`Meta::inbound`]).
    pub inbound: bool,
}

/// A VM's memory is its budget plus the machine's own (see the runtime's VM shapes).
const VM_OVERHEAD: u64 = 128 << 20;

pub struct Node {
    cfg: ServiceConfig,
    pub(crate) rt: Runtime,
    pub(crate) store: Store,
    pub(crate) catalog: Catalog,
    pub(crate) projects: Projects,
    pub(crate) journal: crate::journal::Journal,
    metas: MetaDir,
    sandboxes: Mutex<HashMap<String, Meta>>,
    size: NodeSize,
    pub(crate) metrics: Metrics,
    registrant: String,
    /// A pool top-up is running: creates finishing meanwhile leave it to that one (each
    /// filling to the target at once would overshoot it).
    topping_up: std::sync::atomic::AtomicBool,
    /// `service/lock`, held while this service lives: one service per node's state.
    _service_lock: std::fs::File,
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Takes `dir/lock` for this process, which then writes its PID there. Two services over
/// one node's state would each take the other's sandboxes for ones an earlier service
/// left, and end them. A predecessor that was just killed may hold the lock a moment
/// longer through a child it forked that has not yet exec'd (the lock is shared across a
/// fork): waited for up to 5 s.
fn take_node_lock(dir: &std::path::Path) -> Result<std::fs::File, ServiceError> {
    use std::io::{Read, Seek, Write};
    let io = |what: String| move |source| ServiceError::Io { what, source };
    std::fs::create_dir_all(dir).map_err(io(format!("making {}", dir.display())))?;
    let path = dir.join("lock");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io(format!("opening {}", path.display())))?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let locked = strata_host::fs::flock(&file, strata_host::fs::Lock::Exclusive, false)
            .map_err(io(format!("locking {}", path.display())))?;
        if locked {
            break;
        }
        if Instant::now() >= deadline {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            return Err(ServiceError::AlreadyExists(format!(
                "another `strata serve` (PID {}) serves this node's state ({}): stop it first, \
                 or give this one a home of its own (STRATA_HOME)",
                if holder.is_empty() { "unknown" } else { holder },
                dir.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let pid = std::process::id();
    file.set_len(0)
        .and_then(|_| file.rewind())
        .and_then(|_| writeln!(file, "{pid}"))
        .map_err(io(format!("writing {}", path.display())))?;
    Ok(file)
}

impl Node {
    /// Takes the runtime (opened without its reap at open), takes back the sandboxes an
    /// earlier service left that still live, ends those that did not survive with
    /// `node-restart`, then reaps the rest of the host once.
    pub async fn start(
        cfg: ServiceConfig,
        rt: Runtime,
        store: Store,
        registrant: String,
    ) -> Result<Arc<Node>, ServiceError> {
        crate::check_node_name(&cfg.node)?;
        let service_dir = rt.state_dir().join("service");
        let dir = service_dir.clone();
        let service_lock = tokio::task::spawn_blocking(move || take_node_lock(&dir))
            .await
            .map_err(|e| ServiceError::Internal(e.to_string()))??;
        let catalog = Catalog::open(&store).await?;
        let metas = MetaDir::open(&service_dir.join("sandboxes"))?;
        let size = cfg.node_size.unwrap_or_else(NodeSize::probe);
        let node = Arc::new(Node {
            projects: Projects::new(&store),
            journal: crate::journal::Journal::new(&store, &cfg.node, cfg.journal_retention),
            metrics: Metrics::new(),
            cfg,
            rt,
            store,
            catalog,
            metas,
            sandboxes: Mutex::new(HashMap::new()),
            size,
            registrant,
            topping_up: Default::default(),
            _service_lock: service_lock,
        });
        let n = node.clone();
        tokio::task::spawn_blocking(move || n.recover())
            .await
            .map_err(|e| ServiceError::Internal(e.to_string()))??;
        node.sweep_journals().await;
        Ok(node)
    }

    /// Where `Layers.Build` receives tars.
    pub fn uploads_dir(&self) -> std::path::PathBuf {
        self.rt.state_dir().join("service").join("uploads")
    }

    fn recover(&self) -> Result<(), ServiceError> {
        // Tars of builds an earlier service did not finish.
        let _ = std::fs::remove_dir_all(self.uploads_dir());
        let (mut kept, mut ended) = (0, 0);
        for meta in self.metas.load_all() {
            match self.rt.get(&meta.local) {
                Ok(sb) if sb.id() == meta.local && sb.is_alive() => {
                    kept += 1;
                    self.lock().insert(meta.local.clone(), meta);
                }
                Ok(sb) if sb.id() == meta.local => {
                    ended += 1;
                    if let Err(e) = sb.end(EndReason::NodeRestart) {
                        tracing::warn!("ending {} after the restart: {e}", meta.id);
                    }
                    self.metas.remove(&meta.local);
                }
                _ => {
                    // Gone meanwhile (destroyed by hand, or reaped): nothing to end.
                    self.metas.remove(&meta.local);
                }
            }
        }
        // A service killed between making a sandbox and saving its record left one no
        // client can reach (its ID was never returned): a caller's sandbox with no
        // record is this node's to end. Local CLI users' sandboxes are theirs.
        let held: std::collections::HashSet<String> = self.lock().keys().cloned().collect();
        for rec in self.rt.list() {
            if held.contains(&rec.id) || !crate::projects::is_service_identity(&rec.spec.identity) {
                continue;
            }
            if let Ok(sb) = self.rt.get(&rec.id) {
                ended += 1;
                if let Err(e) = sb.end(EndReason::NodeRestart) {
                    tracing::warn!(
                        "ending {} (no record of the service's) after the restart: {e}",
                        rec.id
                    );
                }
            }
        }
        let report = self.rt.reap_report()?;
        tracing::info!(kept, ended, reaped = ?report, "took back the node's sandboxes");
        Ok(())
    }

    pub fn config(&self) -> &ServiceConfig {
        &self.cfg
    }

    pub fn size(&self) -> NodeSize {
        self.size
    }

    /// What admission allows on this node.
    pub fn capacity(&self) -> Capacity {
        Capacity {
            memory_bytes: (self.size.memory_bytes as f64 * self.cfg.memory_overcommit) as u64,
            cpus: f64::from(self.size.cores) * self.cfg.cpu_overcommit,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Meta>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every sandbox the service holds (pending creates included).
    pub fn metas(&self) -> Vec<Meta> {
        self.lock().values().cloned().collect()
    }

    /// The client-facing ID of a runtime sandbox.
    fn external_id(&self, local: &str) -> String {
        format!("{}-{local}", self.cfg.node)
    }

    /// The caller's sandbox `id`: refused as not found when it is another project's, so a
    /// token cannot even learn which IDs exist.
    pub fn meta_for(&self, caller: &Caller, id: &str) -> Result<Meta, ServiceError> {
        let not_found = || {
            ServiceError::NotFound(format!(
                "no sandbox `{id}` in project `{}` on node `{}`",
                caller.project.name, self.cfg.node
            ))
        };
        let local = id
            .strip_prefix(&self.cfg.node)
            .and_then(|r| r.strip_prefix('-'))
            .ok_or_else(|| {
                if id.contains('-') {
                    ServiceError::NotFound(format!(
                        "sandbox `{id}` is not on this node (`{}`): its ID names the node that holds it",
                        self.cfg.node
                    ))
                } else {
                    not_found()
                }
            })?;
        let meta = self.lock().get(local).cloned().ok_or_else(not_found)?;
        if meta.project != caller.project.name || meta.pending {
            return Err(not_found());
        }
        Ok(meta)
    }

    /// A live sandbox by its client-facing ID, whichever project owns it (for callers
    /// that prove a sandbox's own credential instead of a project's token).
    pub(crate) fn meta_by_id(&self, id: &str) -> Option<Meta> {
        let local = id.strip_prefix(&self.cfg.node)?.strip_prefix('-')?;
        self.lock().get(local).filter(|m| !m.pending).cloned()
    }

    /// The runtime's state directory (the service keeps its own files under `service/`).
    pub fn state_dir(&self) -> std::path::PathBuf {
        self.rt.state_dir().to_path_buf()
    }

    /// The runtime's sandbox behind `meta`, running: a hibernated one is admitted to the
    /// node again (RESOURCE_EXHAUSTED when its budgets no longer fit) and woken. Touching it restarts
    /// its idle TTL.
    pub fn sandbox(&self, meta: &Meta) -> Result<Sandbox, ServiceError> {
        let sb = self.handle(meta)?;
        if asleep(meta, &sb) {
            self.wake(meta, &sb)?;
        }
        Ok(sb)
    }

    /// [`Self::sandbox`] for an async caller: the handle is made right here (a stat and a
    /// read of the sandbox's small record, and its idle mark), and only a hibernated
    /// sandbox's wake goes to the blocking pool. A hand-off to the pool and back wakes two
    /// threads, and on a VM host without halt polling each wake-up of an idle CPU is
    /// a good part of a small command's time.
    pub async fn running(self: &Arc<Self>, meta: &Meta) -> Result<Sandbox, ServiceError> {
        let sb = self.handle(meta)?;
        if asleep(meta, &sb) {
            let (node, m, s) = (self.clone(), meta.clone(), sb.clone());
            crate::blocking(move || node.wake(&m, &s)).await?;
        }
        Ok(sb)
    }

    /// Wakes the hibernated sandbox `sb` behind `meta` if the node's capacity takes its
    /// budgets again (the project's quota never stopped counting them).
    fn wake(&self, meta: &Meta, sb: &Sandbox) -> Result<(), ServiceError> {
        {
            let map = self.lock();
            admission::fits_node(
                map.values().filter(|m| m.local != meta.local),
                Ask {
                    memory_bytes: meta.memory_bytes,
                    cpus: meta.cpus,
                },
                self.capacity(),
                self.cfg.retry_after,
            )
            .inspect_err(|e| {
                if let ServiceError::Exhausted { reason, .. } = e {
                    self.metrics.refused(reason);
                }
            })?;
        }
        let t = Instant::now();
        sb.wake()?;
        self.metrics
            .observe_wake(meta.backend.as_str(), t.elapsed());
        self.update(&meta.local, |m| m.hibernated = false)?;
        Ok(())
    }

    /// Hibernates the sandbox behind `meta` (blocking): its budgets stop counting. Busy
    /// when a command still runs after `wait` (`None`: the runtime's default wait).
    pub fn hibernate(
        &self,
        meta: &Meta,
        wait: Option<Duration>,
    ) -> Result<strata_runtime::HibernateInfo, ServiceError> {
        let sb = self.handle(meta)?;
        let t = Instant::now();
        let info = match wait {
            Some(w) => sb.hibernate_waiting(w)?,
            None => sb.hibernate()?,
        };
        self.metrics
            .observe_hibernate(meta.backend.as_str(), t.elapsed());
        self.update(&meta.local, |m| m.hibernated = true)?;
        Ok(info)
    }

    /// Hibernates the sandboxes behind `metas`, at most `hibernate_concurrency` at once
    /// (the node's disk takes their memory images); each one's outcome, by ID.
    pub async fn hibernate_many(
        self: &Arc<Self>,
        metas: Vec<Meta>,
    ) -> Vec<(String, Result<strata_runtime::HibernateInfo, ServiceError>)> {
        let gate = Arc::new(tokio::sync::Semaphore::new(
            self.cfg.hibernate_concurrency.max(1),
        ));
        let tasks: Vec<_> = metas
            .into_iter()
            .map(|meta| {
                let (node, gate) = (self.clone(), gate.clone());
                tokio::spawn(async move {
                    let _permit = gate.acquire_owned().await;
                    let id = meta.id.clone();
                    let r = tokio::task::spawn_blocking(move || node.hibernate(&meta, None))
                        .await
                        .map_err(|e| ServiceError::Internal(e.to_string()))
                        .and_then(|r| r);
                    (id, r)
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            match t.await {
                Ok(done) => out.push(done),
                Err(e) => tracing::warn!("a hibernation task failed: {e}"),
            }
        }
        out
    }

    /// The runtime's handle on the sandbox behind `meta`, as it is (hibernated or not).
    pub fn handle(&self, meta: &Meta) -> Result<Sandbox, ServiceError> {
        let sb = self.rt.get(&meta.local).map_err(|e| match e {
            strata_runtime::RuntimeError::NotFound(_) => {
                self.forget(&meta.local);
                ServiceError::NotFound(format!("sandbox `{}` has ended (see its audit)", meta.id))
            }
            e => e.into(),
        })?;
        if sb.id() != meta.local {
            return Err(ServiceError::NotFound(format!(
                "sandbox `{}` has ended",
                meta.id
            )));
        }
        sb.touch();
        Ok(sb)
    }

    fn forget(&self, local: &str) {
        self.lock().remove(local);
        self.metas.remove(local);
    }

    /// Changes the service's record of a live sandbox (paused, lifetime, idle TTL) and
    /// saves it.
    pub fn update(
        &self,
        local: &str,
        change: impl FnOnce(&mut Meta),
    ) -> Result<Meta, ServiceError> {
        let m = {
            let mut map = self.lock();
            let meta = map
                .get_mut(local)
                .ok_or_else(|| ServiceError::NotFound(format!("sandbox {local} has ended")))?;
            change(meta);
            meta.clone()
        };
        self.metas.save(&m)?;
        Ok(m)
    }

    /// Pauses or resumes the sandbox behind `meta`, and records which it is (blocking).
    pub fn set_paused(&self, meta: &Meta, paused: bool) -> Result<Meta, ServiceError> {
        let sb = self.sandbox(meta)?;
        if paused {
            sb.pause()?;
        } else {
            sb.resume()?;
        }
        self.update(&meta.local, |m| m.paused = paused)
    }

    /// Replaces a running sandbox's egress allowlist (`HOST:PORT` rules and rule sets;
    /// blocking).
    pub fn set_network(&self, meta: &Meta, rules: &[String]) -> Result<(), ServiceError> {
        let rules = strata_runtime::NetRule::parse_all(rules)
            .map_err(|e| ServiceError::invalid("network", e.to_string()))?;
        let mut sb = self.sandbox(meta)?;
        sb.set_network(rules)?;
        Ok(())
    }

    /// Sets the idle TTL, and the lifetime to end `lifetime` from now, where given
    /// (blocking).
    pub fn extend(
        &self,
        meta: &Meta,
        idle_ttl: Option<Duration>,
        lifetime: Option<Duration>,
    ) -> Result<Meta, ServiceError> {
        let mut sb = self.handle(meta)?;
        if let Some(t) = idle_ttl {
            sb.set_idle_ttl(t)?;
        }
        self.update(&meta.local, |m| {
            if let Some(l) = lifetime {
                m.expires_ms = Some(now_ms() + l.as_millis() as u64);
            }
            if let Some(t) = idle_ttl {
                m.idle_ttl_ms = t.as_millis() as u64;
            }
        })
    }

    /// Resolves, admits and creates a sandbox for `caller`.
    pub async fn create(
        self: &Arc<Self>,
        caller: &Caller,
        args: CreateArgs,
    ) -> Result<Meta, ServiceError> {
        let started = Instant::now();
        let reg = self
            .catalog
            .get(&args.catalog_id)
            .await
            .map_err(|e| match e {
                strata_catalog::CatalogError::Invalid(m) => ServiceError::invalid("catalog_id", m),
                e => e.into(),
            })?;
        let over = Overrides {
            backend: args.backend,
            budgets: args.budgets.clone(),
            env: args.env.clone(),
            network: args.network.clone(),
            identity: Some(caller.identity()),
            display: false,
            privileged: false,
        };
        let spec = SandboxSpec::resolve(&reg, &over).map_err(|e| match e {
            strata_runtime::RuntimeError::Invalid(m) => ServiceError::invalid("budgets", m),
            e => e.into(),
        })?;
        let node = self.clone();
        let s = spec.clone();
        let make = crate::blocking(move || Ok(node.rt.create(s)?));
        self.admit_and_record_detached(caller, spec, args, started, serde_json::json!({}), make)
            .await
    }

    /// [`Self::admit_and_record`] on a task of its own: a client that goes away mid-way
    /// (its deadline, a dropped connection) does not cut the create off between the
    /// sandbox being made and its record, so the node never holds a sandbox the service
    /// does not know (it answers no one, and the reaper ends it by its TTL).
    async fn admit_and_record_detached(
        self: &Arc<Self>,
        caller: &Caller,
        spec: SandboxSpec,
        args: CreateArgs,
        started: Instant,
        audit: serde_json::Value,
        make: impl std::future::Future<Output = Result<Sandbox, ServiceError>> + Send + 'static,
    ) -> Result<Meta, ServiceError> {
        let (node, caller) = (self.clone(), caller.clone());
        crate::detached(async move {
            node.admit_and_record(&caller, &spec, &args, started, audit, make)
                .await
        })
        .await
    }

    /// Admits a sandbox of `spec` for `caller` (its project's backends and quota, the
    /// node's capacity), makes it with `make`, and records it with `args`' labels,
    /// lifetime and reach; `audit` adds to its service audit record.
    async fn admit_and_record(
        self: &Arc<Self>,
        caller: &Caller,
        spec: &SandboxSpec,
        args: &CreateArgs,
        started: Instant,
        audit: serde_json::Value,
        make: impl std::future::Future<Output = Result<Sandbox, ServiceError>>,
    ) -> Result<Meta, ServiceError> {
        self.check_backend(caller, spec.backend)?;
        let memory_bytes = spec.limits.memory_bytes
            + if matches!(spec.backend, Backend::Microvm | Backend::Vm) {
                VM_OVERHEAD
            } else {
                0
            };
        // An unthrottled sandbox counts as one CPU.
        let cpus = spec.limits.cpus.unwrap_or(1.0);
        let lifetime = args.lifetime.or(self.cfg.default_lifetime);
        let mut meta = Meta {
            id: String::new(),
            local: String::new(),
            project: caller.project.name.clone(),
            token: caller.token.clone(),
            catalog_ref: spec.catalog_ref.clone(),
            backend: spec.backend,
            labels: args.labels.clone(),
            created_ms: now_ms(),
            expires_ms: lifetime.map(|l| now_ms() + l.as_millis() as u64),
            memory_bytes,
            cpus,
            disk_bytes: spec.limits.disk_bytes,
            idle_ttl_ms: spec.limits.idle_ttl.as_millis() as u64,
            paused: false,
            hibernated: false,
            inbound: args.inbound,
            pending: true,
        };
        let pending = self.admit_pending(caller, &meta, 1)?;
        let resolved_ms = started.elapsed().as_secs_f64() * 1e3;
        let made = make.await;
        self.release(&pending);
        let sb = made?;
        meta.local = sb.id().to_string();
        meta.id = self.external_id(sb.id());
        meta.pending = false;
        if let Err(e) = self.metas.save(&meta) {
            let _ = sb.destroy();
            return Err(e);
        }
        let mut record = serde_json::json!({"id": meta.id, "project": meta.project,
            "token": meta.token, "labels": meta.labels, "expires_ms": meta.expires_ms});
        if let (Some(r), serde_json::Value::Object(extra)) = (record.as_object_mut(), audit) {
            r.extend(extra);
        }
        let _ = self.rt.audit(sb.id()).record("service", record);
        self.lock().insert(meta.local.clone(), meta.clone());
        tracing::debug!(
            sandbox = %meta.id,
            resolved_ms,
            total_ms = started.elapsed().as_secs_f64() * 1e3,
            "created"
        );
        self.metrics
            .observe_create(meta.backend.as_str(), started.elapsed());
        if self.cfg.pool > 0 {
            let node = self.clone();
            let (backend, disk) = (meta.backend, meta.disk_bytes);
            tokio::task::spawn_blocking(move || node.top_up(backend, disk));
        }
        Ok(meta)
    }

    /// Where snapshots' machine files wait while they go to or come from the store.
    fn snapshot_work(&self) -> std::path::PathBuf {
        self.rt.state_dir().join("service").join("snapshots")
    }

    /// Takes a snapshot of the caller's sandbox into the store (see [`crate::snapshot`]).
    pub async fn snapshot_to_store(
        self: &Arc<Self>,
        caller: &Caller,
        meta: &Meta,
        names: Vec<String>,
        files_only: bool,
    ) -> Result<crate::snapshot::StoredSnapshot, ServiceError> {
        if let Some(max) = caller.project.max_snapshot_storage {
            let held: u64 = crate::snapshot::list(&self.store, Some(&caller.project.name))
                .await?
                .iter()
                .map(|s| s.stored_bytes)
                .sum();
            if held >= max {
                self.metrics.refused("snapshot-storage");
                return Err(ServiceError::Exhausted {
                    reason: "snapshot-storage",
                    message: format!(
                        "project `{}`'s snapshots hold {:.1} MiB of its {:.1} MiB (--max-snapshot-storage): remove some (`strata snapshot rm`)",
                        caller.project.name,
                        held as f64 / 1_048_576.0,
                        max as f64 / 1_048_576.0
                    ),
                    retry_after: self.cfg.retry_after,
                });
            }
        }
        let sb = self.running(meta).await?;
        crate::snapshot::take(
            &self.store,
            &sb,
            &self.snapshot_work(),
            &crate::snapshot::TakeRequest {
                sandbox: meta.id.clone(),
                project: caller.project.name.clone(),
                taken_by: self.registrant(caller),
                names,
                files_only,
            },
        )
        .await
    }

    /// The caller's snapshot `id` (another project's is not found).
    pub async fn snapshot_of(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<crate::snapshot::StoredSnapshot, ServiceError> {
        let snap = crate::snapshot::get(&self.store, id).await?;
        if snap.project != caller.project.name {
            return Err(ServiceError::NotFound(format!(
                "no snapshot {id} in project `{}`",
                caller.project.name
            )));
        }
        Ok(snap)
    }

    /// Starts a sandbox from the caller's snapshot `id`, admitted as a create is; `args`
    /// gives its labels and lifetime (its catalog ID and budgets are the snapshot's).
    pub async fn restore(
        self: &Arc<Self>,
        caller: &Caller,
        id: &str,
        args: CreateArgs,
    ) -> Result<Meta, ServiceError> {
        let started = Instant::now();
        let snap = self.snapshot_of(caller, id).await?;
        let node = self.clone();
        let (s, identity) = (snap.clone(), caller.identity());
        let make = async move {
            crate::snapshot::restore(&node.store, &node.rt, &s, &identity, &node.snapshot_work())
                .await
        };
        self.admit_and_record_detached(
            caller,
            snap.spec.clone(),
            args,
            started,
            serde_json::json!({"restored_from": snap.id}),
            make,
        )
        .await
    }

    /// Forks the caller's sandbox `parent` into `count` children (see [`crate::fork`]),
    /// each admitted as a create would be (all before any is made) and recorded with the
    /// parent's project, labels and lifetime end. Whether they kept its processes. Runs on
    /// a task of its own, as a create does (see [`Self::admit_and_record_detached`]).
    pub async fn fork(
        self: &Arc<Self>,
        caller: &Caller,
        parent: &Meta,
        count: usize,
    ) -> Result<(Vec<Meta>, bool, f64), ServiceError> {
        let (node, caller, parent) = (self.clone(), caller.clone(), parent.clone());
        crate::detached(async move { node.fork_now(&caller, &parent, count).await }).await
    }

    async fn fork_now(
        self: &Arc<Self>,
        caller: &Caller,
        parent: &Meta,
        count: usize,
    ) -> Result<(Vec<Meta>, bool, f64), ServiceError> {
        crate::fork::check_count(count)?;
        let template = Meta {
            created_ms: now_ms(),
            paused: false,
            hibernated: false,
            pending: true,
            ..parent.clone()
        };
        let pending = self.admit_pending(caller, &template, count)?;
        let made = async {
            let sb = self.running(parent).await?;
            crate::fork::fork(&self.store, &self.rt, &sb, count, &self.registrant(caller)).await
        }
        .await;
        self.release(&pending);
        let forked = made?;
        let mut metas = Vec::new();
        for sb in forked.children {
            let meta = Meta {
                local: sb.id().to_string(),
                id: self.external_id(sb.id()),
                pending: false,
                ..template.clone()
            };
            if let Err(e) = self.metas.save(&meta) {
                let _ = sb.destroy();
                return Err(e);
            }
            let _ = sb.audit().record(
                "service",
                serde_json::json!({"id": meta.id, "project": meta.project, "token": meta.token,
                                   "labels": meta.labels, "expires_ms": meta.expires_ms,
                                   "forked_from": parent.id}),
            );
            self.lock().insert(meta.local.clone(), meta.clone());
            metas.push(meta);
        }
        Ok((metas, forked.processes, forked.millis))
    }

    /// Grades the caller's sandbox `meta` with its entry's `command` (see
    /// [`crate::evaluate`]): the evaluation sandbox must be of a backend the project may
    /// use, and is admitted as a sandbox of the project's while it runs. A request that
    /// cannot be graded is refused as such before any admission.
    pub async fn evaluate(
        self: &Arc<Self>,
        caller: &Caller,
        meta: &Meta,
        command: &str,
        backend: Option<Backend>,
    ) -> Result<crate::evaluate::Evaluation, ServiceError> {
        let grading =
            crate::evaluate::Grading::of(&self.catalog, &meta.catalog_ref, &meta.id, command)
                .await?;
        let backend = grading.backend(meta.backend, backend);
        self.check_backend(caller, backend)?;
        let (node, caller, meta) = (self.clone(), caller.clone(), meta.clone());
        crate::detached(async move {
            let pending = node.admit_pending(&caller, &meta, 1)?;
            let graded = async {
                let sb = node.running(&meta).await?;
                crate::evaluate::evaluate(
                    &node.store,
                    &node.rt,
                    &sb,
                    &grading,
                    &crate::evaluate::EvaluateRequest {
                        backend,
                        identity: caller.identity(),
                        keep_output: node.cfg.output_cap,
                    },
                )
                .await
            }
            .await;
            node.release(&pending);
            graded
        })
        .await
    }

    /// Refuses a backend the caller's project may not use.
    fn check_backend(&self, caller: &Caller, backend: Backend) -> Result<(), ServiceError> {
        if caller.project.allows_backend(backend) {
            return Ok(());
        }
        self.metrics.refused("backend");
        Err(ServiceError::PermissionDenied(format!(
            "project `{}` may not use the {} backend (it may use: {})",
            caller.project.name,
            backend.as_str(),
            caller
                .project
                .backends
                .iter()
                .map(|b| b.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )))
    }

    /// Admits `count` sandboxes like `like` (its memory and CPUs) for `caller` against its
    /// project's quota and the node's capacity, all or none, and holds them as pending
    /// records under fresh local names until [`Self::release`]d: later admissions count
    /// them while they are being made.
    fn admit_pending(
        &self,
        caller: &Caller,
        like: &Meta,
        count: usize,
    ) -> Result<Vec<String>, ServiceError> {
        let ask = Ask {
            memory_bytes: like.memory_bytes,
            cpus: like.cpus,
        };
        let mut map = self.lock();
        let mut pending = Vec::with_capacity(count);
        for _ in 0..count {
            let admitted = admission::admit(
                map.values(),
                &caller.project,
                ask,
                self.capacity(),
                self.cfg.retry_after,
            );
            if let Err(e) = admitted {
                if let ServiceError::Exhausted { reason, .. } = &e {
                    self.metrics.refused(reason);
                }
                for l in &pending {
                    map.remove(l);
                }
                return Err(e);
            }
            let local = format!("pending-{}", uuid::Uuid::new_v4().simple());
            map.insert(
                local.clone(),
                Meta {
                    local: local.clone(),
                    pending: true,
                    ..like.clone()
                },
            );
            pending.push(local);
        }
        Ok(pending)
    }

    /// Drops pending records [`Self::admit_pending`] made.
    fn release(&self, pending: &[String]) {
        let mut map = self.lock();
        for l in pending {
            map.remove(l);
        }
    }

    fn top_up(&self, backend: Backend, disk: u64) {
        use std::sync::atomic::Ordering;
        if self.topping_up.swap(true, Ordering::AcqRel) {
            return;
        }
        self.fill_pools(backend, disk);
        self.topping_up.store(false, Ordering::Release);
    }

    fn fill_pools(&self, backend: Backend, disk: u64) {
        if matches!(backend, Backend::Fncall | Backend::Container) {
            if let Err(e) = self.rt.fill_uppers(disk, self.cfg.pool) {
                tracing::warn!("filling the upper pool: {e}");
            }
        }
        if backend == Backend::Fncall {
            if let Err(e) = self.rt.fill_pool(self.cfg.pool) {
                tracing::warn!("filling the fncall pool: {e}");
            }
        }
    }

    /// Ends a sandbox, recording `reason`; its journal's retention starts.
    pub fn end(&self, meta: &Meta, reason: EndReason) -> Result<(), ServiceError> {
        let result = match self.rt.get(&meta.local) {
            Ok(sb) if sb.id() == meta.local => sb.end(reason).map_err(ServiceError::from),
            Ok(_) | Err(strata_runtime::RuntimeError::NotFound(_)) => Ok(()),
            Err(e) => Err(e.into()),
        };
        self.forget(&meta.local);
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let (journal, id) = (self.journal.clone(), meta.id.clone());
            handle.spawn(async move {
                if let Err(e) = journal.ended(&id).await {
                    tracing::warn!("dating the end of {id}'s journal: {e}");
                }
            });
        }
        self.metrics.ended(reason.as_str());
        result
    }

    /// One reaper pass: lifetimes, then the runtime's own reap (idle TTLs, crashed
    /// sandboxes, leftovers), then forgetting what the runtime no longer has.
    pub fn reap_once(&self) -> Result<(), ServiceError> {
        let now = now_ms();
        let expired: Vec<Meta> = self
            .lock()
            .values()
            .filter(|m| !m.pending && m.expires_ms.is_some_and(|e| e <= now))
            .cloned()
            .collect();
        for m in expired {
            tracing::info!(sandbox = %m.id, "lifetime over");
            if let Err(e) = self.end(&m, EndReason::Lifetime) {
                tracing::warn!("ending {} at the end of its lifetime: {e}", m.id);
            }
        }
        let report = self.rt.reap_report()?;
        for local in &report.hibernated {
            if let Err(e) = self.update(local, |m| m.hibernated = true) {
                tracing::warn!("recording the hibernation of {local}: {e}");
            }
        }
        for _ in &report.expired {
            self.metrics.ended(EndReason::IdleTtl.as_str());
        }
        for _ in &report.crashed {
            self.metrics.ended(EndReason::Crashed.as_str());
        }
        // What the runtime no longer has (reaped above, or ended by hand) is forgotten;
        // each checked now, after the reap, so a create finishing meanwhile is kept.
        let known: Vec<String> = self
            .lock()
            .values()
            .filter(|m| !m.pending)
            .map(|m| m.local.clone())
            .collect();
        for local in known {
            if matches!(
                self.rt.get(&local),
                Err(strata_runtime::RuntimeError::NotFound(_))
            ) {
                self.forget(&local);
            }
        }
        Ok(())
    }
}

/// Runs the sandbox's own tool (`rm`, `mkdir`, `mv`) for a file operation the runtime has
/// no call for; its exit and stderr are the answer.
pub(crate) fn run_tool(sb: &Sandbox, argv: Vec<String>, what: &str) -> Result<(), ServiceError> {
    let req = strata_runtime::ExecRequest {
        argv,
        keep_output: Some(4096),
        timeout: Some(Duration::from_secs(60)),
        ..Default::default()
    };
    let r = sb.exec(&req)?;
    if r.status_code() == 0 {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&r.stderr).trim().to_string();
    if err.contains("No such file") {
        return Err(ServiceError::NotFound(format!("{what}: {err}")));
    }
    Err(ServiceError::invalid("path", format!("{what}: {err}")))
}

/// How often the reaper also sweeps the journals of ended sandboxes.
const JOURNAL_SWEEP_EVERY: Duration = Duration::from_secs(600);

/// Runs [`Node::reap_once`] every `reap_every`, and the journal sweep now and then.
pub(crate) async fn reaper(node: Arc<Node>) {
    let mut tick = tokio::time::interval(node.cfg.reap_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut swept = Instant::now();
    loop {
        tick.tick().await;
        if swept.elapsed() >= JOURNAL_SWEEP_EVERY {
            node.sweep_journals().await;
            swept = Instant::now();
        }
        let n = node.clone();
        match tokio::task::spawn_blocking(move || n.reap_once()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("reaper: {e}"),
            Err(e) => tracing::warn!("reaper: {e}"),
        }
    }
}

impl Node {
    /// Dates the end of the journals of this node's sandboxes that are gone, and removes
    /// those past the retention.
    pub(crate) async fn sweep_journals(&self) {
        let prefix = format!("{}-", self.cfg.node);
        let live: std::collections::HashSet<String> =
            self.metas().into_iter().map(|m| m.id).collect();
        match self
            .journal
            .sweep(|id| id.starts_with(&prefix), |id| live.contains(id))
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!("removed the journals of {n} sandboxes past their retention"),
            Err(e) => tracing::warn!("sweeping the journals: {e}"),
        }
    }

    /// A failed call's status; a failure of the store is counted in the metrics.
    pub(crate) fn fail(&self, e: impl Into<ServiceError>) -> tonic::Status {
        let e = e.into();
        if e.is_store() {
            self.metrics.store_error();
        }
        tonic::Status::from(e)
    }

    pub fn registrant(&self, caller: &Caller) -> String {
        format!("{} via {}", caller.identity(), self.registrant)
    }

    pub fn store(&self) -> &Store {
        &self.store
    }
}

impl Node {
    /// The runtime ID of the caller's sandbox `id`, live or ended: its audit record's own
    /// `service` line names the project it belongs to.
    fn owned_local(&self, caller: &Caller, id: &str) -> Result<String, ServiceError> {
        let not_found = || {
            ServiceError::NotFound(format!(
                "no sandbox `{id}` in project `{}` on node `{}`, live or ended",
                caller.project.name, self.cfg.node
            ))
        };
        let local = id
            .strip_prefix(&self.cfg.node)
            .and_then(|r| r.strip_prefix('-'))
            .filter(|l| !l.is_empty() && l.len() <= 32 && l.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(not_found)?;
        let records = self.rt.audit(local).read().map_err(|_| not_found())?;
        let owner = records
            .iter()
            .find(|r| r.get("event").and_then(|e| e.as_str()) == Some("service"))
            .and_then(|r| r.get("project"))
            .and_then(|p| p.as_str());
        if owner != Some(caller.project.name.as_str()) {
            return Err(not_found());
        }
        Ok(local.to_string())
    }

    /// The audit record of the caller's sandbox `id`, also after it ended.
    pub fn audit_of(&self, caller: &Caller, id: &str) -> Result<String, ServiceError> {
        let local = self.owned_local(caller, id)?;
        let log = self.rt.audit(&local);
        std::fs::read_to_string(log.path()).map_err(|source| ServiceError::Io {
            what: format!("reading the audit of {id}"),
            source,
        })
    }

    /// The journal of the caller's sandbox `id`, also after it ended.
    pub async fn journal_of(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<Vec<crate::journal::Step>, ServiceError> {
        self.owned_local(caller, id)?;
        self.journal.list(id).await
    }
}

/// Whether the sandbox behind `meta` must be woken before use (the service's record or
/// the runtime's says it is hibernated).
fn asleep(meta: &Meta, sb: &Sandbox) -> bool {
    meta.hibernated || sb.is_hibernated()
}
