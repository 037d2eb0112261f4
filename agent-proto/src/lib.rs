//! The host–agent protocol, shared by the runtime (client) and `strata-agent` (server).
//!
//! One connection carries one conversation (a ping, one exec, a file read). It opens with
//! a handshake ([`handshake`]): the host's `Hello` names the protocol version and proves
//! it holds the sandbox's key; the agent's `Welcome` names its version and proves the
//! same, so neither side acts on a peer that is not the other (a command that got hold of
//! a socket, an agent of another build). Then the byte stream is a sequence of frames
//! ([`frame`]): control frames carry typed JSON messages ([`msg`]), data frames raw stdin,
//! stdout or stderr bytes, so output is never re-encoded. The same framing runs over a
//! Unix socket (function-call sandboxes, containers) and, multiplexed ([`mux`]), over a
//! VM's virtio-serial port. [`policy`] is the confinement every sandbox gets, one list for
//! every backend.

pub mod frame;
pub mod handshake;
pub mod msg;
pub mod mux;
pub mod policy;

pub use frame::{read_frame, write_control, write_frame, Frame, FrameKind, MAX_FRAME};
pub use handshake::{HandshakeError, SandboxKey};
pub use msg::*;

/// Bumped whenever a message changes incompatibly. Both ends check it on every
/// connection; the `Hello` / `Welcome` / `Refused` frames keep their shape across versions
/// so that a mismatch is always reported with both numbers.
pub const PROTOCOL_VERSION: u32 = 2;

/// The fields of /proc/PID/stat after the command name (which sits in parentheses and may
/// hold spaces): `[0]` is the state, `[1]` the parent PID, `[19]` the start time, `[21]`
/// the resident pages.
pub fn proc_stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    Some(rest.split(' ').map(str::to_string).collect())
}

/// A process's command line from /proc, arguments joined by spaces.
pub fn proc_cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .trim_end_matches('\0')
                .replace('\0', " ")
        })
        .unwrap_or_default()
}

/// `text` cut to at most `max` bytes at a character boundary: for showing what a peer sent
/// in a message (`String::truncate` panics inside a character, and a peer's text is any).
pub fn shortened(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn shortening_never_cuts_a_character() {
        assert_eq!(super::shortened("aé".repeat(3), 4), "aéa");
        assert_eq!(super::shortened("ééé".into(), 3), "é");
        assert_eq!(super::shortened("abc".into(), 10), "abc");
    }
}
