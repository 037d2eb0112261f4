//! Unix sockets at paths of any length. A socket address holds at most 107 bytes of
//! path, and a home under a deep directory (a CI checkout, a user's scratch space) gives
//! longer ones. Where a path does not fit, its directory is opened (`O_PATH`) and the
//! socket is named through `/proc/self/fd/N/NAME`, which the kernel resolves like the
//! directory itself: binding and connecting then work whatever the directory's depth.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
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

/// Binds `sock`, an unbound unix stream socket (one another process made, taken with
/// [`take_fd`]), at `path`, however long, and makes it listen.
pub fn listen_at(sock: &OwnedFd, path: &Path) -> io::Result<()> {
    let short = shorten(path)?;
    let bytes = short.path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is a plain C struct, for which all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    for (to, from) in addr.sun_path.iter_mut().zip(bytes) {
        *to = *from as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + bytes.len() + 1;
    // SAFETY: bind(2) reads `len` bytes of `addr`, which holds them (the path and its
    // terminating zero fit, checked above).
    let r = unsafe {
        libc::bind(
            sock.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: listen(2) on a descriptor we hold; no pointers.
    if unsafe { libc::listen(sock.as_raw_fd(), 128) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A descriptor of this process for the open file behind descriptor `fd` of process `pid`
/// (`pidfd_getfd`, Linux 5.6+; the caller needs to be allowed to ptrace `pid`).
pub fn take_fd(pid: u32, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a PID and flags, no pointers; a descriptor it returns is
    // ours alone.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above: the new descriptor is this process's own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    // SAFETY: pidfd_getfd takes descriptors and flags, no pointers.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pidfd_getfd made this descriptor for us (close-on-exec).
    Ok(unsafe { OwnedFd::from_raw_fd(got as i32) })
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
