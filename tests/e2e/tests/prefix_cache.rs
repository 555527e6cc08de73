//! The prefix cache through `tandem up` (one prefill and one decode worker), on each test model:
//! - greedy output equals the in-process engine's (which has no cache) for a miss, a long shared
//!   prefix, a repeat, a prompt that diverges mid-block, an unrelated prompt and salted prompts:
//!   over tcp, over shm, with `--speculate ngram`, and with `--prefix-cache false`;
//! - the work saved is exactly the leading full blocks the workers already hold: the prefill
//!   worker reports them in `Usage.cached_tokens` and computes only the rest (its `prefix_cache`
//!   counters), the decode worker pins them and the transfer carries only the blocks after them
//!   (`Timings.transfer_bytes`, both workers' `transfers.bytes`);
//! - `cache_salt` isolates: a cached prompt under another salt is computed and sent in full, and
//!   is a hit again under its own salt;
//! - without the cache nothing is cached and every prompt is sent whole;
//! - afterwards every worker is quiescent (free + cached == total, invariants hold).
//!
//! Requests go one after another, so what each finds in the cache is known exactly.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tandem_e2e::*;
use tandem_proto::v1;
use tandem_serve::auth::{cluster_request, Secret};

/// The cluster secret of the clusters started here, so the test may call the workers' `Stats`.
const SECRET: &str = "prefix-cache-test-secret";
/// Tokens per KV block (passed to the workers).
const BS: usize = 16;
/// Output tokens of every request: enough for n-gram drafts, short enough for SmolLM2 on 2 cores.
const MAX_TOKENS: u32 = 24;
/// The prompts' shared prefix, in tokens (18 full blocks and 12 tokens).
const SHARED: usize = 300;
/// Where the mid-block divergence is (block 12 holds tokens 192..208).
const DIVERGE_AT: usize = 200;

/// Text the prompts are cut from (repetitive, so prompt lookup finds drafts).
const PASSAGES: [&str; 4] = [
    "The river town kept its clocks by the ferry. Every morning the first boat left at six.",
    "Mix the flour with the salt, add the water slowly, and knead the dough for ten minutes.",
    "The meeting is moved to Thursday at ten in the small room on the second floor.",
    "Nobody remembered who had started the custom, but everybody agreed the town needed it.",
];

/// One request of the workload, and how many leading prompt blocks both workers hold of it when
/// it comes (with the cache on; none without).
struct Step {
    what: &'static str,
    prompt: Vec<u32>,
    salt: &'static str,
    cached_blocks: usize,
}

/// The first `n` tokens of `text` repeated until it has that many.
fn tokens(model: &TestModel, text: &str, n: usize) -> Vec<u32> {
    let ids = model.tokenizer().encode(text, false).expect("tokenizes");
    assert!(!ids.is_empty());
    ids.iter().copied().cycle().take(n).collect()
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn workload(model: &TestModel) -> Vec<Step> {
    let story: String = (0..24).map(|i| format!("Entry {i}: {} ", PASSAGES[i % 4])).collect();
    let shared = tokens(model, &story, SHARED);
    let with = |head: &[u32], tail: &str, n: usize| {
        let mut p = head.to_vec();
        p.extend(tokens(model, tail, n));
        p
    };
    // A and B: 320 tokens, 20 blocks; they share exactly the first 300 tokens.
    let a = with(&shared, " Summarize the entries above in one sentence, then list the days named.", 20);
    let b = with(&shared, " Which entry mentions the meeting room, and on which floor is it held?", 20);
    assert_eq!(common_prefix(&a, &b), SHARED, "the suffixes must differ at their first token");
    // C: the shared text with one token changed mid-block 12, 310 tokens.
    let mut c = with(&shared, " Copy the last entry exactly as it is written above, word for word.", 10);
    c[DIVERGE_AT] = *c[DIVERGE_AT + 1..].iter().find(|&&t| t != shared[DIVERGE_AT]).expect("another token");
    assert_eq!(common_prefix(&a, &c), DIVERGE_AT);
    // D: unrelated, 290 tokens (18 full blocks and a partial one).
    let other: String =
        (0..24).map(|i| format!("Line {i}. {} ", PASSAGES[(i + 2) % 4].to_uppercase())).collect();
    let d = tokens(model, &format!("Translate every line below into French. {other}"), 290);
    assert!(common_prefix(&a, &d) < BS && common_prefix(&c, &d) < BS, "D must share no block");

    let step = |what, prompt: &Vec<u32>, salt, cached_blocks| Step {
        what,
        prompt: prompt.clone(),
        salt,
        cached_blocks,
    };
    vec![
        step("a miss", &a, "", 0),
        // The 18 full blocks of the shared prefix; block 18 mixes shared and new tokens.
        step("a long shared prefix", &b, "", SHARED / BS),
        // All 20 blocks are held, but the block of the last prompt token is always computed and sent.
        step("a repeat", &b, "", 19),
        step("a divergence mid-block", &c, "", DIVERGE_AT / BS),
        step("an unrelated prompt", &d, "", 0),
        // B is cached unsalted; a salt is another namespace, and so is each other salt.
        step("a cached prompt under salt a", &b, "a", 0),
        step("the same prompt under salt b", &b, "b", 0),
        step("salt a again", &b, "a", 19),
    ]
}

/// `tandem up` with the workers' addresses from the router's `Health`.
struct Up {
    proc: Proc,
    router: SocketAddr,
    prefill: SocketAddr,
    decode: SocketAddr,
}

impl Up {
    fn start(model: &TestModel, args: &[&str]) -> Up {
        Up::start_with(model, 512, args)
    }

    /// [`Up::start`] with pools of `kv_blocks` blocks.
    fn start_with(model: &TestModel, kv_blocks: usize, args: &[&str]) -> Up {
        let blocks = kv_blocks.to_string();
        let mut all: Vec<String> = ["up", "--threads", "1", "--kv-blocks", blocks.as_str(), "--block-size"]
            .iter()
            .chain(&[BS.to_string().as_str(), "--cluster-secret", SECRET, "--model"])
            .map(|s| s.to_string())
            .collect();
        all.push(model.path.display().to_string());
        all.extend(args.iter().map(|s| s.to_string()));
        let proc = Proc::spawn("up", &bin("tandem"), &all);
        let line = proc
            .next_line(Duration::from_secs(240))
            .unwrap_or_else(|| panic!("no ready line:\n{}", proc.log_tail(4000)));
        let ready = parse_ready(&line)
            .unwrap_or_else(|| panic!("unexpected line {line:?}:\n{}", proc.log_tail(4000)));
        let h = block_on(health(ready.router)).expect("Health");
        let addr = |role: v1::Role| -> SocketAddr {
            let w = h.workers.iter().find(|w| w.role == role as i32).unwrap_or_else(|| panic!("{h:?}"));
            w.address.parse().expect("worker address")
        };
        Up { router: ready.router, prefill: addr(v1::Role::Prefill), decode: addr(v1::Role::Decode), proc }
    }

    fn stop(mut self) {
        self.proc.signal(libc::SIGINT);
        let st = self.proc.wait_exit(Duration::from_secs(60)).expect("tandem up stops");
        assert!(st.success(), "tandem up exited with {st}:\n{}", self.proc.log_tail(4000));
    }

    /// Polls both workers until each is quiescent and returns their stats (prefill, decode).
    fn assert_quiescent(&self) -> (v1::StatsResponse, v1::StatsResponse) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (p, d) = (worker_stats(self.prefill), worker_stats(self.decode));
            if is_quiescent(&p) && is_quiescent(&d) {
                return (p, d);
            }
            if Instant::now() >= deadline {
                panic!("workers not quiescent:\n{p:#?}\n{d:#?}\n{}", self.proc.log_tail(4000));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A worker's `Stats`, counted on its engine thread (fresh, not the published snapshot), with the
/// allocator's invariants checked.
fn worker_stats(addr: SocketAddr) -> v1::StatsResponse {
    let secret = Secret::new(SECRET, "cluster-secret").expect("secret");
    let st = block_on(async {
        let mut c = WorkerClient::new(channel(addr).await.expect("worker reachable"));
        c.stats(cluster_request(Some(&secret), v1::StatsRequest { check_invariants: true }))
            .await
            .expect("Stats")
            .into_inner()
    });
    assert!(st.invariants_checked && st.invariants_ok, "{addr}: {}", st.invariant_error);
    st
}

/// What the final message of a Generate stream reports, with the tokens of the whole stream.
struct Answer {
    tokens: Vec<u32>,
    finish_reason: Option<String>,
    usage: v1::Usage,
    timings: v1::Timings,
}

fn send(router: SocketAddr, prompt: &[u32], salt: &str) -> Result<Answer, tonic::Status> {
    let req = v1::GenerateRequest {
        prompt: Some(v1::generate_request::Prompt::TokenIds(v1::TokenIds { ids: prompt.to_vec() })),
        max_tokens: Some(MAX_TOKENS),
        cache_salt: salt.into(),
        ..Default::default()
    };
    block_on(async {
        let ch = channel(router).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let mut stream = TandemClient::new(ch).generate(req).await?.into_inner();
        let mut a = Answer {
            tokens: Vec::new(),
            finish_reason: None,
            usage: Default::default(),
            timings: Default::default(),
        };
        let (mut usage, mut timings) = (None, None);
        while let Some(msg) = stream.message().await? {
            a.tokens.extend(msg.token_ids);
            a.finish_reason = msg.finish_reason.or(a.finish_reason);
            usage = msg.usage.or(usage);
            timings = msg.timings.or(timings);
        }
        a.usage = usage.expect("the last message carries the usage");
        a.timings = timings.expect("the last message carries the timings");
        Ok(a)
    })
}

/// Counter changes across one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Delta {
    lookups: u64,
    hit_tokens: u64,
    computed_prompt_tokens: u64,
    transfers: u64,
    transfer_bytes: u64,
}

fn delta(before: &v1::StatsResponse, after: &v1::StatsResponse) -> Delta {
    let (p0, p1) = (before.prefix_cache.unwrap_or_default(), after.prefix_cache.unwrap_or_default());
    let (t0, t1) = (before.transfers.unwrap_or_default(), after.transfers.unwrap_or_default());
    Delta {
        lookups: p1.lookups - p0.lookups,
        hit_tokens: p1.hit_tokens - p0.hit_tokens,
        computed_prompt_tokens: p1.computed_prompt_tokens - p0.computed_prompt_tokens,
        transfers: t1.transfers - t0.transfers,
        transfer_bytes: t1.bytes - t0.bytes,
    }
}

/// The workload through `tandem up --prefix-cache <cache> args...`, one request at a time: the
/// reference output every time, exactly the savings [`Step::cached_blocks`] says (none without
/// the cache), and quiescent workers at the end.
fn run(model: &TestModel, cache: bool, args: &[&str]) {
    run_with(model, cache, args, true)
}

/// [`run`]; with `exact` false (pools whose window layers give back old KV, which then is
/// neither moved nor cached), the reference output every time, hits no more than a full pool's,
/// and quiescent workers at the end.
fn run_with(model: &TestModel, cache: bool, args: &[&str], exact: bool) {
    let steps = workload(model);
    let prompts: Vec<Vec<u32>> = steps.iter().map(|s| s.prompt.clone()).collect();
    let expected = reference_ids(&model.path, &prompts, MAX_TOKENS, 512, BS);
    let flag = cache.to_string();
    let mut all = vec!["--prefix-cache", flag.as_str()];
    all.extend_from_slice(args);
    let up = Up::start(model, &all);
    let mut block_bytes = None;
    for (i, (step, want)) in steps.iter().zip(&expected).enumerate() {
        let ctx = format!("request {i}, {} ({all:?})", step.what);
        let before = (worker_stats(up.prefill), worker_stats(up.decode));
        let got = send(up.router, &step.prompt, step.salt)
            .unwrap_or_else(|s| panic!("{ctx} failed: {s:?}\n{}", up.proc.log_tail(4000)));
        let after = (worker_stats(up.prefill), worker_stats(up.decode));
        assert_eq!(got.tokens, want.token_ids, "{ctx}: output differs from the engine's");
        assert_eq!(got.finish_reason, want.finish_reason, "{ctx}");

        let n = step.prompt.len();
        let blocks = n.div_ceil(BS);
        let cached = if cache { step.cached_blocks } else { 0 };
        let sent = (blocks - cached) as u64;
        if !exact {
            assert!(
                got.usage.cached_tokens as usize <= cached * BS,
                "{ctx}: more cached than a full pool holds"
            );
            assert!(got.timings.transfer_bytes > 0, "{ctx}: nothing moved");
            continue;
        }
        let per_block = *block_bytes.get_or_insert_with(|| {
            // The first request is a miss: every block is sent.
            let b = got.timings.transfer_bytes;
            assert!(b > 0 && b.is_multiple_of(blocks as u64), "{ctx}: {b} bytes for {blocks} blocks");
            b / blocks as u64
        });
        assert_eq!(got.usage.prompt_tokens as usize, n, "{ctx}");
        assert_eq!(got.usage.cached_tokens as usize, cached * BS, "{ctx}: cached tokens");
        assert_eq!(
            got.timings.transfer_bytes,
            sent * per_block,
            "{ctx}: {sent} of {blocks} blocks should move"
        );

        let (p, d) = (delta(&before.0, &after.0), delta(&before.1, &after.1));
        let hits = (cached * BS) as u64;
        let moved = got.timings.transfer_bytes;
        if cache {
            let computed = (n - cached * BS) as u64;
            let want_p = Delta {
                lookups: 1,
                hit_tokens: hits,
                computed_prompt_tokens: computed,
                transfers: 1,
                transfer_bytes: moved,
            };
            assert_eq!(p, want_p, "{ctx}: prefill worker's counters");
            let want_d = Delta {
                lookups: 1,
                hit_tokens: hits,
                computed_prompt_tokens: 0,
                transfers: 1,
                transfer_bytes: moved,
            };
            assert_eq!(d, want_d, "{ctx}: decode worker's counters");
        } else {
            for (who, st) in [("prefill", &after.0), ("decode", &after.1)] {
                assert_eq!(st.prefix_cache, None, "{ctx}: the {who} worker reports a prefix cache");
            }
            let want = Delta {
                lookups: 0,
                hit_tokens: 0,
                computed_prompt_tokens: 0,
                transfers: 1,
                transfer_bytes: moved,
            };
            assert_eq!((p, d), (want, want), "{ctx}: transfer counters");
        }
    }

    let (p, d) = up.assert_quiescent();
    for (who, st) in [("prefill", &p), ("decode", &d)] {
        let kv = st.kv.expect("kv counters");
        if cache {
            let pc = st.prefix_cache.expect("prefix-cache counters");
            assert!(kv.cached > 0, "the {who} worker kept nothing cached: {kv:?}");
            assert_eq!(pc.cached_blocks, kv.cached, "{who}: {pc:?} vs {kv:?}");
        } else {
            assert_eq!(kv.cached, 0, "the {who} worker cached blocks without a prefix cache: {kv:?}");
        }
    }
    if args.contains(&"--speculate") {
        let s = d.speculation.expect("the decode worker reports speculation");
        assert!(s.proposed > 0 && s.accepted <= s.proposed, "no drafts, the test proves nothing: {s:?}");
    }
    up.stop();
}

model_test!(cache_over_tcp, |m| run(m, true, &["--transport", "tcp"]));

model_test!(cache_over_shm, |m| run(m, true, &["--transport", "shm"]));

model_test!(cache_with_ngram_speculation, |m| run(m, true, &["--transport", "tcp", "--speculate", "ngram"]));

// Partial transfers (cached prefixes skipped) and staged speculation over NIXL.
model_test!(cache_with_ngram_speculation_over_nixl, |m| {
    if tandem_e2e::external::nixl_library("cache_with_ngram_speculation_over_nixl") {
        run(m, true, &["--transport", "nixl", "--speculate", "ngram"])
    }
});

// The prefix cache (with n-gram speculation) for every family beyond Llama, on pools that keep
// every layer's KV (so that the savings are exactly those the workload states).
family_test!(family_cache_with_ngram_speculation, |m| run(
    m,
    true,
    &["--transport", "shm", "--speculate", "ngram", "--windowed-kv", "false"]
));

// The same where window layers give back old KV (the workers' default): the same output.
family_test!(family_windowed_cache_with_ngram_speculation, |m| run_with(
    m,
    true,
    &["--transport", "shm", "--speculate", "ngram"],
    false
));

model_test!(no_cache, |m| run(m, false, &["--transport", "tcp"]));

// KV tiers (docs/prefix-cache.md#kv-tiers): pools too small to keep a conversation while other
// prompts run, with a disk tier behind them. A conversation's next turn after the pools evicted
// it comes back from disk (the workers read fewer prompt tokens than they did without the tier,
// in the same test), with the reference output; the tier survives `tandem up` being stopped and
// started again; a tier too small to hold a page stores nothing and costs nothing but the
// computation; and an unusable directory is refused at start-up by name.

/// Blocks in each worker's pool in the tier tests: one 208-token prompt and its answer take 15.
const SMALL_POOL: usize = 40;

/// A conversation's first turn, four unrelated prompts that push it out of both pools, and its
/// next turn (the first turn and new text): the prompts, in order.
fn evicting_workload(model: &TestModel) -> Vec<Vec<u32>> {
    let first = tokens(model, PASSAGES[0], 208);
    let mut all = vec![first.clone()];
    for (i, passage) in PASSAGES.iter().enumerate() {
        let mut other = tokens(model, passage, 200 + i);
        other.insert(0, first[1]);
        other.rotate_left(i + 1);
        all.push(other);
    }
    let mut next = first;
    next.extend(tokens(model, PASSAGES[2], 40));
    all.push(next);
    all
}

/// Runs the workload on a cluster with `args`; every answer is the reference's. Returns the last
/// request's cached tokens.
fn run_evicting(model: &TestModel, args: &[&str], expected: &[Answer0]) -> (Up, u32) {
    let prompts = evicting_workload(model);
    let up = Up::start_with(model, SMALL_POOL, args);
    let mut cached = 0;
    for (i, (prompt, want)) in prompts.iter().zip(expected).enumerate() {
        let got = send(up.router, prompt, "")
            .unwrap_or_else(|s| panic!("request {i} ({args:?}) failed: {s:?}\n{}", up.proc.log_tail(4000)));
        assert_eq!(got.tokens, want.0, "request {i} ({args:?}): output differs from the engine's");
        cached = got.usage.cached_tokens;
    }
    up.assert_quiescent();
    (up, cached)
}

/// The reference tokens of a prompt.
struct Answer0(Vec<u32>);

fn expected(model: &TestModel) -> Vec<Answer0> {
    let prompts = evicting_workload(model);
    reference_ids(&model.path, &prompts, MAX_TOKENS, 512, BS)
        .into_iter()
        .map(|r| Answer0(r.token_ids))
        .collect()
}

/// The page files in a worker's disk tier under `tandem up --kv-disk-dir dir`.
fn pages_on_disk(dir: &std::path::Path, worker: &str) -> usize {
    let files = std::fs::read_dir(dir.join(worker)).expect("the worker's tier directory");
    files
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).into_iter().flatten().flatten())
        .filter(|f| f.path().extension().is_some_and(|x| x == "kvp"))
        .count()
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tandem-e2e-tiers-{tag}-{}", rand::random::<u32>()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

model_test!(an_evicted_conversation_comes_back_from_the_disk_tier_and_after_a_restart, |m| {
    let want = expected(m);
    let first_blocks = (208 / BS) as u32;
    // Without a tier the pools forget the first turn: the last request computes it again.
    let (up, cached) = run_evicting(m, &["--transport", "tcp"], &want);
    up.stop();
    assert_eq!(cached, 0, "the pools kept the conversation: the test measures nothing");

    let dir = temp_dir("restart");
    let disk = dir.display().to_string();
    let args = ["--transport", "tcp", "--kv-disk-dir", disk.as_str()];
    let (up, cached) = run_evicting(m, &args, &want);
    assert!(cached >= first_blocks * BS as u32 - BS as u32, "{cached} tokens came back from disk");
    up.stop();
    for worker in ["prefill-0", "decode-0"] {
        assert!(pages_on_disk(&dir, worker) > 0, "{worker} kept no page on disk");
    }

    // Started again on the same directory: the conversation's next turn finds it at once.
    let up = Up::start_with(m, SMALL_POOL, &args);
    let prompts = evicting_workload(m);
    let last = prompts.len() - 1;
    let got = send(up.router, &prompts[last], "").expect("the revisit after the restart");
    assert_eq!(got.tokens, want[last].0, "after the restart");
    assert!(got.usage.cached_tokens >= first_blocks * BS as u32 - BS as u32, "{:?}", got.usage);
    up.assert_quiescent();
    up.stop();
    let _ = std::fs::remove_dir_all(&dir);
});

#[test]
fn a_full_tier_keeps_only_its_newest_pages_and_changes_no_answer() {
    let m = TestModel::tiny();
    let want = expected(&m);
    let dir = temp_dir("tiny");
    let disk = dir.display().to_string();
    // Two of the tiny model's pages (6 KiB each): the conversation's are evicted from the tier
    // by the prompts after it, so nothing comes back.
    let args = ["--transport", "tcp", "--kv-disk-dir", disk.as_str(), "--kv-disk-bytes", "12KiB"];
    let (up, cached) = run_evicting(&m, &args, &want);
    assert_eq!(cached, 0, "the tier kept only later prompts' pages");
    up.stop();
    for worker in ["prefill-0", "decode-0"] {
        let pages = pages_on_disk(&dir, worker);
        assert!((1..=2).contains(&pages), "{worker} holds {pages} pages in a tier of two");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unusable_disk_tier_directory_is_refused_by_name() {
    let m = TestModel::tiny();
    let missing = std::env::temp_dir().join(format!("tandem-no-such-dir-{}", rand::random::<u32>()));
    let mut all: Vec<String> = ["up", "--threads", "1", "--model"].iter().map(|s| s.to_string()).collect();
    all.push(m.path.display().to_string());
    all.extend(["--kv-disk-dir".into(), missing.display().to_string()]);
    let mut proc = Proc::spawn("up-bad-tier", &bin("tandem"), &all);
    let st = proc.wait_exit(Duration::from_secs(60)).expect("tandem up exits");
    assert!(!st.success());
    let log = proc.log_tail(4000);
    assert!(log.contains("--kv-disk-dir") && log.contains(&missing.display().to_string()), "{log}");

    // A worker given a directory it cannot write refuses to start, naming it.
    if unsafe { libc::geteuid() } != 0 {
        use std::os::unix::fs::PermissionsExt;
        let ro = temp_dir("read-only");
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        let args: Vec<String> = [
            "--model",
            &m.path.display().to_string(),
            "--listen",
            "127.0.0.1:0",
            "--kv-disk-dir",
            &ro.display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut w = Proc::spawn("worker-read-only-tier", &bin("tandem-decode"), &args);
        let st = w.wait_exit(Duration::from_secs(60)).expect("the worker exits");
        assert!(!st.success());
        let log = w.log_tail(4000);
        assert!(log.contains("--kv-disk-dir") && log.contains(&ro.display().to_string()), "{log}");
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
        let _ = std::fs::remove_dir_all(&ro);
    }
}
