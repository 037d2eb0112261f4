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

/// How many times better Strata did than the baseline (above 1: better), whichever
/// direction the row counts as better.
fn advantage(row: &Row) -> Option<f64> {
    if row.strata <= 0.0 || row.baseline <= 0.0 {
        return None;
    }
    Some(if row.better == "lower" {
        row.baseline / row.strata
    } else {
        row.strata / row.baseline
    })
}

fn escape_xml(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A section as an SVG chart: one bar per row, Strata's advantage over the row's baseline
/// on a log scale from 1/100 to 100 (right of the line: better than the baseline).
///
/// The few rectangles and labels are written directly: the plotting crates need a font
/// rasterizer to lay out text even for SVG output.
pub fn chart(sec: &Section) -> String {
    const LABEL_W: f64 = 520.0;
    const PLOT_W: f64 = 420.0;
    const ROW_H: f64 = 22.0;
    const TOP: f64 = 30.0;
    let rows: Vec<(&Row, f64)> = sec
        .rows
        .iter()
        .filter_map(|r| advantage(r).map(|a| (r, a)))
        .collect();
    let height = TOP + ROW_H * rows.len() as f64 + 30.0;
    let width = LABEL_W + PLOT_W + 90.0;
    let x_of = |a: f64| LABEL_W + PLOT_W * (a.clamp(0.01, 100.0).log10() + 2.0) / 4.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{LABEL_W}" y="18" font-weight="bold">{}: times better than the baseline (log scale)</text>"#,
        escape_xml(&sec.name)
    );
    for (i, (row, a)) in rows.iter().enumerate() {
        let y = TOP + ROW_H * i as f64;
        let (x0, x1) = (x_of(1.0).min(x_of(*a)), x_of(1.0).max(x_of(*a)));
        let color = if *a >= 1.0 { "#2e8b57" } else { "#c0392b" };
        let mut name = row.name.clone();
        if name.chars().count() > 80 {
            name = name.chars().take(77).collect::<String>() + "...";
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            LABEL_W - 8.0,
            y + 15.0,
            escape_xml(&name)
        );
        let _ = writeln!(
            s,
            r#"<rect x="{x0:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{color}"/>"#,
            y + 4.0,
            (x1 - x0).max(1.0),
            ROW_H - 8.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}">{}×</text>"#,
            LABEL_W + PLOT_W + 8.0,
            y + 15.0,
            fmt(*a)
        );
    }
    let base_x = x_of(1.0);
    let bottom = TOP + ROW_H * rows.len() as f64;
    let _ = writeln!(
        s,
        r##"<line x1="{base_x}" y1="{}" x2="{base_x}" y2="{bottom}" stroke="#333"/>"##,
        TOP - 4.0
    );
    for (a, label) in [
        (0.01, "1/100"),
        (0.1, "1/10"),
        (1.0, "1"),
        (10.0, "10"),
        (100.0, "100"),
    ] {
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{label}</text>"#,
            x_of(a),
            bottom + 16.0
        );
    }
    s.push_str("</svg>\n");
    s
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
            "![{} chart]({})\n",
            sec.name,
            chart_file(&r.suite, &r.date, &sec.name)
        );
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

fn chart_file(suite: &str, date: &str, section: &str) -> String {
    format!("{suite}-{date}-{section}.svg")
}

/// Writes `<suite>-<date>.json` and `.md` into `dir` with one `.svg` chart per section,
/// plus `latest-<suite>.md`.
pub fn write(dir: &Path, r: &Results) -> anyhow::Result<(PathBuf, PathBuf)> {
    let stem = format!("{}-{}", r.suite, r.date);
    let json = dir.join(format!("{stem}.json"));
    let md = dir.join(format!("{stem}.md"));
    std::fs::write(&json, serde_json::to_string_pretty(r)?)?;
    for sec in &r.sections {
        std::fs::write(
            dir.join(chart_file(&r.suite, &r.date, &sec.name)),
            chart(sec),
        )?;
    }
    let text = markdown(r);
    std::fs::write(&md, &text)?;
    std::fs::write(dir.join(format!("latest-{}.md", r.suite)), &text)?;
    Ok((json, md))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_draws_one_bar_per_row_on_the_right_side_of_one() {
        let sec = Section {
            name: "demo".into(),
            description: String::new(),
            rows: vec![
                Row::new("faster", "ms", 10.0, "base", 40.0, "lower", ""),
                Row::new("slower <x>", "MB/s", 50.0, "base", 100.0, "higher", ""),
                Row::new("no baseline", "ms", 1.0, "base", 0.0, "lower", ""),
            ],
        };
        let svg = chart(&sec);
        assert_eq!(svg.matches("<rect").count(), 2);
        assert!(svg.contains("4.00×") && svg.contains("0.5000×"), "{svg}");
        assert!(svg.contains("slower &lt;x&gt;"));
        // The better row's bar starts at the 1× line and goes right; the worse one ends there.
        let one = 520.0 + 420.0 * 2.0 / 4.0;
        assert!(svg.contains(&format!("<rect x=\"{one:.1}\"")), "{svg}");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
