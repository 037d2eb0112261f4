//! `strata-agent relay --port SOCK --listen SOCK`: the host end of a VM's agent channel.
//!
//! QEMU offers the guest's virtio-serial port as one Unix-socket connection; the runtime
//! (any number of CLI processes at once) wants a connection per conversation, exactly as
//! with a function-call sandbox's agent. The relay holds the port's one connection and
//! accepts conversations on `--listen`, multiplexing them over the port. It exits when
//! QEMU closes the port (the VM is gone).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_agent_proto::mux;

pub fn main(args: &[String]) -> Result<(), String> {
    let (mut port, mut listen) = (None, None);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--port" => port = Some(PathBuf::from(value)),
            "--listen" => listen = Some(PathBuf::from(value)),
            other => return Err(format!("unknown option {other}")),
        }
    }
    let usage = "usage: strata-agent relay --port SOCK --listen SOCK";
    let (port, listen) = (port.ok_or(usage)?, listen.ok_or(usage)?);
    let deadline = Instant::now() + Duration::from_secs(30);
    let stream = loop {
        match strata_host::unix::connect(&port) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => {
                return Err(format!("connecting to {}: {e}", port.display()))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    // A new host: whatever the guest held from before (a restored machine's
    // conversations) ends here, before the first of ours opens.
    mux::start_session(&mut &stream).map_err(|e| format!("port: {e}"))?;
    let _ = std::fs::remove_file(&listen);
    let listener = strata_host::unix::bind(&listen)
        .map_err(|e| format!("listening on {}: {e}", listen.display()))?;
    let out = Arc::new(Mutex::new(
        stream.try_clone().map_err(|e| format!("port: {e}"))?,
    ));
    let conns: Arc<Mutex<HashMap<u32, mux::Conversation>>> = Arc::default();
    {
        let (out, conns) = (out.clone(), conns.clone());
        // Conversation numbers start somewhere new each time, so a guest restored from a
        // snapshot never confuses a new conversation with one it had in flight.
        let mut next = std::process::id().wrapping_mul(2_654_435_761);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                next = next.wrapping_add(1);
                let id = next;
                // Known before the guest hears of it: its answer may come back before
                // `join` returns, and one to a conversation not (yet) in the map is dropped
                // (a lost `welcome` once made the next frame look like the handshake's
                // answer, with 64 VMs on two cores). The reader takes the map, then the
                // port, as this does: no deadlock.
                let mut map = conns.lock().unwrap_or_else(|p| p.into_inner());
                {
                    let mut w = out.lock().unwrap_or_else(|p| p.into_inner());
                    if mux::write(&mut *w, id, mux::OPEN, b"").is_err() {
                        std::process::exit(0);
                    }
                }
                if let Ok(conv) = mux::join(id, client, out.clone()) {
                    map.insert(id, conv);
                }
            }
        });
    }
    let mut input = std::io::BufReader::with_capacity(256 << 10, stream);
    loop {
        match mux::read(&mut input) {
            // Bytes, credit or an end; a guest that breaks a conversation's flow control
            // has it ended here, not held in our memory.
            Ok(Some(envelope)) => {
                let mut conns = conns.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(id) = mux::dispatch(&mut conns, &*out, envelope) {
                    eprintln!("strata-agent relay: conversation {id}: the guest broke flow control; ended");
                }
            }
            // QEMU closed the port: the VM is gone, and so is every conversation.
            Ok(None) => return Ok(()),
            Err(e) => return Err(format!("port: {e}")),
        }
    }
}
