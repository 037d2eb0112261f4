//! Network policy. By default a sandbox has its own empty network namespace: loopback only.
//! With an allowlist it gets a veth pair into a named namespace (`/run/netns/strata-<id>`)
//! and nftables rules on the host side, outside anything the sandbox can touch: packets from
//! its veth reach only allowlisted (address, port) pairs, forwarded or to the host itself;
//! everything else, the host's own addresses and private ranges included, is dropped, and
//! each dropped destination is remembered in a per-sandbox set for the audit record.
//! Host names are resolved when the sandbox is created and written to its /etc/hosts.
//!
//! Several runtime homes may share a host: namespaces are named after the home
//! (`strata-<home tag>-<id>`), so one home's reap never sees another's, and the /30
//! address slots are claimed host-wide (`/run/strata/net/<slot>`, naming home and
//! sandbox), so two homes never hand out one address.

use std::net::{Ipv4Addr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::spec::NetRule;
use crate::RuntimeError;

const TABLE: &str = "inet strata";
/// Each sandbox gets a /30 out of this /16: host side .1, sandbox .2.
const POOL: [u8; 2] = [10, 231];
const SLOTS: u32 = 16384;

/// An allowed destination after resolution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// An address or CIDR, as nft writes it.
    pub net: String,
    pub port: u16,
    /// The name it was resolved from, for /etc/hosts.
    pub name: Option<String>,
}

/// A sandbox's network, set up.
#[derive(Debug, Clone)]
pub struct Network {
    pub netns: PathBuf,
    pub hosts: Vec<(Ipv4Addr, String)>,
}

fn veth(id: &str) -> String {
    format!("sv{id}")
}

/// The networks of one runtime home.
#[derive(Debug, Clone)]
pub struct Networks {
    /// The home's state directory (owner of its slots).
    state: PathBuf,
    /// Short name of the home in namespace names.
    tag: String,
    /// Where /30 slots are claimed, host-wide.
    slots: PathBuf,
}

impl Networks {
    /// The networks of the home `state`, claiming slots in `slots` (normally
    /// `/run/strata/net`, shared by every home on the host).
    pub fn new(state: &Path, slots: PathBuf) -> Networks {
        let tag = crate::cgroup::parent_for(state)
            .trim_start_matches("strata-")
            .to_string();
        Networks {
            state: state.to_path_buf(),
            tag,
            slots,
        }
    }

    fn netns_name(&self, id: &str) -> String {
        format!("strata-{}-{id}", self.tag)
    }

    pub fn netns_path(&self, id: &str) -> PathBuf {
        Path::new("/run/netns").join(self.netns_name(id))
    }

    /// What a slot file of this home's sandbox `id` holds.
    fn owner(&self, id: &str) -> String {
        format!("{}\t{id}\n", self.state.display())
    }
}

/// Resolves the rules: names through the host's resolver (IPv4), CIDRs as given.
pub fn resolve(rules: &[NetRule]) -> Result<Vec<Destination>, RuntimeError> {
    let mut out = Vec::new();
    for r in rules {
        let host = r.host.as_str();
        let cidr = host.split_once('/').and_then(|(a, m)| {
            let a: Ipv4Addr = a.parse().ok()?;
            let m: u8 = m.parse().ok()?;
            (m <= 32).then_some((a, m))
        });
        if let Some((a, m)) = cidr {
            out.push(Destination {
                net: format!("{a}/{m}"),
                port: r.port,
                name: None,
            });
        } else if let Ok(a) = host.parse::<Ipv4Addr>() {
            out.push(Destination {
                net: a.to_string(),
                port: r.port,
                name: None,
            });
        } else {
            let addrs: Vec<Ipv4Addr> = (host, r.port)
                .to_socket_addrs()
                .map_err(|e| {
                    RuntimeError::Invalid(format!(
                        "network destination `{host}`: cannot resolve: {e}"
                    ))
                })?
                .filter_map(|sa| match sa.ip() {
                    std::net::IpAddr::V4(a) => Some(a),
                    std::net::IpAddr::V6(_) => None,
                })
                .collect();
            if addrs.is_empty() {
                return Err(RuntimeError::Invalid(format!(
                    "network destination `{host}` has no IPv4 address (IPv6 is not routed to sandboxes)"
                )));
            }
            for a in addrs {
                out.push(Destination {
                    net: a.to_string(),
                    port: r.port,
                    name: Some(host.to_string()),
                });
            }
        }
    }
    Ok(out)
}

fn run(program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, RuntimeError> {
    crate::run_tool(Command::new(program).args(args), stdin)
}

/// Claims a /30 slot for a sandbox: a file created exclusively in the host-wide slot
/// directory, so concurrent creates, of any home, never share one.
fn allocate_slot(nets: &Networks, id: &str) -> Result<u32, RuntimeError> {
    let dir = &nets.slots;
    std::fs::create_dir_all(dir).map_err(RuntimeError::io(dir))?;
    let start = id
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32))
        % SLOTS;
    for i in 0..SLOTS {
        let slot = (start + i) % SLOTS;
        let path = dir.join(slot.to_string());
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(mut f) => {
                std::io::Write::write_all(&mut f, nets.owner(id).as_bytes())
                    .map_err(RuntimeError::io(&path))?;
                return Ok(slot);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(RuntimeError::io(&path)(e)),
        }
    }
    Err(RuntimeError::Setup("no free sandbox network slot".into()))
}

fn slot_addrs(slot: u32) -> (Ipv4Addr, Ipv4Addr) {
    let base = u32::from(Ipv4Addr::new(POOL[0], POOL[1], 0, 0)) + slot * 4;
    (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
}

/// The table, base chains and masquerading shared by every sandbox (idempotent).
fn ensure_table() -> Result<(), RuntimeError> {
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
        .map_err(RuntimeError::io(Path::new("/proc/sys/net/ipv4/ip_forward")))?;
    let script = format!(
        "add table {TABLE}\n\
         add map {TABLE} sandboxes {{ type ifname : verdict; }}\n\
         add chain {TABLE} forward {{ type filter hook forward priority 0; policy accept; }}\n\
         add chain {TABLE} input {{ type filter hook input priority 0; policy accept; }}\n\
         add chain {TABLE} postrouting {{ type nat hook postrouting priority 100; }}\n\
         flush chain {TABLE} forward\n\
         flush chain {TABLE} input\n\
         flush chain {TABLE} postrouting\n\
         add rule {TABLE} forward iifname vmap @sandboxes\n\
         add rule {TABLE} forward iifname \"sv*\" drop\n\
         add rule {TABLE} input iifname vmap @sandboxes\n\
         add rule {TABLE} input iifname \"sv*\" drop\n\
         add rule {TABLE} postrouting ip saddr {}.{}.0.0/16 oifname != \"sv*\" masquerade\n",
        POOL[0], POOL[1]
    );
    run("nft", &["-f", "-"], Some(&script)).map(|_| ())
}

/// Creates the namespace, the veth pair and the rules for sandbox `id`.
pub fn setup(nets: &Networks, id: &str, rules: &[NetRule]) -> Result<Network, RuntimeError> {
    let dests = resolve(rules)?;
    ensure_table()?;
    let slot = allocate_slot(nets, id)?;
    let (host_ip, sandbox_ip) = slot_addrs(slot);
    let (ns, v) = (nets.netns_name(id), veth(id));
    run("ip", &["netns", "add", &ns], None)?;
    run(
        "ip",
        &["-b", "-"],
        Some(&format!(
            "link add {v} type veth peer name eth0 netns {ns}\n\
             addr add {host_ip}/30 dev {v}\n\
             link set {v} up\n"
        )),
    )?;
    run(
        "ip",
        &["-n", &ns, "-b", "-"],
        Some(&format!(
            "addr add {sandbox_ip}/30 dev eth0\n\
             link set eth0 up\n\
             link set lo up\n\
             route add default via {host_ip}\n"
        )),
    )?;
    let elements: Vec<String> = dests
        .iter()
        .map(|d| format!("{} . {}", d.net, d.port))
        .collect();
    let mut script = format!(
        "add set {TABLE} allow_{id} {{ type ipv4_addr . inet_service; flags interval; }}\n\
         add set {TABLE} tried_{id} {{ type ipv4_addr . inet_service; flags dynamic; size 4096; }}\n\
         add chain {TABLE} sb_{id}\n"
    );
    if !elements.is_empty() {
        script.push_str(&format!(
            "add element {TABLE} allow_{id} {{ {} }}\n",
            elements.join(", ")
        ));
    }
    script.push_str(&format!(
        "add rule {TABLE} sb_{id} ip daddr . tcp dport @allow_{id} accept\n\
         add rule {TABLE} sb_{id} ip daddr . udp dport @allow_{id} accept\n\
         add rule {TABLE} sb_{id} meta l4proto {{ tcp, udp }} add @tried_{id} {{ ip daddr . th dport }} drop\n\
         add rule {TABLE} sb_{id} drop\n\
         add element {TABLE} sandboxes {{ \"{v}\" : jump sb_{id} }}\n"
    ));
    run("nft", &["-f", "-"], Some(&script))?;
    let hosts = dests
        .iter()
        .filter_map(|d| Some((d.net.parse().ok()?, d.name.clone()?)))
        .collect();
    Ok(Network {
        netns: nets.netns_path(id),
        hosts,
    })
}

/// Destinations the sandbox tried and was refused (`address:port`).
pub fn refused(id: &str) -> Vec<String> {
    let Ok(text) = run(
        "nft",
        &[
            "-j",
            "list",
            "set",
            "inet",
            "strata",
            &format!("tried_{id}"),
        ],
        None,
    ) else {
        return Vec::new();
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for item in v["nftables"].as_array().into_iter().flatten() {
        for e in item["set"]["elem"].as_array().into_iter().flatten() {
            let concat = e["concat"]
                .as_array()
                .or_else(|| e["elem"]["val"]["concat"].as_array());
            if let Some(c) = concat {
                if let (Some(a), Some(p)) = (
                    c.first().and_then(|a| a.as_str()),
                    c.get(1).and_then(|p| p.as_u64()),
                ) {
                    out.push(format!("{a}:{p}"));
                }
            }
        }
    }
    out.sort();
    out
}

/// Removes the rules, the veth and the namespace of sandbox `id`; tolerates any of them
/// being gone already.
pub fn teardown(nets: &Networks, id: &str) {
    let v = veth(id);
    let script = format!("delete element {TABLE} sandboxes {{ \"{v}\" }}\n");
    let _ = run("nft", &["-f", "-"], Some(&script));
    for obj in [
        format!("chain {TABLE} sb_{id}"),
        format!("set {TABLE} allow_{id}"),
        format!("set {TABLE} tried_{id}"),
    ] {
        let _ = run("nft", &["-f", "-"], Some(&format!("delete {obj}\n")));
    }
    let _ = run("ip", &["link", "delete", &v], None);
    // And the name an older build gave it (`strata-<id>`, its slot in the home).
    for ns in [nets.netns_name(id), format!("strata-{id}")] {
        if Path::new("/run/netns").join(&ns).exists() {
            let _ = run("ip", &["netns", "delete", &ns], None);
        }
    }
    let owner = nets.owner(id);
    if let Ok(rd) = std::fs::read_dir(&nets.slots) {
        for e in rd.flatten() {
            if std::fs::read_to_string(e.path()).is_ok_and(|o| o == owner) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    if let Ok(rd) = std::fs::read_dir(nets.state.join("net")) {
        for e in rd.flatten() {
            if std::fs::read_to_string(e.path()).is_ok_and(|o| o == id) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// This home's sandbox IDs with a network namespace or slot on this host.
pub fn existing(nets: &Networks) -> Vec<String> {
    let mut ids = std::collections::BTreeSet::new();
    let prefix = format!("strata-{}-", nets.tag);
    if let Ok(rd) = std::fs::read_dir("/run/netns") {
        for e in rd.flatten() {
            if let Some(id) = e.file_name().to_str().and_then(|n| n.strip_prefix(&prefix)) {
                ids.insert(id.to_string());
            }
        }
    }
    let mine = format!("{}\t", nets.state.display());
    if let Ok(rd) = std::fs::read_dir(&nets.slots) {
        for e in rd.flatten() {
            if let Ok(owner) = std::fs::read_to_string(e.path()) {
                if let Some(id) = owner.strip_prefix(&mine) {
                    ids.insert(id.trim().to_string());
                }
            }
        }
    }
    // Slots an older build claimed inside the home.
    if let Ok(rd) = std::fs::read_dir(nets.state.join("net")) {
        for e in rd.flatten() {
            if let Ok(owner) = std::fs::read_to_string(e.path()) {
                ids.insert(owner);
            }
        }
    }
    ids.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_resolve_to_addresses_and_cidrs() {
        let d = resolve(&[
            NetRule {
                host: "10.0.0.0/8".into(),
                port: 80,
            },
            NetRule {
                host: "192.0.2.7".into(),
                port: 443,
            },
            NetRule {
                host: "localhost".into(),
                port: 22,
            },
        ])
        .unwrap();
        assert_eq!(d[0].net, "10.0.0.0/8");
        assert_eq!(d[1].net, "192.0.2.7");
        assert!(d
            .iter()
            .any(|x| x.name.as_deref() == Some("localhost") && x.net == "127.0.0.1"));
        assert!(resolve(&[NetRule {
            host: "no-such-host.invalid".into(),
            port: 1
        }])
        .is_err());
        let (h, s) = slot_addrs(1);
        assert_eq!(
            (h, s),
            (Ipv4Addr::new(10, 231, 0, 5), Ipv4Addr::new(10, 231, 0, 6))
        );
    }

    #[test]
    fn two_homes_claim_distinct_slots_and_see_only_their_own() {
        let slots = tempfile::tempdir().unwrap();
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let na = Networks::new(a.path(), slots.path().to_path_buf());
        let nb = Networks::new(b.path(), slots.path().to_path_buf());
        assert_ne!(na.netns_name("x"), nb.netns_name("x"));
        // The same sandbox ID in both homes still gets two addresses.
        let sa = allocate_slot(&na, "abc").unwrap();
        let sb = allocate_slot(&nb, "abc").unwrap();
        assert_ne!(sa, sb);
        assert_eq!(existing(&na), vec!["abc".to_string()]);
        teardown(&nb, "abc");
        assert_eq!(
            existing(&na),
            vec!["abc".to_string()],
            "b's teardown took a's slot"
        );
        assert!(existing(&nb).is_empty());
        assert!(slots.path().join(sa.to_string()).exists());
        assert!(!slots.path().join(sb.to_string()).exists());
    }
}
