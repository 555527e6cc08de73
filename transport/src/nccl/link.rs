//! The communicators of the nccl transport, one per prefill/decode pair, made lazily.
//!
//! P names each communicator it opens with a random key and sends the key, with the NCCL unique
//! id, in the HELLO of the first transfer to that decode worker; both sides then join (P as
//! rank 0, D as rank 1) while D holds the HELLO's reservation, and D answers OK once it has
//! joined. Later transfers name the key only. A decode worker that does not know the key (it
//! restarted) refuses by name and P opens a new communicator. A communicator that failed is
//! aborted and forgotten on both sides.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_engine::cuda::DeviceKvPool;
use tandem_engine::kv::BlockId;

use super::{load, pieces, runs, NcclError, NcclPeer, UniqueId};

/// Longest wait for both ranks to join a new communicator.
pub(crate) const JOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// Most communicators a worker keeps; past it, broken ones go first, then any one.
const MAX_LINKS: usize = 32;

/// Words of D's refusal when a HELLO names a communicator it does not have (P then opens a new
/// one).
pub(crate) const UNKNOWN_COMM: &str = "unknown NCCL communicator";

/// A fresh random communicator key.
fn fresh_key() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos(),
    );
    h.write_u32(std::process::id());
    h.finish() | 1
}

/// The device addresses of every layer's K and V plane of `pool`, in wire order.
fn planes(pool: &DeviceKvPool) -> Result<Vec<u64>, NcclError> {
    let l = pool.layout();
    let mut v = Vec::with_capacity(2 * l.num_layers);
    for layer in 0..l.num_layers {
        for kv in 0..2 {
            v.push(
                pool.block_address(layer, kv, 0)
                    .map_err(|e| NcclError::Invalid(format!("the KV pool has no block 0: {e}")))?,
            );
        }
    }
    Ok(v)
}

/// This side's pieces of a transfer of `src` into `dst` (`mine` is this side's list, in `pool`).
fn transfer_pieces(
    pool: &DeviceKvPool,
    mine: &[BlockId],
    src: &[BlockId],
    dst: &[BlockId],
) -> Result<Vec<(u64, usize)>, NcclError> {
    if src.len() != dst.len() {
        return Err(NcclError::Invalid(format!(
            "{} source blocks for {} destination blocks",
            src.len(),
            dst.len()
        )));
    }
    let nb = pool.layout().num_blocks;
    if let Some(b) = mine.iter().find(|&&b| b as usize >= nb) {
        return Err(NcclError::Invalid(format!("block {b} outside the KV pool of {nb} blocks")));
    }
    Ok(pieces(&planes(pool)?, pool.layout().block_bytes(), mine, &runs(src, dst)))
}

/// Drops communicators on a thread of their own: dropping one joins its thread, which may wait
/// for NCCL, and the caller may be an async task.
fn drop_elsewhere(peers: Vec<Arc<NcclPeer>>) {
    if !peers.is_empty() {
        let _ = std::thread::Builder::new().name("nccl-drop".into()).spawn(move || drop(peers));
    }
}

/// Removes broken communicators, and with `make_room` one more when the table is full; returns
/// them for [`drop_elsewhere`].
fn trim<K: Clone + Eq + std::hash::Hash, V>(
    links: &mut HashMap<K, V>,
    make_room: bool,
    peer: impl Fn(&V) -> &Arc<NcclPeer>,
) -> Vec<Arc<NcclPeer>> {
    let broken: Vec<K> = links.iter().filter(|(_, v)| peer(v).is_broken()).map(|(k, _)| k.clone()).collect();
    let mut out: Vec<Arc<NcclPeer>> =
        broken.iter().filter_map(|k| links.remove(k)).map(|v| peer(&v).clone()).collect();
    if make_room && links.len() >= MAX_LINKS {
        if let Some(k) = links.keys().next().cloned() {
            out.extend(links.remove(&k).map(|v| peer(&v).clone()));
        }
    }
    out
}

/// P: communicators with decode workers, by the decode worker's KV address.
pub(crate) struct SendLinks {
    own: DeviceKvPool,
    links: Mutex<HashMap<String, (u64, Arc<NcclPeer>)>>,
}

/// How P's HELLO opens the transfer's communicator.
pub(crate) enum Opening {
    /// A communicator both sides already have.
    Reuse(u64, Arc<NcclPeer>),
    /// A new one: both join after the HELLO.
    New(u64, UniqueId),
}

impl SendLinks {
    pub fn new(own: DeviceKvPool) -> Result<SendLinks, NcclError> {
        load()?;
        Ok(SendLinks { own, links: Mutex::new(HashMap::new()) })
    }

    /// The communicator to use with the decode worker at `peer`: a healthy one already there,
    /// or a new key and unique id.
    pub fn opening(&self, peer: &str) -> Result<Opening, NcclError> {
        if let Some((k, p)) = self.links.lock().unwrap_or_else(|p| p.into_inner()).get(peer) {
            if !p.is_broken() {
                return Ok(Opening::Reuse(*k, p.clone()));
            }
        }
        Ok(Opening::New(fresh_key(), load()?.unique_id()?))
    }

    /// Joins a new communicator as rank 0 (blocks until D joined, at most [`JOIN_TIMEOUT`]) and
    /// keeps it for `peer`.
    pub fn join(&self, peer: &str, key: u64, id: UniqueId) -> Result<Arc<NcclPeer>, NcclError> {
        let p = Arc::new(NcclPeer::connect(load()?, self.own.context().clone(), id, 0, JOIN_TIMEOUT)?);
        let old = {
            let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
            let mut old = trim(&mut links, true, |(_, p)| p);
            old.extend(links.insert(peer.to_owned(), (key, p.clone())).map(|(_, p)| p));
            old
        };
        drop_elsewhere(old);
        Ok(p)
    }

    /// Forgets the communicator `key` with `peer` (it failed, or the peer does not know it); a
    /// newer one made meanwhile stays.
    pub fn forget(&self, peer: &str, key: u64) {
        let gone = {
            let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
            match links.get(peer) {
                Some((k, _)) if *k == key => links.remove(peer).map(|(_, p)| p),
                _ => None,
            }
        };
        drop_elsewhere(gone.into_iter().collect());
    }

    /// The sender's pieces of a transfer of its blocks `src` into D's blocks `dst`.
    pub fn pieces(&self, src: &[BlockId], dst: &[BlockId]) -> Result<Vec<(u64, usize)>, NcclError> {
        transfer_pieces(&self.own, src, src, dst)
    }
}

/// D: communicators with prefill workers, by the key the prefill worker chose.
pub(crate) struct RecvLinks {
    own: DeviceKvPool,
    links: Mutex<HashMap<u64, Arc<NcclPeer>>>,
}

impl RecvLinks {
    pub fn new(own: DeviceKvPool) -> Result<RecvLinks, NcclError> {
        load()?;
        Ok(RecvLinks { own, links: Mutex::new(HashMap::new()) })
    }

    /// Joins the communicator a HELLO announced, as rank 1 (blocks, at most [`JOIN_TIMEOUT`]).
    pub fn join(&self, key: u64, id: UniqueId) -> Result<Arc<NcclPeer>, NcclError> {
        let p = Arc::new(NcclPeer::connect(load()?, self.own.context().clone(), id, 1, JOIN_TIMEOUT)?);
        let old = {
            let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
            let mut old = trim(&mut links, true, |p| p);
            old.extend(links.insert(key, p.clone()));
            old
        };
        drop_elsewhere(old);
        Ok(p)
    }

    /// The healthy communicator named `key`, if there is one.
    pub fn get(&self, key: u64) -> Option<Arc<NcclPeer>> {
        let (found, old) = {
            let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
            let old = trim(&mut links, false, |p| p);
            (links.get(&key).cloned(), old)
        };
        drop_elsewhere(old);
        found
    }

    /// The receiver's pieces of a transfer of P's blocks `src` into its blocks `dst`.
    pub fn pieces(&self, src: &[BlockId], dst: &[BlockId]) -> Result<Vec<(u64, usize)>, NcclError> {
        transfer_pieces(&self.own, dst, src, dst)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_differ() {
        let a = super::fresh_key();
        let b = super::fresh_key();
        assert_ne!(a, b);
        assert_ne!(a, 0);
    }
}
