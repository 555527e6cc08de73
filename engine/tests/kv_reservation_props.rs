//! Property test of the reservation table over a real block allocator (prefix caching on):
//! random interleavings of reserving (with and without a cached prefix), transfers beginning,
//! completing and failing, releases by reservation id and by request id (also before the
//! reservation exists), leases running out as time advances, adoption, cancellation of adopted
//! sequences, and the engine thread catching up with ended reservations.
//!
//! The test keeps its own model of what each reservation should be (state, lease, blocks) and of
//! each adopted sequence, predicts every transition's answer, and after every operation checks:
//! the table answers as the model says; no block has two owners (a raw block belongs to one
//! reservation and no table or pin) and none is orphaned (the allocator's used blocks are
//! exactly those some reservation or sequence holds); the allocator's invariants hold and
//! free + cached + used == total; the table agrees with the allocator. At the end, after every
//! transfer ended, everything was released and the sequences cancelled, every block is free or
//! cached.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use tandem_engine::kv::prefix::{block_hashes, chain_root, reusable_blocks, BlockHash};
use tandem_engine::kv::reservation::{
    Completion, ReservationError, ReservationId, ReservationState, ReservationTable, ReservedBlocks,
};
use tandem_engine::kv::{BlockAllocator, BlockId, KvError, SeqId};

const BS: usize = 4;
const TOTAL: usize = 24;
const LEASE: Duration = Duration::from_millis(100);

/// Prompt `i`: one of three shared leading parts (2 or 3 blocks), then tokens of its own.
fn prompt(i: usize, extra: usize) -> Vec<u32> {
    let family = (i % 3) as u32;
    let mut t: Vec<u32> = (0..(8 + 4 * (i % 2) as u32)).map(|k| family * 100 + k).collect();
    t.extend((0..extra as u32).map(|k| 1000 + i as u32 * 50 + k));
    t
}

fn root() -> BlockHash {
    chain_root("model", "")
}

/// Request id `q`: five named requests and the empty id (a reservation made without one).
fn request(q: usize) -> String {
    if q % 6 == 5 {
        String::new()
    } else {
        format!("req{}", q % 6)
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Reserve for request `q` and prompt `i` with `extra` tokens, pinning its cached prefix or not.
    Reserve { q: usize, i: usize, extra: usize, cached: bool },
    /// A transfer opens for reservation `r` (an index into every id ever granted, or unknown).
    Begin(usize),
    /// The transfer into `r` completes.
    Complete(usize),
    /// The transfer into `r` fails.
    Abort(usize),
    /// Release by reservation id.
    ReleaseId(usize),
    /// Release by request id (possibly before its reservation exists).
    ReleaseRequest(usize),
    /// Time advances by this many milliseconds and expired leases end.
    Advance(u64),
    /// Adopt with `short` tokens fewer than the blocks hold (less than one block): when `own`, a
    /// Filled reservation (the `r`th) for its own request, else `r` for request `q`.
    Adopt { r: usize, q: usize, own: bool, short: usize },
    /// Cancel adopted sequence `s` (an index into the live ones).
    Cancel(usize),
    /// The engine thread returns the blocks of ended reservations.
    Reclaim,
    /// A sequence computes prompt `i` and ends, leaving its full blocks cached.
    Warm(usize, usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..6usize, 0..6usize, 0..9usize, any::<bool>())
            .prop_map(|(q, i, extra, cached)| Op::Reserve { q, i, extra, cached }),
        4 => any::<usize>().prop_map(Op::Begin),
        3 => any::<usize>().prop_map(Op::Complete),
        1 => any::<usize>().prop_map(Op::Abort),
        2 => any::<usize>().prop_map(Op::ReleaseId),
        2 => (0..6usize).prop_map(Op::ReleaseRequest),
        2 => (0..60u64).prop_map(Op::Advance),
        3 => (any::<usize>(), 0..6usize, any::<bool>(), 0..BS).prop_map(|(r, q, own, short)| Op::Adopt { r, q, own, short }),
        2 => any::<usize>().prop_map(Op::Cancel),
        2 => Just(Op::Reclaim),
        2 => (0..6usize, 0..9usize).prop_map(|(i, e)| Op::Warm(i, e)),
    ]
}

/// What the test expects of a live reservation.
#[derive(Debug, Clone)]
struct Expect {
    request: String,
    tokens: Vec<u32>,
    blocks: ReservedBlocks,
    state: ReservationState,
    deadline: Option<Instant>,
}

struct World {
    alloc: BlockAllocator,
    table: ReservationTable,
    now: Instant,
    /// Every id ever granted, in order (ops pick from it, plus one never granted).
    granted: Vec<ReservationId>,
    live: BTreeMap<ReservationId, Expect>,
    /// Blocks of ended reservations the table still owns.
    ending: Vec<ReservedBlocks>,
    /// Request ids remembered as released early, until when.
    early: HashMap<String, Instant>,
    /// Adopted sequences and their tokens.
    seqs: BTreeMap<SeqId, Vec<u32>>,
    next_seq: SeqId,
}

impl World {
    fn new() -> World {
        let mut alloc = BlockAllocator::new(TOTAL, BS);
        alloc.set_caching(true);
        World {
            alloc,
            table: ReservationTable::new(LEASE),
            now: Instant::now(),
            granted: Vec::new(),
            live: BTreeMap::new(),
            ending: Vec::new(),
            early: HashMap::new(),
            seqs: BTreeMap::new(),
            next_seq: 1,
        }
    }

    /// The id op index `r` names: mostly a live one, else any ever granted or one never granted.
    fn pick(&self, r: usize) -> ReservationId {
        if r % 4 != 0 && !self.live.is_empty() {
            return *self.live.keys().nth((r / 4) % self.live.len()).unwrap();
        }
        match r % (self.granted.len() + 1) {
            i if i < self.granted.len() => self.granted[i],
            _ => 1_000_000,
        }
    }

    fn end(&mut self, id: ReservationId) {
        let e = self.live.remove(&id).expect("ending a live reservation");
        self.ending.push(e.blocks);
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Reserve { q, i, extra, cached } => self.reserve(&request(q), prompt(i, extra), cached),
            Op::Begin(r) => {
                let id = self.pick(r);
                let got = self.table.begin(id);
                match self.live.get_mut(&id) {
                    None => assert_eq!(got, Err(ReservationError::Unknown(id))),
                    Some(e) => match e.state {
                        ReservationState::Reserved => {
                            assert_eq!(got, Ok(e.blocks.raw.clone()));
                            e.state = ReservationState::Filling { release_when_done: false };
                            e.deadline = None;
                        }
                        ReservationState::Filling { .. } => {
                            assert_eq!(got, Err(ReservationError::AlreadyFilling(id)))
                        }
                        ReservationState::Filled => assert_eq!(got, Err(ReservationError::AlreadyFilled(id))),
                    },
                }
            }
            Op::Complete(r) => {
                let id = self.pick(r);
                let got = self.table.complete(id, self.now);
                let want = match self.live.get(&id).map(|e| e.state) {
                    Some(ReservationState::Filling { release_when_done: false }) => {
                        let e = self.live.get_mut(&id).unwrap();
                        e.state = ReservationState::Filled;
                        e.deadline = Some(self.now + LEASE);
                        Completion::Filled
                    }
                    Some(ReservationState::Filling { release_when_done: true }) => {
                        self.end(id);
                        Completion::Ended
                    }
                    _ => Completion::Ignored,
                };
                assert_eq!(got, want);
            }
            Op::Abort(r) => {
                let id = self.pick(r);
                let got = self.table.abort(id);
                let filling =
                    matches!(self.live.get(&id).map(|e| e.state), Some(ReservationState::Filling { .. }));
                assert_eq!(got, filling);
                if filling {
                    self.end(id);
                }
            }
            Op::ReleaseId(r) => {
                let id = self.pick(r);
                self.release(id, "");
            }
            Op::ReleaseRequest(q) => self.release(0, &request(q)),
            Op::Advance(ms) => {
                self.now += Duration::from_millis(ms);
                let got: Vec<ReservationId> = self.table.expire(self.now).into_iter().map(|x| x.id).collect();
                let want: Vec<ReservationId> = self
                    .live
                    .iter()
                    .filter(|(_, e)| e.deadline.is_some_and(|d| d <= self.now))
                    .map(|(id, _)| *id)
                    .collect();
                assert_eq!(got, want, "expired reservations");
                for id in want {
                    self.end(id);
                }
            }
            Op::Adopt { r, q, own, short } => {
                let filled: Vec<ReservationId> = self
                    .live
                    .iter()
                    .filter(|(_, e)| e.state == ReservationState::Filled)
                    .map(|(id, _)| *id)
                    .collect();
                let id = if own && !filled.is_empty() { filled[r % filled.len()] } else { self.pick(r) };
                self.adopt(id, q, own, short)
            }
            Op::Cancel(s) => {
                if self.seqs.is_empty() {
                    return;
                }
                let seq = *self.seqs.keys().nth(s % self.seqs.len()).unwrap();
                self.seqs.remove(&seq);
                self.alloc.free_sequence(seq).unwrap();
            }
            Op::Reclaim => {
                assert_eq!(self.table.reclaim(&mut self.alloc).unwrap(), self.ending.len());
                self.ending.clear();
            }
            Op::Warm(i, extra) => {
                let tokens = prompt(i, extra);
                if !self.alloc.can_allocate(tokens.len()) {
                    return;
                }
                let seq = self.next_seq;
                self.next_seq += 1;
                let fresh = self.alloc.add_sequence(seq, tokens.len()).unwrap().to_vec();
                self.check_fresh(&fresh);
                for (k, h) in block_hashes(root(), &tokens, BS).into_iter().enumerate() {
                    self.alloc.register(seq, k, h).unwrap();
                }
                self.alloc.free_sequence(seq).unwrap();
            }
        }
    }

    fn reserve(&mut self, req: &str, tokens: Vec<u32>, cached: bool) {
        let pinned = if cached {
            let n = reusable_blocks(tokens.len(), BS);
            self.alloc.lookup(&block_hashes(root(), &tokens[..n * BS], BS))
        } else {
            Vec::new()
        };
        let raw = self.alloc.blocks_for(tokens.len()) - pinned.len();
        let got = self.table.reserve(&mut self.alloc, req, pinned.clone(), raw, self.now);
        // Whatever the answer, ended reservations' blocks went back first.
        self.ending.clear();
        let early = !req.is_empty() && self.early.remove(req).is_some_and(|until| self.now < until);
        match got {
            Err(ReservationError::ReleasedEarly(r)) => {
                assert!(early, "refused as released early without a remembered release");
                assert_eq!(r, req);
            }
            Err(ReservationError::Kv(KvError::OutOfBlocks { .. })) => {
                assert!(!early);
                // Pinning a cached block nobody holds takes it from the available ones too.
                let cost = raw + self.alloc.unreferenced(&pinned);
                assert!(
                    cost > self.alloc.available_blocks(),
                    "refused needing {cost} of {:?}",
                    self.alloc.stats()
                );
            }
            Err(e) => panic!("unexpected refusal: {e}"),
            Ok(g) => {
                assert!(!early, "a request released early got a reservation");
                assert_eq!(g.cached_blocks, pinned.len());
                assert_eq!(g.blocks.len(), raw);
                assert!(!self.granted.contains(&g.id), "ids are never reused");
                self.granted.push(g.id);
                let fresh = g.blocks.clone();
                self.live.insert(
                    g.id,
                    Expect {
                        request: req.to_owned(),
                        tokens,
                        blocks: ReservedBlocks { pinned, raw: g.blocks },
                        state: ReservationState::Reserved,
                        deadline: Some(self.now + LEASE),
                    },
                );
                self.check_fresh(&fresh);
            }
        }
    }

    fn release(&mut self, id: ReservationId, req: &str) {
        let got = self.table.release(id, req, self.now);
        let ids: Vec<ReservationId> = self
            .live
            .iter()
            .filter(|(rid, e)| (id != 0 && **rid == id) || (!req.is_empty() && e.request == req))
            .map(|(rid, _)| *rid)
            .collect();
        let remembered = ids.is_empty() && id == 0 && !req.is_empty();
        assert_eq!(got.remembered, remembered);
        if remembered {
            let now = self.now;
            self.early.retain(|_, until| now < *until);
            self.early.insert(req.to_owned(), now + LEASE);
        }
        let (mut ended, mut marked) = (Vec::new(), Vec::new());
        for rid in ids {
            let e = self.live.get_mut(&rid).unwrap();
            if let ReservationState::Filling { release_when_done } = &mut e.state {
                *release_when_done = true;
                marked.push(rid);
            } else {
                ended.push(rid);
                self.end(rid);
            }
        }
        assert_eq!((got.ended, got.marked), (ended, marked));
    }

    fn adopt(&mut self, id: ReservationId, q: usize, own: bool, short: usize) {
        let Some(e) = self.live.get(&id).cloned() else {
            let seq = self.next_seq;
            assert_eq!(self.table.adopt(&mut self.alloc, id, "", seq, 1), Err(ReservationError::Unknown(id)));
            return;
        };
        let req = if own { e.request.clone() } else { request(q) };
        let n_tokens = e.blocks.len() * BS - short;
        let seq = self.next_seq;
        let got = self.table.adopt(&mut self.alloc, id, &req, seq, n_tokens);
        if !req.is_empty() && !e.request.is_empty() && req != e.request {
            assert!(matches!(got, Err(ReservationError::NotYours { .. })), "{got:?}");
            return;
        }
        match e.state {
            ReservationState::Reserved => assert_eq!(got, Err(ReservationError::NotFilled(id))),
            ReservationState::Filling { .. } => assert_eq!(got, Err(ReservationError::StillFilling(id))),
            ReservationState::Filled => {
                assert_eq!(got, Ok(e.blocks.clone()));
                self.next_seq += 1;
                self.live.remove(&id);
                let mut table = e.blocks.pinned.clone();
                table.extend(&e.blocks.raw);
                assert_eq!(self.alloc.block_table(seq), Some(table.as_slice()));
                // The sequence registers its full blocks, as the engine does, so that cancelling
                // it leaves them cached for later reservations to pin.
                let full = n_tokens.min(e.tokens.len()) / BS;
                for (k, h) in block_hashes(root(), &e.tokens[..full * BS], BS).into_iter().enumerate() {
                    self.alloc.register(seq, k, h).unwrap();
                }
                self.seqs.insert(seq, e.tokens);
            }
        }
    }

    /// Blocks just handed out: nobody else may hold them.
    fn check_fresh(&self, fresh: &[BlockId]) {
        let held = self.owners();
        for b in fresh {
            let n = held.get(b).copied().unwrap_or(0);
            assert_eq!(n, 1, "block {b} handed out while another owner holds it ({n} holders)");
        }
    }

    /// Every holder of every held block, by the model: sequence tables, pins and raw blocks of
    /// live and ending reservations.
    fn owners(&self) -> BTreeMap<BlockId, usize> {
        let mut n: BTreeMap<BlockId, usize> = BTreeMap::new();
        for s in self.alloc.sequences() {
            for &b in self.alloc.block_table(s).unwrap() {
                *n.entry(b).or_default() += 1;
            }
        }
        for b in self.live.values().map(|e| &e.blocks).chain(&self.ending) {
            for &x in b.pinned.iter().chain(&b.raw) {
                *n.entry(x).or_default() += 1;
            }
        }
        n
    }

    fn check(&self) {
        self.alloc.check_invariants().expect("allocator invariants");
        let s = self.alloc.stats();
        assert_eq!(s.free + s.cached + s.used, s.total);
        self.table.check(&self.alloc).expect("table agrees with the allocator");

        // The table says what the model says.
        assert_eq!(self.table.ids().collect::<Vec<_>>(), self.live.keys().copied().collect::<Vec<_>>());
        for (id, e) in &self.live {
            assert_eq!(self.table.state(*id), Some(e.state), "reservation {id}");
            assert_eq!(self.table.deadline(*id), e.deadline, "reservation {id}");
            assert_eq!(self.table.blocks(*id), Some(&e.blocks), "reservation {id}");
        }
        assert_eq!(self.table.ended(), self.ending.len());
        assert_eq!(self.table.released_early(), self.early.len());

        // No block has two owners: a raw block is held by its reservation alone.
        let owners = self.owners();
        let mut raw = BTreeSet::new();
        for b in self.live.values().map(|e| &e.blocks).chain(&self.ending) {
            for &x in &b.raw {
                assert!(raw.insert(x), "raw block {x} in two reservations");
                assert_eq!(owners[&x], 1, "raw block {x} has other holders");
                assert!(self.alloc.is_raw(x));
            }
        }
        assert_eq!(s.raw_reserved, raw.len());
        let mut pins: BTreeMap<BlockId, u32> = BTreeMap::new();
        for b in self.live.values().map(|e| &e.blocks).chain(&self.ending) {
            for &x in &b.pinned {
                *pins.entry(x).or_default() += 1;
            }
        }
        for b in 0..TOTAL as BlockId {
            assert_eq!(self.alloc.pins(b), pins.get(&b).copied().unwrap_or(0), "pins of block {b}");
        }
        // None is orphaned: the used blocks are exactly those someone holds.
        assert_eq!(s.used, owners.len(), "used blocks {s:?} but holders of {owners:?}");
    }

    /// Ends every transfer, releases everything, cancels every sequence and reclaims.
    fn wind_down(&mut self) {
        // Index 4k + 1 picks the kth live reservation; the first is always left first.
        while !self.live.values().all(|e| matches!(e.state, ReservationState::Filling { .. })) {
            let k = self
                .live
                .values()
                .position(|e| !matches!(e.state, ReservationState::Filling { .. }))
                .unwrap();
            self.apply(&Op::ReleaseId(4 * k + 1));
            self.check();
        }
        for _ in 0..self.live.len() {
            self.apply(&Op::ReleaseId(1));
            self.check();
            // Only marked transfers are left; they complete or fail.
            let id = *self.live.keys().next().unwrap();
            self.apply(&if id % 2 == 0 { Op::Complete(1) } else { Op::Abort(1) });
            self.check();
        }
        assert!(self.live.is_empty() && self.table.is_empty());
        while !self.seqs.is_empty() {
            self.apply(&Op::Cancel(0));
            self.check();
        }
        self.apply(&Op::Reclaim);
        self.check();
        let s = self.alloc.stats();
        assert_eq!(s.used, 0, "{s:?}");
        assert_eq!(s.free + s.cached, s.total);
        assert_eq!((s.raw_reserved, s.pinned, self.table.ended()), (0, 0, 0));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn reservations_never_lose_or_share_a_block(ops in prop::collection::vec(op(), 1..120)) {
        let mut w = World::new();
        for op in &ops {
            w.apply(op);
            w.check();
        }
        w.wind_down();
    }
}

/// The interleavings the issue names, in order, so that each is exercised whatever the
/// generator draws: a release that overtakes its reserve, a release during a transfer, a failed
/// transfer, a lease that ends, and an adopted sequence cancelled.
#[test]
fn a_named_interleaving() {
    let mut w = World::new();
    let ops = [
        Op::Warm(0, 4),
        Op::ReleaseRequest(0),
        Op::Reserve { q: 0, i: 0, extra: 4, cached: true },
        Op::Reserve { q: 1, i: 0, extra: 4, cached: true },
        Op::Begin(0),
        Op::ReleaseRequest(1),
        Op::Complete(0),
        Op::Reserve { q: 2, i: 1, extra: 3, cached: false },
        Op::Begin(1),
        Op::Abort(1),
        Op::Reserve { q: 3, i: 2, extra: 0, cached: false },
        Op::Advance(99),
        Op::Advance(1),
        Op::Reserve { q: 4, i: 0, extra: 6, cached: true },
        Op::Begin(3),
        Op::Complete(3),
        Op::Adopt { r: 3, q: 0, own: true, short: 2 },
        Op::Cancel(0),
        Op::Reclaim,
    ];
    for op in &ops {
        w.apply(op);
        w.check();
    }
    assert_eq!(w.granted.len(), 4, "the early-released request got none");
    assert!(w.live.is_empty() && w.seqs.is_empty());
    assert!(w.alloc.stats().cached > 0, "cached prefixes were pinned and returned");
    w.wind_down();
}
