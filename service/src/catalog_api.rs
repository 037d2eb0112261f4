//! `strata.v1.Catalog`: a token resolves and lists every entry, and registers and removes
//! only in its project's namespaces.

use std::sync::Arc;

use strata_catalog::Entry;
use tonic::{Request, Response, Status};

use crate::error::ServiceError;
use crate::node::Node;
use crate::node_api::caller;
use crate::proto;
use crate::proto::catalog_server;

pub struct CatalogApi(pub Arc<Node>);

fn namespace_of(id: &str) -> &str {
    id.split('/').next().unwrap_or("")
}

fn entry_reply(reg: &strata_catalog::Registered) -> Result<proto::CatalogEntry, ServiceError> {
    Ok(proto::CatalogEntry {
        reference: reg.reference(),
        json: serde_json::to_string(reg).map_err(|e| ServiceError::Internal(e.to_string()))?,
        layers: reg.entry.layers().into_iter().map(String::from).collect(),
        backend: reg.entry.backend.as_str().to_string(),
        registered_ms: reg.registered_at.saturating_mul(1000),
        registered_by: reg.registered_by.clone(),
    })
}

impl CatalogApi {
    pub(crate) fn check_namespace(caller: &crate::Caller, id: &str) -> Result<(), ServiceError> {
        let ns = namespace_of(id);
        if caller.project.owns_namespace(ns) {
            return Ok(());
        }
        Err(ServiceError::PermissionDenied(format!(
            "project `{}` may not change catalog namespace `{ns}` (its namespaces: {}); ask for it with `strata project create ... --namespaces`",
            caller.project.name,
            if caller.project.namespaces.is_empty() {
                "none".to_string()
            } else {
                caller.project.namespaces.join(", ")
            }
        )))
    }
}

#[tonic::async_trait]
impl catalog_server::Catalog for CatalogApi {
    async fn register(
        &self,
        req: Request<proto::RegisterRequest>,
    ) -> Result<Response<proto::CatalogEntry>, Status> {
        let who = caller(&self.0, &req).await?;
        let r = req.into_inner();
        let mut entry = Entry::from_toml(&r.toml, "the request's toml")
            .map_err(|e| Status::from(ServiceError::invalid("toml", e.to_string())))?;
        if !r.catalog_id.is_empty() {
            let (id, version) = strata_catalog::parse_ref(&r.catalog_id)
                .map_err(|e| Status::from(ServiceError::invalid("catalog_id", e.to_string())))?;
            entry.id = id;
            if let Some(v) = version {
                entry.version = Some(v);
            }
        }
        Self::check_namespace(&who, &entry.id)?;
        let reg = self
            .0
            .catalog
            .register(entry, &self.0.registrant(&who))
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(entry_reply(&reg)?))
    }

    async fn resolve(
        &self,
        req: Request<proto::CatalogRef>,
    ) -> Result<Response<proto::CatalogEntry>, Status> {
        caller(&self.0, &req).await?;
        let r = req.into_inner();
        let reg = self
            .0
            .catalog
            .get(&r.catalog_id)
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(entry_reply(&reg)?))
    }

    async fn list(
        &self,
        req: Request<proto::CatalogListRequest>,
    ) -> Result<Response<proto::CatalogListReply>, Status> {
        caller(&self.0, &req).await?;
        let r = req.into_inner();
        let ids = self
            .0
            .catalog
            .list(&r.prefix)
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(proto::CatalogListReply { ids }))
    }

    async fn history(
        &self,
        req: Request<proto::CatalogRef>,
    ) -> Result<Response<proto::HistoryReply>, Status> {
        caller(&self.0, &req).await?;
        let r = req.into_inner();
        let log = self
            .0
            .catalog
            .history(&r.catalog_id)
            .await
            .map_err(|e| self.0.fail(e))?;
        let records = log
            .iter()
            .map(|l| serde_json::to_string(l).map_err(|e| ServiceError::Internal(e.to_string())))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Response::new(proto::HistoryReply { records }))
    }

    async fn remove(
        &self,
        req: Request<proto::CatalogRef>,
    ) -> Result<Response<proto::RemoveReply>, Status> {
        let who = caller(&self.0, &req).await?;
        let r = req.into_inner();
        Self::check_namespace(&who, &r.catalog_id)?;
        let removed = self
            .0
            .catalog
            .remove(&r.catalog_id, &self.0.registrant(&who))
            .await
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(proto::RemoveReply { removed }))
    }
}
