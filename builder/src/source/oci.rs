//! OCI images: from an OCI layout directory, or pulled from a registry with `oci-client`.
//! Every blob is checked against its sha256 digest; layers are applied in order with their
//! whiteouts, flattening the image into one tree.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::chunker::ChunkSink;
use crate::source::tar::{apply_tar, decompress};
use crate::source::Excludes;
use crate::tree::{Tree, Whiteouts};
use crate::BuildError;

#[derive(Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    annotations: std::collections::HashMap<String, String>,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize)]
struct Platform {
    architecture: String,
    os: String,
}

#[derive(Deserialize)]
struct Index {
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Manifest {
    layers: Vec<Descriptor>,
}

const REF_NAME: &str = "org.opencontainers.image.ref.name";

fn is_index(media_type: &str) -> bool {
    media_type.contains("image.index") || media_type.contains("manifest.list")
}

struct Layout {
    root: PathBuf,
}

impl Layout {
    fn blob_path(&self, digest: &str) -> Result<PathBuf, BuildError> {
        let (alg, hex) = digest
            .split_once(':')
            .ok_or_else(|| BuildError::Oci(format!("malformed digest `{digest}`")))?;
        if alg != "sha256" || hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(BuildError::Oci(format!(
                "unsupported or malformed digest `{digest}`"
            )));
        }
        Ok(self.root.join("blobs").join(alg).join(hex))
    }

    /// Opens a blob after checking its whole content against `digest`, so a damaged blob
    /// is reported as such rather than as whatever parse error its damage causes.
    fn open_blob(&self, digest: &str) -> Result<File, BuildError> {
        let p = self.blob_path(digest)?;
        let io = |source| BuildError::Io {
            path: p.display().to_string(),
            source,
        };
        let mut f = File::open(&p).map_err(io)?;
        let mut hasher = Sha256::new();
        std::io::copy(&mut f, &mut hasher).map_err(io)?;
        let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
        if !actual.eq_ignore_ascii_case(digest) {
            return Err(BuildError::Oci(format!(
                "blob {}: digest mismatch: content is {actual}, expected {digest}",
                p.display()
            )));
        }
        std::io::Seek::rewind(&mut f).map_err(io)?;
        Ok(f)
    }

    fn read_json<T: for<'de> Deserialize<'de>>(&self, digest: &str) -> Result<T, BuildError> {
        let mut bytes = Vec::new();
        let mut r = self.open_blob(digest)?;
        r.read_to_end(&mut bytes)
            .map_err(|e| BuildError::Oci(e.to_string()))?;
        serde_json::from_slice(&bytes).map_err(|e| BuildError::Oci(format!("blob {digest}: {e}")))
    }

    /// Follows index entries (multi-platform images included) down to one image manifest.
    fn resolve(&self, reference: Option<&str>) -> Result<Manifest, BuildError> {
        let index_path = self.root.join("index.json");
        let text = std::fs::read(&index_path).map_err(|source| BuildError::Io {
            path: index_path.display().to_string(),
            source,
        })?;
        let index: Index = serde_json::from_slice(&text)
            .map_err(|e| BuildError::Oci(format!("{}: {e}", index_path.display())))?;
        let chosen = match reference {
            Some(r) => index
                .manifests
                .iter()
                .find(|d| d.annotations.get(REF_NAME).map(String::as_str) == Some(r))
                .ok_or_else(|| {
                    let names: Vec<_> = index
                        .manifests
                        .iter()
                        .filter_map(|d| d.annotations.get(REF_NAME))
                        .cloned()
                        .collect();
                    BuildError::Oci(format!(
                        "no image named `{r}` in {} (it has: {})",
                        self.root.display(),
                        names.join(", ")
                    ))
                })?,
            None if index.manifests.len() == 1 => &index.manifests[0],
            None => {
                return Err(BuildError::Oci(format!(
                    "{} holds {} images; name one with oci:PATH:REF",
                    self.root.display(),
                    index.manifests.len()
                )))
            }
        };
        let mut digest = chosen.digest.clone();
        let mut media_type = chosen.media_type.clone();
        while is_index(&media_type) {
            let nested: Index = self.read_json(&digest)?;
            let pick = nested
                .manifests
                .iter()
                .find(|d| {
                    d.platform
                        .as_ref()
                        .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
                })
                .ok_or_else(|| {
                    BuildError::Oci(format!("image index {digest} has no linux/amd64 image"))
                })?;
            digest = pick.digest.clone();
            media_type = pick.media_type.clone();
        }
        self.read_json(&digest)
    }
}

/// Flattens the image `reference` (or the only image) of the OCI layout at `root`.
pub fn read_layout(
    root: &Path,
    reference: Option<&str>,
    whiteouts: Whiteouts,
    excludes: &Excludes,
    sink: &dyn ChunkSink,
) -> Result<Tree, BuildError> {
    let layout = Layout {
        root: root.to_path_buf(),
    };
    let manifest = layout.resolve(reference)?;
    let mut tree = Tree::new();
    for layer in &manifest.layers {
        let blob = layout.open_blob(&layer.digest)?;
        let what = format!("layer {}", layer.digest);
        let mut reader = decompress(blob, &what)?;
        apply_tar(&mut tree, &mut reader, &what, whiteouts, excludes, sink)?;
    }
    Ok(tree)
}
