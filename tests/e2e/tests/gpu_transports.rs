//! The GPU KV transports through the real processes.
//!
//! Without a GPU: `--transport cuda-ipc` and `--transport nccl` fail at once, naming what is
//! missing, from both workers, `tandem up` and `tandem bench --transfer`.
//!
//! With a GPU (each test prints a `SKIPPED` line and passes without one, unless
//! `TANDEM_REQUIRE_GPU=1`, which makes it fail):
//! - a cluster on cuda:0 with `--transport cuda-ipc` and `--dtype f32 --kv-dtype f32` gives the
//!   same greedy tokens as a CPU cluster with `--activations f32 --kv-dtype f32`, its transfers
//!   went over cuda-ipc, and every worker ends quiescent;
//! - requests abandoned at random moments (before, during and after the transfer) leave both
//!   workers with free == total;
//! - with two GPUs, the same parity over nccl (prefill on cuda:0, decode on cuda:1). With one GPU
//!   the nccl test says so and passes even under `TANDEM_REQUIRE_GPU=1`: NCCL refuses two ranks
//!   on one device, so such a machine cannot run it.

use std::process::Command;
use std::time::Duration;

use tandem_e2e::*;
use tandem_test_support::{skip_test, Prerequisite};

/// Runs `bin args` and returns its exit success and stderr; it must end within `limit`.
fn run_fast(bin_name: &str, args: &[&str], limit: Duration) -> (bool, String) {
    let program = bin(bin_name);
    let t = std::time::Instant::now();
    let out = Command::new(program).args(args).output().expect("the binary runs");
    assert!(t.elapsed() < limit, "{bin_name} {args:?} took {:?}, more than {limit:?}", t.elapsed());
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn gpu_transports_without_a_gpu_fail_at_once_naming_what_is_missing() {
    let model = TestModel::tiny();
    let m = model.path.display().to_string();
    let limit = Duration::from_secs(20);
    for (worker, transport) in
        [("tandem-prefill", "cuda-ipc"), ("tandem-decode", "nccl"), ("tandem-decode", "cuda-ipc")]
    {
        let (ok, err) =
            run_fast(worker, &["--model", &m, "--device", "cpu", "--transport", transport], limit);
        assert!(!ok, "{worker} --transport {transport} on the CPU started");
        assert!(
            err.contains(&format!("--transport {transport} moves KV blocks between GPUs"))
                && err.contains("--device cpu"),
            "{worker}: {err}"
        );
    }
    let (ok, err) = run_fast("tandem", &["up", "--model", &m, "--transport", "cuda-ipc"], limit);
    assert!(!ok && err.contains("cuda-ipc") && err.contains("cpu"), "tandem up: {err}");
    let (ok, err) =
        run_fast("tandem", &["bench", "--transfer", "--model", &m, "--transfer-transports", "nccl"], limit);
    assert!(!ok && err.contains("nccl moves KV between GPUs"), "tandem bench: {err}");
    if !tandem_engine::cuda::driver_present() {
        // A GPU device where there is no driver: the error names the driver.
        let (ok, err) =
            run_fast("tandem", &["bench", "--transfer", "--model", &m, "--device", "cuda:0"], limit);
        assert!(!ok && err.contains("no NVIDIA driver"), "tandem bench on cuda:0: {err}");
        let (ok, err) = run_fast(
            "tandem-decode",
            &["--model", &m, "--device", "cuda:0", "--transport", "cuda-ipc"],
            limit,
        );
        assert!(!ok && err.contains("no NVIDIA driver"), "tandem-decode on cuda:0: {err}");
    }
    if tandem_transport::nccl::load().is_err() {
        // nccl on a GPU device without the library: the error names the library.
        let (ok, err) =
            run_fast("tandem-decode", &["--model", &m, "--device", "cuda:0", "--transport", "nccl"], limit);
        assert!(!ok && err.contains("libnccl.so.2"), "tandem-decode --transport nccl: {err}");
    }
}

/// `Some(())` when cuda:`ordinal` is usable; otherwise records the skip.
fn gpu(test: &str, ordinal: usize) -> Option<()> {
    tandem_test_support::gpu_for_test(test, ordinal, tandem_engine::cuda::probe(ordinal)).then_some(())
}

fn gpu_args(device: &str) -> Vec<String> {
    ["--device", device, "--dtype", "f32", "--kv-dtype", "f32"].map(String::from).to_vec()
}

fn cpu_spec(model: &TestModel) -> ClusterSpec {
    let mut spec = ClusterSpec::new(model.path.clone(), "auto");
    let f32 = ["--activations", "f32", "--kv-dtype", "f32"].map(String::from).to_vec();
    spec.prefill_args = f32.clone();
    spec.decode_args = f32;
    spec
}

fn workload() -> Vec<Req> {
    (0..8)
        .map(|i| {
            Req::text(
                format!("Request {i}: the ferry left at six and the {}", "town ".repeat(i * 9)),
                12 + i as u32,
            )
        })
        .collect()
}

/// `tandem_worker_kv_transfers_total{transport=kind, outcome="ok"}` of a worker.
fn transfers_over(worker: &Proc, kind: &str) -> f64 {
    let http = worker.http.expect("the worker announces its HTTP address");
    let (code, text) = http_get(http, "/metrics").expect("the worker answers /metrics");
    assert_eq!(code, 200, "{text}");
    text.lines()
        .filter(|l| l.starts_with("tandem_worker_kv_transfers_total{"))
        .filter(|l| l.contains(&format!("transport=\"{kind}\"")) && l.contains("outcome=\"ok\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The GPU cluster's greedy tokens equal the CPU cluster's, over `transport`.
fn parity_over(test: &str, transport: &str, prefill_device: &str, decode_device: &str) {
    let model = TestModel::tiny();
    let reqs = workload();
    let cpu = Cluster::start(cpu_spec(&model));
    let want = generate_all(cpu.router.addr(), &reqs);
    cpu.assert_quiescent(Duration::from_secs(30));
    drop(cpu);

    let mut spec = ClusterSpec::new(model.path.clone(), transport);
    spec.prefill_args = gpu_args(prefill_device);
    spec.decode_args = gpu_args(decode_device);
    let gpu = Cluster::start(spec);
    let got = generate_all(gpu.router.addr(), &reqs);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let (g, w) =
            (g.as_ref().expect("the GPU cluster answers"), w.as_ref().expect("the CPU cluster answers"));
        assert_eq!(g.token_ids, w.token_ids, "{test}: request {i}: GPU over {transport} vs CPU");
    }
    let moved = transfers_over(&gpu.decode[0], transport);
    assert!(
        moved >= reqs.len() as f64,
        "{test}: {moved} transfers over {transport} for {} requests",
        reqs.len()
    );
    gpu.assert_quiescent(Duration::from_secs(30));
}

#[test]
fn cuda_ipc_cluster_matches_the_cpu_cluster() {
    const TEST: &str = "cuda_ipc_cluster_matches_the_cpu_cluster";
    if gpu(TEST, 0).is_none() {
        return;
    }
    parity_over(TEST, "cuda-ipc", "cuda:0", "cuda:0");
    if tandem_engine::cuda::probe(1).is_ok() {
        parity_over(TEST, "cuda-ipc", "cuda:0", "cuda:1");
    }
}

#[test]
fn nccl_cluster_matches_the_cpu_cluster() {
    const TEST: &str = "nccl_cluster_matches_the_cpu_cluster";
    if gpu(TEST, 0).is_none() {
        return;
    }
    if let Err(e) = tandem_engine::cuda::probe(1) {
        eprintln!("NOT RUN {TEST}: one GPU only ({e}); NCCL cannot put two ranks on one GPU");
        return;
    }
    if let Err(e) = tandem_transport::nccl::load() {
        skip_test(Prerequisite::External, TEST, &e.to_string(), "pip install nvidia-nccl-cu13");
        return;
    }
    parity_over(TEST, "nccl", "cuda:0", "cuda:1");
}

#[test]
fn cuda_ipc_cancellations_leave_every_block_free() {
    const TEST: &str = "cuda_ipc_cancellations_leave_every_block_free";
    if gpu(TEST, 0).is_none() {
        return;
    }
    let model = TestModel::tiny();
    let mut spec = ClusterSpec::new(model.path.clone(), "cuda-ipc");
    spec.prefill_args = gpu_args("cuda:0");
    spec.decode_args = gpu_args("cuda:0");
    let cluster = Cluster::start(spec);
    let router = cluster.router.addr();
    let long = model.fit(6, |k| Req::text("once upon a time there was a lamp ".repeat(k * 5), 32));
    block_on(async {
        let mut tasks = Vec::new();
        for i in 0..48u64 {
            let req = long.to_proto();
            // From at once to 300 ms: before the reservation, during prefill and the copy, and
            // while streaming.
            let after = Duration::from_millis((i * 37) % 300);
            tasks.push(tokio::spawn(async move {
                let _ = tokio::time::timeout(after, generate(router, req)).await;
            }));
        }
        for t in tasks {
            t.await.expect("the request task ends");
        }
    });
    cluster.assert_quiescent(Duration::from_secs(30));
    // The cluster still serves afterwards.
    let after = generate_all(router, &[Req::text("After the storm", 4)]);
    assert!(after[0].is_ok(), "{:?}", after[0]);
}
