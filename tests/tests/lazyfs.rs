//! lazyfs end to end: layers mounted through the FUSE blob server and the kernel's EROFS,
//! read back exactly, metadata-only walks fetch nothing, a store outage fails reads with
//! EIO within the bound and heals, a SIGKILLed daemon leaves nothing that hangs, the
//! first run's access order becomes a prefetch list (and its chunks a packed copy a new
//! host's first mount fetches), and the control socket is root's
//! alone and only undoes the daemon's own binds; and the same reads, corruption and outage
//! against radosgw through a proxy adding latency.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use strata_builder::{LayerKind, Source};
use strata_tests::treecmp::{assert_same_tree, Ignore};
use strata_tests::*;

/// A `strata lazyfs serve` process with its own STRATA_HOME.
struct Daemon {
    home: PathBuf,
    store: String,
    child: Option<Child>,
}

impl Daemon {
    fn start(home: &Path, store: &str, fetch_timeout: &str) -> Daemon {
        let mut d = Daemon {
            home: home.to_path_buf(),
            store: store.to_string(),
            child: None,
        };
        d.spawn(fetch_timeout);
        d
    }

    fn spawn(&mut self, fetch_timeout: &str) {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let log = std::fs::File::create(self.home.join(format!("daemon-{stamp}.log"))).unwrap();
        let child = Command::new(strata_bin())
            .env("STRATA_HOME", &self.home)
            .env("STRATA_LOG", "info")
            .args([
                "--store",
                &self.store,
                "lazyfs",
                "serve",
                "--fetch-timeout",
                fetch_timeout,
                "--cache-max",
                "1G",
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let sock = self.home.join("lazyfs/run/control.sock");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(sock.exists() && self.cli(&["cache", "stats"]).status.success()) {
            assert!(Instant::now() < deadline, "daemon did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(strata_bin())
            .env("STRATA_HOME", &self.home)
            .arg("--store")
            .arg(&self.store)
            .args(args)
            .output()
            .unwrap()
    }

    fn stats(&self, id: &str) -> serde_json::Value {
        let o = self.cli(&["layer", "stats", id, "--json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.cli(&["lazyfs", "stop"]);
            if let Some(mut c) = self.child.take() {
                let deadline = Instant::now() + Duration::from_secs(10);
                while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn fixture(rt: &tokio::runtime::Runtime, work: &Path) -> (PathBuf, String, String) {
    let src = work.join("src");
    fixtures::full_tree(&src, true);
    fixtures::workspace_tree(&src.join("ws"), 400, 9);
    let store_dir = work.join("store");
    let store =
        strata_store::Store::open(&strata_store::StoreUrl::Local(store_dir.clone())).unwrap();
    let r = build(rt, &store, Source::Dir(src.clone()), LayerKind::Base).unwrap();
    (src, store_dir.to_str().unwrap().to_string(), r.id.to_hex())
}

/// Every file of the mounted layer at `mnt` equals the source's (the mount point's own
/// metadata aside).
fn assert_served_exactly(src: &Path, mnt: &Path) {
    assert_same_tree(
        src,
        mnt,
        Ignore {
            root_meta: true,
            ..Default::default()
        },
    );
}

/// The fixture layer, a daemon for it, and the layer mounted at `<work>/mnt`.
fn mounted(
    rt: &tokio::runtime::Runtime,
    work: &Path,
    fetch_timeout: &str,
) -> (PathBuf, String, Daemon, PathBuf) {
    let (src, store, id) = fixture(rt, work);
    let home = work.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let daemon = Daemon::start(&home, &store, fetch_timeout);
    let mnt = work.join("mnt");
    let o = daemon.cli(&["layer", "mount", &id, mnt.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (src, id, daemon, mnt)
}

#[test]
fn lazily_mounted_layer_reads_exactly_and_walks_fetch_nothing() {
    if !have_root("lazyfs_reads") || !have_fuse("lazyfs_reads") {
        return;
    }
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let (src, id, daemon, mnt) = mounted(&rt, work.path(), "5s");
    let home = work.path().join("home");
    let store = daemon.store.clone();

    // A metadata-only walk (ls -lR) reads the local metadata image only.
    sh(&format!("ls -lR '{}' > /dev/null", mnt.display()));
    let s = daemon.stats(&id);
    assert_eq!(s["fetched_bytes"], 0, "ls -lR fetched blob data: {s}");
    assert_eq!(s["requested_bytes"], 0, "{s}");

    // Every byte, through the kernel, equals the source.
    assert_served_exactly(&src, &mnt);
    let s = daemon.stats(&id);
    assert!(
        s["fetched_bytes"].as_u64().unwrap() > 0 && s["cache_misses"].as_u64().unwrap() > 0,
        "{s}"
    );

    let o = daemon.cli(&["layer", "umount", mnt.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(mounts_under(&mnt).is_empty());

    // The first run's access order was saved; a second mount prefetches it.
    assert!(
        Path::new(&store)
            .join(format!("layers/{id}.prefetch.json"))
            .exists(),
        "no prefetch list saved"
    );
    drop(daemon);
    assert!(
        mounts_under(&home).is_empty(),
        "daemon stop left mounts: {:?}",
        mounts_under(&home)
    );

    // The chunks it read were packed in that order too: a new host's first mount fetches
    // them from the packed copy, and every byte reads back exactly.
    assert!(
        Path::new(&store)
            .join(format!("layers/{id}.prefetch.pack"))
            .exists(),
        "no packed prefetch copy saved"
    );
    let home = work.path().join("home2");
    std::fs::create_dir_all(&home).unwrap();
    let daemon = Daemon::start(&home, &store, "5s");
    let mnt = work.path().join("mnt2");
    let o = daemon.cli(&["layer", "mount", &id, mnt.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let deadline = Instant::now() + Duration::from_secs(10);
    while daemon.stats(&id)["prefetched_chunks"].as_u64().unwrap_or(0) == 0 {
        assert!(Instant::now() < deadline, "nothing prefetched");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_served_exactly(&src, &mnt);
    assert!(daemon
        .cli(&["layer", "umount", mnt.to_str().unwrap()])
        .status
        .success());
}

#[test]
fn store_outage_fails_uncached_reads_within_the_bound_and_heals() {
    if !have_root("lazyfs_outage") || !have_fuse("lazyfs_outage") {
        return;
    }
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let (src, _id, daemon, mnt) = mounted(&rt, work.path(), "3s");
    let store = daemon.store.clone();
    // Warm one file.
    let cached = std::fs::read(mnt.join("ten-k")).unwrap();
    assert_eq!(cached, std::fs::read(src.join("ten-k")).unwrap());

    // "Stop" the store: its directory disappears.
    let moved = PathBuf::from(format!("{store}.away"));
    std::fs::rename(&store, &moved).unwrap();
    let t = Instant::now();
    let err = std::fs::read(mnt.join("big/three-mib")).unwrap_err();
    let took = t.elapsed();
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(20),
        "EIO after {took:?}"
    );
    assert_eq!(
        std::fs::read(mnt.join("ten-k")).unwrap(),
        cached,
        "cached data must keep working"
    );

    // The store comes back: the same read works, without remounting.
    std::fs::rename(&moved, &store).unwrap();
    assert_eq!(
        std::fs::read(mnt.join("big/three-mib")).unwrap(),
        std::fs::read(src.join("big/three-mib")).unwrap()
    );
    assert!(daemon
        .cli(&["layer", "umount", mnt.to_str().unwrap()])
        .status
        .success());
}

#[test]
fn a_killed_daemon_leaves_nothing_that_hangs_and_a_new_one_serves_again() {
    if !have_root("lazyfs_sigkill") || !have_fuse("lazyfs_sigkill") {
        return;
    }
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let (src, id, mut daemon, mnt) = mounted(&rt, work.path(), "3s");
    let home = work.path().join("home");
    // Every file read once, so every chunk was served and goes to the disk cache (written
    // in the background: wait until the cache stops growing).
    assert_served_exactly(&src, &mnt);
    let cached = || -> u64 {
        let o = daemon.cli(&["cache", "stats", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["bytes"].as_u64().unwrap()
    };
    let mut last = u64::MAX;
    let deadline = Instant::now() + Duration::from_secs(20);
    while cached() != last && Instant::now() < deadline {
        last = cached();
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(
        last > 3 << 20,
        "the read chunks reached the disk cache: {last}"
    );

    // A second client whose bind ends while no daemon runs (a sandbox torn down then).
    let gone = work.path().join("gone");
    assert!(daemon
        .cli(&["layer", "mount", &id, gone.to_str().unwrap()])
        .status
        .success());
    daemon.kill9();
    sh(&format!(
        "umount -l '{}' && rmdir '{}'",
        gone.display(),
        gone.display()
    ));
    // Nothing hangs: listing works (metadata is local) and data reads fail fast.
    let t = Instant::now();
    let out = Command::new("timeout")
        .args(["10", "ls", "-lR"])
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(
        out.status.code() != Some(124),
        "ls hung on a dead daemon's mount"
    );
    let _ = Command::new("timeout")
        .args(["10", "cat"])
        .arg(mnt.join("big/three-mib"))
        .output()
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(15));

    // A new daemon reaps the dead mounts and restores the layer at the same place, and
    // serves what the dead one cached from its disk (re-verified), fetching nothing.
    daemon.spawn("3s");
    assert_served_exactly(&src, &mnt);
    // The bind whose client went is not restored: its directory is not made again.
    assert!(
        !gone.exists(),
        "a restarted daemon made {} again",
        gone.display()
    );
    let s = daemon.stats(&id);
    assert_eq!(
        s["fetched_bytes"].as_u64(),
        Some(0),
        "a restarted daemon reuses its disk cache: {s}"
    );
    assert!(s["cache_hits"].as_u64().unwrap() > 0, "{s}");
    let fuse_mounts: Vec<_> = mounts_under(&home.join("lazyfs/fuse"));
    assert_eq!(
        fuse_mounts.len(),
        1,
        "one FUSE mount, not a stale one beside it: {fuse_mounts:?}"
    );
    assert!(daemon
        .cli(&["layer", "umount", mnt.to_str().unwrap()])
        .status
        .success());
    drop(daemon);
    assert!(mounts_under(&home).is_empty() && mounts_under(&mnt).is_empty());
}

/// A tmpfs the test mounts itself, with a file of its own in it.
fn own_tmpfs(dir: &Path) -> strata_tests::OwnMount {
    let own = strata_tests::OwnMount::new("-t tmpfs -o size=1m strata-test-own", dir);
    std::fs::write(dir.join("marker"), b"mine").unwrap();
    own
}

/// The file system type of the topmost mount exactly at `dir`, if any.
fn top_mount(dir: &Path) -> Option<String> {
    let dir = dir.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .rev()
        .filter(|l| l.split(' ').nth(4) == Some(dir.as_str()))
        .find_map(|l| Some(l.split_once(" - ")?.1.split(' ').next()?.to_string()))
}

#[test]
fn the_socket_is_roots_alone_and_umount_undoes_only_the_daemons_binds() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !have_root("lazyfs_umount_guard") || !have_fuse("lazyfs_umount_guard") {
        return;
    }
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let (_src, store, id) = fixture(&rt, work.path());
    let home = work.path().join("home");
    // A run directory left world-writable (by hand, an old build) is narrowed at start.
    let run = home.join("lazyfs/run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o777)).unwrap();
    let daemon = Daemon::start(&home, &store, "5s");
    let meta = std::fs::symlink_metadata(&run).unwrap();
    assert!(meta.is_dir());
    assert_eq!(
        meta.mode() & 0o7777,
        0o700,
        "run/ mode {:o}",
        meta.mode() & 0o7777
    );
    assert_eq!(meta.uid(), 0, "run/ is root's");
    let sock = std::fs::symlink_metadata(run.join("control.sock")).unwrap();
    assert_eq!(sock.mode() & 0o777, 0o600);

    let mnt = work.path().join("mnt");
    let o = daemon.cli(&["layer", "mount", &id, mnt.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(top_mount(&mnt).as_deref(), Some("erofs"));

    // A mount of our own, never bound by the daemon: refused, named, left alone.
    let own = own_tmpfs(&work.path().join("own"));
    for shown in [own.0.clone(), own.0.join(".")] {
        let o = daemon.cli(&["layer", "umount", shown.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "umount of a foreign mount succeeded");
        assert!(
            err.contains(&format!("{} is not a lazyfs bind", own.0.display())),
            "{err}"
        );
    }
    assert_eq!(top_mount(&own.0).as_deref(), Some("tmpfs"), "still mounted");
    assert_eq!(std::fs::read(own.0.join("marker")).unwrap(), b"mine");
    // Nor a directory inside one of its binds.
    let o = daemon.cli(&["layer", "umount", mnt.join("big").to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("is not a lazyfs bind"));

    // Something mounted over the daemon's bind is not the bind: refused, left alone.
    let over = own_tmpfs(&mnt);
    let o = daemon.cli(&["layer", "umount", mnt.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "umount took the tmpfs over the bind");
    assert!(
        err.contains("tmpfs mount") && err.contains("unmount it first"),
        "{err}"
    );
    assert_eq!(top_mount(&mnt).as_deref(), Some("tmpfs"));
    drop(over);
    assert_eq!(top_mount(&mnt).as_deref(), Some("erofs"));

    // The daemon's own bind still goes, once; then it is no bind of the daemon's.
    let o = daemon.cli(&["layer", "umount", mnt.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(top_mount(&mnt), None);
    let o = daemon.cli(&["layer", "umount", mnt.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("is not a lazyfs bind"));

    drop(daemon);
    assert_eq!(
        top_mount(&own.0).as_deref(),
        Some("tmpfs"),
        "stop left it too"
    );
    drop(own);
    assert!(mounts_under(&home).is_empty() && mounts_under(work.path()).is_empty());
}

#[test]
fn a_workspace_test_suite_on_lazy_layers_reads_a_small_fraction() {
    if !have_root("lazyfs_fraction")
        || !have_fuse("lazyfs_fraction")
        || !have_tool("lazyfs_fraction", "mmdebstrap")
    {
        return;
    }
    let rt = runtime();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let tar = sh(&format!(
        "bash '{}'",
        repo.join("datasets/base/make-rootfs.sh").display()
    ));
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let store_dir = work.path().join("store");
    let store =
        strata_store::Store::open(&strata_store::StoreUrl::Local(store_dir.clone())).unwrap();
    let base = build(
        &rt,
        &store,
        Source::Tar(PathBuf::from(tar.trim())),
        LayerKind::Base,
    )
    .unwrap();
    let req =
        strata_builder::BuildRequest::from_definition(&repo.join("datasets/sample/workspace.toml"))
            .unwrap();
    let ws = rt
        .block_on(strata_builder::build(&store, &req, None))
        .unwrap();

    let home = work.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let daemon = Daemon::start(&home, store_dir.to_str().unwrap(), "10s");
    let (base_mnt, ws_mnt) = (work.path().join("base"), work.path().join("ws"));
    for (id, dir) in [(base.id.to_hex(), &base_mnt), (ws.id.to_hex(), &ws_mnt)] {
        let o = daemon.cli(&["layer", "mount", &id, dir.to_str().unwrap()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let merged = work.path().join("merged");
    let (upper, wd) = (work.path().join("upper"), work.path().join("wd"));
    for d in [&merged, &upper, &wd] {
        std::fs::create_dir_all(d).unwrap();
    }
    sh(&format!(
        "mount -t overlay overlay -o lowerdir='{}:{}',upperdir='{}',workdir='{}' '{}'",
        ws_mnt.display(),
        base_mnt.display(),
        upper.display(),
        wd.display(),
        merged.display()
    ));
    let out = Command::new("chroot")
        .arg(&merged)
        .args([
            "/bin/sh",
            "-c",
            "cd /work && python3 -m unittest discover -s tests 2>&1",
        ])
        .output()
        .unwrap();
    let _ = Command::new("umount").arg(&merged).status();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("OK"),
        "workspace tests failed:\n{text}"
    );

    let (sb, sw) = (
        daemon.stats(&base.id.to_hex()),
        daemon.stats(&ws.id.to_hex()),
    );
    let fetched = sb["fetched_bytes"].as_u64().unwrap() + sw["fetched_bytes"].as_u64().unwrap();
    let total = base.blob_bytes + ws.blob_bytes;
    let fraction = fetched as f64 / total as f64;
    eprintln!(
        "workspace test suite fetched {fetched} of {total} data bytes ({:.1}%) of base + workspace",
        fraction * 100.0
    );
    assert!(
        fraction <= 0.25,
        "fetched {:.1}% of the layers",
        fraction * 100.0
    );
    for dir in [&base_mnt, &ws_mnt] {
        assert!(daemon
            .cli(&["layer", "umount", dir.to_str().unwrap()])
            .status
            .success());
    }
}

/// A daemon the CLI starts on demand that dies at start is reported at once, with the
/// reason from its log (here: a cache on tmpfs, refused), instead of after the full wait.
#[test]
fn a_daemon_that_dies_as_it_starts_is_reported_with_its_reason() {
    if !have_root("lazyfs_dies_at_start") || !have_fuse("lazyfs_dies_at_start") {
        return;
    }
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        assert!(
            !privileged_required(),
            "no /dev/shm (tmpfs) to put a home on"
        );
        eprintln!("SKIP lazyfs_dies_at_start: no /dev/shm");
        return;
    }
    let home = tempfile::tempdir_in(shm).unwrap();
    let store = tempfile::tempdir_in(scratch_root()).unwrap();
    let target = tempfile::tempdir_in(scratch_root()).unwrap();
    let o = Command::new(strata_bin())
        .env("STRATA_HOME", home.path())
        .args(["--store", store.path().to_str().unwrap(), "layer", "mount"])
        .arg("ab".repeat(32))
        .arg(target.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "mounted with a cache on tmpfs");
    assert!(err.contains("exited as it started"), "{err}");
    assert!(err.contains("on tmpfs"), "the daemon's own reason: {err}");
}

/// The lazy path against a real S3 store (radosgw) behind the latency-injecting proxy at
/// 2 ms added round-trip time: every byte read back exactly, a corrupt response detected
/// and fetched again, a truncated body and a reset connection fetched again, a partition
/// and an outage each failing uncached reads within the bound and healing.
#[test]
fn over_radosgw_with_added_latency_reads_exactly_survives_corruption_truncation_resets_and_an_outage(
) {
    use strata_tests::proxy::{LatencyProxy, Link};
    if !have_root("lazyfs_s3") || !have_fuse("lazyfs_s3") {
        return;
    }
    let Some(server) = strata_tests::s3::S3Server::start("lazyfs_s3") else {
        return;
    };
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("src");
    fixtures::full_tree(&src, true);
    fixtures::workspace_tree(&src.join("ws"), 400, 9);
    let direct =
        strata_store::Store::open(&strata_store::StoreUrl::parse(&server.url).unwrap()).unwrap();
    let id = build(&rt, &direct, Source::Dir(src.clone()), LayerKind::Base)
        .unwrap()
        .id
        .to_hex();
    // A second layer, read first during the outage: nothing of it is cached by then.
    let other_src = work.path().join("other");
    fixtures::workspace_tree(&other_src, 50, 31);
    let other = build(
        &rt,
        &direct,
        Source::Dir(other_src.clone()),
        LayerKind::Workspace,
    )
    .unwrap()
    .id
    .to_hex();
    // One more layer for each fault of a single response, read while the fault is set:
    // nothing of it is cached by then, so its first read fetches (the base layer may be
    // in the cache whole by then, its readahead having run ahead of the reads).
    let fault_layers: Vec<(std::path::PathBuf, String)> = [("truncated", 41), ("reset", 43)]
        .into_iter()
        .map(|(name, seed)| {
            let dir = work.path().join(name);
            fixtures::workspace_tree(&dir, 30, seed);
            let id = build(&rt, &direct, Source::Dir(dir.clone()), LayerKind::Toolkit)
                .unwrap()
                .id
                .to_hex();
            (dir, id)
        })
        .collect();

    let proxy = LatencyProxy::start(
        server.endpoint(),
        Link {
            rtt: Duration::from_millis(2),
            bandwidth: None,
        },
    )
    .unwrap();
    let url = server.url_through(proxy.addr());
    let home = work.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let daemon = Daemon::start(&home, &url, "3s");
    let (mnt, other_mnt) = (work.path().join("mnt"), work.path().join("other-mnt"));
    let fault_mnts: Vec<std::path::PathBuf> = fault_layers
        .iter()
        .map(|(dir, _)| dir.with_extension("mnt"))
        .collect();
    let mounts: Vec<(&String, &std::path::PathBuf)> = [(&id, &mnt), (&other, &other_mnt)]
        .into_iter()
        .chain(fault_layers.iter().map(|(_, id)| id).zip(&fault_mnts))
        .collect();
    for &(layer, dir) in &mounts {
        let o = daemon.cli(&["layer", "mount", layer, dir.to_str().unwrap()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }

    // The first data read gets a response with a flipped byte: detected by the chunk's
    // digest, fetched again, and the reader gets the right bytes.
    proxy.corrupt_next(1);
    assert_eq!(
        std::fs::read(mnt.join("big/three-mib")).unwrap(),
        std::fs::read(src.join("big/three-mib")).unwrap()
    );
    assert_eq!(proxy.corrupted(), 1, "the proxy corrupted no response");
    let log = sh(&format!("cat '{}'/daemon-*.log", home.display()));
    assert!(log.contains("is corrupt"), "no corruption reported:\n{log}");
    let cached = std::fs::read(mnt.join("ten-k")).unwrap();
    assert_eq!(cached, std::fs::read(src.join("ten-k")).unwrap());

    // A body cut short and a connection reset: the fetch fails, is tried again, and the
    // reader gets the right bytes. The fault's own layer is read in order until one fetch
    // (the reader's or its readahead's) met the fault.
    for (((fault, fired), (dir, _)), fault_mnt) in [
        (
            "truncated",
            &(|p: &LatencyProxy| p.truncated()) as &dyn Fn(&LatencyProxy) -> usize,
        ),
        ("reset", &|p: &LatencyProxy| p.resets()),
    ]
    .into_iter()
    .zip(&fault_layers)
    .zip(&fault_mnts)
    {
        match fault {
            "truncated" => proxy.truncate_next(1),
            _ => proxy.reset_next(1),
        }
        let files: Vec<std::path::PathBuf> = walkdir::WalkDir::new(dir)
            .sort_by_file_name()
            .into_iter()
            .flatten()
            .filter(|e| e.file_type().is_file())
            .map(|e| e.path().strip_prefix(dir).unwrap().to_path_buf())
            .collect();
        let mut next = files.iter();
        while fired(&proxy) == 0 {
            let f = next
                .next()
                .unwrap_or_else(|| panic!("no read met the {fault} fault"));
            assert_eq!(
                std::fs::read(fault_mnt.join(f)).unwrap(),
                std::fs::read(dir.join(f)).unwrap(),
                "{} after a {fault} response",
                f.display()
            );
        }
        assert_eq!(fired(&proxy), 1, "{fault}");
        assert_served_exactly(dir, fault_mnt);
    }

    // An outage: uncached reads fail with EIO within the bound, cached ones keep working,
    // and once the store is back the same read works without remounting.
    let victim = sh(&format!(
        "cd '{}' && find . -type f -size +1k | sort | head -1",
        other_src.display()
    ));
    let victim = victim.trim();
    // Both ways a store goes away: connections refused and cut (`set_down`), and a
    // partition that answers nothing (the store client's own timeout is 30 s: each fetch
    // must be bounded by the daemon's 3 s, not by it).
    for (outage, set) in [
        (
            "a partition",
            &(|p: &LatencyProxy, on| p.set_partitioned(on)) as &dyn Fn(&LatencyProxy, bool),
        ),
        ("an outage", &|p: &LatencyProxy, on| p.set_down(on)),
    ] {
        set(&proxy, true);
        let t = Instant::now();
        let err = std::fs::read(other_mnt.join(victim)).unwrap_err();
        let took = t.elapsed();
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{outage}: {err}");
        assert!(
            took >= Duration::from_secs(2) && took < Duration::from_secs(20),
            "{outage}: EIO after {took:?}; the daemon's log:\n{}",
            sh(&format!("tail -n 40 '{}'/daemon-*.log", home.display()))
        );
        assert_eq!(std::fs::read(mnt.join("ten-k")).unwrap(), cached);
        set(&proxy, false);
    }
    assert_eq!(
        std::fs::read(other_mnt.join(victim)).unwrap(),
        std::fs::read(other_src.join(victim)).unwrap()
    );

    // Every byte of the tree, through the proxy.
    assert_served_exactly(&src, &mnt);
    assert!(daemon.stats(&other)["fetch_errors"].as_u64().unwrap() >= 1);
    for &(_, dir) in &mounts {
        assert!(daemon
            .cli(&["layer", "umount", dir.to_str().unwrap()])
            .status
            .success());
    }
    drop(daemon);
    assert!(mounts_under(&home).is_empty(), "{:?}", mounts_under(&home));
    // A corrupted body, a truncated one, a reset connection and an outage, each
    // survived with exact bytes served.
    strata_tests::contained(
        "store faults: corrupt, truncated, reset, outage, partition",
        "faults",
        5,
    );
}
