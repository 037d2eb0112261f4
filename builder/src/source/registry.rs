//! Pulls an image from an OCI/Docker registry with `oci-client` (manifest and blobs checked
//! against their digests) and flattens its layers like an OCI layout. Registries on
//! loopback, and those the caller lists in [`RegistrySettings::insecure`], are spoken to
//! over plain HTTP; credentials are the caller's too ([`RegistrySettings::credentials`]).
//! The `strata` binary fills these from its settings (`STRATA_INSECURE_REGISTRIES`,
//! `STRATA_REGISTRY_USER`, `STRATA_REGISTRY_PASSWORD` or `strata.toml`).

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use crate::chunker::ChunkSink;
use crate::source::tar::{apply_tar, decompress};
use crate::source::Excludes;
use crate::tree::{Tree, Whiteouts};
use crate::BuildError;

/// How registry pulls are made: which registries speak plain HTTP, and whose credentials
/// are sent. The default: HTTPS except on loopback, anonymous.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RegistrySettings {
    /// Registries (`HOST` or `HOST:PORT`, as the image reference names them) spoken to
    /// over plain HTTP, besides loopback.
    pub insecure: Vec<String>,
    /// Basic-auth credentials sent to every registry; anonymous without.
    pub credentials: Option<RegistryCredentials>,
}

/// A registry user and password.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryCredentials {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for RegistrySettings {
    /// Never prints the password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistrySettings")
            .field("insecure", &self.insecure)
            .field(
                "credentials",
                &self
                    .credentials
                    .as_ref()
                    .map(|c| format!("{} (password hidden)", c.user)),
            )
            .finish()
    }
}

impl RegistrySettings {
    /// The registries of `reference` spoken to over plain HTTP: the configured ones, and
    /// the reference's own registry when it is on loopback.
    fn plain_http(&self, reference: &Reference) -> Vec<String> {
        let registry = reference.registry().to_string();
        let host = registry.split(':').next().unwrap_or_default();
        let mut insecure: Vec<String> = self
            .insecure
            .iter()
            .filter(|s| !s.is_empty())
            .cloned()
            .collect();
        if host == "localhost" || host.starts_with("127.") || host == "[::1]" {
            insecure.push(registry);
        }
        insecure
    }

    fn auth(&self) -> RegistryAuth {
        match &self.credentials {
            Some(c) => RegistryAuth::Basic(c.user.clone(), c.password.clone()),
            None => RegistryAuth::Anonymous,
        }
    }

    fn client_for(&self, reference: &Reference) -> Client {
        Client::new(ClientConfig {
            protocol: ClientProtocol::HttpsExcept(self.plain_http(reference)),
            ..Default::default()
        })
    }

    fn explain(&self, image: &str, e: oci_client::errors::OciDistributionError) -> BuildError {
        use oci_client::errors::OciDistributionError as E;
        let hint = match (&e, &self.credentials) {
            (E::AuthenticationFailure(_) | E::UnauthorizedError { .. }, Some(_)) => {
                "; the registry refused our credentials (registry_user and registry_password: STRATA_REGISTRY_USER and STRATA_REGISTRY_PASSWORD, or strata.toml)"
            }
            (E::AuthenticationFailure(_) | E::UnauthorizedError { .. }, None) => {
                "; the registry wants credentials: set registry_user and registry_password (STRATA_REGISTRY_USER and STRATA_REGISTRY_PASSWORD, or strata.toml)"
            }
            (E::ImageManifestNotFoundError(_), _) => "; check the repository name and tag",
            _ => "",
        };
        BuildError::Oci(format!("pulling {image}: {e}{hint}"))
    }
}

/// Pulls `image` with `settings` and flattens it into a tree. Must run on a thread that
/// may block, inside a
/// tokio runtime (the build runs sources on a blocking thread).
pub fn read_image(
    image: &str,
    settings: &RegistrySettings,
    whiteouts: Whiteouts,
    excludes: &Excludes,
    sink: &dyn ChunkSink,
) -> Result<Tree, BuildError> {
    let reference: Reference = image
        .parse()
        .map_err(|e| BuildError::Oci(format!("`{image}` is not an image reference: {e}")))?;
    let client = settings.client_for(&reference);
    let auth = settings.auth();
    let rt = tokio::runtime::Handle::try_current()
        .map_err(|_| BuildError::Internal("registry pulls need a tokio runtime".into()))?;
    let (manifest, _digest, _config) = rt
        .block_on(client.pull_manifest_and_config(&reference, &auth))
        .map_err(|e| settings.explain(image, e))?;
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
        .map_err(|e| settings.explain(image, e))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_for_loopback_and_the_listed_registries_only() {
        let listed = RegistrySettings {
            insecure: vec!["registry.lan:5000".into(), String::new()],
            credentials: None,
        };
        let r = |s: &str| s.parse::<Reference>().unwrap();
        assert_eq!(
            RegistrySettings::default().plain_http(&r("127.0.0.1:5000/a/b:v1")),
            vec!["127.0.0.1:5000"]
        );
        assert!(RegistrySettings::default()
            .plain_http(&r("registry.lan:5000/a/b:v1"))
            .is_empty());
        assert_eq!(
            listed.plain_http(&r("localhost:5000/a:v1")),
            vec!["registry.lan:5000", "localhost:5000"]
        );
        assert_eq!(
            listed.plain_http(&r("docker.io/library/debian:12")),
            vec!["registry.lan:5000"]
        );
    }

    #[test]
    fn credentials_are_sent_as_given_and_never_printed() {
        let s = RegistrySettings {
            insecure: vec![],
            credentials: Some(RegistryCredentials {
                user: "bot".into(),
                password: "hunter2".into(),
            }),
        };
        assert!(matches!(s.auth(), RegistryAuth::Basic(u, p) if u == "bot" && p == "hunter2"));
        assert!(matches!(
            RegistrySettings::default().auth(),
            RegistryAuth::Anonymous
        ));
        let shown = format!("{s:?}");
        assert!(
            shown.contains("bot") && !shown.contains("hunter2"),
            "{shown}"
        );
    }
}
