//! The transport's own descriptions of a transfer's far end and of its results: where to send
//! ([`KvDestination`]), what a worker can send or receive with ([`TransportOffer`]), and what
//! moved so far ([`TransferCounters`]). Plain values: whoever speaks a wire format (the worker
//! services) converts them at its edge, so nothing here knows protobuf.
//!
//! Invariant of [`Counters`]: the total counts every transfer, and each transport's slot counts
//! the transfers that named that transport; a failure before a transport was named counts in the
//! total only.

use std::sync::Mutex;

use tandem_engine::kv::BlockId;

use crate::TransportKind;

/// Where a prefill worker sends a sequence's blocks: a decode worker's reservation, over one
/// transport that both workers offered (as the router chose it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvDestination {
    /// The decode worker (for messages and logs).
    pub worker_id: String,
    /// The transport to use.
    pub transport: TransportKind,
    /// `host:port` of the decode worker's KV listener (every kind's control connection).
    pub address: String,
    /// shm: the segment that holds the decode worker's pool.
    pub segment_path: String,
    /// The decode worker's reservation the blocks fill.
    pub reservation_id: u64,
    /// Destination blocks for the prompt's blocks `skip_blocks..`, in order.
    pub block_ids: Vec<BlockId>,
    /// Leading prompt blocks the destination already holds: they are not sent.
    pub skip_blocks: u32,
    /// cuda-ipc: the CUDA IPC handle of the decode worker's pool.
    pub ipc_handle: Vec<u8>,
    /// cuda-ipc: blocks in that pool (its plane stride).
    pub pool_blocks: u32,
    /// cuda-ipc and nccl: UUID of the decode worker's GPU.
    pub device_uuid: String,
    /// nixl: the decode worker's registration (its agent's metadata and its pool's place and
    /// shape, see [`crate::nixl`]).
    pub nixl_metadata: Vec<u8>,
}

impl KvDestination {
    /// A destination for `block_ids` of `reservation_id` over `offer` (a decode worker's),
    /// skipping no block.
    pub fn for_offer(offer: &TransportOffer, reservation_id: u64, block_ids: Vec<BlockId>) -> KvDestination {
        KvDestination {
            worker_id: String::new(),
            transport: offer.kind,
            address: offer.address.clone(),
            segment_path: offer.segment_path.clone(),
            reservation_id,
            block_ids,
            skip_blocks: 0,
            ipc_handle: offer.ipc_handle.clone(),
            pool_blocks: offer.pool_blocks,
            device_uuid: offer.device_uuid.clone(),
            nixl_metadata: offer.nixl_metadata.clone(),
        }
    }
}

/// One transport a worker can use, as it advertises it at registration. A decode worker's
/// offers carry where to reach it; a prefill worker's leave the address empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransportOffer {
    pub kind: TransportKind,
    /// `host:port` of the decode worker's KV listener.
    pub address: String,
    /// shm: path of the segment that holds the decode worker's pool.
    pub segment_path: String,
    /// Identity of the host ([`crate::host_id`]); shm and cuda-ipc pairs must share it.
    pub host_id: String,
    /// cuda-ipc (decode workers): the CUDA IPC handle of the pool.
    pub ipc_handle: Vec<u8>,
    /// cuda-ipc and nccl: UUID of the worker's GPU.
    pub device_uuid: String,
    /// cuda-ipc (decode workers): blocks in the exported pool.
    pub pool_blocks: u32,
    /// cuda-ipc (prefill workers): UUIDs of the GPUs this worker can write.
    pub writable_gpus: Vec<String>,
    /// nixl (decode workers): the registration of the pool, as [`KvDestination::nixl_metadata`].
    pub nixl_metadata: Vec<u8>,
}

/// Transfers so far, completed and failed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TransferCounters {
    /// Completed transfers.
    pub transfers: u64,
    /// Block payload bytes of completed transfers.
    pub bytes: u64,
    /// Seconds spent in completed transfers.
    pub seconds: f64,
    /// Failed transfers.
    pub failures: u64,
    /// Failed transfers whose bytes did not match the sender's checksums (destination side).
    pub checksum_failures: u64,
}

/// Adds up transfers for [`TransferCounters`]: in total, and per transport.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// The total, then one slot per kind in [`TransportKind::ALL`] order.
    inner: Mutex<[TransferCounters; TransportKind::ALL.len() + 1]>,
}

impl Counters {
    const TOTAL: usize = 0;

    fn slot(kind: TransportKind) -> usize {
        TransportKind::ALL.iter().position(|&k| k == kind).map_or(Self::TOTAL, |i| i + 1)
    }

    fn update(&self, kind: Option<TransportKind>, f: impl Fn(&mut TransferCounters)) {
        let mut c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut c[Self::TOTAL]);
        if let Some(k) = kind {
            f(&mut c[Self::slot(k)]);
        }
    }

    pub(crate) fn success(&self, kind: TransportKind, bytes: u64, seconds: f64) {
        self.update(Some(kind), |c| {
            c.transfers += 1;
            c.bytes += bytes;
            c.seconds += seconds;
        });
    }

    pub(crate) fn failure(&self, kind: Option<TransportKind>, checksum: bool) {
        self.update(kind, |c| {
            c.failures += 1;
            if checksum {
                c.checksum_failures += 1;
            }
        });
    }

    /// Totals (`None`) or one transport's counters.
    pub(crate) fn snapshot(&self, kind: Option<TransportKind>) -> TransferCounters {
        let c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        c[kind.map_or(Self::TOTAL, Self::slot)]
    }
}
