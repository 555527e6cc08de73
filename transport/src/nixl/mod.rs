//! nixl: host pools on any two hosts, through NVIDIA's NIXL (its UCX backend picks RDMA over
//! InfiniBand, RoCE or EFA, shared memory or cross-memory attach on one host, or TCP).
//!
//! # Registration
//! D registers its whole pool with its NIXL agent once, when its receiver binds, and offers the
//! result as [`TransportOffer::nixl_metadata`](crate::TransportOffer): an envelope ([`Envelope`])
//! holding the pool's address, length and shape, the agent's name and the agent's metadata
//! (the backend's connection information and the registration's keys). The offer travels with
//! the worker's registration to the router, which hands it to P in every destination. P loads
//! a peer agent's metadata the first time a destination names it, and again after any failure
//! with it (a failure forgets the peer). A restarted D has a new agent name, so P never writes
//! with stale keys: D also refuses a HELLO naming another agent than its own.
//!
//! # Direction: P writes
//! A source pool in host memory (a CPU worker's) is registered with P's agent the first time a
//! stage reads it, and each group of blocks is written from it straight into D's reserved blocks
//! (one descriptor per run of blocks consecutive on both sides, per layer's K or V), after P
//! read the group's checksums from it. A source that lends no memory, or whose registration
//! fails, is copied group by group into one half of a staging region registered once
//! (checksummed while copied, as tcp does) and written from there, the next group going into
//! the other half while the write runs. When a group's write completes (NIXL's UCX backend
//! flushes the endpoint first, so the bytes are in D's memory), P sends the group's checksums in
//! a SUMS frame on the session's connection, and D checks that group in its pool on a thread
//! while P writes the next one, as for shm. P pushing fits the session, in which P learns when
//! a group is ready; a pull by D would cost a round trip per transfer to say where it lies.
//!
//! # Completion and deadlines
//! Completion is judged on P's own request status, not on NIXL notifications: D learns that a
//! group is in from the SUMS frame, which the session's connection delivers in order, so no
//! notification can be lost or judged late. Every wait has the sender's I/O timeout as its
//! deadline, and ends early when D gives up; the status is read once more after the deadline
//! before the transfer is failed. A request that fails or is abandoned is settled before the
//! stage returns: released (the backend aborts it), or polled to a final status for another
//! deadline. A write that can be neither finished nor aborted would land in blocks D reuses once
//! the session closes, so the process stops instead (its writes die with it). After a failure,
//! with no write in flight, P drops the peer's metadata and loads it afresh next time; a peer
//! found unreachable, or refused as a restarted one, is dropped by the next stage.
//!
//! # Safety of writes into D's memory
//! As for shm: P writes only while its session is open and D has not told it to stop (checked
//! before every group it posts), and D reuses the blocks only once P closed or the close grace
//! passed. Stages of one sender run one at a time (the engine thread's; a lock makes it so), so
//! the staging halves and the source's registration are never reused under a running write.
//!
//! # What the registration exposes
//! D's offer holds the keys of its whole registered pool, and it travels to every prefill worker
//! through the router. Whoever holds it and reaches D's fabric can write any of D's blocks
//! without a HELLO: the cluster secret guards the session (the token in the HELLO, TLS on the
//! control connection and the router's channels), not the fabric. Keep the fabric to the
//! cluster's hosts.

mod library;

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::kind::{
    bad_destination, check_block_range, copy_group_checksummed, BoxFuture, Inbound, Link, Outbound, Outgoing,
    ReceiveKind, ReceiverEnv, Registration, SendKind, SenderEnv, SumsIn, Transfer,
};
use crate::options::NixlConfig;
use crate::types::{KvDestination, TransportOffer};
use crate::wire::{self, Hello};
use crate::{KvBlockSource, TransportError};
use tandem_engine::kv::{checksum, BlockId, KvDtype, KvLayout};

pub use library::{
    library_path, Agent, NixlLib, Registered, Request, CAPI, LIBRARY_ENV, PINNED_VERSION, VERSION_FILE,
};

pub(crate) const KIND: Registration = Registration {
    name: "nixl",
    wire_code: 5,
    needs_gpu: false,
    writes_directly: true,
    hello_ext: true,
    sender,
    receiver,
};

/// NIXL failures. Messages say what was being done and, where there is one, what to do.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NixlError {
    /// The library could not be loaded.
    #[error("NIXL is not available: cannot load {path}: {msg}; {hint}")]
    Missing { path: String, msg: String, hint: String },
    /// A library loaded but lacks an entry point of NIXL's C API.
    #[error("{path} is not NIXL's C API: symbol {name} is missing ({msg}); point --nixl-lib at the directory of libnixl_capi.so")]
    Symbol { path: String, name: String, msg: String },
    /// The library is another release than the pinned one.
    #[error("{path} is NIXL {found}, this build is tested with {pinned}; run scripts/fetch-nixl.sh")]
    Version { path: String, found: String, pinned: String },
    /// A call returned an error status.
    #[error("{what} failed (nixl_capi_status_t {code})")]
    Call { what: String, code: i32 },
    /// A request did not complete in time.
    #[error("{what}: not done after {after:?}")]
    Timeout { what: String, after: Duration },
    /// Something this side asked for cannot work.
    #[error("{0}")]
    Invalid(String),
}

/// Loads NIXL's C API from `dir` (else `TANDEM_NIXL_LIB`, else the loader's path), once.
pub fn load(dir: Option<&Path>) -> Result<Arc<NixlLib>, NixlError> {
    library::load(dir)
}

/// A name for this process's agent: unique per process instance, so a restarted worker is a
/// new peer.
fn agent_name(role: &str) -> String {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("tandem-{role}-{}-{nanos:x}", std::process::id())
}

/// How D's refusal of a HELLO naming another agent begins (P then drops that agent's metadata).
const STALE_AGENT: &str = "the sender loaded the metadata of nixl agent";

/// The first bytes of an [`Envelope`].
const MAGIC: &[u8] = b"tandem-nixl-v1\0";

/// What D's offer carries: where its pool is in D's memory, its shape, and the agent that
/// registered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The pool's layout (its block count is D's).
    pub layout: KvLayout,
    /// Address of layer 0's K tensor in D's memory, and the pool's length in bytes.
    pub base: u64,
    pub len: u64,
    /// D's agent.
    pub agent: String,
    /// D's agent metadata, for [`Agent::load_remote`].
    pub metadata: Vec<u8>,
}

impl Envelope {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        let l = &self.layout;
        let name = l.name().as_bytes();
        b.extend_from_slice(&(name.len() as u32).to_le_bytes());
        b.extend_from_slice(name);
        for v in [l.num_layers, l.num_blocks, l.block_size, l.num_kv_heads, l.head_dim] {
            b.extend_from_slice(&(v as u64).to_le_bytes());
        }
        b.extend_from_slice(&self.base.to_le_bytes());
        b.extend_from_slice(&self.len.to_le_bytes());
        for s in [self.agent.as_bytes(), &self.metadata] {
            b.extend_from_slice(&(s.len() as u32).to_le_bytes());
            b.extend_from_slice(s);
        }
        b
    }

    /// Parses an envelope; the error names what is wrong with it.
    pub fn decode(b: &[u8]) -> Result<Envelope, String> {
        if b.is_empty() {
            return Err("no nixl metadata (the decode worker did not register its pool with NIXL)".into());
        }
        let rest = b.strip_prefix(MAGIC).ok_or("not Tandem's nixl metadata (unknown header)")?;
        let mut r = Cursor { b: rest, at: 0 };
        let name =
            String::from_utf8(r.bytes("layout name")?.to_vec()).map_err(|_| "layout name is not UTF-8")?;
        let dtype = KvDtype::ALL
            .into_iter()
            .find(|d| d.layout_name() == name)
            .ok_or_else(|| format!("unknown KV layout `{name}`"))?;
        let mut dims = [0usize; 5];
        for (d, what) in
            dims.iter_mut().zip(["num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"])
        {
            *d = usize::try_from(r.u64(what)?).map_err(|_| format!("{what} too large"))?;
        }
        let [num_layers, num_blocks, block_size, num_kv_heads, head_dim] = dims;
        let layout = KvLayout { num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype };
        layout.validate().map_err(|e| format!("invalid layout: {e}"))?;
        let base = r.u64("pool address")?;
        let len = r.u64("pool length")?;
        let agent =
            String::from_utf8(r.bytes("agent name")?.to_vec()).map_err(|_| "agent name is not UTF-8")?;
        let metadata = r.bytes("agent metadata")?.to_vec();
        if r.at != rest.len() {
            return Err(format!("{} trailing bytes", rest.len() - r.at));
        }
        if agent.is_empty() || metadata.is_empty() {
            return Err("empty agent name or metadata".into());
        }
        let need = [layout.num_layers, layout.num_blocks, layout.block_bytes()]
            .into_iter()
            .try_fold(2u64, |a, d| a.checked_mul(d as u64))
            .ok_or("the layout's size overflows")?;
        if base.checked_add(len).is_none() {
            return Err("the pool's address range overflows".into());
        }
        if len < need {
            return Err(format!("a pool of {len} bytes cannot hold its layout's {need}"));
        }
        Ok(Envelope { layout, base, len, agent, metadata })
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| format!("truncated in {what}"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }

    fn bytes(&mut self, what: &str) -> Result<&[u8], String> {
        let n = u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")) as usize;
        self.take(n, what)
    }
}

// ---------------------------------------------------------------------------------------------
// P's half.

fn sender(env: &SenderEnv<'_>) -> Box<dyn SendKind> {
    let Some(cfg) = env.opts.nixl.clone() else {
        return Box::new(NixlSend {
            state: Err("nixl is not enabled on this worker (--transport nixl)".into()),
        });
    };
    let state = load(cfg.lib_dir.as_deref())
        .and_then(|lib| Agent::new(lib, &agent_name("prefill"), &cfg.backend))
        .map(|agent| {
            Arc::new(SendState {
                agent,
                layout: env.layout,
                io: env.opts.io_timeout,
                peers: Mutex::default(),
                gone: Mutex::default(),
                stage: Mutex::default(),
            })
        })
        .map_err(|e| e.to_string());
    if let Err(e) = &state {
        tracing::warn!(error = %e, "nixl transport unavailable");
    }
    Box::new(NixlSend { state })
}

/// P's half: its agent, the peers whose metadata it loaded, and what its stages reuse.
struct NixlSend {
    state: Result<Arc<SendState>, String>,
}

struct SendState {
    agent: Arc<Agent>,
    layout: KvLayout,
    io: Duration,
    /// Peer agents whose metadata is loaded.
    peers: Mutex<HashSet<String>>,
    /// Peers found gone (unreachable, or restarted under a new agent) outside a stage: their
    /// metadata is dropped by the next stage, when no write is in flight (dropping it under a
    /// running write would pull the keys from under it).
    gone: Mutex<HashSet<String>>,
    /// Held for a whole stage: one stage at a time per sender (the engine thread's), so a
    /// stage's writes never overlap another's reuse of the staging region or the source's
    /// registration.
    stage: Mutex<StageState>,
}

#[derive(Default)]
struct StageState {
    /// The registered staging region (two halves), grown when a larger group comes.
    staging: Option<Staging>,
    /// The source pool, registered the first time a stage could read it in place.
    source: Option<Registered>,
    /// A source region whose registration failed (say, past the memory-lock limit): staged
    /// through the buffer instead of retried every transfer.
    unregistrable: Option<(usize, usize)>,
}

impl SendState {
    /// Drops `peer`'s metadata now: the next destination naming it loads it again. Only with
    /// the stage lock held and no write in flight.
    fn forget_now(&self, peer: &str) {
        if self.peers.lock().unwrap_or_else(|p| p.into_inner()).remove(peer) {
            self.agent.invalidate_remote(peer);
        }
    }

    /// Drops the metadata of the peers found gone since the last stage (stage lock held),
    /// except `current`, which a destination just named: if it is gone, its write fails and
    /// the failure drops it.
    fn forget_gone(&self, current: &str) {
        let gone = std::mem::take(&mut *self.gone.lock().unwrap_or_else(|p| p.into_inner()));
        for peer in gone.iter().filter(|p| *p != current) {
            self.forget_now(peer);
        }
    }

    /// Ends a request that failed, timed out or was abandoned, so that nothing more of it can
    /// land in D's memory: released (the backend aborts it), or else polled to a final status
    /// for another I/O deadline and released then. A write that can be neither finished nor
    /// aborted could land in blocks D has reused once this session closes; the process stops
    /// instead (its writes die with it).
    fn settle(&self, mut req: Request) {
        let deadline = Instant::now() + self.io;
        loop {
            match req.release() {
                Ok(()) => return,
                Err((r, e)) => {
                    req = r;
                    if Instant::now() >= deadline {
                        tracing::error!(error = %e, "nixl: a write can be neither aborted nor finished; stopping");
                        std::process::abort();
                    }
                }
            }
            let _ = req.poll();
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Staging memory registered with the agent. The buffer outlives the registration (fields drop
/// in order).
struct Staging {
    reg: Registered,
    buf: Vec<u8>,
}

impl Staging {
    fn new(agent: &Arc<Agent>, len: usize) -> Result<Staging, NixlError> {
        let buf = vec![0u8; len];
        // SAFETY: `buf` is owned by the returned value and outlives `reg` (declared first, so
        // dropped first); only this process writes it, NIXL only reads it for our writes.
        let reg = unsafe { agent.register(buf.as_ptr() as usize, len) }?;
        Ok(Staging { reg, buf })
    }
}

impl SendKind for NixlSend {
    fn unavailable(&self) -> Option<String> {
        self.state.as_ref().err().cloned()
    }

    fn prepare(&self, dest: &KvDestination) -> Result<Box<dyn Outbound>, TransportError> {
        let st = self.state.as_ref().map_err(|e| bad_destination(dest, e))?;
        let env = Envelope::decode(&dest.nixl_metadata)
            .map_err(|e| bad_destination(dest, format!("nixl metadata: {e}")))?;
        let diffs = env.layout.differences(&st.layout, false);
        if !diffs.is_empty() {
            return Err(bad_destination(
                dest,
                format!(
                    "its KV layout does not match this worker's (destination vs this worker): {}",
                    diffs.join(", ")
                ),
            ));
        }
        check_block_range(dest, env.layout.num_blocks)?;
        // Held across the load, so concurrent first transfers to one peer load it once.
        let mut peers = st.peers.lock().unwrap_or_else(|p| p.into_inner());
        if !peers.contains(&env.agent) {
            let name = st
                .agent
                .load_remote(&env.metadata)
                .map_err(|e| bad_destination(dest, format!("nixl metadata: {e}")))?;
            if name != env.agent {
                // Undo the load, unless it named a peer loaded before (still in use).
                if !peers.contains(&name) {
                    st.agent.invalidate_remote(&name);
                }
                return Err(bad_destination(
                    dest,
                    format!("nixl metadata names agent {name}, its envelope {}", env.agent),
                ));
            }
            peers.insert(name);
        }
        drop(peers);
        Ok(Box::new(NixlOut { st: st.clone(), env }))
    }
}

struct NixlOut {
    st: Arc<SendState>,
    env: Envelope,
}

/// A posted group: its request, its first index and its checksums.
type InFlight = (Request, usize, Vec<u32>);

impl NixlOut {
    fn error(&self, link: &Link, what: &str, e: NixlError) -> TransportError {
        TransportError::Nixl { peer: link.peer.clone(), msg: format!("{what}: {e}") }
    }

    /// Waits for `req` until the deadline (or until D gives up), then reads its status once
    /// more before failing it. On `Err` the caller settles the request.
    fn wait(&self, link: &Link, req: &mut Request, what: &str) -> Result<(), TransportError> {
        let deadline = Instant::now() + self.st.io;
        let mut spins = 0u32;
        loop {
            match req.poll() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.error(link, what, e)),
            }
            if Instant::now() >= deadline {
                return match req.poll() {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(self.error(
                        link,
                        what,
                        NixlError::Timeout { what: "the write".into(), after: self.st.io },
                    )),
                    Err(e) => Err(self.error(link, what, e)),
                };
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // D gave up or the connection broke: stop waiting (the request is aborted).
                link.check_stopped()?;
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Waits for a posted group and sends its checksums; a request that fails is settled
    /// before this returns.
    fn finish(&self, link: &Link, (mut req, first, crcs): InFlight) -> Result<(), TransportError> {
        if let Err(e) = self.wait(link, &mut req, &format!("writing the group at block {first}")) {
            self.st.settle(req);
            return Err(e);
        }
        if let Err((req, e)) = req.release() {
            self.st.settle(req);
            return Err(self.error(link, "releasing a finished write", e));
        }
        link.send(Outgoing::Frame(wire::sums_frame(first as u32, &crcs)))
    }

    /// Posts groups one after another: `group(g)` prepares group `g`'s descriptors and
    /// checksums (while group `g - 1`'s write runs), then the previous group is finished and
    /// this one posted. Every request is finished or settled before this returns.
    fn pipeline(
        &self,
        link: &Link,
        groups: usize,
        mut group: impl FnMut(usize) -> Result<(Vec<(usize, usize, usize)>, Vec<u32>), TransportError>,
    ) -> Result<(), TransportError> {
        let size = link.group_blocks;
        let mut inflight: Option<InFlight> = None;
        let result = (|| {
            for g in 0..groups {
                let (descs, crcs) = group(g)?;
                if let Some(prev) = inflight.take() {
                    self.finish(link, prev)?;
                }
                // D may have given up: then not another byte goes into its memory.
                link.check_stopped()?;
                let req =
                    self.st.agent.write(&self.env.agent, &descs).map_err(|e| {
                        self.error(link, &format!("posting the group at block {}", g * size), e)
                    })?;
                inflight = Some((req, g * size, crcs));
            }
            match inflight.take() {
                Some(last) => self.finish(link, last),
                None => Ok(()),
            }
        })();
        if let Some((req, _, _)) = inflight.take() {
            self.st.settle(req);
        }
        if matches!(result, Err(TransportError::Nixl { .. })) {
            // No write is in flight any more: load the peer afresh next time.
            self.st.forget_now(&self.env.agent);
        }
        result
    }
}

/// One descriptor per run of blocks consecutive on both sides (`local` and `remote` give a run's
/// first block's addresses).
fn runs(
    src: Option<&[BlockId]>,
    dest: &[BlockId],
    bb: usize,
    mut at: impl FnMut(usize) -> Result<(usize, usize), TransportError>,
) -> Result<Vec<(usize, usize, usize)>, TransportError> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < dest.len() {
        let mut j = i + 1;
        while j < dest.len() && dest[j] == dest[j - 1] + 1 && src.is_none_or(|s| s[j] == s[j - 1] + 1) {
            j += 1;
        }
        let (local, remote) = at(i)?;
        out.push((local, remote, (j - i) * bb));
        i = j;
    }
    Ok(out)
}

impl Outbound for NixlOut {
    fn hello_ext(&self) -> Vec<u8> {
        self.env.agent.as_bytes().to_vec()
    }

    fn unreachable(&self) {
        // D is gone; its metadata is dropped by the next stage, when no write is in flight.
        self.st.gone.lock().unwrap_or_else(|p| p.into_inner()).insert(self.env.agent.clone());
    }

    fn refused(&self, msg: &str) {
        // D restarted under the same address with another agent: the one loaded is gone.
        if msg.contains(STALE_AGENT) {
            self.st.gone.lock().unwrap_or_else(|p| p.into_inner()).insert(self.env.agent.clone());
        }
    }

    fn stage(
        &mut self,
        src: &dyn KvBlockSource,
        src_blocks: &[BlockId],
        link: &Link,
    ) -> Result<(), TransportError> {
        let mut stage = self.st.stage.lock().unwrap_or_else(|p| p.into_inner());
        self.st.forget_gone(&self.env.agent);
        let slayout = src.source_layout();
        let region = src.host_region().filter(|&(_, len)| {
            len > 0 && len >= 2 * slayout.num_layers * slayout.num_blocks * slayout.block_bytes()
        });
        if let Some(region) = region.filter(|_| slayout.differences(&link.layout, false).is_empty()) {
            if stage.source.as_ref().is_none_or(|r| (r.addr, r.len) != region)
                && stage.unregistrable != Some(region)
            {
                stage.source = None;
                // SAFETY: a source lends its region for as long as senders use it (the engine's
                // pool lives as long as the worker), and the backend only reads it, during our
                // writes, which run while this stage holds the lock (and the engine thread
                // stages, so nothing writes the pool then).
                match unsafe { self.st.agent.register(region.0, region.1) } {
                    Ok(r) => stage.source = Some(r),
                    Err(e) => {
                        tracing::warn!(error = %e, bytes = region.1, "nixl: the KV pool cannot be registered; staging through a buffer");
                        stage.unregistrable = Some(region);
                    }
                }
            }
            if stage.source.is_some() {
                return self.stage_in_place(slayout, region.0, src_blocks, link);
            }
        }
        self.stage_through_buffer(&mut stage, src, src_blocks, link)
    }
}

impl NixlOut {
    /// The source pool is registered host memory: each group's checksums are read from it, and
    /// each group is written from it straight into D's blocks (one copy, by the backend).
    fn stage_in_place(
        &self,
        slayout: KvLayout,
        addr: usize,
        src_blocks: &[BlockId],
        link: &Link,
    ) -> Result<(), TransportError> {
        let (bb, layers, size) = (slayout.block_bytes(), slayout.num_layers, link.group_blocks);
        let dlayout = self.env.layout;
        let groups = src_blocks.len().div_ceil(size);
        self.pipeline(link, groups, |g| {
            let group = &src_blocks[g * size..((g + 1) * size).min(src_blocks.len())];
            let dest = &link.dest_blocks[g * size..g * size + group.len()];
            let mut crcs = vec![0u32; group.len()];
            for layer in 0..layers {
                for (&b, sum) in group.iter().zip(&mut crcs) {
                    let (k, v) = (slayout.block_offset(layer, 0, b)?, slayout.block_offset(layer, 1, b)?);
                    // SAFETY: both pieces lie in the pool's region (offsets from checked ids; the
                    // region's length was checked against the layout), which nothing writes
                    // while we stage.
                    let (k, v) = unsafe {
                        (
                            std::slice::from_raw_parts((addr + k) as *const u8, bb),
                            std::slice::from_raw_parts((addr + v) as *const u8, bb),
                        )
                    };
                    *sum = checksum::update_kv(*sum, k, v);
                }
            }
            let mut descs = Vec::new();
            for layer in 0..layers {
                for kv in 0..2 {
                    descs.extend(runs(Some(group), dest, bb, |i| {
                        let remote = dlayout.block_offset(layer, kv, dest[i])? as u64 + self.env.base;
                        Ok((addr + slayout.block_offset(layer, kv, group[i])?, remote as usize))
                    })?);
                }
            }
            Ok((descs, crcs))
        })
    }

    /// Any other source: each group is copied (and checksummed) into one half of the
    /// registered staging region, then written from there; the next group goes into the other
    /// half while that write runs (the half a group uses was last written from two groups
    /// before, which finished before the previous group was posted).
    fn stage_through_buffer(
        &self,
        stage: &mut StageState,
        src: &dyn KvBlockSource,
        src_blocks: &[BlockId],
        link: &Link,
    ) -> Result<(), TransportError> {
        let (bb, layers, size) = (link.layout.block_bytes(), link.layout.num_layers, link.group_blocks);
        let half = size * 2 * layers * bb;
        if stage.staging.as_ref().is_none_or(|s| s.buf.len() < 2 * half) {
            stage.staging = None;
            let s = Staging::new(&self.st.agent, 2 * half)
                .map_err(|e| self.error(link, "registering staging memory", e))?;
            stage.staging = Some(s);
        }
        let stg = stage.staging.as_mut().expect("staging set above");
        let base = stg.reg.addr;
        let buf = &mut stg.buf;
        let dlayout = self.env.layout;
        let groups = src_blocks.len().div_ceil(size);
        self.pipeline(link, groups, |g| {
            let group = &src_blocks[g * size..((g + 1) * size).min(src_blocks.len())];
            let dest = &link.dest_blocks[g * size..g * size + group.len()];
            let n = group.len();
            let off = (g % 2) * half;
            // Layer-major: each layer's K (and V) of the group lie together, so consecutive
            // destination blocks make one descriptor.
            let mut pieces: Vec<Option<(&mut [u8], &mut [u8])>> = Vec::with_capacity(layers * n);
            let mut rest = &mut buf[off..off + 2 * layers * n * bb];
            for _ in 0..layers {
                let (k, r) = rest.split_at_mut(n * bb);
                let (v, r) = r.split_at_mut(n * bb);
                rest = r;
                pieces.extend(k.chunks_exact_mut(bb).zip(v.chunks_exact_mut(bb)).map(Some));
            }
            let crcs = copy_group_checksummed(
                src,
                group,
                layers,
                |_| link.check_stopped(),
                |layer, i| {
                    pieces[layer * n + i]
                        .take()
                        .ok_or_else(|| TransportError::Invalid("block piece used twice".into()))
                },
            )?;
            let mut descs = Vec::new();
            for layer in 0..layers {
                for kv in 0..2 {
                    descs.extend(runs(None, dest, bb, |i| {
                        let remote = dlayout.block_offset(layer, kv, dest[i])? as u64 + self.env.base;
                        Ok((base + off + ((layer * 2 + kv) * n + i) * bb, remote as usize))
                    })?);
                }
            }
            Ok((descs, crcs))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// D's half.

fn receiver(env: &ReceiverEnv<'_>) -> Box<dyn ReceiveKind> {
    let state = match (&env.opts.nixl, env.sink.host_region()) {
        (None, _) => Err("nixl is not enabled on this worker (--transport nixl)".to_owned()),
        (Some(_), None) => {
            Err("this worker's KV pool is not in host memory (nixl registers host pools only)".into())
        }
        (Some(_), Some((_, 0))) => Err("this worker's KV pool is empty".into()),
        (Some(cfg), Some((addr, len))) => {
            register_pool(cfg, env.sink.layout(), addr, len).map_err(|e| e.to_string())
        }
    };
    if let (Some(_), Err(e)) = (&env.opts.nixl, &state) {
        tracing::warn!(error = %e, "nixl transport unavailable");
    }
    Box::new(NixlReceive { state: Mutex::new(state) })
}

fn register_pool(
    cfg: &NixlConfig,
    layout: KvLayout,
    addr: usize,
    len: usize,
) -> Result<RecvState, NixlError> {
    let agent = Agent::new(load(cfg.lib_dir.as_deref())?, &agent_name("decode"), &cfg.backend)?;
    // SAFETY: the pool outlives the receiver (the sink holds it), and the receiver deregisters
    // it when it closes; peers write only blocks of reservations this receiver pinned for them.
    let reg = unsafe { agent.register(addr, len) }?;
    let metadata = agent.local_metadata()?;
    let envelope =
        Envelope { layout, base: addr as u64, len: len as u64, agent: agent.name.clone(), metadata }.encode();
    tracing::info!(agent = %agent.name, bytes = len, "nixl: KV pool registered");
    Ok(RecvState { _reg: reg, name: agent.name.clone(), envelope })
}

/// D's half: the registration, while the receiver lives.
struct NixlReceive {
    state: Mutex<Result<RecvState, String>>,
}

struct RecvState {
    /// Keeps the pool registered (and the agent alive).
    _reg: Registered,
    name: String,
    envelope: Vec<u8>,
}

impl ReceiveKind for NixlReceive {
    fn unavailable(&self) -> Option<String> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).as_ref().err().cloned()
    }

    fn offer(&self, offer: &mut TransportOffer) {
        if let Ok(s) = self.state.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            offer.nixl_metadata = s.envelope.clone();
        }
    }

    fn check_hello(&self, h: &Hello) -> Result<(), String> {
        match self.state.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Err(e) => Err(format!("{e}; use tcp")),
            Ok(s) if h.ext != s.name.as_bytes() => Err(format!(
                "{STALE_AGENT} {}, this worker's agent is {} (restarted?)",
                String::from_utf8_lossy(&h.ext),
                s.name
            )),
            Ok(_) => Ok(()),
        }
    }

    fn close(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.is_ok() {
            *s = Err("the receiver closed".into());
        }
    }

    fn start<'a>(
        &'a self,
        _hello: &'a Hello,
        t: Transfer,
    ) -> BoxFuture<'a, Result<Box<dyn Inbound>, TransportError>> {
        Box::pin(async move { Ok(SumsIn::start(t)) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_blocks: 8,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
            dtype: KvDtype::F16,
        }
    }

    fn envelope() -> Envelope {
        let l = layout();
        let len = 2 * l.num_layers * l.num_blocks * l.block_bytes();
        Envelope {
            layout: l,
            base: 0x1000,
            len: len as u64,
            agent: "tandem-decode-1-2".into(),
            metadata: vec![7; 40],
        }
    }

    #[test]
    fn descriptors_merge_runs_consecutive_on_both_sides() {
        let at = |i: usize| Ok((1000 + i * 10, 5000 + i * 10));
        let dest: Vec<BlockId> = vec![4, 5, 6, 9, 10, 2];
        // Staged: the local side is contiguous, so runs follow the destination alone.
        let staged = runs(None, &dest, 10, at).unwrap();
        assert_eq!(staged, [(1000, 5000, 30), (1030, 5030, 20), (1050, 5050, 10)]);
        // In place: a run also needs consecutive source blocks.
        let src: Vec<BlockId> = vec![7, 8, 20, 21, 22, 23];
        let placed = runs(Some(&src), &dest, 10, at).unwrap();
        assert_eq!(placed, [(1000, 5000, 20), (1020, 5020, 10), (1030, 5030, 20), (1050, 5050, 10)]);
        assert!(runs(None, &[], 10, at).unwrap().is_empty());
    }

    #[test]
    fn envelopes_round_trip() {
        let e = envelope();
        assert_eq!(Envelope::decode(&e.encode()).unwrap(), e);
    }

    #[test]
    fn truncated_foreign_or_inconsistent_envelopes_are_refused_by_name() {
        let b = envelope().encode();
        for cut in [MAGIC.len() + 2, MAGIC.len() + 30, b.len() - 1] {
            let err = Envelope::decode(&b[..cut]).unwrap_err();
            assert!(err.contains("truncated in"), "{cut}: {err}");
        }
        assert!(Envelope::decode(b"{\"agent\":\"x\"}").unwrap_err().contains("not Tandem's nixl metadata"));
        assert!(Envelope::decode(&[]).unwrap_err().contains("no nixl metadata"));
        let mut long = b.clone();
        long.push(0);
        assert!(Envelope::decode(&long).unwrap_err().contains("1 trailing bytes"));
        let mut small = envelope();
        small.len -= 1;
        assert!(Envelope::decode(&small.encode()).unwrap_err().contains("cannot hold"));
        let mut foreign = b.clone();
        let at = MAGIC.len() + 4;
        foreign[at..at + 6].copy_from_slice(b"xandem");
        assert!(Envelope::decode(&foreign).unwrap_err().contains("unknown KV layout"));
    }
}
