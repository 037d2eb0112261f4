//! The fuzz targets: one function per parser that takes bytes from the untrusted side
//! (a sandbox, a VM guest, the store, a registry or a tar, another project's catalog
//! entry, an API client). Each must return for any input, never panic, and hold what it
//! parsed within its bounds. `src/main.rs` runs one under AFL++ (`scripts/fuzz.sh`); the
//! crate's tests run every target over its corpus and the inputs that once failed.

use std::collections::HashMap;

use strata_agent_proto::{mux, AgentMsg, Frame, MAX_FRAME};

/// A target: its name (the corpus directory under `fuzz/corpus/`) and its function.
pub type Target = (&'static str, fn(&[u8]));

/// Every target.
pub const TARGETS: &[Target] = &[
    ("agent_frame", agent_frame),
    ("mux_envelope", mux_envelope),
    ("manifest", manifest),
    ("tar_layer", tar_layer),
    ("catalog_entry", catalog_entry),
    ("e2b_connect", e2b_connect),
    ("grpc_create", grpc_create),
    ("egress_dns", egress_dns),
    ("egress_sniff", egress_sniff),
];

/// The target called `name`.
pub fn target(name: &str) -> Option<fn(&[u8])> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

/// What a sandbox's agent (or a guest) sends the host: frames, the first of them checked
/// as the handshake's answer.
pub fn agent_frame(data: &[u8]) {
    let (_, opening) = match strata_agent_proto::handshake::hello(None) {
        Ok(h) => h,
        Err(_) => return,
    };
    let mut r = data;
    let mut first = true;
    while let Ok(Some(frame)) = strata_agent_proto::read_frame::<serde_json::Value>(&mut r) {
        match frame {
            Frame::Control(v) => {
                if first {
                    let _ = opening.check(&v);
                }
                if let Ok(msg) = serde_json::from_value::<AgentMsg>(v) {
                    let _ = format!("{msg:?}");
                }
            }
            Frame::Data(_, bytes) => assert!(bytes.len() <= MAX_FRAME),
        }
        first = false;
    }
}

/// What a VM guest writes on its port: envelopes of many conversations, their bytes
/// parsed as frames per conversation as the host's agent clients would.
pub fn mux_envelope(data: &[u8]) {
    let mut r = data;
    let mut streams: HashMap<u32, Vec<u8>> = HashMap::new();
    while let Ok(Some((conn, kind, bytes))) = mux::read(&mut r) {
        assert!(bytes.len() <= mux::MAX_PIECE);
        if kind == mux::DATA {
            let s = streams.entry(conn).or_default();
            if s.len() + bytes.len() <= 4 * mux::MAX_PIECE {
                s.extend_from_slice(&bytes);
            }
        }
    }
    for bytes in streams.values() {
        agent_frame(bytes);
    }
}

/// A layer manifest from the store: parsed, then (with its ID made to match, so the
/// table's checks are reached) validated; a valid one is used as a reader would.
pub fn manifest(data: &[u8]) {
    let Ok(mut m) = serde_json::from_slice::<strata_store::LayerManifest>(data) else {
        return;
    };
    m.id = m.content_id();
    if m.validate().is_err() {
        return;
    }
    let _ = m.chunk_bytes();
    for c in m.chunks.clone() {
        let i = m.chunk_at(c.blob_offset);
        assert!(i < m.chunks.len());
        assert!(c.blob_offset + c.length as u64 <= m.blob_size);
        assert!(c.pack_offset.checked_add(c.stored_length as u64).is_some());
    }
    let _ = m.chunk_at(m.blob_size.saturating_sub(1));
}

/// Throws chunks away: the tar target checks parsing, not storage.
struct Discard;

impl strata_builder::chunker::ChunkSink for Discard {
    fn put(&self, _: &[u8], _: strata_store::Digest) -> Result<(), strata_builder::BuildError> {
        Ok(())
    }
}

/// A tar layer (plain, gzip or zstd; from a registry, an upload or a build): read into a
/// tree as an overlay layer, laid out and written as an EROFS image.
pub fn tar_layer(data: &[u8]) {
    use strata_builder::source::tar::{apply_tar, decompress};
    use strata_builder::tree::{Tree, Whiteouts};
    let Ok(mut reader) = decompress(data, "fuzz") else {
        return;
    };
    // Bounded: a small compressed input may stand for a large tar.
    let mut limited = std::io::Read::take(&mut reader, 64 << 20);
    let mut tree = Tree::new();
    let excludes = strata_builder::Excludes::default();
    if apply_tar(
        &mut tree,
        &mut limited,
        "fuzz",
        Whiteouts::Overlay,
        &excludes,
        &Discard,
    )
    .is_err()
    {
        return;
    }
    if let Ok(layout) = strata_builder::layout::layout(&tree) {
        let _ = strata_builder::erofs::write_image(&tree, &layout);
    }
}

/// A catalog entry as TOML (registered by another project, or read back from the store).
pub fn catalog_entry(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok(e) = strata_catalog::Entry::from_toml(&text, "fuzz") else {
        return;
    };
    let _ = e.budgets.memory_bytes();
    let _ = e.budgets.disk_bytes();
    let _ = e.budgets.timeout();
    let _ = e.all_layers();
    let _ = serde_json::to_vec(&e);
}

/// An E2B client's Connect stream: envelopes split at any point.
pub fn e2b_connect(data: &[u8]) {
    let Some((&split, rest)) = data.split_first() else {
        return;
    };
    let at = (split as usize).min(rest.len());
    let mut d = strata_service::e2b::connect::Deframer::default();
    for part in [&rest[..at], &rest[at..]] {
        d.push(part);
        while let Ok(Some(v)) = d.next_message() {
            let _ = strata_service::e2b::connect::field(&v, "processId", "process_id");
            let _ = strata_service::e2b::connect::int(v.get("pid"));
        }
    }
}

/// A gRPC `Sandboxes.Create` request body, decoded and checked as the node does.
pub fn grpc_create(data: &[u8]) {
    use prost::Message;
    if let Ok(req) = strata_service::proto::CreateRequest::decode(data) {
        let _ = strata_service::create_args(req);
    }
}

/// A DNS packet a sandbox sends its egress proxy, answered for a policy allowing
/// `*.example.org`: an answer is a DNS message again, and names only admitted addresses.
pub fn egress_dns(data: &[u8]) {
    use strata_egress::{dns, AnswerFilter, Policy};
    let Ok(policy) = Policy::of(&[("*.example.org", 443)]) else {
        return;
    };
    let filter = AnswerFilter::default();
    let (reply, outcome) = dns::answer(data, &policy, &filter, &mut |_| {
        vec![
            std::net::Ipv4Addr::new(127, 0, 0, 1),
            std::net::Ipv4Addr::new(93, 184, 216, 34),
        ]
    });
    if let dns::Outcome::Answered { name, addrs } = &outcome {
        assert!(policy.allows_name(name), "answered {name}");
        assert!(addrs.iter().all(|a| filter.admits(*a)), "{addrs:?}");
    }
    if let Some(reply) = reply {
        assert!(reply.len() <= 4096, "a reply of {} bytes", reply.len());
    }
}

/// The first bytes of a sandbox's connection, read for the name they ask for.
pub fn egress_sniff(data: &[u8]) {
    let data = &data[..data.len().min(strata_egress::sniff::SNIFF_MAX)];
    let got = strata_egress::sniff::sniff(data);
    if let Some(name) = got.name() {
        assert!(name.len() <= data.len(), "a name longer than its input");
    }
}
