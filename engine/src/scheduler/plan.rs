//! The scheduler's decision for one step, as a pure function: a [`StepState`] (plain numbers
//! about the sequences and the KV pool) in, a [`Plan`] out. Nothing here touches a backend, a
//! tokenizer, a sampler or the block allocator; the engine applies the plan afterwards.
//!
//! The rules, in the order [`plan`] applies them:
//! 1. **Decode first.** Every running sequence, oldest first, gets one token, until the token
//!    budget is spent. When its next token needs a block and none is free, the newest sequence
//!    holding blocks that is not in the batch yet is preempted (its blocks freed, its tokens to be
//!    recomputed from scratch) and the allocation retried; that may be the asking sequence
//!    itself. So an older sequence always makes progress at the expense of newer ones.
//! 2. **Then prefill, in queue order** (preempted sequences go to the front), within what is left
//!    of the budget and, when the step decodes, within [`StepState::prefill_limit`] more tokens
//!    (the inter-token latency budget, [`super::cost`]). A sequence is
//!    admitted with blocks for all its tokens at once, so a half-prefilled sequence never waits
//!    for blocks. Admission stops at the first sequence that does not fit (blocks, or
//!    `max_num_seqs`), so no prompt overtakes an older one, but sequences admitted earlier keep
//!    their chunks. A prompt longer than what is left of the budget runs in chunks.
//!    Admission never preempts anything.
//! 3. **Then speculation, with what is left** of both limits. A running sequence with draft tokens turns its
//!    decode entry into a verification entry (`[newest, d1..dk]`, blocks for `k` more positions),
//!    oldest first, with as many of its drafts as the remaining token budget allows and only with
//!    blocks that leave one free block per sequence in the batch. Never in a step that preempts:
//!    a pool short enough to preempt has no blocks to speculate with, and speculation never takes
//!    blocks another sequence needs.
//!
//! Invariants of every plan (the property tests below check them):
//! - the batch's tokens never exceed `max_batch_tokens`;
//! - with a `prefill_limit`, the tokens beyond one per decode entry never exceed it;
//! - applying the preemptions and allocations in plan order never needs more blocks than are
//!   free at that moment;
//! - preemptions only happen while decoding, and every preempted sequence is newer than every
//!   sequence that decodes;
//! - a sequence appears at most once in the batch, never with zero tokens;
//! - the batch is empty exactly when [`Plan::idle`] says why.
//!
//! Blocks held by reservations and by prefilled sequences waiting for release are simply not
//! free: the planner neither sees nor preempts them. Those owners only meet the scheduler in
//! [`check_reservation`], the rule that lets a new reservation take free blocks.
//! - verification entries only in a step without preemptions, only for running sequences with
//!   drafts, with at most their drafts, keeping one free block per batch entry.

use std::collections::{BTreeMap, VecDeque};

use crate::kv::SeqId;

/// One sequence as the planner sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqView {
    /// Identifier; a higher id is a newer sequence.
    pub id: SeqId,
    /// Tokens known (prompt, then generated ones).
    pub len: usize,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    /// Blocks the sequence holds (0: none, waiting for admission). A queued sequence holding
    /// fewer than its tokens need has not been admitted yet: it holds only the cached prefix
    /// blocks it found (see the prefix cache in [`super::Engine`]).
    pub blocks: usize,
    /// Of those, blocks other owners hold too (a shared cached prefix): preempting the sequence
    /// does not make them available.
    pub shared: usize,
    /// Draft tokens proposed for it this step (running sequences only; 0 without speculation).
    pub draft: usize,
}

/// What the planner needs to know about the engine before a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepState {
    /// Most tokens in one forward pass.
    pub max_batch_tokens: usize,
    /// Most tokens a step may compute besides one per decoding sequence (prompt chunks and draft
    /// tokens), when the step decodes: the inter-token latency budget of
    /// [`super::cost::StepCost::prefill_limit`]. `None`: only `max_batch_tokens` limits them.
    pub prefill_limit: Option<usize>,
    /// Most sequences holding blocks (and not held for release) at once.
    pub max_num_seqs: usize,
    /// Tokens per block (at least 1).
    pub block_size: usize,
    /// Window of each layer group of the pool (`[None]` without groups): a sequence holds one
    /// block (page) per group and token block, less those window groups gave back
    /// ([`crate::kv::groups`]). The engine slides every sequence to its computed length before
    /// it plans, so [`SeqView::blocks`] is what [`crate::kv::groups::pages_held`] says.
    pub windows: Vec<Option<usize>>,
    /// Blocks free in the pool.
    pub free_blocks: usize,
    /// Blocks in the pool.
    pub total_blocks: usize,
    /// Sequences whose every token but the newest is computed: they decode. Any order.
    pub running: Vec<SeqView>,
    /// Sequences with tokens left to compute (prompts, preempted sequences), in admission order.
    pub queued: Vec<SeqView>,
}

impl StepState {
    /// Blocks a sequence holds with `tokens` tokens once its later queries start at `from`.
    fn blocks_for(&self, tokens: usize, from: usize) -> usize {
        crate::kv::groups::pages_held(&self.windows, tokens, from, self.block_size)
    }
}

/// What a batch entry computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A chunk of tokens not computed yet: a prompt, or a preempted sequence's recomputation.
    Prefill,
    /// The one newest token of a running sequence.
    Decode,
    /// The newest token of a running sequence and `tokens - 1` draft tokens after it, computed in
    /// staged mode and verified; only the accepted prefix is committed.
    Verify,
}

/// One sequence's share of the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub seq: SeqId,
    pub kind: EntryKind,
    /// Position of the first token computed; the ones before it are in the cache.
    pub start: usize,
    /// Tokens computed this step (`start..start + tokens`), at least 1. For a verification entry,
    /// the newest token plus `tokens - 1` draft tokens.
    pub tokens: usize,
    /// Tokens the sequence's blocks must cover before the pass: the engine grows the sequence
    /// (or admits it) to this length, which the plan has already counted against free blocks.
    pub kv_len: usize,
    /// The entry reaches the sequence's newest token: the pass returns its logits and the engine
    /// samples a token.
    pub samples: bool,
}

impl Entry {
    /// Draft tokens verified by this entry (0 unless it is a verification entry).
    pub fn drafts(&self) -> usize {
        if self.kind == EntryKind::Verify {
            self.tokens - 1
        } else {
            0
        }
    }
}

/// A sequence losing its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preemption {
    pub seq: SeqId,
    /// Applied before the allocation of `batch[before]` (after the last one when it equals the
    /// batch length), which is when the plan counted its blocks as free again.
    pub before: usize,
}

/// Why a plan has an empty batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idle {
    /// No sequence is running or waiting.
    NoWork,
    /// Sequences wait, but blocks they need are held by reservations or held sequences: nothing
    /// can run until one is released.
    Stalled,
    /// Sequences wait and every block is free, yet nothing fits: an engine bug (every queued
    /// prompt fits an empty pool), never to be spun on silently.
    NoProgress,
}

/// The scheduler's decision for one step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The forward pass: decode entries (oldest sequence first), then prefill entries (queue
    /// order).
    pub batch: Vec<Entry>,
    /// Preemptions, in the order they are applied (newest victim first).
    pub preempted: Vec<Preemption>,
    /// Set exactly when the batch is empty.
    pub idle: Option<Idle>,
}

impl Plan {
    /// Tokens in the batch.
    pub fn tokens(&self) -> usize {
        self.batch.iter().map(|e| e.tokens).sum()
    }
}

/// The planner's running copy of one sequence.
struct Live {
    len: usize,
    computed: usize,
    blocks: usize,
    shared: usize,
    queued: bool,
    draft: usize,
}

/// Decides one step. See the module documentation for the rules and the invariants.
pub fn plan(state: &StepState) -> Plan {
    let budget = state.max_batch_tokens;
    let mut seqs: BTreeMap<SeqId, Live> = BTreeMap::new();
    for (v, queued) in state.running.iter().map(|v| (v, false)).chain(state.queued.iter().map(|v| (v, true)))
    {
        seqs.insert(
            v.id,
            Live {
                len: v.len,
                computed: v.computed,
                blocks: v.blocks,
                shared: v.shared,
                queued,
                draft: v.draft,
            },
        );
    }
    let mut queue: VecDeque<SeqId> = state.queued.iter().map(|v| v.id).collect();
    let mut free = state.free_blocks;
    let mut batch: Vec<Entry> = Vec::new();
    let mut preempted: Vec<Preemption> = Vec::new();
    let mut used = 0usize;

    // Blocks `seq` still needs to hold `kv_len` tokens.
    let need = |s: &Live, kv_len: usize| state.blocks_for(kv_len, s.computed).saturating_sub(s.blocks);

    let mut running: Vec<SeqId> = state.running.iter().map(|v| v.id).collect();
    running.sort_unstable();
    for id in running {
        if used >= budget {
            break;
        }
        if seqs[&id].blocks == 0 {
            continue; // preempted earlier in this step, or holding nothing to decode with
        }
        loop {
            let s = seqs.get_mut(&id).expect("running sequence is in the table");
            let n = need(s, s.len);
            if n <= free {
                free -= n;
                s.blocks += n;
                batch.push(Entry {
                    seq: id,
                    kind: EntryKind::Decode,
                    start: s.computed,
                    tokens: 1,
                    kv_len: s.len,
                    samples: true,
                });
                used += 1;
                break;
            }
            let victim = seqs
                .iter()
                .rev()
                .find(|(v, s)| s.blocks > 0 && !batch.iter().any(|e| e.seq == **v))
                .map(|(&v, _)| v)
                .expect("the asking sequence holds blocks");
            let v = seqs.get_mut(&victim).expect("victim is in the table");
            free += v.blocks - v.shared;
            v.blocks = 0;
            v.shared = 0;
            v.computed = 0;
            if !v.queued {
                v.queued = true;
                queue.push_front(victim);
            }
            preempted.push(Preemption { seq: victim, before: batch.len() });
            if victim == id {
                break;
            }
        }
    }

    // Prompt chunks and drafts share what the latency budget leaves after the decodes.
    let decodes = used;
    let budget = match state.prefill_limit {
        Some(limit) if decodes > 0 => budget.min(decodes.saturating_add(limit)),
        _ => budget,
    };
    let mut admission_open = true;
    for id in queue {
        if used >= budget {
            break;
        }
        // Admitted: running, or holding blocks for every token (a queued sequence holding only a
        // cached prefix is not admitted yet).
        let admitted =
            |s: &Live| s.blocks > 0 && (!s.queued || s.blocks >= state.blocks_for(s.len, s.computed));
        let active = seqs.values().filter(|s| admitted(s)).count();
        let s = seqs.get_mut(&id).expect("queued sequence is in the table");
        let n = need(s, s.len);
        if !admitted(s) {
            // Held sequences are not in the table: they do not count against `max_num_seqs`.
            if !admission_open || active >= state.max_num_seqs || n > free {
                admission_open = false;
                continue;
            }
        } else if n > free {
            // An admitted sequence holds blocks for all its tokens, so this never happens for
            // states the engine builds; never plan past the free blocks if it does.
            continue;
        }
        free -= n;
        s.blocks += n;
        let tokens = (s.len - s.computed).min(budget - used);
        batch.push(Entry {
            seq: id,
            kind: EntryKind::Prefill,
            start: s.computed,
            tokens,
            kv_len: s.len,
            samples: s.computed + tokens == s.len,
        });
        used += tokens;
    }

    if preempted.is_empty() {
        // Keep one free token block (a block per group) per batch entry, so speculation never
        // eats the pool.
        let reserve = batch.len() * state.windows.len().max(1);
        for e in batch.iter_mut().filter(|e| e.kind == EntryKind::Decode) {
            let s = seqs.get_mut(&e.seq).expect("decoding sequence is in the table");
            let mut extra = s.draft.min(budget.saturating_sub(used));
            while extra > 0 && need(s, s.len + extra) + reserve > free {
                extra -= 1;
            }
            if extra == 0 {
                continue;
            }
            let n = need(s, s.len + extra);
            free -= n;
            s.blocks += n;
            used += extra;
            e.kind = EntryKind::Verify;
            e.tokens = 1 + extra;
            e.kv_len = s.len + extra;
        }
    }

    let idle = if !batch.is_empty() {
        None
    } else if state.running.is_empty() && state.queued.is_empty() {
        Some(Idle::NoWork)
    } else if free < state.total_blocks {
        Some(Idle::Stalled)
    } else {
        Some(Idle::NoProgress)
    };
    Plan { batch, preempted, idle }
}

/// What a new reservation asks for and what it competes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReservationAsk {
    /// Blocks the reservation needs.
    pub needed: usize,
    /// Blocks free now.
    pub free: usize,
    /// Sequences waiting to be scheduled (queued prompts, preempted sequences).
    pub waiting: usize,
    /// Sequences holding blocks and computing.
    pub running: usize,
    /// Outstanding reservations.
    pub reservations: usize,
    /// Blocks the running sequences and outstanding reservations keep free to grow into (see
    /// [`growth_blocks`]).
    pub growth: usize,
    /// Blocks this reservation's sequence will grow into (0 when its output length is unknown).
    pub own_growth: usize,
}

/// Why a reservation is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationRefusal {
    /// Sequences already here wait to be scheduled and go first.
    Waiting { waiting: usize },
    /// The blocks are free but taking them would leave fewer free blocks than the running
    /// sequences and outstanding reservations (each of which becomes a running sequence soon),
    /// and this one, will grow into.
    KeptForGrowth { kept: usize },
    /// Fewer blocks are free than needed.
    OutOfBlocks,
}

/// Whether a reservation may take its blocks now. Sequences already here come first, as a new
/// prompt would: nothing is reserved while one waits, and what the running sequences, the
/// outstanding reservations and this one will grow into within [`GROWTH_HORIZON`] tokens stays
/// free (a watermark for output growth), so that admitting work never makes the pool run out
/// under sequences already running. With nothing running or reserved any reservation that fits
/// is granted, so none is refused forever. Without this rule, reservations retried under load
/// take every block a preempted sequence frees, and running sequences that cross block
/// boundaries together thrash.
pub fn check_reservation(ask: ReservationAsk) -> Result<(), ReservationRefusal> {
    if ask.waiting > 0 {
        return Err(ReservationRefusal::Waiting { waiting: ask.waiting });
    }
    if ask.free < ask.needed {
        return Err(ReservationRefusal::OutOfBlocks);
    }
    if ask.running + ask.reservations == 0 {
        return Ok(());
    }
    let kept = ask.growth + ask.own_growth;
    if ask.free - ask.needed < kept {
        return Err(ReservationRefusal::KeptForGrowth { kept });
    }
    Ok(())
}

/// Tokens of output growth admission keeps room for, per sequence: a sequence admitted with
/// this headroom for everyone runs this many more tokens without the pool running out, whatever
/// is admitted after it.
pub const GROWTH_HORIZON: usize = 64;

/// Blocks a sequence that holds `held` blocks and whose next pass covers `kv_len` positions still
/// needs to generate `left` more tokens (the last of which is never computed), within
/// [`GROWTH_HORIZON`] tokens and `max_len` positions, in a pool with layer groups of `windows`
/// (`[None]` without groups; window groups are counted as if they gave nothing more back).
/// `None` for `left` means unknown: one token block, for the block its next token may start.
pub fn growth_blocks(
    kv_len: usize,
    held: usize,
    left: Option<usize>,
    max_len: usize,
    block_size: usize,
    windows: &[Option<usize>],
) -> usize {
    let Some(left) = left else { return windows.len().max(1) };
    let end = (kv_len + left.min(GROWTH_HORIZON)).saturating_sub(1).max(kv_len).min(max_len);
    let from = kv_len.saturating_sub(1).min(end);
    crate::kv::groups::pages_held(windows, end, from, block_size.max(1)).saturating_sub(held)
}

#[cfg(test)]
mod tests;
