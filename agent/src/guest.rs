//! Pid 1 of a microVM or VM guest (`/init` of the initramfs the runtime builds).
//!
//! Boot: mount the kernel filesystems, load the modules the initramfs carries (all but the
//! disk driver), find the host's virtio-serial port, and serve conversations multiplexed
//! over it. The guest then waits, disk-less, for `GuestSetup`: that is the state a template
//! snapshot captures, so a restored template probes the disks of *its* sandbox when the
//! setup loads the disk driver. Setup mounts each layer's EROFS image (data blob as its
//! `device=`), the writable ext4 disk, overlayfs over them, and switches into that root;
//! commands then run in a cgroup holding the sandbox's memory and process budgets, each in
//! the guest [`Jail`](crate::confine::Jail): the agent stays privileged, its commands do
//! not. They see a /dev of their own (the standard character devices, pts, shm), never the
//! guest's devtmpfs with its disks, console and the agent's virtio port.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};
use strata_agent_proto::{mux, AgentError, ErrorKind, GuestSetup, GuestStats, SandboxKey};

/// The name the host gives the agent's virtio-serial port.
pub const PORT_NAME: &str = "strata.agent";
const MODULES: &str = "/lib/modules";
const RUN: &str = "/run/strata";
const SANDBOX_CGROUP: &str = "/sys/fs/cgroup/sandbox";
/// The sandbox's /dev, made at boot and moved into its root at setup.
const SANDBOX_DEV: &str = "/run/strata/dev";

/// The guest console, opened at boot: the sandbox's /dev has none.
static CONSOLE: std::sync::OnceLock<Option<File>> = std::sync::OnceLock::new();

static SET_UP: Mutex<bool> = Mutex::new(false);

/// Whether this process is a guest's init: the kernel runs `/init` as pid 1.
pub fn is_guest_init() -> bool {
    std::process::id() == 1 && std::env::args().next().as_deref() == Some("/init")
}

pub fn main() -> ! {
    if let Err(e) = boot() {
        console(&format!("strata-agent: boot failed: {e}"));
    }
    // Pid 1 must not exit (the kernel panics); a failed boot leaves the host's timeout to
    // end the VM.
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn console(line: &str) {
    let c = CONSOLE.get_or_init(|| {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/console")
            .ok()
    });
    if let Some(mut c) = c.as_ref() {
        let _ = writeln!(c, "{line}");
    }
}

fn boot() -> Result<(), String> {
    for (src, dir, fstype) in [
        ("proc", "/proc", "proc"),
        ("sysfs", "/sys", "sysfs"),
        ("devtmpfs", "/dev", "devtmpfs"),
    ] {
        std::fs::create_dir_all(dir).map_err(|e| format!("{dir}: {e}"))?;
        mount(Some(src), dir, Some(fstype), MsFlags::empty(), None::<&str>)
            .map_err(|e| format!("mounting {dir}: {e}"))?;
    }
    console("strata-agent: booting");
    // The guest's OOM killer picks a command, never the agent.
    let _ = std::fs::write("/proc/self/oom_score_adj", "-1000");
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    // Every driver, virtio_blk included: a template's disks are probed before it is
    // saved (placeholders larger than any sandbox's file), so a restored guest only has
    // to forget what it read from them (`setup`).
    load_modules(|_| true)?;
    // What every sandbox needs is made before a template is saved, so a restored guest
    // does not run it again: its kernel filesystems (moved into the root at setup), the
    // budget cgroup and the loopback interface.
    kernel_filesystems()?;
    crate::sys::interface_up("lo", None)?;
    let _ = BOOT_DISKS.set(scan_disks());
    if cmdline.split_whitespace().any(|w| w == "strata.probe") {
        // The accelerator probe: reaching here proves the guest boots.
        console("strata-probe-ok");
        // Ends the VM (QEMU runs with -no-reboot).
        let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
    }
    let port = find_port(Duration::from_secs(30))?;
    console(&format!("strata-agent: serving on {}", port.display()));
    serve_port(&port)
}

/// Loads the initramfs's modules in `modules.load` order (dependencies first).
fn load_modules(wanted: impl Fn(&str) -> bool) -> Result<(), String> {
    load_module_list("modules.load", wanted)
}

/// Loads the modules a list file names, in its order.
fn load_module_list(list: &str, wanted: impl Fn(&str) -> bool) -> Result<(), String> {
    let order = std::fs::read_to_string(format!("{MODULES}/{list}"))
        .map_err(|e| format!("{MODULES}/{list}: {e}"))?;
    for name in order.lines().map(str::trim).filter(|n| !n.is_empty()) {
        if !wanted(name) {
            continue;
        }
        let path = format!("{MODULES}/{name}.ko");
        let f = File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        match nix::kmod::finit_module(&f, c"", nix::kmod::ModuleInitFlags::empty()) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(format!("loading module {name}: {e}")),
        }
    }
    Ok(())
}

fn find_port(within: Duration) -> Result<std::path::PathBuf, String> {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(rd) = std::fs::read_dir("/sys/class/virtio-ports") {
            for e in rd.flatten() {
                let name = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
                let dev = Path::new("/dev").join(e.file_name());
                if name.trim() == PORT_NAME && dev.exists() {
                    return Ok(dev);
                }
            }
        }
        if Instant::now() > deadline {
            return Err(format!("no virtio-serial port named {PORT_NAME}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Serves the host's conversations over the port, forever. Each host starts its session
/// with a [`mux::SYNC`], which ends the conversations of any host before it. An
/// end-of-file from the port means "no host" only once it lasts ([`NO_HOST_AFTER`]): the
/// kernel can report one between a host's request and its answer (see `mux::SYNC`), and
/// the stream goes on where it was when the host's data comes.
fn serve_port(path: &Path) -> Result<(), String> {
    let port = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let out = Arc::new(Mutex::new(
        port.try_clone().map_err(|e| format!("port: {e}"))?,
    ));
    let mut input = std::io::BufReader::with_capacity(256 << 10, PortReader::new(port));
    let shared = crate::serve::start_reaper();
    let mut conns: HashMap<u32, mux::Conversation> = HashMap::new();
    loop {
        match mux::read(&mut input) {
            Ok(Some((id, mux::OPEN, _))) => {
                let (ours, theirs) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
                let shared = shared.clone();
                std::thread::spawn(move || {
                    let _ = crate::serve::handle(theirs, shared);
                });
                match mux::join(id, ours, out.clone()) {
                    Ok(conv) => {
                        conns.insert(id, conv);
                    }
                    Err(e) => console(&format!("strata-agent: conversation {id}: {e}")),
                }
            }
            Ok(Some((_, mux::SYNC, _))) => end_all(&mut conns),
            Ok(Some(envelope)) => {
                if let Some(id) = mux::dispatch(&mut conns, &*out, envelope) {
                    console(&format!(
                        "strata-agent: conversation {id}: the host broke flow control; ended"
                    ));
                }
            }
            Ok(None) => end_all(&mut conns),
            Err(e) => {
                // A host that went away mid-envelope, or garbage: drop what is in flight and
                // wait for a host to start a clean stream.
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    console(&format!("strata-agent: port: {e}"));
                }
                end_all(&mut conns);
                input = std::io::BufReader::with_capacity(256 << 10, input.into_inner());
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// How long the port must report no host before the guest takes it as gone.
const NO_HOST_AFTER: Duration = Duration::from_secs(10);

/// The port as a byte stream that ends only when no host has been there for
/// [`NO_HOST_AFTER`]: a shorter end-of-file is waited out, keeping the stream's place.
struct PortReader<R> {
    port: R,
    no_host_since: Option<Instant>,
}

impl<R: std::io::Read> PortReader<R> {
    fn new(port: R) -> PortReader<R> {
        PortReader {
            port,
            no_host_since: None,
        }
    }
}

impl<R: std::io::Read> std::io::Read for PortReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            match self.port.read(buf)? {
                0 => {
                    let since = *self.no_host_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= NO_HOST_AFTER {
                        self.no_host_since = None;
                        return Ok(0);
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                n => {
                    self.no_host_since = None;
                    return Ok(n);
                }
            }
        }
    }
}

fn end_all(conns: &mut HashMap<u32, mux::Conversation>) {
    for (_, conv) in conns.drain() {
        conv.end();
    }
}

/// Mounts the sandbox's root from its disks, enters it and takes the sandbox's key (once
/// per boot); from then on commands run, in the guest jail.
pub fn setup(s: &GuestSetup) -> Result<(), AgentError> {
    let key = SandboxKey::from_hex(&s.key).map_err(crate::serve::bad_key)?;
    set_up(s).map_err(|e| AgentError::new(ErrorKind::Setup, e))?;
    let jail = if s.privileged {
        console("strata-agent: privileged: commands keep the guest's full privileges");
        crate::confine::Jail::privileged()
    } else {
        crate::confine::Jail::guest().map_err(|e| AgentError::new(ErrorKind::Setup, e))?
    };
    if !s.privileged && !jail.scoped() {
        console("strata-agent: this kernel has no Landlock: commands are not scoped");
    }
    let _ = crate::serve::JAIL.set(jail);
    crate::serve::set_key(key);
    Ok(())
}

fn set_up(s: &GuestSetup) -> Result<(), String> {
    let mut done = SET_UP.lock().unwrap_or_else(|p| p.into_inner());
    if *done {
        return Err("this guest is already set up".into());
    }
    let t = Instant::now();
    let mut marks = Vec::new();
    let mut mark = |what: &str| marks.push(format!("{what} {}ms", t.elapsed().as_millis()));
    set_clock_and_entropy(s.time_ns, &s.seed)?;
    if s.display {
        load_module_list("modules.display", |_| true)?;
    }
    mark("driver");
    let mut wanted: Vec<&str> = vec![s.upper.as_str()];
    for layer in s.layers.iter().chain(&s.view_layers) {
        wanted.push(&layer.meta);
        wanted.extend(layer.blob.as_deref());
    }
    wanted.extend(s.root_image.as_ref().map(|i| i.serial.as_str()));
    let disks = disks_by_serial(&wanted, Duration::from_secs(20))?;
    let dev = |serial: &str| disks[serial].clone();
    for serial in &wanted {
        forget_disk_contents(&dev(serial))?;
    }
    if let Some(image) = &s.root_image {
        reread_partitions(&dev(&image.serial))?;
    }
    mark("disks");

    let mut lower = Vec::new();
    for (i, layer) in s.layers.iter().chain(&s.view_layers).enumerate() {
        let meta = &layer.meta;
        let dir = format!("{RUN}/layers/{i}");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{dir}: {e}"))?;
        let data = layer.blob.as_deref().map(|b| format!("device={}", dev(b)));
        mount(
            Some(dev(meta).as_str()),
            dir.as_str(),
            Some("erofs"),
            MsFlags::MS_RDONLY,
            data.as_deref(),
        )
        .map_err(|e| format!("mounting layer {i} ({meta}) at {dir}: {e}"))?;
        lower.push(dir);
    }
    // The views' own layers are mounted beside the stack's, not in it.
    let mounted_layers = lower.clone();
    lower.truncate(s.layers.len());
    if let Some(image) = &s.root_image {
        let dir = format!("{RUN}/image");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{dir}: {e}"))?;
        mount_root_image(&dev(&image.serial), image.partition, &dir)?;
        lower.push(dir);
    }
    mark("layers");
    let disk = format!("{RUN}/disk");
    std::fs::create_dir_all(&disk).map_err(|e| format!("{disk}: {e}"))?;
    mount(
        Some(dev(&s.upper).as_str()),
        disk.as_str(),
        Some("ext4"),
        MsFlags::MS_NOATIME,
        // No background zeroing of inode tables: it would take the guest's CPU from the
        // sandbox, and a sandbox's disk never needs fsck.
        Some("noinit_itable"),
    )
    .map_err(|e| format!("mounting the writable disk at {disk}: {e}"))?;
    let (upper, work) = (format!("{disk}/upper"), format!("{disk}/work"));
    for d in [&upper, &work] {
        std::fs::create_dir_all(d).map_err(|e| format!("{d}: {e}"))?;
    }
    for d in &s.merge_dirs {
        let p = Path::new(&upper).join(&d.path);
        if p.exists() {
            continue;
        }
        std::fs::create_dir_all(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(d.mode));
        let _ = std::os::unix::fs::lchown(&p, Some(d.uid), Some(d.gid));
    }
    let root = format!("{RUN}/root");
    std::fs::create_dir_all(&root).map_err(|e| format!("{root}: {e}"))?;
    let opts = format!(
        "lowerdir={},upperdir={upper},workdir={work}",
        lower.join(":")
    );
    mount(
        Some("overlay"),
        root.as_str(),
        Some("overlay"),
        MsFlags::empty(),
        Some(opts.as_str()),
    )
    .map_err(|e| format!("mounting the overlay: {e}"))?;
    mark("overlay");
    mount_views(&root, &mounted_layers, &s.views)?;
    enter_root(&root, s.privileged)?;
    nix::unistd::sethostname(&s.hostname).map_err(|e| format!("sethostname: {e}"))?;
    if let Some(net) = &s.network {
        network(net)?;
    }
    budgets(s.memory_bytes, s.pids)?;
    mark("root");
    console(&format!("strata-agent: set up: {}", marks.join(", ")));
    *done = true;
    Ok(())
}

/// Mounts the read-only views over the root at `root` (before the agent enters it, so
/// before any command runs), each tree one of `layers` (the mounted layers: the stack's,
/// then the views' own) or several stacked without an upper, by the rules the host's
/// views follow (`strata_host::views`).
fn mount_views(
    root: &str,
    layers: &[String],
    views: &[strata_agent_proto::GuestView],
) -> Result<(), String> {
    if views.is_empty() {
        return Ok(());
    }
    let open_dir = |p: &str| {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
            .open(p)
            .map_err(|e| format!("{p}: {e}"))
    };
    let mut trees = Vec::new();
    for (i, v) in views.iter().enumerate() {
        let dirs = v
            .layers
            .iter()
            .map(|&j| {
                layers.get(j).cloned().ok_or_else(|| {
                    format!("the view at {} names layer {j}, which is not mounted", v.at)
                })
            })
            .collect::<Result<Vec<String>, String>>()?;
        let tree = match dirs.as_slice() {
            [] => return Err(format!("the read-only view at {} has no layers", v.at)),
            [one] => one.clone(),
            many => {
                let dir = format!("{RUN}/views/{i}");
                std::fs::create_dir_all(&dir).map_err(|e| format!("{dir}: {e}"))?;
                // Without an upper, overlayfs mounts read-only.
                mount(
                    Some("overlay"),
                    dir.as_str(),
                    Some("overlay"),
                    MsFlags::MS_RDONLY,
                    Some(format!("lowerdir={}", many.join(":")).as_str()),
                )
                .map_err(|e| format!("stacking the layers of the view at {}: {e}", v.at))?;
                dir
            }
        };
        trees.push(open_dir(&tree)?);
    }
    let root = open_dir(root)?;
    let views: Vec<strata_host::views::View<'_>> = views
        .iter()
        .zip(&trees)
        .map(|(v, tree)| strata_host::views::View {
            tree,
            from: &v.from,
            at: &v.at,
        })
        .collect();
    strata_host::views::mount_views(&root, &views).map_err(|e| e.to_string())
}

/// Drops the pages the kernel cached from a disk: in a guest restored from a template
/// they came from the template's placeholder, not from this sandbox's file.
fn forget_disk_contents(dev: &str) -> Result<(), String> {
    let f = File::open(dev).map_err(|e| format!("{dev}: {e}"))?;
    nix::fcntl::posix_fadvise(
        &f,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .map_err(|e| format!("dropping the cached pages of {dev}: {e}"))
}

/// Reads a disk's partition table again (a template's placeholder had none).
fn reread_partitions(dev: &str) -> Result<(), String> {
    let f = File::open(dev).map_err(|e| format!("{dev}: {e}"))?;
    crate::sys::reread_partitions(&f)
        .map_err(|e| format!("reading the partition table of {dev}: {e}"))
}

/// Filesystems a root image may hold (the ones this guest's kernel has).
const IMAGE_FILESYSTEMS: [&str; 2] = ["ext4", "erofs"];

/// Mounts the root filesystem of the disk image at `disk` read-only at `dir`: partition
/// `partition`, or else the first partition that mounts, or else the whole disk.
fn mount_root_image(disk: &str, partition: Option<u32>, dir: &str) -> Result<(), String> {
    let name = disk.trim_start_matches("/dev/");
    let part = |n: u32| format!("{name}{n}");
    // The kernel reads the partition table just after the disk appears.
    let partitions = |within: Duration| -> Vec<String> {
        let deadline = Instant::now() + within;
        loop {
            let mut found: Vec<(u32, String)> = std::fs::read_dir(format!("/sys/block/{name}"))
                .map(|rd| {
                    rd.flatten()
                        .filter_map(|e| {
                            let entry = e.file_name().to_string_lossy().into_owned();
                            let n = entry.strip_prefix(name)?.parse().ok()?;
                            Path::new(&format!("/dev/{entry}"))
                                .exists()
                                .then_some((n, entry))
                        })
                        .collect()
                })
                .unwrap_or_default();
            found.sort();
            if !found.is_empty() || Instant::now() > deadline {
                return found.into_iter().map(|(_, p)| p).collect();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let candidates = match partition {
        Some(n) => {
            let wanted = part(n);
            let found = partitions(Duration::from_secs(5));
            if !found.contains(&wanted) {
                let numbers: Vec<&str> = found.iter().map(|p| &p[name.len()..]).collect();
                return Err(format!(
                    "disk_image.partition = {n}: the image has no partition {n} (it has {})",
                    if found.is_empty() {
                        "none".to_string()
                    } else {
                        numbers.join(", ")
                    }
                ));
            }
            vec![wanted]
        }
        None => {
            let mut sector = [0u8; 512];
            let labelled = std::fs::File::open(disk)
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut sector))
                .is_ok()
                && sector[510..] == [0x55, 0xaa];
            let mut c = if labelled {
                partitions(Duration::from_secs(2))
            } else {
                Vec::new()
            };
            c.push(name.to_string());
            c
        }
    };
    let mut tried = Vec::new();
    for dev in &candidates {
        for fs in IMAGE_FILESYSTEMS {
            // A read-only disk cannot replay a journal: mount what the journal holds
            // as it was last cleanly written.
            let data = (fs == "ext4").then_some("noload");
            match mount(
                Some(format!("/dev/{dev}").as_str()),
                dir,
                Some(fs),
                MsFlags::MS_RDONLY,
                data,
            ) {
                Ok(()) => {
                    console(&format!("strata-agent: root image {dev} ({fs})"));
                    return Ok(());
                }
                Err(e) => tried.push(format!("{dev} as {fs}: {e}")),
            }
        }
    }
    Err(format!(
        "no root filesystem this guest can mount in the disk image ({}); set disk_image.partition or use an ext4 or EROFS root",
        tried.join("; ")
    ))
}

/// The disks found at boot, device path by serial: a disk's serial is read from the
/// device (a request to QEMU each), so a template's guest asks once, before it is saved.
static BOOT_DISKS: std::sync::OnceLock<HashMap<String, String>> = std::sync::OnceLock::new();

/// The virtio disks present now, device path by serial.
fn scan_disks() -> HashMap<String, String> {
    let mut found = HashMap::new();
    if let Ok(rd) = std::fs::read_dir("/sys/block") {
        for e in rd.flatten() {
            let serial = std::fs::read_to_string(e.path().join("serial")).unwrap_or_default();
            let dev = format!("/dev/{}", e.file_name().to_string_lossy());
            if Path::new(&dev).exists() {
                found.insert(serial.trim().to_string(), dev);
            }
        }
    }
    found
}

/// Waits for the disks with these serial numbers; their device paths by serial.
fn disks_by_serial(serials: &[&str], within: Duration) -> Result<HashMap<String, String>, String> {
    if let Some(known) = BOOT_DISKS.get() {
        if serials.iter().all(|s| known.contains_key(*s)) {
            return Ok(known.clone());
        }
    }
    let deadline = Instant::now() + within;
    loop {
        let found = scan_disks();
        if serials.iter().all(|s| found.contains_key(*s)) {
            return Ok(found);
        }
        if Instant::now() > deadline {
            let missing: Vec<_> = serials
                .iter()
                .filter(|s| !found.contains_key(**s))
                .collect();
            return Err(format!("disks {missing:?} never appeared"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The kernel filesystems a sandbox sees under /proc, /sys and /dev (mounted at boot over
/// the initramfs, moved into the sandbox's root by [`enter_root`]), and the cgroup its
/// commands join.
fn kernel_filesystems() -> Result<(), String> {
    let pts = format!("{SANDBOX_DEV}/pts");
    let shm = format!("{SANDBOX_DEV}/shm");
    for (src, dir, fstype, data) in [
        ("tmpfs", SANDBOX_DEV, "tmpfs", Some("mode=0755,size=64k")),
        (
            "devpts",
            &pts,
            "devpts",
            Some("newinstance,ptmxmode=0666,mode=620"),
        ),
        ("tmpfs", &shm, "tmpfs", Some("mode=1777")),
        ("cgroup2", "/sys/fs/cgroup", "cgroup2", None),
    ] {
        std::fs::create_dir_all(dir).map_err(|e| format!("{dir}: {e}"))?;
        let flags = if fstype == "cgroup2" {
            MsFlags::empty()
        } else {
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC
        };
        mount(Some(src), dir, Some(fstype), flags, data)
            .map_err(|e| format!("mounting {dir}: {e}"))?;
    }
    sandbox_devices()?;
    std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+memory +pids")
        .map_err(|e| format!("enabling the memory and pids controllers: {e}"))?;
    std::fs::create_dir_all(SANDBOX_CGROUP).map_err(|e| format!("{SANDBOX_CGROUP}: {e}"))
}

/// The character devices of the sandbox's /dev (what a container gets), and its links.
fn sandbox_devices() -> Result<(), String> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    for (name, major, minor) in [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ] {
        let path = format!("{SANDBOX_DEV}/{name}");
        mknod(
            path.as_str(),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(major, minor),
        )
        .map_err(|e| format!("{path}: {e}"))?;
        // mknod applies the umask.
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666));
    }
    for (link, to) in crate::confine::DEV_LINKS {
        let path = format!("{SANDBOX_DEV}/{link}");
        std::os::unix::fs::symlink(to, &path).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}

/// Makes `root` the root of the whole guest (as switch_root does: the initramfs cannot be
/// pivoted away), with the boot's kernel filesystems moved inside.
fn enter_root(root: &str, privileged: bool) -> Result<(), String> {
    let sub = |p: &str| format!("{root}{p}");
    // A privileged guest's commands get the guest's devtmpfs (loop devices, FUSE, disks),
    // with the sandbox /dev's pts and shm moved into it.
    let mut moves = vec![("/proc".to_string(), "/proc"), ("/sys".to_string(), "/sys")];
    if privileged {
        moves.push(("/dev".to_string(), "/dev"));
        moves.push((format!("{SANDBOX_DEV}/pts"), "/dev/pts"));
        moves.push((format!("{SANDBOX_DEV}/shm"), "/dev/shm"));
    } else {
        moves.push((SANDBOX_DEV.to_string(), "/dev"));
    }
    for (dir, to) in &moves {
        let dir = dir.as_str();
        let target = sub(to);
        std::fs::create_dir_all(&target).map_err(|e| format!("{target}: {e}"))?;
        mount(
            Some(dir),
            target.as_str(),
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(|e| format!("moving {dir} into the sandbox root: {e}"))?;
    }
    let run = sub("/run");
    std::fs::create_dir_all(&run).map_err(|e| format!("{run}: {e}"))?;
    mount(
        Some("tmpfs"),
        run.as_str(),
        Some("tmpfs"),
        MsFlags::empty(),
        Some("mode=0755"),
    )
    .map_err(|e| format!("mounting /run in the sandbox root: {e}"))?;
    // The guest's kernel is the sandbox's own, but its commands get the same view of it
    // as a container's (a privileged guest's get all of it).
    if !privileged {
        crate::confine::mask_kernel_files(std::path::Path::new(root))?;
    }
    nix::unistd::chdir(root).map_err(|e| format!("chdir {root}: {e}"))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(|e| format!("moving the root: {e}"))?;
    nix::unistd::chroot(".").map_err(|e| format!("chroot: {e}"))?;
    nix::unistd::chdir("/").map_err(|e| format!("chdir /: {e}"))?;
    Ok(())
}

/// The allowlisted network: the one virtio NIC gets its address and its default route
/// (the host's side of the link, where the host's rules and the sandbox's egress proxy
/// are), /etc/resolv.conf names the proxy, and any names given go into /etc/hosts. Run
/// again by a restored copy with its own link: the address is replaced, and so is the
/// route.
pub fn network(net: &strata_agent_proto::GuestNetwork) -> Result<(), String> {
    let nic = std::fs::read_dir("/sys/class/net")
        .map_err(|e| format!("/sys/class/net: {e}"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n != "lo")
        .ok_or("the sandbox allows network destinations but the guest has no interface")?;
    let parse = |a: &str| {
        a.parse::<std::net::Ipv4Addr>()
            .map_err(|_| format!("bad guest network address {a}"))
    };
    crate::sys::interface_up(&nic, Some((parse(&net.address)?, net.prefix)))?;
    if let Some(gw) = &net.gateway {
        crate::sys::default_route(parse(gw)?)?;
    }
    if let Some(ns) = &net.nameserver {
        parse(ns)?;
        std::fs::write(
            "/etc/resolv.conf",
            format!("nameserver {ns}\noptions attempts:2 timeout:2\n"),
        )
        .map_err(|e| format!("/etc/resolv.conf: {e}"))?;
    }
    if net.hosts.is_empty() {
        return Ok(());
    }
    let mut hosts = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
    if !hosts.is_empty() && !hosts.ends_with('\n') {
        hosts.push('\n');
    }
    for h in &net.hosts {
        hosts.push_str(&format!("{}\t{}\n", h.address, h.name));
    }
    std::fs::write("/etc/hosts", hosts).map_err(|e| format!("/etc/hosts: {e}"))
}

/// The cgroup every command joins: the sandbox's memory and process budgets, enforced by
/// the guest kernel (the guest has some memory beyond the budget for itself and the agent).
fn budgets(memory: u64, pids: u32) -> Result<(), String> {
    let write = |p: &str, v: &str| std::fs::write(p, v).map_err(|e| format!("{p}: {e}"));
    write(&format!("{SANDBOX_CGROUP}/memory.max"), &memory.to_string())?;
    let _ = write(&format!("{SANDBOX_CGROUP}/memory.swap.max"), "0");
    write(&format!("{SANDBOX_CGROUP}/pids.max"), &pids.to_string())?;
    let procs = CString::new(format!("{SANDBOX_CGROUP}/cgroup.procs"))
        .map_err(|_| "cgroup path".to_string())?;
    let _ = crate::serve::COMMAND_CGROUP.set(procs);
    Ok(())
}

/// After a restore: the host's clock and fresh entropy.
/// After a restore or a wake: the host's clock and entropy; for a restored copy (a fork)
/// its own host name and a new machine ID, so no two copies share an identity.
pub fn reseed(time_ns: u64, seed: &[u8], hostname: Option<&str>) -> Result<(), AgentError> {
    if !is_guest_init() {
        // A container's agent shares the host's clock and entropy pool, and its host name
        // is set from outside (it may not set it): a restored copy only takes its key.
        if seed.is_empty() && hostname.is_none() {
            return Ok(());
        }
        return Err(AgentError::new(
            ErrorKind::Invalid,
            "only a VM guest's agent takes clock, entropy and host name from the host",
        ));
    }
    set_clock_and_entropy(time_ns, seed).map_err(|e| AgentError::new(ErrorKind::Other, e))?;
    if let Some(name) = hostname {
        nix::unistd::sethostname(name)
            .map_err(|e| AgentError::new(ErrorKind::Other, format!("sethostname: {e}")))?;
        // Only where the root has one (systemd-style); drawn from the pool just reseeded.
        let path = std::path::Path::new("/etc/machine-id");
        if path.exists() {
            let mut id = [0u8; 16];
            File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut id))
                .map_err(|e| AgentError::new(ErrorKind::Other, format!("/dev/urandom: {e}")))?;
            let text: String = id.iter().map(|b| format!("{b:02x}")).collect();
            std::fs::write(path, format!("{text}\n")).map_err(|e| {
                AgentError::new(ErrorKind::Other, format!("writing /etc/machine-id: {e}"))
            })?;
        }
    }
    Ok(())
}

/// Sets the clock and credits the host's entropy to the guest's pool.
fn set_clock_and_entropy(time_ns: u64, seed: &[u8]) -> Result<(), String> {
    if !is_guest_init() {
        return Err("only a VM guest's agent takes clock and entropy from the host".into());
    }
    let ts = libc::timespec {
        tv_sec: (time_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (time_ns % 1_000_000_000) as libc::c_long,
    };
    nix::time::clock_settime(
        nix::time::ClockId::CLOCK_REALTIME,
        nix::sys::time::TimeSpec::from(ts),
    )
    .map_err(|e| format!("setting the clock: {e}"))?;
    if seed.is_empty() {
        return Ok(());
    }
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + seed.len());
    info.extend_from_slice(&((seed.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(seed.len() as i32).to_ne_bytes());
    info.extend_from_slice(seed);
    let f = File::open("/dev/urandom").map_err(|e| format!("/dev/urandom: {e}"))?;
    crate::sys::add_entropy(&f, &info).map_err(|e| format!("adding entropy: {e}"))
}

/// The sandbox cgroup's budget counters and the writable disk's use.
pub fn stats() -> Result<GuestStats, AgentError> {
    if !*SET_UP.lock().unwrap_or_else(|p| p.into_inner()) {
        return Err(AgentError::new(
            ErrorKind::Invalid,
            "no sandbox is set up in this agent",
        ));
    }
    let read =
        |f: &str| std::fs::read_to_string(format!("{SANDBOX_CGROUP}/{f}")).unwrap_or_default();
    let field = |text: &str, key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    // Counted as the host counts its own uppers (out of inodes is full).
    let (disk_used, disk_size) = strata_host::fs::disk_use(std::path::Path::new("/"))
        .map_err(|e| AgentError::new(ErrorKind::Other, format!("statvfs /: {e}")))?;
    Ok(GuestStats {
        oom_kills: field(&read("memory.events"), "oom_kill "),
        pids_max_hits: field(&read("pids.events"), "max "),
        memory_bytes: read("memory.current").trim().parse().unwrap_or(0),
        disk_used,
        disk_size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// A port that answers each read with the next of its pieces (an empty piece is an
    /// end-of-file: "no host" at that moment), then ends for good.
    struct Port(VecDeque<Vec<u8>>);

    impl std::io::Read for Port {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let Some(mut piece) = self.0.pop_front() else {
                return Ok(0);
            };
            let n = piece.len().min(buf.len());
            buf[..n].copy_from_slice(&piece[..n]);
            if n < piece.len() {
                piece.drain(..n);
                self.0.push_front(piece);
            }
            Ok(n)
        }
    }

    /// The race the 16-microVM hibernation test lost once in CI: a loaded guest read the
    /// host's request, then "no host" (the kernel's word from QEMU arrived late), and
    /// ended the conversation the host was waiting on. A short end-of-file, even inside
    /// an envelope, now leaves the stream where it was.
    #[test]
    fn a_short_end_of_file_keeps_the_stream_and_its_place() {
        let mut bytes = Vec::new();
        mux::start_session(&mut bytes).unwrap();
        mux::write(&mut bytes, 7, mux::OPEN, b"").unwrap();
        mux::write(&mut bytes, 7, mux::DATA, b"hello guest").unwrap();
        let (a, b) = bytes.split_at(bytes.len() - 5);
        let port = Port(VecDeque::from([
            a.to_vec(),
            Vec::new(),
            Vec::new(),
            b.to_vec(),
            Vec::new(),
        ]));
        let mut r = std::io::BufReader::new(PortReader::new(port));
        assert_eq!(mux::read(&mut r).unwrap(), Some((0, mux::SYNC, vec![])));
        assert_eq!(mux::read(&mut r).unwrap(), Some((7, mux::OPEN, vec![])));
        assert_eq!(
            mux::read(&mut r).unwrap(),
            Some((7, mux::DATA, b"hello guest".to_vec()))
        );
    }
}
