//! cuda-ipc: GPU to GPU on one host. D exports its KV pool once, as a CUDA IPC memory handle in
//! its registration offer; P opens each decode worker's handle once (cached per handle, closed
//! when the peer is found gone or P shuts down) and copies its blocks straight into the reserved
//! destination blocks with device-to-device copies on a stream of its own, then waits for them
//! and sends the session's DONE. The HELLO carries the handle P opened, so a restarted D refuses
//! a stale mapping by name. D checks no checksums: the bytes never leave GPU memory and the
//! interconnect. Like shm, P writes D's memory itself, so D reuses the blocks only after P
//! closed (the session layer's close grace).
//!
//! When the two devices differ the handle is opened with lazy peer access, so the driver enables
//! peer access between them on first use. A prefill worker offers cuda-ipc with the UUIDs of the
//! GPUs it can write (its own, and those it has peer access to, [`writable_gpus`]); the router
//! pairs it over cuda-ipc only with a decode worker on one of them, so GPUs without peer access,
//! or a GPU this process cannot see, fall back to another transport instead of failing.
//!
//! The pools, mappings and copies are in [`pool`]; this module holds the kind's two halves.

mod pool;

use std::sync::{Arc, OnceLock};

use tandem_engine::cuda::DeviceKvPool;
use tandem_engine::kv::BlockId;

use crate::kind::{
    bad_destination, check_block_range, host_pool, BoxFuture, Inbound, Link, Outbound, ReceiveKind,
    ReceiverEnv, Registration, SendKind, SenderEnv, Transfer,
};
use crate::types::{KvDestination, TransportOffer};
use crate::wire::Hello;
use crate::{KvBlockSource, TransportError, TransportKind};
use pool::IpcSender;
pub use pool::{export, unexport, writable_gpus, IpcHandle, PeerPool};

pub(crate) const KIND: Registration = Registration {
    name: "cuda-ipc",
    wire_code: 3,
    needs_gpu: true,
    writes_directly: true,
    hello_ext: true,
    sender,
    receiver,
};

fn sender(env: &SenderEnv<'_>) -> Box<dyn SendKind> {
    Box::new(IpcSend {
        device: env.opts.device.clone(),
        enabled: env.opts.enable_cuda_ipc,
        ipc: OnceLock::new(),
    })
}

fn receiver(env: &ReceiverEnv<'_>) -> Box<dyn ReceiveKind> {
    let pool = env.sink.device_pool();
    let export = match &pool {
        Some(pool) if env.opts.enable_cuda_ipc => Some(export(pool).map_err(|e| e.to_string())),
        _ => None,
    };
    if let Some(Err(e)) = &export {
        tracing::warn!(error = %e, "cannot export the KV pool for cuda-ipc; not offering it");
    }
    Box::new(IpcReceive {
        uuid: pool.as_ref().and_then(|p| p.device_uuid().ok()).unwrap_or_default(),
        export,
        pool_blocks: env.sink.layout().num_blocks,
    })
}

/// P's half: this worker's pool on its GPU, and the copy stream with the decode workers' pools
/// mapped so far (made on first use).
struct IpcSend {
    device: Option<DeviceKvPool>,
    enabled: bool,
    ipc: OnceLock<Result<Arc<IpcSender>, String>>,
}

impl IpcSend {
    fn ipc(&self) -> Result<Arc<IpcSender>, TransportError> {
        let Some(own) = &self.device else {
            return Err(TransportError::Invalid(
                "cuda-ipc needs this worker's KV pool on a GPU; this worker's is in host memory".into(),
            ));
        };
        self.ipc
            .get_or_init(|| IpcSender::new(own.clone()).map(Arc::new).map_err(|e| e.to_string()))
            .clone()
            .map_err(TransportError::Invalid)
    }
}

impl SendKind for IpcSend {
    fn unavailable(&self) -> Option<String> {
        if self.device.is_none() {
            Some(host_pool(TransportKind::CudaIpc))
        } else if !self.enabled {
            Some("cuda-ipc is turned off (--transport)".into())
        } else {
            None
        }
    }

    fn offer(&self, offer: &mut TransportOffer) {
        if let Some(d) = &self.device {
            offer.device_uuid = d.device_uuid().unwrap_or_default();
            offer.writable_gpus = writable_gpus(d);
        }
    }

    fn prepare(&self, dest: &KvDestination) -> Result<Box<dyn Outbound>, TransportError> {
        if let Some(why) = self.unavailable() {
            return Err(bad_destination(dest, format!("cuda-ipc is not available on this worker: {why}")));
        }
        let sender = self.ipc()?;
        let peer = sender.peer(&dest.ipc_handle, dest.pool_blocks)?;
        check_block_range(dest, peer.layout().num_blocks)?;
        Ok(Box::new(IpcOut { sender, peer, handle: dest.ipc_handle.clone() }))
    }
}

struct IpcOut {
    sender: Arc<IpcSender>,
    /// D's pool as mapped here.
    peer: Arc<PeerPool>,
    handle: Vec<u8>,
}

impl Outbound for IpcOut {
    fn hello_ext(&self) -> Vec<u8> {
        self.handle.clone()
    }

    fn unreachable(&self) {
        // The decode worker is gone (or restarted with a new pool): close its mapping.
        self.sender.forget(&self.handle);
    }

    fn refused(&self, _msg: &str) {
        // D restarted with another pool (or refuses it): do not keep the old mapping.
        self.sender.forget(&self.handle);
    }

    /// Device-to-device copies from this worker's pool (the engine's, which `src` reads) into
    /// D's mapped pool: one 2D copy over every layer's K and V per run of consecutive blocks,
    /// waited for once before returning.
    fn stage(
        &mut self,
        _src: &dyn KvBlockSource,
        src_blocks: &[BlockId],
        link: &Link,
    ) -> Result<(), TransportError> {
        // D may give up meanwhile: then it waits for us to close before it reuses the blocks,
        // and nothing more may be queued.
        self.peer.copy_blocks(self.sender.stream(), src_blocks, &link.dest_blocks, |_| link.check_stopped())
    }
}

/// D's half: the pool's export, if it is on a GPU and cuda-ipc is on.
struct IpcReceive {
    /// The UUID of the pool's GPU; empty for a host pool.
    uuid: String,
    /// The pool's export, or why there is none; `None` when not attempted.
    export: Option<Result<IpcHandle, String>>,
    /// Blocks in the pool.
    pool_blocks: usize,
}

impl ReceiveKind for IpcReceive {
    fn unavailable(&self) -> Option<String> {
        match &self.export {
            Some(Ok(_)) => None,
            Some(Err(e)) => Some(format!("the KV pool cannot be exported: {e}")),
            None if self.uuid.is_empty() => Some(host_pool(TransportKind::CudaIpc)),
            None => Some("cuda-ipc is turned off".into()),
        }
    }

    fn offer(&self, offer: &mut TransportOffer) {
        if let Some(Ok(h)) = &self.export {
            offer.ipc_handle = h.to_vec();
            offer.device_uuid = self.uuid.clone();
            offer.pool_blocks = self.pool_blocks as u32;
        }
    }

    fn check_hello(&self, h: &Hello) -> Result<(), String> {
        match &self.export {
            Some(Ok(ours)) if h.ext != ours[..] => Err(
                "the sender opened another KV pool than this worker's (the decode worker restarted since \
                 its registration?)"
                    .into(),
            ),
            Some(Ok(_)) => Ok(()),
            _ => Err("this worker offers no cuda-ipc (its KV pool is not an exported GPU pool)".into()),
        }
    }

    fn close(&self) {
        if let Some(Ok(h)) = &self.export {
            unexport(h);
        }
    }

    fn start<'a>(
        &'a self,
        _hello: &'a Hello,
        _t: Transfer,
    ) -> BoxFuture<'a, Result<Box<dyn Inbound>, TransportError>> {
        Box::pin(async { Ok(Box::new(IpcIn) as Box<dyn Inbound>) })
    }
}

/// D's side of a transfer: nothing to read, the sender copied every block and waited for the
/// copies before its DONE.
struct IpcIn;

impl Inbound for IpcIn {
    fn frame_limit(&self, _tag: u8, _next: usize) -> Option<usize> {
        None
    }

    fn on_frame<'a>(
        &'a mut self,
        _tag: u8,
        _len: usize,
        next: usize,
        _rd: &'a mut tokio::io::BufReader<crate::conn::KvRead>,
    ) -> BoxFuture<'a, Result<usize, TransportError>> {
        Box::pin(async move { Ok(next) })
    }

    fn arrived(&self, _next: usize, n: usize) -> usize {
        n
    }
}
