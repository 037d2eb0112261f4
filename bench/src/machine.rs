//! Facts about the machine a result was measured on, so numbers from different machines are
//! never compared silently.

use serde::Serialize;

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Machine {
    pub cores: usize,
    pub memory_bytes: u64,
    pub kernel: String,
    pub cpu: String,
    /// What the VM suite ran under: `kvm` if the runtime's probe found /dev/kvm boots a
    /// standard guest, else `tcg`.
    pub accelerator: String,
}

pub fn facts() -> Machine {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_bytes = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_default();
    Machine {
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        memory_bytes,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        cpu,
        accelerator: accelerator(),
    }
}

/// Whether this boot's VMs run under KVM (the runtime's probe said so).
pub fn kvm() -> bool {
    accelerator() == "kvm"
}

/// The runtime's accelerator probe result for this boot (`/run/strata/kvm-probe`).
fn accelerator() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let memo = std::fs::read_to_string("/run/strata/kvm-probe").unwrap_or_default();
    match memo.split_once(' ') {
        Some((id, accel)) if id == boot.trim() => {
            let accel = accel.trim();
            if accel == "tcg" && std::path::Path::new("/dev/kvm").exists() {
                "tcg (/dev/kvm is present but cannot boot a standard guest)".into()
            } else {
                accel.to_string()
            }
        }
        _ => "not used (no VM ran this boot)".into(),
    }
}
