//! Facts about the machine a result was measured on, so numbers from different machines are
//! never compared silently.

use serde::Serialize;

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Machine {
    pub cores: usize,
    pub memory_bytes: u64,
    pub kernel: String,
    pub cpu: String,
    /// `kvm` if /dev/kvm can run a standard guest, else `tcg`, once VM suites exist.
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
        // No suite runs a VM yet; say so rather than leave a blank a reader could fill in.
        accelerator: if std::path::Path::new("/dev/kvm").exists() {
            "not used: no VM suite yet (/dev/kvm present)".into()
        } else {
            "not used: no VM suite yet (no /dev/kvm)".into()
        },
    }
}
