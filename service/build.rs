//! Compiles `proto/strata/v1/*.proto` with protox (a protobuf compiler in Rust, so a build
//! needs no `protoc` on the host) and generates the tonic server and client.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let files = [
        "strata/v1/node.proto",
        "strata/v1/sandboxes.proto",
        "strata/v1/catalog.proto",
        "strata/v1/layers.proto",
    ];
    let fds = protox::compile(files, [&root])?;
    for f in files {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
