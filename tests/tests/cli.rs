//! The `strata` command line: the names, flags, JSON keys and exit codes other tools rely on.

use strata_tests::*;

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn layer_and_store_commands() {
    let work = tempfile::tempdir_in(scratch_root()).unwrap();
    let src = work.path().join("ws");
    fixtures::workspace_tree(&src, 120, 5);
    let store = work.path().join("store");
    let store = store.to_str().unwrap();
    let src_s = src.to_str().unwrap();

    let o = strata(
        store,
        &[
            "layer",
            "build",
            "--kind",
            "workspace",
            "--name",
            "demo",
            "--version",
            "1",
            "--json",
            src_s,
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("one JSON object");
    for key in [
        "id",
        "files",
        "logical_bytes",
        "uploaded_bytes",
        "new_data_bytes",
        "chunks",
        "reused_chunks",
        "seconds",
    ] {
        assert!(j.get(key).is_some(), "--json lacks `{key}`: {j}");
    }
    assert_eq!(j["files"], 120);
    let id = j["id"].as_str().unwrap().to_string();

    // Text mode: the layer ID is the last line of stdout.
    let o = strata(store, &["layer", "build", "--kind", "workspace", src_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().last().unwrap(), id);

    let o = strata(store, &["layer", "inspect", &id[..12], "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(j["provenance"]["name"], "demo");
    assert_eq!(j["provenance"]["kind"], "workspace");

    let o = strata(store, &["layer", "ls"]);
    assert!(
        stdout(&o).contains(&id[..16]) && stdout(&o).contains("demo"),
        "{}",
        stdout(&o)
    );

    let o = strata(store, &["store", "stats", "--json"]);
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    for key in ["chunks", "stored_bytes", "logical_bytes", "dedup_ratio"] {
        assert!(j.get(key).is_some(), "stats lacks `{key}`: {j}");
    }

    let out = work.path().join("export");
    let o = strata(store, &["layer", "export", &id, out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    treecmp::assert_same_tree(
        &src,
        &out,
        treecmp::Ignore {
            root_meta: true,
            ..Default::default()
        },
    );

    let o = strata(store, &["store", "verify"]);
    assert!(o.status.success(), "{}", stderr(&o));

    // Corrupt one pack: verify fails and names the damage.
    let pack = walkdir::WalkDir::new(work.path().join("store/packs"))
        .into_iter()
        .filter_map(|e| e.ok())
        .find(|e| e.file_type().is_file())
        .unwrap()
        .into_path();
    let mut bytes = std::fs::read(&pack).unwrap();
    bytes[10] ^= 0x40;
    std::fs::write(&pack, bytes).unwrap();
    let o = strata(store, &["store", "verify"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("corrupt") && stderr(&o).contains(&id),
        "{}",
        stderr(&o)
    );

    // Bad input: a clear error naming the path, non-zero exit.
    let o = strata(store, &["layer", "build", "/no/such/tree"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/no/such/tree"), "{}", stderr(&o));
    let o = strata(store, &["layer", "inspect", "0123456789abcdef"]);
    assert!(
        !o.status.success() && stderr(&o).contains("not in the store"),
        "{}",
        stderr(&o)
    );
    let o = strata("s3://", &["store", "stats"]);
    assert!(
        !o.status.success() && stderr(&o).contains("bucket"),
        "{}",
        stderr(&o)
    );
}

/// `$STRATA_HOME/strata.toml` sets what the environment and flags leave open (no root
/// needed): its store is the one `layer build`, `layer ls` and `store stats` use, and its
/// runtime settings are what `doctor` checks; the environment and flags still win. A
/// missing `--config` file and an unknown key are refused, naming them.
#[test]
fn the_settings_file_in_the_home_takes_effect_below_the_environment_and_flags() {
    let cli = home::CliHome::new("settings-");
    let root = cli.home.parent().unwrap().to_path_buf();
    let file_store = root.join("file-store");
    let guest = root.join("no-guest-here");
    std::fs::write(
        cli.home.join("strata.toml"),
        format!(
            "# the site's settings\nstore = \"{}\"\nguest_dir = \"{}\"\nvm_accel = \"tcg\"\n",
            file_store.display(),
            guest.display()
        ),
    )
    .unwrap();
    // Only STRATA_HOME: CliHome's own STRATA_STORE would beat the file.
    let strata = |args: &[&str]| {
        let o = std::process::Command::new(strata_bin())
            .args(args)
            .env("STRATA_HOME", &cli.home)
            .env_remove("STRATA_STORE")
            .env_remove("STRATA_CONFIG")
            .output()
            .expect("running strata");
        let (out, err) = home::text(&o);
        (o.status.success(), out, err)
    };

    let src = root.join("ws");
    fixtures::workspace_tree(&src, 12, 2);
    let (ok, out, err) = strata(&[
        "layer",
        "build",
        "--name",
        "from-file",
        src.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let id = out.lines().last().unwrap().to_string();
    assert!(
        file_store
            .join("layers")
            .join(format!("{id}.json"))
            .is_file(),
        "the layer went to the file's store"
    );
    let (ok, out, err) = strata(&["layer", "ls"]);
    assert!(
        ok && out.contains(&id[..16]) && out.contains("from-file"),
        "{out}{err}"
    );
    let (ok, out, err) = strata(&["store", "stats", "--json"]);
    assert!(ok, "{err}");
    let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(stats["layers"], 1, "{stats}");
    assert!(
        !cli.home.join("store").exists(),
        "nothing in the home's default store"
    );

    // The environment beats the file, and the flag beats the environment.
    let o = cli.cli(&["layer", "ls", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), "[]", "STRATA_STORE's store is empty");
    let o = cli.cli(&["--store", file_store.to_str().unwrap(), "layer", "ls"]);
    assert!(stdout(&o).contains(&id[..16]), "{}", stdout(&o));

    // The runtime's settings come from the file too (doctor runs without root; it then
    // reports the missing root, so only its checks are read here).
    let (_, out, err) = strata(&["doctor", "--json"]);
    let report: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("doctor --json: {e}: {out}{err}"));
    let check = |name: &str| {
        report["checks"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["name"] == name))
            .map(|c| c["detail"].as_str().unwrap_or_default().to_string())
            .unwrap_or_else(|| panic!("no {name} check in {report}"))
    };
    assert!(
        check("guest kernel").contains(guest.to_str().unwrap()),
        "{report:#}"
    );
    assert!(check("kvm").contains("tcg"), "{report:#}");

    // A missing explicit file, and an unknown key: refused, naming them.
    let missing = root.join("missing.toml");
    let (ok, _, err) = strata(&["--config", missing.to_str().unwrap(), "layer", "ls"]);
    assert!(!ok, "a missing --config file was accepted");
    assert!(
        err.contains(missing.to_str().unwrap()) && err.contains("--config"),
        "{err}"
    );
    std::fs::write(cli.home.join("strata.toml"), "stroe = \"/srv/strata\"\n").unwrap();
    let (ok, _, err) = strata(&["layer", "ls"]);
    assert!(!ok, "an unknown key was accepted");
    assert!(
        err.contains("strata.toml") && err.contains("stroe") && err.contains("`store`"),
        "{err}"
    );
    // The home's cleanup at exit runs strata there.
    std::fs::remove_file(cli.home.join("strata.toml")).unwrap();
}
