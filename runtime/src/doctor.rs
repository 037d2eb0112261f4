//! What a host must have to run sandboxes, checked one piece at a time, each failure with
//! the fix (`strata doctor`).

use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::Command;

use serde::Serialize;

use crate::cgroup::{CgroupMode, Cgroups};
use crate::RuntimeConfig;

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Works, but something users may want is missing or degraded.
    Warn,
    Fail,
}

/// One checked piece of the host.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    /// Whether a sandbox can run without it.
    pub required: bool,
    pub detail: String,
    /// What to do about a warning or failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn new(
        name: &'static str,
        required: bool,
        r: Result<String, (Status, String, String)>,
    ) -> Check {
        match r {
            Ok(detail) => Check {
                name,
                status: Status::Ok,
                required,
                detail,
                fix: None,
            },
            Err((status, detail, fix)) => Check {
                name,
                status,
                required,
                detail,
                fix: Some(fix),
            },
        }
    }
}

type Outcome = Result<String, (Status, String, String)>;

fn fail(detail: impl Into<String>, fix: impl Into<String>) -> Outcome {
    Err((Status::Fail, detail.into(), fix.into()))
}

fn warn(detail: impl Into<String>, fix: impl Into<String>) -> Outcome {
    Err((Status::Warn, detail.into(), fix.into()))
}

/// The first line a tool prints for `--version`, or why it could not run.
fn version(tool: &Path) -> Result<String, String> {
    let out = Command::new(tool)
        .arg("--version")
        .output()
        .map_err(|e| format!("{}: {e}", tool.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.lines().next().unwrap_or_default().trim().to_string())
}

/// Every check, in the order a person fixes them.
pub fn check_host(cfg: &RuntimeConfig) -> Vec<Check> {
    let mut checks = Vec::new();
    checks.push(Check::new("root", true, {
        if nix::unistd::geteuid().is_root() {
            Ok("running as root".into())
        } else {
            fail(
                "not running as root: sandboxes need mounts, namespaces and cgroups",
                "run as root (sudo strata ...)",
            )
        }
    }));
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    checks.push(Check::new(
        "kernel",
        false,
        Ok(format!("Linux {}", release.trim())),
    ));
    checks.push(Check::new("fuse", true, fuse()));
    checks.push(Check::new("erofs", true, erofs(&cfg.state_dir)));
    checks.push(Check::new("overlayfs", true, filesystem("overlay")));
    checks.push(Check::new("cgroups", true, cgroups(&cfg.cgroup_root)));
    checks.push(Check::new("mkfs.ext4", true, {
        match crate::on_path("mkfs.ext4") {
            Some(p) => Ok(format!(
                "{} (formats the writable layers once per size)",
                p.display()
            )),
            None => fail("mkfs.ext4 not found", "apt-get install e2fsprogs"),
        }
    }));
    checks.push(Check::new("agent", true, {
        if cfg.agent.is_file() {
            Ok(format!("{} (fncall sandboxes)", cfg.agent.display()))
        } else {
            fail(
                format!("{} is missing", cfg.agent.display()),
                "cargo build -p strata-agent (or set STRATA_AGENT)",
            )
        }
    }));
    checks.push(Check::new("static agent", false, {
        match &cfg.container_agent {
            Some(p) if p.is_file() => Ok(format!(
                "{} (init of containers and VM guests)",
                p.display()
            )),
            _ => warn(
                "no statically linked strata-agent: containers run commands with `<oci runtime> exec` and without the seccomp policy's refusal of file system ioctls, VM sandboxes cannot start",
                "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS=\"-C target-feature=+crt-static\" cargo build -p strata-agent --target x86_64-unknown-linux-gnu (or set STRATA_STATIC_AGENT)",
            ),
        }
    }));
    checks.push(Check::new("criu", false, {
        match &cfg.criu {
            Some(p) if p.is_file() => match version(p) {
                Ok(v) if v.contains("4.") => {
                    Ok(format!("{v} at {} (container hibernation)", p.display()))
                }
                Ok(v) => warn(
                    format!(
                        "{} is {v}: container hibernation needs CRIU 4.1+ with Strata's patch",
                        p.display()
                    ),
                    "bash scripts/criu.sh (or set STRATA_CRIU)",
                ),
                Err(e) => warn(
                    format!("{} does not run: {e}", p.display()),
                    "bash scripts/criu.sh (or set STRATA_CRIU)",
                ),
            },
            _ => warn(
                "no CRIU: containers cannot hibernate (pause still works)",
                "bash scripts/criu.sh (or set STRATA_CRIU)",
            ),
        }
    }));
    checks.push(Check::new("oci runtime", false, {
        let bin = cfg.oci_runtime.binary();
        let resolved = if bin.is_absolute() {
            Some(bin.to_path_buf())
        } else {
            crate::on_path(&bin.to_string_lossy())
        };
        match resolved.map(|p| version(&p)) {
            Some(Ok(v)) => Ok(format!("{v} (container sandboxes)")),
            _ => fail(
                format!("{} not found: no container sandboxes", bin.display()),
                "apt-get install crun (or runc, with STRATA_OCI_RUNTIME=runc)",
            ),
        }
    }));
    checks.push(Check::new("landlock", false, landlock()));
    checks.push(Check::new(
        "launch namespace",
        false,
        launch_namespace(&cfg.state_dir),
    ));
    checks.push(Check::new("qemu", false, {
        let qemu = &cfg.vm.qemu;
        let found = if qemu.components().count() > 1 {
            Some(qemu.clone())
        } else {
            crate::on_path(&qemu.to_string_lossy())
        };
        match found.map(|p| version(&p)) {
            Some(Ok(v)) => Ok(format!("{v} (microvm and vm sandboxes)")),
            _ => warn(
                format!("{} not found: no microvm or vm sandboxes", qemu.display()),
                "apt-get install qemu-system-x86",
            ),
        }
    }));
    checks.push(Check::new("guest kernel", false, {
        let dir = &cfg.vm.guest_dir;
        if dir.join("vmlinux").is_file() && dir.join("modules.load").is_file() {
            let v = std::fs::read_to_string(dir.join("kernel.version")).unwrap_or_default();
            Ok(format!("{} in {}", v.trim(), dir.display()))
        } else {
            warn(
                format!("no prepared guest kernel in {}", dir.display()),
                "bash scripts/guest-kernel.sh (or set STRATA_GUEST_DIR)",
            )
        }
    }));
    checks.push(Check::new("kvm", false, kvm(&cfg.vm.accel)));
    checks.push(Check::new("network tools", false, {
        let missing: Vec<&str> = ["nft", "ip"]
            .into_iter()
            .filter(|t| crate::on_path(t).is_none())
            .collect();
        if missing.is_empty() {
            Ok("nft and ip (network allowlists)".into())
        } else {
            warn(
                format!(
                    "{} not found: sandboxes with a network allowlist cannot start",
                    missing.join(", ")
                ),
                "apt-get install nftables iproute2",
            )
        }
    }));
    checks.push(Check::new("disk", true, disk(&cfg.state_dir)));
    checks
}

/// Whether a sandbox can run on a host with these checks.
pub fn ready(checks: &[Check]) -> bool {
    checks
        .iter()
        .all(|c| !(c.required && c.status == Status::Fail))
}

fn fuse() -> Outcome {
    use std::os::unix::fs::MetadataExt;
    let dev = Path::new("/dev/fuse");
    let fix = "modprobe fuse (and apt-get install fuse3); in a container, pass /dev/fuse in";
    let meta = match std::fs::metadata(dev) {
        Ok(m) => m,
        Err(e) => return fail(format!("/dev/fuse: {e}"), fix),
    };
    let rdev = meta.rdev();
    let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
    if !meta.file_type().is_char_device() || (major, minor) != (10, 229) {
        return fail(
            format!("/dev/fuse is not the FUSE device (it is {major}:{minor}, expected 10:229)"),
            fix,
        );
    }
    match std::fs::OpenOptions::new().read(true).write(true).open(dev) {
        Ok(_) => Ok("/dev/fuse (lazily loaded layers)".into()),
        Err(e) => fail(format!("opening /dev/fuse: {e}"), fix),
    }
}

fn filesystem(name: &str) -> Outcome {
    let known = std::fs::read_to_string("/proc/filesystems")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().last() == Some(name));
    if known {
        Ok(format!("{name} in /proc/filesystems"))
    } else {
        fail(
            format!("the kernel has no {name} filesystem"),
            format!("modprobe {name}"),
        )
    }
}

/// The nearest directory of `dir` that exists (doctor creates nothing).
fn existing(dir: &Path) -> &Path {
    dir.ancestors()
        .find(|d| d.is_dir())
        .unwrap_or(Path::new("/"))
}

fn erofs(state_dir: &Path) -> Outcome {
    match strata_host::erofs_file_backed(existing(state_dir)) {
        Ok(strata_host::ErofsSource::File) => {
            Ok("layers mount file-backed (the kernel mounts EROFS from a file)".into())
        }
        Ok(strata_host::ErofsSource::Loop) => {
            if Path::new("/dev/loop-control").exists() {
                Ok(
                    "layers mount through loop devices (this kernel has no file-backed EROFS)"
                        .into(),
                )
            } else {
                fail(
                    "this kernel mounts EROFS only from block devices and there is no /dev/loop-control",
                    "modprobe loop",
                )
            }
        }
        Err(e) => fail(
            format!("EROFS: {e}"),
            "modprobe erofs (a kernel with CONFIG_EROFS_FS)",
        ),
    }
}

fn cgroups(root: &Path) -> Outcome {
    match Cgroups::probe(root, "strata-doctor".into()) {
        Ok(cg) => {
            let controllers = match cg.mode() {
                CgroupMode::V2 => std::fs::read_to_string(root.join("cgroup.controllers"))
                    .unwrap_or_default()
                    .trim()
                    .to_string(),
                _ => "memory cpu pids freezer".to_string(),
            };
            Ok(format!(
                "{} at {}: {controllers}",
                cg.mode(),
                root.display()
            ))
        }
        Err(e) => fail(
            e.to_string(),
            "boot with cgroups mounted at /sys/fs/cgroup (systemd does)",
        ),
    }
}

/// Whether host sandboxes can start from a launch mount namespace (`strata_host::mountns`):
/// one is made, a directory carried into a fresh copy of it, and a process run there.
fn launch_namespace(state_dir: &Path) -> Outcome {
    use strata_host::mountns;
    let dir = existing(state_dir);
    let tried = (|| -> std::io::Result<()> {
        let template = mountns::Template::new(dir)?;
        let carried = mountns::carry(dir)?;
        let mut cmd = Command::new("true");
        mountns::enter(&mut cmd, &template, vec![carried], None)?;
        let status = cmd.status()?;
        if status.success() {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "a process in it ended with {status}"
            )))
        }
    })();
    match tried {
        Ok(()) => Ok(
            "sandboxes start in a copy of the host's mounts without the other sandboxes' (open_tree, move_mount)"
                .into(),
        ),
        Err(e) => warn(
            format!("no launch mount namespace ({e}): every sandbox start copies the host's whole mount table, slower as sandboxes accumulate"),
            "Linux 5.2+ with open_tree and move_mount allowed to root (a seccomp profile around Strata may refuse them)",
        ),
    }
}

fn landlock() -> Outcome {
    match strata_host::landlock_abi() {
        0 => warn(
            "no Landlock: commands of one sandbox can ptrace each other (never the agent)",
            "boot a kernel with Landlock enabled (lsm=landlock,...)",
        ),
        1 => warn(
            "Landlock ABI 1 refuses renames across directories to confined processes: not used, so commands of one sandbox can ptrace each other",
            "a Linux 5.19+ kernel",
        ),
        abi @ 2..=5 => Ok(format!(
            "ABI {abi}: each exec is a domain of its own (ptrace and memory); signals are scoped from ABI 6 (Linux 6.12)"
        )),
        abi => Ok(format!("ABI {abi}: each exec is a domain of its own (ptrace, memory and signals)")),
    }
}

fn kvm(accel: &str) -> Outcome {
    let dev = Path::new("/dev/kvm");
    if accel == "tcg" {
        return Ok("STRATA_VM_ACCEL=tcg: VMs run under TCG (emulation)".into());
    }
    if !dev.exists() {
        return warn(
            "no /dev/kvm: VMs run under TCG (emulation, several times slower)",
            "enable virtualization in the firmware, or nested virtualization, and modprobe kvm_intel / kvm_amd",
        );
    }
    if let Err(e) = std::fs::OpenOptions::new().read(true).write(true).open(dev) {
        return warn(
            format!("/dev/kvm: {e}: VMs run under TCG"),
            "run as root or join the kvm group",
        );
    }
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let memo = std::fs::read_to_string("/run/strata/kvm-probe").unwrap_or_default();
    match memo.strip_prefix(&format!("{} ", boot_id.trim())).map(str::trim) {
        Some("kvm") => Ok("/dev/kvm boots a standard guest (probed this boot): VMs use KVM".into()),
        Some(_) => warn(
            "/dev/kvm is there but a standard guest did not boot on it (probed this boot): VMs use TCG",
            "check the host's virtualization (this /dev/kvm may be a paravirtual one that boots only its own guests)",
        ),
        None => Ok("/dev/kvm present; the first VM probes whether a standard guest boots on it".into()),
    }
}

fn disk(state_dir: &Path) -> Outcome {
    let probe = existing(state_dir);
    let st = match nix::sys::statvfs::statvfs(probe) {
        Ok(s) => s,
        Err(e) => {
            return fail(
                format!("{}: {e}", probe.display()),
                "create STRATA_HOME on a disk filesystem",
            )
        }
    };
    let free = st.blocks_available() * st.fragment_size();
    let on_tmpfs = nix::sys::statfs::statfs(probe)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC);
    let gib = free as f64 / (1u64 << 30) as f64;
    if on_tmpfs {
        return fail(
            format!(
                "{} is on tmpfs: layer images and the chunk cache need a disk filesystem",
                probe.display()
            ),
            "set STRATA_HOME to a directory on disk",
        );
    }
    if free < 1 << 30 {
        return fail(
            format!("{gib:.1} GiB free at {}", probe.display()),
            "free space, or set STRATA_HOME to a larger filesystem",
        );
    }
    if free < 5 << 30 {
        return warn(
            format!(
                "{gib:.1} GiB free at {}: enough for a few sandboxes",
                probe.display()
            ),
            "free space, or set STRATA_HOME to a larger filesystem",
        );
    }
    Ok(format!("{gib:.1} GiB free at {}", probe.display()))
}
