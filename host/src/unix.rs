//! Unix sockets at paths of any length. A socket address holds at most 107 bytes of
//! path, and a home under a deep directory (a CI checkout, a user's scratch space) gives
//! longer ones. Where a path does not fit, its directory is opened (`O_PATH`) and the
//! socket is named through `/proc/self/fd/N/NAME`, which the kernel resolves like the
//! directory itself: binding and connecting then work whatever the directory's depth.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// The longest path a `sockaddr_un` holds (its 108 bytes less the terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// A socket path made short enough to use, holding open what makes it valid.
struct Short {
    path: PathBuf,
    _dir: Option<File>,
}

fn shorten(path: &Path) -> io::Result<Short> {
    if path.as_os_str().as_bytes().len() <= MAX_SOCKET_PATH {
        return Ok(Short {
            path: path.to_path_buf(),
            _dir: None,
        });
    }
    let too_long = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "socket path {} is longer than {MAX_SOCKET_PATH} bytes and its file name \
                 alone does not fit either; use a shorter directory",
                path.display()
            ),
        )
    };
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(too_long());
    };
    let dir = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(parent)?;
    let short = Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
    if short.as_os_str().as_bytes().len() > MAX_SOCKET_PATH {
        return Err(too_long());
    }
    Ok(Short {
        path: short,
        _dir: Some(dir),
    })
}

/// Binds a listening socket at `path`, however long.
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    let short = shorten(path)?;
    UnixListener::bind(&short.path)
}

/// Connects to the socket at `path`, however long.
pub fn connect(path: &Path) -> io::Result<UnixStream> {
    let short = shorten(path)?;
    UnixStream::connect(&short.path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn a_socket_deeper_than_an_address_holds_binds_and_connects() {
        let root = tempfile::tempdir().unwrap();
        let deep = root.path().join("d".repeat(60)).join("e".repeat(60));
        std::fs::create_dir_all(&deep).unwrap();
        let path = deep.join("agent.sock");
        assert!(path.as_os_str().len() > MAX_SOCKET_PATH);
        let listener = bind(&path).unwrap();
        assert!(path.exists(), "the socket is named where it was asked for");
        let mut client = connect(&path).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        client.write_all(b"hi").unwrap();
        let mut got = [0u8; 2];
        server.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi");
    }

    #[test]
    fn a_short_path_is_used_as_it_is() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("s.sock");
        let _l = bind(&path).unwrap();
        connect(&path).unwrap();
    }

    #[test]
    fn a_file_name_too_long_for_any_address_is_refused_with_the_path() {
        let root = tempfile::tempdir().unwrap();
        let path = root.path().join("n".repeat(120));
        let err = bind(&path).unwrap_err();
        assert!(err.to_string().contains("shorter directory"), "{err}");
    }
}
