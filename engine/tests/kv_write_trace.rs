//! KV debug output must name the layer, the KV head and the token's slot on every value it
//! reports (logs without the layer index once sent an investigation down a false lead). A minimal
//! subscriber records each TRACE event's fields.
//!
//! This is the only test in its binary on purpose. `tracing` caches each call site's interest the
//! first time the site is hit; a test running beside this one could hit a write-path site while
//! the recording subscriber is being installed and leave that site cached as disabled, so the
//! recorder would see nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use tandem_engine::kv::{CpuKvPool, KvDtype, KvLayout, KvWritePath, StagedSegment, WriteMode};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

const LAYOUT: KvLayout = KvLayout {
    num_layers: 3,
    num_blocks: 8,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 3,
    dtype: KvDtype::F32,
};

type Fields = BTreeMap<String, String>;

struct Recorder(Arc<Mutex<Vec<Fields>>>);

struct Collect<'a>(&'a mut Fields);
impl Visit for Collect<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_string(), format!("{value:?}"));
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        if *event.metadata().level() == tracing::Level::TRACE {
            let mut f = Fields::new();
            event.record(&mut Collect(&mut f));
            self.0.lock().unwrap().push(f);
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

#[test]
fn trace_output_names_layer_head_and_slot() {
    let events = Arc::new(Mutex::new(Vec::new()));
    let segs = vec![
        StagedSegment::new(0..3, vec![4, 5, 6]),
        StagedSegment::new(3..5, vec![13, 12]),
        StagedSegment::new(5..9, vec![20, 21, 22, 23]),
    ];
    let slots: Vec<usize> = segs.iter().flat_map(|s| s.slots.iter().copied()).collect();
    let accepted = [1, 2, 0];
    let width = LAYOUT.num_kv_heads * LAYOUT.head_dim;
    tracing::subscriber::with_default(Recorder(events.clone()), || {
        let mut pool = CpuKvPool::new(LAYOUT);
        let mut w = KvWritePath::new(LAYOUT, 16);
        w.begin_pass(WriteMode::Staged, &segs).unwrap();
        for l in 0..LAYOUT.num_layers {
            let k: Vec<f32> = (0..slots.len() * width).map(|i| (l * 100 + i) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            w.write(&mut pool, l, &k, &v, &slots).unwrap();
        }
        w.end_pass().unwrap();
        w.commit(&mut pool, &accepted).unwrap();
    });
    let events = events.lock().unwrap();
    let of = |msg: &str| -> Vec<&Fields> {
        events.iter().filter(|f| f.get("message").is_some_and(|m| m == msg)).collect()
    };
    let staged = of("kv write staged");
    let committed = of("kv commit");
    let heads = LAYOUT.num_kv_heads;
    assert_eq!(staged.len(), LAYOUT.num_layers * slots.len() * heads);
    assert_eq!(committed.len(), LAYOUT.num_layers * accepted.iter().sum::<usize>() * heads);
    for f in staged.iter().chain(&committed) {
        for key in ["layer", "kv_head", "pass_token", "slot", "block", "offset", "k", "v"] {
            assert!(f.contains_key(key), "trace event {f:?} lacks `{key}`");
        }
    }
    // Every (layer, head) pair is reported, so a log line can always be told apart by layer.
    let pairs: BTreeSet<(String, String)> =
        committed.iter().map(|f| (f["layer"].clone(), f["kv_head"].clone())).collect();
    assert_eq!(pairs.len(), LAYOUT.num_layers * heads);
}
