//! cuda-ipc's pools: D's export of its pool (and the process-wide table of exports), P's
//! mapping of a decode worker's pool ([`PeerPool`]) and the device-to-device copies into it,
//! P's copy stream and cache of mappings ([`IpcSender`]), and the GPUs P can write.
//!
//! Two nodes in one process (tests) cannot open their own export (the driver refuses to open a
//! handle in the process that made it), so exports are also remembered in a process-wide table
//! and a sender that finds the handle there uses the pool's own address.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;
use cudarc::driver::CudaStream;
use tandem_engine::cuda::{bind, DeviceKvPool, IPC_HANDLE_BYTES};
use tandem_engine::kv::{BlockId, KvLayout};

use crate::TransportError;

/// A 64-byte CUDA IPC memory handle.
pub type IpcHandle = [u8; IPC_HANDLE_BYTES];

/// Pools this process exported: handle → the pool (kept alive while exported here).
fn exports() -> &'static Mutex<HashMap<IpcHandle, DeviceKvPool>> {
    static EXPORTS: OnceLock<Mutex<HashMap<IpcHandle, DeviceKvPool>>> = OnceLock::new();
    EXPORTS.get_or_init(Default::default)
}

/// D: the IPC handle of `pool`, remembered for senders in this process.
pub fn export(pool: &DeviceKvPool) -> Result<IpcHandle, TransportError> {
    let h = pool.ipc_handle()?;
    exports().lock().unwrap_or_else(|p| p.into_inner()).insert(h, pool.clone());
    Ok(h)
}

/// D: forgets an export (the pool goes away).
pub fn unexport(handle: &IpcHandle) {
    exports().lock().unwrap_or_else(|p| p.into_inner()).remove(handle);
}

/// P: a decode worker's pool as mapped into this process (on the sender's own context).
pub struct PeerPool {
    own: DeviceKvPool,
    base: u64,
    /// D's layout, with D's block count (its plane stride).
    layout: KvLayout,
    /// Whether `base` came from `cuIpcOpenMemHandle` (and is closed on drop) or from this
    /// process's own export.
    opened: bool,
    /// Whether runs go as one 2D copy over every plane: set at open where both pools' plane
    /// strides fit the device's largest pitch, cleared (for this mapping's life) when the driver
    /// refuses one, after which each plane is copied on its own.
    two_d: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for PeerPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerPool").field("layout", &self.layout).field("opened", &self.opened).finish()
    }
}

fn device_error(own: &DeviceKvPool, what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Kv(tandem_engine::kv::KvError::Device {
        device: own.device().to_string(),
        msg: format!("{what}: {e}"),
    })
}

/// Whether 2D copies from `own` into a pool of `peer`'s layout fit the device's largest pitch
/// (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`): each pool's plane stride is a pitch.
fn pitches_fit(own: &DeviceKvPool, peer: &KvLayout) -> Result<bool, TransportError> {
    let bb = peer.block_bytes();
    let largest = own.layout().num_blocks.max(peer.num_blocks) * bb;
    Ok(largest <= max_pitch(own)?)
}

/// The largest pitch a 2D copy on `own`'s device takes (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`).
fn max_pitch(own: &DeviceKvPool) -> Result<usize, TransportError> {
    let mut dev: sys::CUdevice = 0;
    let mut pitch: std::ffi::c_int = 0;
    // SAFETY: valid out-parameters; the pool's context is bound on this thread.
    unsafe {
        sys::cuCtxGetDevice(&mut dev).result().map_err(|e| device_error(own, "reading the device", e))?;
        sys::cuDeviceGetAttribute(&mut pitch, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH, dev)
            .result()
            .map_err(|e| device_error(own, "reading the largest copy pitch", e))?;
    }
    Ok(pitch.max(0) as usize)
}

impl PeerPool {
    /// Opens D's exported pool (`handle`, `pool_blocks` blocks of this sender's layout) in the
    /// context of this sender's pool `own`.
    pub fn open(
        own: &DeviceKvPool,
        handle: &IpcHandle,
        pool_blocks: usize,
    ) -> Result<PeerPool, TransportError> {
        let layout = KvLayout { num_blocks: pool_blocks, ..own.layout() };
        layout.validate()?;
        let needed = 2 * layout.num_layers * layout.num_blocks * layout.block_bytes();
        bind(own.context()).map_err(|e| device_error(own, "binding the context", e))?;
        let two_d = pitches_fit(own, &layout)?.into();
        if let Some(local) = exports().lock().unwrap_or_else(|p| p.into_inner()).get(handle) {
            if local.bytes() < needed {
                return Err(TransportError::Invalid(format!(
                    "the exported pool has {} bytes, {pool_blocks} blocks need {needed}",
                    local.bytes()
                )));
            }
            return Ok(PeerPool { own: own.clone(), base: local.base(), layout, opened: false, two_d });
        }
        let h = sys::CUipcMemHandle { reserved: handle.map(|b| b as std::ffi::c_char) };
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is a valid out-parameter and the handle is passed by value; the mapping
        // is closed exactly once, in Drop.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
            .result()
        }
        .map_err(|e| {
            device_error(
                own,
                "opening the decode worker's KV pool (cuIpcOpenMemHandle; both workers must be on one \
                 host and share its IPC namespace)",
                e,
            )
        })?;
        let pool = PeerPool { own: own.clone(), base, layout, opened: true, two_d };
        // A wrong block count in the offer would make copies fault, and a fault ends this whole
        // context: check the mapping's real size first (dropping `pool` closes it on error).
        let (mut start, mut size) = (0 as sys::CUdeviceptr, 0usize);
        // SAFETY: valid out-parameters; `base` is a live mapping on the bound context.
        unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base).result() }
            .map_err(|e| device_error(own, "reading the size of the decode worker's KV pool", e))?;
        if start != base || size < needed {
            return Err(TransportError::Invalid(format!(
                "the decode worker's KV pool is {size} bytes, its offer of {pool_blocks} blocks needs {needed}"
            )));
        }
        Ok(pool)
    }

    /// D's pool layout as mapped here.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    fn address(&self, layer: usize, kv: usize, block: BlockId) -> Result<u64, TransportError> {
        Ok(self.base + self.layout.block_offset(layer, kv, block)? as u64)
    }

    /// Copies every layer's K and V of `src` (blocks of the sender's pool) into `dst` (blocks of
    /// this peer pool) on `stream`, and waits for the copies once. Each run of consecutive blocks
    /// is one 2D copy over all `2 × layers` planes (a plane is a row, each pool's plane stride its
    /// pitch), so a transfer queues one copy per run instead of one per run, layer and K/V, and
    /// waits once instead of once per layer. Where a pool's plane stride exceeds the device's
    /// largest pitch (decided at open), each plane is copied on its own. `before(i)` runs before run `i` is queued
    /// and may stop the copy (D gave up); what was queued is waited for in every case.
    pub fn copy_blocks(
        &self,
        stream: &CudaStream,
        src: &[BlockId],
        dst: &[BlockId],
        mut before: impl FnMut(usize) -> Result<(), TransportError>,
    ) -> Result<(), TransportError> {
        if src.len() != dst.len() {
            return Err(TransportError::Invalid(format!(
                "{} source blocks for {} destination blocks",
                src.len(),
                dst.len()
            )));
        }
        if let Some(b) = dst.iter().find(|&&b| b as usize >= self.layout.num_blocks) {
            return Err(TransportError::Invalid(format!(
                "destination block {b} outside the decode worker's pool of {} blocks",
                self.layout.num_blocks
            )));
        }
        let own = &self.own;
        bind(own.context()).map_err(|e| device_error(own, "binding the context", e))?;
        let bb = self.layout.block_bytes();
        let runs = crate::nccl::runs(src, dst);
        let planes = 2 * self.layout.num_layers;
        let (src_pitch, dst_pitch) = (own.layout().num_blocks * bb, self.layout.num_blocks * bb);
        let result = (|| {
            for (i, &(at, len)) in runs.iter().enumerate() {
                before(i)?;
                // The run's first and last blocks in every plane lie inside both pools: checked
                // in the first plane and the last.
                let from = own.block_address(0, 0, src[at])?;
                own.block_address(self.layout.num_layers - 1, 1, src[at + len - 1])?;
                let to = self.address(0, 0, dst[at])?;
                self.address(self.layout.num_layers - 1, 1, dst[at + len - 1])?;
                tracing::trace!(
                    src_block = src[at],
                    dst_block = dst[at],
                    blocks = len,
                    planes,
                    "cuda-ipc copy"
                );
                if self.two_d.load(std::sync::atomic::Ordering::Relaxed) {
                    let copy = sys::CUDA_MEMCPY2D {
                        srcXInBytes: 0,
                        srcY: 0,
                        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                        srcHost: std::ptr::null(),
                        srcDevice: from,
                        srcArray: std::ptr::null_mut(),
                        srcPitch: src_pitch,
                        dstXInBytes: 0,
                        dstY: 0,
                        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                        dstHost: std::ptr::null_mut(),
                        dstDevice: to,
                        dstArray: std::ptr::null_mut(),
                        dstPitch: dst_pitch,
                        WidthInBytes: len * bb,
                        Height: planes,
                    };
                    // SAFETY: row `p` of the copy is `len` consecutive blocks of plane `p` in the
                    // sender's pool and in D's mapped pool (the ends range-checked just above;
                    // planes are `pitch` apart in each). D's reservation keeps its engine off
                    // these blocks until this session ends; `copy` outlives the call.
                    match unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()).result() } {
                        Ok(()) => continue,
                        Err(e) => {
                            // Nothing of this copy was queued: copy the run plane by plane, now
                            // and for the rest of this mapping's life.
                            tracing::warn!(error = %e, "cuda-ipc: a 2D copy was refused; copying plane by plane");
                            self.two_d.store(false, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
                for p in 0..planes {
                    let (from, to) = (from + (p * src_pitch) as u64, to + (p * dst_pitch) as u64);
                    // SAFETY: `len` consecutive blocks of plane `p` in both pools, as above.
                    unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, len * bb, stream.cu_stream()).result() }
                        .map_err(|e| device_error(own, "copying KV blocks to the decode worker", e))?;
                }
            }
            Ok(())
        })();
        // Wait in every case: nothing queued may run after the session lets the reservation go.
        let synced = stream.synchronize().map_err(|e| device_error(own, "waiting for the KV copies", e));
        result.and(synced)
    }
}

impl Drop for PeerPool {
    fn drop(&mut self) {
        if !self.opened {
            return;
        }
        // Closed even when the bind fails: skipping the close would leak the mapping of D's pool
        // for the rest of this process, while a close that fails costs only a warning.
        if let Err(e) = bind(self.own.context()) {
            tracing::warn!(error = %e, "binding the context to close a decode worker's KV pool mapping failed");
        }
        // SAFETY: `base` came from cuIpcOpenMemHandle on this context and is closed only here.
        if let Err(e) = unsafe { sys::cuIpcCloseMemHandle(self.base).result() } {
            tracing::warn!(error = %e, "closing a decode worker's KV pool mapping failed");
        }
    }
}

/// The UUIDs of the GPUs a process on `pool`'s device can write with cuda-ipc: its own, and every
/// other visible GPU it has peer access to. Devices that cannot be queried are left out.
pub fn writable_gpus(pool: &DeviceKvPool) -> Vec<String> {
    let mut out: Vec<String> = pool.device_uuid().into_iter().collect();
    let own = pool.context().cu_device();
    let mut count = 0;
    // SAFETY: a valid out-parameter; the driver is initialised (the pool exists).
    if unsafe { sys::cuDeviceGetCount(&mut count).result() }.is_err() {
        return out;
    }
    for ordinal in 0..count {
        let mut dev = 0;
        // SAFETY: valid out-parameters; `ordinal` is below the device count.
        if unsafe { sys::cuDeviceGet(&mut dev, ordinal).result() }.is_err() || dev == own {
            continue;
        }
        let mut can = 0;
        // SAFETY: valid out-parameter and device handles.
        if unsafe { sys::cuDeviceCanAccessPeer(&mut can, own, dev).result() }.is_err() || can == 0 {
            continue;
        }
        let mut u = std::mem::MaybeUninit::<sys::CUuuid>::zeroed();
        // SAFETY: a valid out-parameter and device handle.
        if unsafe { sys::cuDeviceGetUuid_v2(u.as_mut_ptr(), dev).result() }.is_ok() {
            // SAFETY: initialised by the successful call.
            out.push(tandem_engine::cuda::format_uuid(&unsafe { u.assume_init() }.bytes.map(|c| c as u8)));
        }
    }
    out
}

/// P's side of cuda-ipc: its own pool, a copy stream, and the decode workers' pools it opened.
pub(crate) struct IpcSender {
    own: DeviceKvPool,
    stream: Arc<CudaStream>,
    peers: Mutex<HashMap<IpcHandle, Arc<PeerPool>>>,
}

/// Most decode workers' pools kept open at once; the oldest mapping is closed past it.
const MAX_PEERS: usize = 64;

impl IpcSender {
    pub fn new(own: DeviceKvPool) -> Result<IpcSender, TransportError> {
        bind(own.context()).map_err(|e| device_error(&own, "binding the context", e))?;
        let stream =
            own.context().new_stream().map_err(|e| device_error(&own, "creating a copy stream", e))?;
        Ok(IpcSender { own, stream, peers: Mutex::new(HashMap::new()) })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The mapping of D's pool for `handle`, opened on first use.
    pub fn peer(&self, handle: &[u8], pool_blocks: u32) -> Result<Arc<PeerPool>, TransportError> {
        let handle: IpcHandle = handle.try_into().map_err(|_| {
            TransportError::Invalid(format!(
                "cuda-ipc destination with an IPC handle of {} bytes ({IPC_HANDLE_BYTES} expected)",
                handle.len()
            ))
        })?;
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = peers.get(&handle) {
            if p.layout.num_blocks == pool_blocks as usize {
                return Ok(p.clone());
            }
        }
        let p = Arc::new(PeerPool::open(&self.own, &handle, pool_blocks as usize)?);
        if peers.len() >= MAX_PEERS {
            // Any one goes: a live peer's mapping is simply opened again on its next transfer.
            if let Some(k) = peers.keys().next().copied() {
                peers.remove(&k);
            }
        }
        peers.insert(handle, p.clone());
        Ok(p)
    }

    /// Closes the mapping of a peer found gone (its KV listener refuses connections).
    pub fn forget(&self, handle: &[u8]) {
        if let Ok(h) = IpcHandle::try_from(handle) {
            self.peers.lock().unwrap_or_else(|p| p.into_inner()).remove(&h);
        }
    }
}
