//! The daemon's control protocol: one JSON request per line on a Unix socket, one JSON
//! response per line. The CLI and the runtime are its clients. A failure is an `error`
//! response with its [`ErrorKind`] as `code`; [`Client::call`] turns it back into the
//! matching [`LazyError`] variant, so callers branch on the kind, never on the message.

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
    /// Removes a bind made by `Mount`/`MountMany` (one the daemon recorded; any other
    /// directory is refused with `not-bound`, and a bind with something mounted over it
    /// with `busy`); the layer is detached when no bind is left.
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
    Pong {
        pid: u32,
        store: String,
    },
    Attached(Attached),
    AttachedMany {
        layers: Vec<Attached>,
    },
    Done,
    Stats(LayerStats),
    CacheStats(CacheStats),
    Error {
        /// Absent in replies of daemons older than the codes: those decode as `internal`.
        #[serde(default)]
        code: ErrorKind,
        message: String,
    },
}

/// Why a request failed, as a code on the wire (kebab-case: `not-found`, `not-bound`, ...).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    /// The layer is not in the store, or not attached.
    NotFound,
    /// The request itself is wrong: malformed, an ambiguous layer prefix.
    Invalid,
    /// `Umount` of a directory that is not one of the daemon's binds.
    NotBound,
    /// The store could not be reached.
    Unavailable,
    /// A kernel mount or unmount failed.
    Mount,
    /// The mount is in use, or something else is mounted over it.
    Busy,
    /// Anything else, including codes this build does not know (a newer daemon's).
    #[default]
    #[serde(other)]
    Internal,
}

impl Response {
    /// The reply for a failed request.
    pub fn error(e: &LazyError) -> Response {
        let message = match e {
            // Their display adds a prefix the client's variant adds again.
            LazyError::Internal(m) | LazyError::Daemon(m) => m.clone(),
            e => e.to_string(),
        };
        Response::Error {
            code: e.kind(),
            message,
        }
    }
}

impl LazyError {
    /// The error an `error` reply stands for.
    pub fn from_reply(code: ErrorKind, message: String) -> LazyError {
        match code {
            ErrorKind::NotFound => LazyError::NotFound(message),
            ErrorKind::Invalid => LazyError::Invalid(message),
            ErrorKind::NotBound => LazyError::NotBound(message),
            ErrorKind::Unavailable => LazyError::Unavailable(message),
            ErrorKind::Mount => LazyError::Mount(message),
            ErrorKind::Busy => LazyError::Busy(message),
            ErrorKind::Internal => LazyError::Internal(message),
        }
    }
}

/// A connection to the daemon.
pub struct Client {
    stream: BufReader<UnixStream>,
}

impl Client {
    pub fn connect(socket: &Path) -> Result<Client, LazyError> {
        let s = strata_host::unix::connect(socket).map_err(LazyError::io(socket))?;
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
            Response::Error { code, message } => Err(LazyError::from_reply(code, message)),
            r => Ok(r),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a client makes of `e` after it crossed the socket as the daemon sends it.
    fn across_the_wire(e: &LazyError) -> LazyError {
        let text = serde_json::to_string(&Response::error(e)).unwrap();
        match serde_json::from_str::<Response>(&text).unwrap() {
            Response::Error { code, message } => LazyError::from_reply(code, message),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn error_kinds_survive_the_round_trip_as_their_variants() {
        let cases = [
            (
                LazyError::NotFound("layer x is not attached".into()),
                "not-found",
            ),
            (
                LazyError::Store(strata_store::StoreError::LayerNotFound("ab".into())),
                "not-found",
            ),
            (
                LazyError::Store(strata_store::StoreError::AmbiguousLayer {
                    prefix: "a".into(),
                    count: 2,
                }),
                "invalid",
            ),
            (LazyError::Invalid("bad request: eof".into()), "invalid"),
            (
                LazyError::NotBound("/x is not a lazyfs bind".into()),
                "not-bound",
            ),
            (LazyError::Unavailable("store down".into()), "unavailable"),
            (LazyError::Mount("bind mount at /x: EPERM".into()), "mount"),
            (LazyError::Busy("unmounting /x: EBUSY".into()), "busy"),
            (
                LazyError::Internal("mount task: panicked".into()),
                "internal",
            ),
        ];
        for (e, code) in cases {
            let wire = serde_json::to_value(Response::error(&e)).unwrap();
            assert_eq!(wire["kind"], "error", "{wire}");
            assert_eq!(wire["code"], code, "{wire}");
            let back = across_the_wire(&e);
            assert_eq!(back.kind(), e.kind(), "{e:?} came back as {back:?}");
            assert_eq!(back.to_string(), e.to_string(), "the message is unchanged");
        }
        // The variants callers branch on, by name.
        let not_bound = across_the_wire(&LazyError::NotBound("/x".into()));
        assert!(matches!(not_bound, LazyError::NotBound(m) if m == "/x"));
        let missing = LazyError::Store(strata_store::StoreError::LayerNotFound("ab".into()));
        assert!(matches!(across_the_wire(&missing), LazyError::NotFound(_)));
        assert!(matches!(
            across_the_wire(&LazyError::Unavailable("down".into())),
            LazyError::Unavailable(_)
        ));
        assert!(matches!(
            across_the_wire(&LazyError::Busy("busy".into())),
            LazyError::Busy(_)
        ));
        // Failures with no kind of their own are internal, their text kept.
        let io = LazyError::Io {
            path: "/m".into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        };
        let back = across_the_wire(&io);
        assert!(matches!(back, LazyError::Internal(_)), "{back:?}");
        assert!(back.to_string().contains(&io.to_string()), "{back}");
    }

    #[test]
    fn replies_without_a_code_or_with_an_unknown_one_are_internal() {
        for line in [
            r#"{"kind":"error","message":"boom"}"#,
            r#"{"kind":"error","code":"quota-exceeded","message":"boom"}"#,
        ] {
            match serde_json::from_str::<Response>(line).unwrap() {
                Response::Error { code, message } => {
                    assert_eq!(code, ErrorKind::Internal, "{line}");
                    let e = LazyError::from_reply(code, message);
                    assert!(matches!(&e, LazyError::Internal(m) if m == "boom"), "{e:?}");
                    assert_eq!(e.to_string(), "lazyfs daemon: boom");
                }
                other => panic!("{line}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_client_returns_the_typed_error_the_daemon_sent() {
        use std::os::unix::net::UnixListener;
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("control.sock");
        let listener = UnixListener::bind(&socket).unwrap();
        let server = std::thread::spawn(move || {
            let (conn, _) = listener.accept().unwrap();
            let mut conn = BufReader::new(conn);
            for reply in [
                Response::error(&LazyError::NotBound("/srv is not a lazyfs bind".into())),
                Response::Done,
            ] {
                let mut req = String::new();
                conn.read_line(&mut req).unwrap();
                let mut line = serde_json::to_string(&reply).unwrap();
                line.push('\n');
                conn.get_mut().write_all(line.as_bytes()).unwrap();
            }
        });
        let mut c = Client::connect(&socket).unwrap();
        let e = c.call(&Request::Umount { dir: "/srv".into() }).unwrap_err();
        assert!(
            matches!(&e, LazyError::NotBound(m) if m.contains("/srv")),
            "{e:?}"
        );
        assert_eq!(e.kind(), ErrorKind::NotBound);
        assert!(matches!(c.call(&Request::Ping).unwrap(), Response::Done));
        server.join().unwrap();
    }

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
                code: ErrorKind::NotBound,
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
