//! MicroVM and full-VM sandboxes end to end through the CLI, under whatever accelerator
//! this host has (TCG here): the sample environment's real test suite by catalog ID,
//! budgets and network isolation inside the guest, pause/resume, snapshot/restore into a
//! new QEMU process, and cleanup after a killed runtime.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use strata_tests::home::{can_run_vms, text, SampleEnv};
use strata_tests::host_used_bytes;

type Env = SampleEnv;

static ENV: OnceLock<Option<Env>> = OnceLock::new();

/// Held shared by every test that runs machines, exclusively by one that measures the
/// host's memory (the tests of this file run two at a time).
static MACHINES: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn machines_shared() -> std::sync::RwLockReadGuard<'static, ()> {
    MACHINES.read().unwrap_or_else(|p| p.into_inner())
}

fn machines_alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    MACHINES.write().unwrap_or_else(|p| p.into_inner())
}

/// The shared environment: one store, one STRATA_HOME, the sample registered once.
fn env(test: &str) -> Option<&'static Env> {
    if !can_run_vms(test) {
        return None;
    }
    ENV.get_or_init(|| Some(SampleEnv::new("vm-"))).as_ref()
}

/// Host processes of a sandbox (QEMU and the relay), from its cgroup.
fn vm_host_pids(id: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/sys/fs/cgroup/pids").unwrap().flatten() {
        let procs = e.path().join(id).join("cgroup.procs");
        if let Ok(t) = std::fs::read_to_string(procs) {
            pids.extend(t.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
    }
    pids
}

/// QEMU processes whose command line names `needle`.
fn qemu_processes(needle: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            cmd.contains("qemu-system") && cmd.contains(needle)
        })
        .collect()
}

/// Bytes of a fork's memory image (a mapping of a file under the runtime's `forks/`) that
/// QEMU `pid` has in memory and shares with other processes (smaps `Shared_*`).
fn fork_image_shared_bytes(pid: u32) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut in_image = false;
    let mut kib = 0u64;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or_default();
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            in_image = line.contains("/forks/");
        } else if in_image && (first == "Shared_Clean:" || first == "Shared_Dirty:") {
            kib += words.next().and_then(|n| n.parse().ok()).unwrap_or(0);
        }
    }
    kib << 10
}

#[test]
fn the_sample_test_suite_passes_in_a_microvm_and_a_vm() {
    let _machines = machines_shared();
    let Some(env) = env("vm_sample_suite") else {
        return;
    };
    for backend in ["microvm", "vm"] {
        let o = env.cli(&["run", "--backend", backend, "-c", "test", &env.reference]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{backend}: {out}{err}");
        assert!(out.contains("4 passed"), "{backend}: {out}{err}");
        // The guest runs its own kernel, not the host's.
        let o = env.cli(&[
            "run",
            "--backend",
            backend,
            &env.reference,
            "--",
            "cat",
            "/proc/version",
        ]);
        let (out, err) = text(&o);
        let host = std::fs::read_to_string("/proc/version").unwrap();
        assert!(o.status.success(), "{backend}: {err}");
        assert_ne!(out.trim(), host.trim(), "{backend} shares the host kernel");
        assert!(out.contains("Debian"), "{backend}: {out}");
    }
}

#[test]
fn a_hostile_command_cannot_take_over_the_guest_agent() {
    let _machines = machines_shared();
    let Some(env) = env("vm_agent_integrity") else {
        return;
    };
    for backend in ["microvm", "vm"] {
        env.assert_agent_integrity(backend);
    }
}

#[test]
fn a_guests_kernel_files_are_masked_and_its_settings_read_only() {
    let _machines = machines_shared();
    let Some(env) = env("vm_kernel_files") else {
        return;
    };
    for backend in ["microvm", "vm"] {
        env.assert_kernel_files_hidden(backend);
    }
}

#[test]
fn a_guests_dangerous_syscalls_are_refused() {
    let _machines = machines_shared();
    let Some(env) = env("vm_syscalls") else {
        return;
    };
    for backend in ["microvm", "vm"] {
        env.assert_dangerous_syscalls_refused(backend);
    }
}

#[test]
fn budgets_hold_and_the_network_is_closed_inside_the_guest() {
    let _machines = machines_shared();
    let Some(env) = env("vm_budgets") else {
        return;
    };
    for backend in ["microvm", "vm"] {
        let id = env.create(&[
            "--backend",
            backend,
            "--memory",
            "256M",
            "--disk",
            "64M",
            "--pids",
            "64",
        ]);
        guest_budgets_hold(env, backend, &id);
        network_closed_and_files_through_the_agent(env, &id);
        env.ok(&["sandbox", "rm", &id]);
        env.assert_gone(&id, &[]);
    }
}

/// Memory, disk, pids and wall clock inside a machine sandbox of `backend`: each ends the
/// command that crossed it, says which, and leaves the guest usable.
fn guest_budgets_hold(env: &Env, backend: &str, id: &str) {
    // Memory: a command growing past the budget is killed by the guest's OOM killer;
    // the agent and the sandbox live on.
    let o = env.cli(&[
        "sandbox",
        "exec",
        id,
        "--",
        "python3",
        "-c",
        "a = [bytearray(8 << 20) for _ in range(100)]",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(137), "{err}");
    assert!(err.contains("budget exceeded: memory"), "{err}");

    // Disk: the writable disk is the budget's size; filling it is ENOSPC inside.
    let o = env.sh(id, "dd if=/dev/zero of=/root/fill bs=1M count=200");
    let (_, err) = text(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("No space left"), "{err}");
    assert!(err.contains("budget exceeded: disk"), "{err}");
    let df = env.sh(id, "df -k / | tail -1");
    let size_kib: u64 = text(&df)
        .0
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert!(size_kib <= 64 * 1024, "{}", text(&df).0);
    env.sh(id, "rm -f /root/fill");

    // Processes: a fork bomb stops at the budget.
    let o = env.sh(id, "for i in $(seq 100); do sleep 30 & done; exit 0");
    let (_, err) = text(&o);
    assert!(err.contains("budget exceeded: pids"), "{err}");
    // One process is free again: enough for a shell that kills the rest.
    env.sh(id, "kill -9 -1; true");
    assert!(env.sh(id, "true").status.success());

    // Wall clock: a command past its timeout is killed and named.
    let o = env.cli(&[
        "sandbox",
        "exec",
        id,
        "--timeout",
        "2s",
        "--",
        "sleep",
        "60",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(137), "{backend} timeout: {err}");
    assert!(err.contains("budget exceeded: timeout"), "{backend}: {err}");
    assert!(env.sh(id, "true").status.success());
    strata_tests::contained("budgets: memory, pids, disk, wall clock", backend, 4);
}

/// Inside a machine: no interface but loopback, and files in and out through the agent.
fn network_closed_and_files_through_the_agent(env: &Env, id: &str) {
    // Network: no interface but loopback, and nothing reachable.
    let o = env.sh(id, "cat /proc/net/dev");
    let ifaces: Vec<String> = text(&o)
        .0
        .lines()
        .skip(2)
        .filter_map(|l| Some(l.split(':').next()?.trim().to_string()))
        .collect();
    assert_eq!(ifaces, vec!["lo".to_string()], "{}", text(&o).0);
    let o = env.cli(&[
        "sandbox",
        "exec",
        id,
        "--",
        "python3",
        "-c",
        "import socket; socket.create_connection(('1.1.1.1', 80), timeout=5)",
    ]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("unreachable"), "{err}");

    // Files in and out go through the guest's agent.
    let local = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(local.path(), b"from the host\n").unwrap();
    env.ok(&[
        "sandbox",
        "cp",
        local.path().to_str().unwrap(),
        &format!("{id}:/work/in.txt"),
    ]);
    let o = env.sh(
        id,
        "cat /work/in.txt && echo from the guest > /work/out.txt",
    );
    assert_eq!(text(&o).0, "from the host\n");
    let out = env.ok(&["sandbox", "cp", &format!("{id}:/work/out.txt"), "-"]);
    assert_eq!(out, "from the guest\n");
    let o = env.cli(&["sandbox", "cp", &format!("{id}:/no/such/file"), "-"]);
    assert!(text(&o).1.contains("/no/such/file"), "{}", text(&o).1);
}

#[test]
fn pause_resume_and_snapshot_restore_keep_processes_and_files() {
    let _machines = machines_shared();
    let Some(env) = env("vm_lifecycle") else {
        return;
    };
    let id = env.create(&["--backend", "microvm", "--memory", "256M"]);
    env.sh(
        &id,
        "echo kept > /work/state.txt; \
         (while true; do date +%s%N >> /work/ticks; sleep 0.2; done) >/dev/null 2>&1 &",
    );
    let ticks = |sb: &str| -> usize {
        let o = env.sh(sb, "wc -l < /work/ticks");
        let (out, err) = text(&o);
        out.trim()
            .parse()
            .unwrap_or_else(|_| panic!("wc of {sb}: {out}{err}"))
    };
    std::thread::sleep(Duration::from_secs(1));

    // Paused: the guest's processes stop where they are; resumed, they go on.
    env.ok(&["sandbox", "pause", &id]);
    let frozen = std::fs::read_to_string(
        env.cli
            .runtime_dir()
            .join("audit")
            .join(format!("{id}.jsonl")),
    )
    .unwrap();
    assert!(frozen.contains("\"paused\""), "{frozen}");
    let qmp_status = |sb: &str| -> String {
        let sock = env
            .cli
            .runtime_dir()
            .join("sandboxes")
            .join(sb)
            .join("qmp.sock");
        qmp_query_status(&sock)
    };
    assert_eq!(qmp_status(&id), "paused");
    std::thread::sleep(Duration::from_secs(1));
    env.ok(&["sandbox", "resume", &id]);
    assert_eq!(qmp_status(&id), "running");
    let before = ticks(&id);
    std::thread::sleep(Duration::from_secs(2));
    assert!(ticks(&id) > before, "the loop did not go on after resume");

    // Snapshot, then restore into a new sandbox (a new QEMU process): the loop and the
    // file are there, and the original runs on unchanged.
    let snap = tempfile::tempdir_in(strata_tests::scratch_root()).unwrap();
    let dir = snap.path().join("s1");
    let info: serde_json::Value = serde_json::from_str(&env.ok(&[
        "sandbox",
        "snapshot",
        &id,
        dir.to_str().unwrap(),
        "--json",
    ]))
    .unwrap();
    assert!(info["state_bytes"].as_u64().unwrap() > 1 << 20, "{info}");
    let restored = env
        .ok(&["sandbox", "restore", dir.to_str().unwrap()])
        .lines()
        .last()
        .unwrap()
        .trim()
        .to_string();
    assert_ne!(restored, id);
    let o = env.sh(
        &restored,
        "cat /work/state.txt; ps -eo args 2>/dev/null || true",
    );
    assert!(text(&o).0.starts_with("kept\n"), "{}", text(&o).0);
    let ps: Vec<serde_json::Value> =
        serde_json::from_str(&env.ok(&["sandbox", "ps", &restored, "--json"])).unwrap();
    assert!(
        ps.iter()
            .any(|p| p["cmdline"].as_str().unwrap().contains("while true")),
        "{ps:?}"
    );
    let after_restore = ticks(&restored);
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        ticks(&restored) > after_restore,
        "the restored loop is stopped"
    );
    // Each sandbox has its own QEMU and its own writable disk.
    env.sh(&restored, "echo only-restored > /work/mine.txt");
    assert!(!env.sh(&id, "test -e /work/mine.txt").status.success());
    assert_eq!(qemu_processes(&format!("sandboxes/{id}/")).len(), 1);
    assert_eq!(qemu_processes(&format!("sandboxes/{restored}/")).len(), 1);
    env.ok(&["sandbox", "rm", &id, &restored]);
    env.assert_gone(&id, &[]);
    env.assert_gone(&restored, &[]);
    assert!(qemu_processes(&format!("sandboxes/{restored}/")).is_empty());
}

/// Two nodes (homes) sharing one S3 store (radosgw): a microVM's snapshot taken on A
/// restores on B, which never saw its layers, with its process still counting and its
/// files; so do a container's and a fncall sandbox's (CRIU images, where CRIU is built).
/// All are listed, inspected and removed from B, and no machine file is left on either
/// node.
#[test]
fn a_snapshot_in_the_store_restores_on_another_node_with_its_processes_and_files() {
    let _machines = machines_shared();
    if !can_run_vms("vm_snapshot_s3") {
        return;
    }
    let Some(server) = strata_tests::s3::S3Server::start("vm_snapshot_s3") else {
        return;
    };
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let a = strata_tests::home::CliHome::with_store("snap-a-", &server.url);
    let b = strata_tests::home::CliHome::with_store("snap-b-", &server.url);
    strata_tests::sh(&format!(
        "bash {}/datasets/base/make-rootfs.sh >/dev/null",
        repo.display()
    ));
    let last = |s: String| s.lines().last().unwrap_or_default().trim().to_string();
    let base = last(a.ok(&[
        "layer",
        "build",
        repo.join("datasets/base/debian.toml").to_str().unwrap(),
    ]));
    let scratch = tempfile::tempdir_in(strata_tests::scratch_root()).unwrap();
    let entry = scratch.path().join("entry.toml");
    std::fs::write(
        &entry,
        format!(
            "id = \"tests/snapshot-nodes\"\nbase = \"{base}\"\nbackend = \"microvm\"\nworkdir = \"/root\"\n[budgets]\nmemory = \"256M\"\ndisk = \"512M\"\n"
        ),
    )
    .unwrap();
    let reference = last(a.ok(&["catalog", "register", entry.to_str().unwrap()]));
    let sh = |home: &strata_tests::home::CliHome, id: &str, script: &str| -> String {
        let o = home.cli(&["sandbox", "exec", id, "--", "sh", "-c", script]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{script}: {out}{err}");
        out
    };

    // A: a microVM counting in the background, with a file; and a container with a file.
    let vm = last(a.ok(&["sandbox", "create", &reference]));
    sh(
        &a,
        &vm,
        "echo from-a > /root/note; \
         (i=0; while true; do i=$((i+1)); echo $i > /root/count.new; mv /root/count.new /root/count; sleep 0.2; done) >/dev/null 2>&1 &",
    );
    std::thread::sleep(Duration::from_secs(1));
    // Counted before: the snapshot is taken when asked, the store written after.
    let before: u64 = sh(&a, &vm, "cat /root/count").trim().parse().unwrap();
    let vm_snap = last(a.ok(&[
        "sandbox",
        "snapshot",
        &vm,
        "--to-store",
        "--name",
        "counting",
    ]));
    assert!(vm_snap.starts_with("snap-"), "{vm_snap}");
    // A container and a fncall sandbox, each counting, with a file.
    let ct_processes = strata_tests::home::can_hibernate_containers("vm_snapshot_s3");
    let mut hosts = Vec::new();
    for backend in ["container", "fncall"] {
        let id = last(a.ok(&["sandbox", "create", "--backend", backend, &reference]));
        sh(
            &a,
            &id,
            &format!("echo {backend}-file > /root/ct-note; \
             (i=0; while true; do i=$((i+1)); echo $i > /root/count.new; mv /root/count.new /root/count; sleep 0.2; done) >/dev/null 2>&1 &"),
        );
        std::thread::sleep(Duration::from_millis(600));
        let before: u64 = sh(&a, &id, "cat /root/count").trim().parse().unwrap();
        let snap = last(a.ok(&["sandbox", "snapshot", &id, "--to-store"]));
        a.ok(&["sandbox", "rm", &id]);
        hosts.push((backend, snap, before));
    }
    a.ok(&["sandbox", "rm", &vm]);

    // B, a fresh node: both listed, the microVM's with its memory.
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&b.ok(&["snapshot", "ls", "--json"])).unwrap();
    let find = |id: &str| {
        listed
            .iter()
            .find(|s| s["id"] == id)
            .unwrap_or_else(|| panic!("{id} not listed: {listed:?}"))
            .clone()
    };
    let v = find(&vm_snap);
    assert_eq!(v["memory"], true, "{v}");
    assert_eq!(v["names"], serde_json::json!(["counting"]), "{v}");
    assert!(v["state_bytes"].as_u64().unwrap() > 1 << 20, "{v}");
    for (backend, snap, _) in &hosts {
        let c = find(snap);
        assert_eq!(c["memory"], ct_processes, "{backend}: {c}");
    }
    assert!(b
        .ok(&["snapshot", "inspect", &vm_snap])
        .contains("processes, memory and files"));

    // Restored on B: the process goes on counting from where it was, the file is there.
    let restored = last(b.ok(&["sandbox", "restore", &vm_snap]));
    let count = |id: &str| -> u64 { sh(&b, id, "cat /root/count").trim().parse().unwrap() };
    let first = count(&restored);
    assert!(
        first >= before,
        "restored count {first}, before the snapshot {before}"
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        count(&restored) > first,
        "the restored process does not count"
    );
    assert_eq!(sh(&b, &restored, "cat /root/note").trim(), "from-a");
    b.ok(&["sandbox", "rm", &restored]);
    b.assert_sandbox_gone(&restored, &[]);
    for (backend, snap, before) in &hosts {
        let ct_restored = last(b.ok(&["sandbox", "restore", snap]));
        assert_eq!(
            sh(&b, &ct_restored, "cat /root/ct-note").trim(),
            format!("{backend}-file")
        );
        if ct_processes {
            let first = count(&ct_restored);
            assert!(first >= *before, "{backend}: {first} < {before}");
            std::thread::sleep(Duration::from_millis(800));
            assert!(
                count(&ct_restored) > first,
                "the restored {backend} sandbox's process does not count"
            );
        }
        b.ok(&["sandbox", "rm", &ct_restored]);
        b.assert_sandbox_gone(&ct_restored, &[]);
    }

    // Removed: gone from the list, and a restore says so by name.
    let mut rm = vec!["snapshot", "rm", vm_snap.as_str()];
    rm.extend(hosts.iter().map(|(_, snap, _)| snap.as_str()));
    let out = b.ok(&rm);
    assert!(
        out.contains(&format!("removed {vm_snap} and its layer")),
        "{out}"
    );
    let o = b.cli(&["sandbox", "restore", &vm_snap]);
    assert!(!o.status.success());
    assert!(
        text(&o).1.contains(&format!("no snapshot {vm_snap}")),
        "{}",
        text(&o).1
    );
    // Neither node keeps a copy of the machine's files.
    for home in [&a, &b] {
        let work = home.runtime_dir().join("snapshots");
        let left: Vec<_> = std::fs::read_dir(&work)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "snapshot files left: {left:?}");
    }
}

/// `query-status` over a VM's QMP socket.
fn qmp_query_status(sock: &Path) -> String {
    use std::io::{BufRead, BufReader, Write};
    let s = strata_host::unix::connect(sock).unwrap();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    w.write_all(b"{\"execute\":\"qmp_capabilities\"}\n{\"execute\":\"query-status\"}\n")
        .unwrap();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        if let Some(status) = v["return"]["status"].as_str() {
            return status.to_string();
        }
    }
}

#[test]
fn a_killed_runtime_or_a_dead_vm_leaves_nothing_behind() {
    let _machines = machines_shared();
    let Some(env) = env("vm_reap") else {
        return;
    };
    let (mut child, id) = env.spawn_marked_run(
        &["--backend", "microvm", "--memory", "256M"],
        Duration::from_secs(180),
    );
    // The command runs in the guest; then the CLI dies without cleaning up.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !env.ok(&["sandbox", "ps", &id]).contains("sleep 300") {
        assert!(
            Instant::now() < deadline,
            "sleep never started in the guest"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let host_pids = vm_host_pids(&id);
    assert!(host_pids.len() >= 2, "QEMU and the relay: {host_pids:?}");
    let dir: PathBuf = env.cli.runtime_dir().join("sandboxes").join(&id);
    assert!(dir.join("qmp.sock").exists());
    child.kill().unwrap();
    child.wait().unwrap();
    // The VM outlives its CLI until the next runtime reaps it.
    assert_eq!(qemu_processes(&format!("sandboxes/{id}/")).len(), 1);
    env.ok(&["sandbox", "reap"]);
    env.assert_gone(&id, &host_pids);
    assert!(qemu_processes(&format!("sandboxes/{id}/")).is_empty());
    let audit = env.ok(&["sandbox", "audit", &id]);
    assert!(audit.contains("\"reason\":\"owner-gone\""), "{audit}");

    // A VM whose QEMU dies: the next command on the host reaps the rest (the relay, the
    // disks, the cgroup).
    let id = env.create(&["--backend", "microvm", "--memory", "256M"]);
    let vm_pids = vm_host_pids(&id);
    let qemu = env.init_pid(&id);
    // SAFETY: plain kill(2) of the sandbox's QEMU.
    unsafe { libc::kill(qemu, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(200));
    assert!(!env.sandboxes().iter().any(|s| s["id"] == id.as_str()));
    env.assert_gone(&id, &vm_pids);
    let audit = env.ok(&["sandbox", "audit", &id]);
    assert!(audit.contains("\"reason\":\"crashed\""), "{audit}");
}

#[test]
fn a_bad_accelerator_setting_is_refused_by_name() {
    let _machines = machines_shared();
    let Some(env) = env("vm_accel") else {
        return;
    };
    let o = env
        .cmd(&["run", "--backend", "microvm", &env.reference, "--", "true"])
        .env("STRATA_VM_ACCEL", "fast")
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("STRATA_VM_ACCEL=fast") && err.contains("auto, kvm or tcg"),
        "{err}"
    );
}

/// SECURITY.md, "evaluation", on microvm and vm: the grading sandbox is a machine of the
/// agent's backend whose guest agent mounts the grader's layer and the protected paths
/// read-only over its root (by the host's rules) before any command runs.
#[test]
fn a_vm_agent_can_change_neither_its_grader_nor_the_tests_that_grade_it() {
    let _machines = machines_shared();
    let Some(env) = env("vm_evaluate") else {
        return;
    };
    for backend in ["microvm", "vm"] {
        env.assert_grader_untouchable(backend);
    }
}

/// A microVM's network card is the other end of a tap device on the host, behind the same
/// rules as a container's veth: an allowed address is reachable, nothing else (the host's
/// other ports, the internet, QEMU's old user-network gateway); the allowlist can be
/// replaced while it runs; a fork's child gets a link of its own (another address) and
/// reaches what its parent may; refused attempts are in the audit; nothing of the link is
/// left after.
#[test]
fn an_allowlist_opens_exactly_its_destinations_in_a_microvm() {
    let _machines = machines_shared();
    let Some(env) = env("vm_allowlist") else {
        return;
    };
    let host_ip = strata_tests::sh(
        "ip -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -1",
    )
    .trim()
    .to_string();
    let (allowed, other) = (
        strata_tests::HostServer::start(),
        strata_tests::HostServer::start(),
    );
    let probe = format!(
        "import socket\n\
         for host, port in [('{host_ip}', {a}), ('{host_ip}', {b}), ('1.1.1.1', 80), ('10.0.2.2', {a})]:\n\
         \x20   try:\n\
         \x20       s = socket.create_connection((host, port), timeout=3)\n\
         \x20       print(host, port, 'open', s.recv(64).decode().strip(), 'from', s.getsockname()[0])\n\
         \x20   except OSError as e:\n\
         \x20       print(host, port, 'blocked')\n",
        a = allowed.port,
        b = other.port
    );
    let open =
        |out: &str, port: u16| out.contains(&format!("{host_ip} {port} open hello from the host"));
    let blocked =
        |out: &str, host: &str, port: u16| out.contains(&format!("{host} {port} blocked"));
    let source = |out: &str| {
        out.lines()
            .find_map(|l| l.split_once(" from ").map(|(_, a)| a.trim().to_string()))
            .unwrap_or_default()
    };
    let net = format!("{host_ip}:{}", allowed.port);
    let id = env.create(&["--backend", "microvm", "--memory", "256M", "--net", &net]);
    let tap = format!("sv{id}");
    assert!(
        strata_tests::sh("ip -br link").contains(&tap),
        "no tap {tap}"
    );
    let out = env.ok(&["sandbox", "exec", &id, "--", "python3", "-c", &probe]);
    assert!(open(&out, allowed.port), "{out}");
    assert!(blocked(&out, &host_ip, other.port), "{out}");
    assert!(blocked(&out, "1.1.1.1", 80), "{out}");
    assert!(blocked(&out, "10.0.2.2", allowed.port), "{out}");
    let parent_addr = source(&out);
    // A child of a fork has its own link, and the same allowlist.
    let child = env.ok(&["sandbox", "fork", &id, "--count", "1"]);
    let child = child.lines().last().unwrap_or_default().trim().to_string();
    let out = env.ok(&["sandbox", "exec", &child, "--", "python3", "-c", &probe]);
    assert!(open(&out, allowed.port), "child: {out}");
    assert!(blocked(&out, &host_ip, other.port), "child: {out}");
    assert_ne!(
        source(&out),
        parent_addr,
        "the child kept its parent's address: {out}"
    );
    env.ok(&["sandbox", "rm", &child]);
    // The allowlist replaced while the machine runs.
    let net = format!("{host_ip}:{}", other.port);
    env.ok(&["sandbox", "network", &id, "--net", &net]);
    let out = env.ok(&["sandbox", "exec", &id, "--", "python3", "-c", &probe]);
    assert!(open(&out, other.port), "after the update: {out}");
    assert!(
        blocked(&out, &host_ip, allowed.port),
        "after the update: {out}"
    );
    env.ok(&["sandbox", "rm", &id]);
    env.assert_gone(&id, &[]);
    for gone in [&id, &child] {
        assert!(
            !strata_tests::sh("ip -br link").contains(&format!("sv{gone}")),
            "the tap of {gone} was left"
        );
        assert!(
            !strata_tests::sh("nft list table inet strata").contains(gone.as_str()),
            "rules of {gone} left"
        );
    }
    let audit = env.ok(&["sandbox", "audit", &id]);
    assert!(audit.contains("network-refused"), "{audit}");
    assert!(audit.contains("1.1.1.1:80"), "{audit}");
    // Created without an allowlist, a machine has no network card to update.
    let bare = env.create(&["--backend", "microvm", "--memory", "256M"]);
    let o = env.cli(&["sandbox", "network", &bare, "--net", &net]);
    let (_, err) = text(&o);
    assert!(
        !o.status.success() && err.contains("no network card"),
        "{err}"
    );
    env.ok(&["sandbox", "rm", &bare]);
}

#[test]
fn a_full_vm_with_a_display_serves_its_screen_over_vnc() {
    let _machines = machines_shared();
    let Some(env) = env("vm_display") else {
        return;
    };
    let id = env.create(&["--backend", "vm", "--display", "--memory", "256M"]);
    let sock = env
        .cli
        .runtime_dir()
        .join("sandboxes")
        .join(&id)
        .join("vnc.sock");
    let mut conn = strata_host::unix::connect(&sock).unwrap();
    let mut greeting = [0u8; 12];
    std::io::Read::read_exact(&mut conn, &mut greeting).unwrap();
    assert!(greeting.starts_with(b"RFB "), "{greeting:?}");
    // The guest drives the card: a DRM device with a framebuffer console.
    let o = env.sh(&id, "ls /sys/class/drm; cat /proc/fb");
    let (out, err) = text(&o);
    assert!(out.contains("card0") && out.contains("bochs"), "{out}{err}");
    env.ok(&["sandbox", "rm", &id]);
    env.assert_gone(&id, &[]);
    // A microVM has no graphics.
    env.refused_run(
        &["--backend", "microvm", "--display"],
        &env.reference,
        "--backend vm",
    );
}

/// A raw disk image of `size` bytes holding `tree` as an ext4 filesystem: in partition 1
/// of an MBR partition table when `partitioned`, else on the whole disk.
fn ext4_disk_image(image: &Path, tree: &Path, size: u64, partitioned: bool) {
    let f = std::fs::File::create(image).unwrap();
    f.set_len(size).unwrap();
    let offset = if partitioned { 1 << 20 } else { 0 };
    if partitioned {
        // One Linux partition from sector 2048 to the end.
        let mut mbr = [0u8; 512];
        mbr[446 + 4] = 0x83;
        mbr[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
        mbr[446 + 12..446 + 16].copy_from_slice(&((size / 512 - 2048) as u32).to_le_bytes());
        mbr[510] = 0x55;
        mbr[511] = 0xaa;
        std::os::unix::fs::FileExt::write_all_at(&f, &mbr, 0).unwrap();
    }
    drop(f);
    let o = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-d"])
        .arg(tree)
        .args(["-E", &format!("offset={offset}")])
        .arg(image)
        .arg(format!("{}k", (size - offset) / 1024))
        .output()
        .unwrap();
    assert!(o.status.success(), "mkfs.ext4: {:?}", text(&o));
}

#[test]
fn a_full_vm_boots_a_whole_disk_image_under_the_sample_layers() {
    let _machines = machines_shared();
    let Some(env) = env("vm_disk_image") else {
        return;
    };
    let shown: serde_json::Value =
        serde_json::from_str(&env.ok(&["catalog", "show", "--json", &env.reference])).unwrap();
    let sample = &shown["entry"];
    // An OS tree that is not one of our layers: the sample's Debian base, exported, with a
    // file of its own, as an ext4 root in a partitioned disk image and on a whole disk.
    let work = env.cli.home.join("disk-image");
    let tree = work.join("tree");
    env.ok(&[
        "layer",
        "export",
        sample["base"].as_str().unwrap(),
        tree.to_str().unwrap(),
    ]);
    std::fs::write(tree.join("etc/image-marker"), "from the image\n").unwrap();
    let mut entries = Vec::new();
    for (name, partitioned, partition) in [
        ("partitioned", true, ""),
        ("whole", false, ""),
        ("missing-partition", true, "partition = 3\n"),
    ] {
        let dir = work.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        ext4_disk_image(&dir.join("disk.img"), &tree, 384 << 20, partitioned);
        let layer = env.ok(&["layer", "build", dir.to_str().unwrap()]);
        let layer = layer.lines().last().unwrap().trim();
        // The sample's toolkit and workspace stacked on the image's root.
        let mut toml = format!(
            "id = \"images/{name}\"\nbase = \"{layer}\"\ntoolkits = [\"{}\"]\nworkspace = \"{}\"\n\
             backend = \"vm\"\nworkdir = \"/work\"\n[budgets]\nmemory = \"512M\"\n[commands]\ntest = \"{}\"\n[env]\n",
            sample["toolkits"][0].as_str().unwrap(),
            sample["workspace"].as_str().unwrap(),
            sample["commands"]["test"].as_str().unwrap(),
        );
        for (k, v) in sample["env"].as_object().unwrap() {
            toml.push_str(&format!("{k} = \"{}\"\n", v.as_str().unwrap()));
        }
        toml.push_str(&format!("[disk_image]\npath = \"/disk.img\"\n{partition}"));
        let file = work.join(format!("{name}.toml"));
        std::fs::write(&file, toml).unwrap();
        let reference = env.ok(&["catalog", "register", file.to_str().unwrap()]);
        entries.push(reference.lines().last().unwrap().trim().to_string());
    }

    // The sample's own test suite passes on the image's root, which is the overlay's
    // bottom layer under the sample's toolkit and workspace.
    let o = env.cli(&["run", "-c", "test", &entries[0]]);
    let (out, err) = text(&o);
    assert!(o.status.success() && out.contains("4 passed"), "{out}{err}");
    for reference in &entries[..2] {
        let id = env.ok(&["sandbox", "create", reference]);
        let id = id.lines().last().unwrap().trim().to_string();
        let o = env.sh(
            &id,
            "cat /etc/image-marker; grep ' / overlay' /proc/mounts; \
             echo changed > /etc/image-marker; cat /etc/image-marker",
        );
        let (out, err) = text(&o);
        assert!(o.status.success(), "{reference}: {out}{err}");
        assert!(out.starts_with("from the image\n"), "{reference}: {out}");
        assert!(
            out.contains(":/run/strata/image,upperdir="),
            "{reference}: {out}"
        );
        assert!(out.ends_with("changed\n"), "{reference}: {out}");
        env.ok(&["sandbox", "rm", &id]);
        env.assert_gone(&id, &[]);
    }
    // Writes went to the sandbox's own disk, never the image.
    let o = env.cli(&["run", &entries[1], "--", "cat", "/etc/image-marker"]);
    assert_eq!(text(&o).0, "from the image\n", "{:?}", text(&o));

    // Wrong uses are refused by name.
    env.refused_run(&["--backend", "container"], &entries[0], "--backend vm");
    env.refused_run(&[], &entries[2], "no partition 3 (it has 1)");
}

#[test]
fn a_microvms_commit_is_what_its_guest_wrote_and_leaves_no_copy() {
    let _machines = machines_shared();
    let Some(env) = env("vm_commit") else {
        return;
    };
    let id = env.create(&["--backend", "microvm"]);
    // Written just before the commit: only the guest's page cache has it until its flush.
    let changed = env.sh(&id, "echo from-the-guest > /work/vm.txt; rm /etc/issue");
    assert!(changed.status.success(), "{:?}", text(&changed));
    let out = env.ok(&[
        "sandbox",
        "commit",
        &id,
        "--register",
        "datasets/vm-committed",
    ]);
    let lines: Vec<&str> = out.lines().collect();
    let (reference, layer) = (lines[lines.len() - 2], lines[lines.len() - 1]);
    let again = env.ok(&["sandbox", "commit", &id]);
    assert_eq!(
        again.lines().last(),
        Some(layer),
        "same changes, same layer"
    );
    // The guest runs on; the copy its changes were read from is gone.
    assert_eq!(
        env.ok(&["sandbox", "exec", &id, "--", "cat", "/work/vm.txt"]),
        "from-the-guest\n"
    );
    let copies = env
        .cli
        .runtime_dir()
        .join("sandboxes")
        .join(&id)
        .join("changes");
    // The commits made this directory; what they put in it must be gone.
    let left: Vec<_> = std::fs::read_dir(&copies)
        .unwrap_or_else(|e| panic!("{}: {e}", copies.display()))
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "copies left: {left:?}");
    // A container from the registered entry has the guest's files.
    let seen = env.ok(&[
        "run",
        "--backend",
        "container",
        reference,
        "--",
        "sh",
        "-c",
        "cat /work/vm.txt; test ! -e /etc/issue && echo issue-gone",
    ]);
    assert_eq!(seen, "from-the-guest\nissue-gone\n");
    env.ok(&["sandbox", "rm", &id]);
    assert!(qemu_processes(&id).is_empty(), "QEMU of {id} still runs");
}

#[test]
fn a_microvm_hibernated_and_woken_a_hundred_times_keeps_its_files_and_processes() {
    let _machines = machines_alone();
    let Some(env) = env("vm_hibernate") else {
        return;
    };
    /// What a hibernated machine may still hold of the host's memory (the lazyfs
    /// daemon's cache and the runtime's own files move a little between cycles).
    const HIBERNATED_SLACK: u64 = 32 << 20;
    // Measured once the node's own services run (the lazyfs daemon, the machine
    // template), which a first microVM starts.
    let warm = env.create(&["--backend", "microvm"]);
    env.ok(&["sandbox", "rm", &warm]);
    let before = host_used_bytes();
    let id = env.create(&["--backend", "microvm"]);
    let counter = env.sh(
        &id,
        "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 &",
    );
    assert!(counter.status.success(), "{:?}", text(&counter));
    let (mut last, mut awake_max, mut hibernated_max) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    for cycle in 0..100 {
        // The next call wakes it: the counter goes on from where it was.
        let out = env.ok(&[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            &format!("echo {cycle} > /work/cycle-{cycle}; sleep 0.2; cat /tmp/count"),
        ]);
        let count: u64 = out.trim().parse().unwrap_or_else(|_| panic!("{out}"));
        assert!(
            count > last,
            "cycle {cycle}: the counter went from {last} to {count}"
        );
        last = count;
        awake_max = awake_max.max(host_used_bytes().saturating_sub(before));
        env.ok(&["sandbox", "hibernate", &id]);
        assert!(
            qemu_processes(&id).is_empty(),
            "cycle {cycle}: QEMU still runs"
        );
        assert!(
            vm_host_pids(&id).is_empty(),
            "cycle {cycle}: the relay still runs"
        );
        hibernated_max = hibernated_max.max(host_used_bytes().saturating_sub(before));
    }
    let per_cycle = started.elapsed() / 100;
    let events = env.wake_after_cycles(&id, 100);
    // Woken by the first call of each next cycle, and once by `wake`.
    assert_eq!(events, (100, 100));
    // The measure sees the machine: awake, it holds far more than the slack.
    strata_tests::assert_memory_released(
        "100 microVM hibernate/wake cycles (host memory)",
        per_cycle,
        awake_max,
        hibernated_max,
        HIBERNATED_SLACK,
        2,
    );
    env.ok(&["sandbox", "rm", &id]);
    assert!(qemu_processes(&id).is_empty(), "QEMU of {id} still runs");
}

#[test]
fn forks_of_a_microvm_each_continue_its_process_with_their_own_identity() {
    let _machines = machines_shared();
    let Some(env) = env("vm_fork") else {
        return;
    };
    // Eight, to bound the test: nine machines under TCG share two cores here (a fork of 16
    // took 62 s, its checks 7 more minutes). `strata-bench --suite state` forks more.
    const CHILDREN: usize = 8;
    let parent = env.create(&["--backend", "microvm"]);
    // State that lives only in a process's memory: the shell's variable.
    let counter = env.sh(
        &parent,
        "echo from-the-parent > /work/parent.txt; nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 & sleep 0.5; cat /tmp/count",
    );
    let at_fork: u64 = text(&counter).0.trim().parse().expect("the parent's count");
    let before = host_used_bytes();
    let started = Instant::now();
    let out = env.ok(&["sandbox", "fork", &parent, "--count", &CHILDREN.to_string()]);
    let took = started.elapsed();
    let children: Vec<String> = out.lines().map(str::to_string).collect();
    assert_eq!(children.len(), CHILDREN, "{out}");
    let held = host_used_bytes().saturating_sub(before);
    // The parent's memory is one image every child maps copy-on-write: the pages of it a
    // child has in memory are shared with the other children's.
    let mut shared = Vec::new();
    for child in &children {
        let pids = qemu_processes(child);
        assert_eq!(pids.len(), 1, "one QEMU for {child}: {pids:?}");
        shared.push(fork_image_shared_bytes(pids[0]));
    }
    assert!(
        shared.iter().all(|&b| b >= 8 << 20),
        "each child shares at least 8 MiB of the parent's memory image with the others: {shared:?}"
    );
    let mut names = std::collections::BTreeSet::new();
    for (i, child) in children.iter().enumerate() {
        let o = env.sh(
            child,
            &format!(
                "cat /work/parent.txt; hostname; echo {i} > /work/mine.txt; {}",
                strata_tests::home::COUNTER_TWICE
            ),
        );
        let (stdout, stderr) = text(&o);
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(
            lines.first(),
            Some(&"from-the-parent"),
            "{child}: {stdout}{stderr}"
        );
        names.insert(lines.get(1).map(|s| s.to_string()).unwrap_or_default());
        strata_tests::home::assert_counter_went_on(child, lines.get(2).copied(), at_fork, &stdout);
    }
    assert_eq!(
        names.len(),
        CHILDREN,
        "children share a host name: {names:?}"
    );
    // Each child's files are its own, and the parent's are untouched.
    for (i, child) in children.iter().enumerate() {
        assert_eq!(
            env.ok(&["sandbox", "exec", child, "--", "cat", "/work/mine.txt"])
                .trim(),
            i.to_string()
        );
    }
    let p = env.sh(
        &parent,
        "test -e /work/mine.txt && echo leaked || echo clean",
    );
    assert_eq!(text(&p).0.trim(), "clean");
    eprintln!(
        "fork of {CHILDREN} microVMs: {took:?} ({:?} per child); the children hold {} MiB of host memory ({} MiB each) beside the {} MiB of the parent's memory image they share ({} MiB of it in a child on average)",
        took / CHILDREN as u32,
        held >> 20,
        (held / CHILDREN as u64) >> 20,
        shared.iter().max().copied().unwrap_or(0) >> 20,
        (shared.iter().sum::<u64>() / CHILDREN as u64) >> 20
    );
    let mut all = children.clone();
    all.push(parent.clone());
    let mut args = vec!["sandbox", "rm"];
    args.extend(all.iter().map(String::as_str));
    env.ok(&args);
    for id in &all {
        assert!(qemu_processes(id).is_empty(), "QEMU of {id} still runs");
    }
    let forks = env.cli.runtime_dir().join("forks");
    let left: Vec<_> = std::fs::read_dir(&forks)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "fork snapshots left: {left:?}");
}

#[test]
fn an_idle_microvm_hibernates_by_itself_and_wakes_on_its_next_call() {
    let _machines = machines_shared();
    let Some(env) = env("vm_auto_hibernate") else {
        return;
    };
    let id = env.create(&["--backend", "microvm", "--auto-hibernate", "2s"]);
    env.ok(&[
        "sandbox",
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "echo kept > /work/kept.txt",
    ]);
    let state = || {
        let ls: serde_json::Value =
            serde_json::from_str(&env.ok(&["sandbox", "ls", "--json"])).expect("ls --json");
        ls.as_array()
            .and_then(|a| a.iter().find(|s| s["id"] == id.as_str()))
            .and_then(|s| s["state"].as_str().map(str::to_string))
            .unwrap_or_default()
    };
    // Idle past its time, the next reap (every CLI call reaps) hibernates it.
    // (A reap by a test running alongside can hold the sandbox's lock for a moment: the
    // reap skips it then, so it is asked again.)
    std::thread::sleep(Duration::from_secs(3));
    for _ in 0..20 {
        env.ok(&["sandbox", "reap"]);
        if state() == "hibernated" {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(state(), "hibernated");
    assert!(qemu_processes(&id).is_empty(), "QEMU still runs");
    let audit = env.ok(&["sandbox", "audit", &id]);
    assert!(audit.contains("\"event\":\"auto-hibernated\""), "{audit}");
    assert_eq!(
        env.ok(&["sandbox", "exec", &id, "--", "cat", "/work/kept.txt"]),
        "kept\n"
    );
    assert_eq!(state(), "running");
    env.ok(&["sandbox", "rm", &id]);
    assert!(qemu_processes(&id).is_empty(), "QEMU of {id} still runs");
}
