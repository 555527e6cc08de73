//! The LoRA adapters the workers hold, as the router knows them: what each worker advertised at
//! registration (`WorkerInfo.adapters`), replaced by each heartbeat that sets `adapters_set`, and
//! updated at once by the admin API's loads and unloads.
//!
//! Pure bookkeeping over the table's entries (each keeps its list in `info.adapters`).
//!
//! An adapter is known by its name and its id (a hash of its weights): requests name it, the
//! router sends both, and a worker whose adapter of that name has another id refuses the request.
//! When workers hold one name under several ids (loaded from different files), the router routes
//! the name to the id most workers hold (ties: the lowest id) and logs a warning when that
//! appears; `GET /v1/models` lists the name once.
//!
//! Invariants:
//! - A worker holds at most one adapter of a name (a later one of the same name replaces it).
//! - A base-model request never looks at adapters: only requests that name one pay for them.

use std::collections::BTreeMap;

use tandem_proto::v1::{AdapterInfo, Role};

use super::table::{Registry, WorkerEntry};

/// An adapter a request runs under: the name it gave and the id the router routes it to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdapterKey {
    pub name: String,
    /// 32 hex digits, as workers advertise it.
    pub id: String,
}

/// One worker holding an adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub worker_id: String,
    pub role: Role,
    pub address: String,
    /// The adapter's weights are in a backend slot of the worker now.
    pub resident: bool,
    /// The worker is healthy and not draining.
    pub usable: bool,
}

/// An adapter (one name and id) across the workers holding it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterView {
    pub name: String,
    pub id: String,
    /// As the first holder (by worker id) advertised it.
    pub rank: u32,
    pub source: String,
    pub targets: Vec<String>,
    pub bytes: u64,
    /// Requests naming `name` go to this id (false for an id fewer workers hold).
    pub routed: bool,
    /// By worker id.
    pub holders: Vec<Holder>,
}

impl WorkerEntry {
    /// The adapter of that name the worker holds.
    pub fn adapter(&self, name: &str) -> Option<&AdapterInfo> {
        self.info.adapters.iter().find(|a| a.name == name)
    }

    /// Whether the worker holds `key` (its name under its id), and if so whether it is resident.
    pub(super) fn holding(&self, key: &AdapterKey) -> Option<bool> {
        self.adapter(&key.name).filter(|a| a.id == key.id).map(|a| a.resident)
    }
}

/// `adapters` with one entry per name (the last of a name wins, as a later load replaces).
fn dedup(adapters: Vec<AdapterInfo>) -> Vec<AdapterInfo> {
    let mut out: Vec<AdapterInfo> = Vec::with_capacity(adapters.len());
    for a in adapters {
        match out.iter_mut().find(|o| o.name == a.name) {
            Some(o) => *o = a,
            None => out.push(a),
        }
    }
    out
}

impl Registry {
    /// A worker's heartbeat said which adapters it holds now, as of `version` of its set: they
    /// replace what the router knew, unless the router applied a later load or unload already
    /// (the heartbeat read its list before that call: the next one brings it). Returns false
    /// for an unknown worker.
    pub fn set_adapters(&mut self, worker_id: &str, adapters: Vec<AdapterInfo>, version: u64) -> bool {
        let adapters = dedup(adapters);
        let Some(e) = self.workers.get_mut(worker_id) else {
            return false;
        };
        if version < e.adapters_version {
            return true;
        }
        e.adapters_version = version;
        if e.info.adapters == adapters {
            return true; // the usual heartbeat: nothing changed
        }
        let added: Vec<String> = adapters
            .iter()
            .filter(|a| !e.info.adapters.iter().any(|o| o.name == a.name && o.id == a.id))
            .map(|a| a.name.clone())
            .collect();
        e.info.adapters = adapters;
        self.warn_conflicts(&added);
        true
    }

    /// The worker `worker_id` at `address` loaded `info` (the admin API): it holds it from now
    /// on, replacing an adapter of the same name. A worker registered again at another address
    /// since is another process and is left alone.
    pub fn adapter_loaded(&mut self, worker_id: &str, address: &str, mut info: AdapterInfo) {
        let Some(e) = self.workers.get_mut(worker_id).filter(|e| e.info.address == address) else {
            return;
        };
        // An answer older than a list already applied (a change made since, through another
        // router, or an answer from a process that has restarted since) changes nothing.
        if info.adapters_version != 0 && info.adapters_version < e.adapters_version {
            return;
        }
        e.adapters_version = e.adapters_version.max(info.adapters_version);
        // Kept as heartbeats list it (the version is the call's, not the adapter's).
        info.adapters_version = 0;
        let name = info.name.clone();
        match e.info.adapters.iter_mut().find(|a| a.name == info.name) {
            Some(a) => *a = info,
            None => e.info.adapters.push(info),
        }
        self.warn_conflicts(&[name]);
    }

    /// The worker `worker_id` at `address` holds no adapter `name` any more, as of `version` of
    /// its adapter set (the admin API; 0 when a request found it gone).
    pub fn adapter_unloaded(&mut self, worker_id: &str, address: &str, name: &str, version: u64) {
        if let Some(e) = self.workers.get_mut(worker_id).filter(|e| e.info.address == address) {
            if version != 0 && version < e.adapters_version {
                return; // older than what the router applied since (see adapter_loaded)
            }
            e.adapters_version = e.adapters_version.max(version);
            e.info.adapters.retain(|a| a.name != name);
        }
    }

    /// Logs each of `names` that registered workers hold under more than one id.
    pub(super) fn warn_conflicts(&self, names: &[String]) {
        for name in names {
            let ids = self.ids_of(name);
            if ids.len() > 1 {
                let chosen = self.resolve_adapter(name).map(|k| k.id).unwrap_or_default();
                let held: Vec<String> = ids.iter().map(|(id, n)| format!("{id} on {n}")).collect();
                tracing::warn!(
                    adapter = %name,
                    routed_id = %chosen,
                    "workers hold LoRA adapter `{name}` under different ids ({}): requests for it go to \
                     the workers holding {chosen} only; load the same weights everywhere",
                    held.join(", ")
                );
            }
        }
    }

    /// The ids registered workers hold adapter `name` under, and how many workers hold each.
    fn ids_of(&self, name: &str) -> BTreeMap<&str, usize> {
        let mut ids: BTreeMap<&str, usize> = BTreeMap::new();
        for e in self.workers.values() {
            if let Some(a) = e.adapter(name) {
                *ids.entry(a.id.as_str()).or_default() += 1;
            }
        }
        ids
    }

    /// The adapter a request naming `name` runs under: the id most registered workers hold it
    /// under (ties: the lowest id). None when no worker holds an adapter of that name.
    pub fn resolve_adapter(&self, name: &str) -> Option<AdapterKey> {
        let ids = self.ids_of(name);
        // The first of the most held: the BTreeMap's order makes the lowest id win a tie.
        let (id, _) = ids.iter().fold(None::<(&str, usize)>, |best, (&id, &n)| match best {
            Some((_, m)) if m >= n => best,
            _ => Some((id, n)),
        })?;
        Some(AdapterKey { name: name.to_owned(), id: id.to_owned() })
    }

    /// Whether some registered worker holds an adapter called `name`.
    pub fn has_adapter(&self, name: &str) -> bool {
        self.workers.values().any(|e| e.adapter(name).is_some())
    }

    /// Every adapter name registered workers hold, sorted, each once.
    pub fn adapter_names(&self) -> Vec<String> {
        let mut names: Vec<String> =
            self.workers.values().flat_map(|e| e.info.adapters.iter().map(|a| a.name.clone())).collect();
        names.sort();
        names.dedup();
        names
    }

    /// Every adapter (name and id) registered workers hold, by name then id, with its holders.
    pub fn adapters(&self) -> Vec<AdapterView> {
        let mut views: BTreeMap<(String, String), AdapterView> = BTreeMap::new();
        for e in self.workers.values() {
            for a in &e.info.adapters {
                let v = views.entry((a.name.clone(), a.id.clone())).or_insert_with(|| AdapterView {
                    name: a.name.clone(),
                    id: a.id.clone(),
                    rank: a.rank,
                    source: a.source.clone(),
                    targets: a.targets.clone(),
                    bytes: a.bytes,
                    routed: false,
                    holders: Vec::new(),
                });
                v.holders.push(Holder {
                    worker_id: e.info.worker_id.clone(),
                    role: e.role(),
                    address: e.info.address.clone(),
                    resident: a.resident,
                    usable: e.usable(),
                });
            }
        }
        let mut out: Vec<AdapterView> = views.into_values().collect();
        for v in &mut out {
            v.routed = self.resolve_adapter(&v.name).is_some_and(|k| k.id == v.id);
        }
        out
    }

    /// Why no plan can run a request under `key` (none of the usable workers it may use holds
    /// it): the sentence a client is told.
    pub(super) fn no_holder(&self, key: &AdapterKey, avoided: &dyn Fn(&WorkerEntry) -> bool) -> String {
        let holds = |role: Role| {
            self.workers
                .values()
                .filter(|e| e.role() == role && e.usable() && !avoided(e) && e.holding(key).is_some())
                .count()
        };
        let (p, d, c) = (holds(Role::Prefill), holds(Role::Decode), holds(Role::Colocated));
        let name = &key.name;
        if p + d + c == 0 {
            format!("no usable worker holds the LoRA adapter `{name}` now")
        } else if d > 0 && p == 0 {
            format!(
                "no usable prefill worker holds the LoRA adapter `{name}` ({d} decode workers do, and \
                 --prefill-fallback fail keeps them from computing prompts)"
            )
        } else {
            format!("no usable decode worker holds the LoRA adapter `{name}` ({p} prefill workers do)")
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::registry::fixtures::*;
    use crate::registry::{Plan, PromptBlocks};

    fn adapter(name: &str, id: &str, resident: bool) -> AdapterInfo {
        AdapterInfo { name: name.into(), id: id.into(), rank: 8, resident, ..Default::default() }
    }

    fn holding(id: &str, role: Role, port: u16, adapters: &[AdapterInfo]) -> tandem_proto::v1::WorkerInfo {
        tandem_proto::v1::WorkerInfo {
            adapters: adapters.to_vec(),
            max_adapters: 4,
            ..worker(id, role, port, &[("tcp", "")])
        }
    }

    fn key(name: &str, id: &str) -> AdapterKey {
        AdapterKey { name: name.into(), id: id.into() }
    }

    fn under(key: &AdapterKey) -> PromptBlocks {
        PromptBlocks::unhashed(20).with_adapter(Some(key.clone()))
    }

    fn pair(plan: &Plan) -> (String, String) {
        match plan {
            Plan::Split { prefill, decode, .. } => (prefill.worker_id.clone(), decode.worker_id.clone()),
            Plan::Colocated { worker } => (String::new(), worker.worker_id.clone()),
        }
    }

    #[test]
    fn only_workers_holding_the_adapter_under_its_id_are_chosen_resident_first() {
        let mut r = registry();
        let t0 = Instant::now();
        let a = adapter("sql", "aa", false);
        r.admit(holding("d1", Role::Decode, 1, &[]), false, t0).unwrap();
        r.admit(holding("d2", Role::Decode, 2, std::slice::from_ref(&a)), false, t0).unwrap();
        r.admit(holding("d3", Role::Decode, 3, &[adapter("sql", "bb", true)]), false, t0).unwrap();
        r.admit(holding("p1", Role::Prefill, 4, &[]), false, t0).unwrap();
        r.admit(holding("p2", Role::Prefill, 5, std::slice::from_ref(&a)), false, t0).unwrap();
        r.heartbeat("d1", Some(load(60, 0)), t0);
        r.heartbeat("d2", Some(load(10, 0)), t0);
        r.heartbeat("d3", Some(load(30, 0)), t0);
        r.heartbeat("p1", Some(load(64, 0)), t0);
        r.heartbeat("p2", Some(load(64, 500)), t0);
        // The base model goes by load: d1 has the most free blocks, p1 no queue.
        assert_eq!(pair(&r.pick(&load_only()).unwrap()), ("p1".into(), "d1".into()));
        // Two workers hold "aa", one "bb": "aa" is routed to, and only its holders take it.
        assert_eq!(r.resolve_adapter("sql"), Some(key("sql", "aa")));
        let k = key("sql", "aa");
        assert_eq!(pair(&r.pick(&under(&k)).unwrap()), ("p2".into(), "d2".into()));
        // Two ids, two workers each: the lowest id wins the tie; a third "bb" makes it the majority.
        r.admit(holding("c1", Role::Colocated, 6, &[adapter("sql", "bb", false)]), false, t0).unwrap();
        assert_eq!(r.resolve_adapter("sql"), Some(key("sql", "aa")));
        r.admit(holding("c2", Role::Colocated, 7, &[adapter("sql", "bb", false)]), false, t0).unwrap();
        assert_eq!(r.resolve_adapter("sql"), Some(key("sql", "bb")));
        let bb = r.adapters().into_iter().find(|v| v.id == "bb").unwrap();
        assert!(bb.routed && bb.holders.len() == 3, "{bb:?}");
        // c1 and c2 (colocated, idle) hold "bb" only: an "aa" request still goes to p2 and d2.
        r.heartbeat("c1", Some(load(64, 0)), t0);
        assert_eq!(pair(&r.pick(&under(&k)).unwrap()), ("p2".into(), "d2".into()));
        // Resident beats more free blocks.
        r.set_adapters("d1", vec![adapter("sql", "aa", true)], 0);
        r.heartbeat("d1", Some(load(5, 0)), t0);
        assert_eq!(pair(&r.pick(&under(&k)).unwrap()), ("p2".into(), "d1".into()));
        // ... but not an overloaded worker.
        r.heartbeat("d1", Some(load(0, 0)), t0);
        assert_eq!(pair(&r.pick(&under(&k)).unwrap()), ("p2".into(), "d2".into()));
        // Unknown names resolve to nothing; a key nobody holds is refused naming the adapter.
        assert_eq!(r.resolve_adapter("nope"), None);
        let e = r.pick(&under(&key("nope", "cc"))).unwrap_err();
        assert!(e.contains("`nope`"), "{e}");
        assert_eq!(r.adapter_names(), vec!["sql".to_owned()]);
    }

    #[test]
    fn an_adapter_requests_blocks_are_named_under_its_salt_and_find_the_digests_of_its_holders() {
        use tandem_model::prefix;
        let mut r = registry();
        let t0 = Instant::now();
        let a = adapter("sql", "aa", true);
        for (id, role, port) in [("d1", Role::Decode, 1), ("d2", Role::Decode, 2), ("p1", Role::Prefill, 3)] {
            let info = tandem_proto::v1::WorkerInfo { adapters: vec![a.clone()], ..caching(id, role, port) };
            r.admit(info, false, t0).unwrap();
        }
        r.heartbeat("d1", Some(load(40, 0)), t0);
        r.heartbeat("d2", Some(load(38, 0)), t0);
        let tokens: Vec<u32> = (0..80).collect();
        let k = key("sql", "aa");
        let lora = PromptBlocks::under(&tokens, MODEL, "", Some(k.clone()), &[16]);
        let base = PromptBlocks::new(&tokens, MODEL, "", &[16]);
        // What a worker's prefix cache names the adapter's blocks: the root salted with its id.
        let root = prefix::chain_root(MODEL, "\u{0}lora:aa");
        let want: Vec<u64> =
            prefix::block_hashes(root, &tokens[..64], 16).iter().map(|h| h.short()).collect();
        assert_eq!(lora.reusable(16), want.as_slice());
        assert_ne!(lora.reusable(16), base.reusable(16));
        // d2 holds the prompt's blocks under the adapter: the adapter's request follows them,
        // the base model's does not (it goes by load: d1).
        r.set_cache("d2", Some(&digest(lora.reusable(16))));
        let plan = r.pick(&lora).unwrap();
        assert_eq!((plan.decoder().worker_id.as_str(), plan.decoder().overlap), ("d2", 4));
        assert_eq!(r.pick(&base).unwrap().decoder().worker_id, "d1");
    }

    #[test]
    fn without_a_prefill_worker_holding_it_the_decode_worker_computes_the_prompt_or_the_request_fails() {
        let t0 = Instant::now();
        let k = key("sql", "aa");
        let a = adapter("sql", "aa", true);
        for fallback in [true, false] {
            let mut r = registry();
            r.set_prefill_fallback(fallback);
            r.admit(holding("d1", Role::Decode, 1, std::slice::from_ref(&a)), false, t0).unwrap();
            r.admit(holding("p1", Role::Prefill, 2, &[]), false, t0).unwrap();
            match r.pick(&under(&k)) {
                Ok(plan) => {
                    assert!(fallback);
                    assert!(plan.decode_prefills(), "{plan:?}");
                }
                Err(e) => {
                    assert!(!fallback);
                    assert!(e.contains("no usable prefill worker holds the LoRA adapter `sql`"), "{e}");
                }
            }
            // The base model still splits.
            assert!(matches!(r.pick(&load_only()).unwrap(), Plan::Split { .. }));
        }
    }

    #[test]
    fn heartbeats_replace_the_list_and_admin_calls_update_it() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(holding("d1", Role::Decode, 1, &[adapter("a", "01", false)]), false, t0).unwrap();
        r.admit(holding("p1", Role::Prefill, 2, &[adapter("a", "01", false)]), false, t0).unwrap();
        assert!(r.has_adapter("a"));
        assert!(r.set_adapters("d1", vec![adapter("b", "02", true)], 0));
        assert!(!r.set_adapters("zz", vec![], 0), "unknown worker");
        assert_eq!(r.adapter_names(), vec!["a".to_owned(), "b".to_owned()]);
        let views = r.adapters();
        assert_eq!(views.len(), 2);
        assert_eq!(views[1].holders[0].worker_id, "d1");
        assert!(views[1].holders[0].resident && views[1].routed);
        // An admin load shows at once; one at a stale address does not.
        let addr = r.get("p1").unwrap().info.address.clone();
        r.adapter_loaded("p1", &addr, adapter("b", "02", false));
        r.adapter_loaded("p1", "10.0.0.1:1", adapter("c", "03", false));
        assert_eq!(r.adapters().iter().find(|v| v.name == "b").unwrap().holders.len(), 2);
        assert!(!r.has_adapter("c"));
        // Loading a name again replaces it.
        r.adapter_loaded("p1", &addr, adapter("b", "02", true));
        assert_eq!(r.get("p1").unwrap().info.adapters.len(), 2);
        r.adapter_unloaded("p1", &addr, "a", 0);
        assert!(!r.has_adapter("a"));
        // A worker that leaves takes its adapters with it.
        r.remove("d1");
        r.adapter_unloaded("p1", &addr, "b", 0);
        assert!(r.adapter_names().is_empty());
    }

    #[test]
    fn a_heartbeat_read_before_an_admin_call_does_not_undo_it() {
        let mut r = registry();
        let t0 = Instant::now();
        r.admit(holding("d1", Role::Decode, 1, &[adapter("a", "01", false)]), false, t0).unwrap();
        let addr = r.get("d1").unwrap().info.address.clone();
        // The worker answers an unload (its set is at version 1 now) ...
        r.adapter_unloaded("d1", &addr, "a", 1);
        // ... while a heartbeat of version 0, read before, still lists the adapter: ignored.
        assert!(r.set_adapters("d1", vec![adapter("a", "01", false)], 0));
        assert!(!r.has_adapter("a"), "a stale heartbeat brought an unloaded adapter back");
        // A load answered at version 2; a heartbeat of version 1 (without it) changes nothing.
        let mut loaded = adapter("b", "02", false);
        loaded.adapters_version = 2;
        r.adapter_loaded("d1", &addr, loaded);
        assert!(r.set_adapters("d1", vec![], 1));
        assert!(r.has_adapter("b"), "a stale heartbeat dropped a loaded adapter");
        assert_eq!(r.get("d1").unwrap().info.adapters[0].adapters_version, 0, "kept as heartbeats list it");
        // The heartbeat of version 2 has it, and a later one (an unload made through another
        // router) is applied.
        assert!(r.set_adapters("d1", vec![adapter("b", "02", true)], 2));
        assert!(r.get("d1").unwrap().info.adapters[0].resident);
        assert!(r.set_adapters("d1", vec![], 3));
        assert!(!r.has_adapter("b"));
        // An admin answer older than an applied list changes nothing: a load answered at
        // version 3 (an unload through another router made version 4 since) ...
        assert!(r.set_adapters("d1", vec![], 4));
        let mut late = adapter("b", "02", false);
        late.adapters_version = 3;
        r.adapter_loaded("d1", &addr, late);
        assert!(!r.has_adapter("b"), "a late load answer listed an adapter unloaded since");
        assert!(r.set_adapters("d1", vec![adapter("e", "05", false)], 5));
        r.adapter_unloaded("d1", &addr, "e", 4);
        assert!(r.has_adapter("e"), "a late unload answer unlisted an adapter loaded since");
        // A worker that registers again starts from a fresh entry (its versions start at its own
        // start time, above its old process's).
        r.remove("d1");
        r.admit(holding("d1", Role::Decode, 1, &[]), false, t0).unwrap();
        assert_eq!(r.get("d1").unwrap().adapters_version, 0);
        assert!(r.set_adapters("d1", vec![adapter("f", "06", false)], 1));
        assert!(r.has_adapter("f"));
        // Workers older than versions send 0 and are always applied.
        r.admit(holding("d2", Role::Decode, 2, &[]), false, t0).unwrap();
        assert!(r.set_adapters("d2", vec![adapter("c", "03", false)], 0));
        assert!(r.has_adapter("c"));
    }
}
