//! Fork: N new sandboxes that start from where one is. Where the backend saves processes
//! and memory (microvm, vm; a container with CRIU), the parent is snapshotted once and
//! the snapshot restored N times: each child continues the parent's processes from its
//! memory, with a fresh identity (its own ID, key, host name, machine ID; a VM's guest
//! also fresh entropy). Elsewhere (fncall, or a container without CRIU) the parent's
//! files are committed as a layer and
//! each child is a new sandbox of the parent's stack with that layer on top: the parent's
//! files, fresh processes. Used by the node service and by the embedded CLI alike; the
//! caller admits, records and owns the children.

use std::path::Path;
use std::time::Instant;

use strata_builder::LayerKind;
use strata_runtime::{Runtime, Sandbox};
use strata_store::Store;

use crate::ServiceError;

/// The most children one fork makes.
pub const MAX_FORK: usize = 100;

/// What a fork made.
pub struct Forked {
    pub children: Vec<Sandbox>,
    /// The children continue the parent's processes and memory (else: its files only).
    pub processes: bool,
    pub millis: f64,
}

/// Refuses a count outside 1..=[`MAX_FORK`].
pub fn check_count(count: usize) -> Result<(), ServiceError> {
    if (1..=MAX_FORK).contains(&count) {
        Ok(())
    } else {
        Err(ServiceError::invalid(
            "count",
            format!("{count} children: a fork makes 1 to {MAX_FORK}"),
        ))
    }
}

/// Makes `count` children of `parent` (see the module's comment); on failure every child
/// made so far is destroyed. `registrant` names who committed the parent's files.
pub async fn fork(
    store: &Store,
    rt: &Runtime,
    parent: &Sandbox,
    count: usize,
    registrant: &str,
) -> Result<Forked, ServiceError> {
    check_count(count)?;
    let t = Instant::now();
    let processes = parent.saves_memory();
    let (rt2, parent2) = (rt.clone(), parent.clone());
    let children = if processes {
        tokio::task::spawn_blocking(move || restore_many(&rt2, &parent2, count))
            .await
            .map_err(|e| ServiceError::Internal(e.to_string()))??
    } else {
        let committed = crate::commit::commit(
            store,
            parent,
            &crate::commit::CommitRequest {
                kind: LayerKind::Toolkit,
                register: None,
                registrant: registrant.to_string(),
            },
        )
        .await?;
        let mut spec = parent.spec().clone();
        spec.layers.insert(0, committed.layer.to_string());
        tokio::task::spawn_blocking(move || {
            made_all((0..count).map(|_| rt2.create(spec.clone()).map_err(ServiceError::from)))
        })
        .await
        .map_err(|e| ServiceError::Internal(e.to_string()))??
    };
    Ok(Forked {
        children,
        processes,
        millis: t.elapsed().as_secs_f64() * 1e3,
    })
}

/// One snapshot of `parent`, restored `count` times, then removed.
fn restore_many(
    rt: &Runtime,
    parent: &Sandbox,
    count: usize,
) -> Result<Vec<Sandbox>, ServiceError> {
    // The parent's memory goes there: the host's other users may not read it.
    let dir = crate::snapshot::private_dir(&rt.state_dir().join("forks"), parent.id())?;
    let made = parent
        .snapshot(&dir)
        .map_err(ServiceError::from)
        .and_then(|_| made_all((0..count).map(|_| restore(rt, &dir))));
    if let Err(e) = std::fs::remove_dir_all(&dir) {
        tracing::warn!("removing the fork snapshot {}: {e}", dir.display());
    }
    made
}

fn restore(rt: &Runtime, dir: &Path) -> Result<Sandbox, ServiceError> {
    Ok(rt.restore(dir, false)?)
}

/// Every child, or (the first failure) none: those made are destroyed.
fn made_all(
    children: impl Iterator<Item = Result<Sandbox, ServiceError>>,
) -> Result<Vec<Sandbox>, ServiceError> {
    let mut made = Vec::new();
    for child in children {
        match child {
            Ok(sb) => made.push(sb),
            Err(e) => {
                for sb in made {
                    let id = sb.id().to_string();
                    if let Err(d) = sb.destroy() {
                        tracing::warn!("destroying fork child {id} after a failed fork: {d}");
                    }
                }
                return Err(e);
            }
        }
    }
    Ok(made)
}
