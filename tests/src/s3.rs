//! A real S3 server for tests: Ceph radosgw on 127.0.0.1, started and stopped through
//! `scripts/s3-server.sh`.

use std::path::PathBuf;
use std::process::Command;

/// A running radosgw; stopped when dropped.
pub struct S3Server {
    dir: tempfile::TempDir,
    pub url: String,
    script: PathBuf,
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/s3-server.sh")
}

impl S3Server {
    /// Starts a server, or returns None (a skip) when radosgw is not installed and
    /// privileged tests are not required.
    pub fn start(test: &str) -> Option<S3Server> {
        if !crate::have_tool(test, "radosgw") {
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("strata-s3-")
            .tempdir()
            .expect("tempdir");
        let port = 7480 + (std::process::id() % 500) as u16;
        let out = Command::new("bash")
            .arg(script())
            .arg("start")
            .arg(dir.path())
            .arg(port.to_string())
            .output()
            .expect("running s3-server.sh");
        let server = S3Server {
            dir,
            url: String::new(),
            script: script(),
        };
        assert!(
            out.status.success(),
            "starting radosgw failed:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut server = server;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Some(rest) = line.strip_prefix("export ") else {
                continue;
            };
            let Some((k, v)) = rest.split_once('=') else {
                continue;
            };
            let v = v.trim_matches('"').trim_matches('\'');
            if k == "STRATA_TEST_S3_URL" {
                server.url = v.to_string();
            } else {
                // SAFETY: set before any other thread of this test reads the environment.
                unsafe { std::env::set_var(k, v) };
            }
        }
        assert!(
            !server.url.is_empty(),
            "s3-server.sh printed no STRATA_TEST_S3_URL"
        );
        Some(server)
    }
}

impl S3Server {
    /// Where radosgw listens.
    pub fn endpoint(&self) -> std::net::SocketAddr {
        self.url
            .split("endpoint=http://")
            .nth(1)
            .and_then(|e| e.split(['&', '/']).next())
            .and_then(|e| e.parse().ok())
            .expect("s3-server.sh printed an http endpoint")
    }

    /// This server's store URL with its endpoint at `addr` instead (a proxy in front).
    pub fn url_through(&self, addr: std::net::SocketAddr) -> String {
        self.url
            .replace(&self.endpoint().to_string(), &addr.to_string())
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(&self.script)
            .arg("stop")
            .arg(self.dir.path())
            .status();
    }
}
