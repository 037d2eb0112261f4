//! The root of a sandbox whose processes run on the host's kernel (fncall, container):
//! its writable upper (a pooled one, or a fresh image), its layers stacked with overlayfs
//! under it, and the network namespace of an allowlist with the allowed names in its
//! /etc/hosts.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use crate::backend::{Host, NewSandbox};
use crate::{files, network, rootfs, RuntimeError};

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
        if !net.hosts.is_empty() {
            write_hosts(&paths.merged, &net.hosts)?;
        }
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

/// Marks the lines of /etc/hosts the runtime wrote, so a new allowlist replaces them.
const HOSTS_MARK: &str = "# strata allowlist";
/// The most of the sandbox's own /etc/hosts kept when the allowed names are rewritten.
const HOSTS_MAX: usize = 1 << 20;

/// Names the allowed hosts in the /etc/hosts of the root `merged`, in place of the names
/// an earlier allowlist put there; the sandbox's own lines stay.
pub(crate) fn write_hosts(merged: &Path, hosts: &[(Ipv4Addr, String)]) -> Result<(), RuntimeError> {
    let mut old = Vec::new();
    let read = files::read_file_with(merged, "/etc/hosts", &mut |part| {
        if old.len() + part.len() > HOSTS_MAX {
            return Err(RuntimeError::Invalid(format!(
                "the sandbox's /etc/hosts is over {HOSTS_MAX} bytes: the allowed names are not written into it"
            )));
        }
        old.extend_from_slice(part);
        Ok(())
    });
    match read {
        Ok(()) => {}
        Err(RuntimeError::File { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            old.clear()
        }
        Err(e) => return Err(e),
    }
    let mut text: String = String::from_utf8_lossy(&old)
        .lines()
        .filter(|l| !l.ends_with(HOSTS_MARK))
        .map(|l| format!("{l}\n"))
        .collect();
    for (addr, name) in hosts {
        text.push_str(&format!("{addr}\t{name}\t{HOSTS_MARK}\n"));
    }
    files::write_file(merged, "/etc/hosts", text.as_bytes(), 0o644)
}

/// What the runtime writes into a host root's upper itself: the allowed hosts' names.
pub(crate) fn runtime_written_paths(spec: &crate::SandboxSpec) -> Vec<String> {
    if spec.network.is_empty() {
        Vec::new()
    } else {
        vec!["etc/hosts".to_string()]
    }
}
