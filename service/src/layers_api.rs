//! `strata.v1.Layers`: inspect and list the layers of the node's store.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use crate::error::ServiceError;
use crate::node::Node;
use crate::node_api::caller;
use crate::proto;
use crate::proto::layers_server;

pub struct LayersApi(pub Arc<Node>);

fn fail(node: &Node, e: impl Into<ServiceError>) -> Status {
    let e = e.into();
    if e.is_store() {
        node.metrics.store_error();
    }
    Status::from(e)
}

#[tonic::async_trait]
impl layers_server::Layers for LayersApi {
    async fn inspect(
        &self,
        req: Request<proto::LayerRef>,
    ) -> Result<Response<proto::LayerInfo>, Status> {
        caller(&self.0, &req).await?;
        let r = req.into_inner();
        let store = self.0.store();
        let id = store
            .resolve_layer(&r.layer)
            .await
            .map_err(|e| fail(&self.0, e))?;
        let manifest = store.get_layer(&id).await.map_err(|e| fail(&self.0, e))?;
        let provenance = store.get_provenance(&id).await.ok();
        Ok(Response::new(proto::LayerInfo {
            id: id.to_string(),
            manifest_json: to_json(&manifest)?,
            provenance_json: match &provenance {
                Some(p) => to_json(p)?,
                None => String::new(),
            },
        }))
    }

    async fn list(
        &self,
        req: Request<proto::LayerListRequest>,
    ) -> Result<Response<proto::LayerListReply>, Status> {
        caller(&self.0, &req).await?;
        let ids = self
            .0
            .store()
            .list_layers()
            .await
            .map_err(|e| fail(&self.0, e))?;
        Ok(Response::new(proto::LayerListReply {
            ids: ids.iter().map(|d| d.to_string()).collect(),
        }))
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, Status> {
    serde_json::to_string(v).map_err(|e| Status::from(ServiceError::Internal(e.to_string())))
}
