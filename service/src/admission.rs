//! Admission: a create is admitted only if the project's quota and the node's capacity
//! (its memory and cores times the overcommit factors) hold with it counted; otherwise it
//! is refused at once, retryable, never queued and never allowed to push the host into OOM.

use std::time::Duration;

use crate::error::ServiceError;
use crate::projects::Project;
use crate::state::Meta;

/// How much a node admits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    pub memory_bytes: u64,
    pub cpus: f64,
}

/// What a new sandbox asks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask {
    pub memory_bytes: u64,
    pub cpus: f64,
}

/// Committed budgets of `live` (pending creates included).
pub fn committed<'a>(live: impl Iterator<Item = &'a Meta>) -> (u64, f64, usize) {
    live.fold((0, 0.0, 0), |(m, c, n), s| {
        (m + s.memory_bytes, c + s.cpus, n + 1)
    })
}

/// What `live` holds of the node now: a hibernated sandbox's memory and CPUs went back to
/// it (a project's quota still counts them: they are its sandboxes).
pub fn on_node<'a>(live: impl Iterator<Item = &'a Meta>) -> (u64, f64, usize) {
    committed(live.filter(|m| !m.hibernated))
}

/// Refuses `ask` if it breaks the project's quota or the node's capacity.
pub fn admit<'a>(
    live: impl Iterator<Item = &'a Meta> + Clone,
    project: &Project,
    ask: Ask,
    node: Capacity,
    retry_after: Duration,
) -> Result<(), ServiceError> {
    let (pmem, pcpus, pcount) = committed(live.clone().filter(|m| m.project == project.name));
    let refuse = |reason: &'static str, message: String| ServiceError::Exhausted {
        reason,
        message,
        retry_after,
    };
    if let Some(max) = project.max_sandboxes {
        if pcount as u64 >= u64::from(max) {
            return Err(refuse(
                "quota-sandboxes",
                format!(
                    "project `{}` has {pcount} of its {max} sandboxes; destroy one or raise --max-sandboxes",
                    project.name
                ),
            ));
        }
    }
    if let Some(max) = project.max_memory {
        if pmem + ask.memory_bytes > max {
            return Err(refuse(
                "quota-memory",
                format!(
                    "project `{}` would commit {} MiB of memory, over its quota of {} MiB",
                    project.name,
                    (pmem + ask.memory_bytes) >> 20,
                    max >> 20
                ),
            ));
        }
    }
    if let Some(max) = project.max_cpus {
        if pcpus + ask.cpus > max + 1e-9 {
            return Err(refuse(
                "quota-cpus",
                format!(
                    "project `{}` would commit {:.2} CPUs, over its quota of {max}",
                    project.name,
                    pcpus + ask.cpus
                ),
            ));
        }
    }
    fits_node(live, ask, node, retry_after)
}

/// Refuses `ask` if the node's capacity cannot take it (a wake, besides every create).
pub fn fits_node<'a>(
    live: impl Iterator<Item = &'a Meta>,
    ask: Ask,
    node: Capacity,
    retry_after: Duration,
) -> Result<(), ServiceError> {
    let (mem, cpus, _) = on_node(live);
    let refuse = |reason: &'static str, message: String| ServiceError::Exhausted {
        reason,
        message,
        retry_after,
    };
    if mem + ask.memory_bytes > node.memory_bytes {
        return Err(refuse(
            "node-memory",
            format!(
                "this node has {} MiB of {} MiB admitted memory committed; a sandbox of {} MiB does not fit (try another node, a smaller budget, or later)",
                mem >> 20,
                node.memory_bytes >> 20,
                ask.memory_bytes >> 20
            ),
        ));
    }
    if cpus + ask.cpus > node.cpus + 1e-9 {
        return Err(refuse(
            "node-cpus",
            format!(
                "this node has {cpus:.2} of {:.2} admitted CPUs committed; {:.2} more do not fit",
                node.cpus, ask.cpus
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_catalog::Backend;

    fn meta(project: &str, mem: u64, cpus: f64) -> Meta {
        Meta {
            id: "n-x".into(),
            local: "x".into(),
            project: project.into(),
            token: "t".into(),
            catalog_ref: "a/b@1".into(),
            backend: Backend::Container,
            labels: Default::default(),
            created_ms: 0,
            expires_ms: None,
            memory_bytes: mem,
            cpus,
            disk_bytes: 0,
            idle_ttl_ms: 0,
            paused: false,
            hibernated: false,
            inbound: false,
            pending: false,
        }
    }

    fn project(max: Option<u32>, mem: Option<u64>) -> Project {
        Project {
            name: "p".into(),
            max_sandboxes: max,
            max_memory: mem,
            max_cpus: None,
            max_snapshot_storage: None,
            namespaces: vec![],
            backends: vec![],
            allow_internet: false,
            created_ms: 0,
        }
    }

    const NODE: Capacity = Capacity {
        memory_bytes: 4 << 30,
        cpus: 8.0,
    };
    const ASK: Ask = Ask {
        memory_bytes: 1 << 30,
        cpus: 1.0,
    };

    fn reason(r: Result<(), ServiceError>) -> Option<&'static str> {
        match r {
            Ok(()) => None,
            Err(ServiceError::Exhausted { reason, .. }) => Some(reason),
            Err(e) => panic!("unexpected {e}"),
        }
    }

    #[test]
    fn quotas_count_only_the_project_and_the_node_counts_everyone() {
        let live = [meta("p", 1 << 30, 1.0), meta("q", 2 << 30, 1.0)];
        let d = Duration::from_secs(5);
        // Two of p's: the second is refused at a quota of 1... with one alive already.
        assert_eq!(
            reason(admit(live.iter(), &project(Some(1), None), ASK, NODE, d)),
            Some("quota-sandboxes")
        );
        assert_eq!(
            reason(admit(live.iter(), &project(Some(2), None), ASK, NODE, d)),
            None
        );
        assert_eq!(
            reason(admit(
                live.iter(),
                &project(None, Some(3 << 29)),
                ASK,
                NODE,
                d
            )),
            Some("quota-memory")
        );
        // 3 GiB committed on a 4 GiB node: 1 GiB fits, 1 GiB + 1 byte does not.
        assert_eq!(
            reason(admit(live.iter(), &project(None, None), ASK, NODE, d)),
            None
        );
        let big = Ask {
            memory_bytes: (1 << 30) + 1,
            cpus: 1.0,
        };
        assert_eq!(
            reason(admit(live.iter(), &project(None, None), big, NODE, d)),
            Some("node-memory")
        );
        let cpus = Ask {
            memory_bytes: 1,
            cpus: 6.5,
        };
        assert_eq!(
            reason(admit(live.iter(), &project(None, None), cpus, NODE, d)),
            Some("node-cpus")
        );
    }
}
