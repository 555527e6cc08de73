//! The KV block allocator: pure bookkeeping (no I/O, no async, no storage) of which block belongs
//! to whom.
//!
//! A block is *free*, *owned* or *cached*. Owners are sequences (through their block tables; forks
//! and shared prefixes share blocks, so a block may have several sequence holders), a *raw
//! reservation* (blocks a decode node reserves for an incoming transfer before the sequence
//! exists; a raw block has exactly one holder and is never in a table) or a *pin* (a reservation's
//! hold on cached prefix blocks it will adopt). The reference count of a block is its number of
//! holders.
//!
//! **Prefix cache** ([`BlockAllocator::set_caching`]). A full block of committed tokens can be
//! *registered* under its [`BlockHash`](super::prefix::BlockHash). When its last holder lets go, a
//! registered block is not freed but *cached*: unreferenced, its K/V intact, findable by hash
//! ([`BlockAllocator::lookup`]) until memory is needed. Allocation takes free blocks first (lowest
//! id), then evicts cached blocks least recently released first. Cached blocks are allocatable, so
//! [`BlockAllocator::available_blocks`] (free + cached) is what a new owner can count on.
//!
//! Invariants (checked by [`BlockAllocator::check_invariants`], which tests run after every
//! operation and nodes run at quiescent moments):
//! - `free + cached + owned == total`, and no block is in two of those states;
//! - a block's reference count equals the number of its holders, and an owned block has one;
//! - no block appears twice in one table, and a raw block is in no table;
//! - a sequence's table holds exactly `blocks_for(seq_len)` blocks;
//! - the hash index and the blocks' hashes agree; a free block has no hash, a cached one has one.
//!
//! Every operation is all-or-nothing: it validates everything first and, on error, leaves the
//! allocator exactly as it was. Allocation is deterministic: the lowest free block id first, then
//! the oldest cached block.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;

use super::prefix::BlockHash;
use super::KvError;
use tandem_model::window as groups;

/// Index of a block in the KV pool.
pub type BlockId = u32;

/// A table entry whose page was given back (a window group's page no later query reaches; see
/// [`super::groups`]).
pub const NO_PAGE: BlockId = BlockId::MAX;
/// Identifier of a sequence (request) in the allocator.
pub type SeqId = u64;

/// A copy the backend must perform before writing into a sequence's last block: the block was
/// shared (after a fork) and partially filled, so the sequence now owns a private copy `dst` of `src`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOnWrite {
    pub src: BlockId,
    pub dst: BlockId,
}

/// A snapshot of the allocator's occupancy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvStats {
    /// Blocks in the pool.
    pub total: usize,
    /// Blocks on the free list.
    pub free: usize,
    /// Blocks holding cached K/V that nobody holds (evictable): `free + cached + used == total`.
    pub cached: usize,
    /// Blocks with at least one holder.
    pub used: usize,
    /// Live sequences.
    pub sequences: usize,
    /// Blocks held by raw reservations.
    pub raw_reserved: usize,
    /// Holds of reservations on cached prefix blocks.
    pub pinned: usize,
    /// Cached blocks evicted to make room, since the allocator was created.
    pub evictions: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct SeqState {
    /// The flat table: `groups` pages per token block ([`super::groups`]); [`NO_PAGE`] where a
    /// window group gave its page back.
    blocks: Vec<BlockId>,
    len: usize,
    /// The first position any later pass of the sequence queries ([`BlockAllocator::slide`]):
    /// window groups hold no page of a block no query from here on reaches.
    from: usize,
}

impl SeqState {
    fn new(blocks: Vec<BlockId>, len: usize, from: usize) -> Self {
        Self { blocks, len, from }
    }

    /// The pages held (not the given-back entries).
    fn pages(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.blocks.iter().copied().filter(|&b| b != NO_PAGE)
    }
}

/// Reference-counted block allocator. See the module documentation for its invariants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockAllocator {
    block_size: usize,
    /// Window of each layer group (`None`: global); one entry without groups.
    windows: Vec<Option<usize>>,
    /// Free blocks; a set so that the lowest id is handed out first and duplicates are impossible.
    free: BTreeSet<BlockId>,
    /// Number of holders of each block (0 for a free block).
    refcount: Vec<u32>,
    /// Whether each block is held by a raw reservation.
    raw: Vec<bool>,
    raw_count: usize,
    seqs: BTreeMap<SeqId, SeqState>,
    /// Prefix caching is on: registered blocks are cached when released.
    caching: bool,
    /// The hash each registered block holds.
    hash_of: Vec<Option<BlockHash>>,
    /// Registered blocks by hash (the inverse of `hash_of`).
    by_hash: HashMap<BlockHash, BlockId>,
    /// Whether each registered page belongs to a layer group other than 0 (its name is not a
    /// prompt's block hash, so cache digests leave it out).
    other_group: Vec<bool>,
    /// Cached (registered, unreferenced) blocks by release tick: the first is evicted first.
    lru: BTreeMap<u64, BlockId>,
    /// The release tick of each cached block (0 when not cached).
    lru_tick: Vec<u64>,
    tick: u64,
    /// Holds of reservations on each block (counted in `refcount`).
    pins: Vec<u32>,
    pin_count: usize,
    evictions: u64,
    /// Evicted pages are recorded for the KV tiers ([`Self::set_spilling`]).
    spilling: bool,
    /// Pages evicted since the last [`Self::take_evicted`], with the names they held: their
    /// bytes are intact until the engine writes into them.
    evicted: Vec<(BlockId, BlockHash)>,
}

impl BlockAllocator {
    /// An allocator over `num_blocks` blocks of `block_size` tokens.
    ///
    /// # Panics
    /// If `block_size` is zero or `num_blocks` does not fit a [`BlockId`]; use [`Self::try_new`] for
    /// values that come from configuration.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        match Self::try_new(num_blocks, block_size) {
            Ok(a) => a,
            Err(e) => panic!("BlockAllocator::new: {e}"),
        }
    }

    /// Like [`Self::new`], returning an error for a zero block size or too many blocks.
    pub fn try_new(num_blocks: usize, block_size: usize) -> Result<Self, KvError> {
        if block_size == 0 {
            return Err(KvError::InvalidLayout("block size must be at least 1".into()));
        }
        if num_blocks > BlockId::MAX as usize {
            return Err(KvError::InvalidLayout(format!("{num_blocks} blocks do not fit a 32-bit block id")));
        }
        Ok(Self {
            block_size,
            windows: vec![None],
            free: (0..num_blocks as BlockId).collect(),
            refcount: vec![0; num_blocks],
            raw: vec![false; num_blocks],
            raw_count: 0,
            seqs: BTreeMap::new(),
            caching: false,
            hash_of: vec![None; num_blocks],
            other_group: vec![false; num_blocks],
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            lru_tick: vec![0; num_blocks],
            tick: 0,
            pins: vec![0; num_blocks],
            pin_count: 0,
            evictions: 0,
            spilling: false,
            evicted: Vec::new(),
        })
    }

    /// An allocator of `num_pages` pages for a pool with layer groups of these windows
    /// ([`super::groups`]): a sequence holds `windows.len()` pages per token block, and window
    /// groups give back the pages no later query reaches ([`Self::slide`]).
    pub fn with_windows(
        num_pages: usize,
        block_size: usize,
        windows: &[Option<usize>],
    ) -> Result<Self, KvError> {
        if windows.is_empty() || windows.contains(&Some(0)) {
            return Err(KvError::InvalidLayout(format!("layer groups with windows {windows:?}")));
        }
        let mut a = Self::try_new(num_pages, block_size)?;
        a.windows = windows.to_vec();
        Ok(a)
    }

    /// Window of each layer group (one entry, `None`, without groups).
    pub fn windows(&self) -> &[Option<usize>] {
        &self.windows
    }

    /// Pages per token block (the number of layer groups).
    pub fn groups(&self) -> usize {
        self.windows.len()
    }

    /// Turns prefix caching on or off. Off, registered blocks are freed when released (and
    /// turning it off drops every cached block).
    pub fn set_caching(&mut self, on: bool) {
        self.caching = on;
        if !on {
            while let Some((_, b)) = self.lru.pop_first() {
                self.uncache(b);
                self.free.insert(b);
            }
            let owned: Vec<BlockId> = self.by_hash.values().copied().collect();
            for b in owned {
                self.unregister(b);
            }
        }
    }

    /// Whether prefix caching is on.
    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks on the free list (not counting cached ones; see [`Self::available_blocks`]).
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Blocks a new owner can get now: free ones and cached ones (evicted on demand).
    pub fn available_blocks(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// Cached blocks nobody holds.
    pub fn cached_blocks(&self) -> usize {
        self.lru.len()
    }

    /// Blocks (pages) needed to hold `n_tokens` tokens when no window group has given any back:
    /// a new sequence's table, and an upper bound of any sequence's.
    pub fn blocks_for(&self, n_tokens: usize) -> usize {
        n_tokens.div_ceil(self.block_size) * self.groups()
    }

    /// Pages a sequence of `len` tokens holds once its later queries start at `from`.
    pub fn pages_held(&self, len: usize, from: usize) -> usize {
        groups::pages_held(&self.windows, len, from, self.block_size)
    }

    /// Pages a sequence of `n_tokens` tokens that moves between workers keeps for its token
    /// blocks `first..` ([`super::groups::kept_count`]): what a transfer of them moves and a
    /// reservation takes. Without groups, `blocks_for(n_tokens) - first`.
    pub fn kept_pages(&self, n_tokens: usize, first: usize) -> usize {
        groups::kept_count(&self.windows, n_tokens, first, self.block_size)
    }

    /// The token blocks that `pinned` leading kept pages of a sequence of `n_tokens` tokens
    /// cover, when they end at a token-block boundary.
    pub fn pinned_token_blocks(&self, pinned: usize, n_tokens: usize) -> Option<usize> {
        if pinned == 0 {
            return Some(0);
        }
        let mut blocks = groups::kept_entries(&self.windows, n_tokens, 0, self.block_size).map(|(i, _)| i);
        let last = blocks.nth(pinned - 1)?;
        // The next kept page must start another token block.
        (blocks.next() != Some(last)).then_some(last + 1)
    }

    /// The names of the kept pages of token blocks `..hashes.len()` of a sequence of `n_tokens`
    /// tokens that moved between workers, in table order, when `hashes` name those token blocks
    /// ([`group_hash`]).
    pub fn kept_hashes(&self, hashes: &[BlockHash], n_tokens: usize) -> Vec<BlockHash> {
        groups::kept_entries(&self.windows, n_tokens, 0, self.block_size)
            .take_while(|&(i, _)| i < hashes.len())
            .map(|(i, k)| group_hash(hashes[i], k))
            .collect()
    }

    /// Whether `seq` still holds, for its positions before `from`, every page a query at `from`
    /// reads: whether it can be truncated to `from` tokens and computed on from there (false for
    /// an unknown sequence). Window groups may have given back what lies before their window.
    pub fn holds_from(&self, seq: SeqId, from: usize) -> bool {
        let entries = from.div_ceil(self.block_size) * self.groups();
        self.seqs.get(&seq).is_some_and(|s| {
            s.blocks.iter().take(entries).enumerate().all(|(j, &b)| b != NO_PAGE || !self.keeps(j, from))
        })
    }

    /// Whether a flat table's entry `j` holds a page while later queries start at `from`: always
    /// for a global group, within the window's reach for a window group ([`super::groups::kept`]).
    fn keeps(&self, j: usize, from: usize) -> bool {
        let g = self.groups();
        groups::kept(self.windows[j % g], j / g, from, self.block_size)
    }

    /// Pages `seq` holds (its table less the pages window groups gave back).
    pub fn held(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.pages().count())
    }

    /// Whether a new sequence of `n_tokens` tokens would fit now.
    pub fn can_allocate(&self, n_tokens: usize) -> bool {
        self.blocks_for(n_tokens) <= self.available_blocks()
    }

    /// Creates sequence `seq` with `n_tokens` tokens and returns its block table. All-or-nothing.
    pub fn add_sequence(&mut self, seq: SeqId, n_tokens: usize) -> Result<&[BlockId], KvError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::SequenceExists { seq });
        }
        let needed = self.blocks_for(n_tokens);
        self.ensure_free(needed)?;
        let blocks = self.take_free(needed);
        let state = self.seqs.entry(seq).or_insert(SeqState::new(blocks, n_tokens, 0));
        Ok(&state.blocks)
    }

    /// Grows `seq` by `n_new` tokens. If a page of the sequence's last token block is shared
    /// with another sequence and partially filled, the new tokens would land in a page others
    /// read, so the sequence gets a private copy: each returned [`CopyOnWrite`] (at most one per
    /// layer group) tells the backend which page to copy where before writing. All-or-nothing on
    /// [`KvError::OutOfBlocks`].
    pub fn append(&mut self, seq: SeqId, n_new: usize) -> Result<Vec<CopyOnWrite>, KvError> {
        let (bs, g) = (self.block_size, self.groups());
        let state = self.seqs.get(&seq).ok_or(KvError::UnknownSequence { seq })?;
        if n_new == 0 {
            return Ok(Vec::new());
        }
        let new_len = state.len.checked_add(n_new).ok_or(KvError::InvalidLength {
            seq,
            requested: usize::MAX,
            current: state.len,
        })?;
        let have = state.blocks.len();
        let want = new_len.div_ceil(bs) * g;
        let cow_src: Vec<(usize, BlockId)> = if state.len % bs != 0 {
            let last = state.len / bs * g;
            (last..last + g)
                .map(|i| (i, state.blocks[i]))
                .filter(|&(_, b)| b != NO_PAGE && self.refcount[b as usize] > 1)
                .collect()
        } else {
            Vec::new()
        };
        let needed = (want - have) + cow_src.len();
        self.ensure_free(needed)?;

        let cows: Vec<(usize, CopyOnWrite)> = cow_src
            .into_iter()
            .map(|(i, src)| {
                let dst = self.take_free(1)[0];
                self.refcount[src as usize] -= 1;
                (i, CopyOnWrite { src, dst })
            })
            .collect();
        let extra = self.take_free(want - have);
        let state = self.seqs.get_mut(&seq).expect("checked above");
        for &(i, c) in &cows {
            state.blocks[i] = c.dst;
        }
        state.blocks.extend(extra);
        state.len = new_len;
        Ok(cows.into_iter().map(|(_, c)| c).collect())
    }

    /// Records that no later pass of `seq` queries a position before `from`, and gives back the
    /// pages of window groups that no query from `from` on reaches ([`super::groups::kept`]).
    /// Returns how many pages the sequence let go. A `from` at or before the recorded one
    /// changes nothing; one past the sequence's length is an error. Without window groups it
    /// only records `from`.
    pub fn slide(&mut self, seq: SeqId, from: usize) -> Result<usize, KvError> {
        let (bs, g) = (self.block_size, self.groups());
        let state = self.seqs.get_mut(&seq).ok_or(KvError::UnknownSequence { seq })?;
        if from > state.len {
            return Err(KvError::InvalidLength { seq, requested: from, current: state.len });
        }
        if from <= state.from {
            return Ok(0);
        }
        let mut released = Vec::new();
        let blocks = state.blocks.len() / g;
        for (k, &w) in self.windows.iter().enumerate() {
            let done = groups::dropped(w, state.from, bs).min(blocks);
            for i in done..groups::dropped(w, from, bs).min(blocks) {
                let b = std::mem::replace(&mut state.blocks[i * g + k], NO_PAGE);
                if b != NO_PAGE {
                    released.push(b);
                }
            }
        }
        state.from = from;
        for &b in &released {
            self.unref(b);
        }
        Ok(released.len())
    }

    /// Shrinks `seq` to `n_tokens` tokens (speculative rollback), releasing the blocks it no
    /// longer needs. A shared block is only returned to the free list when its last holder lets
    /// go. A sequence cannot shrink to where a query would read a page a window group gave back
    /// ([`Self::slide`]).
    pub fn truncate(&mut self, seq: SeqId, n_tokens: usize) -> Result<(), KvError> {
        let current = self.seqs.get(&seq).ok_or(KvError::UnknownSequence { seq })?.len;
        if n_tokens > current || !self.holds_from(seq, n_tokens) {
            return Err(KvError::InvalidLength { seq, requested: n_tokens, current });
        }
        let keep = n_tokens.div_ceil(self.block_size) * self.groups();
        let state = self.seqs.get_mut(&seq).expect("checked above");
        state.from = state.from.min(n_tokens);
        let dropped: Vec<BlockId> = state.blocks.drain(keep..).filter(|&b| b != NO_PAGE).collect();
        state.len = n_tokens;
        for b in dropped {
            self.unref(b);
        }
        Ok(())
    }

    /// Creates `child` sharing every block of `parent` (each shared block's count goes up by one).
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<(), KvError> {
        if self.seqs.contains_key(&child) {
            return Err(KvError::SequenceExists { seq: child });
        }
        let state = self.seqs.get(&parent).ok_or(KvError::UnknownSequence { seq: parent })?.clone();
        for b in state.pages() {
            self.refcount[b as usize] += 1;
        }
        self.seqs.insert(child, state);
        Ok(())
    }

    /// The leading blocks registered under `hashes`, in order, stopping at the first hash not
    /// found. Changes nothing (a hit is only held once [`Self::add_cached_sequence`] or
    /// [`Self::pin`] takes it).
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        if !self.caching {
            return Vec::new();
        }
        hashes.iter().map_while(|h| self.by_hash.get(h).copied()).collect()
    }

    /// The prefix-cache hit for a prompt whose leading blocks hash to `hashes`, as a flat table
    /// ([`super::groups`]): the most leading token blocks `h` such that every page a sequence
    /// needs there is registered, with [`NO_PAGE`] for the pages window groups need not hold.
    /// The sequence holds `len` tokens afterwards (`None`: `h` blocks' worth, a local prefix
    /// hit whose computation resumes at the end of the hit; `Some(n)`: a reservation's `n`,
    /// queried from [`super::groups::transfer_from`]`(n)`).
    /// Without layer groups it is [`Self::lookup`]. Changes nothing.
    pub fn lookup_table(&self, hashes: &[BlockHash], len: Option<usize>) -> Vec<BlockId> {
        if self.groups() == 1 && self.windows[0].is_none() {
            return self.lookup(hashes);
        }
        if !self.caching {
            return Vec::new();
        }
        let (bs, g) = (self.block_size, self.groups());
        let page = |i: usize, k: usize| self.by_hash.get(&group_hash(hashes[i], k)).copied();
        // Global groups need every leading page.
        let mut h = (0..hashes.len())
            .take_while(|&i| (0..g).all(|k| self.windows[k].is_some() || page(i, k).is_some()))
            .count();
        let from_of = |h: usize| len.map_or(h * bs, groups::transfer_from);
        // Window groups need the pages their window reaches from the hit's end: only the last
        // few blocks, checked for each shorter hit until one has them all.
        let windowed: Vec<(usize, Option<usize>)> =
            self.windows.iter().copied().enumerate().filter(|(_, w)| w.is_some()).collect();
        loop {
            let from = from_of(h);
            let complete = windowed
                .iter()
                .all(|&(k, w)| (groups::dropped(w, from, bs).min(h)..h).all(|i| page(i, k).is_some()));
            if complete || h == 0 {
                break;
            }
            h -= 1;
        }
        let from = from_of(h);
        (0..h * g).map(|j| if self.keeps(j, from) { page(j / g, j % g).unwrap() } else { NO_PAGE }).collect()
    }

    /// How many of `blocks` nobody holds now (cached): what holding them costs in
    /// [`Self::available_blocks`].
    pub fn unreferenced(&self, blocks: &[BlockId]) -> usize {
        let distinct: BTreeSet<BlockId> = blocks.iter().copied().collect();
        distinct
            .into_iter()
            .filter(|&b| (b as usize) < self.refcount.len() && self.refcount[b as usize] == 0)
            .count()
    }

    /// Creates sequence `seq` whose first `prefix.len()` blocks are the registered blocks
    /// `prefix` (a prefix-cache hit, from [`Self::lookup`]), holding `prefix.len() * block_size`
    /// tokens; it grows with [`Self::append`] like any sequence. All-or-nothing.
    ///
    /// With layer groups `prefix` is a flat table from [`Self::lookup_table`] (its length a
    /// multiple of the groups, [`NO_PAGE`] exactly where window groups need no page).
    pub fn add_cached_sequence(&mut self, seq: SeqId, prefix: &[BlockId]) -> Result<(), KvError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::SequenceExists { seq });
        }
        let (bs, g) = (self.block_size, self.groups());
        let len = prefix.len() / g * bs;
        self.check_table_shape(seq, prefix, len, len)?;
        let pages: Vec<BlockId> = prefix.iter().copied().filter(|&b| b != NO_PAGE).collect();
        self.check_registered(&pages)?;
        for &b in &pages {
            self.hold(b);
        }
        self.seqs.insert(seq, SeqState::new(prefix.to_vec(), len, len));
        Ok(())
    }

    /// Checks that `table` is a flat table for `len` tokens whose later queries start at `from`:
    /// `groups` entries per token block, [`NO_PAGE`] exactly where [`super::groups::kept`] says no.
    fn check_table_shape(
        &self,
        seq: SeqId,
        table: &[BlockId],
        len: usize,
        from: usize,
    ) -> Result<(), KvError> {
        let expected = self.blocks_for(len);
        if table.len() != expected {
            return Err(KvError::BlockCountMismatch { seq, given: table.len(), n_tokens: len, expected });
        }
        for (j, &b) in table.iter().enumerate() {
            if (b == NO_PAGE) == self.keeps(j, from) {
                return Err(KvError::ForeignBlock {
                    block: b,
                    why: "a page where a window group holds none, or none where it needs one",
                });
            }
        }
        Ok(())
    }

    /// Registers block `index` of `seq`'s table under `hash` (its tokens are committed and the
    /// block is full). Returns false, changing nothing, when another block already holds that
    /// hash (the same tokens computed twice: the other copy stays the cached one) or when caching
    /// is off. Registering a block again under the hash it has is a no-op that returns true.
    pub fn register(&mut self, seq: SeqId, index: usize, hash: BlockHash) -> Result<bool, KvError> {
        let state = self.seqs.get(&seq).ok_or(KvError::UnknownSequence { seq })?;
        if (index + 1) * self.block_size > state.len {
            return Err(KvError::InvalidLength {
                seq,
                requested: (index + 1) * self.block_size,
                current: state.len,
            });
        }
        if !self.caching {
            return Ok(false);
        }
        let g = self.groups();
        let pages: Vec<BlockId> = state.blocks[index * g..(index + 1) * g].to_vec();
        let mut first = false;
        for (k, b) in pages.into_iter().enumerate() {
            if b == NO_PAGE {
                continue;
            }
            let hash = group_hash(hash, k);
            let done = match (self.hash_of[b as usize], self.by_hash.get(&hash)) {
                (Some(h), _) => h == hash,
                (None, Some(_)) => false,
                (None, None) => {
                    self.hash_of[b as usize] = Some(hash);
                    self.other_group[b as usize] = k > 0;
                    self.by_hash.insert(hash, b);
                    true
                }
            };
            if k == 0 {
                first = done;
            }
        }
        Ok(first)
    }

    /// The hash a block is registered under.
    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.hash_of.get(block as usize).copied().flatten()
    }

    /// Every registered block's hash: those in use first (by block id), then the cached ones,
    /// most recently released first. At most `limit`.
    pub fn registered_hashes(&self, limit: usize) -> Vec<BlockHash> {
        // Only group 0's pages are named by the prompt's block hashes themselves (`group_hash`).
        let in_use = self
            .hash_of
            .iter()
            .enumerate()
            .filter(|&(b, h)| h.is_some() && self.refcount[b] > 0 && !self.other_group[b])
            .filter_map(|(_, h)| *h);
        let cached = self
            .lru
            .values()
            .rev()
            .filter(|&&b| !self.other_group[b as usize])
            .filter_map(|&b| self.hash_of[b as usize]);
        in_use.chain(cached).take(limit).collect()
    }

    /// Records every page eviction takes from now on ([`Self::take_evicted`]), for the KV tiers
    /// to keep their contents. Off (the default), nothing is recorded.
    pub fn set_spilling(&mut self, on: bool) {
        self.spilling = on;
        if !on {
            self.evicted.clear();
        }
    }

    /// The pages evicted since the last call, with the names they held, oldest first. Their
    /// contents are intact until the engine next writes into the pool, so it takes them before
    /// every write: a pass, a copy-on-write, or handing raw blocks to a transfer.
    pub fn take_evicted(&mut self) -> Vec<(BlockId, BlockHash)> {
        std::mem::take(&mut self.evicted)
    }

    /// Pages evicted and not yet taken ([`Self::take_evicted`]).
    pub fn pending_evictions(&self) -> usize {
        self.evicted.len()
    }

    /// Every registered page with its name: held ones (by id), then cached ones, most recently
    /// released first.
    pub fn named_pages(&self) -> Vec<(BlockId, BlockHash)> {
        let held = (0..self.total_blocks() as BlockId).filter(|&b| self.refcount[b as usize] > 0);
        held.chain(self.lru.values().rev().copied())
            .filter_map(|b| self.hash_of[b as usize].map(|h| (b, h)))
            .collect()
    }

    /// Whether a page is registered under `name` (held or cached).
    pub fn holds_name(&self, name: BlockHash) -> bool {
        self.caching && self.by_hash.contains_key(&name)
    }

    /// Turns raw blocks, just written with the K/V of the pages they are named after (reloaded
    /// from a KV tier), into cached pages: registered under their names (`group` is the page's
    /// layer group, [`group_hash`]), held by nobody, most recently released. A later lookup finds
    /// them as if the pool had never evicted them. All-or-nothing: every block must be a distinct
    /// raw block and every name unregistered; with caching off it changes nothing and fails.
    pub fn cache_raw(&mut self, pages: &[(BlockId, BlockHash, usize)]) -> Result<(), KvError> {
        if !self.caching {
            return Err(KvError::InvalidLayout("pages reloaded into a pool without a prefix cache".into()));
        }
        let blocks: Vec<BlockId> = pages.iter().map(|p| p.0).collect();
        self.check_raw(&blocks)?;
        let mut names = BTreeSet::new();
        for &(b, name, group) in pages {
            if self.by_hash.contains_key(&name) || !names.insert(name) || group >= self.groups() {
                return Err(KvError::ForeignBlock { block: b, why: "its name is registered already" });
            }
        }
        for &(b, name, group) in pages {
            self.raw[b as usize] = false;
            self.refcount[b as usize] = 0;
            self.hash_of[b as usize] = Some(name);
            self.other_group[b as usize] = group > 0;
            self.by_hash.insert(name, b);
            self.tick += 1;
            self.lru.insert(self.tick, b);
            self.lru_tick[b as usize] = self.tick;
        }
        self.raw_count -= pages.len();
        Ok(())
    }

    /// Moves the cached pages among `blocks` to the most recently released end of the eviction
    /// order (held ones are not evictable and stay as they are), so that reloading the rest of
    /// a prefix never evicts the part the pool still has.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            let i = b as usize;
            if i < self.lru_tick.len() && self.lru_tick[i] != 0 {
                self.lru.remove(&self.lru_tick[i]);
                self.tick += 1;
                self.lru.insert(self.tick, b);
                self.lru_tick[i] = self.tick;
            }
        }
    }

    /// Holds registered blocks for a reservation that will adopt them (see [`Self::adopt`]).
    /// All-or-nothing.
    pub fn pin(&mut self, blocks: &[BlockId]) -> Result<(), KvError> {
        self.check_registered(blocks)?;
        for &b in blocks {
            self.hold(b);
            self.pins[b as usize] += 1;
        }
        self.pin_count += blocks.len();
        Ok(())
    }

    /// Lets go of pins taken with [`Self::pin`]. All-or-nothing.
    pub fn unpin(&mut self, blocks: &[BlockId]) -> Result<(), KvError> {
        self.check_pins(blocks)?;
        for &b in blocks {
            self.pins[b as usize] -= 1;
            self.unref(b);
        }
        self.pin_count -= blocks.len();
        Ok(())
    }

    /// Removes `seq`, releasing its hold on every block in its table.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<(), KvError> {
        let state = self.seqs.remove(&seq).ok_or(KvError::UnknownSequence { seq })?;
        for b in state.pages() {
            self.unref(b);
        }
        Ok(())
    }

    /// The block table of `seq`.
    pub fn block_table(&self, seq: SeqId) -> Option<&[BlockId]> {
        self.seqs.get(&seq).map(|s| s.blocks.as_slice())
    }

    /// How many of `seq`'s blocks others hold too (a shared cached prefix, a fork): releasing
    /// the sequence does not make those available.
    pub fn shared_blocks(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.pages().filter(|&b| self.refcount[b as usize] > 1).count())
    }

    /// The number of tokens of `seq`.
    pub fn seq_len(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).map(|s| s.len)
    }

    /// The slot (`block * block_size + offset`) of token `pos` of `seq` in group 0's page, if the
    /// sequence holds it.
    pub fn slot(&self, seq: SeqId, pos: usize) -> Option<usize> {
        let s = self.seqs.get(&seq)?;
        if pos >= s.len {
            return None;
        }
        let b = s.blocks[pos / self.block_size * self.groups()];
        (b != NO_PAGE).then(|| b as usize * self.block_size + pos % self.block_size)
    }

    /// Live sequences, in increasing id order.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Reserves `n` blocks not tied to any sequence (a decode node's reservation for an incoming
    /// transfer). They stay owned until [`Self::release_blocks`] or [`Self::adopt`].
    pub fn alloc_blocks(&mut self, n: usize) -> Result<Vec<BlockId>, KvError> {
        self.ensure_free(n)?;
        let blocks = self.take_free(n);
        for &b in &blocks {
            self.raw[b as usize] = true;
        }
        self.raw_count += n;
        Ok(blocks)
    }

    /// Returns raw-reserved blocks to the free list. Every id is validated before anything changes:
    /// an id out of range or held by a sequence is [`KvError::ForeignBlock`]; a free id, or an id
    /// listed twice, is [`KvError::DoubleFree`].
    pub fn release_blocks(&mut self, blocks: &[BlockId]) -> Result<(), KvError> {
        self.check_raw(blocks)?;
        for &b in blocks {
            self.raw[b as usize] = false;
            self.refcount[b as usize] = 0;
            self.free.insert(b);
        }
        self.raw_count -= blocks.len();
        Ok(())
    }

    /// Turns a reservation into sequence `seq` of `n_tokens` tokens whose table is `pinned`
    /// (prefix blocks the reservation pinned, see [`Self::pin`]) followed by `raw` (its raw
    /// blocks): the decode node's step once a transfer into the raw blocks has completed. The
    /// reservation's holds become the sequence's, so no count changes.
    ///
    /// With layer groups both lists hold the pages a sequence of `n_tokens` tokens that moved
    /// between workers keeps ([`super::groups::kept_pages`] order: token block by token block,
    /// group by group), the pinned ones for the leading token blocks; the table gets [`NO_PAGE`]
    /// for the rest, and later queries start at its last token
    /// ([`super::groups::transfer_from`]).
    pub fn adopt(
        &mut self,
        seq: SeqId,
        pinned: &[BlockId],
        raw: &[BlockId],
        n_tokens: usize,
    ) -> Result<(), KvError> {
        if self.seqs.contains_key(&seq) {
            return Err(KvError::SequenceExists { seq });
        }
        let bs = self.block_size;
        let expected = self.kept_pages(n_tokens, 0);
        let given = pinned.len() + raw.len();
        let blocks = n_tokens.div_ceil(bs);
        // The pinned pages must end at a token-block boundary.
        if given != expected || self.pinned_token_blocks(pinned.len(), n_tokens).is_none() {
            return Err(KvError::BlockCountMismatch { seq, given, n_tokens, expected });
        }
        self.check_raw(raw)?;
        self.check_pins(pinned)?;
        if let Some(&b) = pinned.iter().find(|b| raw.contains(b)) {
            return Err(KvError::ForeignBlock { block: b, why: "both pinned and raw" });
        }
        let mut distinct = BTreeSet::new();
        if let Some(&b) = pinned.iter().find(|&&b| !distinct.insert(b)) {
            return Err(KvError::ForeignBlock { block: b, why: "pinned twice in one table" });
        }
        for &b in raw {
            self.raw[b as usize] = false;
        }
        self.raw_count -= raw.len();
        for &b in pinned {
            self.pins[b as usize] -= 1;
        }
        self.pin_count -= pinned.len();
        let mut pages = pinned.iter().chain(raw).copied();
        let from = groups::transfer_from(n_tokens);
        let table: Vec<BlockId> = (0..blocks * self.groups())
            .map(|j| if self.keeps(j, from) { pages.next().expect("counted above") } else { NO_PAGE })
            .collect();
        self.seqs.insert(seq, SeqState::new(table, n_tokens, from));
        Ok(())
    }

    /// Whether `block` is held by a raw reservation (false out of range).
    pub fn is_raw(&self, block: BlockId) -> bool {
        self.raw.get(block as usize).copied().unwrap_or(false)
    }

    /// How many reservation pins `block` has (0 out of range).
    pub fn pins(&self, block: BlockId) -> u32 {
        self.pins.get(block as usize).copied().unwrap_or(0)
    }

    /// A snapshot of occupancy.
    pub fn stats(&self) -> KvStats {
        KvStats {
            total: self.total_blocks(),
            free: self.free.len(),
            cached: self.lru.len(),
            used: self.total_blocks() - self.free.len() - self.lru.len(),
            sequences: self.seqs.len(),
            raw_reserved: self.raw_count,
            pinned: self.pin_count,
            evictions: self.evictions,
        }
    }

    /// Checks every invariant listed in the module documentation; reports all violations found.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let total = self.total_blocks();
        let mut v = Vec::new();
        let mut holders = vec![0u32; total];

        for (&seq, s) in &self.seqs {
            let expected = self.blocks_for(s.len);
            if s.blocks.len() != expected {
                v.push(Violation::TableLength { seq, blocks: s.blocks.len(), expected });
            }
            for (j, &b) in s.blocks.iter().enumerate() {
                if s.from > s.len || (b == NO_PAGE) == self.keeps(j, s.from) {
                    v.push(Violation::WindowPages { seq, index: j, from: s.from });
                }
            }
            let mut seen = BTreeSet::new();
            for b in s.pages() {
                if b as usize >= total {
                    v.push(Violation::OutOfRange { block: b });
                    continue;
                }
                if !seen.insert(b) {
                    v.push(Violation::DuplicateInTable { seq, block: b });
                }
                holders[b as usize] += 1;
                if self.raw[b as usize] {
                    v.push(Violation::RawInTable { seq, block: b });
                }
            }
        }
        let mut raw_count = 0;
        for (b, &is_raw) in self.raw.iter().enumerate() {
            if is_raw {
                holders[b] += 1;
                raw_count += 1;
            }
        }
        if raw_count != self.raw_count {
            v.push(Violation::RawCount { counted: raw_count, recorded: self.raw_count });
        }
        let mut pin_count = 0;
        for (b, &p) in self.pins.iter().enumerate() {
            holders[b] += p;
            pin_count += p as usize;
        }
        if pin_count != self.pin_count {
            v.push(Violation::PinCount { counted: pin_count, recorded: self.pin_count });
        }
        for (&h, &b) in &self.by_hash {
            if self.hash_of.get(b as usize).copied().flatten() != Some(h) {
                v.push(Violation::HashIndex { block: b });
            }
        }
        let registered = self.hash_of.iter().filter(|h| h.is_some()).count();
        if registered != self.by_hash.len() {
            v.push(Violation::HashCount { blocks: registered, index: self.by_hash.len() });
        }
        let mut lru_seen = BTreeSet::new();
        for (&tick, &b) in &self.lru {
            if (b as usize) >= total || self.lru_tick[b as usize] != tick || !lru_seen.insert(b) {
                v.push(Violation::CachedState {
                    block: b,
                    why: "listed in the cache twice or under the wrong tick",
                });
            } else if self.hash_of[b as usize].is_none() {
                v.push(Violation::CachedState { block: b, why: "cached without a hash" });
            }
        }
        for &b in &self.free {
            if b as usize >= total {
                v.push(Violation::OutOfRange { block: b });
            }
        }
        let mut owned = 0;
        for (b, (&rc, &h)) in self.refcount.iter().zip(&holders).enumerate() {
            let id = b as BlockId;
            let is_free = self.free.contains(&id);
            let is_cached = lru_seen.contains(&id);
            if is_free && self.hash_of[b].is_some() {
                v.push(Violation::CachedState { block: id, why: "free but still registered" });
            }
            if is_cached && (is_free || h > 0 || rc > 0) {
                v.push(Violation::CachedState { block: id, why: "cached but also free or held" });
            } else if is_cached {
                // Cached: neither free nor owned.
            } else if is_free && (h > 0 || rc > 0) {
                v.push(Violation::FreeAndOwned { block: id, holders: h, refcount: rc });
            } else if !is_free {
                owned += 1;
                if h == 0 {
                    v.push(Violation::Orphan { block: id, refcount: rc });
                } else if rc != h {
                    v.push(Violation::RefcountMismatch { block: id, refcount: rc, holders: h });
                }
            }
        }
        if self.free.len() + lru_seen.len() + owned != total {
            v.push(Violation::CountMismatch { free: self.free.len(), cached: lru_seen.len(), owned, total });
        }
        if v.is_empty() {
            Ok(())
        } else {
            Err(InvariantViolation { violations: v })
        }
    }

    fn ensure_free(&self, needed: usize) -> Result<(), KvError> {
        if needed > self.available_blocks() {
            return Err(KvError::OutOfBlocks { needed, free: self.available_blocks() });
        }
        Ok(())
    }

    /// Takes `n` blocks with a count of one: the lowest free ones, then the cached ones released
    /// longest ago (evicting them from the cache). Callers check `ensure_free` first.
    fn take_free(&mut self, n: usize) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = match self.free.pop_first() {
                Some(b) => b,
                None => {
                    let (_, b) = self.lru.pop_first().expect("ensure_free checked the count");
                    self.uncache(b);
                    if self.spilling {
                        let name = self.hash_of[b as usize].expect("a cached block has a name");
                        self.evicted.push((b, name));
                    }
                    self.unregister(b);
                    self.evictions += 1;
                    b
                }
            };
            self.refcount[b as usize] = 1;
            out.push(b);
        }
        out
    }

    fn unref(&mut self, b: BlockId) {
        let rc = &mut self.refcount[b as usize];
        *rc -= 1;
        if *rc == 0 {
            if self.caching && self.hash_of[b as usize].is_some() {
                self.tick += 1;
                self.lru.insert(self.tick, b);
                self.lru_tick[b as usize] = self.tick;
            } else {
                self.unregister(b);
                self.free.insert(b);
            }
        }
    }

    /// Adds a holder to `b`, taking it out of the cache if nobody held it.
    fn hold(&mut self, b: BlockId) {
        if self.refcount[b as usize] == 0 {
            self.uncache(b);
        }
        self.refcount[b as usize] += 1;
    }

    /// Takes a cached block off the eviction list (its hash stays).
    fn uncache(&mut self, b: BlockId) {
        let tick = std::mem::take(&mut self.lru_tick[b as usize]);
        if tick != 0 {
            self.lru.remove(&tick);
        }
    }

    /// Forgets a block's hash.
    fn unregister(&mut self, b: BlockId) {
        if let Some(h) = self.hash_of[b as usize].take() {
            self.by_hash.remove(&h);
        }
        self.other_group[b as usize] = false;
    }

    /// Validates that every id in `blocks` is a registered block (held or cached).
    fn check_registered(&self, blocks: &[BlockId]) -> Result<(), KvError> {
        for &b in blocks {
            if b as usize >= self.total_blocks() {
                return Err(KvError::ForeignBlock { block: b, why: "id out of range" });
            }
            if self.hash_of[b as usize].is_none() {
                return Err(KvError::ForeignBlock { block: b, why: "not a cached block" });
            }
        }
        Ok(())
    }

    /// Validates that `blocks` can be unpinned: each holds at least as many pins as it appears.
    fn check_pins(&self, blocks: &[BlockId]) -> Result<(), KvError> {
        let mut want: BTreeMap<BlockId, u32> = BTreeMap::new();
        for &b in blocks {
            if b as usize >= self.total_blocks() {
                return Err(KvError::ForeignBlock { block: b, why: "id out of range" });
            }
            *want.entry(b).or_default() += 1;
        }
        for (b, n) in want {
            if self.pins[b as usize] < n {
                return Err(KvError::ForeignBlock { block: b, why: "not pinned" });
            }
        }
        Ok(())
    }

    /// Validates that every id in `blocks` is a distinct raw reservation of this allocator.
    fn check_raw(&self, blocks: &[BlockId]) -> Result<(), KvError> {
        let mut seen = BTreeSet::new();
        for &b in blocks {
            if b as usize >= self.total_blocks() {
                return Err(KvError::ForeignBlock { block: b, why: "id out of range" });
            }
            if self.free.contains(&b) || self.refcount[b as usize] == 0 || !seen.insert(b) {
                return Err(KvError::DoubleFree { block: b });
            }
            if !self.raw[b as usize] {
                return Err(KvError::ForeignBlock { block: b, why: "held by a sequence" });
            }
        }
        Ok(())
    }
}

/// The name of a token block's page of layer group `group` in the prefix cache: group 0's is
/// the block's hash itself, so a pool without groups names blocks as always.
pub fn group_hash(hash: BlockHash, group: usize) -> BlockHash {
    if group == 0 {
        return hash;
    }
    let k = group as u128;
    BlockHash(hash.0.rotate_left(29) ^ k.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
}

/// One broken allocator invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// `free + cached + owned != total`.
    CountMismatch { free: usize, cached: usize, owned: usize, total: usize },
    /// A block on the free list has holders or a non-zero count (overlap).
    FreeAndOwned { block: BlockId, holders: u32, refcount: u32 },
    /// An owned block no live sequence or reservation holds (leak).
    Orphan { block: BlockId, refcount: u32 },
    /// A block's count differs from its number of holders.
    RefcountMismatch { block: BlockId, refcount: u32, holders: u32 },
    /// A block id beyond the pool appears in a table or the free list.
    OutOfRange { block: BlockId },
    /// A sequence holds the same block twice.
    DuplicateInTable { seq: SeqId, block: BlockId },
    /// A raw-reserved block also sits in a sequence's table.
    RawInTable { seq: SeqId, block: BlockId },
    /// A table's length is not `blocks_for(seq_len)`.
    TableLength { seq: SeqId, blocks: usize, expected: usize },
    /// A window group holds a page no later query reaches, or lacks one a query reads (or the
    /// recorded first query position is past the sequence's length).
    WindowPages { seq: SeqId, index: usize, from: usize },
    /// The recorded number of raw blocks differs from the flags.
    RawCount { counted: usize, recorded: usize },
    /// The recorded number of pins differs from the per-block counts.
    PinCount { counted: usize, recorded: usize },
    /// The hash index names a block that does not hold that hash.
    HashIndex { block: BlockId },
    /// Registered blocks and index entries differ in number.
    HashCount { blocks: usize, index: usize },
    /// A block's cache state is inconsistent.
    CachedState { block: BlockId, why: &'static str },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::CountMismatch { free, cached, owned, total } => {
                write!(f, "free {free} + cached {cached} + owned {owned} != total {total}")
            }
            Violation::FreeAndOwned { block, holders, refcount } => {
                write!(f, "block {block} is free but has {holders} holders (refcount {refcount})")
            }
            Violation::Orphan { block, refcount } => {
                write!(f, "block {block} is owned (refcount {refcount}) but has no holder")
            }
            Violation::RefcountMismatch { block, refcount, holders } => {
                write!(f, "block {block} has refcount {refcount} but {holders} holders")
            }
            Violation::OutOfRange { block } => write!(f, "block {block} is out of range"),
            Violation::DuplicateInTable { seq, block } => {
                write!(f, "sequence {seq} holds block {block} twice")
            }
            Violation::RawInTable { seq, block } => {
                write!(f, "raw-reserved block {block} is in the table of sequence {seq}")
            }
            Violation::TableLength { seq, blocks, expected } => {
                write!(f, "sequence {seq} has {blocks} blocks, {expected} expected for its length")
            }
            Violation::WindowPages { seq, index, from } => write!(
                f,
                "sequence {seq}: table entry {index} disagrees with the window (queries from position {from})"
            ),
            Violation::RawCount { counted, recorded } => {
                write!(f, "{counted} raw blocks flagged but {recorded} recorded")
            }
            Violation::PinCount { counted, recorded } => {
                write!(f, "{counted} pins counted but {recorded} recorded")
            }
            Violation::HashIndex { block } => {
                write!(f, "the hash index names block {block}, which does not hold that hash")
            }
            Violation::HashCount { blocks, index } => {
                write!(f, "{blocks} blocks registered but {index} hashes indexed")
            }
            Violation::CachedState { block, why } => write!(f, "block {block}: {why}"),
        }
    }
}

/// Every invariant violation found by one [`BlockAllocator::check_invariants`] run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvariantViolation {
    pub violations: Vec<Violation>,
}

impl fmt::Display for InvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KV allocator invariants violated: ")?;
        for (i, v) in self.violations.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "{v}")?;
        }
        Ok(())
    }
}

impl std::error::Error for InvariantViolation {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_ids_first_and_free_returns_all() {
        let mut a = BlockAllocator::new(8, 4);
        assert_eq!(a.add_sequence(1, 5).unwrap(), &[0, 1]);
        assert_eq!(a.add_sequence(2, 4).unwrap(), &[2]);
        a.free_sequence(1).unwrap();
        assert_eq!(a.add_sequence(3, 1).unwrap(), &[0]);
        a.check_invariants().unwrap();
        a.free_sequence(2).unwrap();
        a.free_sequence(3).unwrap();
        assert_eq!(a.free_blocks(), a.total_blocks());
        a.check_invariants().unwrap();
    }

    #[test]
    fn out_of_blocks_changes_nothing() {
        let mut a = BlockAllocator::new(3, 2);
        a.add_sequence(1, 4).unwrap();
        let before = a.clone();
        assert_eq!(a.add_sequence(2, 3), Err(KvError::OutOfBlocks { needed: 2, free: 1 }));
        assert_eq!(a.append(1, 3), Err(KvError::OutOfBlocks { needed: 2, free: 1 }));
        assert_eq!(a, before);
    }

    #[test]
    fn fork_then_append_copies_partial_shared_block() {
        let mut a = BlockAllocator::new(8, 4);
        a.add_sequence(1, 6).unwrap(); // blocks 0, 1 (block 1 half full)
        a.fork(1, 2).unwrap();
        let cow = a.append(2, 1).unwrap().pop().expect("shared partial block must be copied");
        assert_eq!(cow.src, 1);
        assert_ne!(cow.dst, 1);
        assert_eq!(a.block_table(2).unwrap(), &[0, cow.dst]);
        assert_eq!(a.block_table(1).unwrap(), &[0, 1]);
        // Parent's block 1 is no longer shared: appending to it needs no copy.
        assert_eq!(a.append(1, 1).unwrap(), vec![]);
        a.check_invariants().unwrap();
    }

    #[test]
    fn release_validates_everything_first() {
        let mut a = BlockAllocator::new(6, 4);
        let raw = a.alloc_blocks(2).unwrap();
        a.add_sequence(9, 4).unwrap();
        let seq_block = a.block_table(9).unwrap()[0];
        let before = a.clone();
        assert!(matches!(a.release_blocks(&[raw[0], 100]), Err(KvError::ForeignBlock { block: 100, .. })));
        assert!(matches!(a.release_blocks(&[raw[0], seq_block]), Err(KvError::ForeignBlock { .. })));
        assert_eq!(a.release_blocks(&[raw[0], raw[0]]), Err(KvError::DoubleFree { block: raw[0] }));
        assert_eq!(a, before);
        a.release_blocks(&raw).unwrap();
        assert_eq!(a.release_blocks(&raw[..1]), Err(KvError::DoubleFree { block: raw[0] }));
        a.check_invariants().unwrap();
    }

    #[test]
    fn adopt_moves_raw_blocks_into_a_sequence() {
        let mut a = BlockAllocator::new(6, 4);
        let raw = a.alloc_blocks(2).unwrap();
        assert!(matches!(a.adopt(5, &[], &raw, 9), Err(KvError::BlockCountMismatch { .. })));
        a.adopt(5, &[], &raw, 7).unwrap();
        assert_eq!(a.stats().raw_reserved, 0);
        assert_eq!(a.block_table(5).unwrap(), raw.as_slice());
        assert_eq!(a.slot(5, 5), Some(raw[1] as usize * 4 + 1));
        a.check_invariants().unwrap();
    }

    #[test]
    fn checker_catches_a_leak() {
        let mut a = BlockAllocator::new(4, 4);
        a.add_sequence(1, 4).unwrap();
        // Simulate a producer bug: the table is dropped without releasing its block.
        a.seqs.remove(&1);
        let err = a.check_invariants().unwrap_err();
        assert!(err.violations.iter().any(|v| matches!(v, Violation::Orphan { block: 0, .. })));
    }
}
