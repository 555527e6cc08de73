//! A paced engine thread (`--pace-steps`) over a real engine: while a sequence decodes and a
//! reservation is outstanding it starts no step before the latency target has passed since the
//! last one, yet it still takes its jobs; once no prompt is in flight for it, it decodes at once.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::SeqId;
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_worker::{EngineHandle, SeqSink, SinkFlow};
use tonic::Status;

/// Longest wait for anything (only to turn a hang into a failure).
const HANG: Duration = Duration::from_secs(60);

/// Counts tokens and notes when the sequence finished.
struct Counting(Arc<Mutex<(usize, bool)>>);

impl SeqSink for Counting {
    fn on_events(&mut self, _: &mut Engine, _: SeqId, events: &[SeqEvent]) -> SinkFlow {
        let mut s = self.0.lock().unwrap();
        for e in events {
            match e {
                SeqEvent::Token { .. } => s.0 += 1,
                SeqEvent::Finished { .. } => s.1 = true,
                _ => {}
            }
        }
        if s.1 {
            SinkFlow::Done
        } else {
            SinkFlow::Continue
        }
    }
    fn on_cancel(&mut self, _: Status) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_engine_takes_jobs_and_stops_pacing_when_no_prompt_is_in_flight() {
    let m = load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa"))
        .expect("fixture model");
    let opts = BackendOptions { num_blocks: 16, block_size: 8, max_batch_tokens: 64, ..Default::default() };
    let be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
    // A target far beyond the test's patience: a step that waited for it would hang the test.
    let engine = Engine::new(Box::new(be), m.tokenizer, SchedulerOptions::default())
        .with_itl_target(Duration::from_secs(3600), true)
        .unwrap();
    let (h, thread) = EngineHandle::spawn(engine).unwrap();

    let seen = Arc::new(Mutex::new((0usize, false)));
    let sink = Box::new(Counting(seen.clone()));
    let params = SamplingParams { max_tokens: 6, ignore_eos: true, ..SamplingParams::greedy() };
    // A reservation (a prompt being prefilled elsewhere for this engine) and a request, in one
    // job: from its first step on, the engine is paced.
    let res = h
        .call(move |core| {
            let (res, _) = core.engine.reserve(8).expect("reservation");
            let seq = core.engine.add_request(vec![1, 2, 3], params).expect("request");
            core.attach(1, seq, sink);
            res
        })
        .await
        .unwrap();
    let deadline = Instant::now() + HANG;
    while seen.lock().unwrap().0 == 0 {
        assert!(Instant::now() < deadline, "the first step never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Paced: jobs still run, and no step starts meanwhile.
    for _ in 0..3 {
        let steps = h.call(|core| core.steps()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(h.call(|core| core.steps()).await.unwrap(), steps, "a step ran while paced");
    }
    assert!(!seen.lock().unwrap().1, "finished while paced");
    // No prompt in flight any more: the sequence decodes to its end at once.
    h.call(move |core| core.engine.release_reservation(res).unwrap()).await.unwrap();
    while !seen.lock().unwrap().1 {
        assert!(Instant::now() < deadline, "pacing went on after the reservation ended");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(seen.lock().unwrap().0, 6);
    h.stop("test over");
    thread.join().await;
}
