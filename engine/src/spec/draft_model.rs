//! The draft-model drafter: a smaller model with the target's vocabulary proposes the tokens it
//! would pick itself.
//!
//! Design:
//! - **Its own backend and pool.** The draft model runs on a backend of its own, created on the
//!   target's device, with its own KV pool and its own [`BlockAllocator`] mirroring that pool's
//!   layout. Nothing is shared with the target's pool, so the target's scheduler never counts the
//!   draft's blocks and the draft never touches the target's.
//! - **It prefills itself.** The draft sees only token ids ([`DraftAsk::tokens`]); whatever of a
//!   sequence it has not computed yet (a prompt, tokens the target emitted, a sequence a prefill
//!   worker handed over) it computes in its own passes on the decode worker. No KV is
//!   transferred for it.
//! - **Greedy drafts.** Each draft token is the draft model's argmax (ties to the lowest id), a
//!   deterministic proposal, which is what lets verification keep the target's output exactly as
//!   it is without speculation (see [`super::verify`]).
//! - **Sampled drafts**, for an ask with [`DraftAsk::sampling`] (`--spec-sampled-drafts`): each
//!   draft token is drawn from the draft's distribution under the request's temperature and
//!   filters ([`crate::sampler::draft_distribution`]) with the sequence's own random stream here,
//!   and that distribution is kept for verification ([`Drafter::take_dists`]).
//! - **The tokens given are the truth.** Per sequence the drafter remembers which tokens its pool
//!   holds K/V for. Each call keeps the longest common prefix of those and the ask's tokens and
//!   truncates the rest away: rejected drafts, and a sequence that was preempted and is being
//!   recomputed, need no special case.
//! - **Batched rounds.** One call runs `max` rounds over every asking sequence together: the
//!   first feeds each sequence's catch-up (its tokens not yet computed) and yields draft 1, each
//!   later round feeds every sequence's newest draft and yields the next. A round larger than the
//!   backend's `max_batch_tokens` is split into several passes (chunked prefill). Every chunk is
//!   written direct: the draft's guesses go straight into its own pool, and the next call
//!   truncates whatever the target rejected. The newest draft's own K/V is never computed.
//!
//! Invariants between calls: a sequence has state here exactly when the allocator knows it, and
//! its allocator length equals the number of tokens recorded as computed. A sequence that does
//! not fit (context or free blocks) gets no drafts and holds no blocks; a backend error drops the
//! state of every sequence of that call, so the next call recomputes them from scratch.

use std::collections::{BTreeMap, BTreeSet};

use rand_chacha::rand_core::SeedableRng;
use rand_chacha::ChaCha20Rng;

use super::{DraftAsk, DraftDist, DraftSampling, Drafter, SpecMethod};
use crate::backend::{Backend, LogitsRequest, SeqChunk};
use crate::error::{EngineError, Result};
use crate::kv::{BlockAllocator, SeqId, WriteMode};
use crate::tokenizer::Tokenizer;

/// Proposes tokens with a smaller model sharing the target's vocabulary.
pub struct DraftModelDrafter {
    name: String,
    backend: Box<dyn Backend>,
    /// Mirrors the draft backend's pool.
    alloc: BlockAllocator,
    /// Per sequence, the tokens whose K/V the draft's pool holds, in order.
    seqs: BTreeMap<SeqId, Vec<u32>>,
    /// Longest sequence the draft can hold: its context length, capped by its pool.
    max_len: usize,
    /// Per sequence that samples its drafts, its random stream (seeded from the ask). It lives
    /// until the sequence is forgotten, not only while its K/V does: a stream started again would
    /// repeat draws that already shaped the sequence.
    rngs: BTreeMap<SeqId, ChaCha20Rng>,
    /// Rows of the target's output head: a sampled draft is drawn from these ids only.
    target_vocab: usize,
    /// The distributions of the newest sampled proposal, per sequence, until taken.
    dists: BTreeMap<SeqId, Vec<DraftDist>>,
}

/// Why the draft model cannot draft for the target, or `None` when it can. The target can emit
/// any id below `target_vocab` and its prompts are checked against the same bound, so those ids
/// must all be rows of the draft's embedding; every id the target's tokenizer knows must mean the
/// same text to the draft's; and both must agree on BOS and EOS.
fn incompatibility(
    target: &Tokenizer,
    target_vocab: usize,
    draft: &Tokenizer,
    draft_vocab: usize,
) -> Option<String> {
    if target_vocab > draft_vocab {
        return Some(format!(
            "vocabulary sizes {target_vocab} vs {draft_vocab}: the target can emit ids the draft's embedding lacks"
        ));
    }
    if target.bos_token_id() != draft.bos_token_id() {
        let show = |b: Option<u32>| b.map_or_else(|| "none".to_string(), |b| b.to_string());
        return Some(format!(
            "BOS id {} in the target and {} in the draft",
            show(target.bos_token_id()),
            show(draft.bos_token_id())
        ));
    }
    let eos = |t: &Tokenizer| t.eos_token_ids().iter().copied().collect::<BTreeSet<u32>>();
    if eos(target) != eos(draft) {
        return Some(format!(
            "EOS ids {:?} in the target and {:?} in the draft",
            target.eos_token_ids(),
            draft.eos_token_ids()
        ));
    }
    // Token texts as each tokenizer decodes a lone id. (Tokens that are partial UTF-8 characters
    // all read as U+FFFD, so two byte tokens can only differ by their neighbours' texts; byte-level
    // vocabularies that agree on every other token agree on those too.)
    for id in 0..target.vocab_size() as u32 {
        let want = target.token_text(id);
        let got = draft.token_text(id);
        if want != got {
            let show = |t: Option<String>| t.map_or_else(|| "missing".to_string(), |t| format!("{t:?}"));
            return Some(format!(
                "token {id} is {} in the target and {} in the draft",
                show(want),
                show(got)
            ));
        }
    }
    None
}

/// Checks that a draft model with tokenizer `draft` and `draft_vocab` embedding rows can draft
/// for a target with tokenizer `target` and `target_vocab` rows (see the rule above); the error
/// names the first mismatch. Linear in the vocabulary.
pub fn check_compatible(
    target: &Tokenizer,
    target_vocab: usize,
    draft: &Tokenizer,
    draft_vocab: usize,
) -> Result<()> {
    match incompatibility(target, target_vocab, draft, draft_vocab) {
        None => Ok(()),
        Some(why) => Err(EngineError::InvalidRequest(format!(
            "the draft model is not compatible with the target: {why}"
        ))),
    }
}

/// One sequence's work in one call.
struct Job<'a> {
    /// Index of its ask.
    ask: usize,
    seq: SeqId,
    /// The ask's tokens (the truth).
    tokens: &'a [u32],
    /// Tokens already computed when the call started (after truncation).
    start: usize,
    /// Drafts to produce.
    want: usize,
    drafts: Vec<u32>,
    /// How to sample the drafts (`None`: the argmax).
    sampling: Option<DraftSampling>,
    /// The distribution of each sampled draft.
    dists: Vec<DraftDist>,
}

/// A contiguous part of one item, run in one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    item: usize,
    offset: usize,
    len: usize,
}

/// Packs items of `lens` tokens, in order, into passes of at most `budget` tokens, splitting an
/// item across consecutive passes where it does not fit. An item appears at most once per pass,
/// so no pass holds two chunks of one sequence.
fn pack(lens: &[usize], budget: usize) -> Vec<Vec<Span>> {
    let budget = budget.max(1);
    let mut passes = Vec::new();
    let mut cur = Vec::new();
    let mut room = budget;
    for (item, &len) in lens.iter().enumerate() {
        let mut offset = 0;
        while offset < len {
            if room == 0 {
                passes.push(std::mem::take(&mut cur));
                room = budget;
            }
            let n = (len - offset).min(room);
            cur.push(Span { item, offset, len: n });
            offset += n;
            room -= n;
        }
    }
    if !cur.is_empty() {
        passes.push(cur);
    }
    passes
}

/// Runs `items` (sequence, tokens, position of the first token) through `backend`, in as many
/// passes as its batch limit needs, and returns each item's greedy next token. The allocator must
/// already hold blocks for every position written.
fn run_items(
    backend: &mut dyn Backend,
    alloc: &BlockAllocator,
    items: &[(SeqId, &[u32], usize)],
    sampled: &[bool],
    mut draw: impl FnMut(usize, &mut [f32]) -> Option<u32>,
) -> Result<Vec<u32>> {
    let lens: Vec<usize> = items.iter().map(|i| i.1.len()).collect();
    let mut next = vec![None; items.len()];
    let vocab = backend.config().vocab_size;
    for pass in pack(&lens, backend.max_batch_tokens()) {
        let mut chunks = Vec::with_capacity(pass.len());
        for s in &pass {
            let (seq, tokens, start) = items[s.item];
            let block_table = alloc
                .block_table(seq)
                .ok_or_else(|| EngineError::Internal(format!("draft model: sequence {seq} has no blocks")))?;
            let last = s.offset + s.len == tokens.len();
            chunks.push(SeqChunk {
                tokens: &tokens[s.offset..s.offset + s.len],
                start_pos: start + s.offset,
                block_table,
                logits: if last { LogitsRequest::Last } else { LogitsRequest::None },
                write: WriteMode::Direct,
                // The draft model runs no adapter; verification runs the target's.
                adapter: None,
            });
        }
        // An item that samples needs its logits row, and `draw` draws its token from it (greedy
        // items in the same pass are picked from theirs by the sampler's greedy rule, as the
        // backend would pick them). A pass with no sampling item lets the backend pick.
        let rows = if pass.iter().any(|s| sampled[s.item]) {
            let rows = backend.forward(&chunks)?;
            pass.iter()
                .zip(rows)
                .map(|(s, mut row)| {
                    if row.len() != vocab {
                        return None;
                    }
                    let drawn = if sampled[s.item] { draw(s.item, &mut row) } else { None };
                    drawn.or_else(|| Some(crate::sampler::greedy_pick(&mut row).0))
                })
                .collect::<Vec<_>>()
        } else {
            backend.forward_greedy(&chunks)?.into_iter().map(|p| p.map(|(t, _)| t)).collect()
        };
        for (s, p) in pass.iter().zip(rows) {
            if let Some(token) = p {
                next[s.item] = Some(token);
            }
        }
    }
    next.into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.ok_or_else(|| EngineError::Internal(format!("draft model: no next token for item {i}")))
        })
        .collect()
}

impl DraftModelDrafter {
    /// A drafter over `backend` (the draft model, created on the target's device) with tokenizer
    /// `draft`, for a target with tokenizer `target` and `target_vocab` embedding rows. Refuses a
    /// draft model whose vocabulary differs from the target's ([`check_compatible`]).
    pub fn new(
        target: &Tokenizer,
        target_vocab: usize,
        backend: Box<dyn Backend>,
        draft: &Tokenizer,
        name: String,
    ) -> Result<DraftModelDrafter> {
        let cfg = backend.config();
        if let Some(why) = incompatibility(target, target_vocab, draft, cfg.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "draft model {name} is not compatible with the target: {why}"
            )));
        }
        let layout = backend.kv_layout();
        let alloc = BlockAllocator::try_new(layout.num_blocks, layout.block_size)?;
        let max_len = cfg.max_position_embeddings.min(layout.num_blocks.saturating_mul(layout.block_size));
        Ok(DraftModelDrafter {
            name,
            backend,
            alloc,
            seqs: BTreeMap::new(),
            max_len,
            rngs: BTreeMap::new(),
            target_vocab,
            dists: BTreeMap::new(),
        })
    }

    /// KV blocks of the draft's pool held by sequences (0 once every sequence is forgotten).
    pub fn kv_in_use(&self) -> usize {
        self.alloc.total_blocks() - self.alloc.free_blocks()
    }

    /// Sequences the drafter keeps K/V for.
    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Checks the draft allocator's invariants and that it agrees with the per-sequence state.
    pub fn check_kv(&self) -> Result<()> {
        self.alloc.check_invariants().map_err(|v| {
            EngineError::Internal(format!("draft model {}: KV allocator invariant violated: {v}", self.name))
        })?;
        let owners: Vec<SeqId> = self.alloc.sequences().collect();
        if owners.len() != self.seqs.len() || owners.iter().any(|s| !self.seqs.contains_key(s)) {
            return Err(EngineError::Internal(format!(
                "draft model {}: the allocator holds sequences {owners:?} but the drafter tracks {:?}",
                self.name,
                self.seqs.keys().collect::<Vec<_>>()
            )));
        }
        for (&seq, computed) in &self.seqs {
            let len = self.alloc.seq_len(seq).unwrap_or(0);
            if len != computed.len() {
                return Err(EngineError::Internal(format!(
                    "draft model {}: sequence {seq} holds {len} positions but {} computed tokens",
                    self.name,
                    computed.len()
                )));
            }
        }
        Ok(())
    }

    /// Drops a sequence's state and frees its blocks.
    fn drop_seq(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
        self.dists.remove(&seq);
        // Unknown to the allocator means it held nothing.
        let _ = self.alloc.free_sequence(seq);
    }

    /// Truncates `ask`'s state to what still holds, reserves blocks for this call's positions and
    /// returns its job; `None` (and no state) when it cannot draft now.
    fn prepare<'a>(&mut self, index: usize, ask: &DraftAsk<'a>, asked: &BTreeSet<SeqId>) -> Option<Job<'a>> {
        let n = ask.tokens.len();
        if ask.max == 0 || n == 0 || n > self.max_len {
            self.drop_seq(ask.seq);
            return None;
        }
        let computed = self.seqs.entry(ask.seq).or_default();
        if self.alloc.seq_len(ask.seq).is_none() {
            computed.clear();
            if self.alloc.add_sequence(ask.seq, 0).is_err() {
                self.drop_seq(ask.seq);
                return None;
            }
        }
        // The newest token is always fed again: its logits give the first draft.
        let keep = computed.iter().zip(ask.tokens).take_while(|(a, b)| a == b).count().min(n - 1);
        computed.truncate(keep);
        if self.alloc.truncate(ask.seq, keep).is_err() {
            self.drop_seq(ask.seq);
            return None;
        }
        let vocab = self.backend.config().vocab_size;
        if ask.tokens[keep..].iter().any(|&t| t as usize >= vocab) {
            self.drop_seq(ask.seq);
            return None;
        }
        // Positions written: every ask token, then each draft but the newest.
        let mut want = ask.max.min(self.max_len + 1 - n);
        let bs = self.alloc.block_size();
        let held = self.alloc.block_table(ask.seq).map_or(0, <[_]>::len);
        if (held + self.alloc.free_blocks()) * bs < n + want - 1 {
            // Sequences not drafting this step make room; they recompute when they next draft.
            let idle: Vec<SeqId> = self.seqs.keys().copied().filter(|s| !asked.contains(s)).collect();
            for s in idle {
                tracing::debug!(draft = %self.name, seq = s, "draft KV evicted to make room");
                self.drop_seq(s);
            }
        }
        let room = (held + self.alloc.free_blocks()) * bs;
        if room < n {
            tracing::debug!(draft = %self.name, seq = ask.seq, tokens = n, "draft KV pool full; no drafts");
            self.drop_seq(ask.seq);
            return None;
        }
        want = want.min(room + 1 - n);
        // Fits by the count above. The drafter never forks, so no block is shared and appending
        // never asks for a copy.
        if self.alloc.append(ask.seq, n + want - 1 - keep).is_err() {
            self.drop_seq(ask.seq);
            return None;
        }
        Some(Job {
            ask: index,
            seq: ask.seq,
            tokens: ask.tokens,
            start: keep,
            want,
            drafts: Vec::new(),
            sampling: ask.sampling,
            dists: Vec::new(),
        })
    }

    /// One round over `items` (item `i` belongs to job `of[i]`): each job's next draft, and for
    /// a job that samples, the distribution it was drawn from.
    fn round(
        &mut self,
        jobs: &mut [Job<'_>],
        of: &[usize],
        items: &[(SeqId, &[u32], usize)],
    ) -> Result<Vec<u32>> {
        let plan: Vec<Option<(SeqId, DraftSampling)>> =
            of.iter().map(|&j| jobs[j].sampling.map(|s| (jobs[j].seq, s))).collect();
        let sampled: Vec<bool> = plan.iter().map(Option::is_some).collect();
        let mut got: Vec<Option<DraftDist>> = vec![None; items.len()];
        let (rngs, target_vocab) = (&mut self.rngs, self.target_vocab);
        let tokens = run_items(self.backend.as_mut(), &self.alloc, items, &sampled, |i, row| {
            let (seq, sampling) = plan[i]?;
            // Ids the target cannot emit get no mass: a draft drawn there could not be verified
            // against q, and dropping it would bias the output.
            if let Some(extra) = row.get_mut(target_vocab..) {
                extra.fill(f32::NEG_INFINITY);
            }
            let dist = crate::sampler::draft_distribution(row, &sampling);
            let rng = rngs.entry(seq).or_insert_with(|| ChaCha20Rng::seed_from_u64(sampling.seed));
            let token = crate::sampler::draw_from(&dist, rng)?;
            got[i] = Some(dist);
            Some(token)
        })?;
        for ((&j, &t), dist) in of.iter().zip(&tokens).zip(got) {
            if jobs[j].sampling.is_some() {
                // A row with nothing to sample from fell back to its argmax: a one-point draft.
                jobs[j].dists.push(dist.unwrap_or_else(|| DraftDist { probs: vec![(t, 1.0)] }));
            }
        }
        Ok(tokens)
    }

    /// Runs every round of one call; on error the caller drops the jobs' state.
    fn draft(&mut self, jobs: &mut [Job<'_>]) -> Result<()> {
        // Round 1: each sequence's catch-up, giving draft 1.
        let items: Vec<(SeqId, &[u32], usize)> =
            jobs.iter().map(|j| (j.seq, &j.tokens[j.start..], j.start)).collect();
        let of: Vec<usize> = (0..jobs.len()).collect();
        let first = self.round(jobs, &of, &items)?;
        for (j, t) in jobs.iter_mut().zip(first) {
            self.seqs.entry(j.seq).or_default().extend_from_slice(&j.tokens[j.start..]);
            j.drafts.push(t);
        }
        // Later rounds: every sequence still short of drafts feeds its newest one.
        loop {
            let active: Vec<usize> =
                (0..jobs.len()).filter(|&i| jobs[i].drafts.len() < jobs[i].want).collect();
            if active.is_empty() {
                return Ok(());
            }
            let feed: Vec<[u32; 1]> =
                active.iter().map(|&i| [*jobs[i].drafts.last().expect("round 1 drafted")]).collect();
            let items: Vec<(SeqId, &[u32], usize)> = active
                .iter()
                .zip(&feed)
                .map(|(&i, f)| (jobs[i].seq, &f[..], jobs[i].tokens.len() + jobs[i].drafts.len() - 1))
                .collect();
            let next = self.round(jobs, &active, &items)?;
            for ((&i, f), t) in active.iter().zip(&feed).zip(next) {
                self.seqs.entry(jobs[i].seq).or_default().push(f[0]);
                jobs[i].drafts.push(t);
            }
        }
    }
}

impl Drafter for DraftModelDrafter {
    fn method(&self) -> SpecMethod {
        SpecMethod::Draft
    }

    fn describe(&self) -> String {
        format!("draft model {}", self.name)
    }

    fn propose(&mut self, asks: &[DraftAsk<'_>]) -> Result<Vec<Vec<u32>>> {
        let mut out = vec![Vec::new(); asks.len()];
        self.dists.clear();
        let asked: BTreeSet<SeqId> = asks.iter().map(|a| a.seq).collect();
        let mut seen = BTreeSet::new();
        let mut jobs = Vec::with_capacity(asks.len());
        for (i, ask) in asks.iter().enumerate() {
            // A sequence asked twice in one call drafts once.
            if seen.insert(ask.seq) {
                jobs.extend(self.prepare(i, ask, &asked));
            }
        }
        if jobs.is_empty() {
            return Ok(out);
        }
        if let Err(e) = self.draft(&mut jobs) {
            for j in &jobs {
                self.drop_seq(j.seq);
            }
            return Err(e);
        }
        for j in jobs {
            if j.sampling.is_some() {
                self.dists.insert(j.seq, j.dists);
            }
            out[j.ask] = j.drafts;
        }
        Ok(out)
    }

    fn forget(&mut self, seq: SeqId) {
        self.drop_seq(seq);
        self.rngs.remove(&seq);
    }

    fn take_dists(&mut self, seq: SeqId) -> Option<Vec<DraftDist>> {
        self.dists.remove(&seq)
    }

    fn check_kv(&self, idle: bool) -> Result<()> {
        DraftModelDrafter::check_kv(self)?;
        if idle && self.kv_in_use() != 0 {
            return Err(EngineError::Internal(format!(
                "draft model {}: {} KV blocks held with no live sequence",
                self.name,
                self.kv_in_use()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every pass within budget, every item once per pass, every token of every item exactly once
    /// and in order.
    fn check(lens: &[usize], budget: usize) {
        let passes = pack(lens, budget);
        let mut next = vec![0usize; lens.len()];
        for pass in &passes {
            assert!(!pass.is_empty());
            assert!(pass.iter().map(|s| s.len).sum::<usize>() <= budget, "{lens:?} / {budget}: {passes:?}");
            let items: BTreeSet<usize> = pass.iter().map(|s| s.item).collect();
            assert_eq!(items.len(), pass.len(), "an item twice in one pass: {pass:?}");
            for s in pass {
                assert_eq!(s.offset, next[s.item], "{passes:?}");
                assert!(s.len > 0);
                next[s.item] += s.len;
            }
        }
        assert_eq!(next, lens);
    }

    #[test]
    fn packing_splits_long_items_and_fills_passes() {
        assert_eq!(
            pack(&[3, 5, 1], 4),
            vec![
                vec![Span { item: 0, offset: 0, len: 3 }, Span { item: 1, offset: 0, len: 1 }],
                vec![Span { item: 1, offset: 1, len: 4 }],
                vec![Span { item: 2, offset: 0, len: 1 }],
            ]
        );
        assert_eq!(pack(&[1, 1, 1], 8).len(), 1);
        assert_eq!(pack(&[1, 1, 1], 1).len(), 3);
        assert!(pack(&[], 4).is_empty());
        for budget in 1..9 {
            check(&[7, 1, 1, 12, 3, 1], budget);
            check(&[1; 10], budget);
        }
    }
}
