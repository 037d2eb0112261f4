//! The runtime end to end through the CLI: the sample environment (Debian base, pytest
//! toolkit, wordfreq workspace; datasets/sample/register.sh) built into a fresh store and
//! registered, then run by catalog ID in both backends; budgets; stateful sandboxes; and
//! cleanup after a killed runtime or a crashed sandbox.

use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use strata_tests::home::{
    assert_policy_answers, can_hibernate_containers, can_run_sandboxes, syscall_probe, text,
    SampleEnv,
};
use strata_tests::{have_tool, scratch_root, strata_bin, HostServer};

const BACKENDS: [&str; 2] = ["fncall", "container"];

type Env = SampleEnv;

static ENV: OnceLock<Option<Env>> = OnceLock::new();

/// The shared environment: one store, one STRATA_HOME, the sample registered once.
fn env(test: &str) -> Option<&'static Env> {
    if !can_run_sandboxes(test) {
        return None;
    }
    ENV.get_or_init(|| Some(SampleEnv::new("runtime-")))
        .as_ref()
}

#[test]
fn the_sample_test_suite_passes_in_both_backends() {
    let Some(env) = env("runtime_sample_suite") else {
        return;
    };
    for backend in BACKENDS {
        let o = env.cli(&[
            "run",
            "--backend",
            backend,
            &env.reference,
            "--command",
            "test",
        ]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{backend}: {out}{err}");
        assert!(out.contains("4 passed"), "{backend}: {out}");
        // The pytest that ran is the toolkit layer's, stacked above the base.
        let o = env.cli(&[
            "run",
            "--backend",
            backend,
            &env.reference,
            "--",
            "python3",
            "-c",
            "import pytest, os; print(pytest.__file__); print(os.getcwd())",
        ]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{err}");
        assert!(
            out.contains("/opt/strata-toolkit/site-packages/pytest"),
            "{out}"
        );
        assert!(out.contains("/work"), "{out}");
        // A command's exit status comes back as the CLI's.
        let o = env.cli(&[
            "run",
            "--backend",
            backend,
            &env.reference,
            "--",
            "sh",
            "-c",
            "exit 7",
        ]);
        assert_eq!(o.status.code(), Some(7), "{backend}");
    }
    // runc is the other supported OCI runtime.
    if have_tool("runtime_sample_suite", "runc") {
        let o = env
            .cmd(&[
                "run",
                "--backend",
                "container",
                &env.reference,
                "--command",
                "test",
            ])
            .env("STRATA_OCI_RUNTIME", "runc")
            .output()
            .unwrap();
        let (out, err) = text(&o);
        assert!(
            o.status.success() && out.contains("4 passed"),
            "runc: {out}{err}"
        );
    }
}

#[test]
fn a_hostile_command_cannot_take_over_the_agent() {
    let Some(env) = env("runtime_agent_integrity") else {
        return;
    };
    for backend in BACKENDS {
        env.assert_agent_integrity(backend);
    }
}

#[test]
fn the_hosts_kernel_files_are_masked_and_its_settings_read_only() {
    let Some(env) = env("runtime_kernel_files") else {
        return;
    };
    for backend in BACKENDS {
        env.assert_kernel_files_hidden(backend);
    }
}

#[test]
fn dangerous_syscalls_are_refused_before_the_kernel_sees_them() {
    let Some(env) = env("runtime_syscalls") else {
        return;
    };
    for backend in BACKENDS {
        env.assert_dangerous_syscalls_refused(backend);
    }
}

/// `yes` streamed through `strata run` into /dev/null: the CLI holds none of it (it printed
/// 1.5 GB into 1.48 GB of resident memory before), and every byte arrives.
#[test]
fn streamed_output_is_never_held_in_memory() {
    let Some(env) = env("runtime_stream_memory") else {
        return;
    };
    const BYTES: u64 = 768 << 20;
    const BOUND_KIB: u64 = 96 << 10;
    for backend in BACKENDS {
        let script = format!("yes | head -c {BYTES}");
        let out = strata_tests::stream_and_watch(&mut env.cmd(&[
            "run",
            "--backend",
            backend,
            &env.reference,
            "--",
            "sh",
            "-c",
            &script,
        ]));
        assert!(out.status.success(), "{backend}: {}", out.stderr);
        assert_eq!(out.bytes, BYTES, "{backend}: every byte is delivered");
        let peak = out.peak_kib;
        assert!(peak > 0, "{backend}: the CLI's memory was never read");
        assert!(
            peak < BOUND_KIB,
            "{backend}: the CLI peaked at {peak} KiB streaming {BYTES} bytes (bound {BOUND_KIB} KiB)"
        );
    }
}

/// The host-agent channel checks the protocol version on every connection: an agent of
/// another build is refused with both versions named, and a pool of them is drained.
#[test]
fn an_agent_of_another_protocol_version_is_refused_and_its_pool_drained() {
    let Some(shared) = env("runtime_agent_version") else {
        return;
    };
    // A home of its own (the same store): the other tests' creates refill their home's
    // pool meanwhile, and must neither take this test's old agents nor give it new ones.
    let home = shared.cli.sharing_store("runtime-version-");
    let reference = shared.reference.clone();
    let ready = home.runtime_dir().join("pool/ready");
    let pool_pids = || -> Vec<u32> {
        std::fs::read_dir(&ready)
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| {
                        let t = std::fs::read_to_string(e.path().join("pid")).ok()?;
                        t.split_whitespace().next()?.parse().ok()
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    home.ok(&["sandbox", "pool", "--drain"]);
    // Agents that answer as protocol v1 (an older build's pool).
    let o = home
        .cmd(&["sandbox", "pool", "--fill", "2"])
        .env("STRATA_AGENT_PROTOCOL", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o).1);
    let old = pool_pids();
    assert_eq!(old.len(), 2, "pool: {old:?}");
    // A create claims one, is refused, drains the rest and starts its agent cold.
    let o = home
        .cmd(&["sandbox", "create", "--backend", "fncall", &reference])
        .env("STRATA_POOL", "0")
        .output()
        .unwrap();
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    let current = format!("v{}", strata_agent_proto::PROTOCOL_VERSION);
    assert!(
        err.contains("protocol v1") && err.contains(&current),
        "the refusal names both versions: {err}"
    );
    let id = out.lines().last().unwrap().trim().to_string();
    let o = home.cli(&["sandbox", "exec", &id, "--", "sh", "-c", "echo fresh"]);
    assert_eq!(text(&o).0, "fresh\n", "{}", text(&o).1);
    for pid in &old {
        let alive =
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "));
        assert!(!alive, "pooled agent {pid} of protocol v1 still runs");
    }
    assert!(pool_pids().is_empty(), "the stale pool was not drained");
    home.ok(&["sandbox", "rm", &id]);
    // Started cold, such an agent is refused at once, naming both versions.
    let o = home
        .cmd(&["run", "--backend", "fncall", &reference, "--", "true"])
        .env("STRATA_AGENT_PROTOCOL", "1")
        .env("STRATA_POOL", "0")
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert!(!o.status.success(), "a v1 agent ran a command");
    assert!(
        err.contains("protocol v1") && err.contains(&current),
        "the refusal names both versions: {err}"
    );

    // The same protocol from another build of the agent (an upgrade: a pooled agent sets
    // up its root with the code it was started with): the next runtime command drains it.
    // A build is known by its binary's content, so a copy of the same one is the same.
    // (A fncall sandbox's init is the static agent where there is one.)
    let agent = home.home.join("strata-agent");
    let (built, setting) = match strata_tests::home::static_agent() {
        Some(s) => (s, "STRATA_STATIC_AGENT"),
        None => (strata_bin().with_file_name("strata-agent"), "STRATA_AGENT"),
    };
    std::fs::copy(&built, &agent).unwrap();
    let with_agent = |args: &[&str]| {
        let o = home.cmd(args).env(setting, &agent).output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", text(&o).1);
    };
    with_agent(&["sandbox", "pool", "--fill", "2"]);
    let pooled = pool_pids();
    assert_eq!(pooled.len(), 2, "pool: {pooled:?}");
    with_agent(&["sandbox", "ls"]);
    assert_eq!(pool_pids(), pooled, "the same build's pool is kept");
    // Another build: other bytes at the same path (an ELF runs with bytes appended).
    std::fs::remove_file(&agent).unwrap();
    let mut other = std::fs::read(&built).unwrap();
    other.extend_from_slice(b"another build");
    std::fs::write(&agent, other).unwrap();
    std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    with_agent(&["sandbox", "ls"]);
    assert!(
        pool_pids().is_empty(),
        "another build's pool was not drained"
    );
    home.ok(&["sandbox", "pool", "--drain"]);
}

#[test]
fn budgets_hold_and_say_which_one_ended_the_command() {
    let Some(env) = env("runtime_budgets") else {
        return;
    };
    for backend in BACKENDS {
        let run = |budget: &[&str], cmd: &[&str]| {
            let mut args = vec!["run", "--backend", backend];
            args.extend_from_slice(budget);
            args.push(&env.reference);
            args.push("--");
            args.extend_from_slice(cmd);
            let start = Instant::now();
            let o = env.cli(&args);
            (o.status.code(), text(&o), start.elapsed())
        };
        // Memory: the allocation is OOM-killed.
        let (code, (out, err), _) = run(
            &["--memory", "64M"],
            &[
                "python3",
                "-c",
                "x = bytearray(300 << 20); print('survived')",
            ],
        );
        assert_eq!(code, Some(137), "{backend} memory: {out}{err}");
        assert!(!out.contains("survived"));
        assert!(err.contains("budget exceeded: memory"), "{backend}: {err}");

        // Processes: a fork bomb is contained; the wall clock then ends it.
        let (_, (out, err), _) = run(
            &["--pids", "64", "--timeout", "3s"],
            &["bash", "-c", "bomb() { bomb | bomb & }; bomb; wait"],
        );
        assert!(
            err.contains("budget exceeded: pids"),
            "{backend} pids: {out}{err}"
        );

        // Disk: `yes` fills the upper and gets ENOSPC; the host's disk is untouched.
        let (code, (out, err), _) = run(
            &["--disk", "32M"],
            &["sh", "-c", "yes > /tmp/fill; du -m /tmp/fill"],
        );
        assert!(
            err.contains("No space left on device"),
            "{backend} disk: {out}{err}"
        );
        assert!(err.contains("budget exceeded: disk"), "{backend}: {err}");
        assert_eq!(code, Some(0));
        let mb: u64 = out.split_whitespace().next().unwrap().parse().unwrap();
        assert!(mb <= 32, "{backend}: the file grew to {mb} MiB");

        // Wall clock.
        let (code, (_, err), took) = run(&["--timeout", "2s"], &["sleep", "60"]);
        assert_eq!(code, Some(137), "{backend} timeout: {err}");
        assert!(err.contains("budget exceeded: timeout"), "{backend}: {err}");
        assert!(took < Duration::from_secs(30), "{took:?}");

        // Network: only loopback, nothing routes out.
        let (code, (out, err), _) = run(
            &[],
            &[
                "python3",
                "-c",
                "import socket\n\
                 print(open('/proc/net/dev').read())\n\
                 try:\n    socket.create_connection(('1.1.1.1', 80), timeout=3); print('REACHED')\n\
                 except OSError as e: print('blocked', e.errno)",
            ],
        );
        assert_eq!(code, Some(0), "{err}");
        assert!(
            out.contains("blocked") && !out.contains("REACHED"),
            "{backend}: {out}"
        );
        let ifaces: Vec<&str> = out
            .lines()
            .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim()))
            .filter(|n| !n.contains('|'))
            .collect();
        assert_eq!(ifaces, ["lo"], "{backend}: {out}");
        strata_tests::contained("budgets: memory, pids, disk, wall clock", backend, 4);
    }
}

#[test]
fn a_stateful_sandbox_keeps_processes_and_files_until_removed() {
    let Some(env) = env("runtime_stateful") else {
        return;
    };
    let scratch = tempfile::tempdir_in(scratch_root()).unwrap();
    for backend in BACKENDS {
        let id = env.create(&["--backend", backend, "--memory", "256M"]);
        env.ok(&[
            "sandbox",
            "exec",
            &id,
            "--",
            "sh",
            "-c",
            "nohup sleep 300 >/dev/null 2>&1 & echo kept > /tmp/state",
        ]);
        // A later exec sees the earlier one's file and background process.
        assert_eq!(
            env.ok(&["sandbox", "exec", &id, "--", "cat", "/tmp/state"]),
            "kept\n"
        );
        let ps: Vec<serde_json::Value> =
            serde_json::from_str(&env.ok(&["sandbox", "ps", &id, "--json"])).unwrap();
        let sleeper = ps
            .iter()
            .find(|p| p["cmdline"] == "sleep 300")
            .unwrap_or_else(|| panic!("{backend}: no sleep in {ps:?}"));
        let host_pids: Vec<u32> = ps
            .iter()
            .map(|p| p["host_pid"].as_u64().unwrap() as u32)
            .collect();
        assert_ne!(
            sleeper["pid"], sleeper["host_pid"],
            "ps shows in-sandbox PIDs"
        );
        // Files in and out.
        let local = scratch.path().join(format!("{backend}.in"));
        std::fs::write(&local, b"from the host\n").unwrap();
        env.ok(&[
            "sandbox",
            "cp",
            local.to_str().unwrap(),
            &format!("{id}:/work/in/file.txt"),
        ]);
        assert_eq!(
            env.ok(&["sandbox", "exec", &id, "--", "cat", "/work/in/file.txt"]),
            "from the host\n"
        );
        let back = scratch.path().join(format!("{backend}.out"));
        env.ok(&[
            "sandbox",
            "cp",
            &format!("{id}:/tmp/state"),
            back.to_str().unwrap(),
        ]);
        assert_eq!(std::fs::read(&back).unwrap(), b"kept\n");
        // A symlink the sandbox plants resolves inside it, never on the host.
        let secret = scratch.path().join("host-secret");
        std::fs::write(&secret, b"host only").unwrap();
        env.ok(&[
            "sandbox",
            "exec",
            &id,
            "--",
            "ln",
            "-s",
            secret.to_str().unwrap(),
            "/tmp/escape",
        ]);
        let o = env.cli(&["sandbox", "cp", &format!("{id}:/tmp/escape"), "-"]);
        assert!(!o.status.success() && !String::from_utf8_lossy(&o.stdout).contains("host only"));
        let _ = env.cli(&[
            "sandbox",
            "cp",
            local.to_str().unwrap(),
            &format!("{id}:/tmp/escape"),
        ]);
        assert_eq!(std::fs::read(&secret).unwrap(), b"host only");
        // stdin and environment reach the command.
        let mut child = env
            .cmd(&[
                "sandbox",
                "exec",
                "-i",
                "-e",
                "GREETING=hi",
                &id,
                "--",
                "sh",
                "-c",
                "read x; echo $GREETING $x",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(b"there\n").unwrap();
        let o = child.wait_with_output().unwrap();
        assert_eq!(String::from_utf8_lossy(&o.stdout), "hi there\n");

        assert!(env.sandboxes().iter().any(|s| s["id"] == id.as_str()));
        env.ok(&["sandbox", "rm", &id]);
        assert!(!env.sandboxes().iter().any(|s| s["id"] == id.as_str()));
        env.assert_gone(&id, &host_pids);
        // The audit record outlives the sandbox.
        let audit = env.ok(&["sandbox", "audit", &id]);
        let events: Vec<serde_json::Value> = audit
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let kinds: Vec<&str> = events
            .iter()
            .map(|e| e["event"].as_str().unwrap())
            .collect();
        assert_eq!(kinds.first(), Some(&"created"));
        assert_eq!(kinds.last(), Some(&"ended"));
        assert!(
            kinds.contains(&"file-write") && kinds.iter().filter(|k| **k == "exec").count() >= 4
        );
        assert_eq!(events[0]["catalog"], env.reference.as_str());
        assert_eq!(events.last().unwrap()["reason"], "destroyed", "{audit}");
    }
}

#[test]
fn a_killed_runtime_and_a_crashed_sandbox_leave_nothing_behind() {
    let Some(env) = env("runtime_reap") else {
        return;
    };
    for backend in BACKENDS {
        // `strata run` killed mid-command: its sandbox is reaped by the next runtime.
        let (mut child, id) =
            env.spawn_marked_run(&["--backend", backend], Duration::from_secs(60));
        // Wait until the command runs, then kill the CLI without letting it clean up.
        std::thread::sleep(Duration::from_millis(500));
        let ps: Vec<serde_json::Value> =
            serde_json::from_str(&env.ok(&["sandbox", "ps", &id, "--json"])).unwrap();
        let host_pids: Vec<u32> = ps
            .iter()
            .map(|p| p["host_pid"].as_u64().unwrap() as u32)
            .collect();
        child.kill().unwrap();
        child.wait().unwrap();
        // Any runtime command reaps (tests run in parallel, so it may be another's).
        env.ok(&["sandbox", "reap"]);
        env.assert_gone(&id, &host_pids);
        let audit = env.ok(&["sandbox", "audit", &id]);
        assert!(audit.contains("\"reason\":\"owner-gone\""), "{audit}");

        // A sandbox whose init dies: the next command on the host reaps it.
        let id = env.create(&["--backend", backend]);
        let init = env.init_pid(&id);
        // SAFETY: plain kill(2) of the sandbox's init.
        unsafe { libc::kill(init, libc::SIGKILL) };
        // Each listing reaps first; the one after the init is gone no longer lists it (a
        // loaded host may take a moment to end the killed process).
        let deadline = Instant::now() + Duration::from_secs(20);
        while env.sandboxes().iter().any(|s| s["id"] == id.as_str()) {
            assert!(
                Instant::now() < deadline,
                "{backend}: sandbox {id} is still listed 20 s after its init was killed"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        env.assert_gone(&id, &[init as u32]);
        let audit = env.ok(&["sandbox", "audit", &id]);
        assert!(audit.contains("\"reason\":\"crashed\""), "{audit}");
    }
}

#[test]
fn an_idle_sandbox_expires_after_its_ttl() {
    let Some(env) = env("runtime_idle_ttl") else {
        return;
    };
    let id = env.create(&["--backend", "fncall", "--idle-ttl", "1s"]);
    let busy = env.create(&["--backend", "fncall"]);
    std::thread::sleep(Duration::from_millis(1500));
    env.ok(&["sandbox", "reap"]);
    env.assert_gone(&id, &[]);
    let audit = env.ok(&["sandbox", "audit", &id]);
    assert!(audit.contains("\"reason\":\"idle-ttl\""), "{audit}");
    assert!(env.sandboxes().iter().any(|s| s["id"] == busy.as_str()));
    env.ok(&["sandbox", "rm", &busy]);
}

#[test]
fn an_allowlist_opens_exactly_its_destinations() {
    if !have_tool("runtime_allowlist", "nft") {
        return;
    }
    let Some(env) = env("runtime_allowlist") else {
        return;
    };
    let host_ip = strata_tests::sh(
        "ip -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -1",
    );
    let host_ip = host_ip.trim();
    assert!(!host_ip.is_empty(), "the host has no global IPv4 address");
    let (allowed, other) = (HostServer::start(), HostServer::start());
    let probe = format!(
        "import socket\n\
         for host, port in [('{host_ip}', {a}), ('{host_ip}', {b}), ('1.1.1.1', 80), ('10.231.255.253', {a})]:\n\
         \x20   try:\n\
         \x20       s = socket.create_connection((host, port), timeout=2)\n\
         \x20       print(host, port, 'open', s.recv(64).decode().strip())\n\
         \x20   except OSError as e:\n\
         \x20       print(host, port, 'blocked')\n",
        a = allowed.port,
        b = other.port
    );
    for backend in BACKENDS {
        let net = format!("{host_ip}:{}", allowed.port);
        let id = env.create(&["--backend", backend, "--net", &net]);
        let out = env.ok(&["sandbox", "exec", &id, "--", "python3", "-c", &probe]);
        assert!(
            out.contains(&format!(
                "{host_ip} {} open hello from the host",
                allowed.port
            )),
            "{backend}: {out}"
        );
        assert!(
            out.contains(&format!("{host_ip} {} blocked", other.port)),
            "{backend}: {out}"
        );
        assert!(out.contains("1.1.1.1 80 blocked"), "{backend}: {out}");
        let veth = format!("sv{id}");
        assert!(strata_tests::sh("ip -br link").contains(&veth));
        env.ok(&["sandbox", "rm", &id]);
        env.assert_gone(&id, &[]);
        assert!(
            !strata_tests::sh("ip -br link").contains(&veth),
            "{backend}: veth left"
        );
        let netns = std::fs::read_dir("/run/netns")
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        assert!(
            !netns.iter().any(|n| n.contains(&id)),
            "{backend}: netns left: {netns:?}"
        );
        assert!(
            !strata_tests::sh("nft list table inet strata").contains(&id),
            "{backend}: rules left"
        );
        let audit = env.ok(&["sandbox", "audit", &id]);
        assert!(audit.contains("network-refused"), "{backend}: {audit}");
        assert!(
            audit.contains(&format!("{host_ip}:{}", other.port)),
            "{backend}: {audit}"
        );
        assert!(audit.contains("1.1.1.1:80"), "{backend}: {audit}");
    }
}

/// Two runtime homes on one host (sharing one store, as a cluster's nodes do) run
/// networked sandboxes at the same time; each one's reap and destroy leave the other's
/// sandboxes reachable and intact.
#[test]
fn two_homes_on_one_host_keep_each_others_networked_sandboxes() {
    if !have_tool("runtime_two_homes", "nft") {
        return;
    }
    let Some(env) = env("runtime_two_homes") else {
        return;
    };
    let other = env.cli.sharing_store("runtime-other-");
    let host_ip = strata_tests::sh(
        "ip -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -1",
    );
    let host_ip = host_ip.trim().to_string();
    let server = HostServer::start();
    let net = format!("{host_ip}:{}", server.port);
    let probe = format!(
        "import socket; s = socket.create_connection(('{host_ip}', {}), timeout=5); print(s.recv(64).decode().strip())",
        server.port
    );
    let reaches = |home: &strata_tests::home::CliHome, id: &str| {
        let o = home.cli(&["sandbox", "exec", id, "--", "python3", "-c", &probe]);
        let (out, err) = text(&o);
        assert!(
            o.status.success() && out.contains("hello from the host"),
            "sandbox {id} lost its network: {out}{err}"
        );
    };
    let create = |home: &strata_tests::home::CliHome, backend: &str| {
        home.ok(&[
            "sandbox",
            "create",
            "--backend",
            backend,
            "--net",
            &net,
            &env.reference,
        ])
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string()
    };
    for backend in BACKENDS {
        let a = create(&env.cli, backend);
        let b = create(&other, backend);
        reaches(&env.cli, &a);
        reaches(&other, &b);
        // Each home's reap leaves the other's alone.
        env.ok(&["sandbox", "reap"]);
        other.ok(&["sandbox", "reap"]);
        reaches(&env.cli, &a);
        reaches(&other, &b);
        // So does a destroy.
        other.ok(&["sandbox", "rm", &b]);
        reaches(&env.cli, &a);
        let b2 = create(&other, backend);
        env.ok(&["sandbox", "rm", &a]);
        reaches(&other, &b2);
        other.ok(&["sandbox", "rm", &b2]);
        env.assert_gone(&a, &[]);
        other.assert_sandbox_gone(&b, &[]);
        other.assert_sandbox_gone(&b2, &[]);
    }
}

#[test]
fn a_commit_becomes_a_layer_and_an_entry_a_fresh_home_starts_from() {
    let Some(env) = env("runtime_commit") else {
        return;
    };
    for backend in BACKENDS {
        let id = env.create(&["--backend", backend]);
        // An installed package (a module where Python finds it), a deleted base file and a
        // directory replaced whole (opaque), as an agent's work leaves them.
        let changed = env.sh(
            &id,
            "set -e; d=/usr/local/lib/python3.11/dist-packages; mkdir -p $d/committed_pkg; \
             echo 'VALUE = 42' > $d/committed_pkg/__init__.py; \
             test -e /etc/issue; rm /etc/issue; \
             rm -rf /etc/apt; mkdir /etc/apt; echo only > /etc/apt/only",
        );
        assert!(changed.status.success(), "{:?}", text(&changed));
        let entry = format!("datasets/committed-{backend}");
        let out = env.ok(&["sandbox", "commit", &id, "--register", &entry]);
        let lines: Vec<&str> = out.lines().collect();
        let layer = lines.last().copied().unwrap_or_default().to_string();
        assert_eq!(layer.len(), 64, "the layer ID comes last: {out}");
        let reference = lines[lines.len() - 2];
        assert!(
            reference.starts_with(&format!("{entry}@v")),
            "the registered entry comes before the layer: {out}"
        );
        // Nothing changed since: the same layer, already in the store.
        let again = env.ok(&["sandbox", "commit", &id, "--json"]);
        let (json, last) = again
            .trim_end()
            .rsplit_once('\n')
            .expect("JSON, then the ID");
        assert_eq!(last, layer, "{again}");
        let again: serde_json::Value = serde_json::from_str(json).expect("commit --json");
        assert_eq!(again["layer"], layer.as_str(), "{again}");
        assert_eq!(again["created"], false, "{again}");
        // A paused sandbox stays paused through a commit; `ls --json` says which.
        let state = |id: &str| {
            env.sandboxes()
                .into_iter()
                .find(|s| s["id"] == id)
                .map(|s| s["state"].as_str().unwrap_or_default().to_string())
        };
        assert_eq!(state(&id).as_deref(), Some("running"));
        env.ok(&["sandbox", "pause", &id]);
        assert_eq!(state(&id).as_deref(), Some("paused"));
        let paused = env.ok(&["sandbox", "commit", &id]);
        assert_eq!(paused.lines().last(), Some(layer.as_str()));
        assert_eq!(state(&id).as_deref(), Some("paused"), "a commit thawed it");
        env.ok(&["sandbox", "resume", &id]);
        assert_eq!(state(&id).as_deref(), Some("running"));
        // The sandbox runs on after its changes were read.
        assert_eq!(
            env.ok(&["sandbox", "exec", &id, "--", "cat", "/etc/apt/only"]),
            "only\n"
        );
        // Another home sharing the store, which never saw the sandbox.
        let other = env.cli.sharing_store("runtime-commit-");
        let seen = other.ok(&[
            "run",
            "--backend",
            backend,
            reference,
            "--",
            "sh",
            "-c",
            "python3 -c 'import committed_pkg; print(committed_pkg.VALUE)'; \
             test ! -e /etc/issue && echo issue-gone; ls /etc/apt",
        ]);
        assert_eq!(seen, "42\nissue-gone\nonly\n", "{seen}");
        let pid = env.init_pid(&id) as u32;
        env.ok(&["sandbox", "rm", &id]);
        env.assert_gone(&id, &[pid]);
    }
}

/// The shared environment, where containers can hibernate (CRIU built).
fn hibernating_env(test: &str) -> Option<&'static Env> {
    env(test).filter(|_| can_hibernate_containers(test))
}

/// The memory cgroup directory of the process `pid` on the host (v1 or v2).
fn sandbox_memory_cgroup(pid: u32) -> std::path::PathBuf {
    let table = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("its cgroups");
    for line in table.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        if ctrl.split(',').any(|c| c == "memory") {
            return std::path::Path::new("/sys/fs/cgroup/memory")
                .join(path.trim_start_matches('/'));
        }
    }
    let v2 = table
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .expect("a cgroup");
    std::path::Path::new("/sys/fs/cgroup").join(v2.trim_start_matches('/'))
}

/// Anonymous and shared memory charged to the memory cgroup `dir` (v1: `total_rss` and
/// `total_shmem`; v2: `anon` and `shmem`).
fn cgroup_memory(dir: &std::path::Path) -> u64 {
    let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    stat.lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| matches!(*k, "total_rss" | "total_shmem" | "anon" | "shmem"))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum()
}

/// What the container hibernation test's process does: holds 64 MiB of its own memory,
/// counts, and records which `SECRET_MARK` environments it can read: its own child's (the
/// control) and, if a restore lost its Landlock domain, a later exec's too.
const WATCHER: &str = r#"
import os, time
ballast = bytearray(64 << 20)
for k in range(0, len(ballast), 4096):
    ballast[k] = 1
if os.fork() == 0:
    os.execve("/bin/sleep", ["sleep", "infinity"], {"SECRET_MARK": "control"})
i = 0
while True:
    i += 1
    seen = set()
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                env = open(f"/proc/{p}/environ", "rb").read()
            except OSError:
                continue
            seen.update(v[12:].decode() for v in env.split(b"\0") if v.startswith(b"SECRET_MARK="))
    with open("/tmp/count.new", "w") as f:
        f.write(f"{i} {' '.join(sorted(seen))}\n")
    os.rename("/tmp/count.new", "/tmp/count")
    time.sleep(0.05)
"#;

/// Container hibernation (CRIU): files and a running process's memory survive every
/// cycle, the host's memory comes back while it hibernates, and a restored process keeps
/// a Landlock domain of its own (SECURITY.md, "The agent's integrity", point 2: it reads
/// no later exec's environment).
#[test]
fn a_container_hibernated_and_woken_a_hundred_times_keeps_its_files_processes_and_scope() {
    hibernate_and_wake("container", 100);
}

/// Fncall hibernation (CRIU, the static agent as init): as a container's, over fewer
/// cycles (the path is the same past the agent; a container's hundred are above). The
/// woken agent still gives each command the sandbox's filesystem rules: a write to /proc's
/// settings or a device node made is refused after the wake as before it.
#[test]
fn a_fncall_sandbox_hibernated_and_woken_keeps_its_files_processes_and_scope() {
    hibernate_and_wake("fncall", 20);
}

/// Writes a process's own name in /proc: what a fncall sandbox's filesystem rules refuse.
const PROC_WRITE: &str = "(printf w > /proc/self/comm) 2>/dev/null && echo written || echo refused";

/// `cycles` hibernate → wake cycles of a `backend` sandbox running [`WATCHER`].
fn hibernate_and_wake(backend: &str, cycles: u64) {
    let Some(env) = hibernating_env(&format!("{backend}_hibernate")) else {
        return;
    };
    /// What a hibernated sandbox may still hold of memory: the kernel's own charges to
    /// its cgroup (it keeps its limits while it sleeps), no process's.
    const HIBERNATED_SLACK: u64 = 4 << 20;
    let id = env.create(&["--backend", backend]);
    let confined = if backend == "fncall" {
        "refused\n"
    } else {
        "written\n"
    };
    assert_eq!(
        env.sh_ok(&id, PROC_WRITE),
        confined,
        "{backend}: before it slept"
    );
    // Measured in the sandbox's own cgroup (anonymous and shared memory: what its
    // processes hold; page cache of its files is the host's to reclaim), which other
    // tests running at once do not move.
    let memory_dir = sandbox_memory_cgroup(env.init_pid(&id) as u32);
    let before = cgroup_memory(&memory_dir);
    // Named by backend: the host-wide `pgrep` below must not find the other test's.
    let watcher = format!("python3 /tmp/watch-{backend}.py");
    let script = format!(
        "cat > /tmp/watch-{backend}.py <<'EOF'\n{WATCHER}\nEOF\nnohup {watcher} >/dev/null 2>&1 &"
    );
    let started = env.sh(&id, &script);
    assert!(started.status.success(), "{:?}", text(&started));
    std::thread::sleep(Duration::from_millis(500));
    let watcher_runs = || {
        std::process::Command::new("pgrep")
            .args(["-f", &watcher])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let (mut last, mut awake_max, mut hibernated_max) = (0u64, 0u64, 0u64);
    let t = Instant::now();
    for cycle in 0..cycles {
        // The next call wakes it: the count goes on from where it was.
        let mark = format!("SECRET_MARK=exec{cycle}");
        let out = env.ok(&[
            "sandbox",
            "exec",
            "--env",
            &mark,
            &id,
            "--",
            "sh",
            "-c",
            &format!("echo {cycle} > /work/cycle-{cycle}; sleep 0.3; cat /tmp/count"),
        ]);
        let mut fields = out.split_whitespace();
        let count: u64 = fields
            .next()
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("cycle {cycle}: {out}"));
        let seen: Vec<&str> = fields.collect();
        assert!(
            count > last,
            "cycle {cycle}: the count went from {last} to {count}"
        );
        assert_eq!(
            seen,
            ["control"],
            "cycle {cycle}: the watcher reads its own child's environment and no exec's"
        );
        last = count;
        awake_max = awake_max.max(cgroup_memory(&memory_dir).saturating_sub(before));
        env.ok(&["sandbox", "hibernate", &id]);
        assert!(!watcher_runs(), "cycle {cycle}: the watcher still runs");
        hibernated_max = hibernated_max.max(cgroup_memory(&memory_dir).saturating_sub(before));
    }
    let per_cycle = t.elapsed() / cycles as u32;
    let events = env.wake_after_cycles(&id, cycles as usize);
    assert_eq!(events, (cycles as usize, cycles as usize));
    if backend == "fncall" {
        // The woken agent confines each command as before it slept: /proc is read-only
        // to it (a process's own name, which no capability guards, is refused by the
        // filesystem rules alone; a container, without them, may write it).
        assert_eq!(
            env.sh_ok(&id, PROC_WRITE),
            "refused\n",
            "after {cycles} wakes"
        );
    }
    // Measured in the sandbox's cgroup: awake, it holds its 64 MiB.
    strata_tests::assert_memory_released(
        &format!("{cycles} {backend} hibernate/wake cycles"),
        per_cycle,
        awake_max,
        hibernated_max,
        HIBERNATED_SLACK,
        3,
    );
    let host_pids: Vec<u32> = std::process::Command::new("pgrep")
        .args(["-f", &watcher])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    assert!(!host_pids.is_empty(), "the woken watcher does not run");
    env.ok(&["sandbox", "rm", &id]);
    env.assert_gone(&id, &host_pids);
}

/// A container checkpoint CRIU refuses (here a file deleted while open, larger than what a
/// checkpoint saves) leaves the sandbox running where it was, its agent serving, and says
/// why; once the obstacle is gone the sandbox hibernates and wakes. An idle container
/// with `auto_hibernate` is hibernated by the reaper.
#[test]
fn a_container_whose_checkpoint_fails_runs_on_as_it_was() {
    let Some(env) = hibernating_env("container_checkpoint_fails") else {
        return;
    };
    let id = env.create(&["--backend", "container"]);
    let started = env.sh(
        &id,
        "echo kept > /work/kept; \
         nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 & \
         nohup python3 -c \"import os, time; f = open('/tmp/ghost', 'wb'); f.write(bytes([1]) * (100 << 20)); f.flush(); os.unlink('/tmp/ghost'); open('/tmp/ghost.ready', 'w').close(); [time.sleep(0.05) for _ in iter(lambda: os.path.exists('/tmp/ghost.stop'), True)]\" >/dev/null 2>&1 & \
         for i in $(seq 600); do test -e /tmp/ghost.ready && break; sleep 0.05; done; test -e /tmp/ghost.ready",
    );
    assert!(started.status.success(), "{:?}", text(&started));
    let count = || -> u64 {
        let out = env.ok(&["sandbox", "exec", &id, "--", "cat", "/tmp/count"]);
        out.trim().parse().unwrap_or_else(|_| panic!("{out}"))
    };
    let before = count();
    // Under load CRIU may also fail to seize a task caught in uninterruptible sleep
    // ("Unseizable non-zombie ... state D"): that too is a refused checkpoint the sandbox
    // survives, but not the one this test is about, so it is tried again.
    let mut tries = 0;
    let err = loop {
        tries += 1;
        let o = env.cli(&["sandbox", "hibernate", &id]);
        let (out, err) = text(&o);
        assert!(
            !o.status.success(),
            "a checkpoint of a 100 MiB deleted file passed: {out}"
        );
        if err.contains("ghost") || tries == 3 {
            break err;
        }
        eprintln!("checkpoint refused for another reason, trying again: {err}");
    };
    assert!(
        err.contains("process checkpoint (CRIU)") && err.contains("ghost"),
        "{err}"
    );
    assert!(err.contains("checkpoint-failed.log"), "{err}");
    let state = env
        .sandboxes()
        .into_iter()
        .find(|s| s["id"] == id.as_str())
        .map(|s| s["state"].clone());
    assert_eq!(state, Some("running".into()));
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        count() > before,
        "the counter stopped after the refused checkpoint"
    );
    assert_eq!(
        env.ok(&["sandbox", "exec", &id, "--", "cat", "/work/kept"]),
        "kept\n"
    );
    // Without the deleted file the checkpoint goes through. (A later exec cannot signal
    // its holder, another exec's process: it is told to end by a file.)
    env.sh_ok(&id, "touch /tmp/ghost.stop; sleep 0.5");
    env.ok(&["sandbox", "hibernate", &id]);
    let asleep = count();
    assert!(asleep > before);
    std::thread::sleep(Duration::from_millis(300));
    assert!(count() > asleep, "the counter stopped after the wake");
    env.ok(&["sandbox", "rm", &id]);
    // Idle past its auto_hibernate, a container is hibernated by the next reap (any
    // embedded CLI call) and woken by its next command.
    let idle = env.create(&["--backend", "container", "--auto-hibernate", "1s"]);
    env.sh_ok(&idle, "echo idle > /work/idle");
    // Each `sandbox ls` reaps; a reap that finds it busy or cannot save it tries again at
    // the next one.
    let mut state = None;
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(500));
        state = env
            .sandboxes()
            .into_iter()
            .find(|s| s["id"] == idle.as_str())
            .map(|s| s["state"].clone());
        if state == Some("hibernated".into()) {
            break;
        }
    }
    assert_eq!(
        state,
        Some("hibernated".into()),
        "auto_hibernate did not hibernate it"
    );
    assert_eq!(
        env.ok(&["sandbox", "exec", &idle, "--", "cat", "/work/idle"]),
        "idle\n"
    );
    assert!(env
        .ok(&["sandbox", "audit", &idle])
        .contains("\"event\":\"auto-hibernated\""));
    env.ok(&["sandbox", "rm", &idle]);
}

/// A container's fork (CRIU): 16 children, each continuing the parent's process from its
/// memory (a shell whose count lives in a variable), each with its own files, host name,
/// machine ID and key (its agent answers the CLI with the child's own key); the parent is
/// untouched, and a child hibernates and wakes like any container. Reports the time per
/// child and the host memory the children hold.
#[test]
fn forks_of_a_container_each_continue_its_process_with_their_own_identity() {
    fork_children("container", 16);
}

/// A fncall sandbox's fork: as a container's, with 8 children.
#[test]
fn forks_of_a_fncall_sandbox_each_continue_its_process_with_their_own_identity() {
    fork_children("fncall", 8);
}

/// Forks `children` of a `backend` sandbox holding a counting process.
fn fork_children(backend: &str, children: usize) {
    let Some(env) = hibernating_env(&format!("{backend}_fork")) else {
        return;
    };
    let parent = env.create(&["--backend", backend]);
    env.sh_ok(
        &parent,
        "echo from-the-parent > /work/parent.txt; echo 0123456789abcdef0123456789abcdef > /etc/machine-id; \
         nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' >/dev/null 2>&1 & sleep 0.5",
    );
    let count = |id: &str| -> u64 {
        let out = env.ok(&["sandbox", "exec", id, "--", "cat", "/tmp/count"]);
        out.trim().parse().unwrap_or_else(|_| panic!("{id}: {out}"))
    };
    let at_fork = count(&parent);
    let before = strata_tests::host_used_bytes();
    let started = Instant::now();
    let forked = env.cli(&["sandbox", "fork", &parent, "--count", &children.to_string()]);
    let took = started.elapsed();
    // What the fork logged (its stderr) says why, should it leave its snapshot behind.
    let fork_log = String::from_utf8_lossy(&forked.stderr).into_owned();
    assert!(forked.status.success(), "sandbox fork: {fork_log}");
    let out = String::from_utf8_lossy(&forked.stdout).into_owned();
    let kids: Vec<String> = out.lines().map(str::to_string).collect();
    assert_eq!(kids.len(), children, "{out}");
    let held = strata_tests::host_used_bytes().saturating_sub(before);
    let (mut names, mut machine_ids) = (
        std::collections::BTreeSet::new(),
        std::collections::BTreeSet::new(),
    );
    for (i, child) in kids.iter().enumerate() {
        let stdout = env.sh_ok(
            child,
            &format!("cat /work/parent.txt; hostname; cat /etc/machine-id; echo {i} > /work/mine.txt; {}", strata_tests::home::COUNTER_TWICE),
        );
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.first(), Some(&"from-the-parent"), "{child}: {stdout}");
        assert_eq!(
            lines.get(1).copied(),
            Some(format!("sandbox-{child}").as_str()),
            "{child}: {stdout}"
        );
        names.insert(lines.get(1).map(|s| s.to_string()).unwrap_or_default());
        machine_ids.insert(lines.get(2).map(|s| s.to_string()).unwrap_or_default());
        strata_tests::home::assert_counter_went_on(child, lines.get(3).copied(), at_fork, &stdout);
    }
    assert_eq!(names.len(), children, "children share a host name");
    assert_eq!(
        machine_ids.len(),
        children,
        "children share a machine ID: {machine_ids:?}"
    );
    assert!(!machine_ids.contains("0123456789abcdef0123456789abcdef"));
    for (i, child) in kids.iter().enumerate() {
        assert_eq!(
            env.ok(&["sandbox", "exec", child, "--", "cat", "/work/mine.txt"])
                .trim(),
            i.to_string()
        );
    }
    assert_eq!(
        env.sh_ok(
            &parent,
            "test -e /work/mine.txt && echo leaked || echo clean; hostname"
        ),
        format!("clean\nsandbox-{parent}\n")
    );
    assert!(count(&parent) > at_fork, "the parent's process stopped");
    // A child is a sandbox like any: it hibernates and wakes with its process.
    let first = &kids[0];
    let asleep = count(first);
    env.ok(&["sandbox", "hibernate", first]);
    // The next call wakes it; its counter then moves on (within 10 s on a loaded host: the
    // first read may come before the woken process's next tick).
    let woken = env.sh_ok(first, strata_tests::home::COUNTER_TWICE);
    strata_tests::home::assert_counter_went_on(first, woken.lines().next(), asleep, &woken);
    eprintln!(
        "fork of {children} {backend} sandboxes: {took:?} ({:?} per child); the children hold {} MiB of host memory ({} KiB each, none shared: CRIU restores private copies)",
        took / children as u32,
        held >> 20,
        (held / children as u64) >> 10
    );
    let mut all = kids.clone();
    all.push(parent.clone());
    let pids: Vec<u32> = all.iter().map(|id| env.init_pid(id) as u32).collect();
    let mut args = vec!["sandbox", "rm"];
    args.extend(all.iter().map(String::as_str));
    env.ok(&args);
    for id in &all {
        env.assert_gone(id, &pids);
    }
    let forks = env.cli.runtime_dir().join("forks");
    let left: Vec<_> = walkdir::WalkDir::new(&forks)
        .min_depth(1)
        .into_iter()
        .flatten()
        .map(|e| e.into_path())
        .collect();
    assert!(
        left.is_empty(),
        "fork snapshots left: {left:?}; the fork logged: {fork_log}"
    );
}

/// SECURITY.md, "evaluation": an agent's sandbox can change neither what grades it nor how.
/// The agent overwrites /bin/bash and a /usr/lib file (only its own upper: the next
/// sandbox of the entry is clean), rewrites the workspace's tests to pass, plants a
/// conftest where the grader's files will be, and leaves a module that games the grader
/// at import. `sandbox evaluate` grades it over the workspace's own tests and the grader's
/// hidden one: it fails, every tampering try under the grader was refused, the audit names
/// the protected files the agent changed, and the agent's sandbox is as it was. A control
/// agent that changed nothing passes; one that made /work a symlink is refused by name.
#[test]
fn an_agent_can_change_neither_its_grader_nor_the_tests_that_grade_it() {
    let Some(env) = env("runtime_evaluate") else {
        return;
    };
    for backend in BACKENDS {
        env.assert_grader_untouchable(backend);
    }
}

/// Host sandboxes start from a launch mount namespace (`strata_host::mountns`): a copy of
/// the host's without any sandbox's mounts (so what a start copies and reads does not grow
/// with the sandboxes on the node), into which a start carries only its own root.
#[test]
fn a_launch_namespace_holds_no_sandboxs_mounts_but_the_one_it_carries() {
    use strata_host::mountns;
    if !strata_tests::have_root("launch_namespace") {
        return;
    }
    let dir = tempfile::tempdir_in(scratch_root()).unwrap();
    let state = dir.path().join("runtime");
    let before = state.join("sandboxes/a/rootfs");
    let after = state.join("sandboxes/b/rootfs");
    let other = dir.path().join("other-home/rootfs");
    for d in [&before, &after, &other] {
        std::fs::create_dir_all(d).unwrap();
    }
    for d in ["l", "u", "w"] {
        std::fs::create_dir_all(dir.path().join(d)).unwrap();
    }
    // A sandbox of this home and another home's overlay root, both there when the
    // template is made.
    let _a = strata_tests::OwnMount::new("-t tmpfs strata-test-a", &before);
    let d = dir.path().display();
    let _other = strata_tests::OwnMount::new(
        &format!("-t overlay strata-test-other -o lowerdir={d}/l,upperdir={d}/u,workdir={d}/w"),
        &other,
    );
    let template = mountns::Template::new(&state).expect("a launch namespace");
    // The sandbox starting now, its root mounted after the template was made.
    let _b = strata_tests::OwnMount::new("-t tmpfs strata-test-b", &after);
    std::fs::write(after.join("marker"), "carried\n").unwrap();
    let mut cmd = std::process::Command::new("cat");
    cmd.arg("/proc/self/mountinfo").arg(after.join("marker"));
    let carried = mountns::carry(&after).expect("open_tree of the root");
    mountns::enter(&mut cmd, &template, vec![carried], None).unwrap();
    let out = cmd.output().expect("cat in the launch namespace");
    let (table, err) = text(&out);
    assert!(out.status.success(), "{err}");
    let points: Vec<&str> = table
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .collect();
    assert!(points.contains(&"/proc"), "the host's own mounts: {table}");
    assert!(
        points.contains(&after.to_str().unwrap()),
        "the carried root: {table}"
    );
    assert!(
        table.ends_with("carried\n"),
        "the carried root's files: {table}"
    );
    for gone in [&before, &other] {
        assert!(
            !points.contains(&gone.to_str().unwrap()),
            "{} is in the launch namespace: {table}",
            gone.display()
        );
    }
    // Neither the template nor the host changed: the host keeps all three, once each.
    let host = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for p in [&before, &after, &other] {
        let at = p.to_str().unwrap();
        let n = host
            .lines()
            .filter(|l| l.split_whitespace().nth(4) == Some(at))
            .count();
        assert_eq!(n, 1, "{at} in the host's table: {host}");
    }
    let mut again = std::process::Command::new("cat");
    again.arg("/proc/self/mountinfo");
    mountns::enter(&mut again, &template, Vec::new(), None).unwrap();
    let table = String::from_utf8_lossy(&again.output().unwrap().stdout).into_owned();
    assert!(
        !table.contains(after.to_str().unwrap()),
        "a carried mount stayed in the template: {table}"
    );
}

/// A container without the static agent (catatonit as its init, commands through `<oci
/// runtime> exec`, no agent filter on itself) is the one case whose seccomp filter comes
/// from the OCI spec: the policy's allowlist and denied set still hold there. The
/// `strata` binary is linked where no static agent lies beside it.
#[test]
fn a_container_without_the_static_agent_keeps_the_policys_seccomp_filter() {
    let Some(env) = env("runtime_no_static_agent") else {
        return;
    };
    let dir = tempfile::tempdir_in(scratch_root()).unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let linked = bin.join("strata");
    if std::fs::hard_link(strata_bin(), &linked).is_err() {
        std::fs::copy(strata_bin(), &linked).unwrap();
    }
    let cli = |args: &[&str]| -> String {
        let out = std::process::Command::new(&linked)
            .args(args)
            .env("STRATA_HOME", &env.cli.home)
            .env("STRATA_STORE", &env.cli.store)
            .env("STRATA_AGENT", strata_bin().with_file_name("strata-agent"))
            .env_remove("STRATA_STATIC_AGENT")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "strata {args:?}: {stdout}{stderr}");
        stdout
    };
    let id = cli(&[
        "sandbox",
        "create",
        "--backend",
        "container",
        &env.reference,
    ])
    .lines()
    .last()
    .unwrap_or_default()
    .trim()
    .to_string();
    let script = "tr '\\0' ' ' < /proc/1/cmdline; echo; grep ^Seccomp /proc/self/status";
    let status = cli(&["sandbox", "exec", &id, "--", "sh", "-c", script]);
    let source = std::fs::read_to_string(syscall_probe()).unwrap();
    let out = cli(&[
        "sandbox", "exec", &id, "--", "python3", "-c", &source, "all",
    ]);
    cli(&["sandbox", "rm", &id]);
    env.cli.assert_sandbox_gone(&id, &[]);
    assert!(
        status.starts_with("/.strata/init"),
        "the init is not catatonit (a static agent was used?): {status}"
    );
    assert!(
        status.contains("Seccomp:\t2") && status.contains("Seccomp_filters:\t1"),
        "one filter, the OCI spec's: {status}"
    );
    // The ioctl refusals are the agent's alone (SECURITY.md says why): not asked for.
    assert_policy_answers("catatonit container", &out, &[("unlisted", "ENOSYS")]);
}
