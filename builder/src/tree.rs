//! The in-memory filesystem tree a layer is built from: inodes in an arena, directories as
//! byte-sorted name maps, hard links as several names for one node, and regular files as
//! the chunk lists the chunker produced (the data itself is already in the store).

use std::collections::{BTreeMap, HashMap, HashSet};

use strata_store::Digest;

use crate::BuildError;

pub type NodeId = usize;

/// The root directory's node.
pub const ROOT: NodeId = 0;

/// Largest name EROFS (and Linux) accepts.
pub const NAME_MAX: usize = 255;

/// Owner, permissions and time of a node. `mode` holds the permission bits including
/// setuid, setgid and sticky (0o7777); the file type comes from [`NodeKind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Meta {
    pub mode: u16,
    pub uid: u32,
    pub gid: u32,
    /// Whole seconds: sub-second times are dropped so that a directory and a tar of it
    /// (which keeps seconds only) give the same layer.
    pub mtime: i64,
}

impl Meta {
    pub const DEFAULT_DIR: Meta = Meta {
        mode: 0o755,
        uid: 0,
        gid: 0,
        mtime: 0,
    };
}

/// One storage chunk of a file: `length` bytes with content `digest`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChunkRef {
    pub digest: Digest,
    pub length: u32,
}

/// A run of non-hole EROFS chunks of a file, contiguous in the blob.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Index of the first EROFS chunk (of `1 << chunk_bits` bytes) the segment covers.
    pub first: u64,
    /// Number of EROFS chunks covered.
    pub count: u64,
    /// Storage chunks covering the segment's bytes, in order.
    pub chunks: Vec<ChunkRef>,
}

/// A regular file's content: its size and where its non-hole data is.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct FileData {
    pub size: u64,
    pub segments: Vec<Segment>,
}

impl FileData {
    /// EROFS chunk size for a file of this size: the whole file when it fits in 1 MiB
    /// (one index entry), else 1 MiB, the granularity of holes.
    pub fn chunk_bits(size: u64) -> u32 {
        let bits = 64 - size.saturating_sub(1).leading_zeros();
        bits.clamp(12, 20)
    }

    pub fn erofs_chunks(size: u64) -> u64 {
        size.div_ceil(1u64 << Self::chunk_bits(size))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeKind {
    Dir(BTreeMap<Vec<u8>, NodeId>),
    File(FileData),
    Symlink(Vec<u8>),
    CharDev { major: u32, minor: u32 },
    BlockDev { major: u32, minor: u32 },
    Fifo,
    Socket,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub meta: Meta,
    /// Full attribute names (`user.x`, `trusted.overlay.opaque`) to values.
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    pub kind: NodeKind,
}

impl Node {
    pub fn new(meta: Meta, kind: NodeKind) -> Node {
        Node {
            meta,
            xattrs: BTreeMap::new(),
            kind,
        }
    }

    pub fn is_dir(&self) -> bool {
        matches!(self.kind, NodeKind::Dir(_))
    }
}

/// How OCI/AUFS whiteout entries (`.wh.NAME`, `.wh..wh..opq`) are treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whiteouts {
    /// Apply them to the tree and drop them: the layer is the bottom of its stack.
    Apply,
    /// Apply them, and also record overlayfs whiteouts (0:0 character devices) and opaque
    /// directories, so the layer masks what lies under it in an overlay stack.
    Overlay,
}

pub const OPAQUE_XATTR: &[u8] = b"trusted.overlay.opaque";
const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// Splits a tar or relative path into components, rejecting `..` and over-long names.
pub fn split_path(path: &[u8]) -> Result<Vec<&[u8]>, BuildError> {
    let mut parts = Vec::new();
    for c in path.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                return Err(BuildError::BadEntry {
                    path: String::from_utf8_lossy(path).into_owned(),
                    reason: "path contains `..`; layer sources must stay inside their root".into(),
                })
            }
            name if name.len() > NAME_MAX => {
                return Err(BuildError::BadEntry {
                    path: String::from_utf8_lossy(path).into_owned(),
                    reason: format!(
                        "a name is {} bytes long; the limit is {NAME_MAX}",
                        name.len()
                    ),
                })
            }
            name => parts.push(name),
        }
    }
    Ok(parts)
}

/// A filesystem tree under construction.
#[derive(Debug, Clone)]
pub struct Tree {
    nodes: Vec<Node>,
    /// Directories created only because something inside them was named; their metadata
    /// must not override a lower layer's when layers are merged.
    implicit: HashSet<NodeId>,
}

/// A whiteout marker found in a layer, to be applied to the layers below it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Whiteout {
    /// `.wh.NAME`: the path that is removed.
    Remove { path: Vec<u8>, meta: Meta },
    /// `.wh..wh..opq`: the directory whose lower content is hidden.
    Opaque { dir: Vec<u8> },
}

impl Whiteout {
    /// Recognizes a whiteout marker path.
    pub fn parse(path: &[u8], meta: Meta) -> Result<Option<Whiteout>, BuildError> {
        let parts = split_path(path)?;
        let Some((last, dirs)) = parts.split_last() else {
            return Ok(None);
        };
        if !last.starts_with(WHITEOUT_PREFIX) {
            return Ok(None);
        }
        let dir = dirs.join(&b'/');
        if *last == OPAQUE_MARKER {
            return Ok(Some(Whiteout::Opaque { dir }));
        }
        let mut target = dir;
        if !target.is_empty() {
            target.push(b'/');
        }
        target.extend_from_slice(&last[WHITEOUT_PREFIX.len()..]);
        Ok(Some(Whiteout::Remove { path: target, meta }))
    }
}

impl Default for Tree {
    fn default() -> Self {
        Self::new()
    }
}

impl Tree {
    pub fn new() -> Tree {
        Tree {
            nodes: vec![Node::new(Meta::DEFAULT_DIR, NodeKind::Dir(BTreeMap::new()))],
            implicit: HashSet::new(),
        }
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id]
    }

    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id]
    }

    /// Every node, for changes that do not touch the tree's shape.
    pub fn nodes_mut(&mut self) -> impl Iterator<Item = &mut Node> {
        self.nodes.iter_mut()
    }

    pub fn children(&self, id: NodeId) -> Option<&BTreeMap<Vec<u8>, NodeId>> {
        match &self.nodes[id].kind {
            NodeKind::Dir(c) => Some(c),
            _ => None,
        }
    }

    fn children_mut(&mut self, id: NodeId) -> &mut BTreeMap<Vec<u8>, NodeId> {
        match &mut self.nodes[id].kind {
            NodeKind::Dir(c) => c,
            _ => unreachable!("children_mut on a non-directory"),
        }
    }

    /// Finds a node by path.
    pub fn lookup(&self, path: &[u8]) -> Option<NodeId> {
        let mut cur = ROOT;
        for part in split_path(path).ok()? {
            cur = *self.children(cur)?.get(part)?;
        }
        Some(cur)
    }

    /// The directory that will hold `parts`' last component, creating missing parents with
    /// default metadata (tar streams may name a file before, or without, its directory).
    fn parent_dir(&mut self, parts: &[&[u8]], path: &[u8]) -> Result<NodeId, BuildError> {
        let mut cur = ROOT;
        for part in &parts[..parts.len().saturating_sub(1)] {
            let next = self.children(cur).and_then(|c| c.get(*part)).copied();
            cur = match next {
                Some(n) if self.nodes[n].is_dir() => n,
                Some(_) => {
                    return Err(BuildError::BadEntry {
                        path: String::from_utf8_lossy(path).into_owned(),
                        reason: format!("`{}` is not a directory", String::from_utf8_lossy(part)),
                    })
                }
                None => {
                    let id =
                        self.push(Node::new(Meta::DEFAULT_DIR, NodeKind::Dir(BTreeMap::new())));
                    self.implicit.insert(id);
                    self.children_mut(cur).insert(part.to_vec(), id);
                    id
                }
            };
        }
        Ok(cur)
    }

    fn push(&mut self, node: Node) -> NodeId {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// Puts `node` at `path`, replacing what was there. A directory replacing a directory
    /// keeps its children (tar streams list a directory's metadata after its content, and
    /// later OCI layers re-list parent directories); the empty path updates the root.
    pub fn insert(&mut self, path: &[u8], node: Node) -> Result<NodeId, BuildError> {
        let parts = split_path(path)?;
        if parts.is_empty() {
            if !node.is_dir() {
                return Err(BuildError::BadEntry {
                    path: String::from_utf8_lossy(path).into_owned(),
                    reason: "the root of a layer must be a directory".into(),
                });
            }
            self.nodes[ROOT].meta = node.meta;
            self.nodes[ROOT].xattrs = node.xattrs;
            return Ok(ROOT);
        }
        let parent = self.parent_dir(&parts, path)?;
        let name = parts[parts.len() - 1];
        if let Some(&existing) = self.children(parent).and_then(|c| c.get(name)) {
            if self.nodes[existing].is_dir() && node.is_dir() {
                self.nodes[existing].meta = node.meta;
                self.nodes[existing].xattrs = node.xattrs;
                self.implicit.remove(&existing);
                return Ok(existing);
            }
        }
        let id = self.push(node);
        self.children_mut(parent).insert(name.to_vec(), id);
        Ok(id)
    }

    /// Adds another name for the node at `target` (a hard link).
    pub fn link(&mut self, path: &[u8], target: &[u8]) -> Result<NodeId, BuildError> {
        let id = self.lookup(target).ok_or_else(|| BuildError::BadEntry {
            path: String::from_utf8_lossy(path).into_owned(),
            reason: format!(
                "hard link to `{}`, which is not in the tree (it must come earlier in the source)",
                String::from_utf8_lossy(target)
            ),
        })?;
        if self.nodes[id].is_dir() {
            return Err(BuildError::BadEntry {
                path: String::from_utf8_lossy(path).into_owned(),
                reason: "hard link to a directory".into(),
            });
        }
        let parts = split_path(path)?;
        let parent = self.parent_dir(&parts, path)?;
        let name = parts
            .last()
            .ok_or_else(|| BuildError::BadEntry {
                path: String::from_utf8_lossy(path).into_owned(),
                reason: "hard link with an empty name".into(),
            })?
            .to_vec();
        self.children_mut(parent).insert(name, id);
        Ok(id)
    }

    /// Removes the entry at `path` if present.
    pub fn remove(&mut self, path: &[u8]) -> Result<(), BuildError> {
        let parts = split_path(path)?;
        let Some((last, dirs)) = parts.split_last() else {
            return Ok(());
        };
        let mut cur = ROOT;
        for d in dirs {
            match self.children(cur).and_then(|c| c.get(*d)) {
                Some(&n) => cur = n,
                None => return Ok(()),
            }
        }
        if let NodeKind::Dir(c) = &mut self.nodes[cur].kind {
            c.remove(*last);
        }
        Ok(())
    }

    /// Stacks `layer` (one OCI/tar layer read on its own) on this tree: its whiteouts hide
    /// what lies below, then its entries are added. With [`Whiteouts::Overlay`] the
    /// whiteouts are also kept, as overlayfs markers, to mask layers stacked under this one.
    pub fn apply_layer(
        &mut self,
        mut layer: Tree,
        whiteouts: &[Whiteout],
        mode: Whiteouts,
    ) -> Result<(), BuildError> {
        for w in whiteouts {
            match w {
                Whiteout::Remove { path, meta } => {
                    self.remove(path)?;
                    if mode == Whiteouts::Overlay && layer.lookup(path).is_none() {
                        layer.insert(
                            path,
                            Node::new(*meta, NodeKind::CharDev { major: 0, minor: 0 }),
                        )?;
                    }
                }
                Whiteout::Opaque { dir } => {
                    if let Some(d) = self.lookup(dir).filter(|&d| self.nodes[d].is_dir()) {
                        self.children_mut(d).clear();
                    }
                    if mode == Whiteouts::Overlay {
                        let d = match layer.lookup(dir) {
                            Some(d) if layer.nodes[d].is_dir() => d,
                            _ => layer.insert(
                                dir,
                                Node::new(Meta::DEFAULT_DIR, NodeKind::Dir(BTreeMap::new())),
                            )?,
                        };
                        layer.nodes[d]
                            .xattrs
                            .insert(OPAQUE_XATTR.to_vec(), b"y".to_vec());
                    }
                }
            }
        }
        let mut copied = HashMap::new();
        self.graft(ROOT, &layer, ROOT, &mut copied);
        Ok(())
    }

    /// Copies the children of `src` in `other` into directory `dst`, merging directories.
    fn graft(
        &mut self,
        dst: NodeId,
        other: &Tree,
        src: NodeId,
        copied: &mut HashMap<NodeId, NodeId>,
    ) {
        let Some(children) = other.children(src) else {
            return;
        };
        for (name, &child) in children {
            let theirs = &other.nodes[child];
            let ours = self.children(dst).and_then(|c| c.get(name)).copied();
            match ours {
                Some(o) if self.nodes[o].is_dir() && theirs.is_dir() => {
                    if !other.implicit.contains(&child) {
                        self.nodes[o].meta = theirs.meta;
                        self.nodes[o].xattrs = theirs.xattrs.clone();
                        self.implicit.remove(&o);
                    } else if let Some(v) = theirs.xattrs.get(OPAQUE_XATTR) {
                        self.nodes[o]
                            .xattrs
                            .insert(OPAQUE_XATTR.to_vec(), v.clone());
                    }
                    self.graft(o, other, child, copied);
                }
                _ => {
                    let id = match copied.get(&child) {
                        Some(&id) => id,
                        None => {
                            let mut node = theirs.clone();
                            if let NodeKind::Dir(c) = &mut node.kind {
                                c.clear();
                            }
                            let id = self.push(node);
                            if other.implicit.contains(&child) {
                                self.implicit.insert(id);
                            }
                            copied.insert(child, id);
                            if theirs.is_dir() {
                                self.graft(id, other, child, copied);
                            }
                            id
                        }
                    };
                    self.children_mut(dst).insert(name.clone(), id);
                }
            }
        }
    }

    /// Visits every reachable node once, depth first in name order, parents before
    /// children, with the path of its first name. This order fixes the layer's layout.
    pub fn walk<'a>(&'a self, mut f: impl FnMut(&[u8], NodeId, &'a Node)) {
        let mut seen = vec![false; self.nodes.len()];
        let mut stack: Vec<(Vec<u8>, NodeId)> = vec![(Vec::new(), ROOT)];
        while let Some((path, id)) = stack.pop() {
            if std::mem::replace(&mut seen[id], true) {
                continue;
            }
            f(&path, id, &self.nodes[id]);
            if let Some(children) = self.children(id) {
                for (name, &child) in children.iter().rev() {
                    let mut p = path.clone();
                    if !p.is_empty() {
                        p.push(b'/');
                    }
                    p.extend_from_slice(name);
                    stack.push((p, child));
                }
            }
        }
    }

    /// Moves the whole tree under `prefix` (created as 0755 root directories); the old
    /// root's metadata goes to the innermost one.
    pub fn rebase(mut self, prefix: &[u8]) -> Result<Tree, BuildError> {
        let parts = split_path(prefix)?;
        if parts.is_empty() {
            return Ok(self);
        }
        let old_root = std::mem::replace(
            &mut self.nodes[ROOT],
            Node::new(Meta::DEFAULT_DIR, NodeKind::Dir(BTreeMap::new())),
        );
        let moved = self.push(old_root);
        let mut cur = ROOT;
        for (i, part) in parts.iter().enumerate() {
            let next = if i + 1 == parts.len() {
                moved
            } else {
                self.push(Node::new(Meta::DEFAULT_DIR, NodeKind::Dir(BTreeMap::new())))
            };
            self.children_mut(cur).insert(part.to_vec(), next);
            cur = next;
        }
        Ok(self)
    }

    /// Number of regular files and their total size (hard links counted once).
    pub fn file_totals(&self) -> (u64, u64) {
        let (mut files, mut bytes) = (0, 0);
        self.walk(|_, _, n| {
            if let NodeKind::File(f) = &n.kind {
                files += 1;
                bytes += f.size;
            }
        });
        (files, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(size: u64) -> Node {
        Node::new(
            Meta {
                mode: 0o644,
                uid: 0,
                gid: 0,
                mtime: 1,
            },
            NodeKind::File(FileData {
                size,
                segments: vec![],
            }),
        )
    }

    #[test]
    fn insert_creates_parents_and_keeps_children_of_relisted_dirs() {
        let mut t = Tree::new();
        t.insert(b"./a/b/c.txt", file(3)).unwrap();
        let dir = Node::new(
            Meta {
                mode: 0o700,
                uid: 5,
                gid: 5,
                mtime: 9,
            },
            NodeKind::Dir(BTreeMap::new()),
        );
        t.insert(b"a/b/", dir).unwrap();
        let b = t.lookup(b"a/b").unwrap();
        assert_eq!(t.node(b).meta.uid, 5);
        assert!(t.lookup(b"a/b/c.txt").is_some());
        assert!(t.insert(b"a/b/c.txt/d", file(1)).is_err());
        assert!(t.insert(b"../etc/passwd", file(1)).is_err());
        assert!(t.insert(&[b'x'; 256], file(1)).is_err());
    }

    #[test]
    fn layers_apply_whiteouts_to_what_is_below_only() {
        for mode in [Whiteouts::Apply, Whiteouts::Overlay] {
            let mut lower = Tree::new();
            lower.insert(b"etc/keep", file(1)).unwrap();
            lower.insert(b"etc/gone", file(1)).unwrap();
            lower.insert(b"opt/x/y", file(1)).unwrap();
            let dir = Node::new(
                Meta {
                    mode: 0o700,
                    uid: 3,
                    gid: 3,
                    mtime: 5,
                },
                NodeKind::Dir(BTreeMap::new()),
            );
            lower.insert(b"opt/x", dir).unwrap();
            let mut upper = Tree::new();
            upper.insert(b"opt/x/new", file(2)).unwrap();
            let marks: Vec<_> = [
                b"etc/.wh.gone".as_slice(),
                b"opt/x/.wh..wh..opq",
                b"etc/keep",
            ]
            .iter()
            .filter_map(|p| Whiteout::parse(p, Meta::DEFAULT_DIR).unwrap())
            .collect();
            assert_eq!(marks.len(), 2);
            lower.apply_layer(upper, &marks, mode).unwrap();
            let x = lower.lookup(b"opt/x").unwrap();
            let names: Vec<_> = lower.children(x).unwrap().keys().cloned().collect();
            assert_eq!(
                names,
                vec![b"new".to_vec()],
                "same-layer entries survive the opaque marker"
            );
            assert_eq!(
                lower.node(x).meta.uid,
                3,
                "an implicit directory keeps the lower metadata"
            );
            assert!(lower.lookup(b"etc/keep").is_some());
            let gone = lower.lookup(b"etc/gone");
            match mode {
                Whiteouts::Apply => {
                    assert!(gone.is_none());
                    assert!(lower.node(x).xattrs.is_empty());
                }
                Whiteouts::Overlay => {
                    assert_eq!(
                        lower.node(gone.unwrap()).kind,
                        NodeKind::CharDev { major: 0, minor: 0 }
                    );
                    assert_eq!(lower.node(x).xattrs.get(OPAQUE_XATTR).unwrap(), b"y");
                }
            }
        }
    }

    #[test]
    fn hard_links_share_a_node_and_walk_visits_it_once() {
        let mut t = Tree::new();
        t.insert(b"a", file(10)).unwrap();
        t.link(b"z/b", b"a").unwrap();
        assert_eq!(t.lookup(b"a"), t.lookup(b"z/b"));
        assert_eq!(t.file_totals(), (1, 10));
        let mut paths = Vec::new();
        t.walk(|p, _, _| paths.push(String::from_utf8_lossy(p).into_owned()));
        assert_eq!(paths, vec!["", "a", "z"]);
        assert!(t.link(b"c", b"missing").is_err());
    }

    #[test]
    fn rebase_moves_the_tree_under_a_prefix() {
        let mut t = Tree::new();
        t.insert(b"src/a.py", file(3)).unwrap();
        t.node_mut(ROOT).meta.mode = 0o700;
        let t = t.rebase(b"/work/repo/").unwrap();
        assert!(t.lookup(b"work/repo/src/a.py").is_some());
        assert_eq!(t.node(t.lookup(b"work/repo").unwrap()).meta.mode, 0o700);
        assert_eq!(t.node(ROOT).meta, Meta::DEFAULT_DIR);
        assert_eq!(t.children(ROOT).unwrap().len(), 1);
    }

    #[test]
    fn chunk_bits() {
        assert_eq!(FileData::chunk_bits(1), 12);
        assert_eq!(FileData::chunk_bits(4096), 12);
        assert_eq!(FileData::chunk_bits(4097), 13);
        assert_eq!(FileData::chunk_bits(1 << 20), 20);
        assert_eq!(FileData::chunk_bits(100 << 20), 20);
        assert_eq!(FileData::erofs_chunks(100 << 20), 100);
        assert_eq!(FileData::erofs_chunks(5000), 1);
    }

    /// What a path holds in the model: a directory, or a file told apart by a marker.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Held {
        Dir,
        File(u64),
    }

    type Model = BTreeMap<String, Held>;

    fn under(path: &str, root: &str) -> bool {
        path == root || path.starts_with(&format!("{root}/"))
    }

    /// The model of [`Tree::insert`]: refused under a non-directory; a directory over a
    /// directory keeps it; anything else replaces what was there, with all it held.
    fn model_insert(m: &mut Model, path: &str, held: Held) -> bool {
        let parts: Vec<&str> = path.split('/').collect();
        for n in 1..parts.len() {
            let prefix = parts[..n].join("/");
            match m.get(&prefix) {
                Some(Held::File(_)) => return false,
                Some(Held::Dir) => {}
                None => {
                    m.insert(prefix, Held::Dir);
                }
            }
        }
        if m.get(path) == Some(&Held::Dir) && held == Held::Dir {
            return true;
        }
        m.retain(|p, _| !under(p, path));
        m.insert(path.to_string(), held);
        true
    }

    fn node_of(held: Held) -> Node {
        match held {
            Held::Dir => Node::new(Meta::DEFAULT_DIR, NodeKind::Dir(BTreeMap::new())),
            Held::File(marker) => file(marker),
        }
    }

    /// A tree and its model from the same inserts (those the tree refuses are skipped).
    fn build(entries: &[(String, Held)]) -> (Tree, Model) {
        let (mut t, mut m) = (Tree::new(), Model::new());
        for (path, held) in entries {
            let accepted = t.insert(path.as_bytes(), node_of(*held)).is_ok();
            assert_eq!(accepted, model_insert(&mut m, path, *held), "insert {path}");
        }
        (t, m)
    }

    fn seen(t: &Tree) -> Model {
        let mut out = Model::new();
        t.walk(|path, _, node| {
            let p = String::from_utf8_lossy(path)
                .trim_start_matches('/')
                .to_string();
            if p.is_empty() {
                return;
            }
            let held = match &node.kind {
                NodeKind::Dir(_) => Held::Dir,
                NodeKind::File(f) => Held::File(f.size),
                other => panic!("unexpected {other:?}"),
            };
            out.insert(p, held);
        });
        out
    }

    fn entry() -> impl proptest::strategy::Strategy<Value = (String, Held)> {
        use proptest::prelude::*;
        (
            proptest::collection::vec(prop_oneof!["a", "b", "c"], 1..=3),
            proptest::option::of(0u64..4),
        )
            .prop_map(|(parts, marker)| (parts.join("/"), marker.map_or(Held::Dir, Held::File)))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]

        /// A layer stacked with its whiteouts (Apply) against the model of OCI layers:
        /// removals take a path and all it held, an opaque directory loses what lay below,
        /// then the layer's entries go on top (a directory over a directory merges).
        #[test]
        fn whiteouts_apply_as_the_model_says(
            lower in proptest::collection::vec(entry(), 0..12),
            upper in proptest::collection::vec(entry(), 0..8),
            outs in proptest::collection::vec((entry(), proptest::bool::ANY), 0..4),
        ) {
            let (mut tree, mut model) = build(&lower);
            let (layer, upper_model) = build(&upper);
            let whiteouts: Vec<Whiteout> = outs
                .iter()
                .map(|((path, _), opaque)| {
                    if *opaque {
                        Whiteout::Opaque { dir: path.as_bytes().to_vec() }
                    } else {
                        Whiteout::Remove { path: path.as_bytes().to_vec(), meta: Meta::DEFAULT_DIR }
                    }
                })
                .collect();
            for ((path, _), opaque) in &outs {
                if *opaque {
                    if model.get(path) == Some(&Held::Dir) {
                        model.retain(|p, _| p == path || !under(p, path));
                    }
                } else {
                    model.retain(|p, _| !under(p, path));
                }
            }
            for (path, held) in &upper_model {
                if model.get(path) == Some(&Held::Dir) && *held == Held::Dir {
                    continue;
                }
                model.retain(|p, _| !under(p, path));
                model.insert(path.clone(), *held);
            }
            tree.apply_layer(layer, &whiteouts, Whiteouts::Apply).unwrap();
            proptest::prop_assert_eq!(seen(&tree), model);
        }
    }
}
