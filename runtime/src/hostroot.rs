//! The root of a sandbox whose processes run on the host's kernel (fncall, container):
//! its writable upper (a pooled one, or a fresh image), its layers stacked with overlayfs
//! under it, and the network namespace of an allowlist with the allowed names in its
//! /etc/hosts.

use std::path::PathBuf;

use crate::backend::{Host, NewSandbox};
use crate::{files, network, rootfs, RuntimeError};

/// A host root, assembled.
pub(crate) struct HostRoot {
    /// The overlay mount the init starts in.
    pub rootfs: PathBuf,
    /// A prepared network namespace to join; none means a fresh, empty one.
    pub netns: Option<PathBuf>,
}

/// Assembles the root of `new` on the host.
pub(crate) fn prepare(host: &Host, new: &NewSandbox) -> Result<HostRoot, RuntimeError> {
    if new.restore.is_some() {
        return Err(RuntimeError::Invalid(format!(
            "a {} sandbox cannot be restored from a snapshot (snapshots are of VMs)",
            new.spec.backend.as_str()
        )));
    }
    let t = std::time::Instant::now();
    let bytes = new.spec.limits.disk_bytes;
    let upper_dir = match host.uppers.claim(new.id, bytes) {
        Some(dir) => dir,
        None => host.uppers.create(new.id, bytes)?,
    };
    let t_upper = t.elapsed();
    let paths = rootfs::RootfsPaths::new(new.dir, &upper_dir, new.spec.layers.len());
    rootfs::assemble(host.lazyfs, &new.spec.layers, &paths, &host.facts)?;
    let netns = if new.spec.network.is_empty() {
        None
    } else {
        let net = network::setup(host.networks, new.id, &new.spec.network)?;
        if !net.hosts.is_empty() {
            let mut hosts = files::read_file(&paths.merged, "/etc/hosts").unwrap_or_default();
            for (addr, name) in &net.hosts {
                hosts.extend_from_slice(format!("{addr}\t{name}\n").as_bytes());
            }
            files::write_file(&paths.merged, "/etc/hosts", &hosts, 0o644)?;
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

/// What the runtime writes into a host root's upper itself: the allowed hosts' names.
pub(crate) fn runtime_written_paths(spec: &crate::SandboxSpec) -> Vec<String> {
    if spec.network.is_empty() {
        Vec::new()
    } else {
        vec!["etc/hosts".to_string()]
    }
}
