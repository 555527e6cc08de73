//! Wire types for Tandem (`tandem.v1`).
//!
//! The `.proto` sources live in `proto/tandem/v1/`. Generating Rust types from them (protox + tonic)
//! arrives with the disaggregated-serving work; until then this crate only exposes the source text so
//! that other crates can embed or inspect it.

/// The `tandem.v1` protocol definition.
pub const TANDEM_V1_PROTO: &str = include_str!("../tandem/v1/tandem.proto");

#[cfg(test)]
mod tests {
    #[test]
    fn proto_declares_package() {
        assert!(super::TANDEM_V1_PROTO.contains("package tandem.v1;"));
    }
}
