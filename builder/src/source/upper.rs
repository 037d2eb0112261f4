//! Reads an overlayfs upper directory (what build steps changed over their input layers)
//! as a layer: added and changed entries, whiteouts (0:0 character devices) and opaque
//! directories kept as overlayfs reads them, the overlay's own bookkeeping and the build's
//! timestamps removed so that the same changes always give the same layer.

use std::path::{Path, PathBuf};

use crate::chunker::ChunkSink;
use crate::source::{dir, Excludes, PathFilter};
use crate::tree::{Tree, OPAQUE_XATTR};
use crate::BuildError;

/// Modification time every entry of a step-built layer gets.
pub const NORMALIZED_MTIME: i64 = 0;

const OVERLAY_XATTR_PREFIX: &[u8] = b"trusted.overlay.";

/// What to keep of an upper directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpperFilter {
    /// The input layers' roots (read only for existence checks), to tell the `__pycache__`
    /// directories the steps left beside the inputs' Python files from new ones.
    pub lowers: Vec<PathBuf>,
    /// Keep only these paths (globs, like excludes) and what lies under them; empty keeps
    /// everything.
    pub capture: Vec<String>,
    /// Leave out `__pycache__` directories whose parent directory comes from an input.
    pub drop_input_pycache: bool,
}

struct Filter<'a> {
    excludes: &'a Excludes,
    capture: Vec<Vec<glob::Pattern>>,
    lowers: &'a [PathBuf],
    drop_input_pycache: bool,
}

impl Filter<'_> {
    /// Whether `parts` is a captured path, lies under one, or is a directory on the way to
    /// one.
    fn captured(&self, parts: &[&str], is_dir: bool) -> bool {
        if self.capture.is_empty() {
            return true;
        }
        self.capture.iter().any(|pattern| {
            let common = parts.len().min(pattern.len());
            let prefix_matches = parts[..common]
                .iter()
                .zip(&pattern[..common])
                .all(|(part, p)| p.matches(part));
            prefix_matches && (parts.len() >= pattern.len() || is_dir)
        })
    }

    fn input_pycache(&self, rel: &str) -> bool {
        let Some(parent) = rel.strip_suffix("__pycache__") else {
            return false;
        };
        if !(parent.is_empty() || parent.ends_with('/')) {
            return false;
        }
        self.lowers
            .iter()
            .any(|lower| layer_entry(lower, parent).is_some_and(|m| m.is_dir()))
    }
}

/// What `rel` is in the layer mounted at `lower`, found without following a link on the
/// way (a layer's absolute link would name a path of the host here); none if it is not
/// there.
pub fn layer_entry(lower: &Path, rel: &str) -> Option<std::fs::Metadata> {
    let parts: Vec<&str> = rel.split('/').filter(|p| !p.is_empty()).collect();
    let mut p = lower.to_path_buf();
    let mut meta = std::fs::symlink_metadata(&p).ok()?;
    for part in parts {
        // A link's metadata is not a directory's: nothing beyond a link is looked at.
        if !meta.is_dir() {
            return None;
        }
        p.push(part);
        meta = std::fs::symlink_metadata(&p).ok()?;
    }
    Some(meta)
}

impl PathFilter for Filter<'_> {
    fn skip(&self, rel: &[u8], is_dir: bool) -> bool {
        if self.excludes.matches(rel) {
            return true;
        }
        let text = String::from_utf8_lossy(rel);
        let text = text.trim_start_matches("./").trim_matches('/');
        let parts: Vec<&str> = text.split('/').filter(|p| !p.is_empty()).collect();
        if !self.captured(&parts, is_dir) {
            return true;
        }
        is_dir && self.drop_input_pycache && self.input_pycache(text)
    }
}

/// Capture globs split into per-component patterns.
fn capture_patterns(capture: &[String]) -> Result<Vec<Vec<glob::Pattern>>, BuildError> {
    capture
        .iter()
        .map(|c| {
            c.trim_matches('/')
                .split('/')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    glob::Pattern::new(p)
                        .map_err(|e| BuildError::Definition(format!("capture pattern `{c}`: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .collect()
}

/// Reads `upper` into a tree, leaving out `excludes` and what `filter` rejects.
pub fn read_upper(
    upper: &Path,
    filter: &UpperFilter,
    excludes: &Excludes,
    sink: &dyn ChunkSink,
) -> Result<Tree, BuildError> {
    let capture = capture_patterns(&filter.capture)?;
    let walk_filter = Filter {
        excludes,
        capture,
        lowers: &filter.lowers,
        drop_input_pycache: filter.drop_input_pycache,
    };
    let mut tree = dir::read_dir(upper, &walk_filter, sink)?;
    normalize(&mut tree);
    Ok(tree)
}

/// Drops the overlay's bookkeeping attributes (origin file handles, impure and redirect
/// markers differ between runs) but keeps opaque markers, and fixes every timestamp.
fn normalize(tree: &mut Tree) {
    for node in tree.nodes_mut() {
        node.meta.mtime = NORMALIZED_MTIME;
        node.xattrs
            .retain(|name, _| !name.starts_with(OVERLAY_XATTR_PREFIX) || name == OPAQUE_XATTR);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter<'a>(excludes: &'a Excludes, capture: &[&str], lowers: &'a [PathBuf]) -> Filter<'a> {
        Filter {
            excludes,
            capture: capture_patterns(&capture.iter().map(|c| c.to_string()).collect::<Vec<_>>())
                .unwrap(),
            lowers,
            drop_input_pycache: true,
        }
    }

    #[test]
    fn capture_keeps_paths_their_parents_and_what_lies_under() {
        let none = Excludes::default();
        let f = filter(&none, &["/usr/local/lib/python3*"], &[]);
        assert!(!f.skip(b"usr", true));
        assert!(!f.skip(b"usr/local/lib", true));
        assert!(!f.skip(b"usr/local/lib/python3.11", true));
        assert!(!f.skip(b"usr/local/lib/python3.11/x/y.py", false));
        assert!(f.skip(b"usr/local/bin", true));
        assert!(f.skip(b"usr/local/lib/file", false));
        assert!(f.skip(b"etc/passwd", false));
        let all = filter(&none, &[], &[]);
        assert!(!all.skip(b"etc/passwd", false));
    }

    #[test]
    fn only_pycache_beside_input_files_is_dropped() {
        let lower = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(lower.path().join("usr/lib/python3")).unwrap();
        let lowers = vec![lower.path().to_path_buf()];
        let none = Excludes::default();
        let f = filter(&none, &[], &lowers);
        assert!(f.skip(b"usr/lib/python3/__pycache__", true));
        assert!(!f.skip(b"usr/lib/python3/newpkg/__pycache__", true));
        assert!(!f.skip(b"usr/lib/python3/not__pycache__", true));
        assert!(!f.skip(b"usr/lib/python3/__pycache__", false));
    }
}
