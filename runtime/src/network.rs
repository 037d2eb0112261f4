//! Network policy. By default a sandbox has its own empty network namespace: loopback only.
//! With an allowlist it gets a veth pair into a named namespace (`/run/netns/strata-<id>`)
//! and nftables rules on the host side, outside anything the sandbox can touch: packets from
//! its veth reach only allowlisted (address, port) pairs, forwarded or to the host itself;
//! everything else, the host's own addresses and private ranges included, is dropped, and
//! each dropped destination is remembered in a per-sandbox set for the audit record.
//! Rules by name (`pypi.org:443`, `*.debian.org:80`, the rule sets of `strata_egress`) are
//! enforced by the sandbox's egress proxy (`strata-agent egress`, outside the sandbox, on
//! the host side of its veth): every DNS packet the sandbox sends is redirected to the
//! proxy's resolver, every TCP connection to a port a name rule opens to its forwarder,
//! which checks the TLS server name or HTTP Host against the rules and the destination
//! against what its resolver answered. The sandbox's /etc/resolv.conf names the proxy.
//! The allowlist of a running sandbox can be replaced ([`update`]); one created without
//! a network gets its veth then, into the namespace its init already has.
//!
//! Several runtime homes may share a host: namespaces are named after the home
//! (`strata-<home tag>-<id>`), so one home's reap never sees another's, and the /30
//! address slots are claimed host-wide (`/run/strata/net/<slot>`, naming home and
//! sandbox), so two homes never hand out one address.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

use strata_egress::{AnswerFilter, DomainRule, EgressLog, Pattern, Policy, ProxyConfig};

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
}

/// A sandbox's network, set up.
#[derive(Debug, Clone)]
pub struct Network {
    pub netns: PathBuf,
    /// The resolver the sandbox asks (its egress proxy), when rules name hosts.
    pub nameserver: Option<Ipv4Addr>,
}

/// The files of a sandbox's egress proxy, in its directory.
const PROXY_CONFIG: &str = "egress.json";
const PROXY_PID: &str = "egress.pid";
/// The proxy's log of decisions (see [`egress_log`]).
const PROXY_LOG: &str = "egress-log.json";
/// The most connections one sandbox's proxy forwards at once.
const PROXY_CONNECTIONS: usize = 256;

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
    /// The `strata-agent` binary, which runs the egress proxy of rules by name.
    agent: PathBuf,
}

impl Networks {
    /// The networks of the home `state`, claiming slots in `slots` (normally
    /// `/run/strata/net`, shared by every home on the host); `agent` runs egress proxies.
    pub fn new(state: &Path, slots: PathBuf, agent: PathBuf) -> Networks {
        let tag = crate::cgroup::parent_for(state)
            .trim_start_matches("strata-")
            .to_string();
        Networks {
            state: state.to_path_buf(),
            tag,
            slots,
            agent,
        }
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.state.join("sandboxes").join(id)
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

/// Splits the rules: addresses and CIDRs as nft destinations, names (and `*.` patterns)
/// as the egress proxy's policy.
pub fn resolve(rules: &[NetRule]) -> Result<(Vec<Destination>, Policy), RuntimeError> {
    let mut out = Vec::new();
    let mut policy = Policy::default();
    for r in rules {
        let host = r.host.as_str();
        if let Some((a, m)) = parse_cidr(host) {
            let a = Ipv4Addr::from(a);
            out.push(Destination {
                net: if host.contains('/') {
                    format!("{a}/{m}")
                } else {
                    a.to_string()
                },
                port: r.port,
            });
        } else if host.parse::<std::net::IpAddr>().is_ok() {
            return Err(RuntimeError::Invalid(format!(
                "network destination `{host}`: IPv6 is not routed to sandboxes"
            )));
        } else {
            let pattern = Pattern::parse(host)
                .map_err(|e| RuntimeError::Invalid(format!("network destination: {e}")))?;
            policy.rules.push(DomainRule {
                pattern,
                port: r.port,
            });
        }
    }
    Ok((out, policy))
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
         add map {TABLE} sandboxes_nat {{ type ifname : verdict; }}\n\
         add chain {TABLE} prerouting {{ type nat hook prerouting priority -100; }}\n\
         add chain {TABLE} forward {{ type filter hook forward priority 0; policy accept; }}\n\
         add chain {TABLE} input {{ type filter hook input priority 0; policy accept; }}\n\
         add chain {TABLE} postrouting {{ type nat hook postrouting priority 100; }}\n\
         flush chain {TABLE} forward\n\
         flush chain {TABLE} input\n\
         flush chain {TABLE} postrouting\n\
         flush chain {TABLE} prerouting\n\
         add rule {TABLE} prerouting iifname vmap @sandboxes_nat\n\
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
    let (dests, policy) = resolve(rules)?;
    ensure_table()?;
    let slot = allocate_slot(nets, id)?;
    run("ip", &["netns", "add", &nets.netns_name(id)], None)?;
    wire(nets, id, slot, &dests, &policy)
}

/// A VM's network link: the host's side of its tap device and the guest's address on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TapNetwork {
    /// The tap device QEMU opens (`sv<id>`, like a container's veth: the same base
    /// rules and the same per-sandbox chains apply).
    pub device: String,
    pub host: Ipv4Addr,
    pub guest: Ipv4Addr,
    pub prefix: u8,
    /// The resolver the guest asks (its egress proxy), when rules name hosts.
    pub nameserver: Option<Ipv4Addr>,
}

/// The tap device, the rules and the egress proxy of VM sandbox `id`: the guest's NIC is
/// the tap's other end, so its packets meet the host's rules as a container's do at its
/// veth. The device is persistent (a hibernated machine's QEMU opens it again on wake)
/// until [`teardown`].
pub fn setup_tap(nets: &Networks, id: &str, rules: &[NetRule]) -> Result<TapNetwork, RuntimeError> {
    let (dests, policy) = resolve(rules)?;
    ensure_table()?;
    let slot = allocate_slot(nets, id)?;
    let (host_ip, guest_ip) = slot_addrs(slot);
    let v = veth(id);
    run(
        "ip",
        &["-b", "-"],
        Some(&format!(
            "tuntap add dev {v} mode tap vnet_hdr\n\
             addr add {host_ip}/30 dev {v}\n\
             link set {v} up\n"
        )),
    )?;
    Ok(TapNetwork {
        device: v,
        host: host_ip,
        guest: guest_ip,
        prefix: 30,
        nameserver: filter_and_proxy(nets, id, slot, &dests, &policy)?,
    })
}

/// Replaces the allowlist of running sandbox `id` with `rules`, at once (one nft
/// transaction; the egress proxy restarted with the new names). A sandbox without a
/// network yet gets one: the namespace of its init (`init_pid`) is named and wired as
/// [`setup`] wires a new one. The caller records that the sandbox is networked before, so
/// a crash in between leaves nothing untracked.
pub fn update(
    nets: &Networks,
    id: &str,
    init_pid: u32,
    rules: &[NetRule],
) -> Result<Network, RuntimeError> {
    let (dests, policy) = resolve(rules)?;
    if let Some(slot) = wired_slot(nets, id)? {
        let (host_ip, _) = slot_addrs(slot);
        stop_proxy(nets, id);
        // A network wired by an older build has neither the nat map nor its chain.
        ensure_table()?;
        let mut script = format!("flush set {TABLE} allow_{id}\n");
        script.push_str(&add_elements(id, &dests));
        script.push_str(&chain_rules(id, host_ip, &policy));
        run("nft", &["-f", "-"], Some(&script))?;
        return Ok(Network {
            netns: nets.netns_path(id),
            nameserver: start_proxy(nets, id, host_ip, &policy)?,
        });
    }
    ensure_table()?;
    let slot = allocate_slot(nets, id)?;
    let wired = run(
        "ip",
        &[
            "netns",
            "attach",
            &nets.netns_name(id),
            &init_pid.to_string(),
        ],
        None,
    )
    .and_then(|_| wire(nets, id, slot, &dests, &policy));
    if wired.is_err() {
        // Half a network is none: the sandbox stays as it was.
        teardown(nets, id);
    }
    wired
}

/// The address slot of sandbox `id` when it is wired (a veth into its named namespace, or
/// a VM's tap device), so an update replaces only its rules.
fn wired_slot(nets: &Networks, id: &str) -> Result<Option<u32>, RuntimeError> {
    let slot = claimed_slots(nets, id)
        .iter()
        .find_map(|p| p.file_name()?.to_str()?.parse().ok());
    if nets.netns_path(id).exists() && slot.is_none() {
        return Err(RuntimeError::Setup(format!(
            "sandbox {id} has a network but no address slot"
        )));
    }
    Ok(slot.filter(|_| nets.netns_path(id).exists() || link_exists(&veth(id))))
}

/// Whether the host has a network device of this name.
fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

/// Whether VM sandbox `id` has its tap device (it was created with an allowlist).
pub fn has_tap(id: &str) -> bool {
    link_exists(&veth(id))
}

/// A tap device that leads nowhere (no address, no route; the base rules drop whatever
/// comes in on `sv*`), for the maker of a VM template with a network card: QEMU's user
/// network saves state of its own, so a machine saved over one restores only over
/// another; one saved over a tap restores over a sandbox's tap. Removed when dropped;
/// one whose maker died is removed by [`reap_maker_taps`].
pub struct MakerTap {
    pub device: String,
}

impl MakerTap {
    pub fn create() -> Result<MakerTap, RuntimeError> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        // `svt`, the maker's PID and a counter, in hex: at most 15 bytes, and never a
        // sandbox's `sv<12 hex digits>`.
        let device = format!(
            "svt{:x}x{:x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed) & 0xfffff
        );
        run(
            "ip",
            &["tuntap", "add", "dev", &device, "mode", "tap", "vnet_hdr"],
            None,
        )?;
        Ok(MakerTap { device })
    }
}

impl Drop for MakerTap {
    fn drop(&mut self) {
        let _ = run("ip", &["link", "delete", &self.device], None);
    }
}

/// Removes the tap devices of template makers that died.
pub fn reap_maker_taps() {
    let Ok(rd) = std::fs::read_dir("/sys/class/net") else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let maker = name
            .strip_prefix("svt")
            .and_then(|rest| rest.split_once('x'))
            .and_then(|(pid, _)| u32::from_str_radix(pid, 16).ok());
        if let Some(pid) = maker {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = run("ip", &["link", "delete", &name], None);
            }
        }
    }
}

/// Whether anything of a network of sandbox `id` may be on this host (its named
/// namespace, its veth or tap, an address slot): what its end must tear down, whatever
/// its record says now (an allowlist emptied while it ran keeps its link).
pub fn maybe_wired(nets: &Networks, id: &str) -> bool {
    nets.netns_path(id).exists() || link_exists(&veth(id)) || !claimed_slots(nets, id).is_empty()
}

/// The veth pair into the named namespace of `id`, its addresses and route, its rules
/// allowing `dests`, and the egress proxy of `policy`.
fn wire(
    nets: &Networks,
    id: &str,
    slot: u32,
    dests: &[Destination],
    policy: &Policy,
) -> Result<Network, RuntimeError> {
    let (host_ip, sandbox_ip) = slot_addrs(slot);
    let (ns, v) = (nets.netns_name(id), veth(id));
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
    Ok(Network {
        netns: nets.netns_path(id),
        nameserver: filter_and_proxy(nets, id, slot, dests, policy)?,
    })
}

/// Sandbox `id`'s sets and chains for the link of `slot` (its veth or tap), and its
/// egress proxy; the resolver it is to use.
fn filter_and_proxy(
    nets: &Networks,
    id: &str,
    slot: u32,
    dests: &[Destination],
    policy: &Policy,
) -> Result<Option<Ipv4Addr>, RuntimeError> {
    let (host_ip, _) = slot_addrs(slot);
    let mut script = format!(
        "add set {TABLE} allow_{id} {{ type ipv4_addr . inet_service; flags interval; }}\n\
         add set {TABLE} tried_{id} {{ type ipv4_addr . inet_service; flags dynamic,timeout; \
         timeout {TRIED_TIMEOUT_S}s; size {TRIED_SIZE}; counter; }}\n"
    );
    script.push_str(&add_elements(id, dests));
    script.push_str(&chain_rules(id, host_ip, policy));
    run("nft", &["-f", "-"], Some(&script))?;
    start_proxy(nets, id, host_ip, policy)
}

/// Sandbox `id`'s chains, made if missing (a network wired by an older build has no nat
/// chain) and joined to the base chains' maps, their rules replacing what they held. The
/// filter chain (forward and input) lets through the allow set and, with rules by name,
/// the proxy's two ports on the host side of the veth; everything else is remembered and
/// dropped. The nat chain (prerouting) sends every DNS packet and every TCP connection to
/// a port a name rule opens (not an allowed address) to the proxy.
fn chain_rules(id: &str, host_ip: Ipv4Addr, policy: &Policy) -> String {
    let v = veth(id);
    // Only the sandbox's own address: a VM guest's kernel, or root in a container, could
    // write packets from another (another sandbox's, whose replies it would then steer).
    let sandbox_ip = Ipv4Addr::from(u32::from(host_ip) + 1);
    let mut script = format!(
        "add chain {TABLE} sb_{id}\n\
         add chain {TABLE} nat_{id}\n\
         add counter {TABLE} untracked_{id}\n\
         add element {TABLE} sandboxes {{ \"{v}\" : jump sb_{id} }}\n\
         add element {TABLE} sandboxes_nat {{ \"{v}\" : jump nat_{id} }}\n\
         flush chain {TABLE} sb_{id}\n\
         flush chain {TABLE} nat_{id}\n\
         add rule {TABLE} sb_{id} ip saddr != {sandbox_ip} drop\n\
         add rule {TABLE} sb_{id} ip daddr . tcp dport @allow_{id} accept\n\
         add rule {TABLE} sb_{id} ip daddr . udp dport @allow_{id} accept\n"
    );
    let ports = policy.ports();
    if !ports.is_empty() {
        let ports = ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let fwd = strata_egress::FORWARD_PORT;
        script.push_str(&format!(
            "add rule {TABLE} sb_{id} ip daddr {host_ip} udp dport 53 accept\n\
             add rule {TABLE} sb_{id} ip daddr {host_ip} tcp dport {fwd} accept\n\
             add rule {TABLE} nat_{id} udp dport 53 redirect to :53\n\
             add rule {TABLE} nat_{id} ip daddr . tcp dport @allow_{id} return\n\
             add rule {TABLE} nat_{id} tcp dport {{ {ports} }} redirect to :{fwd}\n"
        ));
    }
    script.push_str(&format!(
        "add rule {TABLE} sb_{id} meta l4proto {{ tcp, udp }} add @tried_{id} {{ ip daddr . th dport }} drop\n\
         add rule {TABLE} sb_{id} counter name untracked_{id} drop\n"
    ));
    script
}

/// The slot files sandbox `id` of this home holds (one, unless a crash left more).
fn claimed_slots(nets: &Networks, id: &str) -> Vec<PathBuf> {
    let owner = nets.owner(id);
    let Ok(rd) = std::fs::read_dir(&nets.slots) else {
        return Vec::new();
    };
    rd.flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::read_to_string(p).is_ok_and(|o| o == owner))
        .collect()
}

/// Starts the egress proxy of sandbox `id` on `host_ip` when `policy` names hosts; the
/// resolver the sandbox is to use then.
fn start_proxy(
    nets: &Networks,
    id: &str,
    host_ip: Ipv4Addr,
    policy: &Policy,
) -> Result<Option<Ipv4Addr>, RuntimeError> {
    if policy.rules.is_empty() {
        return Ok(None);
    }
    let dir = nets.sandbox_dir(id);
    let cfg = ProxyConfig {
        listen: host_ip,
        dns_port: 53,
        forward_port: strata_egress::FORWARD_PORT,
        policy: policy.clone(),
        filter: AnswerFilter {
            host: host_addresses(),
            ranges: vec![(Ipv4Addr::new(POOL[0], POOL[1], 0, 0), 16)],
        },
        log: dir.join(PROXY_LOG),
        alive: dir.clone(),
        max_connections: PROXY_CONNECTIONS,
    };
    let config = dir.join(PROXY_CONFIG);
    let text = serde_json::to_vec(&cfg).map_err(|e| RuntimeError::Setup(e.to_string()))?;
    std::fs::write(&config, text).map_err(RuntimeError::io(&config))?;
    let agent = nets.agent.to_string_lossy().into_owned();
    let pid = run(&agent, &["egress", &config.to_string_lossy()], None)?;
    let pid_file = dir.join(PROXY_PID);
    std::fs::write(&pid_file, pid.trim()).map_err(RuntimeError::io(&pid_file))?;
    Ok(Some(host_ip))
}

/// Ends the egress proxy of sandbox `id`, if it runs (it would end by itself once the
/// sandbox's directory is gone).
fn stop_proxy(nets: &Networks, id: &str) {
    let dir = nets.sandbox_dir(id);
    let Some(pid) = std::fs::read_to_string(dir.join(PROXY_PID))
        .ok()
        .and_then(|p| p.trim().parse::<i32>().ok())
    else {
        return;
    };
    // Only the proxy of this sandbox: a PID reused since is left alone.
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let config = dir.join(PROXY_CONFIG);
    if String::from_utf8_lossy(&cmdline).contains(&*config.to_string_lossy()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let _ = std::fs::remove_file(dir.join(PROXY_PID));
}

/// The decisions of sandbox `id`'s egress proxy so far (empty without one).
pub fn egress_log(nets: &Networks, id: &str) -> EgressLog {
    EgressLog::read(&nets.sandbox_dir(id).join(PROXY_LOG)).unwrap_or_default()
}

/// The host's own IPv4 addresses (no answer may send a sandbox to them).
fn host_addresses() -> Vec<Ipv4Addr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    addrs
        .filter_map(|a| {
            a.address
                .and_then(|sa| sa.as_sockaddr_in().map(|sin| sin.ip()))
        })
        .collect()
}

/// The nft line adding `dests` to the allow set of `id` (none when empty). A range
/// inside another of the same port is left out: an interval set refuses overlaps.
fn add_elements(id: &str, dests: &[Destination]) -> String {
    let ranges: Vec<Option<(u32, u8)>> = dests.iter().map(|d| parse_cidr(&d.net)).collect();
    let mut elements: Vec<String> = Vec::new();
    for (i, d) in dests.iter().enumerate() {
        let covered = ranges[i].is_some_and(|r| {
            dests.iter().enumerate().any(|(j, o)| {
                j != i
                    && o.port == d.port
                    && ranges[j].is_some_and(|q| contains(q, r) && (q != r || j < i))
            })
        });
        if !covered {
            elements.push(format!("{} . {}", d.net, d.port));
        }
    }
    if elements.is_empty() {
        return String::new();
    }
    format!(
        "add element {TABLE} allow_{id} {{ {} }}\n",
        elements.join(", ")
    )
}

/// `a.b.c.d` or `a.b.c.d/m` as (network address, prefix length).
fn parse_cidr(text: &str) -> Option<(u32, u8)> {
    let (addr, len) = match text.split_once('/') {
        Some((a, m)) => (a, m.parse::<u8>().ok().filter(|m| *m <= 32)?),
        None => (text, 32),
    };
    let a = u32::from(addr.parse::<Ipv4Addr>().ok()?);
    Some((a & mask(len), len))
}

fn mask(len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len))
    }
}

/// Whether range `outer` holds all of range `inner`.
fn contains(outer: (u32, u8), inner: (u32, u8)) -> bool {
    outer.1 <= inner.1 && inner.0 & mask(outer.1) == outer.0
}

/// Ranges no sandbox reaches through "the internet": this network, private, shared
/// (carrier NAT), loopback, link-local (cloud metadata services), protocol
/// assignments, documentation, benchmarking, multicast and reserved (RFC 6890).
const NOT_PUBLIC: [&str; 14] = [
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// The public IPv4 internet, less the addresses and ranges in `except`, as CIDR ranges
/// (what "open internet" allows: never the host's network, its neighbours or a cloud's
/// metadata service).
pub fn public_ranges(except: &[String]) -> Result<Vec<String>, RuntimeError> {
    let mut holes: Vec<(u32, u8)> = NOT_PUBLIC.iter().filter_map(|c| parse_cidr(c)).collect();
    for e in except {
        holes.push(parse_cidr(e).ok_or_else(|| {
            RuntimeError::Invalid(format!(
                "`{e}` is not an IPv4 address or range (a.b.c.d or a.b.c.d/len)"
            ))
        })?);
    }
    let mut out = Vec::new();
    let mut todo = vec![(0u32, 0u8)];
    while let Some(r) = todo.pop() {
        if holes.iter().any(|h| contains(*h, r)) {
            continue;
        }
        if holes.iter().any(|h| contains(r, *h)) {
            let half = 1u32 << (31 - u32::from(r.1));
            todo.push((r.0 | half, r.1 + 1));
            todo.push((r.0, r.1 + 1));
            continue;
        }
        out.push(r);
    }
    out.sort();
    Ok(out
        .into_iter()
        .map(|(a, l)| format!("{}/{l}", Ipv4Addr::from(a)))
        .collect())
}

/// How long a refused destination stays in a sandbox's record of attempts: its first
/// attempt's time is read back from what is left of this (so entries never refresh).
const TRIED_TIMEOUT_S: u64 = 90 * 24 * 3600;
/// The most distinct refused destinations recorded; packets beyond them are counted in
/// the `untracked_` counter.
const TRIED_SIZE: u32 = 4096;

/// One destination a sandbox tried and was refused.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Attempt {
    /// `address:port`.
    pub destination: String,
    /// Packets sent to it (a connection's retries count each).
    pub packets: u64,
    /// When the first was refused, milliseconds since the epoch (to the second); absent
    /// for a network wired by an older build.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_ms: Option<u64>,
}

/// What a sandbox tried and was refused: each destination (TCP and UDP) with its count
/// and first time, and the packets not recorded by destination (other protocols, or
/// beyond the record's size).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Refused {
    pub attempts: Vec<Attempt>,
    pub untracked_packets: u64,
}

impl Refused {
    pub fn is_empty(&self) -> bool {
        self.attempts.is_empty() && self.untracked_packets == 0
    }
}

/// What sandbox `id` tried and was refused, from its nftables set and counter.
pub fn refused(id: &str) -> Refused {
    let nft_json = |args: &[&str]| {
        run("nft", args, None)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let mut out = Refused::default();
    let set = nft_json(&[
        "-j",
        "list",
        "set",
        "inet",
        "strata",
        &format!("tried_{id}"),
    ]);
    out.attempts = parse_tried(set.as_ref(), now_ms);
    let counter = nft_json(&[
        "-j",
        "list",
        "counter",
        "inet",
        "strata",
        &format!("untracked_{id}"),
    ]);
    out.untracked_packets = counter
        .as_ref()
        .and_then(|v| v["nftables"].as_array())
        .into_iter()
        .flatten()
        .find_map(|item| item["counter"]["packets"].as_u64())
        .unwrap_or(0);
    out
}

/// The attempts in `nft -j list set` output of a `tried_` set, at `now_ms`.
fn parse_tried(v: Option<&serde_json::Value>, now_ms: u64) -> Vec<Attempt> {
    let mut out = Vec::new();
    let items = v
        .and_then(|v| v["nftables"].as_array())
        .into_iter()
        .flatten();
    for item in items {
        let set = &item["set"];
        let timeout = set["timeout"].as_u64();
        for e in set["elem"].as_array().into_iter().flatten() {
            // An element with stateful parts is `{"elem": {"val": ..., "expires": ...}}`.
            let (val, facts) = match e["elem"].as_object() {
                Some(_) => (&e["elem"]["val"], &e["elem"]),
                None => (e, e),
            };
            let Some(c) = val["concat"].as_array() else {
                continue;
            };
            let (Some(a), Some(p)) = (
                c.first().and_then(|a| a.as_str()),
                c.get(1).and_then(|p| p.as_u64()),
            ) else {
                continue;
            };
            // Added once and never refreshed: its age is the timeout less what is left.
            let first_ms = match (timeout, facts["expires"].as_u64()) {
                (Some(t), Some(left)) => Some(now_ms.saturating_sub(t.saturating_sub(left) * 1000)),
                _ => None,
            };
            out.push(Attempt {
                destination: format!("{a}:{p}"),
                packets: facts["counter"]["packets"].as_u64().unwrap_or(1),
                first_ms,
            });
        }
    }
    out.sort_by(|a, b| a.destination.cmp(&b.destination));
    out
}

/// Removes the rules, the veth and the namespace of sandbox `id`; tolerates any of them
/// being gone already.
pub fn teardown(nets: &Networks, id: &str) {
    stop_proxy(nets, id);
    let v = veth(id);
    for map in ["sandboxes", "sandboxes_nat"] {
        let script = format!("delete element {TABLE} {map} {{ \"{v}\" }}\n");
        let _ = run("nft", &["-f", "-"], Some(&script));
    }
    for obj in [
        format!("chain {TABLE} sb_{id}"),
        format!("chain {TABLE} nat_{id}"),
        format!("set {TABLE} allow_{id}"),
        format!("set {TABLE} tried_{id}"),
        format!("counter {TABLE} untracked_{id}"),
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
    for slot in claimed_slots(nets, id) {
        let _ = std::fs::remove_file(slot);
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
    #[test]
    fn refused_attempts_read_back_with_their_count_and_first_time() {
        // What `nft -j list set` printed on Debian 12's nftables 1.0.6 after three SYNs to
        // one destination and one to another, 7 and 4 s after they were first refused; and
        // an element of a set an older build made (no counter, no timeout).
        let now = 1_800_000_000_000;
        let v: serde_json::Value = serde_json::from_str(
            r#"{"nftables": [{"metainfo": {"version": "1.0.6"}}, {"set": {"family": "inet",
            "name": "tried", "table": "strata", "type": ["ipv4_addr", "inet_service"],
            "flags": ["timeout"], "timeout": 604800, "elem": [
            {"elem": {"val": {"concat": ["192.0.2.8", 82]}, "expires": 604796, "counter": {"packets": 1, "bytes": 60}}},
            {"elem": {"val": {"concat": ["192.0.2.7", 81]}, "expires": 604793, "counter": {"packets": 3, "bytes": 180}}}]}},
            {"set": {"name": "old", "elem": [{"concat": ["10.0.0.1", 80]}]}}]}"#,
        )
        .unwrap();
        assert_eq!(
            parse_tried(Some(&v), now),
            vec![
                Attempt {
                    destination: "10.0.0.1:80".into(),
                    packets: 1,
                    first_ms: None
                },
                Attempt {
                    destination: "192.0.2.7:81".into(),
                    packets: 3,
                    first_ms: Some(now - 7_000)
                },
                Attempt {
                    destination: "192.0.2.8:82".into(),
                    packets: 1,
                    first_ms: Some(now - 4_000)
                },
            ]
        );
        assert!(parse_tried(None, now).is_empty());
    }

    use super::*;

    #[test]
    fn rules_split_into_addresses_and_names() {
        let rule = |host: &str, port| NetRule {
            host: host.into(),
            port,
        };
        let (d, policy) = resolve(&[
            rule("10.0.0.0/8", 80),
            rule("192.0.2.7", 443),
            rule("localhost", 22),
            rule("*.debian.org", 80),
        ])
        .unwrap();
        assert_eq!(d[0].net, "10.0.0.0/8");
        assert_eq!(d[1].net, "192.0.2.7");
        assert_eq!(d.len(), 2, "a name became an address: {d:?}");
        assert!(policy.allows("localhost", 22) && policy.allows("deb.debian.org", 80));
        assert!(!policy.allows("localhost", 80));
        assert!(resolve(&[rule("::1", 80)]).is_err());
        let (h, s) = slot_addrs(1);
        assert_eq!(
            (h, s),
            (Ipv4Addr::new(10, 231, 0, 5), Ipv4Addr::new(10, 231, 0, 6))
        );
    }

    #[test]
    fn name_rules_send_dns_and_their_ports_to_the_proxy() {
        let (_, policy) = resolve(&[
            NetRule {
                host: "pypi.org".into(),
                port: 443,
            },
            NetRule {
                host: "1.2.3.4".into(),
                port: 443,
            },
        ])
        .unwrap();
        let host = Ipv4Addr::new(10, 231, 0, 1);
        let with = chain_rules("x", host, &policy);
        assert!(
            with.contains("nat_x udp dport 53 redirect to :53"),
            "{with}"
        );
        assert!(
            with.contains("nat_x ip daddr . tcp dport @allow_x return"),
            "{with}"
        );
        assert!(
            with.contains("tcp dport { 443 } redirect to :3129"),
            "{with}"
        );
        assert!(
            with.contains("ip daddr 10.231.0.1 udp dport 53 accept"),
            "{with}"
        );
        let without = chain_rules("x", host, &Policy::default());
        assert!(
            !without.contains("redirect") && !without.contains("dport 53"),
            "{without}"
        );
        // Only the sandbox's own address is let out, first; whatever it sends that is not
        // allowed is remembered and dropped, last.
        for script in [with, without] {
            let spoof = script
                .find("sb_x ip saddr != 10.231.0.2 drop")
                .expect("the address check");
            assert!(
                spoof < script.find("accept").expect("an accept"),
                "{script}"
            );
            assert!(script
                .trim_end()
                .ends_with("add rule inet strata sb_x counter name untracked_x drop"));
        }
    }

    #[test]
    fn the_public_internet_leaves_out_private_and_metadata_ranges() {
        let public = public_ranges(&[]).unwrap();
        let ranges: Vec<(u32, u8)> = public.iter().map(|c| parse_cidr(c).unwrap()).collect();
        let inside = |a: &str| {
            let a = parse_cidr(a).unwrap();
            ranges.iter().any(|r| contains(*r, a))
        };
        for private in [
            "10.1.2.3",
            "172.20.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "127.0.0.1",
            "100.100.0.1",
            "224.0.0.251",
            "255.255.255.255",
        ] {
            assert!(!inside(private), "{private} counts as public");
        }
        for open in [
            "1.1.1.1",
            "8.8.8.8",
            "151.101.0.223",
            "172.15.255.255",
            "11.0.0.0",
        ] {
            assert!(inside(open), "{open} is left out");
        }
        // Disjoint, so nft's interval set takes them.
        for (i, a) in ranges.iter().enumerate() {
            for b in &ranges[i + 1..] {
                assert!(!contains(*a, *b) && !contains(*b, *a), "{a:?} {b:?}");
            }
        }
        let less = public_ranges(&["8.8.8.8".into(), "1.0.0.0/8".into()]).unwrap();
        assert!(less.len() > public.len());
        assert!(!less.iter().any(|c| c.starts_with("1.0.0.0/")));
        assert!(public_ranges(&["example.com".into()]).is_err());
    }

    #[test]
    fn contained_ranges_of_one_port_are_added_once() {
        let d = |net: &str, port| Destination {
            net: net.into(),
            port,
        };
        let line = add_elements(
            "x",
            &[
                d("0.0.0.0/0", 443),
                d("151.101.0.223", 443),
                d("151.101.0.223", 80),
                d("151.101.0.223", 80),
                d("10.0.0.0/8", 22),
            ],
        );
        assert_eq!(
            line,
            "add element inet strata allow_x { 0.0.0.0/0 . 443, 151.101.0.223 . 80, 10.0.0.0/8 . 22 }\n"
        );
        assert_eq!(add_elements("x", &[]), "");
    }

    #[test]
    fn two_homes_claim_distinct_slots_and_see_only_their_own() {
        let slots = tempfile::tempdir().unwrap();
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let na = Networks::new(a.path(), slots.path().to_path_buf(), "strata-agent".into());
        let nb = Networks::new(b.path(), slots.path().to_path_buf(), "strata-agent".into());
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
