//! `strata catalog ...`: register, show, list, trace and remove catalog entries.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use strata_catalog::{Action, Catalog, Entry, LogRecord, Registered};
use strata_store::Store;

use crate::output::print_json;

#[derive(Subcommand)]
pub enum CatalogCommand {
    /// Register an entry (TOML). Prints `namespace/name@version` last.
    Register {
        entry: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Show an entry: `namespace/name` (latest) or `namespace/name@version`.
    Show {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// List entry IDs, optionally only those starting with PREFIX.
    Ls {
        #[arg(default_value = "")]
        prefix: String,
    },
    /// Every registration and removal of an entry, oldest first.
    History {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Remove `namespace/name@version`, or every version of `namespace/name`: a tombstone
    /// in the entry's log (its history keeps both). The layers stay (`strata layer rm`).
    Rm {
        /// `namespace/name@version` or `namespace/name`.
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

/// Runs `cmd`; registrations and removals are recorded as made by `registrant`.
pub async fn run(store: &Store, registrant: &str, cmd: CatalogCommand) -> Result<i32> {
    let catalog = Catalog::open(store).await?;
    match cmd {
        CatalogCommand::Register { entry, json } => {
            let text = std::fs::read_to_string(&entry)
                .with_context(|| format!("reading {}", entry.display()))?;
            let e = Entry::from_toml(&text, &entry.display().to_string())?;
            let r = catalog.register(e, registrant).await?;
            if json {
                print_json(&r)?;
            } else {
                println!("{}", r.reference());
            }
        }
        CatalogCommand::Show { id, json } => {
            print_entry(&*catalog.get(&id).await?, json)?;
        }
        CatalogCommand::Ls { prefix } => {
            for id in catalog.list(&prefix).await? {
                println!("{id}");
            }
        }
        CatalogCommand::History { id, json } => {
            print_history(&catalog.history(&id).await?, json)?;
        }
        CatalogCommand::Rm { ids } => {
            for id in ids {
                for reference in catalog.remove(&id, registrant).await? {
                    println!("removed {reference}");
                }
            }
        }
    }
    Ok(0)
}

/// `catalog show`'s output (embedded or through a node service).
pub fn print_entry(r: &Registered, json: bool) -> Result<()> {
    if json {
        return print_json(r);
    }
    let e = &r.entry;
    println!("id          {}", r.reference());
    println!(
        "registered  {} by {}",
        crate::output::human_time(r.registered_at),
        r.registered_by
    );
    println!("backend     {:?}", e.backend);
    println!("base        {}", e.base);
    if let Some(image) = &e.disk_image {
        match image.partition {
            Some(n) => println!("disk image  {} (partition {n})", image.path),
            None => println!("disk image  {}", image.path),
        }
    }
    for t in &e.toolkits {
        println!("toolkit     {t}");
    }
    if let Some(w) = &e.workspace {
        println!("workspace   {w}");
    }
    if let Some(w) = &e.workdir {
        println!("workdir     {w}");
    }
    println!("budgets     {}", serde_json::to_string(&e.budgets)?);
    for (k, v) in &e.env {
        println!("env         {k}={v}");
    }
    for (k, v) in &e.commands {
        println!("command     {k}: {v}");
    }
    Ok(())
}

/// `catalog history`'s output.
pub fn print_history(h: &[LogRecord], json: bool) -> Result<()> {
    if json {
        return print_json(&h);
    }
    for r in h {
        let action = match r.action {
            Action::Register => "register",
            Action::Remove => "remove",
        };
        println!(
            "{:>6}  {:<8}  {:<12} {}  {}",
            r.seq,
            action,
            r.version,
            crate::output::human_time(r.at),
            r.by
        );
    }
    Ok(())
}
