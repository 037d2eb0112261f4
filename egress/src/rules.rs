//! Domain rules: a name (exact, or `*.` for every name under a domain) and a port, the
//! named rule sets Strata ships (`pypi`, `npm`, `crates`, `debian`, `github`), and which
//! addresses an answer for an allowed name may hold.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use crate::EgressError;

/// Names a rule can match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "name", rename_all = "snake_case")]
pub enum Pattern {
    /// Exactly this name.
    Exact(String),
    /// Every name under this domain (`*.example.com`: `a.example.com`, `a.b.example.com`,
    /// not `example.com` itself).
    Under(String),
}

impl Pattern {
    /// Parses `name` or `*.domain`, lower-cased. Names are letters, digits, hyphens and
    /// dots (IDNs in their `xn--` form), 253 characters at most, labels of 1..=63.
    pub fn parse(text: &str) -> Result<Pattern, EgressError> {
        let lower = text.trim_end_matches('.').to_ascii_lowercase();
        let (under, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest.to_string()),
            None => (false, lower),
        };
        if !valid_name(&name) || !name.contains('.') && under {
            return Err(EgressError::BadName(text.to_string()));
        }
        Ok(if under {
            Pattern::Under(name)
        } else {
            Pattern::Exact(name)
        })
    }

    /// Whether `name` (lower-case, no trailing dot) is one this pattern matches.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            Pattern::Exact(n) => n == name,
            Pattern::Under(d) => name
                .strip_suffix(d.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        }
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pattern::Exact(n) => f.write_str(n),
            Pattern::Under(d) => write!(f, "*.{d}"),
        }
    }
}

/// Whether `name` is a host name: LDH labels of 1..=63 characters, 253 in all, not
/// starting or ending with a hyphen, not all digits in the last label (that is an address).
pub fn valid_name(name: &str) -> bool {
    if name.is_empty() || name.len() > 253 {
        return false;
    }
    let labels: Vec<&str> = name.split('.').collect();
    let ldh = labels.iter().all(|l| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    });
    ldh && labels
        .last()
        .is_some_and(|l| !l.chars().all(|c| c.is_ascii_digit()))
}

/// One allowed destination by name: the names and the TCP port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainRule {
    pub pattern: Pattern,
    pub port: u16,
}

/// The rule sets shipped with Strata, by name: what a package manager or a forge needs.
pub const RULE_SETS: &[(&str, &[(&str, u16)])] = &[
    (
        "pypi",
        &[("pypi.org", 443), ("files.pythonhosted.org", 443)],
    ),
    (
        "npm",
        &[("registry.npmjs.org", 443), ("registry.yarnpkg.com", 443)],
    ),
    (
        "crates",
        &[
            ("crates.io", 443),
            ("index.crates.io", 443),
            ("static.crates.io", 443),
            ("static.rust-lang.org", 443),
        ],
    ),
    (
        "debian",
        &[
            ("deb.debian.org", 80),
            ("deb.debian.org", 443),
            ("security.debian.org", 80),
            ("security.debian.org", 443),
        ],
    ),
    (
        "github",
        &[
            ("github.com", 443),
            ("api.github.com", 443),
            ("codeload.github.com", 443),
            ("*.githubusercontent.com", 443),
        ],
    ),
];

/// The `(host, port)` pairs rule set `name` stands for, if it is one.
pub fn rule_set(name: &str) -> Option<&'static [(&'static str, u16)]> {
    RULE_SETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, rules)| *rules)
}

/// The names of the shipped rule sets, for messages.
pub fn rule_set_names() -> String {
    RULE_SETS
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

/// What a sandbox may reach by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub rules: Vec<DomainRule>,
}

impl Policy {
    /// The policy of `(pattern, port)` pairs, each pattern parsed.
    pub fn of(rules: &[(&str, u16)]) -> Result<Policy, EgressError> {
        let rules = rules
            .iter()
            .map(|(p, port)| {
                Ok(DomainRule {
                    pattern: Pattern::parse(p)?,
                    port: *port,
                })
            })
            .collect::<Result<_, EgressError>>()?;
        Ok(Policy { rules })
    }

    /// Whether `name` may be reached on `port`.
    pub fn allows(&self, name: &str, port: u16) -> bool {
        self.rules
            .iter()
            .any(|r| r.port == port && r.pattern.matches(name))
    }

    /// Whether `name` may be reached on any port (so the resolver answers for it).
    pub fn allows_name(&self, name: &str) -> bool {
        self.rules.iter().any(|r| r.pattern.matches(name))
    }

    /// The ports some rule opens, each once.
    pub fn ports(&self) -> Vec<u16> {
        let mut ports: Vec<u16> = self.rules.iter().map(|r| r.port).collect();
        ports.sort_unstable();
        ports.dedup();
        ports
    }
}

/// Ranges an answer for an allowed name may never point into, whatever the name's owner
/// makes it resolve to (DNS rebinding): this network, loopback, link-local (cloud
/// metadata services), multicast and reserved. A name of a private network (an internal
/// mirror) stays reachable; the host's own addresses and the sandboxes' pool are refused
/// by [`AnswerFilter`].
const NEVER: [(Ipv4Addr, u8); 5] = [
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// Which answers of the host's resolver a sandbox is given.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnswerFilter {
    /// The host's own addresses.
    pub host: Vec<Ipv4Addr>,
    /// Ranges no answer may fall in besides the fixed ones (the sandboxes' address pool).
    pub ranges: Vec<(Ipv4Addr, u8)>,
}

impl AnswerFilter {
    /// Whether a sandbox may be sent to `addr` for a name.
    pub fn admits(&self, addr: Ipv4Addr) -> bool {
        let inside = |(net, len): &(Ipv4Addr, u8)| {
            let mask = if *len == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(*len))
            };
            u32::from(addr) & mask == u32::from(*net) & mask
        };
        !NEVER.iter().any(inside) && !self.ranges.iter().any(inside) && !self.host.contains(&addr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_their_names_only() {
        let exact = Pattern::parse("PyPI.org.").unwrap();
        assert_eq!(exact, Pattern::Exact("pypi.org".into()));
        assert!(exact.matches("pypi.org"));
        assert!(!exact.matches("evil-pypi.org") && !exact.matches("a.pypi.org"));
        let under = Pattern::parse("*.githubusercontent.com").unwrap();
        assert!(under.matches("raw.githubusercontent.com"));
        assert!(under.matches("a.b.githubusercontent.com"));
        assert!(!under.matches("githubusercontent.com"));
        assert!(!under.matches("evilgithubusercontent.com"));
        assert!(!under.matches("githubusercontent.com.evil.net"));
        for bad in [
            "",
            "*",
            "*.com",
            "a..b",
            "-a.com",
            "a_b.com",
            "1.2.3.4",
            "*.*.a.com",
            "a b",
        ] {
            assert!(Pattern::parse(bad).is_err(), "{bad:?} parsed");
        }
        assert_eq!(under.to_string(), "*.githubusercontent.com");
    }

    #[test]
    fn every_shipped_rule_set_parses() {
        for (name, rules) in RULE_SETS {
            assert!(!rules.is_empty(), "{name}");
            for (host, port) in *rules {
                Pattern::parse(host).unwrap();
                assert!(*port > 0);
            }
        }
        assert!(rule_set("pypi").is_some() && rule_set("nowhere").is_none());
    }

    #[test]
    fn policies_allow_names_on_their_ports() {
        let p = Policy::of(&[("pypi.org", 443), ("*.debian.org", 80)]).unwrap();
        assert!(p.allows("pypi.org", 443) && !p.allows("pypi.org", 80));
        assert!(p.allows("deb.debian.org", 80) && !p.allows("debian.org", 80));
        assert!(p.allows_name("deb.debian.org") && !p.allows_name("example.com"));
        assert_eq!(p.ports(), vec![80, 443]);
    }

    #[test]
    fn answers_into_the_host_or_its_loopback_are_refused() {
        let f = AnswerFilter {
            host: vec![Ipv4Addr::new(10, 1, 2, 3)],
            ranges: vec![(Ipv4Addr::new(10, 231, 0, 0), 16)],
        };
        for no in [
            "127.0.0.1",
            "169.254.169.254",
            "0.0.0.0",
            "10.1.2.3",
            "10.231.0.1",
            "224.0.0.1",
        ] {
            assert!(!f.admits(no.parse().unwrap()), "{no}");
        }
        for yes in ["151.101.0.223", "10.9.9.9", "203.0.113.80"] {
            assert!(f.admits(yes.parse().unwrap()), "{yes}");
        }
    }
}
