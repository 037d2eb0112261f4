//! `strata snapshot ls|inspect|rm`: the snapshots in the store (taken by `strata sandbox
//! snapshot --to-store`), on the local store or through a node service (`--server`),
//! with one output either way.

use anyhow::Result;
use clap::Subcommand;
use strata_service::proto;
use strata_store::Store;

use crate::output::{human_bytes, human_time, print_json, took};

#[derive(Subcommand)]
pub enum SnapshotCommand {
    /// Every snapshot (through a service: the project's), oldest first.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// One snapshot: what it holds, of which sandbox and stack, its sizes.
    Inspect {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Remove snapshots (a memory snapshot's layer goes too, its chunks at the next
    /// `strata store gc`).
    Rm { ids: Vec<String> },
}

/// A snapshot as `--json` prints it (the API's field names).
pub fn to_json(s: &proto::SnapshotInfo) -> serde_json::Value {
    serde_json::json!({
        "id": s.id, "layer": s.layer, "memory": s.memory, "backend": s.backend,
        "sandbox": s.sandbox, "catalog_ref": s.catalog_ref, "project": s.project,
        "names": s.names, "taken_ms": s.taken_ms, "taken_by": s.taken_by,
        "state_bytes": s.state_bytes, "disk_bytes": s.disk_bytes,
        "stored_bytes": s.stored_bytes, "uploaded_bytes": s.uploaded_bytes,
        "seconds": s.seconds,
    })
}

fn holds(s: &proto::SnapshotInfo) -> &'static str {
    if s.memory {
        "processes, memory and files"
    } else {
        "files"
    }
}

/// What `sandbox snapshot --to-store` prints: a summary on stderr, the ID last.
pub fn print_taken(s: &proto::SnapshotInfo, json: bool) -> Result<()> {
    if json {
        print_json(&to_json(s))?;
    } else {
        eprintln!(
            "stored {} of {} ({}): {} in the layer, {} new to the store, in {}",
            s.id,
            s.sandbox,
            holds(s),
            human_bytes(s.stored_bytes),
            human_bytes(s.uploaded_bytes),
            took(std::time::Duration::from_secs_f64(s.seconds.max(0.0))),
        );
    }
    println!("{}", s.id);
    Ok(())
}

fn print_list(snaps: &[proto::SnapshotInfo], json: bool) -> Result<()> {
    if json {
        return print_json(&snaps.iter().map(to_json).collect::<Vec<_>>());
    }
    if snaps.is_empty() {
        eprintln!("no snapshots (take one with `strata sandbox snapshot ID --to-store`)");
    }
    for s in snaps {
        println!(
            "{}  {:<8} {:>10}  {}  {}  {}",
            s.id,
            s.backend,
            human_bytes(s.stored_bytes),
            human_time(s.taken_ms / 1000),
            if s.memory { "memory" } else { "files " },
            s.catalog_ref,
        );
    }
    Ok(())
}

fn print_one(s: &proto::SnapshotInfo, json: bool) -> Result<()> {
    if json {
        return print_json(&to_json(s));
    }
    println!("snapshot   {}", s.id);
    println!("holds      {}", holds(s));
    println!(
        "of         {} ({}, {})",
        s.sandbox, s.backend, s.catalog_ref
    );
    println!(
        "taken      {} by {}",
        human_time(s.taken_ms / 1000),
        s.taken_by
    );
    if !s.project.is_empty() {
        println!("project    {}", s.project);
    }
    if !s.names.is_empty() {
        println!("names      {}", s.names.join(", "));
    }
    println!("layer      {}", s.layer);
    if s.memory {
        println!("state      {}", human_bytes(s.state_bytes));
    }
    println!("disk       {}", human_bytes(s.disk_bytes));
    println!(
        "stored     {} ({} new when taken)",
        human_bytes(s.stored_bytes),
        human_bytes(s.uploaded_bytes)
    );
    Ok(())
}

/// On the local store.
pub async fn run(store: &Store, cmd: SnapshotCommand) -> Result<i32> {
    use strata_service::snapshot;
    match cmd {
        SnapshotCommand::Ls { json } => {
            let snaps = snapshot::list(store, None).await?;
            print_list(
                &snaps.iter().map(|s| s.to_proto()).collect::<Vec<_>>(),
                json,
            )?;
        }
        SnapshotCommand::Inspect { id, json } => {
            print_one(&snapshot::get(store, &id).await?.to_proto(), json)?;
        }
        SnapshotCommand::Rm { ids } => {
            for id in ids {
                let snap = snapshot::get(store, &id).await?;
                let layer = snapshot::remove(store, &snap).await?;
                println!("removed {id}{}", if layer { " and its layer" } else { "" });
            }
        }
    }
    Ok(0)
}

/// Through a node service.
pub async fn remote(remote: &crate::remote::Remote, cmd: SnapshotCommand) -> Result<i32> {
    let mut sbs = remote.sandboxes();
    let err = remote.err();
    match cmd {
        SnapshotCommand::Ls { json } => {
            let r = sbs
                .list_snapshots(remote.req(proto::ListSnapshotsRequest {}))
                .await
                .map_err(&err)?
                .into_inner();
            print_list(&r.snapshots, json)?;
        }
        SnapshotCommand::Inspect { id, json } => {
            let s = sbs
                .get_snapshot(remote.req(proto::SnapshotId { id }))
                .await
                .map_err(&err)?
                .into_inner();
            print_one(&s, json)?;
        }
        SnapshotCommand::Rm { ids } => {
            for id in ids {
                sbs.remove_snapshot(remote.req(proto::SnapshotId { id: id.clone() }))
                    .await
                    .map_err(&err)?;
                println!("removed {id}");
            }
        }
    }
    Ok(0)
}
