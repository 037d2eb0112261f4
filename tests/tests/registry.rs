//! Pulling from a real registry (Debian's docker-registry on 127.0.0.1, the image pushed
//! with skopeo): the pulled image gives the same layer as the OCI layout it came from.

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use strata_builder::{LayerKind, Source};
use strata_tests::fixtures::{simple_tar, write_oci_layout};
use strata_tests::*;

struct Registry(Child);

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_registry_image_builds_the_same_layer_as_its_oci_layout() {
    if !have_tool("registry_pull", "docker-registry") || !have_tool("registry_pull", "skopeo") {
        return;
    }
    let rt = runtime();
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let port = 5000 + (std::process::id() % 1000) as u16;
    let config = work.path().join("registry.yml");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            work.path().join("data").display()
        ),
    )
    .unwrap();
    let _registry = Registry(
        Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "registry did not start");
        std::thread::sleep(Duration::from_millis(50));
    }

    let layout = work.path().join("oci");
    let lower = simple_tar(
        &[
            ("etc/os-release", b"ID=strata\n"),
            ("usr/bin/tool", b"#!/bin/sh\n"),
        ],
        &[],
    );
    let upper = simple_tar(&[("etc/motd", b"hi\n")], &["usr/bin/.wh.tool"]);
    write_oci_layout(&layout, &[lower, upper]);
    let image = format!("127.0.0.1:{port}/strata/test:v1");
    sh(&format!(
        "skopeo copy --quiet --dest-tls-verify=false oci:{}:latest docker://{image}",
        layout.display()
    ));

    let (_sd, store) = temp_store();
    let from_layout = build(
        &rt,
        &store,
        Source::OciLayout {
            path: layout,
            reference: None,
        },
        LayerKind::Base,
    )
    .unwrap();
    let pulled = build(
        &rt,
        &store,
        Source::parse(&format!("docker://{image}")).unwrap(),
        LayerKind::Base,
    )
    .unwrap();
    assert_eq!(pulled.id, from_layout.id);
    assert_eq!(pulled.files, 2, "the whiteout removed usr/bin/tool");

    let e = build(
        &rt,
        &store,
        Source::Registry(format!("127.0.0.1:{port}/strata/missing:v1")),
        LayerKind::Base,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("strata/missing"), "{e}");
}
