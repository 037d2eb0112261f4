//! `strata.v1.Node`: health (no token needed), version, capacity.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::node::Node;
use crate::proto;
use crate::proto::node_server;

pub struct NodeApi(pub Arc<Node>);

/// The token of a request (`authorization: Bearer <token>`).
pub(crate) fn bearer<T>(req: &Request<T>) -> Option<String> {
    let v = req.metadata().get("authorization")?.to_str().ok()?;
    let t = v
        .strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))?;
    Some(t.trim().to_string())
}

/// The caller of a request, refused when it carries no valid token.
pub(crate) async fn caller<T>(node: &Node, req: &Request<T>) -> Result<crate::Caller, Status> {
    let token = bearer(req).ok_or_else(|| {
        Status::from(crate::ServiceError::Unauthenticated(
            "no token: send `authorization: Bearer <token>` (set STRATA_TOKEN; make one with `strata token create --project NAME`)".into(),
        ))
    })?;
    node.projects
        .authenticate(&token)
        .await
        .map_err(|e| node.fail(e))
}

#[tonic::async_trait]
impl node_server::Node for NodeApi {
    async fn health(
        &self,
        _req: Request<proto::HealthRequest>,
    ) -> Result<Response<proto::HealthReply>, Status> {
        Ok(Response::new(proto::HealthReply {
            status: "serving".into(),
            node: self.0.config().node.clone(),
        }))
    }

    async fn version(
        &self,
        req: Request<proto::VersionRequest>,
    ) -> Result<Response<proto::VersionReply>, Status> {
        caller(&self.0, &req).await?;
        Ok(Response::new(proto::VersionReply {
            version: self.0.config().version.clone(),
            api: "v1".into(),
        }))
    }

    async fn capacity(
        &self,
        req: Request<proto::CapacityRequest>,
    ) -> Result<Response<proto::CapacityReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let metas = self.0.metas();
        let (mem, cpus, _) = crate::admission::on_node(metas.iter());
        let mut counts: std::collections::BTreeMap<(String, String), u32> = Default::default();
        for m in &metas {
            *counts
                .entry((m.backend.as_str().to_string(), m.state().to_string()))
                .or_default() += 1;
        }
        let cap = self.0.capacity();
        let size = self.0.size();
        Ok(Response::new(proto::CapacityReply {
            node: self.0.config().node.clone(),
            cores: size.cores,
            memory_bytes: size.memory_bytes,
            admit_memory_bytes: cap.memory_bytes,
            admit_cpus: cap.cpus,
            committed_memory_bytes: mem,
            committed_cpus: cpus,
            sandboxes: counts
                .into_iter()
                .map(|((backend, state), count)| proto::BackendCount {
                    backend,
                    state,
                    count,
                })
                .collect(),
            project_sandboxes: metas
                .iter()
                .filter(|m| m.project == who.project.name)
                .count() as u32,
            project_max_sandboxes: who.project.max_sandboxes.unwrap_or(0),
        }))
    }
}
