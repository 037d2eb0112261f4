//! The E2B-compatible API end to end: the real `e2b` SDKs from PyPI (two pinned
//! releases) and npm (pinned), unmodified, against a `strata serve --e2b-listen` started
//! here, configured only by E2B_API_URL / E2B_SANDBOX_URL and E2B_API_KEY (a project
//! token), as a user switching from E2B would. The Python scenarios are in
//! `tests/e2b/suite.py`; each asserts what the real sandbox did.

use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

use strata_tests::home::{
    can_hibernate_containers, can_run_sandboxes, can_run_vms, CliHome, SampleEnv,
};
use strata_tests::service::{e2b_client, e2b_node, e2b_python, e2b_suite, Service, E2B_PYTHON};
use strata_tests::{have_tool, mounts_under, HostServer};

static ENV: OnceLock<Option<SampleEnv>> = OnceLock::new();

fn env(test: &str) -> Option<&'static SampleEnv> {
    if !can_run_sandboxes(test) {
        return None;
    }
    ENV.get_or_init(|| Some(SampleEnv::new("e2b-"))).as_ref()
}

/// A service on a fresh home of the shared store, its E2B API on, and a project token.
fn service(
    env: &SampleEnv,
    prefix: &str,
    project_flags: &[&str],
    settings: &str,
) -> (CliHome, Service, String) {
    let home = env.cli.sharing_store(prefix);
    let project = format!("{}{}", prefix.trim_end_matches('-'), std::process::id());
    let mut args = vec!["project", "create", project.as_str()];
    args.extend_from_slice(project_flags);
    home.ok(&args);
    let out = home.ok(&["token", "create", "--project", &project]);
    let token = out.lines().last().unwrap_or_default().trim().to_string();
    assert!(token.starts_with("strata_"), "{out}");
    let svc = Service::start_e2b(&home, settings);
    (home, svc, token)
}

/// Asserts a client run succeeded, showing its output and the service's log if not.
fn assert_client_ok(o: &std::process::Output, what: &str, svc: &Service) {
    assert!(
        o.status.success(),
        "{what} failed:\n{}\n{}\nservice log (tail):\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
        tail(&svc.log_text())
    );
}

/// `HOST:PORT` of a server on the host's own address that every sandbox's network
/// update test reaches (or must not), started once for the whole binary.
fn host_probe() -> &'static str {
    static PROBE: OnceLock<(HostServer, String)> = OnceLock::new();
    &PROBE
        .get_or_init(|| {
            let ip = strata_tests::sh(
                "ip -4 -o addr show scope global | awk '{print $4}' | cut -d/ -f1 | head -1",
            );
            let server = HostServer::start();
            let dest = format!("{}:{}", ip.trim(), server.port);
            (server, dest)
        })
        .1
}

/// Runs a scenario of the suite with one SDK release; panics with its output and the
/// service's log when it fails.
fn run_suite(
    svc: &Service,
    token: &str,
    version: &str,
    scenario: &str,
    backend: &str,
    template: &str,
) {
    let t = Instant::now();
    let o = e2b_client(e2b_python(version), &svc.e2b_url(), token)
        .env("HOST_PROBE", host_probe())
        .arg(e2b_suite())
        .args([scenario, backend, template])
        .output()
        .expect("running the e2b suite");
    assert_client_ok(&o, &format!("e2b {version} {scenario} on {backend}"), svc);
    eprintln!(
        "e2b {version} {scenario} on {backend}: ok in {:.1?}\n{}",
        t.elapsed(),
        String::from_utf8_lossy(&o.stdout).trim_end()
    );
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(60)..].join("\n")
}

/// Nothing of the home's sandboxes is left: no record, mount or cgroup.
fn assert_nothing_left(home: &CliHome) {
    let left = strata_tests::home::sandboxes_in(&home.home);
    assert!(left.is_empty(), "sandboxes left: {left:?}");
    let mounts: Vec<_> = mounts_under(&home.runtime_dir().join("sandboxes"));
    assert!(mounts.is_empty(), "mounts left: {mounts:?}");
}

#[test]
fn e2b_python_sdks_drive_container_and_fncall_sandboxes() {
    // Threat model: "clients with a token" (SECURITY.md): the E2B key is a project token.
    let Some(env) = env("e2b_python_sdks") else {
        return;
    };
    let (home, svc, token) = service(env, "e2b-full-", &[], "");
    for version in E2B_PYTHON {
        for backend in ["container", "fncall"] {
            run_suite(&svc, &token, version, "full", backend, &env.reference);
        }
    }
    run_suite(
        &svc,
        &token,
        E2B_PYTHON[0],
        "proxy",
        "container",
        &env.reference,
    );
    // A container's and a fncall sandbox's forks and a container's store snapshots (as
    // templates, with both SDK generations) carry its processes (CRIU) and files.
    if strata_tests::home::can_hibernate_containers("e2b_python_sdks") {
        for backend in ["container", "fncall"] {
            run_suite(&svc, &token, E2B_PYTHON[0], "fork", backend, &env.reference);
        }
        for version in E2B_PYTHON {
            run_suite(
                &svc,
                &token,
                version,
                "snapshot",
                "container",
                &env.reference,
            );
        }
    }
    assert_nothing_left(&home);
}

#[test]
fn e2b_pause_and_connect_twenty_times_keeps_files_and_processes() {
    let Some(env) = env("e2b_pause_rounds") else {
        return;
    };
    let (home, svc, token) = service(env, "e2b-pause-", &[], "");
    for version in E2B_PYTHON {
        run_suite(&svc, &token, version, "pause", "container", &env.reference);
    }
    assert_nothing_left(&home);
}

/// SECURITY.md, "the node service" (what a sandbox sends back crosses in bounded pieces
/// with back-pressure): 512 MiB of `yes` through the E2B API reaches the SDK whole, in
/// pieces as it is printed, while the service's resident memory grows by less than 128 MiB
/// and its log by less than 64 KiB.
#[test]
fn e2b_endless_output_streams_through_bounded_memory() {
    let Some(env) = env("e2b_flood") else {
        return;
    };
    let (home, svc, token) = service(env, "e2b-flood-", &[], "");
    let (rss, log) = (svc.peak_rss(), svc.log_text().len());
    run_suite(
        &svc,
        &token,
        E2B_PYTHON[0],
        "flood",
        "container",
        &env.reference,
    );
    let grown = svc.peak_rss().saturating_sub(rss);
    assert!(grown < 128 << 20, "the service grew by {} MiB", grown >> 20);
    let logged = svc.log_text().len().saturating_sub(log);
    assert!(logged < 64 << 10, "the service logged {logged} bytes");
    assert_nothing_left(&home);
}

#[test]
fn e2b_burst_of_32_async_creates_runs_the_tests_and_leaves_nothing() {
    let Some(env) = env("e2b_burst") else {
        return;
    };
    // 32 sandboxes of one CPU each live at once on a 2-core machine: admission at the
    // default overcommit (4) would answer the later creates with 429, as it should.
    let (home, svc, token) = service(env, "e2b-burst-", &[], "cpu_overcommit = 16.0\n");
    run_suite(
        &svc,
        &token,
        E2B_PYTHON[0],
        "burst",
        "container",
        &env.reference,
    );
    assert_nothing_left(&home);
}

#[test]
fn e2b_python_sdk_drives_microvm_and_vm_sandboxes() {
    let Some(env) = env("e2b_vms") else {
        return;
    };
    if !can_run_vms("e2b_vms") {
        return;
    }
    let (home, svc, token) = service(env, "e2b-vm-", &[], "");
    for backend in ["microvm", "vm"] {
        run_suite(
            &svc,
            &token,
            E2B_PYTHON[0],
            "short",
            backend,
            &env.reference,
        );
    }
    // A microVM's or a container's pause with nothing streaming is a hibernation (a
    // machine's memory image or a CRIU checkpoint on disk, nothing running); connect wakes
    // it where it was. Its audit says so.
    for backend in ["microvm", "container"] {
        if backend == "container" && !can_hibernate_containers("e2b_vms") {
            continue;
        }
        let o = e2b_client(e2b_python(E2B_PYTHON[0]), &svc.e2b_url(), &token)
            .arg(e2b_suite())
            .args(["hibernate", backend, &env.reference])
            .output()
            .expect("running the e2b suite");
        assert_client_ok(&o, &format!("e2b hibernate on {backend}"), &svc);
        let out = String::from_utf8_lossy(&o.stdout);
        let id = out
            .split_whitespace()
            .skip_while(|w| *w != "sandbox")
            .nth(1)
            .map(|w| w.trim_end_matches(':').to_string())
            .unwrap_or_else(|| panic!("no sandbox ID in {out}"));
        let local = id.rsplit('-').next().unwrap_or_default();
        let audit = std::fs::read_to_string(
            home.runtime_dir()
                .join("audit")
                .join(format!("{local}.jsonl")),
        )
        .unwrap_or_else(|e| panic!("the audit of {id}: {e}"));
        let events = |e: &str| audit.matches(&format!("\"event\":\"{e}\"")).count();
        assert_eq!(
            (events("hibernated"), events("woken")),
            (5, 5),
            "{backend}: {audit}"
        );
    }
    // fork(count=4): children continue the parent's detached process, each its own.
    run_suite(
        &svc,
        &token,
        E2B_PYTHON[0],
        "fork",
        "microvm",
        &env.reference,
    );
    // create_snapshot of a microVM: sandboxes from it continue its process.
    run_suite(
        &svc,
        &token,
        E2B_PYTHON[0],
        "snapshot",
        "microvm",
        &env.reference,
    );
    // A server inside a guest, reached through the agent's relay.
    run_suite(
        &svc,
        &token,
        E2B_PYTHON[0],
        "proxy",
        "microvm",
        &env.reference,
    );
    assert_nothing_left(&home);
}

#[test]
fn e2b_node_sdk_creates_runs_writes_reads_and_kills() {
    let Some(env) = env("e2b_node") else {
        return;
    };
    if !have_tool("e2b_node", "npm") {
        return;
    }
    let (home, svc, token) = service(env, "e2b-node-", &[], "");
    let dir = e2b_node();
    let script = r#"
const { Sandbox, CommandExitError } = require('e2b');
(async () => {
  const sb = await Sandbox.create(process.env.TEMPLATE, {
    envs: { GREETING: 'hi from node' }, metadata: { 'strata.backend': 'container' },
    allowInternetAccess: false,
  });
  const chunks = [];
  const r = await sb.commands.run('echo $GREETING; echo err >&2', { onStdout: (d) => chunks.push(d) });
  if (r.stdout !== 'hi from node\n' || r.stderr !== 'err\n' || chunks.join('') !== r.stdout)
    throw new Error('run: ' + JSON.stringify(r));
  let failed = false;
  try { await sb.commands.run('exit 4'); } catch (e) { failed = e instanceof CommandExitError && e.exitCode === 4; }
  if (!failed) throw new Error('exit 4 did not raise CommandExitError');
  await sb.files.write('/tmp/node.txt', 'written by node');
  const back = await sb.files.read('/tmp/node.txt');
  if (back !== 'written by node') throw new Error('read back ' + back);
  const inside = await sb.commands.run('cat /tmp/node.txt');
  if (inside.stdout !== 'written by node') throw new Error('inside: ' + inside.stdout);
  if (!(await sb.kill()) && (await sb.isRunning())) throw new Error('kill');
  if (await sb.isRunning()) throw new Error('still running after kill');
  console.log('node ok');
})().catch((e) => { console.error(e); process.exit(1); });
"#;
    let o = e2b_client("node", &svc.e2b_url(), &token)
        .args(["-e", script])
        .current_dir(&dir)
        .env("TEMPLATE", &env.reference)
        .output()
        .expect("running node");
    assert_client_ok(&o, "the Node SDK", &svc);
    assert!(String::from_utf8_lossy(&o.stdout).contains("node ok"));
    assert_nothing_left(&home);
}

#[test]
fn e2b_api_refuses_open_internet_unless_the_project_allows_it_and_routes_by_host() {
    let Some(env) = env("e2b_policy") else {
        return;
    };
    let (_home, svc, token) = service(env, "e2b-policy-", &[], "e2b_domain = \"strata.test\"\n");
    // The older SDK sends allow_internet_access=True unless told: refused, naming the fix.
    let script = r#"
import os, sys
from e2b import Sandbox, SandboxException
try:
    Sandbox.create(sys.argv[1], metadata={"strata.backend": "container"})
    raise SystemExit("open internet was granted")
except SandboxException as e:
    assert "allow_internet_access" in str(e) and "--allow-internet" in str(e), e
# Host names route like E2B's proxy: <port>-<id>.<domain> reaches envd of that sandbox.
import http.client
sb = Sandbox.create(sys.argv[1], metadata={"strata.backend": "container"}, allow_internet_access=False)
c = http.client.HTTPConnection(os.environ["E2B_HOST"])
c.request("GET", "/health", headers={"Host": f"49983-{sb.sandbox_id}.strata.test",
                                      "X-Access-Token": sb._envd_access_token})
r = c.getresponse()
assert r.status == 204, (r.status, r.read())
r.read()
c.request("GET", "/health", headers={"Host": f"49983-{sb.sandbox_id}.strata.test", "X-Access-Token": "wrong"})
r = c.getresponse()
assert r.status == 401, (r.status, r.read())
r.read()
sb.kill()
print("policy ok")
"#;
    let e2b_addr = svc.e2b.clone().unwrap_or_default();
    let o = e2b_client(e2b_python(E2B_PYTHON[1]), &svc.e2b_url(), &token)
        .args(["-c", script, &env.reference])
        .env("E2B_HOST", &e2b_addr)
        .output()
        .expect("running python");
    assert_client_ok(&o, "the policy and routing checks", &svc);
}

#[test]
fn e2b_api_serves_tls_with_a_given_certificate() {
    let Some(env) = env("e2b_tls") else {
        return;
    };
    if !have_tool("e2b_tls", "openssl") {
        return;
    }
    let home = env.cli.sharing_store("e2b-tls-");
    let dir = home.home.join("tls");
    std::fs::create_dir_all(&dir).expect("tls dir");
    // A private CA and a leaf for 127.0.0.1 (the SDK refuses a CA used as the leaf).
    let sh = r#"set -e
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=strata-test-ca 2>/dev/null
openssl req -newkey rsa:2048 -nodes -keyout leaf.key -out leaf.csr -subj /CN=127.0.0.1 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n' > ext
openssl x509 -req -in leaf.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out leaf.pem -days 2 -extfile ext 2>/dev/null
"#;
    let o = Command::new("bash")
        .args(["-c", sh])
        .current_dir(&dir)
        .output()
        .expect("openssl");
    assert!(
        o.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let project = format!("e2btls{}", std::process::id());
    home.ok(&["project", "create", &project]);
    let token = home.ok(&["token", "create", "--project", &project]);
    let token = token.lines().last().unwrap_or_default().trim().to_string();
    let svc = Service::start_e2b(
        &home,
        &format!(
            "e2b_tls_cert = \"{}\"\ne2b_tls_key = \"{}\"\n",
            dir.join("leaf.pem").display(),
            dir.join("leaf.key").display()
        ),
    );
    let url = svc.e2b_url().replace("http://", "https://");
    let script = r#"
import sys
from e2b import Sandbox
sb = Sandbox.create(sys.argv[1], metadata={"strata.backend": "container"}, allow_internet_access=False)
assert sb.commands.run("echo over tls").stdout == "over tls\n"
sb.files.write("/tmp/t.txt", "tls file")
assert sb.files.read("/tmp/t.txt") == "tls file"
assert sb.kill()
print("tls ok")
"#;
    let o = e2b_client(e2b_python(E2B_PYTHON[0]), &url, &token)
        .args(["-c", script, &env.reference])
        .env("SSL_CERT_FILE", dir.join("ca.pem"))
        .output()
        .expect("running python");
    assert_client_ok(&o, "the E2B SDK over TLS", &svc);
}

/// Reads one HTTP/1.1 response (headers and a `content-length` body) from `s`: its status
/// line.
fn read_response(s: &mut std::net::TcpStream) -> String {
    use std::io::Read;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_string();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            while got.len() < end + 4 + len {
                let n = s.read(&mut buf).expect("the response's body");
                assert!(n > 0, "the connection closed inside a response: {head}");
                got.extend_from_slice(&buf[..n]);
            }
            return head.lines().next().unwrap_or_default().to_string();
        }
        let n = s.read(&mut buf).expect("a response");
        assert!(n > 0, "the connection closed before a response");
        got.extend_from_slice(&buf[..n]);
    }
}

/// The control plane answers only once it has read the whole request, so the connection
/// stays open for the client's next call. Answering a connect to an unknown sandbox
/// before its body arrived made hyper close the connection after the answer, and the
/// e2b SDK's next call, sent on it at once, failed with "Server disconnected without
/// sending a response" (CI, e2b 2.20.0).
#[test]
fn the_api_answers_after_the_whole_request_and_keeps_the_connection() {
    use std::io::{Read, Write};
    let Some(env) = env("e2b_keepalive") else {
        return;
    };
    let (_home, svc, token) = service(env, "e2b-keepalive-", &[], "");
    let addr = svc.e2b_url().trim_start_matches("http://").to_string();
    let mut s = std::net::TcpStream::connect(&addr).expect("the E2B API");
    let body = br#"{"timeout":5}"#;
    write!(
        s,
        "POST /sandboxes/test-000000000000/connect HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .expect("the request's head");
    // The body is not there yet: no answer.
    s.set_read_timeout(Some(std::time::Duration::from_millis(500)))
        .expect("read timeout");
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) => {}
        other => panic!(
            "answered before the request's body arrived: {other:?} {:?}",
            String::from_utf8_lossy(&buf)
        ),
    }
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .expect("read timeout");
    s.write_all(body).expect("the request's body");
    let status = read_response(&mut s);
    assert!(status.starts_with("HTTP/1.1 404"), "{status}");
    // The same connection serves the next call.
    write!(
        s,
        "GET /sandboxes HTTP/1.1\r\nHost: {addr}\r\nX-API-Key: {token}\r\n\r\n"
    )
    .expect("the next request");
    let status = read_response(&mut s);
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
}
