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

/// A moment given in seconds since the Unix epoch, as people read it: the UTC date and
/// time, and how long ago.
pub fn human_time(unix_secs: u64) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(unix_secs);
    let stamp = humantime::format_rfc3339_seconds(at)
        .to_string()
        .replace('T', " ")
        .replace('Z', " UTC");
    match std::time::SystemTime::now().duration_since(at) {
        Ok(ago) => format!("{stamp} ({} ago)", rough_duration(ago)),
        Err(_) => stamp,
    }
}

/// A duration to its largest unit or two: `3h 12m`, `45s`.
pub fn rough_duration(d: std::time::Duration) -> String {
    let s = d.as_secs();
    let (days, hours, mins) = (s / 86_400, s / 3600 % 24, s / 60 % 60);
    match (days, hours, mins) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, m) => format!("{m}m {}s", s % 60),
        (0, h, m) => format!("{h}h {m}m"),
        (d, h, _) => format!("{d}d {h}h"),
    }
}

/// A command's running time: `83 ms`, `4.2 s`, then as [`rough_duration`].
pub fn took(d: std::time::Duration) -> String {
    match d.as_millis() {
        ms @ 0..1000 => format!("{ms} ms"),
        ms @ 1000..60_000 => format!("{:.1} s", ms as f64 / 1000.0),
        _ => rough_duration(d),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moment_reads_as_a_date_and_how_long_ago() {
        let shown = human_time(1_796_153_673);
        assert!(shown.starts_with("2026-12-01 19:34:33 UTC ("), "{shown}");
        assert!(shown.contains(" UTC"), "{shown}");
        assert_eq!(rough_duration(std::time::Duration::from_secs(42)), "42s");
        assert_eq!(
            rough_duration(std::time::Duration::from_secs(3 * 3600 + 12 * 60)),
            "3h 12m"
        );
        assert_eq!(
            rough_duration(std::time::Duration::from_secs(2 * 86_400 + 5 * 3600)),
            "2d 5h"
        );
    }
}
