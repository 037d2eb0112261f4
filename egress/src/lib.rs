//! Egress by name. A sandbox's network rules name hosts (`pypi.org:443`, `*.debian.org:80`)
//! or rule sets (`pypi`); this crate owns what they mean ([`rules`]), the resolver the
//! sandbox asks ([`dns`]), reading the name a connection asks for ([`sniff`]) and the
//! per-sandbox proxy that enforces it outside the sandbox ([`proxy`]). The runtime wires
//! the sandbox's packets to the proxy; the `strata-agent egress` helper runs it.

pub mod dns;
pub mod proxy;
pub mod rules;
pub mod sniff;

use std::path::PathBuf;

pub use proxy::{EgressLog, LogEntry, Proxy, ProxyConfig, FORWARD_PORT};
pub use rules::{rule_set, rule_set_names, AnswerFilter, DomainRule, Pattern, Policy, RULE_SETS};

#[derive(Debug, thiserror::Error)]
pub enum EgressError {
    #[error("`{0}` is not a host name (letters, digits, hyphens and dots, or `*.` and a domain)")]
    BadName(String),
    #[error("egress proxy: cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("egress log {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("egress log {path} is not a log of the proxy: {source}")]
    BadLog {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}
