//! `strata-fuzz TARGET`: runs one target of [`strata_fuzz::TARGETS`] under AFL++ when built
//! by `cargo afl build --features afl` (see `scripts/fuzz.sh`); built plainly, it runs the
//! target once over its standard input (to replay a crash: `strata-fuzz T < input`).
//! `strata-fuzz --list` names the targets.

fn main() {
    let name = std::env::args().nth(1).unwrap_or_default();
    if name == "--list" {
        for (n, _) in strata_fuzz::TARGETS {
            println!("{n}");
        }
        return;
    }
    let Some(target) = strata_fuzz::target(&name) else {
        let names: Vec<&str> = strata_fuzz::TARGETS.iter().map(|(n, _)| *n).collect();
        eprintln!("usage: strata-fuzz TARGET (one of: {})", names.join(", "));
        std::process::exit(2);
    };
    #[cfg(feature = "afl")]
    afl::fuzz!(|data: &[u8]| {
        target(data);
    });
    #[cfg(not(feature = "afl"))]
    {
        let mut data = Vec::new();
        if let Err(e) = std::io::Read::read_to_end(&mut std::io::stdin(), &mut data) {
            eprintln!("reading the input: {e}");
            std::process::exit(2);
        }
        target(&data);
    }
}
