//! Property test of the block allocator with layer groups whose windows give pages back
//! (`kv::groups`): random sequences of operations (growing, sliding, truncating, forking,
//! registering and finding cached prefixes, reserving and adopting) on pools with one global and
//! two window groups, a single window group, and two different windows. After every operation the
//! invariant checker passes (it checks that a table holds a page exactly where a window still
//! reaches); a failed operation leaves the allocator exactly as it was; a sequence holds the pages
//! `pages_held` counts for its length and first query position; and freeing everything gives
//! every page back.

use std::collections::BTreeMap;

use proptest::prelude::*;
use tandem_engine::kv::groups::{kept, transfer_from};
use tandem_engine::kv::prefix::{block_hashes, chain_root};
use tandem_engine::kv::{BlockAllocator, KvError, SeqId, NO_PAGE};

const BS: usize = 2;
const PAGES: usize = 60;
const SEQS: u64 = 5;

#[derive(Debug, Clone)]
enum Op {
    Add(SeqId, usize),
    Append(SeqId, usize),
    /// Slide to this fraction (in 1/8) of the sequence's length.
    Slide(SeqId, usize),
    Truncate(SeqId, usize),
    Fork(SeqId, SeqId),
    Free(SeqId),
    /// Register every full block of the sequence under the hashes of its tokens.
    Register(SeqId),
    /// A local prefix hit for a prompt of this many tokens of the shared token stream.
    Cached(SeqId, usize),
    /// A reservation for a prompt of this many tokens of the shared token stream, adopted at once.
    Reserve(SeqId, usize),
}

fn op() -> impl Strategy<Value = Op> {
    let seq = 0..SEQS;
    prop_oneof![
        3 => (seq.clone(), 0..24usize).prop_map(|(s, n)| Op::Add(s, n)),
        5 => (seq.clone(), 1..9usize).prop_map(|(s, n)| Op::Append(s, n)),
        4 => (seq.clone(), 0..9usize).prop_map(|(s, f)| Op::Slide(s, f)),
        2 => (seq.clone(), 0..28usize).prop_map(|(s, n)| Op::Truncate(s, n)),
        1 => (seq.clone(), seq.clone()).prop_map(|(p, c)| Op::Fork(p, c)),
        2 => seq.clone().prop_map(Op::Free),
        2 => seq.clone().prop_map(Op::Register),
        2 => (seq.clone(), 1..30usize).prop_map(|(s, n)| Op::Cached(s, n)),
        2 => (seq, 1..30usize).prop_map(|(s, n)| Op::Reserve(s, n)),
    ]
}

/// Every sequence's tokens are a prefix of one stream, so that cached prefixes are found.
fn stream(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 % 13).collect()
}

/// What the test knows independently of the allocator: each sequence's length and first query.
#[derive(Debug, Default, Clone)]
struct Model {
    seqs: BTreeMap<SeqId, (usize, usize)>,
}

fn apply(a: &mut BlockAllocator, m: &mut Model, op: &Op) -> Result<(), KvError> {
    let root = chain_root("props", "");
    match *op {
        Op::Add(s, n) => {
            let r = a.add_sequence(s, n).map(|_| ());
            if r.is_ok() {
                m.seqs.insert(s, (n, 0));
            }
            r
        }
        Op::Append(s, n) => {
            let r = a.append(s, n).map(|_| ());
            if r.is_ok() {
                m.seqs.get_mut(&s).unwrap().0 += n;
            }
            r
        }
        Op::Slide(s, eighths) => {
            let len = m.seqs.get(&s).map_or(0, |x| x.0);
            let to = len * eighths / 8;
            let r = a.slide(s, to).map(|_| ());
            if r.is_ok() {
                let e = m.seqs.get_mut(&s).unwrap();
                e.1 = e.1.max(to);
            }
            r
        }
        Op::Truncate(s, n) => {
            let r = a.truncate(s, n);
            if r.is_ok() {
                let e = m.seqs.get_mut(&s).unwrap();
                *e = (n, e.1.min(n));
            }
            r
        }
        Op::Fork(p, c) => {
            let r = a.fork(p, c);
            if r.is_ok() {
                let e = m.seqs[&p];
                m.seqs.insert(c, e);
            }
            r
        }
        Op::Free(s) => {
            let r = a.free_sequence(s);
            if r.is_ok() {
                m.seqs.remove(&s);
            }
            r
        }
        Op::Register(s) => {
            let Some(&(len, _)) = m.seqs.get(&s) else { return a.register(s, 0, root).map(|_| ()) };
            let hashes = block_hashes(root, &stream(len)[..len / BS * BS], BS);
            for (i, &h) in hashes.iter().enumerate() {
                a.register(s, i, h)?;
            }
            Ok(())
        }
        Op::Cached(s, n) => {
            let hashes = block_hashes(root, &stream(n)[..n / BS * BS], BS);
            let hit = a.lookup_table(&hashes, None);
            let h = hit.len() / a.groups();
            // The hit holds a page exactly where a query from its end reads one.
            for (j, &b) in hit.iter().enumerate() {
                assert_eq!(b != NO_PAGE, kept(a.windows()[j % a.groups()], j / a.groups(), h * BS, BS));
            }
            let r = a.add_cached_sequence(s, &hit);
            if r.is_ok() {
                m.seqs.insert(s, (h * BS, h * BS));
            }
            r
        }
        Op::Reserve(s, n) => {
            if m.seqs.contains_key(&s) || n < 2 {
                return Ok(());
            }
            let reusable = (n - 1) / BS;
            let hashes = block_hashes(root, &stream(n)[..reusable * BS], BS);
            let hit = a.lookup_table(&hashes, Some(n));
            let pinned: Vec<_> = hit.into_iter().filter(|&b| b != NO_PAGE).collect();
            a.pin(&pinned)?;
            let raw = match a.alloc_blocks(a.kept_pages(n, 0) - pinned.len()) {
                Ok(raw) => raw,
                Err(e) => {
                    a.unpin(&pinned).unwrap();
                    return Err(e);
                }
            };
            a.adopt(s, &pinned, &raw, n).expect("a reservation's pages adopt");
            m.seqs.insert(s, (n, transfer_from(n)));
            Ok(())
        }
    }
}

fn check(a: &BlockAllocator, m: &Model) {
    a.check_invariants().unwrap_or_else(|e| panic!("{e}"));
    for (&s, &(len, from)) in &m.seqs {
        assert_eq!(a.seq_len(s), Some(len), "sequence {s}");
        assert_eq!(
            a.held(s),
            a.pages_held(len, from),
            "sequence {s}: pages held at length {len}, from {from}"
        );
        assert!(a.holds_from(s, from));
    }
}

fn run(windows: &[Option<usize>], ops: &[Op], caching: bool) {
    let mut a = BlockAllocator::with_windows(PAGES, BS, windows).unwrap();
    a.set_caching(caching);
    let mut m = Model::default();
    for op in ops {
        let before = (a.clone(), m.clone());
        // Registering and reserving are several allocator calls (a failed reservation's
        // unpinning refreshes the cached pages' recency, as the reservation table's does).
        if apply(&mut a, &mut m, op).is_err() && !matches!(op, Op::Register(_) | Op::Reserve(..)) {
            assert_eq!(a, before.0, "{op:?} failed but changed the allocator");
            m = before.1;
        }
        check(&a, &m);
    }
    let ids: Vec<SeqId> = a.sequences().collect();
    for s in ids {
        a.free_sequence(s).unwrap();
    }
    let st = a.stats();
    assert_eq!((st.used, st.free + st.cached), (0, st.total));
    a.check_invariants().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn windowed_pools_keep_their_invariants(ops in prop::collection::vec(op(), 1..80), caching: bool) {
        run(&[None, Some(5), Some(5)], &ops, caching);
        run(&[Some(3)], &ops, caching);
        run(&[None, Some(4), Some(9)], &ops, caching);
    }
}

#[test]
fn a_slide_gives_back_exactly_the_pages_no_query_reads() {
    let mut a = BlockAllocator::with_windows(PAGES, BS, &[None, Some(5)]).unwrap();
    a.add_sequence(1, 12).unwrap();
    assert_eq!(a.held(1), 12);
    // A query at 10 reads 6..=10: blocks 0..3 (positions 0..6) are dead for the window group.
    assert_eq!(a.slide(1, 10).unwrap(), 3);
    let t = a.block_table(1).unwrap();
    assert!(t.iter().enumerate().all(|(j, &b)| (b == NO_PAGE) == (j % 2 == 1 && j / 2 < 3)), "{t:?}");
    // Going back is refused where a page is gone, allowed where none is.
    assert!(matches!(a.truncate(1, 6), Err(KvError::InvalidLength { .. })));
    a.truncate(1, 11).unwrap();
    assert!(!a.holds_from(1, 9) && a.holds_from(1, 10));
    a.check_invariants().unwrap();
}

#[test]
fn cache_digests_name_only_the_prompts_blocks() {
    let mut a = BlockAllocator::with_windows(PAGES, BS, &[None, Some(5), Some(5)]).unwrap();
    a.set_caching(true);
    a.add_sequence(1, 8).unwrap();
    let hashes = block_hashes(chain_root("props", ""), &stream(8), BS);
    for (i, &h) in hashes.iter().enumerate() {
        assert!(a.register(1, i, h).unwrap());
    }
    // Every page of the four blocks is registered, but digests name the blocks' own hashes.
    let mut named = a.registered_hashes(100);
    named.sort();
    let mut want = hashes.clone();
    want.sort();
    assert_eq!(named, want);
    a.free_sequence(1).unwrap();
    assert_eq!(a.stats().cached, 12);
    assert_eq!(a.registered_hashes(100).len(), 4);
}
