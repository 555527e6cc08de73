//! LoRA adapters in the engine: the adapters a worker holds (by name), which of them are resident
//! in the backend's slots, and the rule that decides residency each step.
//!
//! A sequence resolves its adapter once, when it is queued ([`SamplingParams::adapter`], checked
//! against [`SamplingParams::adapter_id`]), and keeps that adapter (an `Arc`) until it ends, even
//! if the name is unloaded or loaded again with other weights meanwhile. Each step, before
//! planning, every sequence that will run needs its adapter resident. The adapters of running
//! sequences that ran before are (a slot in use is never given up). Then sequences that start
//! running without the queue (adopted from a reservation on a decode worker, or forked for `n`),
//! oldest first, and queued sequences, in queue order, get a free slot, or the least recently
//! used slot no sequence of this step uses. A sequence that finds none waits, in its place (in
//! the queue, or holding its blocks), and is planned as soon as a slot comes free: it is never
//! refused for it.
//!
//! The adapter's id joins the prefix cache's root ([`crate::lora::salted`]), so a request under
//! one adapter never attaches blocks computed under another or under the base.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::{Engine, Phase, SeqId};
use crate::error::{EngineError, Result};
use crate::lora::LoraAdapter;
use crate::sampler::SamplingParams;

/// An engine's adapter counters ([`Engine::adapter_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdapterStats {
    /// Adapters held (loaded), resident or not.
    pub held: usize,
    /// Adapters in a backend slot now (an unloaded one still running sequences counts).
    pub resident: usize,
    /// Backend slots (`--max-loras`).
    pub slots: usize,
    /// Adapters made resident since the engine started.
    pub loads: u64,
    /// Sequences the last step left waiting for a slot.
    pub waiting: usize,
}

/// What the engine says about one adapter it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterStatus {
    pub name: String,
    pub id: String,
    pub rank: usize,
    /// In a backend slot now.
    pub resident: bool,
    pub source: std::path::PathBuf,
    /// The projections it targets (`q_proj`, ...).
    pub targets: Vec<String>,
    pub bytes: usize,
    /// Live sequences running it.
    pub sequences: usize,
}

/// One backend slot.
#[derive(Debug, Clone)]
struct Slot {
    adapter: Arc<LoraAdapter>,
    /// The step counter when a sequence last ran it (least recently used goes first).
    last_used: u64,
}

/// The adapters an engine holds and its slots.
#[derive(Debug, Default)]
pub(super) struct Adapters {
    known: BTreeMap<String, Arc<LoraAdapter>>,
    slots: Vec<Option<Slot>>,
    clock: u64,
    /// Adapters made resident since the engine started (loads into a slot).
    pub(super) loads: u64,
    /// Queued sequences the last placement found no slot for: left out of that step's plan.
    pub(super) waiting: BTreeSet<SeqId>,
}

impl Adapters {
    pub(super) fn new(slots: usize) -> Adapters {
        Adapters { slots: vec![None; slots], ..Default::default() }
    }

    /// The slot `adapter` is resident in.
    pub(super) fn slot_of(&self, adapter: &LoraAdapter) -> Option<usize> {
        self.slots.iter().position(|s| s.as_ref().is_some_and(|s| s.adapter.id == adapter.id))
    }
}

impl Engine {
    /// Holds `adapter` under its name, for requests that name it. Loading a name already held
    /// with the same weights is a no-op; with other weights it is refused (unload it first), so
    /// a name means one adapter across a cluster's workers at any time.
    pub fn add_adapter(&mut self, adapter: LoraAdapter) -> Result<AdapterStatus> {
        if self.backend.adapter_slots() == 0 {
            return Err(EngineError::Lora {
                path: adapter.source.clone(),
                msg: "this worker runs no adapter (--max-loras 0, or a backend without LoRA support)".into(),
            });
        }
        if let Some(have) = self.adapters.known.get(&adapter.name) {
            if have.id != adapter.id {
                return Err(EngineError::Lora {
                    path: adapter.source.clone(),
                    msg: format!(
                        "an adapter named '{}' is already loaded with other weights (id {}, from {}); unload it first",
                        adapter.name,
                        have.id,
                        have.source.display()
                    ),
                });
            }
        } else {
            self.adapters.known.insert(adapter.name.clone(), Arc::new(adapter.clone()));
        }
        Ok(self.adapter_status(&adapter.name).expect("just held"))
    }

    /// Stops holding the adapter `name`: new requests naming it are refused; sequences running
    /// it finish with it, and its slot is given up once none runs it. False when no adapter of
    /// that name is held.
    pub fn remove_adapter(&mut self, name: &str) -> bool {
        self.adapters.known.remove(name).is_some()
    }

    /// The adapters held, by name.
    pub fn adapters(&self) -> Vec<AdapterStatus> {
        self.adapters.known.keys().filter_map(|n| self.adapter_status(n)).collect()
    }

    /// Most adapters resident at once (the backend's slots).
    pub fn max_adapters(&self) -> usize {
        self.adapters.slots.len()
    }

    /// Adapters made resident since the engine started.
    pub fn adapter_loads(&self) -> u64 {
        self.adapters.loads
    }

    /// The adapters' counters, for metrics; `None` for an engine without adapter slots.
    pub fn adapter_stats(&self) -> Option<AdapterStats> {
        if self.adapters.slots.is_empty() {
            return None;
        }
        Some(AdapterStats {
            held: self.adapters.known.len(),
            resident: self.adapters.slots.iter().filter(|s| s.is_some()).count(),
            slots: self.adapters.slots.len(),
            loads: self.adapters.loads,
            waiting: self.adapters.waiting.len(),
        })
    }

    fn adapter_status(&self, name: &str) -> Option<AdapterStatus> {
        let a = self.adapters.known.get(name)?;
        Some(AdapterStatus {
            name: a.name.clone(),
            id: a.id.clone(),
            rank: a.max_rank(),
            resident: self.adapters.slot_of(a).is_some(),
            source: a.source.clone(),
            targets: a.projections().iter().map(|p| p.peft_name().to_string()).collect(),
            bytes: a.bytes(),
            sequences: self
                .seqs
                .values()
                .filter(|s| s.adapter.as_ref().is_some_and(|x| x.id == a.id))
                .count(),
        })
    }

    /// The adapter a request names, checked against the id it expects; `None` for the base.
    pub(super) fn resolve_adapter(&self, params: &SamplingParams) -> Result<Option<Arc<LoraAdapter>>> {
        if params.adapter.is_empty() {
            if !params.adapter_id.is_empty() {
                return Err(EngineError::InvalidRequest("adapter_id is set but adapter is empty".into()));
            }
            return Ok(None);
        }
        let Some(a) = self.adapters.known.get(&params.adapter) else {
            return Err(EngineError::UnknownAdapter(params.adapter.clone()));
        };
        if !params.adapter_id.is_empty() && params.adapter_id != a.id {
            return Err(EngineError::AdapterMismatch {
                name: a.name.clone(),
                have: a.id.clone(),
                want: params.adapter_id.clone(),
            });
        }
        Ok(Some(a.clone()))
    }

    /// The prefix-cache salt of a request: its cache salt joined with its adapter's id. A
    /// decode worker reserves under it ([`Engine::reserve_for`]) for a request with an adapter.
    pub fn request_salt(&self, params: &SamplingParams) -> Result<String> {
        let a = self.resolve_adapter(params)?;
        Ok(crate::lora::salted(&params.cache_salt, a.as_deref()))
    }

    /// Makes resident the adapters of the sequences the next step may run, and records the
    /// sequences that must wait for a slot (left out of the step's plan). An adapter the backend
    /// fails to take (out of device memory) fails the sequences that run it, not the step:
    /// returns them with the error.
    pub(super) fn place_adapters(&mut self) -> Result<Vec<(SeqId, String)>> {
        let mut waiting = BTreeSet::new();
        let mut failed = Vec::new();
        self.adapters.waiting.clear();
        if self.adapters.slots.is_empty() {
            return Ok(failed);
        }
        self.adapters.clock += 1;
        let now = self.adapters.clock;
        let queued: BTreeSet<SeqId> = self.queue.iter().copied().collect();
        // Slots that running sequences use this step: never given up.
        let mut pinned = vec![false; self.adapters.slots.len()];
        // Running sequences whose adapter has no slot: adopted from a reservation or forked (they
        // never passed through the queue), placed first, oldest first.
        let mut unplaced = Vec::new();
        // Queued sequences already admitted (holding blocks for their whole prompt, prefilled in
        // chunks) count as running: their slot is never given to a sequence behind them.
        for (id, s) in &self.seqs {
            let admitted = s.admitted && s.has_blocks;
            if (queued.contains(id) && !admitted) || s.phase == Phase::Held || self.is_loading(*id) {
                continue;
            }
            if let Some(a) = &s.adapter {
                match self.adapters.slot_of(a) {
                    Some(i) => {
                        pinned[i] = true;
                        if let Some(slot) = &mut self.adapters.slots[i] {
                            slot.last_used = now;
                        }
                    }
                    None => unplaced.push(*id),
                }
            }
        }
        // A slot whose adapter was unloaded and that no sequence runs any more is given back now
        // (its memory freed), not when another adapter needs it.
        for i in 0..self.adapters.slots.len() {
            let Some(slot) = &self.adapters.slots[i] else { continue };
            let a = &slot.adapter;
            let held = self.adapters.known.get(&a.name).is_some_and(|k| k.id == a.id);
            let used = self.seqs.values().any(|s| s.adapter.as_ref().is_some_and(|x| x.id == a.id));
            if !pinned[i] && !held && !used {
                self.backend.set_adapter(i, None)?;
                self.adapters.slots[i] = None;
            }
        }
        let order: Vec<SeqId> = unplaced.into_iter().chain(self.queue.iter().copied()).collect();
        // Adapters the backend refused this step, by id, with the error their sequences get.
        let mut broken: BTreeMap<String, String> = BTreeMap::new();
        for id in order {
            let Some(a) = self.seqs.get(&id).and_then(|s| s.adapter.clone()) else { continue };
            if let Some(error) = broken.get(&a.id) {
                failed.push((id, error.clone()));
                continue;
            }
            if let Some(i) = self.adapters.slot_of(&a) {
                pinned[i] = true;
                if let Some(slot) = &mut self.adapters.slots[i] {
                    slot.last_used = now;
                }
                continue;
            }
            // A free slot, else the least recently used one nobody needs this step.
            let free = self.adapters.slots.iter().position(Option::is_none).or_else(|| {
                (0..self.adapters.slots.len())
                    .filter(|&i| !pinned[i])
                    .min_by_key(|&i| self.adapters.slots[i].as_ref().map_or(0, |s| s.last_used))
            });
            let Some(i) = free else {
                waiting.insert(id);
                continue;
            };
            if let Err(e) = self.backend.set_adapter(i, Some(a.clone())) {
                // The backend left the slot as it was; what it held may be gone, so it is empty now.
                tracing::warn!(adapter = %a.name, error = %e, "an adapter could not be made resident");
                let _ = self.backend.set_adapter(i, None);
                self.adapters.slots[i] = None;
                let error = format!("adapter {} could not be made resident: {e}", a.name);
                failed.push((id, error.clone()));
                broken.insert(a.id.clone(), error);
                continue;
            }
            self.adapters.slots[i] = Some(Slot { adapter: a, last_used: now });
            self.adapters.loads += 1;
            pinned[i] = true;
        }
        self.adapters.waiting = waiting;
        Ok(failed)
    }

    /// The backend slot a sequence's chunks name (`None`: the base model).
    pub(super) fn adapter_slot(&self, seq: SeqId) -> Result<Option<u16>> {
        let Some(a) = self.seqs.get(&seq).and_then(|s| s.adapter.as_ref()) else { return Ok(None) };
        match self.adapters.slot_of(a) {
            Some(i) => Ok(Some(i as u16)),
            None => Err(EngineError::Internal(format!(
                "sequence {seq} runs adapter {}, which is not resident",
                a.name
            ))),
        }
    }
}
