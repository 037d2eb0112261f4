//! The `state` suite: durable rollout state against a cold create of the same entry in
//! the same run. Hibernate and wake of a microVM (wake to first exec against a create to
//! first exec), the hibernated state's size against the memory its guest uses, and fork
//! of N children per backend against N creates; a snapshot into the store (time, size)
//! and its restore on another node. A container's hibernation (CRIU) and wake against a
//! container create, and the same of a fncall sandbox.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use strata_catalog::Backend;
use strata_runtime::{ExecRequest, Runtime, Sandbox, SandboxSpec};
use strata_store::{Store, StoreUrl};

use crate::report::{Row, Section};
use crate::runtime::{percentile, runtime_config, setup};
use crate::vm::{once, vm_spec};

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn check(sb: &Sandbox, script: &str) -> Result<String> {
    let r = sb.exec(&ExecRequest::shell(script))?;
    if !r.success() {
        bail!(
            "`{script}` failed in {}: {}",
            sb.id(),
            String::from_utf8_lossy(&r.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&r.stdout).into_owned())
}

/// Host memory in use: MemTotal - MemAvailable (reclaimable page cache, such as a fork's
/// memory image the children share, is not counted).
fn host_used_bytes() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = |key: &str| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    kib("MemTotal:").saturating_sub(kib("MemAvailable:")) << 10
}

/// Creates `n` sandboxes of `spec` and runs `/bin/true` in each; the time for all.
fn creates(rt: &Runtime, spec: &SandboxSpec, n: usize) -> Result<f64> {
    Ok(creates_held(rt, spec, n)?.0)
}

/// [`creates`], and the host memory the `n` held (all running, after their first exec).
fn creates_held(rt: &Runtime, spec: &SandboxSpec, n: usize) -> Result<(f64, u64)> {
    let before = host_used_bytes();
    let t = Instant::now();
    // As many at once as a fork restores (one per core), so the two compare like for like.
    let width = std::thread::available_parallelism()
        .map_or(2, |w| w.get())
        .clamp(1, 8);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let made: Vec<Sandbox> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..width.min(n))
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    while next.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < n {
                        mine.push(rt.create_owned(spec.clone()));
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect::<Result<Vec<_>, _>>()
    })?;
    anyhow::ensure!(made.len() == n, "a create worker panicked");
    for sb in &made {
        check(sb, "true")?;
    }
    let took = ms(t);
    let held = host_used_bytes().saturating_sub(before);
    for sb in made {
        sb.destroy()?;
    }
    Ok((took, held))
}

/// A snapshot of `sb` into the store, restored by another node (a fresh home sharing the
/// store: its own lazyfs cache, nothing of the sandbox), then removed: the snapshot, the
/// times to take it and to restore it (-> first exec).
fn store_round_trip(
    rt: &tokio::runtime::Runtime,
    store: &Store,
    sb: &Sandbox,
    scratch: &Path,
    store_url: &str,
    name: &str,
) -> Result<(strata_service::snapshot::StoredSnapshot, f64, f64)> {
    let t = Instant::now();
    let snap = rt.block_on(strata_service::snapshot::take(
        store,
        sb,
        &scratch.join("snapshot-work"),
        &strata_service::snapshot::TakeRequest {
            sandbox: sb.id().to_string(),
            taken_by: "strata-bench".into(),
            ..Default::default()
        },
    ))?;
    let snap_ms = ms(t);
    if !snap.memory {
        bail!("the {name} snapshot kept no processes (is CRIU built? scripts/setup.sh)");
    }
    let node_b = Runtime::open(runtime_config(
        &scratch.join(format!("node-b-{name}")),
        store_url,
    )?)?;
    let t = Instant::now();
    let restored = rt.block_on(strata_service::snapshot::restore(
        store,
        &node_b,
        &snap,
        "strata-bench",
        &scratch.join("restore-work"),
    ))?;
    check(&restored, "test -s /root/blob")?;
    let restore_ms = ms(t);
    restored.destroy()?;
    node_b.drain_pool();
    rt.block_on(strata_service::snapshot::remove(store, &snap))?;
    Ok((snap, snap_ms, restore_ms))
}

/// `cycles` hibernations of `sb`, each woken by a command: the hibernation times, the
/// wake -> first exec times, and the last saved state's bytes.
fn hibernate_cycles(sb: &Sandbox, cycles: usize) -> Result<(Vec<f64>, Vec<f64>, u64)> {
    let (mut hib, mut wake, mut state) = (Vec::new(), Vec::new(), 0u64);
    for _ in 0..cycles {
        let t = Instant::now();
        state = sb.hibernate()?.state_bytes;
        hib.push(ms(t));
        let t = Instant::now();
        check(sb, "test -s /root/blob")?;
        wake.push(ms(t));
    }
    Ok((hib, wake, state))
}

pub fn run(
    rt: &tokio::runtime::Runtime,
    scratch: &Path,
    repo: &Path,
    quick: bool,
) -> Result<Section> {
    let s = setup(rt, scratch, repo)?;
    let runtime = Runtime::open(runtime_config(&s.home, &s.store_url)?)?;
    let store = Store::open(&StoreUrl::Local(s.store_url.clone().into()))?;
    let mut rows = Vec::new();
    let microvm = vm_spec(&s.spec, Backend::Microvm);
    // Makes the template and warms the layer caches, outside the timings.
    once(&runtime, &microvm)?;

    // Hibernate and wake: a guest with a running process and a written file.
    let sb = runtime.create_owned(microvm.clone())?;
    check(
        &sb,
        "dd if=/dev/urandom of=/root/blob bs=1M count=16 2>/dev/null; nohup sh -c 'while true; do sleep 1; done' >/dev/null 2>&1 &",
    )?;
    let used_kib: f64 = check(
        &sb,
        "awk '/MemTotal/{t=$2}/MemFree/{f=$2}END{print t-f}' /proc/meminfo",
    )?
    .trim()
    .parse()
    .unwrap_or(0.0);
    let cycles = if quick { 5 } else { 20 };
    let (mut hib, mut wake, state) = hibernate_cycles(&sb, cycles)?;
    let (snap, snap_ms, restore_ms) =
        store_round_trip(rt, &store, &sb, scratch, &s.store_url, "microvm")?;
    sb.destroy()?;
    let mut cold: Vec<f64> = (0..if quick { 3 } else { 5 })
        .map(|_| once(&runtime, &microvm))
        .collect::<Result<_>>()?;
    let cold50 = percentile(&mut cold, 0.5);
    rows.push(Row::new(
        "microvm hibernate, p50",
        "ms",
        percentile(&mut hib, 0.5),
        "create -> first exec, p50",
        cold50,
        "lower",
        "QMP stop, state migrated to a file, QEMU quits",
    ));
    rows.push(Row::new(
        "microvm wake -> first exec, p50",
        "ms",
        percentile(&mut wake, 0.5),
        "create -> first exec, p50",
        cold50,
        "lower",
        "the same machine started from its saved state; processes and files kept",
    ));
    rows.push(Row::new(
        "microvm hibernated state",
        "MiB",
        state as f64 / 1_048_576.0,
        "memory the guest uses (MemTotal - MemFree, page cache included)",
        used_kib / 1024.0,
        "lower",
        "target: at most what the guest uses (its files stay on its disk)",
    ));
    rows.push(Row::new(
        "microvm snapshot into the store",
        "ms",
        snap_ms,
        "create -> first exec, p50",
        cold50,
        "lower",
        "machine saved (paused for the save and the disk copy), built as a layer of chunks",
    ));
    rows.push(Row::new(
        "microvm snapshot size in the store",
        "MiB",
        snap.uploaded_bytes as f64 / 1_048_576.0,
        "memory the guest uses + 16 MiB written",
        used_kib / 1024.0 + 16.0,
        "lower",
        &format!(
            "target: at most the baseline; chunks after lz4 and dedup ({:.1} MiB raw: state + written disk)",
            (snap.state_bytes + snap.disk_bytes) as f64 / 1_048_576.0
        ),
    ));
    rows.push(Row::new(
        "microvm restore on another node -> first exec",
        "ms",
        restore_ms,
        "create -> first exec, p50",
        cold50,
        "lower",
        "cold node: its layers and the snapshot fetched from the store, a new QEMU; processes and files kept",
    ));

    // A container's and a fncall sandbox's hibernation (CRIU): a process holding 64 MiB
    // and 16 MiB written.
    let container = SandboxSpec {
        backend: Backend::Container,
        ..s.spec.clone()
    };
    let fncall = SandboxSpec {
        backend: Backend::Fncall,
        ..s.spec.clone()
    };
    for (name, spec) in [("container", &container), ("fncall", &fncall)] {
        creates(&runtime, spec, 1)?;
        let sb = runtime.create_owned(spec.clone())?;
        check(
            &sb,
            "dd if=/dev/urandom of=/root/blob bs=1M count=16 2>/dev/null; nohup python3 -c 'import time, os; b = os.urandom(64 << 20); time.sleep(86400)' >/dev/null 2>&1 & sleep 1",
        )?;
        let held = sb.cgroup().memory_usage();
        let (mut hib, mut wake, state) = hibernate_cycles(&sb, cycles)?;
        let (ct_snap, ct_snap_ms, ct_restore_ms) =
            store_round_trip(rt, &store, &sb, scratch, &s.store_url, name)?;
        sb.destroy()?;
        let mut cold: Vec<f64> = (0..if quick { 5 } else { 20 })
            .map(|_| creates(&runtime, spec, 1))
            .collect::<Result<_>>()?;
        let cold50 = percentile(&mut cold, 0.5);
        rows.push(Row::new(
            &format!("{name} hibernate, p50"),
            "ms",
            percentile(&mut hib, 0.5),
            "create -> first exec, p50",
            cold50,
            "lower",
            "agent parked, CRIU checkpoint of the process tree, tree ended",
        ));
        rows.push(Row::new(
            &format!("{name} wake -> first exec, p50"),
            "ms",
            percentile(&mut wake, 0.5),
            "create -> first exec, p50",
            cold50,
            "lower",
            "target: at most 3x; CRIU restore over the same root in a fresh PID namespace",
        ));
        rows.push(Row::new(
            &format!("{name} hibernated state"),
            "MiB",
            state as f64 / 1_048_576.0,
            "memory the sandbox's cgroup holds awake (page cache included)",
            held as f64 / 1_048_576.0,
            "lower",
            "CRIU images; its files stay in its upper",
        ));
        rows.push(Row::new(
            &format!("{name} snapshot into the store"),
            "ms",
            ct_snap_ms,
            "create -> first exec, p50",
            cold50,
            "lower",
            &format!(
                "CRIU checkpoint (left running) and upper copy while frozen, built as a layer of chunks; {:.1} MiB stored after lz4 and dedup ({:.1} MiB raw)",
                ct_snap.uploaded_bytes as f64 / 1_048_576.0,
                (ct_snap.state_bytes + ct_snap.disk_bytes) as f64 / 1_048_576.0
            ),
        ));
        rows.push(Row::new(
            &format!("{name} restore on another node -> first exec"),
            "ms",
            ct_restore_ms,
            "create -> first exec, p50",
            cold50,
            "lower",
            "cold node: its layers and the snapshot fetched from the store, CRIU restore; processes and files kept",
        ));
    }

    // Fork of N against N creates, per backend.
    let counts: &[usize] = if quick { &[1, 4] } else { &[1, 16] };
    // A hundred microVMs at once need KVM: under TCG on a few cores the children's idle
    // guests starve each other's starts for many minutes (tried here: not done after 18).
    let many_vms = crate::machine::kvm().then_some(100usize);
    for (name, spec, extra) in [
        ("microvm", &microvm, many_vms),
        ("container", &container, Some(100usize)),
        ("fncall", &fncall, None),
    ] {
        let mut ns = counts.to_vec();
        ns.extend(extra.filter(|_| !quick));
        for &n in &ns {
            let parent = runtime.create_owned(spec.clone())?;
            check(&parent, "echo parent > /work/parent.txt")?;
            let before = host_used_bytes();
            let t = Instant::now();
            let forked = rt.block_on(strata_service::fork::fork(
                &store,
                &runtime,
                &parent,
                n,
                "strata-bench",
            ))?;
            for child in &forked.children {
                check(child, "test -s /work/parent.txt")?;
            }
            let took = ms(t);
            let held = host_used_bytes().saturating_sub(before);
            for child in forked.children {
                child.destroy()?;
            }
            parent.destroy()?;
            let (baseline, baseline_held) = creates_held(&runtime, spec, n)?;
            rows.push(Row::new(
                &format!("{name} fork of {n} -> first exec in each"),
                "ms",
                took,
                &format!("{n} creates -> first exec in each"),
                baseline,
                "lower",
                if forked.processes && name == "microvm" {
                    "one snapshot restored N times, its memory one image the children map copy-on-write: processes and memory carried"
                } else if forked.processes {
                    "one snapshot restored N times: processes and memory carried"
                } else {
                    "files committed as a layer under N new sandboxes (no process checkpoint)"
                },
            ));
            if n > 1 && name == "microvm" {
                rows.push(Row::new(
                    &format!("{name} fork of {n}: host memory per child"),
                    "MiB",
                    held as f64 / n as f64 / 1_048_576.0,
                    "host memory per sandbox of as many creates",
                    baseline_held as f64 / n as f64 / 1_048_576.0,
                    "lower",
                    "MemTotal - MemAvailable after each one's first exec; the children map the parent's memory image copy-on-write (its page cache, shared, is not counted)",
                ));
            }
        }
    }
    runtime.drain_pool();
    Ok(Section {
        name: "state".into(),
        description: "Durable rollout state: hibernate and wake of a microVM (16 MiB written, a process running) and of a container and a fncall sandbox (16 MiB written, a process holding 64 MiB), the saved state's size, and fork per backend, each against a create of the same entry in the same run. Layers cached locally; microVMs of 256 MiB under this host's accelerator.".into(),
        rows,
    })
}
