//! tcp: the blocks travel in the connection itself, so it works between any two hosts.
//!
//! P copies each group of blocks (a few MiB) into a staging buffer that is a ready-made BLOCKS
//! frame (head, one checksum per block, payloads), checksumming each piece right after copying
//! it, and hands the frame to the session's writer task at once, so sending one group overlaps
//! copying the next. Staging buffers go back to a pool once written.
//!
//! D reads each BLOCKS frame straight into the reserved blocks (vectored reads into the pool's
//! memory where the sink lends it, else through a buffer) and checks every block against its
//! checksum as soon as it is in, while it is still in the cache. Groups must come in order and
//! cover the transfer exactly once; a block that does not match is refused by its index in the
//! transfer and its destination block.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::BufReader;

use crate::conn::KvRead;
use crate::kind::{
    copy_group_checksummed, mismatch, read_group_sums, BoxFuture, BufferPool, Inbound, Link, Outbound,
    ReceiveKind, ReceiverEnv, Registration, SendKind, SenderEnv, Transfer,
};
use crate::types::KvDestination;
use crate::wire::{self, tag, Hello};
use crate::{block_payload_bytes, KvBlockSink, KvBlockSource, TransportError};
use tandem_engine::kv::{checksum, BlockId};

pub(crate) const KIND: Registration = Registration {
    name: "tcp",
    wire_code: 1,
    needs_gpu: false,
    writes_directly: false,
    hello_ext: false,
    sender,
    receiver,
};

fn sender(env: &SenderEnv<'_>) -> Box<dyn SendKind> {
    Box::new(TcpSend { buffers: Arc::new(BufferPool::new(env.opts.staging_pool_bytes)) })
}

fn receiver(_: &ReceiverEnv<'_>) -> Box<dyn ReceiveKind> {
    Box::new(TcpReceive)
}

/// P's half: the staging buffers, shared by its transfers.
struct TcpSend {
    buffers: Arc<BufferPool>,
}

impl SendKind for TcpSend {
    fn unavailable(&self) -> Option<String> {
        None
    }

    fn prepare(&self, _dest: &KvDestination) -> Result<Box<dyn Outbound>, TransportError> {
        Ok(Box::new(TcpOut { buffers: self.buffers.clone() }))
    }
}

struct TcpOut {
    buffers: Arc<BufferPool>,
}

impl Outbound for TcpOut {
    /// Each group becomes one BLOCKS frame in a staging buffer (head, checksums, payloads),
    /// handed to the writer task as soon as it is complete.
    fn stage(
        &mut self,
        src: &dyn KvBlockSource,
        src_blocks: &[BlockId],
        link: &Link,
    ) -> Result<(), TransportError> {
        let (bb, layers, payload) = (link.layout.block_bytes(), link.layout.num_layers, link.payload);
        for (g, group) in src_blocks.chunks(link.group_blocks).enumerate() {
            link.check_stopped()?;
            let first = (g * link.group_blocks) as u32;
            let head = wire::group_head_len(group.len());
            let mut frame = self.buffers.take(head + group.len() * payload);
            wire::put_group_head(&mut frame, tag::BLOCKS, first, group.len() as u32, group.len() * payload);
            let (heads, body) = frame.split_at_mut(head);
            // Block i's payload is every layer's K then V: its pieces come in layer order.
            let mut pieces: Vec<_> =
                body.chunks_exact_mut(payload).map(|b| b.chunks_exact_mut(2 * bb)).collect();
            let crcs = copy_group_checksummed(
                src,
                group,
                layers,
                |_| Ok(()),
                |_, i| {
                    let kv = pieces[i]
                        .next()
                        .ok_or_else(|| TransportError::Invalid("short staging buffer".into()))?;
                    Ok(kv.split_at_mut(bb))
                },
            )?;
            for (i, crc) in crcs.into_iter().enumerate() {
                let at = wire::group_head_len(i);
                heads[at..at + 4].copy_from_slice(&crc.to_le_bytes());
            }
            link.send(crate::kind::Outgoing::Pooled(frame, self.buffers.clone()))?;
        }
        Ok(())
    }
}

/// D's half: every pool can take tcp.
struct TcpReceive;

impl ReceiveKind for TcpReceive {
    fn unavailable(&self) -> Option<String> {
        None
    }

    fn check_hello(&self, hello: &Hello) -> Result<(), String> {
        if hello.segment_path.is_empty() {
            Ok(())
        } else {
            Err("tcp HELLO carries a segment path".into())
        }
    }

    fn start<'a>(
        &'a self,
        _hello: &'a Hello,
        t: Transfer,
    ) -> BoxFuture<'a, Result<Box<dyn Inbound>, TransportError>> {
        let payload = block_payload_bytes(&t.sink.layout());
        let inbound = TcpIn { max_group: wire::max_group_blocks(payload), payload, t };
        Box::pin(async move { Ok(Box::new(inbound) as Box<dyn Inbound>) })
    }
}

struct TcpIn {
    t: Transfer,
    payload: usize,
    /// Most blocks in one BLOCKS frame.
    max_group: usize,
}

impl Inbound for TcpIn {
    fn frame_limit(&self, t: u8, _next: usize) -> Option<usize> {
        (t == tag::BLOCKS).then_some(wire::GROUP_HEAD_BYTES + self.max_group * (4 + self.payload))
    }

    fn on_frame<'a>(
        &'a mut self,
        t: u8,
        len: usize,
        next: usize,
        rd: &'a mut BufReader<KvRead>,
    ) -> BoxFuture<'a, Result<usize, TransportError>> {
        Box::pin(async move {
            let (io, peer, n) = (self.t.io, self.t.peer.as_str(), self.t.blocks.len());
            let (first, sums) =
                read_group_sums(rd, t, len, next, n, self.max_group, 4 + self.payload, io, peer).await?;
            let dest = &self.t.blocks[first..first + sums.len()];
            receive_group(&*self.t.sink, rd, dest, first, &sums, io, peer).await?;
            Ok(next + sums.len())
        })
    }
}

/// Reads the payloads of one BLOCKS group (blocks `first..` of the transfer, going into `dest`)
/// and checks each block against `sums` as soon as it is in. Where the sink lends its memory
/// the payload is read straight into the pool; otherwise through a buffer.
async fn receive_group(
    sink: &dyn KvBlockSink,
    rd: &mut BufReader<KvRead>,
    dest: &[BlockId],
    first: usize,
    sums: &[u32],
    io: Duration,
    peer: &str,
) -> Result<(), TransportError> {
    let layout = sink.layout();
    let bb = layout.block_bytes();
    let mut staging: Vec<u8> = Vec::new();
    for (k, (&dst, &want)) in dest.iter().zip(sums).enumerate() {
        let i = first + k;
        let what = format!("reading block {i}");
        // SAFETY: `dst` belongs to the reservation this connection pinned: no sequence holds it
        // and no other transfer writes it until this connection completes or aborts it; the
        // slices are dropped at the end of this iteration.
        let got = match unsafe { sink.block_slices_mut(dst) }? {
            Some(mut slices) => {
                wire::read_into_slices(rd, &mut slices, io, peer, &what).await?;
                slices.iter().fold(0, |sum, s| checksum::update(sum, s))
            }
            None => {
                staging.resize(block_payload_bytes(&layout), 0);
                wire::read_exact_idle(rd, &mut staging, io, peer, &what).await?;
                for (layer, kv) in staging.chunks_exact(2 * bb).enumerate() {
                    let (k, v) = kv.split_at(bb);
                    // SAFETY: as above.
                    unsafe { sink.write_block(layer, dst, k, v) }?;
                }
                wire::checksum(&staging)
            }
        };
        if got != want {
            return Err(TransportError::Checksum { peer: peer.into(), msg: mismatch(i, dst, got, want) });
        }
    }
    Ok(())
}
