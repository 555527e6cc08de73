//! The KV write path: staged passes reach each layer's own cache only through `commit(accepted)`,
//! and only the accepted prefix; `discard` leaves the pool untouched; the life cycle is enforced;
//! direct mode writes through; copy-on-write keeps forked sequences apart.
//!
//! Values differ per layer, per token and per element, so a commit that wrote every layer into one
//! cache, defaulted the layer index to 0, or let a rejected token through cannot pass. The life
//! cycle tests run on an f32 pool (values compared exactly); `every_dtype_*` run the two write
//! modes on every pool dtype and compare bytes.

use tandem_engine::kv::{
    BlockAllocator, CpuKvPool, KvDtype, KvError, KvLayout, KvWritePath, StagedSegment, WriteMode,
};

const LAYOUT: KvLayout = KvLayout {
    num_layers: 3,
    num_blocks: 8,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 3,
    dtype: KvDtype::F32,
};
const TE: usize = 6; // num_kv_heads * head_dim

/// K value of element `e` of token `t` (index within the pass) at layer `l`; V is its negation
/// minus a half, so K and V can never be swapped unnoticed.
fn kval(l: usize, t: usize, e: usize) -> f32 {
    1000.0 * (l as f32 + 1.0) + 10.0 * t as f32 + e as f32
}
fn vval(l: usize, t: usize, e: usize) -> f32 {
    -kval(l, t, e) - 0.5
}

fn layer_kv(l: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let k = (0..n * TE).map(|i| kval(l, i / TE, i % TE)).collect();
    let v = (0..n * TE).map(|i| vval(l, i / TE, i % TE)).collect();
    (k, v)
}

/// A pool where every slot of layer `l` holds a sentinel distinct from any written value.
fn sentinel_pool() -> CpuKvPool {
    let mut pool = CpuKvPool::new(LAYOUT);
    for l in 0..LAYOUT.num_layers {
        let s = vec![-7.0 - l as f32; TE];
        for slot in 0..LAYOUT.num_slots() {
            pool.write_token(l, slot, &s, &s).unwrap();
        }
    }
    pool
}

fn snapshot(pool: &CpuKvPool) -> Vec<(Vec<f32>, Vec<f32>)> {
    (0..LAYOUT.num_layers).map(|l| (pool.k(l).to_f32_vec(), pool.v(l).to_f32_vec())).collect()
}

fn segments() -> Vec<StagedSegment> {
    vec![
        StagedSegment::new(0..3, vec![4, 5, 6]),
        StagedSegment::new(3..5, vec![13, 12]),
        StagedSegment::new(5..9, vec![20, 21, 22, 23]),
    ]
}

fn pass_slots(segs: &[StagedSegment]) -> Vec<usize> {
    segs.iter().flat_map(|s| s.slots.iter().copied()).collect()
}

fn write_all_layers(w: &mut KvWritePath, pool: &mut CpuKvPool, slots: &[usize]) {
    for l in 0..LAYOUT.num_layers {
        let (k, v) = layer_kv(l, slots.len());
        w.write(pool, l, &k, &v, slots).unwrap();
    }
}

#[test]
fn commit_writes_exactly_the_accepted_prefix_into_each_layers_own_cache() {
    let mut pool = sentinel_pool();
    let before = snapshot(&pool);
    let segs = segments();
    let slots = pass_slots(&segs);
    let mut w = KvWritePath::new(LAYOUT, 16);

    w.begin_pass(WriteMode::Staged, &segs).unwrap();
    assert_eq!(w.mode(), Some(WriteMode::Staged));
    // Layers out of order: the layer index is what places the data, not the call order.
    for l in [2, 0, 1] {
        let (k, v) = layer_kv(l, slots.len());
        w.write(&mut pool, l, &k, &v, &slots).unwrap();
    }
    w.end_pass().unwrap();
    assert!(w.is_pending());
    assert_eq!(snapshot(&pool), before, "staged writes must not reach the pool before commit");

    let accepted = [2, 0, 4];
    w.commit(&mut pool, &accepted).unwrap();
    assert_eq!(w.mode(), None);

    // Build the expected image independently: sentinel everywhere, then the accepted tokens.
    let mut expected = before.clone();
    for (seg, &a) in segs.iter().zip(&accepted) {
        for (i, &slot) in seg.slots.iter().enumerate().take(a) {
            let t = seg.tokens.start + i;
            for (l, (ek, ev)) in expected.iter_mut().enumerate() {
                for e in 0..TE {
                    ek[slot * TE + e] = kval(l, t, e);
                    ev[slot * TE + e] = vval(l, t, e);
                }
            }
        }
    }
    let got = snapshot(&pool);
    for l in 0..LAYOUT.num_layers {
        assert_eq!(got[l], expected[l], "layer {l} holds the wrong values");
    }
    // Rejected tokens (segment 0's third, all of segment 1) left their slots untouched.
    for &slot in &[6usize, 12, 13] {
        for l in 0..LAYOUT.num_layers {
            assert!(pool.k(l).to_f32_vec()[slot * TE..(slot + 1) * TE].iter().all(|&x| x == -7.0 - l as f32));
            assert!(pool.v(l).to_f32_vec()[slot * TE..(slot + 1) * TE].iter().all(|&x| x == -7.0 - l as f32));
        }
    }
    // Nothing left to commit.
    assert!(matches!(w.commit(&mut pool, &accepted), Err(KvError::NothingStaged(_))));
}

#[test]
fn discard_leaves_the_pool_untouched() {
    let mut pool = sentinel_pool();
    let before = snapshot(&pool);
    let segs = segments();
    let slots = pass_slots(&segs);
    let mut w = KvWritePath::new(LAYOUT, 16);

    // Discard after end_pass.
    w.begin_pass(WriteMode::Staged, &segs).unwrap();
    write_all_layers(&mut w, &mut pool, &slots);
    w.end_pass().unwrap();
    w.discard();
    assert_eq!(w.mode(), None);
    assert_eq!(snapshot(&pool), before);

    // Discard of a pass still open (some layers written).
    w.begin_pass(WriteMode::Staged, &segs).unwrap();
    let (k, v) = layer_kv(1, slots.len());
    w.write(&mut pool, 1, &k, &v, &slots).unwrap();
    w.discard();
    assert_eq!(snapshot(&pool), before);

    // A fresh pass works after a discard, and its commit does not resurrect the discarded data.
    let one = [StagedSegment::new(0..1, vec![30])];
    w.begin_pass(WriteMode::Staged, &one).unwrap();
    write_all_layers(&mut w, &mut pool, &[30]);
    w.end_pass().unwrap();
    w.commit(&mut pool, &[1]).unwrap();
    let after = snapshot(&pool);
    for l in 0..LAYOUT.num_layers {
        for (i, (&x, &y)) in after[l].0.iter().zip(&before[l].0).enumerate() {
            if i / TE != 30 {
                assert_eq!(x, y, "layer {l} element {i} changed");
            } else {
                assert_eq!(x, kval(l, 0, i % TE));
            }
        }
    }
}

#[test]
fn life_cycle_is_enforced_and_errors_change_nothing() {
    let mut pool = sentinel_pool();
    let before = snapshot(&pool);
    let segs = segments();
    let slots = pass_slots(&segs);
    let mut w = KvWritePath::new(LAYOUT, 16);
    let (k0, v0) = layer_kv(0, slots.len());

    // Nothing open or staged.
    assert_eq!(w.commit(&mut pool, &[1, 1, 1]), Err(KvError::NothingStaged("no staged pass")));
    assert_eq!(w.write(&mut pool, 0, &k0, &v0, &slots), Err(KvError::NoOpenPass));
    assert_eq!(w.end_pass(), Err(KvError::NoOpenPass));

    // Staged passes need segments that tile the pass and fit the staging buffer.
    assert!(matches!(w.begin_pass(WriteMode::Staged, &[]), Err(KvError::InvalidSegments(_))));
    let gap = [StagedSegment::new(0..2, vec![1, 2]), StagedSegment::new(3..4, vec![3])];
    assert!(matches!(w.begin_pass(WriteMode::Staged, &gap), Err(KvError::InvalidSegments(_))));
    let short = [StagedSegment::new(0..2, vec![1])];
    assert!(matches!(w.begin_pass(WriteMode::Staged, &short), Err(KvError::InvalidSegments(_))));
    let dup = [StagedSegment::new(0..2, vec![1, 2]), StagedSegment::new(2..3, vec![2])];
    assert!(matches!(w.begin_pass(WriteMode::Staged, &dup), Err(KvError::DuplicateSlot { slot: 2, .. })));
    let far = [StagedSegment::new(0..1, vec![LAYOUT.num_slots()])];
    assert!(matches!(w.begin_pass(WriteMode::Staged, &far), Err(KvError::SlotOutOfRange { .. })));
    let mut small = KvWritePath::new(LAYOUT, 4);
    assert_eq!(
        small.begin_pass(WriteMode::Staged, &segs),
        Err(KvError::TooManyTokens { n_tokens: 9, capacity: 4 })
    );
    assert_eq!(w.mode(), None, "failed begin_pass must not open a pass");

    // Double begin.
    w.begin_pass(WriteMode::Staged, &segs).unwrap();
    assert_eq!(w.begin_pass(WriteMode::Staged, &segs), Err(KvError::PassAlreadyOpen));
    assert_eq!(w.begin_pass(WriteMode::Direct, &[]), Err(KvError::PassAlreadyOpen));

    // Bad writes: layer out of range, wrong shape, slots differing from the pass's, twice.
    assert_eq!(
        w.write(&mut pool, LAYOUT.num_layers, &k0, &v0, &slots),
        Err(KvError::LayerOutOfRange { layer: 3, num_layers: 3 })
    );
    assert!(matches!(w.write(&mut pool, 0, &k0[1..], &v0, &slots), Err(KvError::ShapeMismatch { .. })));
    let mut swapped = slots.clone();
    swapped.swap(0, 1);
    assert_eq!(w.write(&mut pool, 0, &k0, &v0, &swapped), Err(KvError::SlotsMismatch { layer: 0 }));
    w.write(&mut pool, 0, &k0, &v0, &slots).unwrap();
    assert_eq!(w.write(&mut pool, 0, &k0, &v0, &slots), Err(KvError::LayerWrittenTwice { layer: 0 }));

    // Commit before end_pass, end_pass with layers missing: the pass stays open.
    assert!(matches!(w.commit(&mut pool, &[1, 1, 1]), Err(KvError::NothingStaged(_))));
    assert_eq!(w.end_pass(), Err(KvError::LayersNotWritten { missing: vec![1, 2] }));
    for l in 1..LAYOUT.num_layers {
        let (k, v) = layer_kv(l, slots.len());
        w.write(&mut pool, l, &k, &v, &slots).unwrap();
    }
    w.end_pass().unwrap();
    assert_eq!(w.end_pass(), Err(KvError::NoOpenPass));

    // Staged data pending blocks new passes and writes.
    assert_eq!(w.begin_pass(WriteMode::Direct, &[]), Err(KvError::StagedPending));
    assert_eq!(w.write(&mut pool, 0, &k0, &v0, &slots), Err(KvError::NoOpenPass));

    // Bad accepted lengths are refused without touching the pool or the staged data.
    assert!(matches!(w.commit(&mut pool, &[1, 1]), Err(KvError::InvalidAccepted(_))));
    assert!(matches!(w.commit(&mut pool, &[1, 3, 1]), Err(KvError::InvalidAccepted(_))));
    let mut other = CpuKvPool::new(KvLayout { num_layers: 2, ..LAYOUT });
    assert!(matches!(w.commit(&mut other, &[1, 1, 1]), Err(KvError::LayoutMismatch { .. })));
    assert_eq!(snapshot(&pool), before);
    assert!(w.is_pending());

    // The staged data survived the failed commits intact.
    w.commit(&mut pool, &[3, 2, 4]).unwrap();
    for (t, &slot) in slots.iter().enumerate() {
        for l in 0..LAYOUT.num_layers {
            assert_eq!(pool.k(l).to_f32_vec()[slot * TE], kval(l, t, 0));
            assert_eq!(pool.v(l).to_f32_vec()[slot * TE + TE - 1], vval(l, t, TE - 1));
        }
    }
}

#[test]
fn direct_mode_writes_through_per_layer() {
    let mut pool = sentinel_pool();
    let mut w = KvWritePath::new(LAYOUT, 1);
    // Direct passes are not bounded by the staging capacity and need no segments.
    let slots = [8usize, 9, 10, 11, 2];
    w.begin_pass(WriteMode::Direct, &[]).unwrap();
    assert_eq!(w.mode(), Some(WriteMode::Direct));
    for l in 0..LAYOUT.num_layers {
        let (k, v) = layer_kv(l, slots.len());
        w.write(&mut pool, l, &k, &v, &slots).unwrap();
        // Visible immediately, in this layer only.
        for (t, &slot) in slots.iter().enumerate() {
            assert_eq!(pool.k(l).to_f32_vec()[slot * TE + 1], kval(l, t, 1));
            assert_eq!(pool.v(l).to_f32_vec()[slot * TE + 2], vval(l, t, 2));
        }
        for later in l + 1..LAYOUT.num_layers {
            assert_eq!(
                pool.k(later).to_f32_vec()[slots[0] * TE],
                -7.0 - later as f32,
                "layer {l} leaked into layer {later}"
            );
        }
    }
    // Later layers must write the same slots as the first.
    w.end_pass().unwrap();
    assert_eq!(w.mode(), None);
    assert!(matches!(w.commit(&mut pool, &[]), Err(KvError::NothingStaged(_))));

    w.begin_pass(WriteMode::Direct, &[]).unwrap();
    let (k, v) = layer_kv(0, 2);
    w.write(&mut pool, 0, &k, &v, &[0, 1]).unwrap();
    let (k, v) = layer_kv(1, 2);
    assert_eq!(w.write(&mut pool, 1, &k, &v, &[1, 0]), Err(KvError::SlotsMismatch { layer: 1 }));
    assert!(matches!(w.write(&mut pool, 1, &k, &v, &[3, 3]), Err(KvError::SlotsMismatch { .. })));
    w.discard();

    // A direct write with a duplicate or out-of-range slot is refused before anything is written.
    let snap = snapshot(&pool);
    w.begin_pass(WriteMode::Direct, &[]).unwrap();
    assert!(matches!(w.write(&mut pool, 0, &k, &v, &[5, 5]), Err(KvError::DuplicateSlot { slot: 5, .. })));
    assert!(matches!(w.write(&mut pool, 0, &k, &v, &[5, 99]), Err(KvError::SlotOutOfRange { slot: 99, .. })));
    assert_eq!(snapshot(&pool), snap);
}

#[test]
fn copy_on_write_keeps_forks_apart() {
    let bs = LAYOUT.block_size;
    let mut alloc = BlockAllocator::new(LAYOUT.num_blocks, bs);
    let mut pool = CpuKvPool::new(LAYOUT);
    let mut w = KvWritePath::new(LAYOUT, 8);

    // Parent: 6 tokens, so its second block is half full.
    alloc.add_sequence(1, 6).unwrap();
    let parent_slots: Vec<usize> = (0..6).map(|p| alloc.slot(1, p).unwrap()).collect();
    w.begin_pass(WriteMode::Direct, &[]).unwrap();
    write_all_layers(&mut w, &mut pool, &parent_slots);
    w.end_pass().unwrap();

    alloc.fork(1, 2).unwrap();
    let cow = alloc.append(2, 1).unwrap().pop().expect("shared half-full block needs a copy");
    pool.copy_block(cow.src, cow.dst).unwrap();
    alloc.check_invariants().unwrap();

    // The child's new token goes into its private copy, through a staged pass fully accepted.
    let child_slot = alloc.slot(2, 6).unwrap();
    assert_eq!(child_slot / bs, cow.dst as usize);
    let seg = [StagedSegment::new(0..1, vec![child_slot])];
    w.begin_pass(WriteMode::Staged, &seg).unwrap();
    for l in 0..LAYOUT.num_layers {
        let k = vec![0.25 + l as f32; TE];
        w.write(&mut pool, l, &k, &k, &[child_slot]).unwrap();
    }
    w.end_pass().unwrap();
    w.commit(&mut pool, &[1]).unwrap();

    for l in 0..LAYOUT.num_layers {
        let (src_k, src_v) = pool.block_bytes(l, cow.src);
        let (dst_k, dst_v) = pool.block_bytes(l, cow.dst);
        let filled = 2 * LAYOUT.token_bytes(); // the two tokens the parent had in the shared block
        assert_eq!(&dst_k[..filled], &src_k[..filled], "layer {l}: copy lost the parent's tokens");
        assert_eq!(&dst_v[..filled], &src_v[..filled]);
        // The parent's block did not see the child's token.
        assert!(
            src_k[filled..filled + LAYOUT.token_bytes()].iter().all(|&b| b == 0),
            "layer {l}: child wrote into the shared block"
        );
        assert_eq!(pool.k(l).to_f32_vec()[child_slot * TE], 0.25 + l as f32);
    }
    assert!(matches!(pool.copy_block(0, LAYOUT.num_blocks as u32), Err(KvError::BlockOutOfRange { .. })));

    alloc.free_sequence(1).unwrap();
    alloc.free_sequence(2).unwrap();
    assert_eq!(alloc.free_blocks(), alloc.total_blocks());
    alloc.check_invariants().unwrap();
}

/// A speculative step end to end: grow the sequence for the draft, stage, accept a prefix, commit,
/// roll the allocator back to the accepted length. The committed tokens are readable at the
/// sequence's positions and nothing leaks.
#[test]
fn speculative_step_with_rollback() {
    let mut alloc = BlockAllocator::new(LAYOUT.num_blocks, LAYOUT.block_size);
    let mut pool = sentinel_pool();
    let mut w = KvWritePath::new(LAYOUT, 8);
    alloc.add_sequence(7, 3).unwrap();
    let draft = 5;
    alloc.append(7, draft).unwrap();
    let slots: Vec<usize> = (3..3 + draft).map(|p| alloc.slot(7, p).unwrap()).collect();
    w.begin_pass(WriteMode::Staged, &[StagedSegment::new(0..draft, slots.clone())]).unwrap();
    write_all_layers(&mut w, &mut pool, &slots);
    w.end_pass().unwrap();
    let accepted = 2;
    w.commit(&mut pool, &[accepted]).unwrap();
    alloc.truncate(7, 3 + accepted).unwrap();
    alloc.check_invariants().unwrap();
    for l in 0..LAYOUT.num_layers {
        for (t, &slot) in slots.iter().enumerate() {
            let want = if t < accepted { kval(l, t, 0) } else { -7.0 - l as f32 };
            assert_eq!(pool.k(l).to_f32_vec()[slot * TE], want, "layer {l} draft token {t}");
        }
    }
    alloc.free_sequence(7).unwrap();
    assert_eq!(alloc.free_blocks(), alloc.total_blocks());
}

/// Every byte of every layer's K and V.
fn pool_bytes(pool: &CpuKvPool) -> Vec<u8> {
    let l = pool.layout();
    let mut out = Vec::new();
    for layer in 0..l.num_layers {
        for b in 0..l.num_blocks as u32 {
            let (k, v) = pool.block_bytes(layer, b);
            out.extend_from_slice(k);
            out.extend_from_slice(v);
        }
    }
    out
}

/// Values no 16-bit dtype represents exactly (so rounding is exercised), distinct per layer,
/// token and element.
fn inexact_kv(l: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let (k, v) = layer_kv(l, n);
    (k.iter().map(|x| x * 1.000_37 + 0.1).collect(), v.iter().map(|x| x * 0.999_71 - 0.1).collect())
}

/// In every dtype, a staged pass committed in full leaves exactly the bytes a direct pass of the
/// same values leaves: the conversion to the pool's dtype happens once, at the pool, either way.
#[test]
fn every_dtype_direct_and_staged_commit_write_identical_bytes() {
    for dtype in KvDtype::ALL {
        let layout = KvLayout { dtype, ..LAYOUT };
        let segs = segments();
        let slots = pass_slots(&segs);
        let (mut direct, mut staged) = (CpuKvPool::new(layout), CpuKvPool::new(layout));
        let mut w = KvWritePath::new(layout, 16);
        w.begin_pass(WriteMode::Direct, &[]).unwrap();
        for l in 0..layout.num_layers {
            let (k, v) = inexact_kv(l, slots.len());
            w.write(&mut direct, l, &k, &v, &slots).unwrap();
        }
        w.end_pass().unwrap();
        w.begin_pass(WriteMode::Staged, &segs).unwrap();
        for l in 0..layout.num_layers {
            let (k, v) = inexact_kv(l, slots.len());
            w.write(&mut staged, l, &k, &v, &slots).unwrap();
        }
        w.end_pass().unwrap();
        assert!(pool_bytes(&staged).iter().all(|&b| b == 0), "{dtype}: staged data reached the pool");
        w.commit(&mut staged, &[3, 2, 4]).unwrap();
        assert_eq!(pool_bytes(&staged), pool_bytes(&direct), "{dtype}");
        // And those bytes are the values converted to the dtype, at each token's own slot.
        let te = layout.token_elems();
        for l in 0..layout.num_layers {
            let (k, v) = inexact_kv(l, slots.len());
            for (t, &slot) in slots.iter().enumerate() {
                let (block, off) = ((slot / layout.block_size) as u32, slot % layout.block_size);
                let (kb, vb) = direct.block_bytes(l, block);
                let at = off * layout.token_bytes()..(off + 1) * layout.token_bytes();
                let mut want = vec![0u8; layout.token_bytes()];
                dtype.encode(&k[t * te..(t + 1) * te], &mut want);
                assert_eq!(&kb[at.clone()], want.as_slice(), "{dtype} layer {l} token {t} K");
                dtype.encode(&v[t * te..(t + 1) * te], &mut want);
                assert_eq!(&vb[at], want.as_slice(), "{dtype} layer {l} token {t} V");
            }
        }
        if dtype != KvDtype::F32 {
            let (k, _) = inexact_kv(0, 1);
            assert_ne!(direct.read_token(0, slots[0]).unwrap().0, k[..te], "{dtype}: values were rounded");
        }
    }
}

/// In every dtype, a partly accepted commit writes the accepted tokens' bytes and leaves every
/// rejected token's slot as it was.
#[test]
fn every_dtype_rejected_tokens_never_reach_the_pool() {
    for dtype in KvDtype::ALL {
        let layout = KvLayout { dtype, ..LAYOUT };
        let mut pool = CpuKvPool::new(layout);
        let marker = vec![-3.5f32; layout.token_elems()];
        for l in 0..layout.num_layers {
            for slot in 0..layout.num_slots() {
                pool.write_token(l, slot, &marker, &marker).unwrap();
            }
        }
        let before = pool_bytes(&pool);
        let segs = segments();
        let slots = pass_slots(&segs);
        let mut w = KvWritePath::new(layout, 16);
        w.begin_pass(WriteMode::Staged, &segs).unwrap();
        for l in 0..layout.num_layers {
            let (k, v) = inexact_kv(l, slots.len());
            w.write(&mut pool, l, &k, &v, &slots).unwrap();
        }
        w.end_pass().unwrap();
        w.commit(&mut pool, &[1, 0, 2]).unwrap();
        let accepted_slots = [4usize, 20, 21];
        for l in 0..layout.num_layers {
            for slot in 0..layout.num_slots() {
                let (k, v) = pool.read_token(l, slot).unwrap();
                if accepted_slots.contains(&slot) {
                    assert_ne!(k, marker, "{dtype} layer {l} slot {slot}: accepted token missing");
                } else {
                    assert_eq!((k, v), (marker.clone(), marker.clone()), "{dtype} layer {l} slot {slot}");
                }
            }
        }
        assert_ne!(pool_bytes(&pool), before);
    }
}

/// A write path and a pool of different dtypes refuse each other, naming the field.
#[test]
fn a_pool_of_another_dtype_is_refused_by_name() {
    let mut pool = CpuKvPool::new(KvLayout { dtype: KvDtype::Bf16, ..LAYOUT });
    let mut w = KvWritePath::new(KvLayout { dtype: KvDtype::F16, ..LAYOUT }, 4);
    w.begin_pass(WriteMode::Direct, &[]).unwrap();
    let (k, v) = layer_kv(0, 1);
    let e = w.write(&mut pool, 0, &k, &v, &[0]).unwrap_err();
    assert!(matches!(e, KvError::LayoutMismatch { .. }));
    let msg = e.to_string();
    assert!(msg.contains("dtype: bf16 vs f16") && msg.contains("tandem-bf16-lkv-v1"), "{msg}");
    assert!(pool_bytes(&pool).iter().all(|&b| b == 0));
}
