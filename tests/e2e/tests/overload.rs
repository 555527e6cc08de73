//! Overload through the real processes: `tandem bench --router --duration-s` offers twice the load
//! the decode worker's KV pool holds, for 30 seconds. Requests beyond capacity are refused with
//! RESOURCE_EXHAUSTED and a retry hint, the line for KV blocks never grows past
//! `--max-kv-waiting`, every admitted request runs to its last token, and the workers end with
//! every block free. Latencies are printed (the figures and their comparison live in
//! `scripts/overload-bench.sh` and `docs/benchmarks.md`, not in assertions).

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_e2e::*;

/// Prompt and output tokens of every request: 4 + 4 blocks of 16 at most.
const PROMPT: usize = 48;
const OUTPUT: usize = 64;
/// Decode pool: about 4 such sequences at once.
const POOL: usize = 32;
const MAX_KV_WAITING: usize = 2;

/// Runs `tandem bench --router` with `args` and returns its JSON report.
fn bench(router: SocketAddr, args: &[&str]) -> serde_json::Value {
    let mut cmd = Command::new(bin("tandem"));
    cmd.args(["bench", "--router", &router.to_string(), "--json"]);
    cmd.args(["--prompt-tokens", &PROMPT.to_string(), "--decode-tokens", &OUTPUT.to_string()]);
    cmd.args(args);
    let out = cmd.output().expect("running tandem bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "tandem bench failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("bench JSON ({e}): {stdout}"))
}

fn metrics(cluster: &Cluster) -> String {
    let http = cluster.router.http.expect("the router announces its HTTP address");
    http_get(http, "/metrics").expect("the router answers /metrics").1
}

/// Sum of the `name` samples whose labels hold every one of `labels`.
fn labelled(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter(|l| labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn twice_the_capacity_is_refused_fast_and_what_is_admitted_finishes() {
    let model = TestModel::tiny();
    let mut spec = ClusterSpec::new(model.path.clone(), "tcp");
    spec.kv_blocks = 256;
    spec.decode_kv_blocks = Some(POOL);
    spec.router_args =
        vec!["--max-kv-waiting".into(), MAX_KV_WAITING.to_string(), "--kv-wait-ms".into(), "10000".into()];
    let cluster = Cluster::start(spec);
    let router = cluster.router.addr();

    // Unloaded: one request at a time.
    let calm = bench(router, &["--concurrency", "1", "--requests", "8"]);
    assert_eq!((calm["failed"].as_u64(), calm["refused"].as_u64()), (Some(0), Some(0)), "{calm}");

    // Twice what the pool holds, for 30 s, while the line for KV blocks is watched.
    let stop = Arc::new(AtomicBool::new(false));
    let longest_line = Arc::new(Mutex::new(0.0f64));
    let http = cluster.router.http.expect("the router announces its HTTP address");
    let watcher = {
        let (stop, longest_line) = (stop.clone(), longest_line.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if let Some((_, text)) = http_get(http, "/metrics") {
                    let n = sample(&text, "tandem_router_kv_waiting").unwrap_or(0.0);
                    let mut l = longest_line.lock().unwrap();
                    *l = l.max(n);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let before = metrics(&cluster);
    let loaded = bench(router, &["--concurrency", "8", "--duration-s", "30"]);
    stop.store(true, Ordering::SeqCst);
    watcher.join().unwrap();
    let after = metrics(&cluster);

    eprintln!("unloaded: {calm}");
    eprintln!("2x overload: {loaded}");
    let ms = |v: &serde_json::Value, k: &str, p: &str| v[k][p].as_f64().unwrap_or(f64::NAN);
    eprintln!(
        "refusals answered in p50 {:.1} ms, p99 {:.1} ms; inter-token p99 {:.1} ms loaded vs {:.1} ms unloaded",
        ms(&loaded, "refusal_ms", "p50"),
        ms(&loaded, "refusal_ms", "p99"),
        ms(&loaded, "itl_ms", "p99"),
        ms(&calm, "itl_ms", "p99"),
    );
    let n = |k: &str| loaded[k].as_u64().unwrap_or_else(|| panic!("{k} in {loaded}"));
    assert_eq!(n("failed"), 0, "every admitted request ran to its last token: {loaded}\n{}", cluster.logs());
    assert!(n("refused") > 0, "twice the capacity was offered, yet nothing was refused: {loaded}");
    assert_eq!(n("refused_without_retry_after"), 0, "{loaded}");
    assert!(n("requests") > n("refused"), "some requests were admitted: {loaded}");
    let longest = *longest_line.lock().unwrap();
    assert!(longest <= MAX_KV_WAITING as f64, "{longest} requests waited for KV blocks at once");

    // The router's counts agree with the client's: the refusals, and no other error.
    let delta =
        |name: &str, labels: &[&str]| labelled(&after, name, labels) - labelled(&before, name, labels);
    let refused = n("refused") as f64;
    assert_eq!(delta("tandem_router_errors_total", &["resource_exhausted"]), refused, "{after}");
    assert_eq!(delta("tandem_router_errors_total", &[]), refused, "only refusals failed:\n{after}");
    assert_eq!(delta("tandem_router_requests_total", &["outcome=\"error\""]), refused, "{after}");
    assert_eq!(
        delta("tandem_router_requests_total", &["outcome=\"ok\""]),
        (n("requests") - n("refused")) as f64,
        "{after}"
    );
    cluster.assert_quiescent(Duration::from_secs(30));
}
