//! The codec every generated service and client uses: prost's, except that a message that does
//! not decode (bad wire format, a `string` field that is not UTF-8) is INVALID_ARGUMENT naming the
//! field, not INTERNAL. A client sending such bytes made a mistake the server did not; gRPC's
//! default of INTERNAL would tell it to look for a bug on the wrong side.
//!
//! The same code reaches a client that decodes a malformed response; Tandem's clients only
//! receive what Tandem's servers encode, so that case is a peer speaking another protocol.

use tonic::codec::{BufferSettings, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Prost encoding, with decode failures reported as INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct Codec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(ProstCodec::default())
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = InvalidArgumentDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        InvalidArgumentDecoder(self.0.decoder())
    }
}

/// [`ProstDecoder`] with its errors turned into INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct InvalidArgumentDecoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for InvalidArgumentDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|st| {
            // prost's message names the path to the bad field
            // ("GenerateRequest.prompt: Prompt.text: invalid string value: data is not UTF-8 encoded").
            let detail =
                st.message().strip_prefix("failed to decode Protobuf message: ").unwrap_or(st.message());
            Status::invalid_argument(format!("malformed protobuf message: {detail}"))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
