//! Compiles `tandem/v1/tandem.proto` with protox (a pure-Rust protobuf compiler, so no system
//! `protoc` is needed) and generates the prost messages and tonic clients and servers. The encoded
//! file descriptor set is written next to them for gRPC server reflection.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "tandem/v1/tandem.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("tandem_v1_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(fds)?;
    Ok(())
}
