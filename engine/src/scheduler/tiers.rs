//! The engine's side of the KV tiers ([`crate::kv::tier`]): pages the pool evicts are spilled to
//! the tiers, and a prompt whose prefix continues in a tier has those pages reloaded into the pool
//! as cached pages before it is looked up, so the prefix cache finds them as if they had never
//! left.
//!
//! - **Spill.** The allocator records every page it evicts with the name it held
//!   ([`BlockAllocator::take_evicted`](crate::kv::BlockAllocator::take_evicted)). Its bytes stay
//!   intact until the engine next writes into the pool, so the engine copies them out before every
//!   write: before a pass's allocations are used (in `grow`), before a copy-on-write, and before
//!   a reservation's raw blocks are handed to a transfer. A pass refuses to run with evictions not
//!   taken, so a missed place is an error, never a corrupt page. The copy goes through
//!   [`Backend::copy_pages_out`](crate::backend::Backend::copy_pages_out): a memory copy on a CPU,
//!   copies queued on the stream ahead of the kernels that reuse the blocks on a GPU, which the
//!   tiers' spill thread waits for (the engine waits itself only before raw blocks go to a
//!   transfer, which writes them outside that order). Checksums and disk writes happen on the
//!   tiers' threads, which drop what they cannot keep up with.
//! - **Reload.** Before a queued sequence is looked up (and before a decode worker's reservation
//!   pins its prefix), the token blocks that follow the pool's hit are looked for in the tiers.
//!   Pages in memory are written into raw blocks and registered as cached pages
//!   ([`BlockAllocator::cache_raw`](crate::kv::BlockAllocator::cache_raw)); pages only on disk
//!   are read by the tiers' thread while the sequence waits out of the queue (at most
//!   [`RELOAD_WAIT`]), so the engine never waits on a disk while it has other work. A page that
//!   cannot be read (an I/O error, a bad checksum) is computed instead.
//! - **Budget.** Reloading takes pool pages: the pages the pool still has for the prompt are moved
//!   to the recent end of the eviction order first, and only as many pages are reloaded as there
//!   are free pages and cached pages of other prompts.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::Engine;
use crate::error::{EngineError, Result};
use crate::kv::allocator::group_hash;
use crate::kv::prefix::BlockHash;
use crate::kv::{BlockId, KvTiers, SeqId, TierKind, TierStats};

/// The longest a queued sequence waits for its prefix's pages to be read from disk before it is
/// admitted without them (the pages not read by then are computed).
pub const RELOAD_WAIT: Duration = Duration::from_millis(2000);

/// The engine's tier state.
pub(super) struct Tiers {
    pub(super) store: KvTiers,
    /// Sequences out of the queue while their pages are read from disk: the names they wait for
    /// and when they stop waiting.
    loading: BTreeMap<SeqId, (Vec<BlockHash>, Instant)>,
    pub(super) stats: TierEngineStats,
}

/// What the engine did with its tiers since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierEngineStats {
    /// Pages copied out of the pool when it evicted them.
    pub spilled_pages: u64,
    /// Evicted pages a tier already held (not copied again).
    pub spill_skipped: u64,
    /// Evicted pages not copied because the spill queue was full.
    pub spill_dropped: u64,
    /// Pages written back into the pool from a tier.
    pub reloaded_pages: u64,
    /// Times a sequence waited out of the queue for pages read from disk.
    pub waits: u64,
    /// Of those, the ones admitted before every page had arrived (the rest was computed).
    pub wait_timeouts: u64,
}

/// What looking a prefix up in the tiers found.
#[derive(Debug, Default)]
pub(super) struct Reload {
    /// Pages written back into the pool.
    pub(super) pages: usize,
    /// Disk pages requested from disk (in flight, or read already: in memory for the next
    /// look, which the sequence waits for).
    pub(super) reading: Vec<BlockHash>,
}

impl Engine {
    /// Puts KV tiers behind the pool: pages the pool evicts are kept there, and prompts whose
    /// prefix continues there get those pages back instead of computing them. Needs the prefix
    /// cache (the pages' names are its names), and a store made for this pool's page size.
    pub fn with_kv_tiers(mut self, store: KvTiers) -> Result<Engine> {
        if self.prefix.is_none() {
            return Err(EngineError::InvalidRequest(
                "KV tiers need the prefix cache (--prefix-cache true)".into(),
            ));
        }
        let page = self.page_bytes();
        if store.page_bytes() != page {
            return Err(EngineError::InvalidRequest(format!(
                "the KV tiers hold pages of {} bytes, this pool's are {page}",
                store.page_bytes()
            )));
        }
        self.alloc.set_spilling(true);
        self.tiers = Some(Tiers { store, loading: BTreeMap::new(), stats: TierEngineStats::default() });
        Ok(self)
    }

    /// Bytes of one pool page: K and V of one block in every storage layer of the pool.
    pub fn page_bytes(&self) -> usize {
        let l = self.backend.kv_layout();
        2 * l.num_layers * l.block_bytes()
    }

    /// The KV tiers, when on.
    pub fn kv_tiers(&self) -> Option<&KvTiers> {
        self.tiers.as_ref().map(|t| &t.store)
    }

    /// The tiers' counters and the engine's, when the tiers are on.
    pub fn tier_stats(&self) -> Option<(TierStats, TierEngineStats)> {
        self.tiers.as_ref().map(|t| (t.store.stats(), t.stats))
    }

    /// What a decode worker does before it reserves for `prompt` (salt `salt`): reloads what the
    /// tiers hold in memory of its prefix and asks the disk for the rest. Returns the tiers and
    /// the names being read, which the caller may wait for (off the engine thread, with
    /// [`KvTiers::in_flight`]) before it reserves, so that the reservation pins them too.
    /// `None` without tiers or for a prompt with no reusable block.
    pub fn prefetch_prompt(
        &mut self,
        prompt: &[u32],
        salt: &str,
    ) -> Result<Option<(KvTiers, Vec<BlockHash>)>> {
        let (Some(root), Some(t)) = (self.prefix_root(salt), &self.tiers) else { return Ok(None) };
        let store = t.store.clone();
        let bs = self.alloc.block_size();
        let n = crate::kv::prefix::reusable_blocks(prompt.len(), bs);
        if n == 0 {
            return Ok(None);
        }
        let hashes = crate::kv::prefix::block_hashes(root, &prompt[..n * bs], bs);
        let reload = self.reload_prefix(&hashes)?;
        Ok((!reload.reading.is_empty()).then_some((store, reload.reading)))
    }

    /// Copies the pages the allocator evicted since the last call into the tiers. Called before
    /// every write into the pool (see the module documentation). The copies are ordered before
    /// the backend's later work on the pool but may still be in flight on return (a GPU's
    /// stream): the tiers' spill thread waits for them.
    pub(super) fn spill_evicted(&mut self) -> Result<()> {
        self.spill_evicted_then(false)
    }

    /// [`Engine::spill_evicted`], waiting for the copies when `wait`: before raw blocks are
    /// handed to a transfer, which writes them outside the backend's order.
    pub(super) fn spill_evicted_then(&mut self, wait: bool) -> Result<()> {
        let Some(t) = &mut self.tiers else { return Ok(()) };
        if wait {
            // Copies queued earlier may still read blocks that are free again by now.
            t.store.settle_spills();
        }
        let evicted = self.alloc.take_evicted();
        if evicted.is_empty() {
            return Ok(());
        }
        let mut todo: Vec<(BlockId, BlockHash)> = Vec::with_capacity(evicted.len());
        for (block, name) in evicted {
            match t.store.contains(name) {
                Some(TierKind::Host) => {
                    t.stats.spill_skipped += 1;
                    continue;
                }
                Some(TierKind::Disk) if !t.store.has_host() => {
                    t.stats.spill_skipped += 1;
                    continue;
                }
                _ => {}
            }
            todo.push((block, name));
        }
        // A spill that cannot keep up drops pages rather than make the engine wait.
        let room = t.store.spill_room();
        if todo.len() > room {
            t.store.drop_spills(todo.len() - room);
            t.stats.spill_dropped += (todo.len() - room) as u64;
            todo.truncate(room);
        }
        if todo.is_empty() {
            return Ok(());
        }
        let blocks: Vec<BlockId> = todo.iter().map(|&(b, _)| b).collect();
        let mut pages: Vec<crate::kv::Page> = todo.iter().map(|_| t.store.page()).collect();
        // SAFETY: the pages are moved into the store with the copy, which waits for it before
        // reading them or giving their memory back (or are waited for here).
        let copy = unsafe { self.backend.copy_pages_out(&blocks, &mut pages) }?;
        let copy = match copy {
            Some(c) if wait => match c.wait() {
                Ok(()) => None,
                Err(e) => {
                    // The copy may still write into the pages: their memory is never given back.
                    std::mem::forget(pages);
                    return Err(EngineError::Internal(format!("copying evicted KV pages out: {e}")));
                }
            },
            c => c,
        };
        t.stats.spilled_pages += pages.len() as u64;
        let named = todo.iter().map(|&(_, name)| name).zip(pages).collect();
        t.store.spill_copied(named, copy);
        Ok(())
    }

    /// Copies the named pages the pool holds and the disk tier lacks to the disk (held pages,
    /// then cached ones from the most recently released), letting the write queue drain between
    /// batches, until all are written or `timeout` has passed: what a worker does as it stops,
    /// so that started again it finds on disk what its pool held too. Returns the pages written.
    /// Without a disk tier it does nothing.
    pub fn spill_pool(&mut self, timeout: Duration) -> Result<usize> {
        let Some(t) = &self.tiers else { return Ok(0) };
        let store = t.store.clone();
        if !store.has_disk() {
            return Ok(0);
        }
        let until = Instant::now() + timeout;
        let mut pages = self.alloc.named_pages();
        pages.retain(|&(_, name)| !store.on_disk(name));
        let mut written = 0;
        for batch in pages.chunks(32) {
            if Instant::now() >= until {
                break;
            }
            for &(block, name) in batch {
                let (page, sum) = read_page(self.backend.as_ref(), block)?;
                store.spill(name, page, sum);
            }
            let drained = store.flush(until.saturating_duration_since(Instant::now()));
            written += batch.iter().filter(|&&(_, name)| store.on_disk(name)).count();
            if !drained {
                break;
            }
        }
        if written < pages.len() {
            tracing::warn!(
                written,
                pages = pages.len(),
                "not every KV pool page reached the disk tier before the worker stopped"
            );
        }
        Ok(written)
    }

    /// Fails when evicted pages were not copied out before a write into the pool (an engine bug
    /// that would otherwise spill pages overwritten by the write).
    pub(super) fn check_spilled(&self) -> Result<()> {
        match self.alloc.pending_evictions() {
            0 => Ok(()),
            n => Err(EngineError::Internal(format!(
                "{n} evicted KV pages were not spilled before the pool was written"
            ))),
        }
    }

    /// Reloads from the tiers the pages of the token blocks named `hashes` (a prompt's leading
    /// full blocks) that follow what the pool holds, as far as every page a block needs is held
    /// somewhere and the pool has room. Pages only on disk are requested from disk (not waited
    /// for) and listed in [`Reload::reading`].
    pub(super) fn reload_prefix(&mut self, hashes: &[BlockHash]) -> Result<Reload> {
        let mut out = Reload::default();
        let Some(t) = &self.tiers else { return Ok(out) };
        let g = self.alloc.groups();
        let windows = self.alloc.windows().to_vec();
        // Per token block, in order: the pages the pool holds, and those a tier holds.
        let mut in_pool: Vec<BlockId> = Vec::new();
        let mut memory: Vec<(BlockHash, usize)> = Vec::new();
        let mut on_disk: Vec<BlockHash> = Vec::new();
        // Pages read from disk stay in memory until taken only as far as there is room there.
        let read_room = t.store.read_room();
        for &h in hashes {
            let mut complete = true;
            let (mut pool_i, mut mem_i, mut disk_i) = (Vec::new(), Vec::new(), Vec::new());
            for (k, w) in windows.iter().enumerate().take(g) {
                let name = group_hash(h, k);
                if let Some(&b) = self.alloc.lookup(std::slice::from_ref(&name)).first() {
                    pool_i.push(b);
                    continue;
                }
                match t.store.contains(name) {
                    Some(TierKind::Host) => mem_i.push((name, k)),
                    Some(TierKind::Disk) => disk_i.push(name),
                    // A window group may have given this page back: the lookup decides.
                    None => complete &= w.is_some(),
                }
            }
            if !complete || on_disk.len() + disk_i.len() > read_room {
                break;
            }
            in_pool.extend(pool_i);
            // Past a block that waits for the disk, pages in memory are of no use until it is
            // read: they are reloaded with it, on the next look.
            if on_disk.is_empty() {
                memory.extend(mem_i);
            }
            on_disk.extend(disk_i);
        }
        if !on_disk.is_empty() {
            // Some may be read before this returns: the sequence still waits one step for them.
            t.store.prefetch(&on_disk);
            out.reading = on_disk;
        }
        if memory.is_empty() {
            return Ok(out);
        }
        // Keep what the pool has of this prompt, then reload what fits besides.
        self.alloc.touch(&in_pool);
        let held_here = self.alloc.unreferenced(&in_pool);
        let room = (self.alloc.available_blocks()).saturating_sub(held_here);
        memory.truncate(room);
        let mut pages = Vec::with_capacity(memory.len());
        for (name, k) in memory {
            // A page evicted from the tier since the look above ends the reload: what follows
            // it could not be used past the gap.
            let Some(bytes) = self.tiers.as_ref().expect("checked above").store.get(name) else { break };
            pages.push((name, k, bytes));
        }
        if pages.is_empty() {
            return Ok(out);
        }
        let blocks = self.alloc.alloc_blocks(pages.len())?;
        // Allocating may have evicted other prompts' pages: they leave before these are written.
        let written = self.spill_evicted().and_then(|()| self.write_pages(&blocks, &pages));
        if let Err(e) = written {
            self.alloc.release_blocks(&blocks)?;
            tracing::warn!(error = %e, "reloading KV pages from a tier failed; computing them instead");
            return Ok(out);
        }
        let named: Vec<(BlockId, BlockHash, usize)> =
            blocks.iter().zip(&pages).map(|(&b, (name, k, _))| (b, *name, *k)).collect();
        if let Err(e) = self.alloc.cache_raw(&named) {
            self.alloc.release_blocks(&blocks)?;
            return Err(e.into());
        }
        out.pages = named.len();
        if let Some(t) = &mut self.tiers {
            t.stats.reloaded_pages += named.len() as u64;
        }
        Ok(out)
    }

    /// Writes reloaded pages' bytes into the pool's `blocks`.
    fn write_pages(
        &mut self,
        blocks: &[BlockId],
        pages: &[(BlockHash, usize, std::sync::Arc<crate::kv::tier::Page>)],
    ) -> Result<()> {
        let bytes: Vec<&[u8]> = pages.iter().map(|(_, _, p)| &p[..]).collect();
        self.backend.write_pages(blocks, &bytes)
    }

    /// Takes `seq` out of the queue while the pages it waits for are read from disk, until
    /// `until` at the latest.
    pub(super) fn start_loading(&mut self, seq: SeqId, names: Vec<BlockHash>, until: Instant) {
        let Some(t) = &mut self.tiers else { return };
        self.queue.retain(|&s| s != seq);
        t.stats.waits += 1;
        t.loading.insert(seq, (names, until));
    }

    /// Puts back at the front of the queue, in arrival order, the loading sequences whose pages
    /// have all arrived or whose wait is over. When nothing else could run, waits a little for a
    /// read to finish instead of spinning.
    pub(super) fn poll_loading(&mut self) {
        let Some(t) = &mut self.tiers else { return };
        if t.loading.is_empty() {
            return;
        }
        let idle = self.queue.is_empty()
            && !self.seqs.iter().any(|(id, s)| s.decodes_next() && !t.loading.contains_key(id));
        if idle {
            t.store.wait_loaded(Duration::from_millis(5));
        }
        let now = Instant::now();
        let ready: Vec<SeqId> = t
            .loading
            .iter()
            .filter(|(_, (names, until))| now >= *until || !t.store.in_flight(names))
            .map(|(&id, _)| id)
            .collect();
        for &id in ready.iter().rev() {
            let (names, until) = t.loading.remove(&id).expect("listed above");
            if now >= until && t.store.in_flight(&names) {
                t.stats.wait_timeouts += 1;
            }
            self.queue.push_front(id);
        }
    }

    /// Forgets a sequence that leaves while it waits for its pages.
    pub(super) fn forget_loading(&mut self, seq: SeqId) {
        if let Some(t) = &mut self.tiers {
            t.loading.remove(&seq);
        }
    }

    /// Whether `seq` is out of the queue waiting for pages from disk.
    pub(super) fn is_loading(&self, seq: SeqId) -> bool {
        self.tiers.as_ref().is_some_and(|t| t.loading.contains_key(&seq))
    }
}

/// Block `block` of `backend`'s pool as a page (every layer's K then V) and its CRC-32, summed
/// while it is copied, as a transfer sender stages a block.
fn read_page(backend: &dyn crate::backend::Backend, block: BlockId) -> Result<(Vec<u8>, u32)> {
    let layout = backend.kv_layout();
    let n = layout.block_bytes();
    let mut page = vec![0u8; 2 * layout.num_layers * n];
    let mut sum = 0;
    for (layer, kv) in page.chunks_exact_mut(2 * n).enumerate() {
        let (k, v) = kv.split_at_mut(n);
        sum = backend.read_block_summed(layer, block, k, v, sum)?;
    }
    Ok((page, sum))
}
