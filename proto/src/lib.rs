//! Wire types for Tandem (`tandem.v1`), generated at build time from `tandem/v1/tandem.proto` by
//! protox and tonic: prost messages, tonic clients (`*_client`) and servers (`*_server`), all
//! speaking through [`codec::Codec`].

pub mod codec;

/// Package `tandem.v1`.
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("tandem.v1");

    /// The encoded `FileDescriptorSet` of `tandem.v1`, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/tandem_v1_descriptor.bin"));
}

/// The `tandem.v1` protocol definition as text.
pub const TANDEM_V1_PROTO: &str = include_str!("../tandem/v1/tandem.proto");

/// Version of the worker protocol carried in every compatibility record; bumped on any change a
/// peer must know about (messages, KV wire format, block byte layout).
pub const PROTOCOL_VERSION: u32 = 1;

/// gRPC metadata a worker sets on a request's error when the request's LoRA adapter cannot run
/// there: [`ADAPTER_UNKNOWN`] (it holds no adapter of that name) or [`ADAPTER_OTHER_WEIGHTS`] (it
/// holds other weights under the name). The router stops sending the adapter's requests to that
/// worker on either, and on nothing else: a code or a message alone does not say it.
pub const ADAPTER_ERROR_KEY: &str = "tandem-adapter-error";
/// See [`ADAPTER_ERROR_KEY`].
pub const ADAPTER_UNKNOWN: &str = "unknown";
/// See [`ADAPTER_ERROR_KEY`].
pub const ADAPTER_OTHER_WEIGHTS: &str = "other-weights";

/// `st` marked as a refusal for the request's adapter, `why` being [`ADAPTER_UNKNOWN`] or
/// [`ADAPTER_OTHER_WEIGHTS`] (see [`ADAPTER_ERROR_KEY`]).
pub fn mark_adapter_refusal(mut st: tonic::Status, why: &'static str) -> tonic::Status {
    st.metadata_mut().insert(ADAPTER_ERROR_KEY, tonic::metadata::MetadataValue::from_static(why));
    st
}

/// The mark of a refusal for the request's adapter ([`mark_adapter_refusal`]); `None` for any
/// other status.
pub fn adapter_refusal(st: &tonic::Status) -> Option<&str> {
    st.metadata().get(ADAPTER_ERROR_KEY).and_then(|v| v.to_str().ok())
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::v1;

    #[test]
    fn proto_declares_package() {
        assert!(super::TANDEM_V1_PROTO.contains("package tandem.v1;"));
    }

    #[test]
    fn optional_fields_distinguish_unset_from_zero() {
        let req = v1::GenerateRequest {
            prompt: Some(v1::generate_request::Prompt::Text("hi".into())),
            max_tokens: Some(0),
            ..Default::default()
        };
        let back = v1::GenerateRequest::decode(req.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back.max_tokens, Some(0));
        assert_eq!(back.sampling, None);
        let empty = v1::GenerateRequest::decode(&[][..]).unwrap();
        assert_eq!(empty.max_tokens, None);
        assert!(empty.prompt.is_none());
    }

    #[test]
    fn descriptor_set_names_every_service() {
        let fds = prost_types_lite::services(v1::FILE_DESCRIPTOR_SET);
        for s in ["Tandem", "Registry", "Worker"] {
            assert!(fds.iter().any(|n| n == s), "service {s} missing from the descriptor set: {fds:?}");
        }
    }

    /// Just enough of `FileDescriptorSet` to list service names, so the test needs no extra crate.
    mod prost_types_lite {
        use prost::Message;

        #[derive(Clone, PartialEq, Message)]
        struct Set {
            #[prost(message, repeated, tag = "1")]
            file: Vec<File>,
        }
        #[derive(Clone, PartialEq, Message)]
        struct File {
            #[prost(message, repeated, tag = "6")]
            service: Vec<Service>,
        }
        #[derive(Clone, PartialEq, Message)]
        struct Service {
            #[prost(string, optional, tag = "1")]
            name: Option<String>,
        }

        pub fn services(bytes: &[u8]) -> Vec<String> {
            let set = Set::decode(bytes).expect("descriptor set decodes");
            set.file.into_iter().flat_map(|f| f.service).filter_map(|s| s.name).collect()
        }
    }
}
