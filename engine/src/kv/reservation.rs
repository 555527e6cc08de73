//! The decode side's reservation table: the one owner of a reservation's state, its lease and its
//! blocks, from the `Reserve` that takes them until a sequence adopts them or they go back to the
//! allocator.
//!
//! A reservation holds the cached prefix blocks it *pinned* and the *raw* blocks a transfer
//! fills ([`ReservedBlocks`]). Its life:
//!
//! ```text
//!   reserve ──► Reserved ──begin──► Filling ──complete──► Filled ──adopt──► (a sequence)
//!                  │                   │                    │
//!        release / lease ends     abort, or release     release / lease ends
//!                  ▼             (marked; ends when          ▼
//!                ended             the transfer does)      ended
//! ```
//!
//! - *Reserved* and *Filled* are leased: [`ReservationTable::expire`] ends those whose lease ran
//!   out. *Filling* is not: an open transfer is proof of life, and its blocks may be written at
//!   any moment (for shm, by another process), so a release then only marks it, and it ends when
//!   the transfer completes or aborts.
//! - A release by request id that finds nothing is remembered for one lease (at most
//!   [`MAX_RELEASED_EARLY`] such ids, the oldest forgotten first): the router releases a request
//!   as soon as it ends, and that call can overtake its `Reserve`. The `Reserve` that lands later
//!   is refused ([`ReservationError::ReleasedEarly`]) without taking any block.
//!
//! Transitions come in two kinds. Those that take or give back blocks take the
//! [`BlockAllocator`] (`reserve`, `adopt`, `reclaim`), so they run only where the allocator is, on
//! the engine's thread. The others only change state (`begin`, `complete`, `abort`, `release`,
//! `expire`), so a transfer's receiver can call them without waiting for a forward pass. An
//! *ended* reservation leaves the table at once (its id is unknown from then on) but its blocks
//! stay owned here, in a list of ended holdings, until [`ReservationTable::reclaim`] returns them
//! to the allocator.
//!
//! The table is plain data: no lock, no clock. Every transition that reads or sets a lease takes
//! `now`. [`SharedReservations`] puts it behind a mutex for the engine and a decode worker's
//! transfer gate to share.
//!
//! Invariants ([`ReservationTable::check`]): the raw blocks of all reservations and ended
//! holdings are distinct, never pinned by any of them, and are exactly the allocator's raw
//! blocks; each block's pins here are exactly its pins in the allocator; a pinned block is
//! registered in the prefix cache; only *Reserved* and *Filled* reservations have a lease.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::allocator::{BlockAllocator, BlockId, SeqId};
use super::KvError;

/// Identifier of a reservation; never 0 (0 means "none" on the wire).
pub type ReservationId = u64;

/// How long an unused reservation lives when nobody sets a lease.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// Most request ids remembered as released before their reservation landed; beyond it the oldest
/// are forgotten (their reservations, should they still land, end with their lease).
pub const MAX_RELEASED_EARLY: usize = 4096;

/// Where a live reservation is in its life (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationState {
    /// Blocks set aside; no transfer yet. Leased.
    Reserved,
    /// A transfer is writing the raw blocks. Not leased; `release_when_done` records a release
    /// that arrived meanwhile.
    Filling { release_when_done: bool },
    /// The raw blocks hold the prompt's KV. Leased.
    Filled,
}

/// The blocks a reservation holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReservedBlocks {
    /// Cached prefix blocks it pinned, in prompt order.
    pub pinned: Vec<BlockId>,
    /// Blocks a transfer fills, in prompt order after the pinned ones.
    pub raw: Vec<BlockId>,
}

impl ReservedBlocks {
    /// Pinned plus raw blocks.
    pub fn len(&self) -> usize {
        self.pinned.len() + self.raw.len()
    }

    /// Whether it holds no block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What [`ReservationTable::reserve`] granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    pub id: ReservationId,
    /// Leading prompt blocks this engine already holds (pinned for the reservation).
    pub cached_blocks: usize,
    /// The blocks a transfer must fill: the prompt's blocks after the cached ones, in order.
    pub blocks: Vec<BlockId>,
}

/// Why a reservation transition was refused. Messages name the reservation (or request).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReservationError {
    /// No live reservation has this id.
    #[error("reservation {0} is unknown (its lease expired, it was released, or it never existed)")]
    Unknown(ReservationId),
    /// The reservation was made for another request.
    #[error("reservation {id} belongs to request {owner}, not {request_id}")]
    NotYours { id: ReservationId, owner: String, request_id: String },
    /// Adoption of a reservation no transfer has filled.
    #[error("reservation {0} has not been filled: no KV transfer arrived for it")]
    NotFilled(ReservationId),
    /// Adoption of a reservation whose transfer is still running.
    #[error("reservation {0} has not been filled: its KV transfer is still in progress")]
    StillFilling(ReservationId),
    /// A second transfer for a reservation being filled.
    #[error("reservation {0} already has a transfer in progress")]
    AlreadyFilling(ReservationId),
    /// A transfer for a reservation already filled.
    #[error("reservation {0} is already filled")]
    AlreadyFilled(ReservationId),
    /// A `Reserve` for a request released before it landed.
    #[error("request {0} was released before its reservation was made")]
    ReleasedEarly(String),
    /// The allocator refused (out of blocks), or disagrees with the table (a bug).
    #[error(transparent)]
    Kv(#[from] KvError),
}

impl ReservationError {
    /// Stable, low-cardinality name of the refusal.
    pub fn kind(&self) -> &'static str {
        match self {
            ReservationError::Unknown(_) => "unknown_reservation",
            ReservationError::NotYours { .. } => "not_yours",
            ReservationError::NotFilled(_) => "not_filled",
            ReservationError::StillFilling(_) => "still_filling",
            ReservationError::AlreadyFilling(_) => "already_filling",
            ReservationError::AlreadyFilled(_) => "already_filled",
            ReservationError::ReleasedEarly(_) => "released_early",
            ReservationError::Kv(e) => e.kind(),
        }
    }
}

/// What [`ReservationTable::complete`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    /// The reservation is Filled, with a fresh lease.
    Filled,
    /// A release arrived during the transfer: the reservation ended.
    Ended,
    /// No reservation with this id was being filled; nothing changed.
    Ignored,
}

/// What [`ReservationTable::release`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Release {
    /// Reservations that ended (their blocks wait for [`ReservationTable::reclaim`]).
    pub ended: Vec<ReservationId>,
    /// Reservations being filled, marked to end with their transfer.
    pub marked: Vec<ReservationId>,
    /// Nothing was found and the request id is remembered as released early.
    pub remembered: bool,
}

impl Release {
    /// Whether any reservation was found.
    pub fn found(&self) -> bool {
        !self.ended.is_empty() || !self.marked.is_empty()
    }
}

/// A reservation whose lease ran out ([`ReservationTable::expire`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expired {
    pub id: ReservationId,
    pub request_id: String,
    /// The state it expired in (Reserved or Filled).
    pub state: ReservationState,
}

#[derive(Debug, Clone)]
struct Entry {
    request_id: String,
    blocks: ReservedBlocks,
    state: ReservationState,
    /// Lease end (Reserved and Filled only).
    deadline: Option<Instant>,
    /// Blocks its sequence will grow into once it runs (admission keeps them free; 1 unless
    /// [`ReservationTable::set_growth`] says otherwise).
    growth: usize,
}

/// The reservation table (see the module documentation).
#[derive(Debug, Clone)]
pub struct ReservationTable {
    entries: BTreeMap<ReservationId, Entry>,
    /// Blocks of reservations that ended, owned here until [`Self::reclaim`].
    ended: Vec<(ReservationId, ReservedBlocks)>,
    /// Request ids released before their reservation landed, with when to forget them.
    released_early: HashMap<String, Instant>,
    lease: Duration,
    next_id: ReservationId,
}

impl Default for ReservationTable {
    fn default() -> Self {
        ReservationTable::new(DEFAULT_LEASE)
    }
}

impl ReservationTable {
    /// An empty table whose reservations are leased for `lease`.
    pub fn new(lease: Duration) -> ReservationTable {
        ReservationTable {
            entries: BTreeMap::new(),
            ended: Vec::new(),
            released_early: HashMap::new(),
            lease,
            next_id: 1,
        }
    }

    /// The lease of unused reservations.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Sets the lease of reservations made or filled from now on.
    pub fn set_lease(&mut self, lease: Duration) {
        self.lease = lease;
    }

    /// Live reservations (ended ones waiting for [`Self::reclaim`] not counted).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is no live reservation.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Records that live reservation `id`'s sequence will grow into `blocks` blocks once it runs
    /// (the admission rule keeps them free). Unknown ids are ignored.
    pub fn set_growth(&mut self, id: ReservationId, blocks: usize) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.growth = blocks;
        }
    }

    /// Blocks the live reservations' sequences will grow into, together.
    pub fn growth(&self) -> usize {
        self.entries.values().map(|e| e.growth).sum()
    }

    /// The state of live reservation `id`.
    pub fn state(&self, id: ReservationId) -> Option<ReservationState> {
        self.entries.get(&id).map(|e| e.state)
    }

    /// The blocks of live reservation `id`.
    pub fn blocks(&self, id: ReservationId) -> Option<&ReservedBlocks> {
        self.entries.get(&id).map(|e| &e.blocks)
    }

    /// When the lease of `id` ends (None while it is being filled, or unknown).
    pub fn deadline(&self, id: ReservationId) -> Option<Instant> {
        self.entries.get(&id).and_then(|e| e.deadline)
    }

    /// Live reservations, in id order.
    pub fn ids(&self) -> impl Iterator<Item = ReservationId> + '_ {
        self.entries.keys().copied()
    }

    /// Request ids remembered as released before their reservation landed (expired ones
    /// included until the next release prunes them).
    pub fn released_early(&self) -> usize {
        self.released_early.len()
    }

    /// Ended reservations whose blocks wait for [`Self::reclaim`].
    pub fn ended(&self) -> usize {
        self.ended.len()
    }

    /// Every block held by a live or ended reservation (pinned and raw), each once.
    pub fn held_blocks(&self) -> BTreeSet<BlockId> {
        self.all_blocks().flat_map(|b| b.pinned.iter().chain(&b.raw)).copied().collect()
    }

    fn all_blocks(&self) -> impl Iterator<Item = &ReservedBlocks> {
        self.entries.values().map(|e| &e.blocks).chain(self.ended.iter().map(|(_, b)| b))
    }

    /// Reserves for `request_id` (may be empty): pins `pinned` (registered blocks found for the
    /// prompt's leading blocks) and takes `raw` blocks, leased until `now + lease`. Blocks of
    /// ended reservations go back to the allocator first. Refused, taking nothing, when the
    /// request was released before (and within a lease of) this call, or when the allocator has
    /// too few blocks. Admission policy (what may be reserved while others wait) is the caller's.
    pub fn reserve(
        &mut self,
        alloc: &mut BlockAllocator,
        request_id: &str,
        pinned: Vec<BlockId>,
        raw: usize,
        now: Instant,
    ) -> Result<Reserved, ReservationError> {
        self.reclaim(alloc)?;
        if !request_id.is_empty() && self.released_early.remove(request_id).is_some_and(|until| now < until) {
            return Err(ReservationError::ReleasedEarly(request_id.to_owned()));
        }
        alloc.pin(&pinned)?;
        let raw = match alloc.alloc_blocks(raw) {
            Ok(raw) => raw,
            Err(e) => {
                alloc.unpin(&pinned)?;
                return Err(e.into());
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        let granted = Reserved { id, cached_blocks: pinned.len(), blocks: raw.clone() };
        self.entries.insert(
            id,
            Entry {
                request_id: request_id.to_owned(),
                blocks: ReservedBlocks { pinned, raw },
                state: ReservationState::Reserved,
                deadline: Some(now + self.lease),
                growth: 1,
            },
        );
        Ok(granted)
    }

    /// A transfer opens for `id`: Reserved → Filling, lease stopped. Returns the raw blocks it
    /// fills.
    pub fn begin(&mut self, id: ReservationId) -> Result<Vec<BlockId>, ReservationError> {
        let e = self.entries.get_mut(&id).ok_or(ReservationError::Unknown(id))?;
        match e.state {
            ReservationState::Reserved => {
                e.state = ReservationState::Filling { release_when_done: false };
                e.deadline = None;
                Ok(e.blocks.raw.clone())
            }
            ReservationState::Filling { .. } => Err(ReservationError::AlreadyFilling(id)),
            ReservationState::Filled => Err(ReservationError::AlreadyFilled(id)),
        }
    }

    /// The transfer into `id` completed with matching checksums: Filling → Filled with a lease
    /// until `now + lease`, or, if a release arrived meanwhile, the reservation ends.
    pub fn complete(&mut self, id: ReservationId, now: Instant) -> Completion {
        let Some(e) = self.entries.get_mut(&id) else { return Completion::Ignored };
        match e.state {
            ReservationState::Filling { release_when_done: false } => {
                e.state = ReservationState::Filled;
                e.deadline = Some(now + self.lease);
                Completion::Filled
            }
            ReservationState::Filling { release_when_done: true } => {
                self.end(id);
                Completion::Ended
            }
            ReservationState::Reserved | ReservationState::Filled => Completion::Ignored,
        }
    }

    /// The transfer into `id` failed: a Filling reservation ends. Returns whether one did.
    pub fn abort(&mut self, id: ReservationId) -> bool {
        match self.entries.get(&id).map(|e| e.state) {
            Some(ReservationState::Filling { .. }) => {
                self.end(id);
                true
            }
            _ => false,
        }
    }

    /// Releases reservation `id` and every reservation of `request_id` (either may be 0/empty).
    /// Filling ones are marked and end with their transfer; the others end now. When `id` is 0
    /// and nothing of `request_id` is found, the request id is remembered until `now + lease` so
    /// that its `Reserve`, should it land later, is refused.
    pub fn release(&mut self, id: ReservationId, request_id: &str, now: Instant) -> Release {
        let ids: Vec<ReservationId> = self
            .entries
            .iter()
            .filter(|(rid, e)| {
                (id != 0 && **rid == id) || (!request_id.is_empty() && e.request_id == request_id)
            })
            .map(|(rid, _)| *rid)
            .collect();
        let mut out = Release::default();
        if ids.is_empty() && id == 0 && !request_id.is_empty() {
            self.remember_released(request_id, now);
            out.remembered = true;
        }
        for rid in ids {
            let Some(e) = self.entries.get_mut(&rid) else { continue };
            if let ReservationState::Filling { release_when_done } = &mut e.state {
                *release_when_done = true;
                out.marked.push(rid);
            } else {
                self.end(rid);
                out.ended.push(rid);
            }
        }
        out
    }

    fn remember_released(&mut self, request_id: &str, now: Instant) {
        let early = &mut self.released_early;
        early.retain(|_, until| now < *until);
        if early.len() >= MAX_RELEASED_EARLY && !early.contains_key(request_id) {
            if let Some(oldest) = early.iter().min_by_key(|(_, until)| **until).map(|(k, _)| k.clone()) {
                early.remove(&oldest);
            }
        }
        early.insert(request_id.to_owned(), now + self.lease);
    }

    /// Ends every Reserved or Filled reservation whose lease ended at or before `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Expired> {
        let ids: Vec<ReservationId> = self
            .entries
            .iter()
            .filter(|(_, e)| e.deadline.is_some_and(|d| d <= now))
            .map(|(id, _)| *id)
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(e) = self.end(id) {
                out.push(Expired { id, request_id: e.request_id, state: e.state });
            }
        }
        out
    }

    /// Moves a live reservation's blocks to the ended holdings.
    fn end(&mut self, id: ReservationId) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        self.ended.push((id, e.blocks.clone()));
        Some(e)
    }

    /// Checks that `id` can be adopted by `request_id` (empty: by anyone): it exists, belongs to
    /// that request (or to none), and is Filled. Returns its blocks.
    pub fn filled(&self, id: ReservationId, request_id: &str) -> Result<&ReservedBlocks, ReservationError> {
        let e = self.entries.get(&id).ok_or(ReservationError::Unknown(id))?;
        if !request_id.is_empty() && !e.request_id.is_empty() && e.request_id != request_id {
            return Err(ReservationError::NotYours {
                id,
                owner: e.request_id.clone(),
                request_id: request_id.to_owned(),
            });
        }
        match e.state {
            ReservationState::Filled => Ok(&e.blocks),
            ReservationState::Reserved => Err(ReservationError::NotFilled(id)),
            ReservationState::Filling { .. } => Err(ReservationError::StillFilling(id)),
        }
    }

    /// Filled → adopted: the reservation's holds become sequence `seq` of `n_tokens` tokens
    /// whose table is the pinned blocks then the raw ones, and the reservation leaves the table.
    /// Refused, changing nothing, for the reasons of [`Self::filled`] or when the allocator
    /// refuses (a block count that does not match `n_tokens`, an existing `seq`).
    pub fn adopt(
        &mut self,
        alloc: &mut BlockAllocator,
        id: ReservationId,
        request_id: &str,
        seq: SeqId,
        n_tokens: usize,
    ) -> Result<ReservedBlocks, ReservationError> {
        let blocks = self.filled(id, request_id)?;
        alloc.adopt(seq, &blocks.pinned, &blocks.raw, n_tokens)?;
        Ok(self.entries.remove(&id).map(|e| e.blocks).unwrap_or_default())
    }

    /// Gives the blocks of ended reservations back to the allocator (raw blocks freed, pins
    /// let go, so cached prefix blocks return to the cache). Returns how many reservations'
    /// blocks went back. A refusal by the allocator is a bug; the holding is dropped (so
    /// [`Self::check`] reports it) and the error returned.
    pub fn reclaim(&mut self, alloc: &mut BlockAllocator) -> Result<usize, ReservationError> {
        let mut n = 0;
        while let Some((_, b)) = self.ended.pop() {
            alloc.release_blocks(&b.raw)?;
            alloc.unpin(&b.pinned)?;
            n += 1;
        }
        Ok(n)
    }

    /// Checks the table against the allocator (see the module documentation); the message says
    /// what disagrees.
    pub fn check(&self, alloc: &BlockAllocator) -> Result<(), String> {
        let total = alloc.total_blocks();
        let mut raw = BTreeSet::new();
        let mut pins: BTreeMap<BlockId, u32> = BTreeMap::new();
        for b in self.all_blocks() {
            for &r in &b.raw {
                if !raw.insert(r) {
                    return Err(format!("block {r} is a raw block of two reservations"));
                }
            }
            for &p in &b.pinned {
                *pins.entry(p).or_default() += 1;
            }
        }
        if let Some(b) = raw.iter().find(|b| pins.contains_key(b)) {
            return Err(format!("block {b} is both raw and pinned"));
        }
        if let Some(&b) = raw.iter().chain(pins.keys()).find(|&&b| b as usize >= total) {
            return Err(format!("block {b} is outside the pool of {total} blocks"));
        }
        let stats = alloc.stats();
        if stats.raw_reserved != raw.len() {
            return Err(format!(
                "{} raw blocks in the allocator but {} in {} reservations and {} ended ones",
                stats.raw_reserved,
                raw.len(),
                self.entries.len(),
                self.ended.len()
            ));
        }
        if let Some(b) = raw.iter().find(|&&b| !alloc.is_raw(b)) {
            return Err(format!("block {b} is a reservation's raw block but not raw in the allocator"));
        }
        let pinned: usize = pins.values().map(|&n| n as usize).sum();
        if stats.pinned != pinned {
            return Err(format!(
                "{} pins in the allocator but {pinned} in {} reservations and {} ended ones",
                stats.pinned,
                self.entries.len(),
                self.ended.len()
            ));
        }
        if let Some((b, n)) = pins.iter().find(|(&b, &n)| alloc.pins(b) != n) {
            return Err(format!("block {b} pinned {n} times here but {} in the allocator", alloc.pins(*b)));
        }
        if let Some(b) = pins.keys().find(|&&b| alloc.block_hash(b).is_none()) {
            return Err(format!("block {b} is pinned but not registered in the prefix cache"));
        }
        for (id, e) in &self.entries {
            let leased = matches!(e.state, ReservationState::Reserved | ReservationState::Filled);
            if leased != e.deadline.is_some() {
                return Err(format!("reservation {id} in state {:?} has lease {:?}", e.state, e.deadline));
            }
        }
        Ok(())
    }
}

/// The reservation table behind a lock, shared by the engine (which runs the transitions that
/// move blocks, holding the allocator) and a decode worker's transfer gate (which runs the
/// state-only ones). Never hold it across anything that waits.
#[derive(Debug, Clone, Default)]
pub struct SharedReservations(Arc<Mutex<ReservationTable>>);

impl SharedReservations {
    /// Shares `table`.
    pub fn new(table: ReservationTable) -> SharedReservations {
        SharedReservations(Arc::new(Mutex::new(table)))
    }

    /// The table. A panic while it was held cannot leave it half-changed (every transition
    /// checks before it changes anything), so a poisoned lock is taken as is.
    pub fn lock(&self) -> MutexGuard<'_, ReservationTable> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::prefix::BlockHash;

    const LEASE: Duration = Duration::from_secs(10);

    /// An allocator of 16 blocks of 4 tokens with caching on, and a table.
    fn setup() -> (BlockAllocator, ReservationTable, Instant) {
        let mut a = BlockAllocator::new(16, 4);
        a.set_caching(true);
        (a, ReservationTable::new(LEASE), Instant::now())
    }

    fn check(a: &BlockAllocator, t: &ReservationTable) {
        a.check_invariants().expect("allocator invariants");
        t.check(a).expect("table agrees with the allocator");
    }

    /// Leaves `n` registered, cached blocks (hashes 1..=n) and returns them in order.
    fn cached(a: &mut BlockAllocator, n: usize) -> Vec<BlockId> {
        a.add_sequence(999, n * a.block_size()).unwrap();
        for i in 0..n {
            assert!(a.register(999, i, BlockHash(i as u128 + 1)).unwrap());
        }
        let blocks = a.block_table(999).unwrap().to_vec();
        a.free_sequence(999).unwrap();
        assert_eq!(a.cached_blocks(), n);
        blocks
    }

    #[test]
    fn reserve_takes_raw_blocks_and_pins_cached_ones() {
        let (mut a, mut t, now) = setup();
        let prefix = cached(&mut a, 2);
        let r = t.reserve(&mut a, "a", prefix.clone(), 3, now).unwrap();
        assert_eq!((r.id, r.cached_blocks, r.blocks.len()), (1, 2, 3));
        assert_eq!(t.state(1), Some(ReservationState::Reserved));
        assert_eq!(t.deadline(1), Some(now + LEASE));
        assert_eq!(t.blocks(1).unwrap().pinned, prefix);
        let s = a.stats();
        assert_eq!((s.raw_reserved, s.pinned, s.cached, s.used), (3, 2, 0, 5));
        check(&a, &t);
        let r2 = t.reserve(&mut a, "", Vec::new(), 1, now).unwrap();
        assert_eq!(r2.id, 2, "ids are never reused");
        check(&a, &t);
    }

    #[test]
    fn reserve_refused_by_the_allocator_takes_nothing() {
        let (mut a, mut t, now) = setup();
        let prefix = cached(&mut a, 2);
        let err = t.reserve(&mut a, "a", prefix, 15, now).unwrap_err();
        assert!(matches!(err, ReservationError::Kv(KvError::OutOfBlocks { .. })), "{err}");
        assert!(t.is_empty());
        let s = a.stats();
        assert_eq!((s.free, s.cached, s.pinned), (14, 2, 0));
        check(&a, &t);
    }

    #[test]
    fn a_transfer_fills_a_reservation_and_its_lease_stops_meanwhile() {
        let (mut a, mut t, now) = setup();
        let r = t.reserve(&mut a, "a", Vec::new(), 2, now).unwrap();
        assert_eq!(t.begin(r.id).unwrap(), r.blocks);
        assert_eq!(t.state(r.id), Some(ReservationState::Filling { release_when_done: false }));
        assert_eq!(t.deadline(r.id), None);
        assert!(t.expire(now + 10 * LEASE).is_empty(), "no lease while filling");
        let later = now + Duration::from_secs(3);
        assert_eq!(t.complete(r.id, later), Completion::Filled);
        assert_eq!(t.state(r.id), Some(ReservationState::Filled));
        assert_eq!(t.deadline(r.id), Some(later + LEASE), "a fresh lease from completion");
        assert_eq!(t.complete(r.id, later), Completion::Ignored, "completing twice changes nothing");
        check(&a, &t);
    }

    #[test]
    fn begin_refusals_say_why() {
        let (mut a, mut t, now) = setup();
        let err = t.begin(7).unwrap_err();
        assert_eq!(
            err.to_string(),
            "reservation 7 is unknown (its lease expired, it was released, or it never existed)"
        );
        let r = t.reserve(&mut a, "a", Vec::new(), 1, now).unwrap();
        t.begin(r.id).unwrap();
        let err = t.begin(r.id).unwrap_err();
        assert_eq!(err, ReservationError::AlreadyFilling(r.id));
        assert_eq!(err.to_string(), "reservation 1 already has a transfer in progress");
        t.complete(r.id, now);
        let err = t.begin(r.id).unwrap_err();
        assert_eq!(err, ReservationError::AlreadyFilled(r.id));
        assert_eq!(err.to_string(), "reservation 1 is already filled");
    }

    #[test]
    fn an_aborted_transfer_ends_the_reservation_and_reclaim_frees_it() {
        let (mut a, mut t, now) = setup();
        let prefix = cached(&mut a, 1);
        let r = t.reserve(&mut a, "a", prefix, 2, now).unwrap();
        assert!(!t.abort(r.id), "no transfer to abort yet");
        t.begin(r.id).unwrap();
        assert!(t.abort(r.id));
        assert_eq!(t.state(r.id), None, "ended: unknown at once");
        assert!(!t.abort(r.id));
        assert_eq!(t.complete(r.id, now), Completion::Ignored);
        assert_eq!(t.begin(r.id).unwrap_err(), ReservationError::Unknown(r.id));
        assert_eq!(t.ended(), 1);
        assert_eq!(a.stats().raw_reserved, 2, "the blocks are still the table's");
        check(&a, &t);
        assert_eq!(t.reclaim(&mut a).unwrap(), 1);
        let s = a.stats();
        assert_eq!((s.free, s.cached, s.used), (15, 1, 0), "the pinned block is cached again");
        check(&a, &t);
    }

    #[test]
    fn a_release_during_a_transfer_waits_for_its_end() {
        let (mut a, mut t, now) = setup();
        let r = t.reserve(&mut a, "b", Vec::new(), 2, now).unwrap();
        t.begin(r.id).unwrap();
        let rel = t.release(0, "b", now);
        assert_eq!(rel, Release { ended: vec![], marked: vec![r.id], remembered: false });
        assert!(rel.found());
        assert_eq!(t.state(r.id), Some(ReservationState::Filling { release_when_done: true }));
        assert_eq!(t.reclaim(&mut a).unwrap(), 0, "blocks kept while the transfer may write them");
        assert_eq!(t.complete(r.id, now), Completion::Ended);
        assert_eq!(t.state(r.id), None);
        t.reclaim(&mut a).unwrap();
        assert_eq!(a.stats().free, 16);
        check(&a, &t);

        // A marked transfer that fails ends too.
        let r = t.reserve(&mut a, "c", Vec::new(), 2, now).unwrap();
        t.begin(r.id).unwrap();
        t.release(r.id, "", now);
        assert!(t.abort(r.id));
        t.reclaim(&mut a).unwrap();
        assert_eq!(a.stats().free, 16);
        check(&a, &t);
    }

    #[test]
    fn release_by_id_and_by_request_id() {
        let (mut a, mut t, now) = setup();
        let x = t.reserve(&mut a, "x", Vec::new(), 1, now).unwrap().id;
        let y1 = t.reserve(&mut a, "y", Vec::new(), 1, now).unwrap().id;
        let y2 = t.reserve(&mut a, "y", Vec::new(), 1, now).unwrap().id;
        t.begin(y1).unwrap();
        t.complete(y1, now);
        let rel = t.release(0, "y", now);
        assert_eq!(rel.ended, vec![y1, y2], "every reservation of the request, Filled or not");
        let rel = t.release(x, "", now);
        assert_eq!(rel.ended, vec![x]);
        let rel = t.release(x, "", now);
        assert!(!rel.found() && !rel.remembered, "a second release finds nothing and remembers nothing");
        assert_eq!(t.released_early(), 0);
        assert_eq!(t.ended(), 3);
        check(&a, &t);
        t.reclaim(&mut a).unwrap();
        assert_eq!(a.stats().free, 16);
    }

    #[test]
    fn a_release_that_overtakes_its_reserve_refuses_it() {
        let (mut a, mut t, now) = setup();
        let rel = t.release(0, "early", now);
        assert!(rel.remembered && !rel.found());
        assert_eq!(t.released_early(), 1);
        let err = t.reserve(&mut a, "early", Vec::new(), 2, now).unwrap_err();
        assert_eq!(err, ReservationError::ReleasedEarly("early".into()));
        assert_eq!(err.to_string(), "request early was released before its reservation was made");
        assert_eq!(t.released_early(), 0, "used once");
        assert!(t.is_empty());
        assert_eq!(a.stats().free, 16, "nothing taken");
        // Used once: the next Reserve for it is granted.
        t.reserve(&mut a, "early", Vec::new(), 2, now).unwrap();
        // A remembered release is forgotten after a lease.
        t.release(0, "late", now);
        t.reserve(&mut a, "late", Vec::new(), 1, now + LEASE).unwrap();
        check(&a, &t);
    }

    #[test]
    fn remembered_releases_are_bounded_and_the_oldest_go_first() {
        let mut t = ReservationTable::new(LEASE);
        let now = Instant::now();
        for i in 0..MAX_RELEASED_EARLY {
            t.release(0, &format!("r{i}"), now + Duration::from_millis(i as u64));
        }
        assert_eq!(t.released_early(), MAX_RELEASED_EARLY);
        t.release(0, "one more", now + Duration::from_secs(1));
        assert_eq!(t.released_early(), MAX_RELEASED_EARLY);
        let mut a = BlockAllocator::new(4, 4);
        t.reserve(&mut a, "r0", Vec::new(), 1, now + Duration::from_secs(1)).expect("r0 was forgotten");
        let err = t.reserve(&mut a, "r1", Vec::new(), 1, now + Duration::from_secs(1)).unwrap_err();
        assert_eq!(err, ReservationError::ReleasedEarly("r1".into()));
        // Expired ones are pruned by the next release.
        t.release(0, "x", now + 2 * LEASE);
        assert_eq!(t.released_early(), 1);
    }

    #[test]
    fn leases_end_reserved_and_filled_reservations() {
        let (mut a, mut t, now) = setup();
        let r = t.reserve(&mut a, "r", Vec::new(), 1, now).unwrap().id;
        let f = t.reserve(&mut a, "f", Vec::new(), 1, now).unwrap().id;
        let busy = t.reserve(&mut a, "busy", Vec::new(), 1, now).unwrap().id;
        t.begin(f).unwrap();
        t.complete(f, now + Duration::from_secs(5));
        t.begin(busy).unwrap();
        assert!(t.expire(now + LEASE - Duration::from_nanos(1)).is_empty(), "not expired yet");
        let gone = t.expire(now + LEASE);
        assert_eq!(gone, vec![Expired { id: r, request_id: "r".into(), state: ReservationState::Reserved }]);
        let gone = t.expire(now + LEASE + Duration::from_secs(5));
        assert_eq!(gone, vec![Expired { id: f, request_id: "f".into(), state: ReservationState::Filled }]);
        assert_eq!(t.ids().collect::<Vec<_>>(), vec![busy], "a transfer in progress never expires");
        check(&a, &t);
        t.reclaim(&mut a).unwrap();
        assert_eq!(a.stats().raw_reserved, 1);
    }

    #[test]
    fn adopt_turns_a_filled_reservation_into_a_sequence() {
        let (mut a, mut t, now) = setup();
        let prefix = cached(&mut a, 2);
        let r = t.reserve(&mut a, "a", prefix.clone(), 2, now).unwrap();
        t.begin(r.id).unwrap();
        t.complete(r.id, now);
        let blocks = t.adopt(&mut a, r.id, "a", 5, 15).unwrap();
        assert_eq!(blocks.pinned, prefix);
        assert!(t.is_empty());
        let mut table = prefix.clone();
        table.extend(&r.blocks);
        assert_eq!(a.block_table(5), Some(table.as_slice()));
        let s = a.stats();
        assert_eq!((s.raw_reserved, s.pinned, s.used), (0, 0, 4));
        check(&a, &t);
        // Cancelling the sequence gives its blocks back; the registered prefix stays cached.
        a.free_sequence(5).unwrap();
        let s = a.stats();
        assert_eq!((s.free, s.cached, s.used), (14, 2, 0));
    }

    #[test]
    fn adopt_refusals_say_why_and_change_nothing() {
        let (mut a, mut t, now) = setup();
        let err = t.adopt(&mut a, 3, "", 1, 4).unwrap_err();
        assert_eq!(err, ReservationError::Unknown(3));
        let r = t.reserve(&mut a, "a", Vec::new(), 2, now).unwrap().id;
        let err = t.adopt(&mut a, r, "b", 1, 8).unwrap_err();
        assert_eq!(err.to_string(), "reservation 1 belongs to request a, not b");
        let err = t.adopt(&mut a, r, "a", 1, 8).unwrap_err();
        assert_eq!(err.to_string(), "reservation 1 has not been filled: no KV transfer arrived for it");
        t.begin(r).unwrap();
        let err = t.adopt(&mut a, r, "", 1, 8).unwrap_err();
        assert_eq!(
            err.to_string(),
            "reservation 1 has not been filled: its KV transfer is still in progress"
        );
        t.complete(r, now);
        let err = t.adopt(&mut a, r, "a", 1, 20).unwrap_err();
        assert!(matches!(err, ReservationError::Kv(KvError::BlockCountMismatch { .. })), "{err}");
        assert_eq!(t.state(r), Some(ReservationState::Filled), "refusals keep the reservation");
        check(&a, &t);
        // A reservation made without a request id may be adopted by any request.
        let anon = t.reserve(&mut a, "", Vec::new(), 1, now).unwrap().id;
        t.begin(anon).unwrap();
        t.complete(anon, now);
        t.adopt(&mut a, anon, "whoever", 2, 3).unwrap();
        check(&a, &t);
    }

    #[test]
    fn check_catches_a_table_that_disagrees_with_the_allocator() {
        let (mut a, mut t, now) = setup();
        t.reserve(&mut a, "a", Vec::new(), 2, now).unwrap();
        let extra = a.alloc_blocks(1).unwrap();
        let err = t.check(&a).unwrap_err();
        assert!(err.contains("3 raw blocks in the allocator but 2"), "{err}");
        a.release_blocks(&extra).unwrap();
        t.check(&a).unwrap();
    }

    #[test]
    fn shared_table_is_one_table() {
        let shared = SharedReservations::default();
        let other = shared.clone();
        let mut a = BlockAllocator::new(4, 4);
        let id = shared.lock().reserve(&mut a, "a", Vec::new(), 1, Instant::now()).unwrap().id;
        assert_eq!(other.lock().begin(id).unwrap().len(), 1);
        assert_eq!(shared.lock().state(id), Some(ReservationState::Filling { release_when_done: false }));
        assert_eq!(shared.lock().lease(), DEFAULT_LEASE);
    }
}
