//! The root of a sandbox whose processes run on the host's kernel (fncall, container):
//! its writable upper (a pooled one, or a fresh image), its layers stacked with overlayfs
//! under it, and the network namespace of an allowlist, its /etc/resolv.conf naming the
//! egress proxy when rules name hosts; and the launch mount namespace such sandboxes
//! start from.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::backend::{Host, NewSandbox};
use crate::{files, network, rootfs, RuntimeError};

/// The launch mount namespace's template (`strata_host::mountns`), shared by the host
/// backends: made at the first OCI runtime call or agent start of this process (an
/// embedded CLI call that starts nothing pays nothing).
pub(crate) struct LaunchNamespace {
    state_dir: PathBuf,
    template: OnceLock<Option<strata_host::mountns::Template>>,
}

impl LaunchNamespace {
    pub(crate) fn new(state_dir: PathBuf) -> LaunchNamespace {
        LaunchNamespace {
            state_dir,
            template: OnceLock::new(),
        }
    }

    /// The template, or none where this host cannot make one (sandboxes then start from
    /// the host's namespace: slower with many sandboxes, the same otherwise).
    pub(crate) fn template(&self) -> Option<&strata_host::mountns::Template> {
        self.template
            .get_or_init(|| {
                strata_host::mountns::Template::new(&self.state_dir)
                    // A host that refuses open_tree (a seccomp profile) could make the
                    // template but carry nothing into it.
                    .and_then(|t| strata_host::mountns::can_carry().map(|()| t))
                    .inspect_err(|e| {
                        tracing::warn!(
                            "no launch mount namespace ({e}): sandboxes start in the host's"
                        )
                    })
                    .ok()
            })
            .as_ref()
    }
}

/// A host root, assembled.
pub(crate) struct HostRoot {
    /// The overlay mount the init starts in.
    pub rootfs: PathBuf,
    /// A prepared network namespace to join; none means a fresh, empty one.
    pub netns: Option<PathBuf>,
}

/// Assembles the root of `new` on the host; its upper starts as a copy of the image
/// `upper_from` (a container snapshot's) when given, empty otherwise.
pub(crate) fn prepare(
    host: &Host,
    new: &NewSandbox,
    upper_from: Option<&Path>,
) -> Result<HostRoot, RuntimeError> {
    let t = std::time::Instant::now();
    let bytes = new.spec.limits.disk_bytes;
    let upper_dir = match upper_from {
        Some(image) => host.uppers.create_from(new.id, image)?,
        None => match host.uppers.claim(new.id, bytes) {
            Some(dir) => dir,
            None => host.uppers.create(new.id, bytes)?,
        },
    };
    let t_upper = t.elapsed();
    let paths = rootfs::RootfsPaths::new(new.dir, &upper_dir, new.spec.layers.len());
    rootfs::assemble(host.lazyfs, &new.spec.layers, &paths, &host.facts)?;
    rootfs::mount_views(host.lazyfs, new.dir, &paths.merged, &new.spec.views)?;
    let netns = if new.spec.network.is_empty() {
        None
    } else {
        let net = network::setup(host.networks, new.id, &new.spec.network)?;
        write_resolver(&paths.merged, net.nameserver)?;
        Some(net.netns)
    };
    tracing::debug!(
        sandbox = new.id,
        upper_ms = t_upper.as_secs_f64() * 1e3,
        rootfs_ms = (t.elapsed() - t_upper).as_secs_f64() * 1e3,
        "host root assembled"
    );
    Ok(HostRoot {
        rootfs: paths.merged,
        netns,
    })
}

/// Names `nameserver` (the sandbox's egress proxy) in the /etc/resolv.conf of the root
/// `merged`. Without one the file stays as it is: a proxy named by an earlier allowlist
/// answers no more (nothing redirects to it), so names stop resolving, as they should.
pub(crate) fn write_resolver(
    merged: &Path,
    nameserver: Option<Ipv4Addr>,
) -> Result<(), RuntimeError> {
    let Some(ns) = nameserver else {
        return Ok(());
    };
    files::write_file(
        merged,
        "/etc/resolv.conf",
        format!("nameserver {ns}\noptions attempts:2 timeout:2\n").as_bytes(),
        0o644,
    )
}

/// What the runtime writes into a host root's upper itself: the egress proxy's name in
/// /etc/resolv.conf.
pub(crate) fn runtime_written_paths(spec: &crate::SandboxSpec) -> Vec<String> {
    if spec.network.is_empty() {
        Vec::new()
    } else {
        vec!["etc/resolv.conf".to_string()]
    }
}
