//! Compiles `tandem/v1/tandem.proto` with protox (a pure-Rust protobuf compiler, so no system
//! `protoc` is needed) and generates the prost messages and tonic clients and servers. The encoded
//! file descriptor set is written next to them for gRPC server reflection. Services and clients
//! use [`codec::Codec`](src/codec.rs), which reports undecodable messages as INVALID_ARGUMENT.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "tandem/v1/tandem.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("tandem_v1_descriptor.bin"), fds.encode_to_vec())?;
    // Our codec reports undecodable requests (e.g. a string that is not UTF-8) as INVALID_ARGUMENT.
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .codec_path("crate::codec::Codec")
        .compile_fds(fds)?;
    Ok(())
}
