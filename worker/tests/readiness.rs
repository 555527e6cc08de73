//! A worker's readiness and liveness over a real engine thread (no network): not ready before it
//! serves; ready while idle; unready while the engine has work but finishes no step (a sink that
//! blocks the engine thread inside a step stands in for a wedged forward pass) and ready again
//! once it moves; alive until the engine thread dies without being told to stop.

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tandem_engine::backend::BackendOptions;
use tandem_engine::cpu::CpuBackend;
use tandem_engine::kv::SeqId;
use tandem_engine::loader::load_model;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SchedulerOptions, SeqEvent};
use tandem_proto::v1::WorkerInfo;
use tandem_serve::ops::render;
use tandem_transport::TransferCounters;
use tandem_worker::{EngineHandle, ReadinessOptions, SeqSink, SinkFlow, WorkerState};
use tonic::Status;

/// Longest wait for anything (only to turn a hang into a failure).
const HANG: Duration = Duration::from_secs(60);

fn engine() -> Engine {
    let m = load_model(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa"))
        .expect("fixture model");
    let opts = BackendOptions { num_blocks: 16, block_size: 8, max_batch_tokens: 64, ..Default::default() };
    let be = CpuBackend::new(m.config, m.weights, opts).expect("backend");
    Engine::new(Box::new(be), m.tokenizer, SchedulerOptions::default())
}

fn state(h: &EngineHandle, stall: Duration) -> std::sync::Arc<WorkerState> {
    WorkerState::new(
        WorkerInfo::default(),
        h.clone(),
        Box::new(|_| TransferCounters::default()),
        Box::new(|| 0),
        ReadinessOptions { needs_registration: false, stall },
    )
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + HANG;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Holds the engine thread inside the step that produced the first token until told to go on.
struct Blocking {
    go: mpsc::Receiver<()>,
    entered: mpsc::Sender<()>,
}

impl SeqSink for Blocking {
    fn on_events(&mut self, _: &mut Engine, _: SeqId, _: &[SeqEvent]) -> SinkFlow {
        let _ = self.entered.send(());
        let _ = self.go.recv_timeout(HANG);
        SinkFlow::Cancel
    }
    fn on_cancel(&mut self, _: Status) {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_engine_turns_unready_and_recovers() {
    let (h, thread) = EngineHandle::spawn(engine()).unwrap();
    let st = state(&h, Duration::from_millis(100));
    assert!(st.ready().unwrap_err().contains("loading"));
    st.set_serving();
    assert_eq!(st.ready(), Ok(()));
    assert_eq!(st.live(), Ok(()));

    let (go_tx, go_rx) = mpsc::channel();
    let (entered_tx, entered_rx) = mpsc::channel();
    let sink = Box::new(Blocking { go: go_rx, entered: entered_tx });
    let params = SamplingParams { max_tokens: 4, ignore_eos: true, ..SamplingParams::greedy() };
    h.call(move |core| {
        let seq = core.engine.add_request(vec![1, 2, 3], params).expect("request");
        core.attach(1, seq, sink);
    })
    .await
    .unwrap();
    tokio::task::spawn_blocking(move || entered_rx.recv_timeout(HANG)).await.unwrap().expect("the step runs");

    eventually("readiness reports the wedged engine", || st.ready().is_err_and(|e| e.contains("wedged")))
        .await;
    assert_eq!(st.live(), Ok(()), "a wedged engine is not dead");
    let text = render(&st.metrics.registry());
    assert!(text.lines().any(|l| l == "tandem_worker_ready 0"), "{text}");

    go_tx.send(()).unwrap();
    eventually("ready again once the engine moves", || st.ready().is_ok()).await;
    let text = render(&st.metrics.registry());
    assert!(text.lines().any(|l| l == "tandem_worker_ready 1"), "{text}");

    // A stop the worker asked for is not a death.
    h.stop("test over");
    thread.join().await;
    assert_eq!(st.live(), Ok(()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_thread_that_dies_fails_liveness() {
    let (h, thread) = EngineHandle::spawn(engine()).unwrap();
    let st = state(&h, Duration::from_secs(30));
    st.set_serving();
    assert_eq!(st.live(), Ok(()));
    h.submit(|_| panic!("a bug on the engine thread (expected by this test)"));
    thread.join().await;
    let e = st.live().unwrap_err();
    assert!(e.contains("engine thread"), "{e}");
}
