//! The KV transfer protocol: one TCP connection per transfer, from the prefill worker (P) to the
//! decode worker's (D) KV listener. All integers are little-endian.
//!
//! ```text
//! P → D  preamble  "TANDEMKV" u32 version (= KV_WIRE_VERSION)
//! P → D  HELLO     transport, reservation, blocks, payload bytes per block, layout
//! D → P  OK        (token checked, then D pinned the reservation: ReservationGate::begin)
//!                                                                     | ERROR message, close
//! P → D  PING*     while P computes the prompt (keeps D's inactivity timer from firing)
//!        tcp: P → D  BLOCK × n   index, crc32, payload   (D checks and writes each one)
//!        shm: P writes the n blocks into D's mapped segment itself
//! P → D  DONE      n, crc32 × n
//! D → P  ACK       bytes verified (ReservationGate::complete)          | ERROR message, close
//! ```
//!
//! After the preamble every message is a *frame*: `tag: u8, len: u32, body: [u8; len]`.
//!
//! | tag | frame | body |
//! |---|---|---|
//! | 1 | HELLO | `u8` transport (1 tcp, 2 shm), `u64` reservation, `u32` blocks, `u64` payload bytes per block, `u32` num_layers, block_size, num_kv_heads, head_dim, `u16`+bytes layout name, `u16`+bytes segment path (shm; empty for tcp), `u16`+bytes auth token (32 bytes, or empty when the cluster has no secret) |
//! | 2 | OK | empty |
//! | 3 | ERROR | UTF-8 message (at most [`MAX_ERROR_BYTES`]) |
//! | 4 | BLOCK | `u32` index within the transfer (0, 1, … in order), `u32` CRC-32 of the payload, payload |
//! | 5 | DONE | `u32` n, n × `u32` CRC-32 of each block payload |
//! | 6 | ACK | `u64` bytes verified |
//! | 7 | PING | empty |
//!
//! A block payload is every layer's K bytes then V bytes of one block (see the [`super`]
//! documentation). Block `i` of a transfer goes into the `i`-th block id of the reservation.
//! Every frame has a hard size limit known before its body is read (a BLOCK frame is exactly
//! `8 + payload` bytes); anything else is refused.
//!
//! Version 2 added the auth token to HELLO; a version 1 sender is refused by its version.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::{KvToken, TransportError, TransportKind};

/// First bytes a sender writes.
pub const MAGIC: [u8; 8] = *b"TANDEMKV";
/// Version of this protocol (sent after the magic).
pub const KV_WIRE_VERSION: u32 = 2;
/// Bytes of the preamble: magic and version.
pub const PREAMBLE_BYTES: usize = 12;
/// Bytes of a frame header: tag and length.
pub const FRAME_HEADER_BYTES: usize = 5;
/// Bytes before a BLOCK frame's payload in its body: index and checksum.
pub const BLOCK_META_BYTES: usize = 8;
/// Largest HELLO body.
pub const MAX_HELLO_BYTES: usize = 4096;
/// Largest ERROR body.
pub const MAX_ERROR_BYTES: usize = 4096;
/// Largest block payload this build accepts (a block of every layer of a very large model is
/// still far smaller).
pub const MAX_BLOCK_PAYLOAD: usize = 256 << 20;
/// Most blocks in one transfer.
pub const MAX_TRANSFER_BLOCKS: usize = 1 << 20;

/// Frame tags.
pub mod tag {
    pub const HELLO: u8 = 1;
    pub const OK: u8 = 2;
    pub const ERROR: u8 = 3;
    pub const BLOCK: u8 = 4;
    pub const DONE: u8 = 5;
    pub const ACK: u8 = 6;
    pub const PING: u8 = 7;
}

/// Name of a frame tag, for messages.
pub fn tag_name(t: u8) -> String {
    match t {
        tag::HELLO => "HELLO".into(),
        tag::OK => "OK".into(),
        tag::ERROR => "ERROR".into(),
        tag::BLOCK => "BLOCK".into(),
        tag::DONE => "DONE".into(),
        tag::ACK => "ACK".into(),
        tag::PING => "PING".into(),
        other => format!("unknown tag {other:#04x}"),
    }
}

/// The preamble for `version`.
pub fn preamble(version: u32) -> [u8; PREAMBLE_BYTES] {
    let mut p = [0u8; PREAMBLE_BYTES];
    p[..8].copy_from_slice(&MAGIC);
    p[8..].copy_from_slice(&version.to_le_bytes());
    p
}

/// Checks a received preamble; the error says what is wrong.
pub fn check_preamble(p: &[u8; PREAMBLE_BYTES]) -> Result<(), String> {
    if p[..8] != MAGIC {
        return Err(format!("bad magic {:02x?} (not a Tandem KV sender)", &p[..8]));
    }
    let v = u32::from_le_bytes([p[8], p[9], p[10], p[11]]);
    if v != KV_WIRE_VERSION {
        return Err(format!("unsupported KV protocol version {v} (this worker speaks {KV_WIRE_VERSION})"));
    }
    Ok(())
}

/// A frame header for `tag` and a body of `len` bytes.
pub fn frame_header(tag: u8, len: usize) -> [u8; FRAME_HEADER_BYTES] {
    let mut h = [0u8; FRAME_HEADER_BYTES];
    h[0] = tag;
    h[1..].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

/// A whole frame.
pub fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(FRAME_HEADER_BYTES + body.len());
    f.extend_from_slice(&frame_header(tag, body.len()));
    f.extend_from_slice(body);
    f
}

/// CRC-32 (IEEE) of a block payload.
pub fn checksum(payload: &[u8]) -> u32 {
    crc32fast::hash(payload)
}

/// A whole BLOCK frame for block `index` of a transfer.
pub fn block_frame(index: u32, payload: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(BLOCK_META_BYTES + payload.len());
    body.extend_from_slice(&index.to_le_bytes());
    body.extend_from_slice(&checksum(payload).to_le_bytes());
    body.extend_from_slice(payload);
    frame(tag::BLOCK, &body)
}

/// A DONE body for these block checksums.
pub fn done_body(crcs: &[u32]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + 4 * crcs.len());
    b.extend_from_slice(&(crcs.len() as u32).to_le_bytes());
    for c in crcs {
        b.extend_from_slice(&c.to_le_bytes());
    }
    b
}

/// Parses a DONE body of a transfer of `expected` blocks.
pub fn parse_done(body: &[u8], expected: usize) -> Result<Vec<u32>, String> {
    if body.len() < 4 {
        return Err(format!("DONE frame of {} bytes is too short", body.len()));
    }
    let n = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
    if n != expected {
        return Err(format!("DONE announces {n} blocks, the transfer has {expected}"));
    }
    if body.len() != 4 + 4 * n {
        return Err(format!("DONE frame of {} bytes for {n} checksums", body.len()));
    }
    Ok(body[4..].chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// The first frame of a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub transport: TransportKind,
    pub reservation: u64,
    /// Blocks the sender will send (must equal the reservation's).
    pub num_blocks: u32,
    /// Bytes of one block payload.
    pub block_payload_bytes: u64,
    pub num_layers: u32,
    pub block_size: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    /// The layout name ([`tandem_engine::kv::KvLayout::name`]), which includes the dtype.
    pub layout: String,
    /// shm: the segment the sender mapped; empty for tcp.
    pub segment_path: String,
    /// Proof of the cluster secret; `None` when the sender has no secret.
    pub token: Option<KvToken>,
}

impl Hello {
    /// The HELLO body.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.layout.len() + self.segment_path.len());
        b.push(self.transport.wire_code());
        b.extend_from_slice(&self.reservation.to_le_bytes());
        b.extend_from_slice(&self.num_blocks.to_le_bytes());
        b.extend_from_slice(&self.block_payload_bytes.to_le_bytes());
        for d in [self.num_layers, self.block_size, self.num_kv_heads, self.head_dim] {
            b.extend_from_slice(&d.to_le_bytes());
        }
        let token = self.token.as_ref().map_or(&[][..], |t| &t.0[..]);
        for s in [self.layout.as_bytes(), self.segment_path.as_bytes(), token] {
            let n = s.len().min(u16::MAX as usize);
            b.extend_from_slice(&(n as u16).to_le_bytes());
            b.extend_from_slice(&s[..n]);
        }
        b
    }

    /// Parses a HELLO body.
    pub fn decode(body: &[u8]) -> Result<Hello, String> {
        let mut r = Reader { b: body, at: 0 };
        let code = r.u8()?;
        let transport =
            TransportKind::from_wire_code(code).ok_or_else(|| format!("unknown transport code {code}"))?;
        let h = Hello {
            transport,
            reservation: r.u64()?,
            num_blocks: r.u32()?,
            block_payload_bytes: r.u64()?,
            num_layers: r.u32()?,
            block_size: r.u32()?,
            num_kv_heads: r.u32()?,
            head_dim: r.u32()?,
            layout: r.string("layout name")?,
            segment_path: r.string("segment path")?,
            token: {
                let n = r.u16()? as usize;
                match r.take(n)? {
                    [] => None,
                    t => Some(KvToken(
                        t.try_into().map_err(|_| format!("HELLO auth token of {n} bytes (32 expected)"))?,
                    )),
                }
            },
        };
        if r.at != body.len() {
            return Err(format!("HELLO has {} trailing bytes", body.len() - r.at));
        }
        Ok(h)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or_else(|| {
            format!("HELLO truncated: {} bytes, field at {} needs {n}", self.b.len(), self.at)
        })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.u16()? as usize;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| format!("HELLO {what} is not UTF-8"))
    }
}

/// Reads exactly `buf.len()` bytes; each read may wait at most `timeout` (an inactivity limit,
/// not a deadline for the whole buffer). EOF before the end is an `UnexpectedEof` error.
pub(crate) async fn read_exact_idle<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut [u8],
    timeout: Duration,
    peer: &str,
    what: &str,
) -> Result<(), TransportError> {
    let mut at = 0;
    while at < buf.len() {
        let n = match tokio::time::timeout(timeout, r.read(&mut buf[at..])).await {
            Err(_) => {
                return Err(TransportError::Timeout { peer: peer.into(), what: what.into(), after: timeout })
            }
            Ok(Err(e)) => return Err(io_err(peer, what, e)),
            Ok(Ok(n)) => n,
        };
        if n == 0 {
            let e = std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("connection closed after {at} of {} bytes", buf.len()),
            );
            return Err(io_err(peer, what, e));
        }
        at += n;
    }
    Ok(())
}

/// Writes all of `buf`, in pieces of at most 1 MiB, each of which may wait at most `timeout`.
pub(crate) async fn write_all_idle<W: AsyncWrite + Unpin>(
    w: &mut W,
    buf: &[u8],
    timeout: Duration,
    peer: &str,
    what: &str,
) -> Result<(), TransportError> {
    for piece in buf.chunks(1 << 20) {
        match tokio::time::timeout(timeout, w.write_all(piece)).await {
            Err(_) => {
                return Err(TransportError::Timeout { peer: peer.into(), what: what.into(), after: timeout })
            }
            Ok(Err(e)) => return Err(io_err(peer, what, e)),
            Ok(Ok(())) => {}
        }
    }
    Ok(())
}

pub(crate) fn io_err(peer: &str, what: &str, e: std::io::Error) -> TransportError {
    TransportError::Io { peer: peer.into(), what: what.into(), source: e }
}

/// Reads a frame header and checks its length against `max_len(tag)` (`None`: the tag is not
/// allowed here) before the body is read.
pub(crate) async fn read_frame_header<R: AsyncRead + Unpin>(
    r: &mut R,
    timeout: Duration,
    peer: &str,
    what: &str,
    max_len: impl Fn(u8) -> Option<usize>,
) -> Result<(u8, usize), TransportError> {
    let mut h = [0u8; FRAME_HEADER_BYTES];
    read_exact_idle(r, &mut h, timeout, peer, what).await?;
    let t = h[0];
    let len = u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize;
    match max_len(t) {
        None => Err(TransportError::Protocol {
            peer: peer.into(),
            msg: format!("unexpected {} frame while {what}", tag_name(t)),
        }),
        Some(max) if len > max => Err(TransportError::Protocol {
            peer: peer.into(),
            msg: format!("{} frame of {len} bytes exceeds the limit of {max} while {what}", tag_name(t)),
        }),
        Some(_) => Ok((t, len)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            transport: TransportKind::Shm,
            reservation: 42,
            num_blocks: 3,
            block_payload_bytes: 1024,
            num_layers: 2,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 16,
            layout: tandem_engine::kv::KvDtype::F32.layout_name().into(),
            segment_path: "/dev/shm/tandem-kv-1-00".into(),
            token: Some(KvToken([7; 32])),
        }
    }

    #[test]
    fn hello_round_trips_and_refuses_truncation() {
        let b = hello().encode();
        assert_eq!(Hello::decode(&b).unwrap(), hello());
        assert!(Hello::decode(&b[..b.len() - 1]).unwrap_err().contains("truncated"));
        let mut extra = b.clone();
        extra.push(0);
        assert!(Hello::decode(&extra).unwrap_err().contains("trailing"));
        let mut bad = b.clone();
        bad[0] = 9;
        assert!(Hello::decode(&bad).unwrap_err().contains("transport code 9"));
        let none = Hello { token: None, ..hello() };
        assert_eq!(Hello::decode(&none.encode()).unwrap(), none);
        // A token of another length is malformed.
        let mut short = b[..b.len() - 34].to_vec();
        short.extend_from_slice(&5u16.to_le_bytes());
        short.extend_from_slice(&[1; 5]);
        assert!(Hello::decode(&short).unwrap_err().contains("auth token of 5 bytes"));
    }

    #[test]
    fn preamble_and_done() {
        assert!(check_preamble(&preamble(KV_WIRE_VERSION)).is_ok());
        assert!(check_preamble(&preamble(1)).unwrap_err().contains("version 1"));
        let mut p = preamble(KV_WIRE_VERSION);
        p[0] = b'X';
        assert!(check_preamble(&p).unwrap_err().contains("magic"));
        assert_eq!(parse_done(&done_body(&[1, 2, 3]), 3).unwrap(), vec![1, 2, 3]);
        assert!(parse_done(&done_body(&[1, 2]), 3).is_err());
        assert!(parse_done(&done_body(&[1, 2, 3])[..15], 3).is_err());
    }
}
