//! `strata doctor [--json]`: prints every check of the host with the fix for what is
//! missing; exits 1 when a sandbox cannot run here.

use anyhow::Result;
use strata_runtime::doctor::{check_host, ready, Status};

pub fn run(settings: &crate::config::Settings, json: bool) -> Result<i32> {
    let cfg = crate::sandbox::runtime_config(settings)?;
    let checks = check_host(&cfg);
    let ok = ready(&checks);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"ready": ok, "checks": checks}))?
        );
    } else {
        for c in &checks {
            let mark = match (c.status, c.required) {
                (Status::Ok, _) => "ok  ",
                (Status::Warn, _) | (Status::Fail, false) => "warn",
                (Status::Fail, true) => "FAIL",
            };
            println!("{mark}  {:<16} {}", c.name, c.detail);
            if let Some(fix) = &c.fix {
                println!("      {:<16} fix: {fix}", "");
            }
        }
        println!(
            "{}",
            if ok {
                "sandboxes can run on this host"
            } else {
                "sandboxes cannot run on this host: fix what is marked FAIL"
            }
        );
    }
    Ok(if ok { 0 } else { 1 })
}
