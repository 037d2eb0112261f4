//! QEMU as the VM engine: the command line of a sandbox's machine, its QMP control socket,
//! and the accelerator probe.
//!
//! A machine's devices depend only on its shape: the agent's virtio-serial port, an
//! entropy device, and the disk slots of its layer count (slot 0 the writable disk, then
//! a metadata image and a data blob per layer; a layer without data has an empty file as
//! its blob). That keeps a template snapshot restorable under any sandbox of the shape:
//! migration needs the same devices on both ends, and only the files behind them change.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::{absolute, RuntimeError};

/// Layers a VM sandbox may stack (two disk slots each; microvm has 24 virtio-mmio
/// transports, two of them taken by the agent's port and the entropy device).
pub const MAX_LAYERS: usize = 10;

/// The machine type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Machine {
    /// `-M microvm`: no firmware, no PCI, virtio-mmio devices.
    Microvm,
    /// `-M q35`: firmware (qboot), PCI devices.
    Q35,
}

impl Machine {
    fn device(&self, kind: &str) -> String {
        match self {
            Machine::Microvm => format!("{kind}-device"),
            Machine::Q35 => format!("{kind}-pci"),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Machine::Microvm => "microvm",
            Machine::Q35 => "q35",
        }
    }

    /// The name of the guest's RAM block: the one QEMU gives its default memory backend
    /// for this machine, so a machine's whole state loads over a named backend.
    fn ram_id(&self) -> &'static str {
        match self {
            Machine::Microvm => "microvm.ram",
            Machine::Q35 => "pc.ram",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl MachineShape {
    /// The writable disk, then a metadata image and a data blob per layer.
    pub fn disk_slots(&self) -> usize {
        1 + 2 * self.layers
    }
}

impl Accel {
    pub fn as_str(&self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// What decides a machine's shape (and so which template snapshot fits it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineShape {
    pub machine: Machine,
    pub accel: Accel,
    pub memory_mib: u64,
    pub vcpus: u32,
    /// Layers stacked (the disk slots follow from it).
    pub layers: usize,
    /// Whether the machine has a network interface (only sandboxes with an allowlist).
    #[serde(default)]
    pub network: bool,
    /// Whether it has a graphics card (full VMs asked for a display).
    #[serde(default)]
    pub display: bool,
    pub kernel: PathBuf,
    pub initramfs: PathBuf,
}

impl MachineShape {
    /// Whether a machine saved as `self` restores as `other`: the same devices, memory
    /// and boot files, wherever each node keeps them (the initramfs's name is the key of
    /// what it holds).
    pub fn restores_as(&self, other: &MachineShape) -> bool {
        let names = |s: &MachineShape| {
            (
                s.kernel.file_name().map(|n| n.to_os_string()),
                s.initramfs.file_name().map(|n| n.to_os_string()),
            )
        };
        let here = MachineShape {
            kernel: other.kernel.clone(),
            initramfs: other.initramfs.clone(),
            ..self.clone()
        };
        here == *other && names(self) == names(other)
    }
}

/// The files and sockets of one machine (kept with a VM sandbox, `machine-files.json`,
/// so a hibernated one starts again on the same ones).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MachineFiles {
    /// One file per disk slot; slot 0 is writable.
    pub disks: Vec<PathBuf>,
    pub port_socket: PathBuf,
    pub qmp_socket: PathBuf,
    pub console_log: PathBuf,
    /// A migration stream to restore from instead of booting.
    pub incoming: Option<PathBuf>,
    /// Extra kernel command line words (the accelerator probe's marker).
    pub extra_append: String,
    /// `-netdev user,...` options of a machine with a network interface.
    pub netdev: Option<String>,
    /// A VNC display on this Unix socket (full VMs).
    pub vnc_socket: Option<PathBuf>,
    /// A disk slot read through the host's page cache instead of with direct I/O: a root
    /// image, which is a file on a layer's EROFS mount (no O_DIRECT there). Its page
    /// cache is the layer's, shared by every VM that boots the image.
    pub page_cached_slot: Option<usize>,
    /// The guest's memory as a mapping of this image file instead of memory of QEMU's own
    /// (see [`MemoryImage`]).
    #[serde(default)]
    pub memory_image: Option<MemoryImage>,
}

/// A fork's guest memory as a file. Its children map it privately (copy-on-write): the
/// pages none of them writes are in the host's memory once, the image's page cache.
/// Their `incoming` holds the devices' state only (saved with `x-ignore-shared`) and is
/// loaded through QMP ([`Qmp::load_beside_image`]). The image is made by a machine that
/// maps it shared and only loads the parent's whole state into it, never running.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemoryImage {
    pub path: PathBuf,
    /// Mapped shared (the image's maker, whose loads write the file), else privately.
    pub shared: bool,
}

/// The host TSC frequency in kHz: a TCG guest told it skips calibration, which otherwise
/// often hangs under emulation.
fn host_khz() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = info.lines().find_map(|l| {
        l.strip_prefix("cpu MHz")?
            .split(':')
            .nth(1)?
            .trim()
            .parse()
            .ok()
    })?;
    // Whole MHz: the reading drifts on some hosts, and it is part of a template's key.
    Some(mhz.round() as u64 * 1000)
}

/// The CPU a TCG guest gets: the x86-64-v2 level (what current distributions require
/// at least), not `max`. Emulated wide vector units are slower than the SSE paths they
/// replace: with `max` glibc picks its AVX2 routines, and the guest forks and imports
/// Python about twice as slowly (measured here).
const TCG_CPU: &str = "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt,+cx16";

/// How QEMU is told of a socket: relative to its working directory, the machine's own
/// (QEMU binds the path itself, and a home deep in the filesystem gives absolute paths
/// longer than a socket address holds).
fn socket_name<'a>(socket: &'a Path, cwd: Option<&Path>) -> std::borrow::Cow<'a, str> {
    match (cwd, socket.parent(), socket.file_name()) {
        (Some(cwd), Some(parent), Some(name)) if parent == cwd => name.to_string_lossy(),
        _ => socket.to_string_lossy(),
    }
}

/// The full command line, running the QEMU binary `qemu`.
pub fn command(qemu: &Path, shape: &MachineShape, files: &MachineFiles) -> Command {
    let mut cmd = Command::new(qemu);
    let cwd = files
        .qmp_socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = cwd {
        cmd.current_dir(dir);
    }
    let m = shape.machine;
    let machine = match m {
        Machine::Microvm => "microvm,x-option-roms=off,rtc=on",
        Machine::Q35 => "q35,vmport=off",
    };
    match &files.memory_image {
        Some(image) => {
            let ram = m.ram_id();
            cmd.args([
                "-object",
                &format!(
                    "memory-backend-file,id={ram},size={}M,mem-path={},share={}",
                    shape.memory_mib,
                    escape(&image.path),
                    if image.shared { "on" } else { "off" }
                ),
            ]);
            cmd.args(["-machine", &format!("{machine},memory-backend={ram}")]);
        }
        None => {
            cmd.args(["-machine", machine]);
        }
    }
    cmd.args(["-accel", shape.accel.as_str()]);
    cmd.args([
        "-cpu",
        if shape.accel == Accel::Kvm {
            "host"
        } else {
            TCG_CPU
        },
    ]);
    if m == Machine::Q35 {
        cmd.args(["-bios", "/usr/share/qemu/qboot.rom"]);
    }
    cmd.args([
        "-m",
        &format!("{}M", shape.memory_mib),
        "-smp",
        &shape.vcpus.to_string(),
        "-nodefaults",
        "-no-user-config",
        "-no-reboot",
    ]);
    if shape.display {
        cmd.args(["-device", "VGA"]);
    }
    match &files.vnc_socket {
        Some(sock) => {
            cmd.arg("-vnc")
                .arg(format!("unix:{}", socket_name(sock, cwd)));
        }
        None => {
            cmd.args(["-display", "none"]);
        }
    }
    cmd.arg("-kernel").arg(absolute(&shape.kernel));
    cmd.arg("-initrd").arg(absolute(&shape.initramfs));
    // With a display the kernel's console is on the screen too; the serial port stays
    // /dev/console (the last one named), the log the host keeps.
    let consoles = if shape.display {
        "console=tty0 console=ttyS0"
    } else {
        "console=ttyS0"
    };
    // init_on_free: freed guest pages are zeros, which a saved state skips.
    let mut append = format!("{consoles} reboot=t panic=-1 quiet loglevel=3 init_on_free=1");
    if shape.accel == Accel::Tcg {
        if let Some(khz) = host_khz() {
            append.push_str(&format!(" tsc_early_khz={khz} tsc=reliable no_timer_check"));
        }
    }
    if !files.extra_append.is_empty() {
        append.push(' ');
        append.push_str(&files.extra_append);
    }
    cmd.args(["-append", &append]);
    cmd.arg("-serial")
        .arg(format!("file:{}", escape(&files.console_log)));
    cmd.arg("-qmp").arg(format!(
        "unix:{},server=on,wait=off",
        socket_name(&files.qmp_socket, cwd)
    ));
    cmd.args(["-device", &format!("{},id=vser", m.device("virtio-serial"))]);
    cmd.arg("-chardev").arg(format!(
        "socket,id=agent,path={},server=on,wait=off",
        socket_name(&files.port_socket, cwd)
    ));
    cmd.args([
        "-device",
        "virtserialport,bus=vser.0,chardev=agent,name=strata.agent",
    ]);
    cmd.args(["-object", "rng-random,id=rng,filename=/dev/urandom"]);
    cmd.args(["-device", &format!("{},rng=rng", m.device("virtio-rng"))]);
    for (slot, file) in files.disks.iter().enumerate() {
        let ro = if slot == 0 { "off" } else { "on" };
        let cache = if files.page_cached_slot == Some(slot) {
            "writeback"
        } else {
            "none"
        };
        cmd.arg("-drive").arg(format!(
            "file={},format=raw,if=none,id=d{slot},readonly={ro},cache={cache},aio=threads,discard=unmap",
            escape(file)
        ));
        cmd.args([
            "-device",
            &format!("{},drive=d{slot},serial=s{slot}", m.device("virtio-blk")),
        ]);
    }
    if shape.network {
        // A sandbox's tap device; a template's machine (which reaches nothing) a user
        // network; an older build's saved options are a user network's.
        let netdev = match files.netdev.as_deref() {
            Some(o) if o.starts_with("tap,") => o.to_string(),
            Some(o) => format!("user,id=net,{o}"),
            None => "user,id=net,restrict=on".to_string(),
        };
        cmd.args(["-netdev", &netdev]);
        cmd.args(["-device", &format!("{},netdev=net", m.device("virtio-net"))]);
    } else {
        cmd.arg("-nic").arg("none");
    }
    match (&files.incoming, &files.memory_image) {
        // Loaded once QMP has set `x-ignore-shared` (no command-line switch for it).
        (Some(_), Some(image)) if !image.shared => {
            cmd.args(["-incoming", "defer"]);
        }
        // Runs as soon as the state is loaded: a guest that finds no host on its port
        // waits for one, so the channel need not be attached first.
        (Some(state), _) => {
            cmd.arg("-incoming")
                .arg(format!("exec:cat {}", shell_quote(state)));
        }
        (None, _) => {}
    }
    cmd
}

/// `-netdev` options for a machine whose network card is the other end of host tap
/// `device`.
pub fn tap_netdev(device: &str) -> String {
    format!("tap,id=net,ifname={device},script=no,downscript=no,vhost=off")
}

/// QEMU option values escape ',' by doubling it.
fn escape(p: &Path) -> String {
    absolute(p).display().to_string().replace(',', ",,")
}

fn shell_quote(p: &Path) -> String {
    format!(
        "'{}'",
        absolute(p).display().to_string().replace('\'', "'\\''")
    )
}

/// The disk slot of layer `i`'s metadata image (its blob is the next one).
pub fn meta_slot(i: usize) -> usize {
    1 + 2 * i
}

/// A QMP connection (JSON commands on the machine's control socket).
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    /// Connects (QEMU creates the socket early in its start) and negotiates capabilities.
    pub fn connect(socket: &Path, within: Duration) -> Result<Qmp, RuntimeError> {
        let deadline = Instant::now() + within;
        let stream = loop {
            match strata_host::unix::connect(socket) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(RuntimeError::Qmp(format!(
                        "socket {}: {e}",
                        socket.display()
                    )))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        };
        stream.set_read_timeout(Some(Duration::from_secs(60))).ok();
        let writer = stream
            .try_clone()
            .map_err(|e| RuntimeError::Qmp(e.to_string()))?;
        let mut qmp = Qmp {
            reader: BufReader::new(stream),
            writer,
        };
        qmp.read_message()?; // the greeting
        qmp.execute("qmp_capabilities", Value::Null)?;
        Ok(qmp)
    }

    fn read_message(&mut self) -> Result<Value, RuntimeError> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .map_err(|e| RuntimeError::Qmp(e.to_string()))?;
        if n == 0 {
            return Err(RuntimeError::Qmp("QEMU closed the socket".into()));
        }
        serde_json::from_str(&line).map_err(|e| RuntimeError::Qmp(format!("{e} in {line:?}")))
    }

    /// Runs a command; its `return` value.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, RuntimeError> {
        let mut msg = json!({ "execute": command });
        if !arguments.is_null() {
            msg["arguments"] = arguments;
        }
        let mut text = msg.to_string();
        text.push('\n');
        self.writer
            .write_all(text.as_bytes())
            .map_err(|e| RuntimeError::Qmp(format!("{command}: {e}")))?;
        loop {
            let reply = self.read_message()?;
            if let Some(r) = reply.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = reply.get("error") {
                return Err(RuntimeError::Qmp(format!(
                    "{command}: {}",
                    e.get("desc").and_then(Value::as_str).unwrap_or("failed")
                )));
            }
            // An asynchronous event: not our answer.
        }
    }

    /// The run state (`running`, `paused`, `inmigrate`, `postmigrate`, ...).
    /// Runs `f` with the machine stopped, and continues it after (whatever `f` returned)
    /// if it was running before.
    pub fn while_stopped<T>(
        &mut self,
        f: impl FnOnce(&mut Qmp) -> Result<T, RuntimeError>,
    ) -> Result<T, RuntimeError> {
        let was_running = self.status()? == "running";
        if was_running {
            self.execute("stop", Value::Null)?;
        }
        let out = f(self);
        if was_running {
            self.execute("cont", Value::Null)?;
        }
        out
    }

    pub fn status(&mut self) -> Result<String, RuntimeError> {
        let r = self.execute("query-status", Value::Null)?;
        Ok(r.get("status")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string())
    }

    /// Waits until the state is no longer `from` (an incoming migration, a save).
    pub fn wait_while(&mut self, from: &str, within: Duration) -> Result<String, RuntimeError> {
        let deadline = Instant::now() + within;
        loop {
            let s = self.status()?;
            if s != from {
                return Ok(s);
            }
            if Instant::now() > deadline {
                return Err(RuntimeError::Qmp(format!(
                    "the VM stayed `{from}` for {within:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn ignore_shared(&mut self, on: bool) -> Result<(), RuntimeError> {
        self.execute(
            "migrate-set-capabilities",
            json!({"capabilities": [{"capability": "x-ignore-shared", "state": on}]}),
        )
        .map(|_| ())
    }

    /// Saves the paused machine's devices to `path`, without its memory (a shared memory
    /// image, which stays as it is); the capability is off again after.
    pub fn save_beside_memory(&mut self, path: &Path) -> Result<(), RuntimeError> {
        self.ignore_shared(true)?;
        let saved = self.save(path);
        // Left on, it would change the format of every later save of this machine.
        self.ignore_shared(false)?;
        saved
    }

    /// Loads what [`Qmp::save_beside_memory`] saved into a machine started with
    /// `-incoming defer` over the memory image, then turns the capability off again (a
    /// later hibernation saves the whole machine).
    pub fn load_beside_image(
        &mut self,
        state: &Path,
        within: Duration,
    ) -> Result<String, RuntimeError> {
        self.ignore_shared(true)?;
        self.execute(
            "migrate-incoming",
            json!({ "uri": format!("exec:cat {}", shell_quote(state)) }),
        )?;
        self.wait_migration(&format!("loading the VM state {}", state.display()), within)?;
        self.ignore_shared(false)?;
        self.wait_while("inmigrate", within)
    }

    /// Saves the paused machine's state to `path` (a migration to a file, throttle off).
    pub fn save(&mut self, path: &Path) -> Result<(), RuntimeError> {
        self.execute(
            "migrate-set-parameters",
            json!({ "max-bandwidth": 64u64 << 30 }),
        )?;
        self.execute(
            "migrate",
            json!({ "uri": format!("exec:cat > {}", shell_quote(path)) }),
        )?;
        self.wait_migration(
            &format!("saving the VM state to {}", path.display()),
            Duration::from_secs(120),
        )
    }

    /// Waits for the migration in progress (a save or a load) to complete; `what` names
    /// it in the error.
    fn wait_migration(&mut self, what: &str, within: Duration) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + within;
        loop {
            let r = self.execute("query-migrate", Value::Null)?;
            match r.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(()),
                Some("failed") | Some("cancelled") => {
                    return Err(RuntimeError::Qmp(format!(
                        "{what} failed: {}",
                        r.get("error-desc").and_then(Value::as_str).unwrap_or("?")
                    )))
                }
                _ if Instant::now() > deadline => {
                    return Err(RuntimeError::Qmp(format!("{what} took over {within:?}")))
                }
                _ => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    }
}

/// Whether KVM can run a standard guest here: boots the guest kernel under KVM with the
/// probe marker and waits for the agent's line on the console. Some hosts expose a
/// `/dev/kvm` a stock kernel cannot boot on (PVM); they hang, so the probe has a deadline.
/// `qemu` is the QEMU binary.
pub fn kvm_works(qemu: &Path, shape: &MachineShape, scratch: &Path) -> bool {
    if !Path::new("/dev/kvm").exists() {
        return false;
    }
    let _ = std::fs::create_dir_all(scratch);
    let console = scratch.join("probe-console.log");
    let _ = std::fs::remove_file(&console);
    let empty = scratch.join("probe-disk.img");
    if std::fs::File::create(&empty)
        .and_then(|f| f.set_len(1 << 20))
        .is_err()
    {
        return false;
    }
    let files = MachineFiles {
        disks: vec![empty.clone(); shape.disk_slots()],
        port_socket: scratch.join("probe-port.sock"),
        qmp_socket: scratch.join("probe-qmp.sock"),
        console_log: console.clone(),
        incoming: None,
        extra_append: "strata.probe".into(),
        netdev: None,
        vnc_socket: None,
        page_cached_slot: None,
        memory_image: None,
    };
    let shape = MachineShape {
        accel: Accel::Kvm,
        ..shape.clone()
    };
    let mut cmd = command(qemu, &shape, &files);
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // The probe dies with us.
    strata_host::exec::die_with_parent(&mut cmd);
    let Ok(mut child) = cmd.spawn() else {
        return false;
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut ok = false;
    while Instant::now() < deadline {
        if std::fs::read_to_string(&console).is_ok_and(|t| t.contains("strata-probe-ok")) {
            ok = true;
            break;
        }
        if matches!(child.try_wait(), Ok(Some(_))) {
            ok = std::fs::read_to_string(&console).is_ok_and(|t| t.contains("strata-probe-ok"));
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    for f in [&console, &empty, &files.port_socket, &files.qmp_socket] {
        let _ = std::fs::remove_file(f);
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(root: &str) -> MachineShape {
        MachineShape {
            machine: Machine::Microvm,
            accel: Accel::Tcg,
            memory_mib: 384,
            vcpus: 1,
            layers: 1,
            network: false,
            display: false,
            kernel: PathBuf::from(format!("{root}/guest/vmlinux")),
            initramfs: PathBuf::from(format!("{root}/vm/initramfs-8ecfb83f00603453.cpio")),
        }
    }

    #[test]
    fn a_snapshot_restores_on_a_node_keeping_the_same_files_elsewhere() {
        assert!(shape("/a").restores_as(&shape("/b")));
        let other_initramfs = MachineShape {
            initramfs: PathBuf::from("/b/vm/initramfs-0000000000000000.cpio"),
            ..shape("/b")
        };
        assert!(!shape("/a").restores_as(&other_initramfs));
        let bigger = MachineShape {
            memory_mib: 512,
            ..shape("/a")
        };
        assert!(!shape("/a").restores_as(&bigger));
    }
}
