//! Result files: one JSON document per run and a Markdown report beside it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::machine::Machine;

/// One measurement next to its baseline from the same run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    pub name: String,
    pub unit: String,
    pub strata: f64,
    pub baseline_name: String,
    pub baseline: f64,
    /// `strata / baseline` (or the reverse where lower is better; see `better`).
    pub ratio: f64,
    /// `higher` or `lower`: which direction is better for `strata`.
    pub better: String,
    pub note: String,
}

impl Row {
    pub fn new(
        name: &str,
        unit: &str,
        strata: f64,
        baseline_name: &str,
        baseline: f64,
        better: &str,
        note: &str,
    ) -> Row {
        let ratio = if baseline == 0.0 {
            0.0
        } else {
            strata / baseline
        };
        Row {
            name: name.into(),
            unit: unit.into(),
            strata,
            baseline_name: baseline_name.into(),
            baseline,
            ratio,
            better: better.into(),
            note: note.into(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Section {
    pub name: String,
    pub description: String,
    pub rows: Vec<Row>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    pub suite: String,
    pub date: String,
    pub machine: Machine,
    pub sections: Vec<Section>,
}

pub fn today() -> String {
    let out = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d")
        .output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn fmt(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

pub fn markdown(r: &Results) -> String {
    let mut s = String::new();
    let m = &r.machine;
    let _ = writeln!(s, "# Strata benchmark: suite `{}`, {}\n", r.suite, r.date);
    let _ = writeln!(
        s,
        "Machine: {} cores, {:.1} GiB, kernel {}, {}, accelerator {}.\n",
        m.cores,
        m.memory_bytes as f64 / (1u64 << 30) as f64,
        m.kernel,
        m.cpu,
        m.accelerator
    );
    for sec in &r.sections {
        let _ = writeln!(s, "## {}\n\n{}\n", sec.name, sec.description);
        let _ = writeln!(
            s,
            "| measurement | strata | baseline | baseline value | ratio | better | note |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|");
        for row in &sec.rows {
            let _ = writeln!(
                s,
                "| {} | {} {} | {} | {} {} | {} | {} | {} |",
                row.name,
                fmt(row.strata),
                row.unit,
                row.baseline_name,
                fmt(row.baseline),
                row.unit,
                fmt(row.ratio),
                row.better,
                row.note
            );
        }
        s.push('\n');
    }
    s
}

/// Writes `<suite>-<date>.json` and `.md` into `dir`, plus `latest-<suite>.md`.
pub fn write(dir: &Path, r: &Results) -> anyhow::Result<(PathBuf, PathBuf)> {
    let stem = format!("{}-{}", r.suite, r.date);
    let json = dir.join(format!("{stem}.json"));
    let md = dir.join(format!("{stem}.md"));
    std::fs::write(&json, serde_json::to_string_pretty(r)?)?;
    let text = markdown(r);
    std::fs::write(&md, &text)?;
    std::fs::write(dir.join(format!("latest-{}.md", r.suite)), &text)?;
    Ok((json, md))
}
