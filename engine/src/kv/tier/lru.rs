//! A set of named entries in least-recently-used order, each with a byte size.
//!
//! Recency is a *tick* the caller passes in, taken from one clock shared by every set of a store,
//! so that entries of different sets can be merged into one most-recent-first order
//! ([`super::KvTiers::names`]). Ticks only grow; two entries never share one.
//!
//! Invariants (checked by [`Lru::check`]): the map and the order hold the same names with the
//! same ticks, and `bytes` is the sum of the entries' sizes.

use std::collections::{BTreeMap, HashMap};

use crate::kv::BlockHash;

struct Slot<V> {
    tick: u64,
    bytes: u64,
    value: V,
}

pub(super) struct Lru<V> {
    map: HashMap<BlockHash, Slot<V>>,
    /// Tick → name, oldest first.
    order: BTreeMap<u64, BlockHash>,
    bytes: u64,
}

impl<V> Default for Lru<V> {
    fn default() -> Self {
        Lru { map: HashMap::new(), order: BTreeMap::new(), bytes: 0 }
    }
}

impl<V> Lru<V> {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn contains(&self, name: BlockHash) -> bool {
        self.map.contains_key(&name)
    }

    /// The entry's value, without touching its recency.
    pub fn peek(&self, name: BlockHash) -> Option<&V> {
        self.map.get(&name).map(|s| &s.value)
    }

    /// Inserts `name` as the most recent entry (replacing any entry of that name).
    pub fn insert(&mut self, name: BlockHash, tick: u64, bytes: u64, value: V) {
        self.remove(name);
        self.order.insert(tick, name);
        self.bytes += bytes;
        self.map.insert(name, Slot { tick, bytes, value });
    }

    /// Makes `name` the most recent entry; false when it is not held.
    pub fn touch(&mut self, name: BlockHash, tick: u64) -> bool {
        let Some(slot) = self.map.get_mut(&name) else { return false };
        self.order.remove(&slot.tick);
        slot.tick = tick;
        self.order.insert(tick, name);
        true
    }

    pub fn remove(&mut self, name: BlockHash) -> Option<V> {
        let slot = self.map.remove(&name)?;
        self.order.remove(&slot.tick);
        self.bytes -= slot.bytes;
        Some(slot.value)
    }

    /// Removes and returns the least recent entry.
    pub fn pop_oldest(&mut self) -> Option<(BlockHash, V)> {
        let (_, name) = self.order.pop_first()?;
        let slot = self.map.remove(&name).expect("lru: order and map agree");
        self.bytes -= slot.bytes;
        Some((name, slot.value))
    }

    /// `(tick, name)`, most recent first.
    pub fn newest_first(&self) -> impl Iterator<Item = (u64, BlockHash)> + '_ {
        self.order.iter().rev().map(|(&t, &n)| (t, n))
    }

    /// Names with their sizes, in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = (BlockHash, u64)> + '_ {
        self.map.iter().map(|(&n, s)| (n, s.bytes))
    }

    pub fn check(&self, what: &str) -> Result<(), String> {
        if self.map.len() != self.order.len() {
            return Err(format!("{what}: {} names but {} in LRU order", self.map.len(), self.order.len()));
        }
        for (&tick, &name) in &self.order {
            match self.map.get(&name) {
                Some(s) if s.tick == tick => {}
                Some(s) => {
                    return Err(format!(
                        "{what}: {name:?} at tick {tick} in the order, {} in the map",
                        s.tick
                    ))
                }
                None => return Err(format!("{what}: {name:?} in the LRU order but not in the map")),
            }
        }
        let sum: u64 = self.map.values().map(|s| s.bytes).sum();
        if sum != self.bytes {
            return Err(format!("{what}: entries sum to {sum} bytes, {} counted", self.bytes));
        }
        Ok(())
    }
}
