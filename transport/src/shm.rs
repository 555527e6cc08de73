//! shm: one host, D's pool in a shared-memory segment that P maps and writes itself.
//!
//! P maps D's segment once (cached per path, re-mapped when the file at that path is another
//! one because D restarted, checked against P's layout) and copies each group of blocks straight
//! into D's reserved blocks, checksumming each piece right after copying it; after each group it
//! sends the group's checksums in a SUMS frame. D hands each SUMS frame to a verifier thread that
//! checks that group in the pool while P writes the next one, and waits for it at DONE.
//!
//! Safety: P writes into D's memory without D's involvement, so P writes only while its session
//! is open and D has not told it to stop (checked before every layer of every group), and D
//! reuses the blocks only once P closed or the close grace passed (the session layer's error
//! path, since the kind [`writes directly`](crate::TransportKind::writes_directly)). The
//! verifier holds the reservation's pin while it reads, so the reservation is never aborted
//! while it still reads the blocks.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::kind::{
    bad_destination, check_block_range, copy_group_checksummed, BoxFuture, Inbound, Link, Outbound, Outgoing,
    ReceiveKind, ReceiverEnv, Registration, SendKind, SenderEnv, SumsIn, Transfer,
};
use crate::types::{KvDestination, TransportOffer};
use crate::wire::{self, Hello};
use crate::{KvBlockSource, TransportError};
use tandem_engine::kv::shm::KvMemory;
use tandem_engine::kv::{BlockId, KvLayout};

pub(crate) const KIND: Registration = Registration {
    name: "shm",
    wire_code: 2,
    needs_gpu: false,
    writes_directly: true,
    hello_ext: false,
    sender,
    receiver,
};

fn sender(env: &SenderEnv<'_>) -> Box<dyn SendKind> {
    Box::new(ShmSend { layout: env.layout, enabled: env.opts.enable_shm, segments: Mutex::default() })
}

fn receiver(env: &ReceiverEnv<'_>) -> Box<dyn ReceiveKind> {
    Box::new(ShmReceive { segment: env.sink.segment_path().map(|p| p.to_string_lossy().into_owned()) })
}

/// P's half: the decode workers' segments mapped so far.
struct ShmSend {
    layout: KvLayout,
    enabled: bool,
    segments: Mutex<HashMap<PathBuf, Arc<KvMemory>>>,
}

impl ShmSend {
    /// The mapping of D's segment at `path`: cached, re-mapped when the file at that path is a
    /// different one (D restarted), checked against this sender's layout.
    fn segment(&self, path: &Path) -> Result<Arc<KvMemory>, TransportError> {
        let mut cache = self.segments.lock().unwrap_or_else(|p| p.into_inner());
        // Forget mappings whose file is gone, so a dead D's memory is not kept alive here.
        cache.retain(|p, m| file_id(p).is_some_and(|id| Some(id) == m.segment_id()));
        if let Some(m) = cache.get(path) {
            return Ok(m.clone());
        }
        let seg = Arc::new(KvMemory::open_segment(path)?);
        let diffs = seg.layout().differences(&self.layout, false);
        if !diffs.is_empty() {
            let diffs = diffs.join(", ");
            tracing::debug!(path = %path.display(), differences = %diffs, "kv layout mismatch (segment vs sender)");
            return Err(TransportError::Invalid(format!(
                "segment {}: its KV layout does not match this worker's (segment vs this worker): {diffs}",
                path.display()
            )));
        }
        cache.insert(path.to_path_buf(), seg.clone());
        Ok(seg)
    }
}

fn file_id(p: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()))
}

/// Adds this process's PID namespace to an shm offer's host id: a peer opens a segment as
/// `/proc/<owner pid>/fd/<fd>`, which names the owner only inside its PID namespace, so shm pairs
/// only processes that share one (cuda-ipc, which does not need it, keeps the plain host id).
fn in_pid_namespace(offer: &mut TransportOffer) {
    if let Ok(ns) = std::fs::metadata("/proc/self/ns/pid") {
        offer.host_id.push_str(&format!("/pidns-{:x}", ns.ino()));
    }
}

impl SendKind for ShmSend {
    fn unavailable(&self) -> Option<String> {
        (!self.enabled).then(|| "shm is turned off (--transport)".into())
    }

    fn offer(&self, offer: &mut TransportOffer) {
        in_pid_namespace(offer);
    }

    fn prepare(&self, dest: &KvDestination) -> Result<Box<dyn Outbound>, TransportError> {
        if !self.enabled {
            return Err(bad_destination(dest, "shm transport is disabled on this worker"));
        }
        if dest.segment_path.is_empty() {
            return Err(bad_destination(dest, "shm destination without a segment path"));
        }
        let seg = self.segment(Path::new(&dest.segment_path))?;
        check_block_range(dest, seg.layout().num_blocks)?;
        Ok(Box::new(ShmOut { seg, path: dest.segment_path.clone() }))
    }
}

struct ShmOut {
    seg: Arc<KvMemory>,
    path: String,
}

impl Outbound for ShmOut {
    fn segment_path(&self) -> String {
        self.path.clone()
    }

    /// The blocks go straight into D's segment; after each group, a SUMS frame with its
    /// checksums lets D verify that group while the next one is copied.
    fn stage(
        &mut self,
        src: &dyn KvBlockSource,
        src_blocks: &[BlockId],
        link: &Link,
    ) -> Result<(), TransportError> {
        let seg = &self.seg;
        let layers = link.layout.num_layers;
        let size = link.group_blocks;
        for (g, (group, dest)) in src_blocks.chunks(size).zip(link.dest_blocks.chunks(size)).enumerate() {
            let crcs = copy_group_checksummed(
                src,
                group,
                layers,
                // D may have given up (timeout, or a bad checksum in an earlier group): then it
                // waits for us to close before it reuses the blocks, and we must not write
                // another byte. Checked before every layer of every group, so at least as often
                // as before every block.
                |_| link.check_stopped(),
                |layer, i| {
                    // SAFETY: `dest[i]` is a block of the reservation D pinned for this session
                    // (it answered OK to our HELLO, and the connection is open): D's engine does
                    // not touch it, and D frees it only after this connection closes or after it
                    // told us to stop, which we checked just before this layer. D reads it (to
                    // verify) only after the SUMS frame of its group, sent below once the whole
                    // group is written.
                    unsafe { seg.block_bytes_mut(layer, dest[i]) }.map_err(TransportError::from)
                },
            )?;
            link.send(Outgoing::Frame(wire::sums_frame((g * size) as u32, &crcs)))?;
        }
        Ok(())
    }
}

/// D's half: the segment its pool lives in, if it does.
struct ShmReceive {
    segment: Option<String>,
}

impl ReceiveKind for ShmReceive {
    fn unavailable(&self) -> Option<String> {
        self.segment.is_none().then(|| "this worker's KV pool is not in shared memory".into())
    }

    fn offer(&self, offer: &mut TransportOffer) {
        offer.segment_path = self.segment.clone().unwrap_or_default();
        in_pid_namespace(offer);
    }

    fn check_hello(&self, h: &Hello) -> Result<(), String> {
        match &self.segment {
            None => Err("this worker's KV pool is not in shared memory; use tcp".into()),
            Some(p) if *p != h.segment_path => {
                Err(format!("sender mapped segment {}, this worker's pool is {p}", h.segment_path))
            }
            Some(_) => Ok(()),
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
