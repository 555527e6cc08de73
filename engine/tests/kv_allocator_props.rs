//! Property test of the KV block allocator: random sequences of valid and invalid operations,
//! checked against a small reference model. After every operation the invariant checker must pass;
//! an operation that fails must leave the allocator exactly as it was; appended tokens must land in
//! blocks no other holder shares (copy-on-write); freeing everything must return free == total.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;
use tandem_engine::kv::{BlockAllocator, BlockId, KvError, SeqId};

#[derive(Debug, Clone)]
enum Op {
    Add(SeqId, usize),
    Append(SeqId, usize),
    Truncate(SeqId, usize),
    Fork(SeqId, SeqId),
    Free(SeqId),
    Alloc(usize),
    /// Release the reservation at this index (modulo the number held), if any.
    Release(usize),
    /// Release an arbitrary id, possibly free, out of range or owned by a sequence.
    ReleaseAny(BlockId),
    /// Release a reservation with its first block listed twice.
    ReleaseDup(usize),
    /// Adopt the reservation at this index as a sequence of this many tokens.
    Adopt(usize, SeqId, usize),
}

const SEQS: u64 = 6;

fn op(total: usize) -> impl Strategy<Value = Op> {
    let seq = 0..SEQS;
    prop_oneof![
        3 => (seq.clone(), 0..20usize).prop_map(|(s, n)| Op::Add(s, n)),
        4 => (seq.clone(), 0..9usize).prop_map(|(s, n)| Op::Append(s, n)),
        2 => (seq.clone(), 0..24usize).prop_map(|(s, n)| Op::Truncate(s, n)),
        2 => (seq.clone(), seq.clone()).prop_map(|(p, c)| Op::Fork(p, c)),
        2 => seq.clone().prop_map(Op::Free),
        2 => (0..5usize).prop_map(Op::Alloc),
        2 => any::<usize>().prop_map(Op::Release),
        1 => (0..(total as BlockId + 4)).prop_map(Op::ReleaseAny),
        1 => any::<usize>().prop_map(Op::ReleaseDup),
        1 => (any::<usize>(), seq, 0..20usize).prop_map(|(i, s, n)| Op::Adopt(i, s, n)),
    ]
}

/// What the test knows independently of the allocator.
#[derive(Debug, Default, Clone)]
struct Model {
    lens: BTreeMap<SeqId, usize>,
    raw: Vec<Vec<BlockId>>,
}

fn holders_excluding(a: &BlockAllocator, model: &Model, seq: SeqId, block: BlockId) -> usize {
    let in_tables =
        a.sequences().filter(|&s| s != seq).filter(|&s| a.block_table(s).unwrap().contains(&block)).count();
    let in_raw = model.raw.iter().filter(|r| r.contains(&block)).count();
    in_tables + in_raw
}

/// Applies `op` to the allocator and the model; returns the allocator's result as `Err` if it
/// failed (the caller then checks nothing changed), and asserts the expected error class.
fn apply(a: &mut BlockAllocator, m: &mut Model, op: &Op) -> Result<(), KvError> {
    let bs = a.block_size();
    match *op {
        Op::Add(s, n) => {
            let r = a.add_sequence(s, n).map(|t| t.len());
            match (&r, m.lens.contains_key(&s)) {
                (Err(KvError::SequenceExists { seq }), true) => assert_eq!(*seq, s),
                (Err(KvError::OutOfBlocks { needed, free }), false) => {
                    assert_eq!(*needed, n.div_ceil(bs));
                    assert!(needed > free);
                }
                (Ok(blocks), false) => {
                    assert_eq!(*blocks, n.div_ceil(bs));
                    m.lens.insert(s, n);
                }
                other => panic!("add({s},{n}): unexpected {other:?}"),
            }
            r.map(|_| ())
        }
        Op::Append(s, n) => {
            let old_table = a.block_table(s).map(<[BlockId]>::to_vec);
            let r = a.append(s, n);
            match (&r, m.lens.get(&s).copied()) {
                (Err(KvError::UnknownSequence { seq }), None) => assert_eq!(*seq, s),
                (Err(KvError::OutOfBlocks { needed, free }), Some(_)) => assert!(needed > free),
                (Ok(cow), Some(old)) => {
                    let new = old + n;
                    m.lens.insert(s, new);
                    let table = a.block_table(s).unwrap();
                    assert!(cow.len() <= 1, "one layer group: at most one copy");
                    if let Some(c) = cow.first() {
                        let old_table = old_table.unwrap();
                        assert_eq!(*old_table.last().unwrap(), c.src, "copy source is the old last block");
                        assert_ne!(c.src, c.dst);
                        assert!(old % bs != 0, "copy only for a partially filled block");
                        assert!(!old_table.contains(&c.dst), "copy target is a new block");
                    }
                    // Every block the new tokens land in is held by this sequence alone.
                    for pos in old..new {
                        let b = table[pos / bs];
                        assert_eq!(holders_excluding(a, m, s, b), 0, "append wrote into shared block {b}");
                    }
                }
                other => panic!("append({s},{n}): unexpected {other:?}"),
            }
            r.map(|_| ())
        }
        Op::Truncate(s, n) => {
            let r = a.truncate(s, n);
            match (&r, m.lens.get(&s).copied()) {
                (Err(KvError::UnknownSequence { .. }), None) => {}
                (Err(KvError::InvalidLength { requested, current, .. }), Some(len)) => {
                    assert_eq!((*requested, *current), (n, len));
                    assert!(n > len);
                }
                (Ok(()), Some(len)) => {
                    assert!(n <= len);
                    m.lens.insert(s, n);
                }
                other => panic!("truncate({s},{n}): unexpected {other:?}"),
            }
            r
        }
        Op::Fork(p, c) => {
            let r = a.fork(p, c);
            match (&r, m.lens.get(&p).copied(), m.lens.contains_key(&c)) {
                (Err(KvError::SequenceExists { seq }), _, true) => assert_eq!(*seq, c),
                (Err(KvError::UnknownSequence { seq }), None, false) => assert_eq!(*seq, p),
                (Ok(()), Some(len), false) => {
                    assert_eq!(a.block_table(p), a.block_table(c));
                    m.lens.insert(c, len);
                }
                other => panic!("fork({p},{c}): unexpected {other:?}"),
            }
            r
        }
        Op::Free(s) => {
            let r = a.free_sequence(s);
            match (&r, m.lens.remove(&s)) {
                (Err(KvError::UnknownSequence { .. }), None) | (Ok(()), Some(_)) => {}
                other => panic!("free({s}): unexpected {other:?}"),
            }
            r
        }
        Op::Alloc(n) => {
            let free = a.free_blocks();
            let r = a.alloc_blocks(n);
            match &r {
                Ok(blocks) => {
                    assert_eq!(blocks.len(), n);
                    assert_eq!(blocks.iter().collect::<BTreeSet<_>>().len(), n, "distinct blocks");
                    m.raw.push(blocks.clone());
                }
                Err(KvError::OutOfBlocks { needed, .. }) => assert!(*needed > free),
                Err(e) => panic!("alloc({n}): unexpected {e:?}"),
            }
            r.map(|_| ())
        }
        Op::Release(i) => {
            if m.raw.is_empty() {
                return Ok(());
            }
            let blocks = m.raw.remove(i % m.raw.len());
            a.release_blocks(&blocks).expect("releasing a live reservation");
            Ok(())
        }
        Op::ReleaseAny(b) => {
            let r = a.release_blocks(&[b]);
            let raw_idx = m.raw.iter().position(|r| r.contains(&b));
            match (&r, raw_idx) {
                (Ok(()), Some(i)) => {
                    m.raw[i].retain(|&x| x != b);
                    if m.raw[i].is_empty() {
                        m.raw.remove(i);
                    }
                }
                (Err(KvError::ForeignBlock { .. }), None) => {
                    let in_table = a.sequences().any(|s| a.block_table(s).unwrap().contains(&b));
                    assert!(b as usize >= a.total_blocks() || in_table, "foreign block {b}");
                }
                (Err(KvError::DoubleFree { .. }), None) => {
                    let in_table = a.sequences().any(|s| a.block_table(s).unwrap().contains(&b));
                    assert!((b as usize) < a.total_blocks() && !in_table, "block {b} is not free");
                }
                other => panic!("release_any({b}): unexpected {other:?}"),
            }
            r
        }
        Op::ReleaseDup(i) => {
            let Some(blocks) = (!m.raw.is_empty()).then(|| m.raw[i % m.raw.len()].clone()) else {
                return Ok(());
            };
            let Some(&first) = blocks.first() else { return Ok(()) };
            let mut dup = blocks.clone();
            dup.push(first);
            let r = a.release_blocks(&dup);
            assert_eq!(r, Err(KvError::DoubleFree { block: first }));
            r
        }
        Op::Adopt(i, s, n) => {
            if m.raw.is_empty() {
                return Ok(());
            }
            let idx = i % m.raw.len();
            let blocks = m.raw[idx].clone();
            let r = a.adopt(s, &[], &blocks, n);
            match (&r, m.lens.contains_key(&s)) {
                (Err(KvError::SequenceExists { .. }), true) => {}
                (Err(KvError::BlockCountMismatch { .. }), false) => assert_ne!(blocks.len(), n.div_ceil(bs)),
                (Ok(()), false) => {
                    assert_eq!(a.block_table(s).unwrap(), blocks.as_slice());
                    m.raw.remove(idx);
                    m.lens.insert(s, n);
                }
                other => panic!("adopt({s},{n}): unexpected {other:?}"),
            }
            r
        }
    }
}

fn check_model(a: &BlockAllocator, m: &Model) {
    a.check_invariants().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.sequences().collect::<Vec<_>>(), m.lens.keys().copied().collect::<Vec<_>>());
    for (&s, &len) in &m.lens {
        assert_eq!(a.seq_len(s), Some(len));
        assert_eq!(a.block_table(s).unwrap().len(), a.blocks_for(len));
    }
    let stats = a.stats();
    assert_eq!(stats.raw_reserved, m.raw.iter().map(Vec::len).sum::<usize>());
    assert_eq!(stats.free + stats.used, stats.total);
    let owned: BTreeSet<BlockId> = m
        .lens
        .keys()
        .flat_map(|&s| a.block_table(s).unwrap().iter().copied())
        .chain(m.raw.iter().flatten().copied())
        .collect();
    assert_eq!(owned.len(), stats.used, "used blocks are exactly those the model's holders hold");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn allocator_keeps_invariants(
        total in 1usize..14,
        bs in 1usize..5,
        ops in prop::collection::vec(op(14), 1..80),
    ) {
        let mut a = BlockAllocator::new(total, bs);
        let mut m = Model::default();
        for op in &ops {
            let before = a.clone();
            let model_before = m.clone();
            if let Err(e) = apply(&mut a, &mut m, op) {
                prop_assert_eq!(&a, &before, "failed {:?} ({}) changed the allocator", op, e);
                prop_assert_eq!(&m.lens, &model_before.lens);
                prop_assert_eq!(&m.raw, &model_before.raw);
                prop_assert!(!e.to_string().is_empty());
            }
            check_model(&a, &m);
        }
        for s in m.lens.keys().copied().collect::<Vec<_>>() {
            a.free_sequence(s).unwrap();
        }
        for r in m.raw.drain(..) {
            a.release_blocks(&r).unwrap();
        }
        prop_assert_eq!(a.free_blocks(), a.total_blocks());
        prop_assert_eq!(a.stats().sequences, 0);
        a.check_invariants().unwrap();
    }
}

/// The lowest free ids go first, so two allocators fed the same operations hand out the same
/// blocks (KV-parity tests compare block contents by id).
#[test]
fn allocation_is_deterministic() {
    let run = || {
        let mut a = BlockAllocator::new(16, 4);
        a.add_sequence(1, 9).unwrap();
        a.add_sequence(2, 3).unwrap();
        a.free_sequence(1).unwrap();
        a.fork(2, 3).unwrap();
        a.append(3, 6).unwrap();
        let raw = a.alloc_blocks(2).unwrap();
        (a.block_table(2).unwrap().to_vec(), a.block_table(3).unwrap().to_vec(), raw)
    };
    assert_eq!(run(), run());
    assert_eq!(run().0, vec![3]);
}
