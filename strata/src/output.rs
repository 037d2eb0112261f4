//! Printing for people and for programs: byte sizes, JSON, progress bars.

use std::sync::Arc;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

pub fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// A byte-count spinner on stderr; invisible when stderr is not a terminal.
pub fn byte_progress(message: &str) -> (ProgressBar, strata_builder::Progress) {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} {bytes} ({bytes_per_sec}) {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_message(message.to_string());
    let b = bar.clone();
    let cb: strata_builder::Progress = Arc::new(move |n| b.set_position(n));
    (bar, cb)
}
