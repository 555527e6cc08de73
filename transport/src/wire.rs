//! The KV transfer protocol: one TCP connection per transfer, from the prefill worker (P) to the
//! decode worker's (D) KV listener. All integers are little-endian.
//!
//! ```text
//! P → D  preamble  "TANDEMKV" u32 version (= KV_WIRE_VERSION)
//! P → D  HELLO     transport, reservation, blocks, payload bytes per block, layout
//! D → P  OK        (token checked, then D pinned the reservation: ReservationGate::begin)
//!                                                                     | ERROR message, close
//! P → D  PING*     while P computes the prompt (keeps D's inactivity timer from firing)
//!        tcp: P → D  BLOCKS × g   first, count, crc32 × count, payloads   (D reads each group
//!                                 straight into the reserved blocks and checks every block)
//!        shm: P writes a group of blocks into D's mapped segment itself, then
//!             P → D  SUMS × g     first, count, crc32 × count             (D checks the group
//!                                 while P writes the next one)
//! P → D  DONE      n
//! D → P  ACK       bytes verified (ReservationGate::complete)          | ERROR message, close
//! ```
//!
//! After the preamble every message is a *frame*: `tag: u8, len: u32, body: [u8; len]`.
//!
//! | tag | frame | body |
//! |---|---|---|
//! | 1 | HELLO | `u8` transport (1 tcp, 2 shm), `u64` reservation, `u32` blocks, `u64` payload bytes per block, `u32` num_layers, block_size, num_kv_heads, head_dim, `u16`+bytes layout name, `u16`+bytes segment path (shm; empty for tcp), `u16`+bytes auth token (32 bytes, or empty when the cluster has no secret), `u16`+bytes kind extension (cuda-ipc, nccl and nixl only), then, optionally, `u16`+bytes LoRA adapter id (1 to [`MAX_ADAPTER_ID_BYTES`] bytes of UTF-8; absent for the base model) |
//! | 2 | OK | empty |
//! | 3 | ERROR | UTF-8 message (at most [`MAX_ERROR_BYTES`]) |
//! | 5 | DONE | `u32` n (blocks in the transfer) |
//! | 6 | ACK | `u64` bytes verified |
//! | 7 | PING | empty |
//! | 8 | BLOCKS | `u32` first index, `u32` count, count × `u32` CRC-32 of each block payload, then the count payloads |
//! | 9 | SUMS | `u32` first index, `u32` count, count × `u32` CRC-32 of each block payload |
//!
//! A block payload is every layer's K bytes then V bytes of one block (see the [`super`]
//! documentation). Block `i` of a transfer goes into the `i`-th block id of the reservation.
//! Groups (BLOCKS on tcp, SUMS on shm) come in order: each starts where the previous one ended,
//! and together they cover the `n` blocks exactly once before DONE. A BLOCKS frame holds at most
//! [`max_group_blocks`] blocks. Every frame has a hard size limit known before its body is read;
//! anything else is refused.
//!
//! The HELLO's adapter id says under which LoRA adapter the prefill worker computed the blocks:
//! the receiver refuses a transfer whose id differs from the one the reservation was made for
//! ([`crate::ReservationGate::adapter_id`]). It is a trailing field, absent for the base model,
//! so a HELLO without an adapter is byte for byte what a sender before adapters wrote (and the
//! version did not change); a receiver before adapters refuses a HELLO with one ("trailing
//! bytes"), as it should, since it cannot check it.
//!
//! Version 2 added the auth token to HELLO. Version 3 replaced the per-block BLOCK frame (tag 4)
//! and the checksums-at-the-end DONE with groups (BLOCKS, SUMS) and a DONE that only counts; a
//! sender of an older version is refused by its version.

use std::time::Duration;

use std::io::IoSliceMut;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use crate::conn::KvRead;
use crate::{KvToken, TransportError, TransportKind};

/// First bytes a sender writes.
pub const MAGIC: [u8; 8] = *b"TANDEMKV";
/// Version of this protocol (sent after the magic).
pub const KV_WIRE_VERSION: u32 = 3;
/// Bytes of the preamble: magic and version.
pub const PREAMBLE_BYTES: usize = 12;
/// Bytes of a frame header: tag and length.
pub const FRAME_HEADER_BYTES: usize = 5;
/// Bytes of a group's head in a BLOCKS or SUMS body, before its checksums: first index and count.
pub const GROUP_HEAD_BYTES: usize = 8;
/// Largest HELLO body.
pub const MAX_HELLO_BYTES: usize = 4096;
/// Longest LoRA adapter id a HELLO may carry (ids are 32 hex digits).
pub const MAX_ADAPTER_ID_BYTES: usize = 128;
/// Largest ERROR body.
pub const MAX_ERROR_BYTES: usize = 4096;
/// Largest block payload this build accepts (a block of every layer of a very large model is
/// still far smaller).
pub const MAX_BLOCK_PAYLOAD: usize = 256 << 20;
/// Most blocks in one transfer.
pub const MAX_TRANSFER_BLOCKS: usize = 1 << 20;
/// Most payload bytes in one BLOCKS frame (unless a single block is larger: then a group is one
/// block).
pub const MAX_GROUP_BYTES: usize = 64 << 20;

/// Frame tags.
pub mod tag {
    pub const HELLO: u8 = 1;
    pub const OK: u8 = 2;
    pub const ERROR: u8 = 3;
    /// Version 2's one-block frame; no longer sent or accepted.
    pub const BLOCK_V2: u8 = 4;
    pub const DONE: u8 = 5;
    pub const ACK: u8 = 6;
    pub const PING: u8 = 7;
    pub const BLOCKS: u8 = 8;
    pub const SUMS: u8 = 9;
    /// nccl: the sender's source block ids, just before it posts its sends.
    pub const NCCL_GO: u8 = 10;
}

/// Name of a frame tag, for messages.
pub fn tag_name(t: u8) -> String {
    match t {
        tag::HELLO => "HELLO".into(),
        tag::OK => "OK".into(),
        tag::ERROR => "ERROR".into(),
        tag::BLOCK_V2 => "BLOCK (KV protocol version 2)".into(),
        tag::DONE => "DONE".into(),
        tag::ACK => "ACK".into(),
        tag::PING => "PING".into(),
        tag::BLOCKS => "BLOCKS".into(),
        tag::SUMS => "SUMS".into(),
        tag::NCCL_GO => "NCCL_GO".into(),
        other => format!("unknown tag {other:#04x}"),
    }
}

/// Most blocks in one BLOCKS frame for blocks of `payload` bytes (at least one).
pub fn max_group_blocks(payload: usize) -> usize {
    (MAX_GROUP_BYTES / payload.max(1)).max(1)
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
        return Err(format!(
            "unsupported KV protocol version {v} (this worker speaks {KV_WIRE_VERSION}; run the same \
             Tandem version on prefill and decode workers)"
        ));
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
    tandem_engine::kv::checksum::update(0, payload)
}

/// Bytes of a BLOCKS or SUMS frame up to the end of its checksums, for a group of `count`.
pub fn group_head_len(count: usize) -> usize {
    FRAME_HEADER_BYTES + GROUP_HEAD_BYTES + 4 * count
}

/// Writes the frame header, first index and count of a group into `out[..GROUP_HEAD_BYTES + 5]`
/// (the checksums follow, at [`group_head_len`]`(0)`).
pub fn put_group_head(out: &mut [u8], tag: u8, first: u32, count: u32, payload_bytes: usize) {
    let body = GROUP_HEAD_BYTES + 4 * count as usize + payload_bytes;
    out[..FRAME_HEADER_BYTES].copy_from_slice(&frame_header(tag, body));
    out[FRAME_HEADER_BYTES..FRAME_HEADER_BYTES + 4].copy_from_slice(&first.to_le_bytes());
    out[FRAME_HEADER_BYTES + 4..FRAME_HEADER_BYTES + 8].copy_from_slice(&count.to_le_bytes());
}

/// A whole BLOCKS frame carrying `payloads` as blocks `first, first + 1, …` of a transfer.
pub fn blocks_frame(first: u32, payloads: &[&[u8]]) -> Vec<u8> {
    let total: usize = payloads.iter().map(|p| p.len()).sum();
    let mut f = vec![0u8; group_head_len(payloads.len())];
    put_group_head(&mut f, tag::BLOCKS, first, payloads.len() as u32, total);
    for (i, p) in payloads.iter().enumerate() {
        let at = group_head_len(i);
        f[at..at + 4].copy_from_slice(&checksum(p).to_le_bytes());
    }
    for p in payloads {
        f.extend_from_slice(p);
    }
    f
}

/// A whole SUMS frame: the checksums of blocks `first, first + 1, …` of a transfer.
pub fn sums_frame(first: u32, crcs: &[u32]) -> Vec<u8> {
    let mut f = vec![0u8; group_head_len(0)];
    put_group_head(&mut f, tag::SUMS, first, crcs.len() as u32, 0);
    for c in crcs {
        f.extend_from_slice(&c.to_le_bytes());
    }
    f
}

/// Parses a group's first index and count, checking that it starts at `next` and stays inside a
/// transfer of `n` blocks and within `max_count` blocks.
pub fn parse_group_head(
    b: &[u8; GROUP_HEAD_BYTES],
    next: usize,
    n: usize,
    max_count: usize,
) -> Result<(usize, usize), String> {
    let first = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let count = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize;
    if count == 0 {
        return Err(format!("empty group at block index {first}"));
    }
    if first >= n || count > n - first {
        return Err(format!(
            "group of blocks {first}..{} outside the reservation of {n} blocks",
            first as u64 + count as u64
        ));
    }
    if first != next {
        return Err(format!("group starting at block index {first} out of order (expected {next})"));
    }
    if count > max_count {
        return Err(format!("group of {count} blocks exceeds the limit of {max_count}"));
    }
    Ok((first, count))
}

/// Little-endian `u32`s of `b` (whose length is a multiple of 4).
pub fn parse_u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The DONE body of a transfer of `n` blocks.
pub fn done_body(n: usize) -> Vec<u8> {
    (n as u32).to_le_bytes().to_vec()
}

/// Parses a DONE body of a transfer of `expected` blocks.
pub fn parse_done(body: &[u8], expected: usize) -> Result<(), String> {
    let Ok(b) = <[u8; 4]>::try_from(body) else {
        return Err(format!("DONE frame of {} bytes (4 expected)", body.len()));
    };
    let n = u32::from_le_bytes(b) as usize;
    if n != expected {
        return Err(format!("DONE announces {n} blocks, the transfer has {expected}"));
    }
    Ok(())
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
    /// What the GPU kinds and nixl add (encoded only for them): cuda-ipc, the IPC handle of the
    /// pool the sender opened; nccl, [`NcclHello`]'s encoding; nixl, the name of the receiver's
    /// agent whose metadata the sender loaded. Empty for shm and tcp.
    pub ext: Vec<u8>,
    /// The id of the LoRA adapter the blocks were computed under
    /// ([`tandem_engine::lora::LoraAdapter::id`]); empty for the base model (then not encoded).
    pub adapter_id: String,
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
        let ext: &[u8] = if self.transport.hello_ext() { &self.ext } else { &[] };
        let mut fields = vec![self.layout.as_bytes(), self.segment_path.as_bytes(), token];
        if self.transport.hello_ext() {
            fields.push(ext);
        }
        // The adapter id is optional and trailing: only a HELLO with an adapter carries it.
        if !self.adapter_id.is_empty() {
            fields.push(self.adapter_id.as_bytes());
        }
        for s in fields {
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
            ext: Vec::new(),
            adapter_id: String::new(),
        };
        let mut h = h;
        if transport.hello_ext() {
            let n = r.u16()? as usize;
            h.ext = r.take(n)?.to_vec();
        }
        // The optional adapter id: present when at least its length is left. Present, it is
        // never empty (the base model omits it), so every accepted HELLO has one encoding.
        if body.len() - r.at >= 2 {
            let n = r.u16()? as usize;
            if n == 0 {
                return Err("HELLO has an empty adapter id field (the base model omits it)".into());
            }
            if n > MAX_ADAPTER_ID_BYTES {
                return Err(format!("HELLO adapter id of {n} bytes (at most {MAX_ADAPTER_ID_BYTES})"));
            }
            let id = r.take(n)?;
            h.adapter_id =
                String::from_utf8(id.to_vec()).map_err(|_| "HELLO adapter id is not UTF-8".to_owned())?;
        }
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

/// How long an I/O wait whose inactivity limit has passed gets to finish after all. A process
/// that was frozen (SIGSTOP) or starved of CPU wakes with its timers due, possibly before it
/// has seen the bytes its peer sent meanwhile; those bytes are progress, not a silent peer.
const IDLE_GRACE: Duration = Duration::from_millis(200);

/// `tokio::time::timeout(timeout, fut)`, with [`IDLE_GRACE`] more when `timeout` runs out.
pub(crate) async fn within_idle<F: std::future::Future>(
    timeout: Duration,
    fut: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    tokio::pin!(fut);
    match tokio::time::timeout(timeout, &mut fut).await {
        Ok(v) => Ok(v),
        Err(_) => tokio::time::timeout(IDLE_GRACE, &mut fut).await,
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
        let n = match within_idle(timeout, r.read(&mut buf[at..])).await {
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

/// Reads exactly as many bytes as `bufs` hold, in order, straight into them: first what `rd` has
/// buffered, then vectored reads from the socket into the slices themselves (no staging copy).
/// Each wait for the socket may last at most `timeout`. EOF before the end is an `UnexpectedEof`
/// error.
pub(crate) async fn read_into_slices(
    rd: &mut BufReader<KvRead>,
    bufs: &mut [&mut [u8]],
    timeout: Duration,
    peer: &str,
    what: &str,
) -> Result<(), TransportError> {
    let total: usize = bufs.iter().map(|b| b.len()).sum();
    // Position: slice `i`, byte `at` within it.
    let (mut i, mut at, mut done) = (0usize, 0usize, 0usize);
    // Whatever a frame-header read left in the reader's buffer comes first.
    while done < total && !rd.buffer().is_empty() {
        while i < bufs.len() && bufs[i].is_empty() {
            i += 1;
        }
        let have = rd.buffer();
        let n = have.len().min(bufs[i].len() - at);
        bufs[i][at..at + n].copy_from_slice(&have[..n]);
        rd.consume(n);
        advance(bufs, n, &mut i, &mut at);
        done += n;
    }
    let sock = match rd.get_ref() {
        KvRead::Plain(sock) => sock,
        KvRead::Tls(_) => {
            // TLS records are decrypted into the reader anyway: ordinary reads, slice by slice.
            while i < bufs.len() {
                let from = std::mem::take(&mut at);
                if from < bufs[i].len() {
                    read_exact_idle(rd, &mut bufs[i][from..], timeout, peer, what).await?;
                }
                i += 1;
            }
            return Ok(());
        }
    };
    while done < total {
        let r = {
            let mut iov: Vec<IoSliceMut<'_>> = Vec::with_capacity(MAX_IOVECS.min(bufs.len() - i));
            for (j, b) in bufs[i..].iter_mut().enumerate() {
                if iov.len() == MAX_IOVECS {
                    break;
                }
                let from = if j == 0 { at } else { 0 };
                if from < b.len() {
                    iov.push(IoSliceMut::new(&mut b[from..]));
                }
            }
            sock.try_read_vectored(&mut iov)
        };
        match r {
            Ok(0) => {
                let e = std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("connection closed after {done} of {total} bytes"),
                );
                return Err(io_err(peer, what, e));
            }
            Ok(n) => {
                advance(bufs, n, &mut i, &mut at);
                done += n;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                match within_idle(timeout, sock.readable()).await {
                    Err(_) => {
                        return Err(TransportError::Timeout {
                            peer: peer.into(),
                            what: what.into(),
                            after: timeout,
                        })
                    }
                    Ok(Err(e)) => return Err(io_err(peer, what, e)),
                    Ok(Ok(())) => {}
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(peer, what, e)),
        }
    }
    Ok(())
}

/// Moves the position (slice `i`, byte `at`) `n` bytes on.
fn advance(bufs: &[&mut [u8]], mut n: usize, i: &mut usize, at: &mut usize) {
    while n > 0 {
        let step = (bufs[*i].len() - *at).min(n);
        *at += step;
        n -= step;
        if *at == bufs[*i].len() {
            *i += 1;
            *at = 0;
        }
    }
}

/// Most slices handed to one vectored read (Linux's `IOV_MAX` is 1024).
const MAX_IOVECS: usize = 1024;

/// Writes all of `buf`, in pieces of at most 1 MiB, each of which may wait at most `timeout`.
pub(crate) async fn write_all_idle<W: AsyncWrite + Unpin>(
    w: &mut W,
    buf: &[u8],
    timeout: Duration,
    peer: &str,
    what: &str,
) -> Result<(), TransportError> {
    for piece in buf.chunks(1 << 20) {
        match within_idle(timeout, w.write_all(piece)).await {
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
            ext: Vec::new(),
            adapter_id: String::new(),
        }
    }

    /// The GPU kinds carry their extension; shm and tcp never do (their encoding is unchanged).
    #[test]
    fn gpu_hellos_carry_their_extension() {
        let ipc = Hello {
            transport: TransportKind::CudaIpc,
            segment_path: String::new(),
            ext: vec![9; 64],
            ..hello()
        };
        assert_eq!(Hello::decode(&ipc.encode()).unwrap(), ipc);
        let nccl_ext = NcclHello { comm_key: 0x1234, unique_id: Some([3; 128]) };
        let nccl = Hello { transport: TransportKind::Nccl, ext: nccl_ext.encode(), ..hello() };
        let back = Hello::decode(&nccl.encode()).unwrap();
        assert_eq!(NcclHello::decode(&back.ext).unwrap(), nccl_ext);
        let reuse = NcclHello { comm_key: 7, unique_id: None };
        assert_eq!(NcclHello::decode(&reuse.encode()).unwrap(), reuse);
        assert!(!format!("{nccl_ext:?}").contains("3, 3"), "the unique id is not printed");
        assert!(NcclHello::decode(&[0; 8]).unwrap_err().contains("truncated"));
        assert!(NcclHello::decode(&[[0; 8].as_slice(), &[2]].concat()).unwrap_err().contains("flag 2"));
        // An ext on a tcp HELLO is not sent: the encoding is the plain one.
        let tcp = Hello { transport: TransportKind::Tcp, ext: vec![1; 10], ..hello() };
        assert_eq!(Hello::decode(&tcp.encode()).unwrap().ext, Vec::<u8>::new());
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

    /// The adapter id is a trailing field: absent, the encoding is the one before adapters; present,
    /// it round-trips on every kind, and an empty, overlong or non-UTF-8 one is refused.
    #[test]
    fn the_adapter_id_is_an_optional_trailing_field() {
        let base = hello().encode();
        let id = "0123456789abcdef0123456789abcdef";
        let with = Hello { adapter_id: id.into(), ..hello() };
        let b = with.encode();
        assert_eq!(&b[..base.len()], &base[..], "the fields before it are unchanged");
        assert_eq!(&b[base.len()..base.len() + 2], &32u16.to_le_bytes());
        assert_eq!(&b[base.len() + 2..], id.as_bytes());
        assert_eq!(Hello::decode(&b).unwrap(), with);
        assert_eq!(Hello::decode(&base).unwrap().adapter_id, "");
        let ipc = Hello { transport: TransportKind::CudaIpc, ext: vec![5; 64], ..with.clone() };
        assert_eq!(Hello::decode(&ipc.encode()).unwrap(), ipc);
        let mut empty = base.clone();
        empty.extend_from_slice(&0u16.to_le_bytes());
        assert!(Hello::decode(&empty).unwrap_err().contains("empty adapter id"));
        let mut long = base.clone();
        long.extend_from_slice(&200u16.to_le_bytes());
        long.extend_from_slice(&[b'a'; 200]);
        assert!(Hello::decode(&long).unwrap_err().contains("200 bytes"));
        let mut bad = base.clone();
        bad.extend_from_slice(&2u16.to_le_bytes());
        bad.extend_from_slice(&[0xff, 0xfe]);
        assert!(Hello::decode(&bad).unwrap_err().contains("not UTF-8"));
        assert!(Hello::decode(&b[..b.len() - 1]).unwrap_err().contains("truncated"));
    }

    #[test]
    fn preamble_and_done() {
        assert!(check_preamble(&preamble(KV_WIRE_VERSION)).is_ok());
        let old = check_preamble(&preamble(2)).unwrap_err();
        assert!(old.contains("version 2") && old.contains("speaks 3"), "{old}");
        let mut p = preamble(KV_WIRE_VERSION);
        p[0] = b'X';
        assert!(check_preamble(&p).unwrap_err().contains("magic"));
        assert!(parse_done(&done_body(3), 3).is_ok());
        assert!(parse_done(&done_body(2), 3).unwrap_err().contains("announces 2 blocks"));
        assert!(parse_done(&[3, 0, 0, 0, 0], 3).unwrap_err().contains("5 bytes"));
        assert_eq!(tag_name(tag::BLOCK_V2), "BLOCK (KV protocol version 2)");
    }

    #[test]
    fn group_frames_have_the_documented_layout() {
        let (a, b) = (vec![1u8; 6], vec![2u8; 6]);
        let f = blocks_frame(4, &[&a, &b]);
        // Header, first, count, two checksums, two payloads.
        assert_eq!(f.len(), FRAME_HEADER_BYTES + 8 + 2 * 4 + 12);
        assert_eq!(f[0], tag::BLOCKS);
        assert_eq!(u32::from_le_bytes(f[1..5].try_into().unwrap()) as usize, f.len() - FRAME_HEADER_BYTES);
        assert_eq!(parse_u32s(&f[5..13]), vec![4, 2]);
        assert_eq!(parse_u32s(&f[13..21]), vec![checksum(&a), checksum(&b)]);
        assert_eq!(&f[21..27], a.as_slice());
        assert_eq!(&f[27..], b.as_slice());
        let s = sums_frame(7, &[9, 10, 11]);
        assert_eq!(s.len(), FRAME_HEADER_BYTES + 8 + 12);
        assert_eq!((s[0], parse_u32s(&s[5..])), (tag::SUMS, vec![7, 3, 9, 10, 11]));
    }

    #[test]
    fn group_heads_are_checked() {
        let head = |first: u32, count: u32| {
            let mut h = [0u8; GROUP_HEAD_BYTES];
            h[..4].copy_from_slice(&first.to_le_bytes());
            h[4..].copy_from_slice(&count.to_le_bytes());
            h
        };
        assert_eq!(parse_group_head(&head(3, 2), 3, 10, 4), Ok((3, 2)));
        assert_eq!(parse_group_head(&head(8, 2), 8, 10, 4), Ok((8, 2)));
        assert!(parse_group_head(&head(3, 0), 3, 10, 4).unwrap_err().contains("empty group"));
        assert!(parse_group_head(&head(9, 2), 9, 10, 4).unwrap_err().contains("outside the reservation"));
        assert!(parse_group_head(&head(u32::MAX, u32::MAX), 0, 10, 4).unwrap_err().contains("outside"));
        assert!(parse_group_head(&head(4, 1), 3, 10, 4).unwrap_err().contains("out of order (expected 3)"));
        assert!(parse_group_head(&head(3, 5), 3, 10, 4).unwrap_err().contains("limit of 4"));
        assert_eq!(max_group_blocks(MAX_GROUP_BYTES + 1), 1);
        assert_eq!(max_group_blocks(1024), MAX_GROUP_BYTES / 1024);
    }
}

/// What an nccl HELLO adds: which communicator between the two workers the transfer uses, and,
/// when the sender is setting a new one up, the NCCL unique id both ranks join with.
#[derive(Clone, PartialEq, Eq)]
pub struct NcclHello {
    /// The sender's name for its communicator with this receiver (random, fresh per
    /// communicator).
    pub comm_key: u64,
    /// Present when the communicator is new: the receiver joins it as rank 1.
    pub unique_id: Option<[u8; 128]>,
}

impl std::fmt::Debug for NcclHello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclHello")
            .field("comm_key", &format_args!("{:#018x}", self.comm_key))
            .field("new", &self.unique_id.is_some())
            .finish()
    }
}

impl NcclHello {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = self.comm_key.to_le_bytes().to_vec();
        match &self.unique_id {
            Some(id) => {
                b.push(1);
                b.extend_from_slice(id);
            }
            None => b.push(0),
        }
        b
    }

    pub fn decode(b: &[u8]) -> Result<NcclHello, String> {
        let mut r = Reader { b, at: 0 };
        let comm_key = r.u64()?;
        let unique_id = match r.u8()? {
            0 => None,
            1 => Some(r.take(128)?.try_into().map_err(|_| "short NCCL unique id".to_string())?),
            other => return Err(format!("NCCL HELLO: bad unique-id flag {other}")),
        };
        if r.at != b.len() {
            return Err(format!("NCCL HELLO has {} trailing bytes", b.len() - r.at));
        }
        Ok(NcclHello { comm_key, unique_id })
    }
}

/// Body of an NCCL_GO frame: the sender's source block ids, in the order of the destination's.
pub fn nccl_go_body(src_blocks: &[u32]) -> Vec<u8> {
    src_blocks.iter().flat_map(|b| b.to_le_bytes()).collect()
}
