//! A `strata serve` of a test home on free loopback ports (killed with its home's test
//! process), and the Python SDK installed from this checkout in a virtual environment
//! under the scratch root, for tests that drive the service as its users do.

use std::io::Read;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::home::CliHome;
use crate::{scratch_root, strata_bin};

pub fn free_port() -> u16 {
    // The kernel may hand a just-released port out again: one service's API and metrics
    // listeners once got the same one. A port is given out once per test process.
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        if given.insert(port) {
            return port;
        }
    }
}

/// A running node service of one home.
pub struct Service {
    pub home: PathBuf,
    pub store: PathBuf,
    pub addr: String,
    pub metrics: String,
    pub log: PathBuf,
    /// The E2B-compatible API's address, when it is served.
    pub e2b: Option<String>,
    child: Option<Child>,
}

impl Service {
    /// Starts `strata serve` for `home`, with `settings` (strata.toml lines) added to its
    /// own: free ports, the reaper every second.
    pub fn start(home: &CliHome, settings: &str) -> Service {
        let addr = format!("127.0.0.1:{}", free_port());
        let metrics = format!("127.0.0.1:{}", free_port());
        std::fs::write(
            home.home.join("strata.toml"),
            format!("listen = \"{addr}\"\nmetrics_listen = \"{metrics}\"\nreap_every = \"1s\"\n{settings}"),
        )
        .expect("writing the service's strata.toml");
        let mut s = Service {
            home: home.home.clone(),
            store: home.store.clone(),
            log: home.home.join("serve.log"),
            e2b: settings
                .lines()
                .find_map(|l| l.strip_prefix("e2b_listen = "))
                .map(|a| a.trim_matches('"').to_string()),
            addr,
            metrics,
            child: None,
        };
        s.spawn();
        s
    }

    /// [`Service::start`] with the E2B API on a free port too.
    pub fn start_e2b(home: &CliHome, settings: &str) -> Service {
        let e2b = format!("127.0.0.1:{}", free_port());
        Service::start(home, &format!("e2b_listen = \"{e2b}\"\n{settings}"))
    }

    /// The E2B API's base URL (for E2B_API_URL and E2B_SANDBOX_URL).
    pub fn e2b_url(&self) -> String {
        format!(
            "http://{}",
            self.e2b.as_deref().expect("the service serves no E2B API")
        )
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("service log");
        let mut cmd = Command::new(strata_bin());
        cmd.args(["serve", "--node-name", "test"])
            .env("STRATA_HOME", &self.home)
            .env("STRATA_STORE", &self.store)
            .env("STRATA_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log);
        // As a script starts it in the background (`nohup strata serve &`): SIGHUP and
        // SIGINT ignored. The service must still stop on SIGINT ([`Service::interrupt`]),
        // and its sandboxes' commands must not inherit what it ignores.
        // SAFETY: between fork and exec only signal(2), async-signal-safe, is called.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGHUP, libc::SIG_IGN);
                libc::signal(libc::SIGINT, libc::SIG_IGN);
                Ok(())
            });
        }
        self.child = Some(cmd.spawn().expect("starting strata serve"));
        let deadline = Instant::now() + Duration::from_secs(120);
        let wanted: Vec<String> = std::iter::once(self.addr.clone())
            .chain(self.e2b.clone())
            .collect();
        // The line this process prints once its listeners are bound (the log keeps the
        // lines of earlier processes: a port that answers may still be a killed one's,
        // held a moment by a child it forked that has not exec'd yet).
        let served = |s: &Service| s.log_text().matches("` serving on ").count();
        let before = served(self);
        while served(self) <= before {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    panic!("strata serve exited ({status}): {}", self.log_text());
                }
            }
            assert!(
                Instant::now() < deadline,
                "strata serve did not listen in 2 minutes: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // A script goes by that line: from then on a client connects.
        for a in &wanted {
            if let Err(e) = TcpStream::connect(a) {
                panic!(
                    "strata serve said it was serving, but {a} refused a connection: {e}: {}",
                    self.log_text()
                );
            }
        }
    }

    /// SIGINT (Ctrl-C, or a script's `kill -INT`): the service stops within 20 s, exits 0
    /// and says so in its log.
    pub fn interrupt(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        let Some(status) = stop(&mut c, libc::SIGINT) else {
            panic!(
                "strata serve did not stop in 20 s after SIGINT: {}",
                self.log_text()
            );
        };
        assert!(
            status.success() && self.log_text().contains("stopping; sandboxes stay"),
            "strata serve after SIGINT: {status}: {}",
            self.log_text()
        );
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The service's peak resident memory so far (VmHWM), bytes.
    pub fn peak_rss(&self) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb << 10)
            .unwrap_or(0)
    }

    /// SIGKILL, as a crash or an OOM kill would.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// `GET /metrics`.
    pub fn scrape(&self) -> String {
        use std::io::Write;
        let mut s = TcpStream::connect(&self.metrics).expect("metrics listener");
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").expect("metrics request");
        let mut text = String::new();
        s.read_to_string(&mut text).expect("metrics reply");
        text
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            stop(&mut c, libc::SIGTERM);
        }
    }
}

/// Sends `signal` to the service `c` and waits 20 s at most for it to exit; its status,
/// or `None` when it had to be killed.
fn stop(c: &mut Child, signal: libc::c_int) -> Option<std::process::ExitStatus> {
    // SAFETY: signalling a child the caller started and has not reaped.
    unsafe { libc::kill(c.id() as i32, signal) };
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = c.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = c.kill();
    let _ = c.wait();
    None
}

/// A command of an unmodified E2B client, pointed at `url` (both URLs) with `token`.
pub fn e2b_client(program: impl AsRef<std::ffi::OsStr>, url: &str, token: &str) -> Command {
    let mut c = Command::new(program);
    c.env("E2B_API_URL", url)
        .env("E2B_SANDBOX_URL", url)
        .env("E2B_API_KEY", token)
        .env("PYTHONUNBUFFERED", "1");
    c
}

/// The E2B suite's script (`tests/e2b/suite.py`).
pub fn e2b_suite() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("e2b/suite.py")
}

/// The Python of a virtual environment holding this checkout's SDK (`sdk/python`, with
/// its dependencies from PyPI), made once per test process.
pub fn python_sdk() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let venv = scratch_root().join("sdk-venv");
        let lock = std::fs::File::create(scratch_root().join("sdk-venv.lock")).expect("venv lock");
        strata_host::fs::flock(&lock, strata_host::fs::Lock::Exclusive, true)
            .expect("locking the venv");
        let py = make_venv(&venv);
        let sdk = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../sdk/python");
        pip_install(&py, &[sdk.as_os_str()]);
        // Reinstalled from the checkout every time: the SDK under test is this one.
        pip_install(
            &py,
            &[
                std::ffi::OsStr::new("--no-deps"),
                std::ffi::OsStr::new("--force-reinstall"),
                sdk.as_os_str(),
            ],
        );
        py
    })
    .clone()
}

/// The Python of the virtual environment `venv`, made if missing.
fn make_venv(venv: &std::path::Path) -> PathBuf {
    let py = venv.join("bin/python");
    if !py.exists() {
        crate::run_ok(
            Command::new("python3").args(["-m", "venv"]).arg(venv),
            "python3 -m venv",
        );
    }
    py
}

/// `pip install` of `what` (from PyPI or a path) into the environment of `py`.
fn pip_install(py: &std::path::Path, what: &[&std::ffi::OsStr]) {
    crate::run_ok(
        Command::new(py)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(what),
        &format!("pip install {what:?}"),
    );
}

/// The `e2b` Python SDK releases the E2B tests pin: the newest, and an older 2.2x one
/// (POST /sandboxes, and envd calls without the sandbox header after connect).
pub const E2B_PYTHON: [&str; 2] = ["2.63.0", "2.20.0"];
/// The `e2b` npm package the Node test pins.
pub const E2B_NODE: &str = "2.51.0";

/// The Python of a virtual environment holding `e2b==version` from PyPI, unmodified;
/// made once per scratch root.
pub fn e2b_python(version: &str) -> PathBuf {
    let venv = scratch_root().join(format!("e2b-{version}"));
    let lock = std::fs::File::create(scratch_root().join(format!("e2b-{version}.lock")))
        .expect("venv lock");
    strata_host::fs::flock(&lock, strata_host::fs::Lock::Exclusive, true)
        .expect("locking the venv");
    if venv.join(".installed").exists() {
        return venv.join("bin/python");
    }
    let py = make_venv(&venv);
    pip_install(&py, &[std::ffi::OsStr::new(&format!("e2b=={version}"))]);
    std::fs::write(venv.join(".installed"), version).expect("marking the venv");
    py
}

/// A directory with the `e2b` npm package ([`E2B_NODE`]) installed, unmodified.
pub fn e2b_node() -> PathBuf {
    let dir = scratch_root().join(format!("e2b-node-{E2B_NODE}"));
    let lock = std::fs::File::create(scratch_root().join("e2b-node.lock")).expect("npm lock");
    strata_host::fs::flock(&lock, strata_host::fs::Lock::Exclusive, true)
        .expect("locking the npm dir");
    if dir.join(".installed").exists() {
        return dir;
    }
    std::fs::create_dir_all(&dir).expect("npm dir");
    std::fs::write(
        dir.join("package.json"),
        "{\"name\": \"strata-e2b-test\", \"private\": true}\n",
    )
    .expect("package.json");
    crate::run_ok(
        Command::new("npm")
            .args(["install", "--silent", "--no-audit", "--no-fund"])
            .arg(format!("e2b@{E2B_NODE}"))
            .current_dir(&dir),
        &format!("npm install e2b@{E2B_NODE}"),
    );
    std::fs::write(dir.join(".installed"), E2B_NODE).expect("marking the npm dir");
    dir
}

/// Runs a Python `script` against `service` with `token` (STRATA_SERVER, STRATA_TOKEN).
pub fn python(service: &Service, token: &str, script: &str) -> Output {
    Command::new(python_sdk())
        .args(["-c", script])
        .env("STRATA_SERVER", service.url())
        .env("STRATA_TOKEN", token)
        .env("PYTHONUNBUFFERED", "1")
        .output()
        .expect("running python")
}

/// [`python`], asserting it succeeds; its stdout.
pub fn python_ok(service: &Service, token: &str, script: &str) -> String {
    let o = python(service, token, script);
    assert!(
        o.status.success(),
        "python failed:\n{}\n{}\nservice log:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
        service.log_text()
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A real Prometheus (Debian's `prometheus`) scraping one target every second, with its
/// data in a temporary directory; stopped on drop.
pub struct Prometheus {
    child: Child,
    pub addr: String,
    _dir: tempfile::TempDir,
}

fn http_get(addr: &str, path: &str) -> Option<String> {
    use std::io::Write;
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
}

impl Prometheus {
    pub fn start(target: &str) -> Prometheus {
        let dir = tempfile::tempdir_in(scratch_root()).expect("prometheus dir");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: strata\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .expect("prometheus.yml");
        let addr = format!("127.0.0.1:{}", free_port());
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("starting prometheus (apt-get install prometheus; scripts/setup.sh does)");
        let p = Prometheus {
            child,
            addr,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while http_get(&p.addr, "/-/ready").is_none_or(|b| !b.contains("Ready")) {
            assert!(Instant::now() < deadline, "prometheus did not become ready");
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    /// The value of an instant query that has exactly one series, once it has one.
    pub fn query(&self, promql: &str) -> Option<f64> {
        let mut q = String::new();
        for b in promql.bytes() {
            if b.is_ascii_alphanumeric() || b"_-.".contains(&b) {
                q.push(b as char);
            } else {
                q.push_str(&format!("%{b:02X}"));
            }
        }
        let body = http_get(&self.addr, &format!("/api/v1/query?query={q}"))?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        let result = v["data"]["result"].as_array()?;
        match result.as_slice() {
            [one] => one["value"][1].as_str()?.parse().ok(),
            _ => None,
        }
    }

    /// Waits (up to a minute) until `promql` reads `want`.
    pub fn wait_for(&self, promql: &str, want: f64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let got = self.query(promql);
            if got == Some(want) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus: {promql} = {got:?}, want {want}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
