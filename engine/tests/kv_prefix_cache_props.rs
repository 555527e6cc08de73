//! Property test of the block allocator with the prefix cache on: sequences start from cached
//! prefixes, grow, register their full blocks and end; reservations pin cached prefixes and are
//! adopted or released; plain allocations put the pool under pressure so cached blocks are
//! evicted. The test keeps its own record of what each block holds. After every operation:
//! the invariant checker passes (free + cached + owned == total), a block handed out fresh is held
//! by nobody else (eviction never takes a referenced block), and every block a sequence or a
//! reservation found in the cache still holds the tokens its hash names. Freeing everything leaves
//! only free and cached blocks.

use std::collections::BTreeMap;

use proptest::prelude::*;
use tandem_engine::kv::prefix::{block_hashes, chain_root, reusable_blocks, BlockHash};
use tandem_engine::kv::{BlockAllocator, BlockId, SeqId};

const BS: usize = 4;
const TOTAL: usize = 24;

/// Prompt `i`: one of three shared "system prompts" (2 or 3 blocks), then tokens of its own.
fn prompt(i: usize, extra: usize) -> Vec<u32> {
    let family = (i % 3) as u32;
    let mut t: Vec<u32> = (0..(8 + 4 * (i % 2) as u32)).map(|k| family * 100 + k).collect();
    t.extend((0..extra as u32).map(|k| 1000 + i as u32 * 50 + k));
    t
}

/// What a block holds, as the test knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Content {
    /// A full block of these tokens (named by their hash).
    Full(BlockHash),
    /// Anything else (a partial block, a plain allocation).
    Other,
}

#[derive(Debug, Clone)]
enum Op {
    /// Start sequence `seq` on prompt `i` with `extra` tokens of its own, through the cache.
    Start(SeqId, usize, usize),
    /// Grow a sequence by `n` generated tokens (registering blocks as they fill).
    Grow(SeqId, usize),
    Free(SeqId),
    /// Reserve for prompt `i` (pinning its cached prefix), then fill the raw blocks.
    Reserve(usize, usize),
    /// Adopt reservation `r` (modulo the number held) as sequence `seq`.
    Adopt(usize, SeqId),
    /// Release reservation `r` (modulo the number held).
    Release(usize),
    /// A plain sequence of `n` tokens (no cache): pressure.
    Plain(SeqId, usize),
    /// Reload what a KV tier holds of prompt `i` beyond the pool's hit (as the engine does
    /// before a lookup).
    Reload(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    let seq = 0..8u64;
    prop_oneof![
        4 => (seq.clone(), 0..6usize, 0..9usize).prop_map(|(s, i, e)| Op::Start(s, i, e)),
        3 => (seq.clone(), 1..7usize).prop_map(|(s, n)| Op::Grow(s, n)),
        3 => seq.clone().prop_map(Op::Free),
        2 => (0..6usize, 0..9usize).prop_map(|(i, e)| Op::Reserve(i, e)),
        2 => (any::<usize>(), seq.clone()).prop_map(|(r, s)| Op::Adopt(r, s)),
        1 => any::<usize>().prop_map(Op::Release),
        2 => (seq, 1..30usize).prop_map(|(s, n)| Op::Plain(s, n)),
        2 => (0..6usize, 0..9usize).prop_map(|(i, e)| Op::Reload(i, e)),
    ]
}

struct Reservation {
    tokens: Vec<u32>,
    pinned: Vec<BlockId>,
    raw: Vec<BlockId>,
}

#[derive(Default)]
struct World {
    content: BTreeMap<BlockId, Content>,
    /// Each live sequence's tokens (None: a plain sequence, never registered).
    seqs: BTreeMap<SeqId, Option<Vec<u32>>>,
    reservations: Vec<Reservation>,
    /// Names of the pages evicted so far (what a KV tier would hold).
    tier: std::collections::BTreeSet<BlockHash>,
}

fn root() -> BlockHash {
    chain_root("model", "")
}

impl World {
    /// Takes the pages the allocator evicted, before anything writes them: each still holds
    /// what its name says (the bytes a tier would keep).
    fn spill(&mut self, a: &mut BlockAllocator) {
        for (b, name) in a.take_evicted() {
            assert_eq!(self.content.get(&b), Some(&Content::Full(name)), "block {b} evicted as {name:?}");
            self.tier.insert(name);
        }
    }

    /// Every block some sequence or reservation holds.
    fn held(&self, a: &BlockAllocator) -> Vec<BlockId> {
        let mut v: Vec<BlockId> = a.sequences().flat_map(|s| a.block_table(s).unwrap().to_vec()).collect();
        for r in &self.reservations {
            v.extend(&r.pinned);
            v.extend(&r.raw);
        }
        v
    }

    /// `fresh` were just handed out: nobody else may hold them.
    fn check_fresh(&self, a: &BlockAllocator, owner: Option<SeqId>, fresh: &[BlockId]) {
        let mut others: Vec<BlockId> = a
            .sequences()
            .filter(|&s| Some(s) != owner)
            .flat_map(|s| a.block_table(s).unwrap().to_vec())
            .collect();
        for r in &self.reservations {
            others.extend(&r.pinned);
            others.extend(&r.raw);
        }
        for b in fresh {
            assert!(!others.contains(b), "block {b} handed out while another owner holds it");
        }
    }

    /// Writes what a sequence of `tokens` holds in blocks `from..` of `table`, and registers the
    /// full ones (as the engine does after computing them).
    fn compute(&mut self, a: &mut BlockAllocator, seq: SeqId, tokens: &[u32], from: usize) {
        let table = a.block_table(seq).unwrap().to_vec();
        let hashes = block_hashes(root(), tokens, BS);
        for (i, &b) in table.iter().enumerate().skip(from) {
            match hashes.get(i) {
                Some(&h) => {
                    self.content.insert(b, Content::Full(h));
                    a.register(seq, i, h).unwrap();
                }
                None => {
                    self.content.insert(b, Content::Other);
                }
            }
        }
    }

    fn apply(&mut self, a: &mut BlockAllocator, op: &Op) {
        match *op {
            Op::Start(s, i, extra) => {
                if self.seqs.contains_key(&s) {
                    return;
                }
                let tokens = prompt(i, extra);
                let n = reusable_blocks(tokens.len(), BS);
                let hits = a.lookup(&block_hashes(root(), &tokens[..n * BS], BS));
                let before = a.stats();
                let cost = tokens.len().div_ceil(BS) - hits.len() + a.unreferenced(&hits);
                if cost > a.available_blocks() {
                    return;
                }
                a.add_cached_sequence(s, &hits).unwrap();
                a.append(s, tokens.len() - hits.len() * BS).unwrap();
                self.spill(a);
                let table = a.block_table(s).unwrap().to_vec();
                assert_eq!(&table[..hits.len()], &hits[..]);
                self.check_fresh(a, Some(s), &table[hits.len()..]);
                assert_eq!(
                    before.free + before.cached - a.stats().free - a.stats().cached,
                    cost,
                    "starting cost differs from what was counted"
                );
                self.compute(a, s, &tokens, hits.len());
                self.seqs.insert(s, Some(tokens));
            }
            Op::Grow(s, n) => {
                let Some(Some(tokens)) = self.seqs.get(&s).cloned() else { return };
                let have = a.block_table(s).unwrap().len();
                if a.append(s, n).is_err() {
                    return;
                }
                self.spill(a);
                let table = a.block_table(s).unwrap().to_vec();
                self.check_fresh(a, Some(s), &table[have..]);
                let mut tokens = tokens;
                let at = tokens.len() as u32;
                tokens.extend((0..n as u32).map(|k| 7000 + s as u32 * 100 + at + k));
                // The old last block may have become full: recompute from it.
                self.compute(a, s, &tokens, have.saturating_sub(1));
                self.seqs.insert(s, Some(tokens));
            }
            Op::Free(s) => {
                if self.seqs.remove(&s).is_some() {
                    a.free_sequence(s).unwrap();
                }
            }
            Op::Plain(s, n) => {
                if self.seqs.contains_key(&s) || a.add_sequence(s, n).is_err() {
                    return;
                }
                self.spill(a);
                let table = a.block_table(s).unwrap().to_vec();
                self.check_fresh(a, Some(s), &table);
                for b in table {
                    self.content.insert(b, Content::Other);
                }
                self.seqs.insert(s, None);
            }
            Op::Reserve(i, extra) => {
                let tokens = prompt(i, extra);
                let n = reusable_blocks(tokens.len(), BS);
                let hits = a.lookup(&block_hashes(root(), &tokens[..n * BS], BS));
                let raw_n = tokens.len().div_ceil(BS) - hits.len();
                if raw_n + a.unreferenced(&hits) > a.available_blocks() {
                    return;
                }
                a.pin(&hits).unwrap();
                let raw = a.alloc_blocks(raw_n).unwrap();
                self.spill(a);
                self.check_fresh(a, None, &raw);
                // The transfer fills the raw blocks.
                let hashes = block_hashes(root(), &tokens, BS);
                for (k, &b) in raw.iter().enumerate() {
                    let c = hashes.get(hits.len() + k).map_or(Content::Other, |&h| Content::Full(h));
                    self.content.insert(b, c);
                }
                self.reservations.push(Reservation { tokens, pinned: hits, raw });
            }
            Op::Adopt(r, s) => {
                if self.reservations.is_empty() || self.seqs.contains_key(&s) {
                    return;
                }
                let r = self.reservations.remove(r % self.reservations.len());
                a.adopt(s, &r.pinned, &r.raw, r.tokens.len()).unwrap();
                self.compute(a, s, &r.tokens, r.pinned.len());
                self.seqs.insert(s, Some(r.tokens));
            }
            Op::Reload(i, extra) => {
                let tokens = prompt(i, extra);
                let n = reusable_blocks(tokens.len(), BS);
                let hashes = block_hashes(root(), &tokens[..n * BS], BS);
                let hits = a.lookup(&hashes);
                // As the engine does: past the pool's hit, a page the pool still holds is kept
                // (its earlier neighbour was evicted before it), one a tier holds is reloaded,
                // and the first held nowhere ends the prefix.
                let mut in_pool = hits.clone();
                let mut kept: Vec<(BlockId, BlockHash)> = Vec::new();
                let mut back: Vec<BlockHash> = Vec::new();
                for &h in &hashes[hits.len()..] {
                    if let Some(&b) = a.lookup(&[h]).first() {
                        in_pool.push(b);
                        kept.push((b, h));
                    } else if self.tier.contains(&h) {
                        back.push(h);
                    } else {
                        break;
                    }
                }
                let room = a.available_blocks() - a.unreferenced(&in_pool);
                let back = &back[..back.len().min(room)];
                if back.is_empty() {
                    return;
                }
                a.touch(&in_pool);
                let raw = a.alloc_blocks(back.len()).unwrap();
                self.spill(a);
                self.check_fresh(a, None, &raw);
                assert_eq!(a.lookup(&hashes), hits, "reloading evicted the prompt's own pages");
                for &(b, h) in &kept {
                    assert_eq!(
                        a.block_hash(b),
                        Some(h),
                        "reloading evicted a page of the prompt the pool held"
                    );
                }
                let pages: Vec<(BlockId, BlockHash, usize)> =
                    raw.iter().zip(back).map(|(&b, &h)| (b, h, 0)).collect();
                for &(b, h, _) in &pages {
                    self.content.insert(b, Content::Full(h));
                }
                a.cache_raw(&pages).unwrap();
                // Found, and whatever the pool held beyond them continues the hit.
                assert!(a.lookup(&hashes).len() >= hits.len() + back.len(), "reloaded pages are found");
                // A name registered already is refused, changing nothing (a free block, so that
                // taking it evicts nothing).
                if a.free_blocks() == 0 {
                    return;
                }
                let again = a.alloc_blocks(1).unwrap();
                self.spill(a);
                let before = a.clone();
                assert!(a.cache_raw(&[(again[0], back[0], 0)]).is_err());
                assert_eq!(*a, before);
                a.release_blocks(&again).unwrap();
            }
            Op::Release(r) => {
                if self.reservations.is_empty() {
                    return;
                }
                let r = self.reservations.remove(r % self.reservations.len());
                a.release_blocks(&r.raw).unwrap();
                a.unpin(&r.pinned).unwrap();
            }
        }
    }

    /// Every registered block holds the tokens its hash names, and every held block's record
    /// matches what its holder expects.
    fn check(&self, a: &BlockAllocator) {
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_eq!(s.free + s.cached + s.used, s.total);
        for b in 0..TOTAL as BlockId {
            if let Some(h) = a.block_hash(b) {
                assert_eq!(
                    self.content.get(&b),
                    Some(&Content::Full(h)),
                    "block {b} registered under a hash it does not hold"
                );
            }
        }
        for (&seq, tokens) in &self.seqs {
            let Some(tokens) = tokens else { continue };
            let hashes = block_hashes(root(), tokens, BS);
            for (i, b) in a.block_table(seq).unwrap().iter().enumerate() {
                if let Some(&h) = hashes.get(i) {
                    assert_eq!(
                        self.content.get(b),
                        Some(&Content::Full(h)),
                        "sequence {seq} block {i} ({b}) lost its K/V"
                    );
                }
            }
        }
        for r in &self.reservations {
            let hashes = block_hashes(root(), &r.tokens, BS);
            for (i, b) in r.pinned.iter().enumerate() {
                assert_eq!(
                    self.content.get(b),
                    Some(&Content::Full(hashes[i])),
                    "pinned block {b} lost its K/V"
                );
            }
        }
        let _ = self.held(a);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn caching_never_loses_or_leaks_a_block(ops in prop::collection::vec(op(), 1..80)) {
        let mut a = BlockAllocator::new(TOTAL, BS);
        a.set_caching(true);
        a.set_spilling(true);
        let mut w = World::default();
        for op in &ops {
            w.apply(&mut a, op);
            w.check(&a);
        }
        for r in std::mem::take(&mut w.reservations) {
            a.release_blocks(&r.raw).unwrap();
            a.unpin(&r.pinned).unwrap();
        }
        for s in std::mem::take(&mut w.seqs).into_keys() {
            a.free_sequence(s).unwrap();
        }
        a.check_invariants().unwrap();
        let s = a.stats();
        prop_assert_eq!(s.used, 0);
        prop_assert_eq!(s.free + s.cached, s.total);
        prop_assert_eq!(s.pinned, 0);
    }
}

/// A prompt's first page evicted while its second stays in the pool (and a tier holds both, the
/// second from an earlier eviction): reloading brings back only the first, and the whole prompt
/// is found again.
#[test]
fn reloading_skips_the_pages_the_pool_still_holds() {
    let mut a = BlockAllocator::new(TOTAL, BS);
    a.set_caching(true);
    a.set_spilling(true);
    let mut w = World::default();
    // Nine tokens: two full blocks the cache may reuse (the last token is always computed).
    let hashes = block_hashes(root(), &prompt(0, 1)[..2 * BS], BS);
    assert_eq!(hashes.len(), 2);
    w.apply(&mut a, &Op::Start(1, 0, 1));
    w.apply(&mut a, &Op::Free(1));
    // Pressure over the whole pool evicts both pages into the tier.
    w.apply(&mut a, &Op::Plain(2, TOTAL * BS));
    assert!(w.tier.contains(&hashes[0]) && w.tier.contains(&hashes[1]));
    w.apply(&mut a, &Op::Free(2));
    w.apply(&mut a, &Op::Reload(0, 1));
    assert_eq!(a.lookup(&hashes).len(), 2);
    // One block short of the pool: the older page (the first) is evicted, the second stays.
    w.apply(&mut a, &Op::Plain(3, (TOTAL - 1) * BS));
    assert!(a.lookup(&hashes).is_empty());
    assert!(a.lookup(&hashes[1..]).len() == 1, "the second page is still in the pool");
    w.apply(&mut a, &Op::Free(3));
    w.check(&a);
    w.apply(&mut a, &Op::Reload(0, 1));
    w.check(&a);
    assert_eq!(a.lookup(&hashes).len(), 2, "the first page reloaded; the second found where it was");
}

#[test]
fn a_shared_prefix_is_found_shared_and_evicted_under_pressure() {
    let mut a = BlockAllocator::new(6, BS);
    a.set_caching(true);
    let mut w = World::default();
    w.apply(&mut a, &Op::Start(1, 0, 3)); // 8 shared + 3 own tokens: 3 blocks, 2 full
    w.apply(&mut a, &Op::Start(2, 3, 2)); // same family, 12 shared + 2 own tokens: finds the 2 full blocks
    assert_eq!(a.block_table(2).unwrap()[..2], a.block_table(1).unwrap()[..2]);
    assert_eq!(a.shared_blocks(2), 2);
    w.check(&a);
    // Cancelling one of two sharers frees nothing the other uses.
    w.apply(&mut a, &Op::Free(1));
    assert_eq!(a.shared_blocks(2), 0);
    w.check(&a);
    w.apply(&mut a, &Op::Free(2));
    let s = a.stats();
    assert_eq!((s.used, s.cached), (0, 3), "the full blocks (two shared, one of sequence 2) stay cached");
    // Pressure takes the free blocks first, then evicts the cached ones, and counts it.
    a.add_sequence(9, 6 * BS).unwrap();
    assert_eq!(a.stats().evictions, 3);
    assert!(a.lookup(&block_hashes(root(), &prompt(0, 3), BS)).is_empty());
    a.free_sequence(9).unwrap();
    assert_eq!(a.stats().free, 6, "plain blocks are freed, not cached");
    a.check_invariants().unwrap();
}
