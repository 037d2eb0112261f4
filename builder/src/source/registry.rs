//! Pulls an image from an OCI/Docker registry with `oci-client` (manifest and blobs checked
//! against their digests) and flattens its layers like an OCI layout. Registries on
//! loopback, and those listed in `STRATA_INSECURE_REGISTRIES` (comma-separated), are spoken
//! to over plain HTTP; credentials come from `STRATA_REGISTRY_USER`/`STRATA_REGISTRY_PASSWORD`.

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use crate::chunker::ChunkSink;
use crate::source::tar::{apply_tar, decompress};
use crate::source::Excludes;
use crate::tree::{Tree, Whiteouts};
use crate::BuildError;

fn client_for(reference: &Reference) -> Client {
    let registry = reference.registry().to_string();
    let host = registry.split(':').next().unwrap_or_default();
    let mut insecure: Vec<String> = std::env::var("STRATA_INSECURE_REGISTRIES")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if host == "localhost" || host.starts_with("127.") || host == "[::1]" {
        insecure.push(registry);
    }
    Client::new(ClientConfig {
        protocol: ClientProtocol::HttpsExcept(insecure),
        ..Default::default()
    })
}

fn auth() -> RegistryAuth {
    match (
        std::env::var("STRATA_REGISTRY_USER"),
        std::env::var("STRATA_REGISTRY_PASSWORD"),
    ) {
        (Ok(u), Ok(p)) => RegistryAuth::Basic(u, p),
        _ => RegistryAuth::Anonymous,
    }
}

fn explain(image: &str, e: oci_client::errors::OciDistributionError) -> BuildError {
    use oci_client::errors::OciDistributionError as E;
    let hint = match &e {
        E::AuthenticationFailure(_) | E::UnauthorizedError { .. } => {
            "; the registry refused our credentials: set STRATA_REGISTRY_USER and STRATA_REGISTRY_PASSWORD"
        }
        E::ImageManifestNotFoundError(_) => "; check the repository name and tag",
        _ => "",
    };
    BuildError::Oci(format!("pulling {image}: {e}{hint}"))
}

/// Pulls `image` and flattens it into a tree. Must run on a thread that may block, inside a
/// tokio runtime (the build runs sources on a blocking thread).
pub fn read_image(
    image: &str,
    whiteouts: Whiteouts,
    excludes: &Excludes,
    sink: &dyn ChunkSink,
) -> Result<Tree, BuildError> {
    let reference: Reference = image
        .parse()
        .map_err(|e| BuildError::Oci(format!("`{image}` is not an image reference: {e}")))?;
    let client = client_for(&reference);
    let auth = auth();
    let rt = tokio::runtime::Handle::try_current()
        .map_err(|_| BuildError::Internal("registry pulls need a tokio runtime".into()))?;
    let (manifest, _digest, _config) = rt
        .block_on(client.pull_manifest_and_config(&reference, &auth))
        .map_err(|e| explain(image, e))?;
    let mut tree = Tree::new();
    for layer in &manifest.layers {
        // The blob is spooled (compressed, digest-checked) to a temp file: the tar reader is
        // synchronous and the download is not. Nothing is unpacked.
        let spool = tempfile::tempfile().map_err(|source| BuildError::Io {
            path: "temporary file".into(),
            source,
        })?;
        let mut out =
            tokio::fs::File::from_std(spool.try_clone().map_err(|source| BuildError::Io {
                path: "temporary file".into(),
                source,
            })?);
        rt.block_on(async {
            client.pull_blob(&reference, layer, &mut out).await?;
            tokio::io::AsyncWriteExt::flush(&mut out)
                .await
                .map_err(oci_client::errors::OciDistributionError::from)
        })
        .map_err(|e| explain(image, e))?;
        let mut file = spool;
        std::io::Seek::rewind(&mut file).map_err(|source| BuildError::Io {
            path: "temporary file".into(),
            source,
        })?;
        let what = format!("{image} layer {}", layer.digest);
        let mut reader = decompress(file, &what)?;
        apply_tar(&mut tree, &mut reader, &what, whiteouts, excludes, sink)?;
    }
    Ok(tree)
}
