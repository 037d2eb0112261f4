//! `strata doctor`: what this host has (cgroup mode, how layer images mount, the VM
//! accelerator), and a missing piece named with its fix.

use std::process::Command;

use strata_tests::home::CliHome;
use strata_tests::{have_root, strata_bin};

fn report(o: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor --json: {e}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

fn check<'a>(r: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    r["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no {name} check in {r}"))
}

#[test]
fn doctor_lists_the_cgroup_mode_the_erofs_path_and_the_accelerator() {
    if !have_root("doctor_lists") {
        return;
    }
    let home = CliHome::new("doctor-");
    let o = home.cli(&["doctor", "--json"]);
    let r = report(&o);
    assert_eq!(o.status.code(), Some(0), "{r:#}");
    assert_eq!(r["ready"], true, "{r:#}");
    let cg = check(&r, "cgroups")["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        ["v1", "hybrid", "v2"].iter().any(|m| cg.starts_with(m)),
        "cgroup mode: {cg}"
    );
    let erofs = check(&r, "erofs")["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        erofs.contains("file-backed") || erofs.contains("loop devices"),
        "EROFS mount path: {erofs}"
    );
    let kvm = check(&r, "kvm")["detail"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        kvm.contains("KVM") || kvm.contains("TCG") || kvm.contains("probes"),
        "{kvm}"
    );
    // The human form says the same.
    let o = home.cli(&["doctor"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("cgroups") && text.contains(&cg), "{text}");
    assert!(text.contains("sandboxes can run on this host"), "{text}");
}

#[test]
fn doctor_names_fuse_and_its_fix_when_fuse_is_hidden() {
    if !have_root("doctor_fuse") {
        return;
    }
    let home = CliHome::new("doctor-");
    // /dev/fuse replaced by /dev/null in a private mount namespace.
    let hidden = |json: &str| {
        Command::new("unshare")
            .args([
                "-m",
                "sh",
                "-c",
                &format!("mount --bind /dev/null /dev/fuse && exec \"$0\" doctor {json}"),
            ])
            .arg(strata_bin())
            .env("STRATA_HOME", &home.home)
            .env("STRATA_STORE", &home.store)
            .output()
            .expect("unshare")
    };
    let o = hidden("--json");
    let r = report(&o);
    assert_eq!(o.status.code(), Some(1), "{r:#}");
    assert_eq!(r["ready"], false);
    let fuse = check(&r, "fuse");
    assert_eq!(fuse["status"], "fail", "{fuse}");
    assert!(
        fuse["fix"]
            .as_str()
            .unwrap_or_default()
            .contains("modprobe fuse"),
        "{fuse}"
    );
    let text_out = hidden("");
    let text = String::from_utf8_lossy(&text_out.stdout);
    assert!(
        text.contains("FAIL  fuse") && text.contains("fix: modprobe fuse"),
        "{text}"
    );
}
