//! MicroVM and full-VM sandboxes: QEMU machines whose guest kernel is the boundary.
//!
//! Layers reach the guest as read-only virtio disks backed by lazyfs's files (each
//! layer's metadata image and data blob), so a VM loads lazily like a container; the
//! guest's agent mounts EROFS over them with `device=`, and overlayfs under a writable
//! disk (a sparse ext4 image sized to the disk budget). The host talks to the agent over
//! virtio-serial through a relay process (`strata-agent relay`), on the same socket path
//! and protocol as a function-call sandbox, so exec is shared code. A guest has no key
//! until its setup gives it the sandbox's; a restored snapshot proves the key it was
//! saved with, which its snapshot directory keeps, and is given the new sandbox's.
//!
//! Fast start: per machine shape a template (a booted guest whose agent waits for its
//! disks, saved to a file) is restored instead of booting; the guest probes its disks
//! only at setup, so one template serves every sandbox of that shape.

pub mod initramfs;
pub mod qemu;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use strata_agent_proto::{AgentMsg, GuestLayer, GuestRootImage, GuestSetup, HostMsg, Reseed};
use strata_lazyfs::Attached;

use crate::agent::{read_key, socket_path, write_key, AgentClient};
use crate::backend::{
    HibernateInfo, Host, NewSandbox, PortStream, ProcessInfo, SandboxBackend, SandboxRef,
    SnapshotInfo,
};
use crate::cgroup::Cgroup;
use crate::cgroup::Counters;
use crate::files::FileEntry;
use crate::rootfs::MergeDir;
use crate::RuntimeError;
pub use qemu::{Accel, Machine, MachineShape};

/// Guest memory beyond the sandbox's budget: the guest kernel and the agent live there,
/// so the budget is what the sandbox's commands get.
const GUEST_RESERVE_MIB: u64 = 128;
/// Host memory QEMU itself needs beyond the guest's RAM (TCG's translation cache, device
/// buffers); the VM's host cgroup allows this much more than the guest has.
const VMM_OVERHEAD: u64 = 512 << 20;
/// The size of a template's disks as its guest probed them: the most a disk of a VM
/// started from a template may hold (larger ones boot instead).
const TEMPLATE_DISK_BYTES: u64 = 1 << 40;
/// How long a booting guest may take to answer (TCG on a busy host is slow).
const BOOT_TIMEOUT: Duration = Duration::from_secs(180);

/// How VMs run on this host. The caller sets it (the `strata` binary, from its settings:
/// `STRATA_GUEST_DIR`, `STRATA_VM_ACCEL`, `STRATA_VM_TEMPLATES`, `STRATA_QEMU`).
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// The guest kernel and its modules (`scripts/guest-kernel.sh`).
    pub guest_dir: PathBuf,
    /// `auto`, `kvm` or `tcg`.
    pub accel: String,
    /// Start from a template snapshot instead of booting.
    pub templates: bool,
    /// The QEMU binary (a name on PATH or a path).
    pub qemu: PathBuf,
}

impl Default for VmConfig {
    /// The setup script's guest directory, `auto`, templates on, Debian's QEMU.
    fn default() -> VmConfig {
        VmConfig {
            guest_dir: PathBuf::from("/usr/local/lib/strata/guest"),
            accel: "auto".into(),
            templates: true,
            qemu: PathBuf::from("qemu-system-x86_64"),
        }
    }
}

/// What a VM sandbox's guest is built from, found by the runtime before the start.
pub struct GuestDisks {
    /// Top-most first.
    pub layers: Vec<Attached>,
    pub upper_image: PathBuf,
    pub merge_dirs: Vec<MergeDir>,
    /// The disk image that stands in for the base layer's tree (the last of `layers`).
    pub root_image: Option<RootImage>,
    /// Layers only the read-only views use, on disks after the stack's.
    pub view_layers: Vec<Attached>,
    /// The sandbox's read-only views, their layers by index (see `GuestView`).
    pub views: Vec<strata_agent_proto::GuestView>,
}

impl GuestDisks {
    /// The base layer (the last) and the root image that takes its disk slot, if any.
    fn image_layer(&self) -> Option<(usize, &RootImage)> {
        Some((self.layers.len().checked_sub(1)?, self.root_image.as_ref()?))
    }
}

/// A raw disk image in the base layer whose root filesystem is the bottom of the guest's
/// stack. It takes the base layer's disk slot, read-only like every layer.
pub struct RootImage {
    pub file: PathBuf,
    pub partition: Option<u32>,
}

impl RootImage {
    /// The image `image.path` inside the base layer bound at `bind`.
    pub fn in_layer(
        bind: &Path,
        base: &str,
        image: &strata_catalog::DiskImage,
    ) -> Result<RootImage, RuntimeError> {
        let file = bind.join(image.path.trim_start_matches('/'));
        let bad = |why: String| {
            RuntimeError::Invalid(format!(
                "disk image {} in base layer {base}: {why} (rebuild the base layer from a directory holding the raw image at that path)",
                image.path
            ))
        };
        let meta = std::fs::metadata(&file).map_err(|e| bad(e.to_string()))?;
        if !meta.is_file() {
            return Err(bad("not a regular file".into()));
        }
        if meta.len() == 0 || meta.len() % 512 != 0 {
            return Err(bad(format!(
                "{} bytes is not a whole number of 512-byte sectors; a raw image is (convert others with `qemu-img convert -O raw`)",
                meta.len()
            )));
        }
        Ok(RootImage {
            file,
            partition: image.partition,
        })
    }
}

/// The snapshot and machine-file format this build writes (and the newest it reads).
pub use crate::record::SNAPSHOT_FORMAT;
/// The machine's files and sockets, in the sandbox directory.
const MACHINE_FILES: &str = "machine-files.json";
/// How long a machine asked to quit after its state was saved may take to exit.
const QUIT_TIMEOUT: Duration = Duration::from_secs(30);

/// A saved VM (`Sandbox::snapshot`): `state` (the machine), `upper.img` (its writable
/// disk at that instant) and this record.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// The format version ([`SNAPSHOT_FORMAT`]; 0: before versions were recorded).
    #[serde(default)]
    pub format: u32,
    pub spec: crate::SandboxSpec,
    pub shape: MachineShape,
    pub taken_ms: u64,
    /// A fork's: the guest's memory as an image in the snapshot (this file), which every
    /// child maps copy-on-write; the state then holds the devices only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_image: Option<String>,
}

pub struct VmBackend {
    pub machine: Machine,
    pub cfg: VmConfig,
    /// The host-side agent binary (runs the relay).
    pub agent: PathBuf,
    /// The static agent, the guest's init.
    pub guest_agent: Option<PathBuf>,
    /// `$state/vm`: initramfs, templates, the empty disk.
    pub dir: PathBuf,
}

fn rt_io(context: &str) -> impl Fn(std::io::Error) -> RuntimeError + '_ {
    move |e| RuntimeError::AgentGone(format!("{context}: {e}"))
}

impl VmBackend {
    /// The machine shape for these budgets on this host.
    pub fn shape(
        &self,
        limits: &crate::Limits,
        layers: usize,
        display: bool,
    ) -> Result<MachineShape, RuntimeError> {
        if display && self.machine != Machine::Q35 {
            return Err(RuntimeError::Invalid(
                "a display needs a full VM (--backend vm); a microvm has no graphics".into(),
            ));
        }
        if layers > qemu::MAX_LAYERS {
            return Err(RuntimeError::Invalid(format!(
                "a VM sandbox stacks at most {} layers; this one has {layers}",
                qemu::MAX_LAYERS
            )));
        }
        let kernel = self.cfg.guest_dir.join("vmlinux");
        if !kernel.is_file() {
            return Err(RuntimeError::Setup(format!(
                "no guest kernel at {} (run scripts/guest-kernel.sh, or set STRATA_GUEST_DIR)",
                kernel.display()
            )));
        }
        let agent = self.guest_agent.as_ref().ok_or_else(|| {
            RuntimeError::Setup(
                "VM sandboxes need the statically linked strata-agent as the guest's init \
                 (build it as scripts/test.sh does, or set STRATA_STATIC_AGENT)"
                    .into(),
            )
        })?;
        let initramfs = initramfs::build(agent, &self.cfg.guest_dir, &self.dir, display)?;
        let host_cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        let vcpus = limits
            .cpus
            .map_or(1, |c| (c.ceil() as u32).clamp(1, host_cpus));
        let mut shape = MachineShape {
            machine: self.machine,
            accel: Accel::Tcg,
            memory_mib: limits.memory_bytes.div_ceil(1 << 20) + GUEST_RESERVE_MIB,
            vcpus,
            layers,
            network: false,
            display,
            kernel,
            initramfs,
        };
        shape.accel = self.accel(&shape)?;
        Ok(shape)
    }

    /// The accelerator: as configured, or for `auto` KVM when the probe (once per host
    /// boot, remembered in /run) shows a stock guest boots on it, else TCG.
    fn accel(&self, shape: &MachineShape) -> Result<Accel, RuntimeError> {
        match self.cfg.accel.as_str() {
            "kvm" => return Ok(Accel::Kvm),
            "tcg" => return Ok(Accel::Tcg),
            "auto" => {}
            other => {
                return Err(RuntimeError::Invalid(format!(
                    "STRATA_VM_ACCEL={other}: use auto, kvm or tcg"
                )))
            }
        }
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .unwrap_or_default()
            .trim()
            .to_string();
        let memo = Path::new("/run/strata").join("kvm-probe");
        if let Ok(text) = std::fs::read_to_string(&memo) {
            if let Some(answer) = text.strip_prefix(&format!("{boot_id} ")) {
                return Ok(if answer.trim() == "kvm" {
                    Accel::Kvm
                } else {
                    Accel::Tcg
                });
            }
        }
        let t = Instant::now();
        let kvm = qemu::kvm_works(&self.cfg.qemu, shape, &self.dir.join("probe"));
        let accel = if kvm { Accel::Kvm } else { Accel::Tcg };
        tracing::info!(
            accel = accel.as_str(),
            probe_ms = t.elapsed().as_millis() as u64,
            "VM accelerator: {}",
            if kvm {
                "KVM boots a standard guest"
            } else {
                "KVM cannot boot a standard guest here (or /dev/kvm is missing); using TCG"
            }
        );
        let _ = std::fs::create_dir_all("/run/strata");
        let _ = std::fs::write(&memo, format!("{boot_id} {}\n", accel.as_str()));
        Ok(accel)
    }

    /// The network of a sandbox with an allowlist: the guest's NIC is the other end of a
    /// tap device on the host (`network::setup_tap`), so its packets meet the same host
    /// rules and the same egress proxy (names, `*.` patterns, rule sets, pinned answers,
    /// server-name checks, refused attempts recorded) as a container's at its veth. The
    /// guest's resolver is always the host's side of the link: a later update that adds
    /// names needs nothing of the guest. QEMU's `-netdev` options and what the guest is
    /// told; `None` without an allowlist (no NIC at all).
    fn network(
        &self,
        nets: &crate::network::Networks,
        id: &str,
        rules: &[crate::NetRule],
    ) -> Result<Option<(String, strata_agent_proto::GuestNetwork)>, RuntimeError> {
        if rules.is_empty() {
            return Ok(None);
        }
        let tap = crate::network::setup_tap(nets, id, rules)?;
        Ok(Some((
            qemu::tap_netdev(&tap.device),
            strata_agent_proto::GuestNetwork {
                address: tap.guest.to_string(),
                prefix: tap.prefix,
                gateway: Some(tap.host.to_string()),
                nameserver: Some(tap.host.to_string()),
                hosts: Vec::new(),
            },
        )))
    }

    /// A 1 MiB empty file behind the disk slots a sandbox does not use.
    fn empty_disk(&self) -> Result<PathBuf, RuntimeError> {
        let path = self.dir.join("empty.img");
        if !path.exists() {
            std::fs::create_dir_all(&self.dir).map_err(RuntimeError::io(&self.dir))?;
            let tmp = self
                .dir
                .join(format!("empty.img.{}", crate::unique_suffix()));
            std::fs::File::create(&tmp)
                .and_then(|f| f.set_len(1 << 20))
                .map_err(RuntimeError::io(&tmp))?;
            std::fs::rename(&tmp, &path).map_err(RuntimeError::io(&path))?;
        }
        Ok(path)
    }

    /// The disk slots for a sandbox: its writable disk, each layer's metadata image and
    /// blob, the empty file elsewhere.
    fn slots(
        &self,
        shape: &MachineShape,
        disks: &GuestDisks,
    ) -> Result<Vec<PathBuf>, RuntimeError> {
        let empty = self.empty_disk()?;
        let mut slots = vec![empty.clone(); shape.disk_slots()];
        slots[0] = disks.upper_image.clone();
        for (i, layer) in disks.layers.iter().chain(&disks.view_layers).enumerate() {
            slots[qemu::meta_slot(i)] = layer.meta_path.clone();
            if let Some(blob) = &layer.blob_path {
                slots[qemu::meta_slot(i) + 1] = blob.clone();
            }
        }
        if let Some((base, image)) = disks.image_layer() {
            slots[qemu::meta_slot(base)] = image.file.clone();
            slots[qemu::meta_slot(base) + 1] = empty;
        }
        Ok(slots)
    }

    fn files(dir: &Path, disks: Vec<PathBuf>, incoming: Option<PathBuf>) -> qemu::MachineFiles {
        qemu::MachineFiles {
            disks,
            port_socket: dir.join("port.sock"),
            qmp_socket: dir.join("qmp.sock"),
            console_log: dir.join("console.log"),
            incoming,
            extra_append: String::new(),
            netdev: None,
            vnc_socket: None,
            page_cached_slot: None,
            memory_image: None,
        }
    }

    /// Starts QEMU (the binary `qemu`, in `cgroup` when given) detached from the caller;
    /// its PID.
    fn spawn_qemu(
        qemu: &Path,
        shape: &MachineShape,
        files: &qemu::MachineFiles,
        log: &Path,
        cgroup: Option<&Cgroup>,
    ) -> Result<std::process::Child, RuntimeError> {
        let mut cmd = qemu::command(qemu, shape, files);
        let out = std::fs::File::create(log).map_err(RuntimeError::io(log))?;
        let err = out.try_clone().map_err(RuntimeError::io(log))?;
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        match cgroup {
            Some(cg) => cg.join_on_exec(&mut cmd)?,
            // A helper machine (a template being made) has no sandbox to be reaped with:
            // it dies with the process that started it.
            None => strata_host::exec::die_with_parent(&mut cmd),
        }
        cmd.spawn().map_err(|e| {
            RuntimeError::Setup(format!(
                "cannot run {}: {e} (install qemu-system-x86 with scripts/setup.sh)",
                qemu.display()
            ))
        })
    }

    /// Starts QEMU on `files` in `cgroup`, detached (waited for on a thread of its own),
    /// then the relay to its agent port; QEMU's PID. `fail` explains a relay that did not
    /// come up (with QEMU's log and the console).
    fn launch(
        &self,
        dir: &Path,
        cgroup: &Cgroup,
        shape: &MachineShape,
        files: &qemu::MachineFiles,
        fail: &dyn Fn(RuntimeError) -> RuntimeError,
    ) -> Result<u32, RuntimeError> {
        let child = Self::spawn_qemu(
            &self.cfg.qemu,
            shape,
            files,
            &dir.join("qemu.log"),
            Some(cgroup),
        )?;
        let pid = child.id();
        std::thread::spawn(move || {
            let mut child = child;
            child.wait()
        });
        self.spawn_relay(dir, cgroup).map_err(fail)?;
        Ok(pid)
    }

    /// Starts the relay between the VM's port and the agent socket, and waits until it
    /// listens.
    fn spawn_relay(&self, dir: &Path, cgroup: &Cgroup) -> Result<(), RuntimeError> {
        let sock = socket_path(dir);
        let _ = std::fs::remove_file(&sock);
        let log = dir.join("relay.log");
        let out = std::fs::File::create(&log).map_err(RuntimeError::io(&log))?;
        let mut cmd = Command::new(&self.agent);
        cmd.arg("relay")
            .arg("--port")
            .arg(dir.join("port.sock"))
            .arg("--listen")
            .arg(&sock)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(out)
            .process_group(0);
        cgroup.join_on_exec(&mut cmd)?;
        let mut child = cmd.spawn().map_err(|e| {
            RuntimeError::Setup(format!(
                "cannot run the agent relay {}: {e}",
                self.agent.display()
            ))
        })?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while strata_host::unix::connect(&sock).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(RuntimeError::VmStart(format!(
                    "the agent relay exited ({status}): {}",
                    std::fs::read_to_string(&log).unwrap_or_default().trim()
                )));
            }
            if Instant::now() > deadline {
                return Err(RuntimeError::VmStart(
                    "the agent relay did not come up within 30 s".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // Reaped by whoever outlives it; the cgroup holds it either way.
        std::thread::spawn(move || child.wait());
        Ok(())
    }

    /// The template snapshot for `shape`, made now if there is none: a guest booted to
    /// its agent, waiting for disks, saved and stopped.
    pub fn template(&self, shape: &MachineShape) -> Result<PathBuf, RuntimeError> {
        let key = {
            // Everything a restore must match: the machine's whole command line (devices,
            // kernel command line; per-sandbox paths left out) and the kernel.
            let mut files = Self::files(
                Path::new("/template"),
                vec![PathBuf::from("/template/disk"); shape.disk_slots()],
                None,
            );
            if shape.network {
                files.netdev = Some(qemu::tap_netdev("svtemplate"));
            }
            let mut h = blake3::Hasher::new();
            h.update(&serde_json::to_vec(shape).unwrap_or_default());
            let cmd = qemu::command(&self.cfg.qemu, shape, &files);
            h.update(cmd.get_program().as_encoded_bytes());
            for arg in cmd.get_args() {
                h.update(arg.as_encoded_bytes());
                h.update(b"\0");
            }
            h.update(
                std::fs::read_to_string(self.cfg.guest_dir.join("kernel.version"))
                    .unwrap_or_default()
                    .as_bytes(),
            );
            h.finalize().to_hex()[..16].to_string()
        };
        let root = self.dir.join("templates");
        let state = root.join(format!("{key}.state"));
        if state.exists() {
            mark_used(&state);
            return Ok(state);
        }
        std::fs::create_dir_all(&root).map_err(RuntimeError::io(&root))?;
        let lock_path = root.join(format!("{key}.lock"));
        let lock = std::fs::File::create(&lock_path).map_err(RuntimeError::io(&lock_path))?;
        // One process makes a template at a time.
        strata_host::fs::flock(&lock, strata_host::fs::Lock::Exclusive, true)
            .map_err(RuntimeError::io(&lock_path))?;
        if state.exists() {
            return Ok(state);
        }
        // Work directories and tap devices of makers that died (their QEMU died with
        // them).
        crate::network::reap_maker_taps();
        if let Ok(rd) = std::fs::read_dir(&root) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let dead = name
                    .rsplit_once('.')
                    .and_then(|(_, pid)| pid.parse::<u32>().ok())
                    .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
                if dead && e.path().is_dir() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let t = Instant::now();
        let work = root.join(format!("{key}.{}", crate::unique_suffix()));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).map_err(RuntimeError::io(&work))?;
        let made = self.make_template(shape, &work, &state);
        let _ = std::fs::remove_dir_all(&work);
        made?;
        prune_unused(&root, ".state");
        tracing::info!(
            template = %state.display(),
            ms = t.elapsed().as_millis() as u64,
            "made a VM template"
        );
        Ok(state)
    }

    fn make_template(
        &self,
        shape: &MachineShape,
        work: &Path,
        state: &Path,
    ) -> Result<(), RuntimeError> {
        // The guest probes its disks before it is saved; a sandbox's own files replace
        // the placeholders and the guest drops what it read from them. The capacity it
        // probed stays: the placeholders are larger than any file a sandbox attaches.
        let mut disks = Vec::new();
        for name in ["upper.img", "placeholder.img"] {
            let path = work.join(name);
            std::fs::File::create(&path)
                .and_then(|f| f.set_len(TEMPLATE_DISK_BYTES))
                .map_err(RuntimeError::io(&path))?;
            disks.push(path);
        }
        disks.resize(shape.disk_slots(), disks[1].clone());
        let mut files = Self::files(work, disks, None);
        // A machine saved over a tap restores over a sandbox's (see `MakerTap`).
        let tap = match shape.network {
            true => Some(crate::network::MakerTap::create()?),
            false => None,
        };
        files.netdev = tap.as_ref().map(|t| qemu::tap_netdev(&t.device));
        let mut child =
            Self::spawn_qemu(&self.cfg.qemu, shape, &files, &work.join("qemu.log"), None)?;
        let outcome = (|| {
            guest_ping(&files.port_socket, BOOT_TIMEOUT)?;
            // Saved while running (the save stops it at the end), so a restore runs as
            // soon as the state is loaded.
            let mut qmp = qemu::Qmp::connect(&files.qmp_socket, Duration::from_secs(10))?;
            let tmp = state.with_extension("tmp");
            qmp.save(&tmp)?;
            let _ = qmp.execute("quit", serde_json::Value::Null);
            std::fs::rename(&tmp, state).map_err(RuntimeError::io(state))
        })();
        let _ = child.kill();
        let _ = child.wait();
        drop(tap);
        outcome.map_err(|e| {
            RuntimeError::VmStart(format!(
                "making the VM template: {e}; console: {}",
                tail(&files.console_log)
            ))
        })
    }
}

/// Continues a machine QEMU started from a saved state (`-incoming`) once the state is
/// loaded (by QMP over a fork's memory image); its QMP connection.
fn continue_loaded(files: &qemu::MachineFiles) -> Result<qemu::Qmp, RuntimeError> {
    let mut qmp = qemu::Qmp::connect(&files.qmp_socket, Duration::from_secs(30))?;
    let within = Duration::from_secs(120);
    match (&files.incoming, &files.memory_image) {
        (Some(state), Some(image)) if !image.shared => qmp.load_beside_image(state, within)?,
        _ => qmp.wait_while("inmigrate", within)?,
    };
    qmp.execute("cont", serde_json::Value::Null)?;
    Ok(qmp)
}

/// How long a template or initramfs may go unused before the maker of a new one removes
/// it: both are keyed by their inputs, so an upgrade or a new machine shape leaves the
/// old ones behind (a template is ~70 MB).
const UNUSED_FOR: Duration = Duration::from_secs(7 * 24 * 3600);
/// A used file's modification time is moved forward at most this often.
const MARK_EVERY: Duration = Duration::from_secs(24 * 3600);

/// Records that a cached file was used (its modification time, at most daily).
pub(crate) fn mark_used(path: &Path) {
    let stale = std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age > MARK_EVERY);
    if stale {
        if let Ok(f) = std::fs::File::options().append(true).open(path) {
            let _ = f.set_modified(std::time::SystemTime::now());
        }
    }
}

/// Removes the files in `dir` ending in `suffix` unused for [`UNUSED_FOR`], with their
/// `.lock` files.
pub(crate) fn prune_unused(dir: &Path, suffix: &str) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(suffix) else {
            continue;
        };
        let unused = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > UNUSED_FOR);
        if unused {
            tracing::info!(file = %e.path().display(), "removing an unused VM cache file");
            let _ = std::fs::remove_file(e.path());
            let _ = std::fs::remove_file(dir.join(format!("{stem}.lock")));
        }
    }
}

/// Whether every disk fits the capacity a template's guest saw.
fn fits_template(disks: &[PathBuf]) -> bool {
    let fits = disks.iter().all(|d| file_len(d) <= TEMPLATE_DISK_BYTES);
    if !fits {
        tracing::info!("a disk is larger than a template's: booting the VM instead");
    }
    fits
}

/// The last lines of a log, for error messages.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join(" | ")
}

/// A ping straight over the port's socket (no relay): the guest's agent is up. The guest
/// has no key yet, so neither does the ping.
fn guest_ping(port: &Path, within: Duration) -> Result<(), RuntimeError> {
    use strata_agent_proto::{handshake, mux, read_frame, write_control, Frame};
    let deadline = Instant::now() + within;
    let stream = loop {
        match strata_host::unix::connect(port) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(RuntimeError::AgentGone(format!("{}: {e}", port.display())))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    stream
        .set_read_timeout(Some(deadline.saturating_duration_since(Instant::now())))
        .ok();
    let mut w = stream.try_clone().map_err(rt_io("port"))?;
    let mut r = std::io::BufReader::new(stream);
    let (hello, opening) = handshake::hello(None)?;
    let mut ping = Vec::new();
    write_control(&mut ping, &HostMsg::Hello(hello)).map_err(rt_io("ping"))?;
    write_control(&mut ping, &HostMsg::Ping).map_err(rt_io("ping"))?;
    mux::start_session(&mut w).map_err(rt_io("port"))?;
    mux::write(&mut w, 1, mux::OPEN, b"").map_err(rt_io("port"))?;
    mux::write(&mut w, 1, mux::DATA, &ping).map_err(rt_io("port"))?;
    let mut got = Vec::new();
    loop {
        match mux::read(&mut r).map_err(rt_io("waiting for the guest's agent"))? {
            Some((1, mux::DATA, data)) => {
                got.extend_from_slice(&data);
                if got.len() > strata_agent_proto::MAX_FRAME {
                    return Err(RuntimeError::Protocol(
                        "the guest's answer to a ping is too long".into(),
                    ));
                }
                let mut rest = &got[..];
                let Ok(Some(Frame::Control(answer))) = read_frame::<serde_json::Value>(&mut rest)
                else {
                    continue;
                };
                opening.check(&answer)?;
                if let Ok(Some(Frame::Control(AgentMsg::Pong { .. }))) =
                    read_frame::<AgentMsg>(&mut rest)
                {
                    let _ = mux::write(&mut w, 1, mux::CLOSE, b"");
                    return Ok(());
                }
            }
            Some(_) => {}
            None => return Err(RuntimeError::AgentGone("the guest closed its port".into())),
        }
    }
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn fresh_seed() -> Vec<u8> {
    let mut seed = vec![0u8; 64];
    if getrandom::fill(&mut seed).is_err() {
        seed.clear();
    }
    seed
}

impl VmBackend {
    /// A VM's root lives in its guest: the layers' lazyfs files and an unmounted upper
    /// image become its disks; nothing is mounted on the host but the layer binds that
    /// keep the layers attached.
    fn prepare(&self, host: &Host, new: &NewSandbox) -> Result<GuestDisks, RuntimeError> {
        let spec = new.spec;
        let from = new.restore.map(|r| r.join("upper.img"));
        let upper_image =
            host.uppers
                .create_image(new.id, spec.limits.disk_bytes, from.as_deref())?;
        let paths =
            crate::rootfs::RootfsPaths::new(new.dir, &host.uppers.dir(new.id), spec.layers.len());
        let layers = crate::rootfs::bind_layers(host.lazyfs, &spec.layers, &paths.layers)?;
        let root_image = match (&spec.disk_image, paths.layers.last(), spec.layers.last()) {
            (Some(image), Some(bind), Some(base)) => Some(RootImage::in_layer(bind, base, image)?),
            _ => None,
        };
        let merge_dirs = crate::rootfs::merge_dirs(&spec.layers, &paths, &host.facts)?;
        // A view's layer that is one of the stack's is the guest's mount of it; another
        // gets a disk of its own (bound where teardown finds view binds).
        let mut extra: Vec<String> = Vec::new();
        let mut views = Vec::new();
        for v in &spec.views {
            if v.layers.is_empty() {
                return Err(RuntimeError::Invalid(format!(
                    "the read-only view at {} has no layers",
                    v.at
                )));
            }
            let layers = v
                .layers
                .iter()
                .map(|id| match spec.layers.iter().position(|l| l == id) {
                    Some(i) => i,
                    None => {
                        let j = extra.iter().position(|l| l == id).unwrap_or_else(|| {
                            extra.push(id.clone());
                            extra.len() - 1
                        });
                        spec.layers.len() + j
                    }
                })
                .collect();
            views.push(strata_agent_proto::GuestView {
                layers,
                from: v.from.clone(),
                at: v.at.clone(),
            });
        }
        let dirs: Vec<PathBuf> = (0..extra.len())
            .map(|j| new.dir.join("views").join("0").join(j.to_string()))
            .collect();
        let view_layers = crate::rootfs::bind_layers(host.lazyfs, &extra, &dirs)?;
        Ok(GuestDisks {
            layers,
            upper_image,
            merge_dirs,
            root_image,
            view_layers,
            views,
        })
    }

    fn agent(&self, sb: &SandboxRef) -> Result<AgentClient, RuntimeError> {
        AgentClient::of(sb.dir)
    }

    fn start(
        &self,
        nets: &crate::network::Networks,
        new: &NewSandbox,
        disks: &GuestDisks,
    ) -> Result<u32, RuntimeError> {
        let ctx = new;
        let l = &ctx.spec.limits;
        let mut shape = self.shape(
            l,
            disks.layers.len() + disks.view_layers.len(),
            ctx.spec.display,
        )?;
        let network = self.network(nets, ctx.id, &ctx.spec.network)?;
        shape.network = network.is_some();
        let slots = self.slots(&shape, disks)?;
        let mut memory_image = None;
        let incoming = match ctx.restore {
            Some(snapshot) => {
                let rec: SnapshotRecord = read_snapshot(snapshot)?;
                memory_image = rec.memory_image.as_ref().map(|name| qemu::MemoryImage {
                    path: snapshot.join(name),
                    shared: false,
                });
                if !rec.shape.restores_as(&shape) {
                    return Err(RuntimeError::Invalid(format!(
                        "snapshot {} was taken on a different machine ({:?}); this host would run {:?}",
                        snapshot.display(),
                        rec.shape,
                        shape
                    )));
                }
                Some(snapshot.join(if memory_image.is_some() {
                    DEVICES_STATE
                } else {
                    "state"
                }))
            }
            None if self.cfg.templates && fits_template(&slots) => Some(self.template(&shape)?),
            None => None,
        };
        let started_from = match (ctx.restore, &incoming) {
            (Some(_), _) => "snapshot",
            (None, Some(_)) => "template",
            (None, None) => "boot",
        };
        let mut machine = serde_json::to_value(&shape).unwrap_or_default();
        machine["started_from"] = started_from.into();
        machine["format"] = SNAPSHOT_FORMAT.into();
        let machine_path = ctx.dir.join("machine.json");
        std::fs::write(&machine_path, machine.to_string())
            .map_err(RuntimeError::io(&machine_path))?;
        // QEMU and the relay live in the sandbox's cgroup: its memory limit leaves room
        // for the VMM, the guest enforces the budget itself, and a kill of the cgroup
        // ends the whole VM.
        ctx.cgroup
            .create(shape.memory_mib * (1 << 20) + VMM_OVERHEAD, l.cpus, 512)?;
        let t = Instant::now();
        let mut files = Self::files(ctx.dir, slots, incoming.clone());
        files.memory_image = memory_image;
        if shape.display {
            files.vnc_socket = Some(ctx.dir.join("vnc.sock"));
        }
        files.netdev = network.as_ref().map(|(opts, _)| opts.clone());
        files.page_cached_slot = disks.image_layer().map(|(base, _)| qemu::meta_slot(base));
        // The same machine starts again from these after a hibernation.
        let files_path = ctx.dir.join(MACHINE_FILES);
        std::fs::write(
            &files_path,
            serde_json::to_vec(&qemu::MachineFiles {
                incoming: None,
                // A wake loads the whole machine into memory of its own.
                memory_image: None,
                ..files.clone()
            })
            .unwrap_or_default(),
        )
        .map_err(RuntimeError::io(&files_path))?;
        let fail = |e: RuntimeError| {
            RuntimeError::VmStart(format!(
                "{e}; QEMU: {}; console: {}",
                tail(&ctx.dir.join("qemu.log")),
                tail(&files.console_log)
            ))
        };
        let pid = self.launch(ctx.dir, &ctx.cgroup, &shape, &files, &fail)?;
        let t_relay = t.elapsed();
        if ctx.restore.is_some() {
            // A snapshot is saved paused (its disk is copied meanwhile): continue it once
            // loaded. A template is saved running and runs by itself.
            continue_loaded(&files).map_err(fail)?;
        }
        let key = read_key(ctx.dir)?;
        // A restored guest proves the key it was saved with; a template's guest has none.
        let (msg, what, guest_key) = match ctx.restore {
            Some(snapshot) => (
                HostMsg::Reseed(Reseed {
                    time_ns: now_ns(),
                    seed: fresh_seed(),
                    key: key.to_hex(),
                    hostname: Some(ctx.hostname.clone()),
                    // Its own link: the snapshot's guest still has its parent's address.
                    network: network.map(|(_, guest)| guest),
                }),
                "reseed",
                Some(read_key(snapshot)?),
            ),
            None => {
                let mut layers = Vec::new();
                let image_layer = disks.image_layer();
                let guest_layer = |i: usize, layer: &Attached| GuestLayer {
                    meta: format!("s{}", qemu::meta_slot(i)),
                    blob: layer
                        .blob_path
                        .as_ref()
                        .map(|_| format!("s{}", qemu::meta_slot(i) + 1)),
                };
                for (i, layer) in disks.layers.iter().enumerate() {
                    if image_layer.is_some_and(|(base, _)| base == i) {
                        continue;
                    }
                    layers.push(guest_layer(i, layer));
                }
                let view_layers = disks
                    .view_layers
                    .iter()
                    .enumerate()
                    .map(|(j, layer)| guest_layer(disks.layers.len() + j, layer))
                    .collect();
                let setup = GuestSetup {
                    layers,
                    upper: "s0".into(),
                    merge_dirs: disks
                        .merge_dirs
                        .iter()
                        .map(|d| strata_agent_proto::MergeDir {
                            path: d.path.display().to_string(),
                            mode: d.mode,
                            uid: d.uid,
                            gid: d.gid,
                        })
                        .collect(),
                    hostname: ctx.hostname.clone(),
                    memory_bytes: l.memory_bytes,
                    pids: l.pids,
                    time_ns: now_ns(),
                    seed: fresh_seed(),
                    network: network.map(|(_, guest)| guest),
                    display: shape.display,
                    root_image: image_layer.map(|(base, image)| GuestRootImage {
                        serial: format!("s{}", qemu::meta_slot(base)),
                        partition: image.partition,
                    }),
                    key: key.to_hex(),
                    privileged: ctx.spec.privileged,
                    view_layers,
                    views: disks.views.clone(),
                };
                (HostMsg::GuestSetup(setup), "setup", None)
            }
        };
        let reply = AgentClient::at(socket_path(ctx.dir), guest_key)
            .request(&msg, None, BOOT_TIMEOUT)
            .map_err(|e| fail(RuntimeError::Setup(format!("guest {what}: {e}"))))?;
        tracing::debug!(
            sandbox = %ctx.id,
            relay_ms = t_relay.as_secs_f64() * 1e3,
            guest_ms = (t.elapsed() - t_relay).as_secs_f64() * 1e3,
            started_from,
            "VM started"
        );
        match reply {
            (AgentMsg::Ready | AgentMsg::Done, _) => Ok(pid),
            (other, _) => Err(fail(RuntimeError::Protocol(format!(
                "guest {what}: unexpected {other:?}"
            )))),
        }
    }
}

impl SandboxBackend for VmBackend {
    fn create(&self, host: &Host, new: &NewSandbox) -> Result<u32, RuntimeError> {
        let t = Instant::now();
        let disks = self.prepare(host, new)?;
        let t_disks = t.elapsed();
        let pid = self.start(host.networks, new, &disks)?;
        // Which machine, accelerator and start path this sandbox got.
        if let Ok(machine) = std::fs::read(new.dir.join("machine.json")) {
            if let Ok(mut m) = serde_json::from_slice::<serde_json::Value>(&machine) {
                m["start_ms"] = serde_json::json!(t.elapsed().as_secs_f64() * 1e3);
                new.audit.record("machine", m)?;
            }
        }
        tracing::debug!(
            sandbox = new.id,
            disks_ms = t_disks.as_secs_f64() * 1e3,
            start_ms = (t.elapsed() - t_disks).as_secs_f64() * 1e3,
            "created"
        );
        Ok(pid)
    }

    /// A guest's counters come with each command's exit; the host's cgroup holds QEMU.
    fn counters(&self, _sb: &SandboxRef) -> Counters {
        Counters::default()
    }

    fn disk_usage(&self, sb: &SandboxRef) -> Result<(u64, u64), RuntimeError> {
        let s = self.agent(sb)?.stats()?;
        Ok((s.disk_used, s.disk_size))
    }

    /// The guest's agent sends a file in one frame, so it is bounded by the frame limit.
    fn read_file(
        &self,
        sb: &SandboxRef,
        path: &str,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let data = self.agent(sb)?.read_file(path)?;
        data.chunks(crate::files::READ_PART).try_for_each(sink)
    }

    fn write_file(
        &self,
        sb: &SandboxRef,
        path: &str,
        data: &[u8],
        mode: u32,
    ) -> Result<(), RuntimeError> {
        self.agent(sb)?.write_file(path, data, mode)
    }

    fn list_dir(&self, sb: &SandboxRef, path: &str) -> Result<Vec<FileEntry>, RuntimeError> {
        Ok(self
            .agent(sb)?
            .list_dir(path)?
            .into_iter()
            .map(|e| FileEntry {
                name: e.name,
                kind: e.kind.as_str().to_string(),
                size: e.size,
                mode: e.mode,
                mtime: e.mtime,
                uid: e.uid,
                gid: e.gid,
                target: e.target,
            })
            .collect())
    }

    /// A guest's ports are behind its own kernel: its agent relays the connection over
    /// the machine's agent channel.
    fn connect_port(&self, sb: &SandboxRef, port: u16) -> Result<PortStream, RuntimeError> {
        self.agent(sb)?.connect_port(port).map(PortStream::Relayed)
    }

    /// A guest created with an allowlist has its tap device: its host rules and egress
    /// proxy are replaced as a container's are (the guest already asks the proxy for
    /// names). One created without has no network card to send through.
    fn set_network(
        &self,
        sb: &SandboxRef,
        networks: &crate::network::Networks,
        rules: &[crate::NetRule],
    ) -> Result<(), RuntimeError> {
        if !crate::network::has_tap(&sb.record.id) {
            return Err(RuntimeError::Unsupported(format!(
                "a {} sandbox created without network destinations has no network card: create a new sandbox with the allowlist it needs",
                self.machine.as_str()
            )));
        }
        crate::network::update(networks, &sb.record.id, sb.record.init_pid, rules).map(|_| ())
    }

    /// The guest's processes, by the agent (their host PID is 0: they are the guest's).
    fn processes(&self, sb: &SandboxRef) -> Vec<ProcessInfo> {
        self.agent(sb)
            .and_then(|a| a.processes())
            .unwrap_or_default()
            .into_iter()
            .map(|p| ProcessInfo {
                pid: p.pid,
                host_pid: 0,
                state: p.state,
                rss_bytes: p.rss_bytes,
                cmdline: p.cmdline,
            })
            .collect()
    }

    /// The guest flushes its page cache (`sync`), the machine stops for a sparse copy of
    /// its upper image and runs on; the copy is mounted on the host.
    fn hold_changes(
        &self,
        sb: &SandboxRef,
        _upper: &Path,
    ) -> Result<(PathBuf, crate::changes::Release), RuntimeError> {
        let flush = crate::exec::ExecEnv {
            argv: vec!["sync".into()],
            env: Default::default(),
            cwd: "/".into(),
            uid: 0,
            gid: 0,
            timeout: Duration::from_secs(120),
        };
        let req = crate::ExecRequest {
            argv: flush.argv.clone(),
            keep_output: Some(4096),
            ..Default::default()
        };
        let flushed = self.exec(sb, &flush, &req, &mut |_, _| {})?;
        if flushed.exit.code != Some(0) {
            return Err(RuntimeError::Exec(format!(
                "the guest could not flush its disk (`sync` ended {:?}: {}); the base needs a `sync` command",
                flushed.exit.code,
                String::from_utf8_lossy(&flushed.stderr).trim()
            )));
        }
        let mut qmp = qemu::Qmp::connect(&sb.dir.join("qmp.sock"), Duration::from_secs(5))?;
        let dir = crate::changes::copy_dir(sb.dir);
        let copied =
            qmp.while_stopped(|_| crate::changes::take_copy(&sb.uppers.image(&sb.record.id), &dir));
        let mounted = match copied.and_then(|()| crate::changes::mount_copy(&dir)) {
            Ok(m) => m,
            Err(e) => {
                let _ = crate::changes::remove_copy(&dir);
                return Err(e);
            }
        };
        Ok((mounted.join("upper"), crate::changes::Release::Copy(dir)))
    }

    /// The machine is stopped (QMP), whether by a pause or a snapshot under way.
    fn paused(&self, sb: &SandboxRef) -> bool {
        qemu::Qmp::connect(&sb.dir.join("qmp.sock"), Duration::from_secs(2))
            .and_then(|mut q| q.status())
            .is_ok_and(|s| s != "running")
    }

    fn pause(&self, sb: &SandboxRef, paused: bool) -> Result<(), RuntimeError> {
        let dir = sb.dir;
        let mut qmp = qemu::Qmp::connect(&dir.join("qmp.sock"), Duration::from_secs(5))?;
        qmp.execute(
            if paused { "stop" } else { "cont" },
            serde_json::Value::Null,
        )?;
        Ok(())
    }

    fn saves_memory(&self) -> bool {
        true
    }

    fn hibernates(&self) -> bool {
        true
    }

    /// The machine stops, its state (memory and devices) is saved to `to/state`, and QEMU
    /// quits, its disks flushed; the relay goes with it. The writable disk stays.
    fn hibernate(&self, sb: &SandboxRef, to: &Path) -> Result<HibernateInfo, RuntimeError> {
        let t = Instant::now();
        // The guest's memory goes there: the host's other users may not read it.
        std::fs::create_dir_all(to).map_err(RuntimeError::io(to))?;
        std::fs::set_permissions(to, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(RuntimeError::io(to))?;
        let mut qmp = qemu::Qmp::connect(&sb.dir.join("qmp.sock"), Duration::from_secs(5))?;
        let was_running = qmp.status()? == "running";
        // Saved stopped: nothing the guest does after the save reaches its disk.
        qmp.execute("stop", serde_json::Value::Null)?;
        let state = to.join("state");
        if let Err(e) = qmp.save(&state) {
            if was_running {
                let _ = qmp.execute("cont", serde_json::Value::Null);
            }
            return Err(e);
        }
        let _ = qmp.execute("quit", serde_json::Value::Null);
        drop(qmp);
        let (pid, start) = (sb.record.init_pid, sb.record.init_start);
        let deadline = Instant::now() + QUIT_TIMEOUT;
        while crate::backend::process_start(pid) == Some(start) {
            if Instant::now() > deadline {
                tracing::warn!(sandbox = %sb.record.id, "QEMU did not quit after its state was saved: killed");
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // The relay (the only other process of the machine's cgroup).
        sb.cgroup.kill_all();
        Ok(HibernateInfo {
            state_bytes: file_len(&state),
            millis: t.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// The same machine (shape, disks, sockets) is started from the saved state, its
    /// guest told the time and given fresh entropy; it proves the sandbox's own key.
    fn wake(&self, sb: &SandboxRef, from: &Path, paused: bool) -> Result<u32, RuntimeError> {
        let dir = sb.dir;
        let machine_path = dir.join("machine.json");
        let shape: MachineShape = crate::record::decode_versioned(
            &machine_path,
            &std::fs::read(&machine_path).map_err(RuntimeError::io(&machine_path))?,
            SNAPSHOT_FORMAT,
        )?;
        let mut files = read_machine_files(dir)?;
        files.incoming = Some(from.join("state"));
        let l = &sb.record.spec.limits;
        sb.cgroup
            .create(shape.memory_mib * (1 << 20) + VMM_OVERHEAD, l.cpus, 512)?;
        let fail = |e: RuntimeError| {
            sb.cgroup.kill_all();
            RuntimeError::VmStart(format!(
                "waking the machine: {e}; QEMU: {}; console: {}",
                tail(&dir.join("qemu.log")),
                tail(&files.console_log)
            ))
        };
        let pid = self.launch(dir, sb.cgroup, &shape, &files, &fail)?;
        let mut qmp = continue_loaded(&files).map_err(fail)?;
        let key = read_key(dir)?;
        let reseed = HostMsg::Reseed(Reseed {
            time_ns: now_ns(),
            seed: fresh_seed(),
            key: key.to_hex(),
            hostname: None,
            network: None,
        });
        AgentClient::at(socket_path(dir), Some(key))
            .request(&reseed, None, BOOT_TIMEOUT)
            .map_err(|e| fail(RuntimeError::Setup(format!("guest reseed: {e}"))))?;
        if paused {
            qmp.execute("stop", serde_json::Value::Null).map_err(fail)?;
        }
        Ok(pid)
    }

    fn snapshot(&self, sb: &SandboxRef, dest: &Path) -> Result<SnapshotInfo, RuntimeError> {
        let (rec, dir) = (sb.record, sb.dir);
        let upper_image = &sb.uppers.image(&rec.id);
        let t = Instant::now();
        let machine_path = dir.join("machine.json");
        let shape: MachineShape = crate::record::decode_versioned(
            &machine_path,
            &std::fs::read(&machine_path).map_err(RuntimeError::io(&machine_path))?,
            SNAPSHOT_FORMAT,
        )?;
        std::fs::create_dir_all(dest).map_err(RuntimeError::io(dest))?;
        let mut qmp = qemu::Qmp::connect(&dir.join("qmp.sock"), Duration::from_secs(5))?;
        let disk = qmp.while_stopped(|qmp| {
            let disk = dest.join("upper.img");
            crate::quota::copy_sparse(upper_image, &disk, file_len(upper_image))?;
            qmp.save(&dest.join("state"))?;
            // The restored guest proves the key it holds now.
            write_key(dest, &read_key(dir)?)?;
            let record = SnapshotRecord {
                format: SNAPSHOT_FORMAT,
                spec: rec.spec.clone(),
                shape,
                taken_ms: crate::audit::now_ms(),
                memory_image: None,
            };
            write_snapshot_record(dest, &record)?;
            Ok(disk)
        })?;
        Ok(SnapshotInfo {
            dir: dest.to_path_buf(),
            state_bytes: file_len(&dest.join("state")),
            disk_bytes: allocated(&disk),
            millis: t.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// [`VmBackend::snapshot`], then (for more than one child) its memory made an image
    /// the children map copy-on-write (see [`qemu::MemoryImage`]), the state cut to the
    /// devices'. Without the image (one child has no one to share with; or its maker
    /// failed) each child loads the whole state, as from any snapshot.
    fn fork_snapshot(
        &self,
        sb: &SandboxRef,
        dest: &Path,
        children: usize,
    ) -> Result<SnapshotInfo, RuntimeError> {
        let mut info = self.snapshot(sb, dest)?;
        if children < 2 {
            return Ok(info);
        }
        let t = Instant::now();
        if let Err(e) = self.make_memory_image(sb.dir, dest) {
            tracing::warn!(sandbox = %sb.record.id, "fork children load the whole state: {e}");
            for name in [MEMORY_IMAGE, DEVICES_STATE] {
                let _ = std::fs::remove_file(dest.join(name));
            }
        }
        info.millis += t.elapsed().as_secs_f64() * 1e3;
        Ok(info)
    }
}

/// A fork snapshot's memory image, and the devices' state saved beside it (its children
/// load that instead of `state`).
const MEMORY_IMAGE: &str = "memory";
const DEVICES_STATE: &str = "devices.state";

fn read_machine_files(dir: &Path) -> Result<qemu::MachineFiles, RuntimeError> {
    let path = dir.join(MACHINE_FILES);
    serde_json::from_slice(&std::fs::read(&path).map_err(RuntimeError::io(&path))?)
        .map_err(|e| RuntimeError::Invalid(format!("{}: {e}", path.display())))
}

fn write_snapshot_record(dest: &Path, record: &SnapshotRecord) -> Result<(), RuntimeError> {
    let path = dest.join("snapshot.json");
    std::fs::write(&path, serde_json::to_vec_pretty(record).unwrap_or_default())
        .map_err(RuntimeError::io(&path))
}

impl VmBackend {
    /// Turns the snapshot in `dest` (of the machine in `dir`) into a fork's: a helper
    /// QEMU of the same machine, in the caller's cgroup and never running its guest, loads
    /// the whole state into `dest/memory` mapped shared (a sparse file: zero pages stay
    /// holes), saves its devices beside it (`devices.state`, what the children load) and
    /// quits; the record then names the image.
    fn make_memory_image(&self, dir: &Path, dest: &Path) -> Result<(), RuntimeError> {
        let mut record = read_snapshot(dest)?;
        let parent = read_machine_files(dir)?;
        let image = dest.join(MEMORY_IMAGE);
        {
            use std::os::unix::fs::OpenOptionsExt;
            // The parent's memory: the host's other users may not read it.
            let f = std::fs::File::options()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&image)
                .map_err(RuntimeError::io(&image))?;
            f.set_len(record.shape.memory_mib << 20)
                .map_err(RuntimeError::io(&image))?;
        }
        let mut disks = parent.disks.clone();
        if let Some(upper) = disks.first_mut() {
            // The copy: the parent runs on with its own.
            *upper = dest.join("upper.img");
        }
        let files = qemu::MachineFiles {
            disks,
            port_socket: dest.join("maker-port.sock"),
            qmp_socket: dest.join("maker-qmp.sock"),
            console_log: dest.join("maker-console.log"),
            incoming: Some(dest.join("state")),
            extra_append: parent.extra_append.clone(),
            netdev: None,
            vnc_socket: None,
            page_cached_slot: parent.page_cached_slot,
            memory_image: Some(qemu::MemoryImage {
                path: image,
                shared: true,
            }),
        };
        let log = dest.join("maker-qemu.log");
        let mut child = Self::spawn_qemu(&self.cfg.qemu, &record.shape, &files, &log, None)?;
        let made = (|| {
            let mut qmp = qemu::Qmp::connect(&files.qmp_socket, Duration::from_secs(30))?;
            qmp.wait_while("inmigrate", Duration::from_secs(120))?;
            qmp.save_beside_memory(&dest.join(DEVICES_STATE))?;
            let _ = qmp.execute("quit", serde_json::Value::Null);
            Ok::<_, RuntimeError>(())
        })()
        .map_err(|e| RuntimeError::VmStart(format!("{e}; QEMU: {}", tail(&log))));
        let _ = child.kill();
        let _ = child.wait();
        for p in [
            &log,
            &files.console_log,
            &files.qmp_socket,
            &files.port_socket,
        ] {
            let _ = std::fs::remove_file(p);
        }
        made?;
        // Named last: until then the snapshot is a whole one.
        record.memory_image = Some(MEMORY_IMAGE.to_string());
        write_snapshot_record(dest, &record)
    }
}

pub fn read_snapshot(dir: &Path) -> Result<SnapshotRecord, RuntimeError> {
    crate::record::read_snapshot(dir)
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map_or(0, |m| m.len())
}

fn allocated(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p).map_or(0, |m| m.blocks() * 512)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_files_unused_for_a_week_are_pruned_and_used_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let old = std::time::SystemTime::now() - Duration::from_secs(8 * 24 * 3600);
        for name in ["old.state", "used.state", "fresh.state", "other.img"] {
            let f = std::fs::File::create(dir.path().join(name)).unwrap();
            if name != "fresh.state" {
                f.set_modified(old).unwrap();
            }
        }
        std::fs::write(dir.path().join("old.lock"), "").unwrap();
        mark_used(&dir.path().join("used.state"));
        prune_unused(dir.path(), ".state");
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["fresh.state", "other.img", "used.state"]);
    }
}
