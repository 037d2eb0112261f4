//! `strata.v1.Layers`: build layers into the node's store from a streamed tar or a
//! registry image (with progress), inspect and list them.

use std::io::Write;
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use strata_builder::{BuildRequest, LayerKind, Source};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::error::ServiceError;
use crate::node::Node;
use crate::node_api::caller;
use crate::proto;
use crate::proto::layers_server;

pub struct LayersApi(pub Arc<Node>);

type BuildStream = Pin<Box<dyn Stream<Item = Result<proto::BuildEvent, Status>> + Send>>;

fn event(e: proto::build_event::Event) -> Result<proto::BuildEvent, Status> {
    Ok(proto::BuildEvent { event: Some(e) })
}

/// A tar being received: a file under the service's uploads directory, removed on drop
/// (a service that died mid-upload has its leftovers removed at its next start).
struct Upload {
    path: std::path::PathBuf,
    file: Option<std::fs::File>,
}

impl Drop for Upload {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl LayersApi {
    /// Receives the rest of a build's tar into an upload file, reporting progress.
    async fn receive(
        &self,
        first: Vec<u8>,
        input: &mut Streaming<proto::BuildInput>,
        tx: &mpsc::Sender<Result<proto::BuildEvent, Status>>,
    ) -> Result<Upload, ServiceError> {
        let dir = self.0.uploads_dir();
        std::fs::create_dir_all(&dir).map_err(|source| ServiceError::Io {
            what: format!("creating {}", dir.display()),
            source,
        })?;
        let path = dir.join(format!("{}.tar", uuid::Uuid::new_v4().simple()));
        let file = std::fs::File::create(&path).map_err(|source| ServiceError::Io {
            what: format!("creating {}", path.display()),
            source,
        })?;
        let mut up = Upload {
            path,
            file: Some(file),
        };
        let max = self.0.config().max_upload_bytes;
        let mut received = 0u64;
        let mut last_report = 0u64;
        let mut chunk = first;
        loop {
            if !chunk.is_empty() {
                received += chunk.len() as u64;
                if received > max {
                    return Err(ServiceError::invalid(
                        "tar",
                        format!(
                            "the tar is larger than this node takes ({} MiB, max_upload_bytes); build it on the node, or from a registry",
                            max >> 20
                        ),
                    ));
                }
                if let Some(f) = up.file.as_mut() {
                    f.write_all(&chunk).map_err(|source| ServiceError::Io {
                        what: "writing the uploaded tar".into(),
                        source,
                    })?;
                }
                if received - last_report >= 8 << 20 {
                    last_report = received;
                    let _ = tx
                        .send(event(proto::build_event::Event::ReceivedBytes(received)))
                        .await;
                }
            }
            match input.message().await {
                Ok(Some(m)) => chunk = m.tar,
                Ok(None) => break,
                Err(e) => {
                    return Err(ServiceError::Unavailable(format!(
                        "the client's tar stream: {e}"
                    )))
                }
            }
        }
        if received == 0 {
            return Err(ServiceError::invalid(
                "tar",
                "no tar bytes and no image: send the tar after the spec, or name an image",
            ));
        }
        if let Some(f) = up.file.take() {
            f.sync_all().map_err(|source| ServiceError::Io {
                what: "writing the uploaded tar".into(),
                source,
            })?;
        }
        let _ = tx
            .send(event(proto::build_event::Event::ReceivedBytes(received)))
            .await;
        Ok(up)
    }
}

#[tonic::async_trait]
impl layers_server::Layers for LayersApi {
    type BuildStream = BuildStream;

    async fn build(
        &self,
        req: Request<Streaming<proto::BuildInput>>,
    ) -> Result<Response<Self::BuildStream>, Status> {
        caller(&self.0, &req).await?;
        let mut input = req.into_inner();
        let first = input.message().await?.unwrap_or_default();
        let spec = first.spec.ok_or_else(|| {
            Status::from(ServiceError::invalid(
                "spec",
                "the first message of Build must carry the spec",
            ))
        })?;
        let kind = match spec.kind.as_str() {
            "" => LayerKind::Base,
            k => k.parse::<LayerKind>().map_err(|e| {
                Status::from(ServiceError::invalid(
                    "spec.kind",
                    format!("{e} (base, workspace or toolkit)"),
                ))
            })?,
        };
        let text = |s: String| (!s.is_empty()).then_some(s);
        let (tx, rx) = mpsc::channel(16);
        let api = LayersApi(self.0.clone());
        tokio::spawn(async move {
            let upload;
            let source = if spec.image.is_empty() {
                match api.receive(first.tar, &mut input, &tx).await {
                    Ok(u) => {
                        let s = Source::Tar(u.path.clone());
                        upload = Some(u);
                        s
                    }
                    Err(e) => {
                        let _ = tx.send(Err(Status::from(e))).await;
                        return;
                    }
                }
            } else {
                upload = None;
                match Source::parse(&spec.image) {
                    Ok(s @ Source::Registry(_)) => s,
                    Ok(_) | Err(_) => {
                        let _ = tx
                            .send(Err(Status::from(ServiceError::invalid(
                                "spec.image",
                                format!(
                                    "`{}` is not a registry image: give docker://HOST/REPO:TAG",
                                    spec.image
                                ),
                            ))))
                            .await;
                        return;
                    }
                }
            };
            let label = if spec.image.is_empty() {
                "a tar streamed to the node service".to_string()
            } else {
                spec.image.clone()
            };
            let req = BuildRequest {
                source,
                kind,
                name: text(spec.name),
                version: text(spec.version),
                exclude: spec.exclude,
                prefix: text(spec.prefix),
                source_label: Some(label),
                provenance: Default::default(),
                registry: api.0.config().registry.clone(),
            };
            let progress_tx = tx.clone();
            let progress: strata_builder::Progress = Arc::new(move |n| {
                let _ = progress_tx.try_send(event(proto::build_event::Event::BuiltBytes(n)));
            });
            let started = std::time::Instant::now();
            let result = strata_builder::build(api.0.store(), &req, Some(progress)).await;
            drop(upload);
            api.0
                .metrics
                .observe_build(result.is_ok(), started.elapsed());
            let last = match result {
                Ok(r) => match serde_json::to_string(&r) {
                    Ok(report_json) => event(proto::build_event::Event::Done(proto::BuildResult {
                        id: r.id.to_string(),
                        files: r.files,
                        logical_bytes: r.logical_bytes,
                        uploaded_bytes: r.uploaded_bytes,
                        new_data_bytes: r.new_data_bytes,
                        chunks: r.chunks,
                        reused_chunks: r.reused_chunks,
                        seconds: r.seconds,
                        report_json,
                    })),
                    Err(e) => Err(Status::internal(e.to_string())),
                },
                Err(e) => Err(build_status(e)),
            };
            let _ = tx.send(last).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

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
            .map_err(|e| self.0.fail(e))?;
        let manifest = store.get_layer(&id).await.map_err(|e| self.0.fail(e))?;
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
            .map_err(|e| self.0.fail(e))?;
        Ok(Response::new(proto::LayerListReply {
            ids: ids.iter().map(|d| d.to_string()).collect(),
        }))
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<String, Status> {
    serde_json::to_string(v).map_err(|e| Status::from(ServiceError::Internal(e.to_string())))
}

/// A failed build: the input's fault is INVALID_ARGUMENT, the store's UNAVAILABLE.
fn build_status(e: strata_builder::BuildError) -> Status {
    use strata_builder::BuildError as B;
    match e {
        B::Store(s) => Status::from(ServiceError::Store(s)),
        e @ (B::Io { .. } | B::Internal(_) | B::Sandbox(_)) => {
            Status::from(ServiceError::Internal(e.to_string()))
        }
        e => Status::from(ServiceError::invalid("source", e.to_string())),
    }
}
