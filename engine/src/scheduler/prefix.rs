//! The engine's side of the prefix cache: naming each sequence's completed blocks after a step,
//! and attaching cached prefixes to queued sequences before planning (see the module
//! documentation of [`super`]).

use super::sequence::Phase;
use super::Engine;
use crate::error::Result;
use crate::kv::prefix::reusable_blocks;
use crate::kv::SeqId;

impl Engine {
    /// Registers the full blocks of `seq`'s committed tokens that are not registered yet. A block
    /// whose hash another block already holds (the same tokens computed twice at once) stays
    /// unregistered and is freed, not cached, when released.
    pub(super) fn register_blocks(&mut self, seq: SeqId) -> Result<()> {
        let bs = self.alloc.block_size();
        let Some(s) = self.seqs.get_mut(&seq) else { return Ok(()) };
        if !s.has_blocks {
            return Ok(());
        }
        let Some(p) = &mut s.prefix else { return Ok(()) };
        // Only what the cache and the allocator agree is committed: `computed` never counts a
        // staged draft token, and a sequence holding just a cached prefix has nothing new.
        let held = self.alloc.seq_len(seq).unwrap_or(0);
        let full = s.computed.min(held) / bs;
        if full <= p.registered {
            return Ok(());
        }
        let from = p.registered;
        let hashes = p.hashes_for(&s.tokens[..full * bs], bs);
        for (i, &h) in hashes.iter().enumerate().skip(from) {
            self.alloc.register(seq, i, h)?;
        }
        p.registered = full;
        Ok(())
    }

    /// Registers the completed blocks of every sequence holding blocks.
    pub(super) fn register_all(&mut self) -> Result<()> {
        if self.prefix.is_none() {
            return Ok(());
        }
        let ids: Vec<SeqId> = self.seqs.iter().filter(|(_, s)| s.has_blocks).map(|(&id, _)| id).collect();
        for id in ids {
            self.register_blocks(id)?;
        }
        Ok(())
    }

    /// Attaches cached prefixes to queued sequences that hold nothing, in queue order, while what
    /// the attached sequences still need (and one block per running sequence) stays available,
    /// so that the planner can admit them. Stops at the first sequence that does not fit, as
    /// admission does.
    pub(super) fn attach_cached_prefixes(&mut self) -> Result<()> {
        if self.prefix.is_none() || self.queue.is_empty() {
            return Ok(());
        }
        let bs = self.alloc.block_size();
        let running = self.seqs.values().filter(|s| s.admitted && s.phase != Phase::Held).count();
        let mut admitted = running;
        // One token block (a page per layer group) kept per running sequence.
        let mut budget = self.alloc.available_blocks() as isize - (running * self.alloc.groups()) as isize;
        let queue: Vec<SeqId> = self.queue.iter().copied().collect();
        for id in queue {
            if self.tiers.is_some() && !self.seqs[&id].has_blocks && self.reload_for(id)? {
                // Out of the queue until its pages are read from disk.
                continue;
            }
            let s = self.seqs.get_mut(&id).expect("queued sequence is live");
            let all = self.alloc.blocks_for(s.tokens.len());
            if s.has_blocks {
                let held = self.alloc.held(id);
                budget -= self.alloc.pages_held(s.tokens.len(), s.computed).saturating_sub(held) as isize;
                admitted += usize::from(s.admitted);
                continue;
            }
            let Some(p) = &mut s.prefix else {
                // Outside the cache (a prompt being scored): it takes its whole cost, and the
                // sequences behind it are still looked up.
                if all as isize > budget || admitted >= self.opts.max_num_seqs {
                    break;
                }
                budget -= all as isize;
                admitted += 1;
                continue;
            };
            let n = reusable_blocks(s.tokens.len(), bs);
            let hits = {
                let hashes = p.hashes_for(&s.tokens[..n * bs], bs);
                self.alloc.lookup_table(hashes, None)
            };
            // The hit in token blocks, and the pages it holds (window groups need none for some).
            let hit_blocks = hits.len() / self.alloc.groups();
            let pages: Vec<_> = hits.iter().copied().filter(|&b| b != crate::kv::NO_PAGE).collect();
            let stats = &mut self.prefix.as_mut().expect("checked above").stats;
            p.count_lookup(stats, s.tokens.len());
            let needs = self.alloc.pages_held(s.tokens.len(), hit_blocks * bs);
            let cost = (needs - pages.len() + self.alloc.unreferenced(&pages)) as isize;
            if cost > budget || admitted >= self.opts.max_num_seqs {
                break;
            }
            budget -= cost;
            admitted += 1;
            if hits.is_empty() {
                continue;
            }
            self.alloc.add_cached_sequence(id, &hits)?;
            let hit_tokens = hit_blocks * bs;
            stats.hit_tokens += hit_tokens as u64;
            if s.started.is_none() {
                p.cached_tokens = hit_tokens;
            }
            p.registered = hit_blocks;
            s.computed = hit_tokens;
            s.has_blocks = true;
            tracing::debug!(seq = id, cached_tokens = hit_tokens, "prefix cache hit");
        }
        Ok(())
    }

    /// Brings back from the KV tiers what they hold of queued sequence `seq`'s prefix beyond the
    /// pool. Returns true when the sequence now waits out of the queue for pages read from disk
    /// (again when more turn out to be on disk, but at most [`super::RELOAD_WAIT`] from its first
    /// wait).
    fn reload_for(&mut self, seq: SeqId) -> Result<bool> {
        let bs = self.alloc.block_size();
        let hashes = {
            let s = self.seqs.get_mut(&seq).expect("queued sequence is live");
            let Some(p) = &mut s.prefix else { return Ok(false) };
            let n = reusable_blocks(s.tokens.len(), bs);
            p.hashes_for(&s.tokens[..n * bs], bs).to_vec()
        };
        let reload = self.reload_prefix(&hashes)?;
        if reload.reading.is_empty() {
            return Ok(false);
        }
        let now = std::time::Instant::now();
        let Some(p) = self.seqs.get_mut(&seq).and_then(|s| s.prefix.as_mut()) else { return Ok(false) };
        let until = *p.tier_wait_until.get_or_insert(now + super::RELOAD_WAIT);
        if now >= until {
            return Ok(false);
        }
        self.start_loading(seq, reload.reading, until);
        Ok(true)
    }

    /// Lets go of the cached prefixes of queued sequences that were not admitted (a step that
    /// could run nothing with them attached plans again without them). Returns whether any was.
    pub(super) fn detach_unadmitted(&mut self) -> Result<bool> {
        let ids: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.has_blocks && !s.admitted && s.phase != Phase::Held)
            .map(|(&id, _)| id)
            .collect();
        for &id in &ids {
            self.alloc.free_sequence(id)?;
            let s = self.seqs.get_mut(&id).expect("live");
            s.has_blocks = false;
            s.computed = 0;
            if let Some(p) = &mut s.prefix {
                p.registered = 0;
            }
        }
        Ok(!ids.is_empty())
    }
}
