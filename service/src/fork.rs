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
            made_all(count, || {
                rt2.create(spec.clone()).map_err(ServiceError::from)
            })
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
        .fork_snapshot(&dir, count)
        .map_err(ServiceError::from)
        .and_then(|_| made_all(count, || restore(rt, &dir)));
    crate::snapshot::remove_work(&dir);
    made
}

fn restore(rt: &Runtime, dir: &Path) -> Result<Sandbox, ServiceError> {
    Ok(rt.restore(dir, false)?)
}

/// `count` children made by `make`, a few at once (as many as the host has cores: a
/// restore is mostly CPU and disk), or (at the first failure) none: those made are
/// destroyed.
fn made_all(
    count: usize,
    make: impl Fn() -> Result<Sandbox, ServiceError> + Sync,
) -> Result<Vec<Sandbox>, ServiceError> {
    let width = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(1, 8)
        .min(count);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed = std::sync::atomic::AtomicBool::new(false);
    let results: Vec<Result<Sandbox, ServiceError>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..width)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    while !failed.load(std::sync::atomic::Ordering::SeqCst)
                        && next.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < count
                    {
                        let child = make();
                        if child.is_err() {
                            failed.store(true, std::sync::atomic::Ordering::SeqCst);
                        }
                        mine.push(child);
                    }
                    mine
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| {
                w.join().unwrap_or_else(|_| {
                    vec![Err(ServiceError::Internal("a fork worker panicked".into()))]
                })
            })
            .collect()
    });
    let (made, errors): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
    let made: Vec<Sandbox> = made.into_iter().filter_map(Result::ok).collect();
    match errors.into_iter().find_map(Result::err) {
        None => Ok(made),
        Some(e) => {
            for sb in made {
                let id = sb.id().to_string();
                if let Err(d) = sb.destroy() {
                    tracing::warn!("destroying fork child {id} after a failed fork: {d}");
                }
            }
            Err(e)
        }
    }
}
