//! The one KV write path.
//!
//! Every layer of a forward pass writes its new K and V through [`KvWritePath::write`], with the
//! layer index passed explicitly (never guessed from call order or token positions). The caller —
//! the scheduler, through the backend — picks the [`WriteMode`] for the whole pass in
//! [`KvWritePath::begin_pass`]; the write path never infers it from token counts:
//!
//! - [`WriteMode::Direct`]: values go straight into the pool.
//! - [`WriteMode::Staged`]: values go into a per-layer staging buffer (speculative verification).
//!   After verification the caller either calls [`KvWritePath::commit`] with the accepted prefix of
//!   every segment, which copies that prefix of *every* layer into *that layer's own* cache, or
//!   [`KvWritePath::discard`]. Rejected tokens never reach the pool.
//!
//! A staged pass may also carry *direct segments* ([`StagedSegment::direct`]): prefill chunks and
//! ordinary decode steps batched with verification. Their tokens are written into the pool as each
//! layer is written, exactly as in a direct pass; they are never staged, so a prefill can never be
//! mistaken for speculation, and `commit` must accept them whole.
//!
//! Life cycle, enforced with typed errors: `begin_pass → write (each layer exactly once) → end_pass
//! → (staged only) commit | discard`. Staged data waiting for commit blocks a new pass, so it can
//! neither be lost nor silently overwritten. [`KvWritePath::discard`] resets from any state. An
//! operation that fails leaves the state and the pool unchanged.
//!
//! The staging buffer is allocated once (capacity = most tokens in one staged pass) and owned here,
//! one region per layer, so layers cannot overwrite each other's staged values. It holds f32
//! whatever the pool's dtype: `commit` converts through the same [`CpuKvPool::write_token`] a
//! direct write uses, so committed bytes equal what a direct write of the same values gives.
//!
//! Debug output (`tracing` at TRACE) names the layer, the KV head, the token's index in the pass and
//! its slot (block, offset) on every value it reports: KV logs without the layer have misled
//! investigations before.

use std::collections::HashSet;
use std::ops::Range;

use super::groups::KvGroups;
use super::layout::KvLayout;
use super::pool::CpuKvPool;
use super::KvError;

/// How a whole forward pass writes its KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// Write into the pool immediately.
    Direct,
    /// Write into the staging buffer; only `commit` moves (a prefix of) it into the pool.
    Staged,
}

/// One sequence's tokens in a pass: their index range within the pass and the pool slot of each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagedSegment {
    /// Token indices within the pass (rows of the `k`/`v` given to `write`).
    pub tokens: Range<usize>,
    /// Slot (`page * block_size + offset`) of each token, `tokens.len()` of them per layer group
    /// of the pool ([`super::groups`]), group after group (one group without groups).
    pub slots: Vec<usize>,
    /// Written straight into the pool even in a staged pass (prefill chunks and ordinary decode
    /// steps batched with verification); `commit` must accept it whole.
    pub direct: bool,
}

impl StagedSegment {
    /// A segment whose tokens are staged in a staged pass.
    pub fn new(tokens: Range<usize>, slots: Vec<usize>) -> Self {
        Self { tokens, slots, direct: false }
    }

    /// A segment written straight into the pool whatever the pass's mode.
    pub fn direct(tokens: Range<usize>, slots: Vec<usize>) -> Self {
        Self { tokens, slots, direct: true }
    }

    /// The slots of layer group `group` of `groups`.
    fn group_slots(&self, group: usize, groups: usize) -> &[usize] {
        let n = self.slots.len() / groups.max(1);
        &self.slots[group * n..(group + 1) * n]
    }
}

#[derive(Debug)]
struct Pass {
    mode: WriteMode,
    segments: Vec<StagedSegment>,
    /// Per layer group, the slot of every token of the pass, in pass order: from the segments,
    /// or (direct mode without segments) from the group's first layer written. Every layer of a
    /// group must write exactly these slots.
    slots: Vec<Option<Vec<usize>>>,
    written: Vec<bool>,
}

#[derive(Debug)]
enum State {
    Idle,
    /// `begin_pass` done, layers being written.
    Open(Pass),
    /// A staged pass has ended; its data waits for `commit` or `discard`.
    Pending(Pass),
}

/// The KV write path of one backend: life-cycle state plus the staging buffer.
#[derive(Debug)]
pub struct KvWritePath {
    layout: KvLayout,
    /// Which storage layer of which group's pages each model layer writes.
    groups: KvGroups,
    capacity: usize,
    /// Per model layer, `capacity` tokens of K (resp. V), token-major like the pool.
    staged_k: Vec<Vec<f32>>,
    staged_v: Vec<Vec<f32>>,
    state: State,
}

impl KvWritePath {
    /// A write path for pools of `layout`, staging at most `max_tokens` tokens per staged pass.
    pub fn new(layout: KvLayout, max_tokens: usize) -> Self {
        Self::with_groups(layout, KvGroups::single(layout.num_layers), max_tokens)
    }

    /// A write path for a pool with layer groups (`layout.num_layers` storage layers per page,
    /// [`KvGroups::per_page`]); `layer` in [`Self::write`] is then the model's layer.
    ///
    /// # Panics
    /// If the groups' pages do not have the layout's storage layers.
    pub fn with_groups(layout: KvLayout, groups: KvGroups, max_tokens: usize) -> Self {
        assert_eq!(groups.per_page(), layout.num_layers, "layer groups vs KV layout");
        let n = max_tokens * layout.token_elems();
        let layers = groups.num_layers();
        Self {
            layout,
            groups,
            capacity: max_tokens,
            staged_k: (0..layers).map(|_| vec![0.0; n]).collect(),
            staged_v: (0..layers).map(|_| vec![0.0; n]).collect(),
            state: State::Idle,
        }
    }

    /// The layout this path writes.
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Most tokens one staged pass may hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The mode of the open pass or of the staged data pending; `None` when idle.
    pub fn mode(&self) -> Option<WriteMode> {
        match &self.state {
            State::Idle => None,
            State::Open(p) | State::Pending(p) => Some(p.mode),
        }
    }

    /// Whether staged data waits for `commit` or `discard`.
    pub fn is_pending(&self) -> bool {
        matches!(self.state, State::Pending(_))
    }

    /// Opens a pass in `mode`. `segments` tile the pass's tokens in order (`0..n`, one per
    /// sequence); they are required in staged mode (commit needs them) and optional in direct mode
    /// (when given, every layer's slots are checked against them).
    pub fn begin_pass(&mut self, mode: WriteMode, segments: &[StagedSegment]) -> Result<(), KvError> {
        match self.state {
            State::Idle => {}
            State::Open(_) => return Err(KvError::PassAlreadyOpen),
            State::Pending(_) => return Err(KvError::StagedPending),
        }
        let slots = if segments.is_empty() {
            if mode == WriteMode::Staged {
                return Err(KvError::InvalidSegments("a staged pass needs at least one segment".into()));
            }
            vec![None; self.groups.len()]
        } else {
            self.validate_segments(segments)?.into_iter().map(Some).collect()
        };
        let n = slots[0].as_ref().map(Vec::len);
        if mode == WriteMode::Staged && n.unwrap_or(0) > self.capacity {
            return Err(KvError::TooManyTokens { n_tokens: n.unwrap_or(0), capacity: self.capacity });
        }
        tracing::debug!(?mode, segments = segments.len(), tokens = n, "kv begin_pass");
        self.state = State::Open(Pass {
            mode,
            segments: segments.to_vec(),
            slots,
            written: vec![false; self.groups.num_layers()],
        });
        Ok(())
    }

    /// Writes layer `layer`'s new K and V (`slots.len()` tokens × `num_kv_heads` × `head_dim`, token
    /// major) for the open pass: into the pool (direct) or into that layer's staging region (staged).
    pub fn write(
        &mut self,
        pool: &mut CpuKvPool,
        layer: usize,
        k: &[f32],
        v: &[f32],
        slots: &[usize],
    ) -> Result<(), KvError> {
        let layout = self.layout;
        let pass = match &mut self.state {
            State::Open(p) => p,
            State::Idle | State::Pending(_) => return Err(KvError::NoOpenPass),
        };
        let layers = self.groups.num_layers();
        if layer >= layers {
            return Err(KvError::LayerOutOfRange { layer, num_layers: layers });
        }
        let (group, at) = (self.groups.group(layer), self.groups.slot(layer));
        let groups = self.groups.len();
        if pass.written[layer] {
            return Err(KvError::LayerWrittenTwice { layer });
        }
        let te = layout.token_elems();
        let n = slots.len();
        if k.len() != n * te {
            return Err(KvError::ShapeMismatch {
                what: "k (tokens x kv_heads x head_dim)",
                expected: n * te,
                actual: k.len(),
            });
        }
        if v.len() != n * te {
            return Err(KvError::ShapeMismatch {
                what: "v (tokens x kv_heads x head_dim)",
                expected: n * te,
                actual: v.len(),
            });
        }
        match &pass.slots[group] {
            Some(expected) if expected.as_slice() != slots => return Err(KvError::SlotsMismatch { layer }),
            Some(_) => {}
            None => check_slots(&layout, layer, slots)?,
        }
        match pass.mode {
            WriteMode::Direct => {
                pool.layout().check_same(&layout, "pool vs write path")?;
                for (i, &slot) in slots.iter().enumerate() {
                    let r = i * te..(i + 1) * te;
                    pool.write_token(at, slot, &k[r.clone()], &v[r])?;
                }
            }
            WriteMode::Staged => {
                self.staged_k[layer][..n * te].copy_from_slice(k);
                self.staged_v[layer][..n * te].copy_from_slice(v);
                // Direct segments of a staged pass go to the pool now; their staged copy is never
                // committed (commit skips them).
                for seg in pass.segments.iter().filter(|s| s.direct) {
                    pool.layout().check_same(&layout, "pool vs write path")?;
                    for (t, &slot) in seg.tokens.clone().zip(seg.group_slots(group, groups)) {
                        let r = t * te..(t + 1) * te;
                        pool.write_token(at, slot, &k[r.clone()], &v[r])?;
                    }
                }
            }
        }
        trace_tokens(
            &layout,
            if pass.mode == WriteMode::Direct { "kv write direct" } else { "kv write staged" },
            layer,
            slots,
            0..n,
            k,
            v,
        );
        if pass.slots[group].is_none() {
            pass.slots[group] = Some(slots.to_vec());
        }
        pass.written[layer] = true;
        Ok(())
    }

    /// Ends the open pass. Every layer must have been written exactly once; if not, the pass stays
    /// open (the caller decides: `discard`, or write the missing layers). A direct pass closes; a
    /// staged pass keeps its data until `commit` or `discard`.
    pub fn end_pass(&mut self) -> Result<(), KvError> {
        let pass = match &self.state {
            State::Open(p) => p,
            State::Idle | State::Pending(_) => return Err(KvError::NoOpenPass),
        };
        let missing: Vec<usize> =
            pass.written.iter().enumerate().filter(|(_, &w)| !w).map(|(l, _)| l).collect();
        if !missing.is_empty() {
            return Err(KvError::LayersNotWritten { missing });
        }
        self.state = match std::mem::replace(&mut self.state, State::Idle) {
            State::Open(p) if p.mode == WriteMode::Staged => State::Pending(p),
            _ => State::Idle,
        };
        tracing::debug!(pending = self.is_pending(), "kv end_pass");
        Ok(())
    }

    /// Writes the accepted prefix of every segment — `accepted[i]` tokens of segment `i` — of every
    /// layer from that layer's staging region into that layer's own cache, then clears the staged
    /// data. Tokens past the prefix are dropped and never reach the pool. Everything is validated
    /// before the pool is touched.
    pub fn commit(&mut self, pool: &mut CpuKvPool, accepted: &[usize]) -> Result<(), KvError> {
        let pass = match &self.state {
            State::Pending(p) => p,
            State::Idle => return Err(KvError::NothingStaged("no staged pass")),
            State::Open(p) if p.mode == WriteMode::Direct => {
                return Err(KvError::NothingStaged("the open pass is direct; nothing is staged"))
            }
            State::Open(_) => {
                return Err(KvError::NothingStaged("the staged pass is still open: call end_pass first"))
            }
        };
        pool.layout().check_same(&self.layout, "pool vs write path")?;
        if accepted.len() != pass.segments.len() {
            return Err(KvError::InvalidAccepted(format!(
                "{} accepted lengths for {} segments",
                accepted.len(),
                pass.segments.len()
            )));
        }
        for (i, (seg, &a)) in pass.segments.iter().zip(accepted).enumerate() {
            if seg.direct && a != seg.tokens.len() {
                return Err(KvError::InvalidAccepted(format!(
                    "segment {i} was written direct ({} tokens); it is accepted whole, not {a}",
                    seg.tokens.len()
                )));
            }
            if a > seg.tokens.len() {
                return Err(KvError::InvalidAccepted(format!(
                    "segment {i}: {a} tokens accepted of {}",
                    seg.tokens.len()
                )));
            }
        }
        let te = self.layout.token_elems();
        let groups = self.groups.len();
        for layer in 0..self.groups.num_layers() {
            let (sk, sv) = (&self.staged_k[layer], &self.staged_v[layer]);
            let (group, at) = (self.groups.group(layer), self.groups.slot(layer));
            for (seg, &a) in pass.segments.iter().zip(accepted).filter(|(s, _)| !s.direct) {
                let toks = seg.tokens.start..seg.tokens.start + a;
                let slots = seg.group_slots(group, groups);
                for (t, &slot) in toks.clone().zip(slots) {
                    let r = t * te..(t + 1) * te;
                    pool.write_token(at, slot, &sk[r.clone()], &sv[r])?;
                }
                trace_tokens(&self.layout, "kv commit", layer, &slots[..a], toks, sk, sv);
            }
        }
        tracing::debug!(?accepted, layers = self.groups.num_layers(), "kv commit");
        self.state = State::Idle;
        Ok(())
    }

    /// Drops any open pass or pending staged data. Staged data never reaches the pool; values a
    /// direct pass already wrote stay where they are (the allocator's truncate releases their slots).
    pub fn discard(&mut self) {
        if !matches!(self.state, State::Idle) {
            tracing::debug!(mode = ?self.mode(), "kv discard");
        }
        self.state = State::Idle;
    }

    /// Checks that segments tile `0..n` in order, that each has one slot per token and layer
    /// group, and that each group's slots are in range and distinct; returns, per group, the
    /// pass's slots in token order.
    fn validate_segments(&self, segments: &[StagedSegment]) -> Result<Vec<Vec<usize>>, KvError> {
        let groups = self.groups.len();
        let mut next = 0;
        let mut slots = vec![Vec::new(); groups];
        for (i, seg) in segments.iter().enumerate() {
            if seg.tokens.start != next || seg.tokens.end < seg.tokens.start {
                return Err(KvError::InvalidSegments(format!(
                    "segment {i} covers tokens {:?}; segments must tile the pass in order from token {next}",
                    seg.tokens
                )));
            }
            if seg.slots.len() != seg.tokens.len() * groups {
                return Err(KvError::InvalidSegments(format!(
                    "segment {i} has {} slots for {} tokens and {groups} layer groups",
                    seg.slots.len(),
                    seg.tokens.len()
                )));
            }
            next = seg.tokens.end;
            for (g, s) in slots.iter_mut().enumerate() {
                s.extend_from_slice(seg.group_slots(g, groups));
            }
        }
        // Layer 0 stands in for "every layer": the same slots are checked against each write.
        for s in &slots {
            check_slots(&self.layout, 0, s)?;
        }
        Ok(slots)
    }
}

/// Slots must lie in the pool and be distinct (two tokens of one pass in one slot would overwrite).
fn check_slots(layout: &KvLayout, layer: usize, slots: &[usize]) -> Result<(), KvError> {
    let num_slots = layout.num_slots();
    let mut seen = HashSet::with_capacity(slots.len());
    for &slot in slots {
        if slot >= num_slots {
            return Err(KvError::SlotOutOfRange { slot, num_slots });
        }
        if !seen.insert(slot) {
            return Err(KvError::DuplicateSlot { layer, slot });
        }
    }
    Ok(())
}

/// TRACE output for KV values, one line per (token, KV head), naming layer, head, pass token and
/// slot. `rows` are the token indices into `k`/`v` matching `slots`.
fn trace_tokens(
    layout: &KvLayout,
    what: &str,
    layer: usize,
    slots: &[usize],
    rows: Range<usize>,
    k: &[f32],
    v: &[f32],
) {
    if !tracing::enabled!(tracing::Level::TRACE) {
        return;
    }
    let (te, hd, bs) = (layout.token_elems(), layout.head_dim, layout.block_size);
    for (t, &slot) in rows.zip(slots) {
        for kv_head in 0..layout.num_kv_heads {
            let at = t * te + kv_head * hd;
            let show = hd.min(4);
            tracing::trace!(
                layer,
                kv_head,
                pass_token = t,
                slot,
                block = slot / bs,
                offset = slot % bs,
                k = ?&k[at..at + show],
                v = ?&v[at..at + show],
                "{what}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            num_layers: 2,
            num_blocks: 4,
            block_size: 2,
            num_kv_heads: 1,
            head_dim: 2,
            dtype: crate::kv::KvDtype::F32,
        }
    }

    #[test]
    fn pending_staged_data_blocks_a_new_pass() {
        let l = layout();
        let mut pool = CpuKvPool::new(l);
        let mut w = KvWritePath::new(l, 4);
        let seg = [StagedSegment::new(0..1, vec![3])];
        w.begin_pass(WriteMode::Staged, &seg).unwrap();
        for layer in 0..2 {
            w.write(&mut pool, layer, &[1.0, 2.0], &[3.0, 4.0], &[3]).unwrap();
        }
        w.end_pass().unwrap();
        assert_eq!(w.begin_pass(WriteMode::Direct, &[]), Err(KvError::StagedPending));
        assert_eq!(w.mode(), Some(WriteMode::Staged));
        w.discard();
        assert_eq!(w.mode(), None);
        w.begin_pass(WriteMode::Direct, &[]).unwrap();
    }
}
