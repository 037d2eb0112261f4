//! Layer sources: what a layer can be built from, how a command-line SOURCE or a layer
//! definition file names one, and reading any of them into a [`Tree`].

pub mod dir;
pub mod oci;
pub mod registry;
pub mod tar;
pub mod upper;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Deserialize;

use crate::chunker::ChunkSink;
use crate::tree::{Tree, Whiteouts};
use crate::{BuildError, LayerKind};

/// Where a layer's tree comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Dir(PathBuf),
    /// A tar file, plain or gzip/zstd compressed (`-` for standard input).
    Tar(PathBuf),
    OciLayout {
        path: PathBuf,
        reference: Option<String>,
    },
    /// An image in a registry, e.g. `127.0.0.1:5000/debian:bookworm`.
    Registry(String),
    /// `git archive` of a revision of a repository.
    Git {
        repo: PathBuf,
        rev: String,
    },
    /// The overlayfs upper directory build steps wrote (see [`upper`]).
    Upper {
        dir: PathBuf,
        filter: upper::UpperFilter,
    },
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Dir(p) => write!(f, "dir:{}", p.display()),
            Source::Tar(p) => write!(f, "tar:{}", p.display()),
            Source::OciLayout {
                path,
                reference: Some(r),
            } => write!(f, "oci:{}:{r}", path.display()),
            Source::OciLayout {
                path,
                reference: None,
            } => write!(f, "oci:{}", path.display()),
            Source::Registry(r) => write!(f, "docker://{r}"),
            Source::Git { repo, rev } => write!(f, "git:{}@{rev}", repo.display()),
            Source::Upper { dir, .. } => write!(f, "upper:{}", dir.display()),
        }
    }
}

/// Path patterns (glob syntax, matched against the path inside the layer without a leading
/// `/`, and against every parent of it) whose entries are left out.
#[derive(Debug, Clone, Default)]
pub struct Excludes(Vec<glob::Pattern>);

impl Excludes {
    pub fn new(patterns: &[String]) -> Result<Excludes, BuildError> {
        patterns
            .iter()
            .map(|p| {
                glob::Pattern::new(p.trim_start_matches('/').trim_end_matches('/'))
                    .map_err(|e| BuildError::Definition(format!("exclude pattern `{p}`: {e}")))
            })
            .collect::<Result<_, _>>()
            .map(Excludes)
    }

    pub fn matches(&self, path: &[u8]) -> bool {
        if self.0.is_empty() {
            return false;
        }
        let text = String::from_utf8_lossy(path);
        let text = text
            .trim_start_matches("./")
            .trim_start_matches('/')
            .trim_end_matches('/');
        let opts = glob::MatchOptions {
            require_literal_separator: true,
            ..Default::default()
        };
        self.0.iter().any(|p| p.matches_with(text, opts))
    }
}

/// Decides which entries of a source are left out of a layer.
pub trait PathFilter: Sync {
    /// `rel` is the entry's path inside the layer without a leading `/`.
    fn skip(&self, rel: &[u8], is_dir: bool) -> bool;
}

impl PathFilter for Excludes {
    fn skip(&self, rel: &[u8], _is_dir: bool) -> bool {
        self.matches(rel)
    }
}

/// A layer definition file (TOML): a `[source]` to read, or `run` steps over `from` layers
/// (see [`crate::steps`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerDefinition {
    pub kind: LayerKind,
    pub name: Option<String>,
    pub version: Option<String>,
    pub source: Option<SourceTable>,
    #[serde(default)]
    pub exclude: Vec<String>,
    /// Where the source's root goes inside the layer (e.g. "work").
    pub prefix: Option<String>,
    /// Input layers of a step build: layer IDs or catalog IDs, top-most first.
    #[serde(default)]
    pub from: Vec<String>,
    /// Shell commands run in order over the inputs; what they change becomes the layer.
    #[serde(default)]
    pub run: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory of the steps (created if missing).
    pub workdir: Option<String>,
    /// Destinations the steps may reach, HOST:PORT (e.g. pypi.org:443).
    #[serde(default)]
    pub network: Vec<String>,
    /// Keep only these paths of what the steps changed (globs); empty keeps everything.
    #[serde(default)]
    pub capture: Vec<String>,
    /// Also leave out the usual build leftovers ([`crate::steps::DEFAULT_EXCLUDES`]).
    #[serde(default = "yes")]
    pub default_excludes: bool,
    /// Budgets of the build sandbox (the catalog's keys: memory, cpus, disk, pids, timeout).
    pub budgets: Option<toml::Table>,
}

fn yes() -> bool {
    true
}

/// The `[source]` table: exactly one of its location keys.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceTable {
    pub dir: Option<PathBuf>,
    pub tar: Option<PathBuf>,
    pub oci: Option<PathBuf>,
    /// Image name inside an OCI layout (`org.opencontainers.image.ref.name`).
    pub reference: Option<String>,
    pub image: Option<String>,
    pub git: Option<PathBuf>,
    pub rev: Option<String>,
}

impl LayerDefinition {
    pub fn load(path: &Path) -> Result<LayerDefinition, BuildError> {
        let text = std::fs::read_to_string(path).map_err(|source| BuildError::Io {
            path: path.display().to_string(),
            source,
        })?;
        toml::from_str(&text)
            .map_err(|e| BuildError::Definition(format!("{}: {e}", path.display())))
    }

    /// Whether the layer is made by running steps rather than read from a source.
    pub fn is_step_build(&self) -> bool {
        !self.run.is_empty() || !self.from.is_empty()
    }

    /// The source, with relative paths taken from the definition file's directory.
    pub fn source(&self, def_path: &Path) -> Result<Source, BuildError> {
        let base = def_path.parent().unwrap_or(Path::new("."));
        let Some(s) = &self.source else {
            return Err(BuildError::Definition(format!(
                "{}: needs a [source] table (dir, tar, oci, image or git), or `from` layers \
                 and `run` steps",
                def_path.display()
            )));
        };
        let rel = |p: &PathBuf| {
            if p.is_absolute() {
                p.clone()
            } else {
                base.join(p)
            }
        };
        let mut found = Vec::new();
        if let Some(p) = &s.dir {
            found.push(Source::Dir(rel(p)));
        }
        if let Some(p) = &s.tar {
            found.push(Source::Tar(rel(p)));
        }
        if let Some(p) = &s.oci {
            found.push(Source::OciLayout {
                path: rel(p),
                reference: s.reference.clone(),
            });
        }
        if let Some(i) = &s.image {
            found.push(Source::Registry(i.clone()));
        }
        if let Some(p) = &s.git {
            found.push(Source::Git {
                repo: rel(p),
                rev: s.rev.clone().unwrap_or_else(|| "HEAD".into()),
            });
        }
        match found.len() {
            1 => Ok(found.remove(0)),
            0 => Err(BuildError::Definition(format!(
                "{}: [source] needs one of dir, tar, oci, image, git",
                def_path.display()
            ))),
            _ => Err(BuildError::Definition(format!(
                "{}: [source] names more than one of dir, tar, oci, image, git",
                def_path.display()
            ))),
        }
    }
}

impl Source {
    /// Interprets a command-line SOURCE: `docker://REF`, `oci:PATH[:REF]`, `git:PATH[@REV]`,
    /// `tar:PATH`, `-` (a tar on standard input), a directory, an OCI layout directory, or
    /// a tar file.
    pub fn parse(text: &str) -> Result<Source, BuildError> {
        if let Some(r) = text.strip_prefix("docker://") {
            return Ok(Source::Registry(r.to_string()));
        }
        if let Some(rest) = text.strip_prefix("oci:") {
            let (path, reference) = match rest.rsplit_once(':') {
                Some((p, r)) if !r.contains('/') => (p, Some(r.to_string())),
                _ => (rest, None),
            };
            return Ok(Source::OciLayout {
                path: path.into(),
                reference,
            });
        }
        if let Some(rest) = text.strip_prefix("git:") {
            let (repo, rev) = rest.rsplit_once('@').unwrap_or((rest, "HEAD"));
            return Ok(Source::Git {
                repo: repo.into(),
                rev: rev.to_string(),
            });
        }
        if let Some(p) = text.strip_prefix("tar:") {
            return Ok(Source::Tar(p.into()));
        }
        if text == "-" {
            return Ok(Source::Tar("-".into()));
        }
        let p = PathBuf::from(text);
        let meta = std::fs::metadata(&p).map_err(|source| BuildError::Io {
            path: text.to_string(),
            source,
        })?;
        if meta.is_dir() {
            if p.join("oci-layout").is_file() && p.join("index.json").is_file() {
                return Ok(Source::OciLayout {
                    path: p,
                    reference: None,
                });
            }
            return Ok(Source::Dir(p));
        }
        Ok(Source::Tar(p))
    }

    /// Reads the source into a tree, sending file data to `sink`; a registry image is
    /// pulled with `registry`'s settings.
    pub fn read(
        &self,
        kind: LayerKind,
        excludes: &Excludes,
        registry: &registry::RegistrySettings,
        sink: &dyn ChunkSink,
    ) -> Result<Tree, BuildError> {
        // A base is the bottom of every stack: whiteouts in it have nothing to hide.
        let whiteouts = if kind == LayerKind::Base {
            Whiteouts::Apply
        } else {
            Whiteouts::Overlay
        };
        match self {
            Source::Dir(p) => dir::read_dir(p, excludes, sink),
            Source::Tar(p) => {
                let what = p.display().to_string();
                let input: Box<dyn std::io::Read> = if p.as_os_str() == "-" {
                    Box::new(std::io::stdin().lock())
                } else {
                    Box::new(std::fs::File::open(p).map_err(|source| BuildError::Io {
                        path: what.clone(),
                        source,
                    })?)
                };
                let mut reader = tar::decompress(input, &what)?;
                let mut tree = Tree::new();
                tar::apply_tar(&mut tree, &mut reader, &what, whiteouts, excludes, sink)?;
                Ok(tree)
            }
            Source::OciLayout { path, reference } => {
                oci::read_layout(path, reference.as_deref(), whiteouts, excludes, sink)
            }
            Source::Registry(r) => registry::read_image(r, registry, whiteouts, excludes, sink),
            Source::Git { repo, rev } => read_git(repo, rev, excludes, sink),
            Source::Upper { dir, filter } => upper::read_upper(dir, filter, excludes, sink),
        }
    }
}

fn read_git(
    repo: &Path,
    rev: &str,
    excludes: &Excludes,
    sink: &dyn ChunkSink,
) -> Result<Tree, BuildError> {
    let what = format!("{}@{rev}", repo.display());
    let mut child = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["archive", "--format=tar", rev])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| BuildError::Io {
            path: format!("git (for {what})"),
            source,
        })?;
    let mut out = child
        .stdout
        .take()
        .ok_or_else(|| BuildError::Internal("git stdout missing".into()))?;
    let mut tree = Tree::new();
    let applied = tar::apply_tar(&mut tree, &mut out, &what, Whiteouts::Apply, excludes, sink);
    drop(out);
    let output = child.wait_with_output().map_err(|source| BuildError::Io {
        path: format!("git (for {what})"),
        source,
    })?;
    if !output.status.success() {
        return Err(BuildError::Source(format!(
            "git archive of {what} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    applied?;
    Ok(tree)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excludes_match_paths_and_globs() {
        let e = Excludes::new(&[
            "tmp".into(),
            "**/__pycache__".into(),
            "var/cache/apt".into(),
        ])
        .unwrap();
        assert!(e.matches(b"tmp"));
        assert!(e.matches(b"./tmp/"));
        assert!(!e.matches(b"tmpfile"));
        assert!(e.matches(b"usr/lib/python3/__pycache__"));
        assert!(e.matches(b"__pycache__"));
        assert!(e.matches(b"var/cache/apt"));
        assert!(!e.matches(b"var/cache/aptx"));
    }

    #[test]
    fn parses_source_forms() {
        assert_eq!(
            Source::parse("docker://127.0.0.1:5000/x:1").unwrap(),
            Source::Registry("127.0.0.1:5000/x:1".into())
        );
        assert_eq!(
            Source::parse("oci:/a/b:latest").unwrap(),
            Source::OciLayout {
                path: "/a/b".into(),
                reference: Some("latest".into())
            }
        );
        assert_eq!(
            Source::parse("git:/r@v1").unwrap(),
            Source::Git {
                repo: "/r".into(),
                rev: "v1".into()
            }
        );
        assert!(Source::parse("/definitely/not/here").is_err());
    }

    #[test]
    fn definition_needs_exactly_one_source() {
        let d: LayerDefinition =
            toml::from_str("kind = \"workspace\"\n[source]\ndir = \"tree\"\n").unwrap();
        assert_eq!(
            d.source(Path::new("/defs/x.toml")).unwrap(),
            Source::Dir("/defs/tree".into())
        );
        let d: LayerDefinition =
            toml::from_str("kind = \"base\"\n[source]\ndir = \"a\"\ntar = \"b\"\n").unwrap();
        assert!(d.source(Path::new("x.toml")).is_err());
        assert!(
            toml::from_str::<LayerDefinition>("kind = \"base\"\nsauce = 1\n[source]\n").is_err()
        );
    }
}
