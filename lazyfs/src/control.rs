//! The daemon's control protocol: one JSON request per line on a Unix socket, one JSON
//! response per line. The CLI and the runtime are its clients.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::blob::LayerStats;
use crate::cache::CacheStats;
use crate::LazyError;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    Ping,
    /// Makes a layer available: metadata image on local disk, blob served, shared EROFS
    /// mount in place.
    Attach {
        id: String,
    },
    /// Attach, then bind the layer's shared mount read-only at `dir`.
    Mount {
        id: String,
        dir: PathBuf,
    },
    /// `Mount` for several layers in one round trip (a sandbox's whole stack); stops at
    /// the first failure, keeping the binds made before it.
    MountMany {
        binds: Vec<(String, PathBuf)>,
    },
    /// Removes a bind made by `Mount`; the layer is detached when no bind is left.
    Umount {
        dir: PathBuf,
    },
    Stats {
        id: String,
    },
    CacheStats,
    Prune {
        max_bytes: u64,
    },
    /// Unmounts everything and exits.
    Shutdown,
}

/// Where an attached layer is.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Attached {
    pub id: String,
    pub meta_path: PathBuf,
    pub blob_path: Option<PathBuf>,
    /// The layer's one shared EROFS mount.
    pub mount: PathBuf,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Response {
    Pong { pid: u32, store: String },
    Attached(Attached),
    AttachedMany { layers: Vec<Attached> },
    Done,
    Stats(LayerStats),
    CacheStats(CacheStats),
    Error { message: String },
}

/// A connection to the daemon.
pub struct Client {
    stream: BufReader<UnixStream>,
}

impl Client {
    pub fn connect(socket: &Path) -> Result<Client, LazyError> {
        let s = UnixStream::connect(socket).map_err(LazyError::io(socket))?;
        s.set_read_timeout(Some(Duration::from_secs(600)))
            .map_err(LazyError::io(socket))?;
        Ok(Client {
            stream: BufReader::new(s),
        })
    }

    pub fn call(&mut self, req: &Request) -> Result<Response, LazyError> {
        let mut line =
            serde_json::to_string(req).map_err(|e| LazyError::Protocol(e.to_string()))?;
        line.push('\n');
        self.stream
            .get_mut()
            .write_all(line.as_bytes())
            .map_err(|e| LazyError::Protocol(format!("sending to the lazyfs daemon: {e}")))?;
        let mut reply = String::new();
        self.stream
            .read_line(&mut reply)
            .map_err(|e| LazyError::Protocol(format!("reading from the lazyfs daemon: {e}")))?;
        if reply.is_empty() {
            return Err(LazyError::Protocol(
                "the lazyfs daemon closed the connection".into(),
            ));
        }
        match serde_json::from_str(&reply)
            .map_err(|e| LazyError::Protocol(format!("bad reply `{reply}`: {e}")))?
        {
            Response::Error { message } => Err(LazyError::Daemon(message)),
            r => Ok(r),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_shape_encodes_and_decodes() {
        let a = Attached {
            id: "ab".into(),
            meta_path: "/m".into(),
            blob_path: None,
            mount: "/mnt".into(),
        };
        for resp in [
            Response::Attached(a.clone()),
            Response::AttachedMany {
                layers: vec![a.clone(), a],
            },
            Response::Done,
            Response::Error {
                message: "x".into(),
            },
        ] {
            let text = serde_json::to_string(&resp).unwrap();
            let back: Response = serde_json::from_str(&text).unwrap();
            assert_eq!(serde_json::to_string(&back).unwrap(), text);
        }
        let req = Request::MountMany {
            binds: vec![("ab".into(), "/x".into())],
        };
        let text = serde_json::to_string(&req).unwrap();
        assert!(matches!(
            serde_json::from_str::<Request>(&text).unwrap(),
            Request::MountMany { binds } if binds.len() == 1
        ));
    }
}
