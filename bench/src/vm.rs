//! The `vm` suite: microVM and full-VM sandboxes under this host's accelerator. Cold boot
//! to first exec against a template restore to first exec; pause and resume against
//! freezing a container sandbox; snapshot time and size against dumping the guest's
//! whole RAM; restore from a snapshot against a cold boot; idle memory per microVM with
//! KSM on against KSM off. Uses the runtime suite's home and sample environment.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use strata_catalog::Backend;
use strata_runtime::{ExecRequest, Runtime, SandboxSpec};

use crate::report::{Row, Section};
use crate::runtime::{percentile, runtime_config, setup};

const VM_MEMORY: u64 = 256 << 20;

pub(crate) fn vm_spec(base: &SandboxSpec, backend: Backend) -> SandboxSpec {
    let mut spec = base.clone();
    spec.backend = backend;
    spec.limits.memory_bytes = VM_MEMORY;
    spec
}

/// Create, run `/bin/true`, destroy; returns create -> first exec done (ms).
pub(crate) fn once(rt: &Runtime, spec: &SandboxSpec) -> Result<f64> {
    let t = Instant::now();
    let sb = rt.create_owned(spec.clone())?;
    let r = sb.exec(&ExecRequest::argv(["/bin/true"]));
    let took = t.elapsed().as_secs_f64() * 1e3;
    sb.destroy()?;
    if !r?.success() {
        bail!("/bin/true failed in a {:?} sandbox", spec.backend);
    }
    Ok(took)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Proportional set size of a process (its share of shared and KSM-merged pages).
fn pss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

const KSM: &str = "/sys/kernel/mm/ksm";

fn ksm_read(f: &str) -> String {
    std::fs::read_to_string(format!("{KSM}/{f}"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn ksm_write(f: &str, v: &str) -> Result<()> {
    std::fs::write(format!("{KSM}/{f}"), v)
        .map_err(|e| anyhow::anyhow!("{KSM}/{f}: {e} (the KSM measurement needs root)"))
}

/// Waits until KSM's sharing stops growing (a full scan passes without change).
fn ksm_settle(limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut last = 0u64;
    let mut still = 0;
    while Instant::now() < deadline && still < 3 {
        std::thread::sleep(Duration::from_secs(2));
        let now: u64 = ksm_read("pages_sharing").parse().unwrap_or(0);
        still = if now == last && now > 0 { still + 1 } else { 0 };
        last = now;
    }
}

pub fn run(
    rt: &tokio::runtime::Runtime,
    scratch: &Path,
    repo: &Path,
    quick: bool,
) -> Result<Section> {
    let s = setup(rt, scratch, repo)?;
    let open = |templates: bool| -> Result<Runtime> {
        let mut cfg = runtime_config(&s.home, &s.store_url)?;
        cfg.vm.templates = templates;
        Ok(Runtime::open(cfg)?)
    };
    let (cold_rt, warm_rt) = (open(false)?, open(true)?);
    let mut rows = Vec::new();
    // Two template starts per cold boot, interleaved so that the host's load drifting
    // over the run (it is shared) weighs on both alike.
    let rounds = if quick { 2 } else { 5 };
    let mut accel = String::new();

    for (backend, name) in [(Backend::Microvm, "microvm"), (Backend::Vm, "vm (q35)")] {
        let spec = vm_spec(&s.spec, backend);
        // Makes the template and warms the layer caches, outside the timings.
        once(&warm_rt, &spec)?;
        let (mut cold, mut warm) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            warm.push(once(&warm_rt, &spec)?);
            cold.push(once(&cold_rt, &spec)?);
            warm.push(once(&warm_rt, &spec)?);
        }
        let (cold50, warm50) = (percentile(&mut cold, 0.5), percentile(&mut warm, 0.5));
        rows.push(Row::new(
            &format!("{name} template restore -> first exec, p50"),
            "ms",
            warm50,
            "cold boot -> first exec, p50",
            cold50,
            "lower",
            "target >= 5x faster than cold boot",
        ));
        if accel.is_empty() {
            accel = std::fs::read_to_string("/run/strata/kvm-probe")
                .unwrap_or_default()
                .split_whitespace()
                .nth(1)
                .unwrap_or("?")
                .to_string();
        }
    }

    // Pause/resume: QMP stop/cont of a microVM against the freezer of a container.
    let vm = warm_rt.create_owned(vm_spec(&s.spec, Backend::Microvm))?;
    let mut container_spec = s.spec.clone();
    container_spec.backend = Backend::Container;
    let ct = warm_rt.create_owned(container_spec)?;
    let samples = if quick { 10 } else { 30 };
    let mut timings = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..samples {
        for (i, sb) in [&vm, &ct].into_iter().enumerate() {
            let t = Instant::now();
            sb.pause()?;
            timings[2 * i].push(ms(t.elapsed()));
            let t = Instant::now();
            sb.resume()?;
            timings[2 * i + 1].push(ms(t.elapsed()));
        }
    }
    for (what, vm_t, ct_t) in [("pause", 0, 2), ("resume", 1, 3)] {
        let v = percentile(&mut timings[vm_t].clone(), 0.5);
        let c = percentile(&mut timings[ct_t].clone(), 0.5);
        rows.push(Row::new(
            &format!("microvm {what}, p50"),
            "ms",
            v,
            &format!("container {what} (cgroup freezer), p50"),
            c,
            "lower",
            "QMP stop/cont",
        ));
    }
    ct.destroy()?;

    // Snapshot: a busy-ish guest (a process and a written file) saved to a file.
    vm.exec(&ExecRequest::shell(
        "dd if=/dev/urandom of=/root/blob bs=1M count=16 2>/dev/null; (sleep 3600 &)",
    ))?;
    let snaps = scratch.join("vm-snapshots");
    let _ = std::fs::remove_dir_all(&snaps);
    let mut snap_ms = Vec::new();
    let mut state_bytes = 0;
    for i in 0..3 {
        let info = vm.snapshot(&snaps.join(format!("s{i}")))?;
        snap_ms.push(info.millis);
        state_bytes = info.state_bytes;
    }
    let guest_ram = VM_MEMORY + (128 << 20);
    let dump = scratch.join("vm-ram-dump");
    let t = Instant::now();
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&dump)?;
        let block = vec![0x5au8; 1 << 20];
        for _ in 0..(guest_ram >> 20) {
            f.write_all(&block)?;
        }
        f.sync_all()?;
    }
    let dump_ms = ms(t.elapsed());
    std::fs::remove_file(&dump)?;
    rows.push(Row::new(
        "microvm snapshot time, p50",
        "ms",
        percentile(&mut snap_ms, 0.5),
        "writing the guest's whole RAM to a file",
        dump_ms,
        "lower",
        "state migrated to a file with the bandwidth limit lifted, plus a sparse copy of the writable disk",
    ));
    rows.push(Row::new(
        "microvm snapshot state size",
        "MiB",
        state_bytes as f64 / 1_048_576.0,
        "guest RAM",
        guest_ram as f64 / 1_048_576.0,
        "lower",
        "untouched pages are not saved",
    ));
    // Restore from the snapshot into a new process.
    let mut restore_ms = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let sb = warm_rt.restore(&snaps.join("s0"), false)?;
        let r = sb.exec(&ExecRequest::argv(["/bin/true"]))?;
        restore_ms.push(ms(t.elapsed()));
        sb.destroy()?;
        if !r.success() {
            bail!("/bin/true failed in a restored microVM");
        }
    }
    let mut cold: Vec<f64> = (0..2)
        .map(|_| once(&cold_rt, &vm_spec(&s.spec, Backend::Microvm)))
        .collect::<Result<_>>()?;
    rows.push(Row::new(
        "microvm snapshot restore -> first exec, p50",
        "ms",
        percentile(&mut restore_ms, 0.5),
        "cold boot -> first exec, p50",
        percentile(&mut cold, 0.5),
        "lower",
        "new QEMU process; processes and files of the snapshot",
    ));
    vm.destroy()?;
    let _ = std::fs::remove_dir_all(&snaps);

    // Idle memory per microVM: PSS of the QEMU processes, KSM off then on.
    let n = if quick { 3 } else { 6 };
    let saved = (
        ksm_read("run"),
        ksm_read("pages_to_scan"),
        ksm_read("sleep_millisecs"),
    );
    let idle: Vec<_> = (0..n)
        .map(|_| warm_rt.create_owned(vm_spec(&s.spec, Backend::Microvm)))
        .collect::<Result<_, _>>()?;
    let pids: Vec<u32> = idle.iter().map(|sb| sb.record().init_pid).collect();
    // Unmerge anything merged before, then let the guests settle.
    ksm_write("run", "2")?;
    std::thread::sleep(Duration::from_secs(5));
    let off = pids.iter().map(|p| pss(*p)).sum::<u64>() as f64 / n as f64;
    ksm_write("pages_to_scan", "20000")?;
    ksm_write("sleep_millisecs", "20")?;
    ksm_write("run", "1")?;
    ksm_settle(Duration::from_secs(if quick { 40 } else { 90 }));
    let on = pids.iter().map(|p| pss(*p)).sum::<u64>() as f64 / n as f64;
    let sharing = ksm_read("pages_sharing");
    // Back as it was (merged pages are split again first when KSM was off).
    if saved.0 != "1" {
        ksm_write("run", "2")?;
    }
    ksm_write("run", &saved.0)?;
    ksm_write("pages_to_scan", &saved.1)?;
    ksm_write("sleep_millisecs", &saved.2)?;
    for sb in idle {
        sb.destroy()?;
    }
    rows.push(Row::new(
        "idle microvm memory (PSS of QEMU), KSM on",
        "MiB",
        on / 1_048_576.0,
        "KSM off",
        off / 1_048_576.0,
        "lower",
        &format!(
            "{n} idle microVMs of {} MiB RAM restored from one template; {sharing} pages shared",
            guest_ram >> 20
        ),
    ));
    warm_rt.drain_pool();
    Ok(Section {
        name: "vm".into(),
        description: format!(
            "MicroVM (QEMU microvm) and full-VM (q35) sandboxes under {accel}: start from a template snapshot vs a cold boot, pause/resume, snapshot and restore, idle memory with KSM. Layers are cached locally; {} MiB budgets.",
            VM_MEMORY >> 20
        ),
        rows,
    })
}
