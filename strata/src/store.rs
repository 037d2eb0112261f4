//! `strata store ...`: statistics, verification, garbage collection.

use std::time::Duration;

use anyhow::Result;
use clap::Subcommand;
use strata_store::Store;

use crate::output::{human_bytes, print_json};

#[derive(Subcommand)]
pub enum StoreCommand {
    /// Chunks, stored and logical bytes, dedup ratio.
    Stats {
        #[arg(long)]
        json: bool,
    },
    /// Read every manifest, metadata image and chunk and check their digests.
    Verify {
        #[arg(long)]
        json: bool,
    },
    /// Delete the packs, metadata images and records no remaining layer references.
    Gc {
        /// Keep unreferenced objects younger than this (they may belong to a build that
        /// has not committed yet).
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        grace: Duration,
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(store: &Store, cmd: StoreCommand) -> Result<i32> {
    match cmd {
        StoreCommand::Stats { json } => {
            let s = store.stats().await?;
            if json {
                print_json(&s)?;
            } else {
                println!("store          {}", store.describe());
                println!("layers         {}", s.layers);
                println!("chunks         {}", s.chunks);
                println!("packs          {}", s.packs);
                println!(
                    "stored bytes   {} ({})",
                    s.stored_bytes,
                    human_bytes(s.stored_bytes)
                );
                println!(
                    "logical bytes  {} ({})",
                    s.logical_bytes,
                    human_bytes(s.logical_bytes)
                );
                println!(
                    "unique bytes   {} ({})",
                    s.unique_bytes,
                    human_bytes(s.unique_bytes)
                );
                println!("dedup ratio    {:.2}", s.dedup_ratio);
            }
            Ok(0)
        }
        StoreCommand::Verify { json } => {
            let r = store.verify().await?;
            if json {
                print_json(&r)?;
            } else {
                for p in &r.problems {
                    eprintln!("error: {p}");
                }
                println!(
                    "verified {} layers, {} packs, {} chunks ({}): {} problem(s)",
                    r.layers,
                    r.packs,
                    r.chunks,
                    human_bytes(r.bytes),
                    r.problems.len()
                );
            }
            Ok(if r.problems.is_empty() { 0 } else { 2 })
        }
        StoreCommand::Gc { grace, json } => {
            let r = store.gc(grace).await?;
            if json {
                print_json(&r)?;
            } else {
                println!(
                    "deleted {} packs and {} metadata images ({}) and {} records; kept {} for {} layers ({} of it dead chunks in live packs) and {} young unreferenced objects; {} expired leases",
                    r.deleted_packs,
                    r.deleted_metadata,
                    human_bytes(r.deleted_bytes),
                    r.deleted_records,
                    human_bytes(r.kept_bytes),
                    r.layers,
                    human_bytes(r.dead_bytes_in_live_packs),
                    r.kept_young,
                    r.expired_leases,
                );
            }
            Ok(0)
        }
    }
}
