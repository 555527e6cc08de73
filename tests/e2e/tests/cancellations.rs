//! A storm of cancellations through the real processes: 1,000 requests (half over shm, half over
//! tcp), most of them abandoned by their client at a random moment — before the router reserves
//! blocks, while the prompt is computed or its KV moves, or while tokens stream — and the rest
//! run to the end. Afterwards every worker has every block free and no reservation left, the
//! requests that ran to the end got reference output, and the router's metrics count exactly
//! what the clients saw.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tandem_e2e::*;
use tandem_proto::v1;

/// Requests per transport.
const REQUESTS: usize = 500;
/// Requests in flight at once.
const CONCURRENCY: usize = 32;

/// What one client did and saw.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Gave up before any token arrived.
    #[default]
    CancelledBeforeTokens,
    /// Gave up while tokens were streaming.
    CancelledStreaming,
    /// Read the stream to its end.
    Finished,
}

/// Sends `req` and reads its stream, giving up after `cancel` (dropping the call, as a client
/// that goes away does). Counts the tokens it received in `tokens`.
async fn run(
    router: std::net::SocketAddr,
    req: v1::GenerateRequest,
    cancel: Duration,
    tokens: Arc<AtomicUsize>,
) -> Result<(Seen, Completion), tonic::Status> {
    // Tokens this client has received so far (counted into `tokens` as they arrive).
    let mine = Arc::new(AtomicUsize::new(0));
    let mine_in = mine.clone();
    let call = generate_watching(router, req, move |out| {
        let before = mine_in.swap(out.token_ids.len(), Ordering::SeqCst);
        tokens.fetch_add(out.token_ids.len() - before, Ordering::SeqCst);
    });
    match tokio::time::timeout(cancel, call).await {
        Ok(r) => r.map(|c| (Seen::Finished, c)),
        Err(_) if mine.load(Ordering::SeqCst) > 0 => Ok((Seen::CancelledStreaming, Completion::default())),
        Err(_) => Ok((Seen::CancelledBeforeTokens, Completion::default())),
    }
}

/// The sum of `name{...}` samples whose labels contain every one of `labels`.
fn labelled(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(name))
        .filter(|l| l.starts_with('{') && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn router_metrics(cluster: &Cluster) -> String {
    let http = cluster.router.http.expect("the router announces its HTTP address");
    let (code, text) = http_get(http, "/metrics").expect("the router answers /metrics");
    assert_eq!(code, 200, "{text}");
    text
}

#[test]
fn a_thousand_requests_cancelled_at_random_leak_nothing_and_are_counted_as_seen() {
    let model = TestModel::tiny();
    // The requests that run to the end: a few prompts, so their reference is cheap.
    let finishing: Vec<Req> =
        (0..4).map(|i| Req::text(format!("Finishing request {i}: the lamp was"), 6 + i as u32)).collect();
    let expected = reference(&model.path, &finishing, 1024, 16);
    // About half the context: a prompt that takes the prefill worker several steps.
    let long = model.fit(6, |k| Req::text("once upon a time there was a lamp ".repeat(k * 5), 64)).prompt;

    let mut totals = [0usize; 3];
    for transport in ["shm", "tcp"] {
        let mut spec = ClusterSpec::new(model.path.clone(), transport);
        spec.kv_blocks = 256;
        // Small steps, so a prompt takes several of them and a cancellation can land mid-prefill.
        spec.max_batch_tokens = 16;
        let cluster = Cluster::start(spec);
        let router = cluster.router.addr();
        let mut rng = rand::rng();
        // Cancel delays spread over every phase of a request's life, from "at once" to "well into
        // the stream"; one request in five is left to finish.
        let plans: Vec<(v1::GenerateRequest, Duration, Option<usize>)> = (0..REQUESTS)
            .map(|i| {
                if i % 5 == 0 {
                    let k = (i / 5) % finishing.len();
                    return (finishing[k].to_proto(), Duration::from_secs(120), Some(k));
                }
                let ms = match rng.random_range(0..5) {
                    0 => 0.0,
                    1 => rng.random_range(0.0..2.0),
                    2 => rng.random_range(2.0..20.0),
                    3 => rng.random_range(20.0..200.0),
                    _ => rng.random_range(200.0..800.0),
                };
                let prompt = if i % 2 == 0 { format!("Story {i}: {long}") } else { format!("Story {i}:") };
                let req = v1::GenerateRequest {
                    prompt: Some(v1::generate_request::Prompt::Text(prompt)),
                    max_tokens: Some(2000),
                    ignore_eos: true,
                    ..Default::default()
                };
                (req, Duration::from_secs_f64(ms / 1e3), None)
            })
            .collect();
        let before = router_metrics(&cluster);
        let tokens = Arc::new(AtomicUsize::new(0));
        let outcomes = block_on(async {
            let limit = Arc::new(tokio::sync::Semaphore::new(CONCURRENCY));
            let mut tasks = Vec::new();
            for (req, cancel, k) in plans {
                let permit = limit.clone().acquire_owned().await.unwrap();
                let tokens = tokens.clone();
                tasks.push(tokio::spawn(async move {
                    let r = run(router, req, cancel, tokens).await;
                    drop(permit);
                    (r, k)
                }));
            }
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.expect("request task"));
            }
            out
        });
        let mut seen = [0usize; 3];
        for (i, (r, k)) in outcomes.iter().enumerate() {
            let (s, c) = r
                .as_ref()
                .unwrap_or_else(|e| panic!("{transport}: request {i} failed: {e:?}\n{}", cluster.logs()));
            seen[*s as usize] += 1;
            match (s, k) {
                (Seen::Finished, Some(k)) => assert_eq!(c, &expected[*k], "{transport}: request {i}"),
                // Ran into the context limit before its client gave up: a finished request too.
                (Seen::Finished, None) => {
                    assert_eq!(c.finish_reason.as_deref(), Some("length"), "{transport}: {i}")
                }
                (_, Some(_)) => panic!("{transport}: request {i} was meant to finish"),
                _ => {}
            }
        }
        eprintln!(
            "{transport}: {} cancelled before any token, {} cancelled while streaming, {} finished",
            seen[0], seen[1], seen[2]
        );
        let planned =
            outcomes.iter().filter(|(r, k)| k.is_some() && matches!(r, Ok((Seen::Finished, _)))).count();
        assert_eq!(planned, REQUESTS / 5, "{transport}: every request left to finish finished");
        assert!(
            seen[0] > 0 && seen[1] > 0,
            "{transport}: cancellations must land both before and after the first token: {seen:?}"
        );

        cluster.assert_quiescent(Duration::from_secs(30));

        // The router counts what the clients saw: every finished request as ok, no errors, and
        // the cancelled ones (those it heard of; a call dropped before it reached the router
        // never started) as cancelled. A client whose time ran out just as the router sent the
        // last message counts itself cancelled while the router counts the request ok: those
        // are the `late` ones, at most as many as the cancellations.
        let after = router_metrics(&cluster);
        let delta = |labels: &[&str]| {
            labelled(&after, "tandem_router_requests_total", labels)
                - labelled(&before, "tandem_router_requests_total", labels)
        };
        let ok = delta(&["outcome=\"ok\""]);
        let late = ok - seen[2] as f64;
        assert!(
            late >= 0.0 && late <= (seen[0] + seen[1]) as f64,
            "{transport}: {ok} counted ok; clients finished {}, cancelled {}\n{after}",
            seen[2],
            seen[0] + seen[1]
        );
        assert_eq!(
            delta(&["outcome=\"error\""]),
            0.0,
            "{transport}: a cancellation was counted as an error:\n{after}"
        );
        let cancelled = delta(&["outcome=\"cancelled\""]);
        assert!(
            cancelled + late >= seen[1] as f64 && cancelled + late <= (seen[0] + seen[1]) as f64,
            "{transport}: {cancelled} counted cancelled and {late} ok after the client left; clients \
             cancelled {} ({} after tokens)\n{after}",
            seen[0] + seen[1],
            seen[1]
        );
        // Tokens the router sent that a cancelled client never read may still be in flight, so
        // the router's count is at least what the clients received.
        let gen = |t: &str| sample(t, "tandem_router_generated_tokens_total").unwrap_or(0.0);
        let sent = gen(&after) - gen(&before);
        let received = tokens.load(Ordering::SeqCst) as f64;
        assert!(sent >= received, "{transport}: router counted {sent} tokens, clients received {received}");
        assert_eq!(sample(&after, "tandem_router_queue_depth"), Some(0.0), "{transport}");
        assert_eq!(sample(&after, "tandem_router_kv_waiting"), Some(0.0), "{transport}");
        for (t, s) in totals.iter_mut().zip(seen) {
            *t += s;
        }
    }
    assert_eq!(totals.iter().sum::<usize>(), 2 * REQUESTS);
}
