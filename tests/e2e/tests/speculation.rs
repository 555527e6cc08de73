//! Speculative decoding wherever it runs, through the real binaries:
//! - `tandem up --speculate ngram` (the flags go to the decode or colocated worker): greedy output
//!   over tcp, over shm and colocated equals the in-process engine's without speculation (which
//!   the parity tests hold equal to the same cluster without speculation), the decode worker did
//!   draft tokens (its `Stats`), and the router lists how each worker speculates;
//! - the worker binaries: a speculating decode worker's `/metrics` counts its draft tokens, the
//!   prefill worker has no such metrics and refuses the speculation flags;
//! - `tandem generate --json --speculate ngram`: the same tokens as without, plus the counts;
//! - a draft model whose vocabulary differs from the target's is refused at start-up, by
//!   `tandem generate`, by `tandem-decode` and by `tandem up`, with a message naming the flag and
//!   the file, and a non-zero exit (never a panic).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tandem_e2e::*;
use tandem_proto::v1;
use tandem_serve::auth::{cluster_request, Secret};

/// The cluster secret of the clusters `tandem up` starts here, so the test may call the workers.
const SECRET: &str = "speculation-test-secret";

/// Passages the prompts ask to repeat: what prompt lookup drafts from.
const PASSAGES: [&str; 4] = [
    "The river town kept its clocks by the ferry. Every morning the first boat left at six.",
    "Mix the flour with the salt, add the water slowly, and knead the dough for ten minutes.",
    "The meeting is moved to Thursday at ten in the small room on the second floor.",
    "Nobody remembered who had started the custom, but everybody agreed the town needed it.",
];

/// Eight chat requests that ask to repeat, quote or copy a passage, and one plain-text one.
fn workload(model: &TestModel) -> Vec<Req> {
    let max_tokens = if model.name == "tiny" { 64 } else { 40 };
    let mut reqs: Vec<Req> = (0..8)
        .map(|i| {
            let asks = ["Repeat this text exactly:", "Quote this passage word for word:"];
            let mut r = Req::text(format!("{}\n\n{}", asks[i / 4], PASSAGES[i % 4]), max_tokens);
            r.chat = true;
            r
        })
        .collect();
    reqs.push(Req::text(format!("{} {}", PASSAGES[0], PASSAGES[0]), max_tokens));
    reqs
}

/// `tandem up` with `args`; the router's address once it is ready.
fn up(model: &TestModel, args: &[&str]) -> (Proc, SocketAddr) {
    let mut all: Vec<String> = ["up", "--threads", "1", "--cluster-secret", SECRET, "--model"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    all.push(model.path.display().to_string());
    all.extend(args.iter().map(|s| s.to_string()));
    let p = Proc::spawn("up", &bin("tandem"), &all);
    let line = p
        .next_line(Duration::from_secs(240))
        .unwrap_or_else(|| panic!("no ready line:\n{}", p.log_tail(4000)));
    let ready =
        parse_ready(&line).unwrap_or_else(|| panic!("unexpected line {line:?}:\n{}", p.log_tail(4000)));
    (p, ready.router)
}

fn stop(mut up: Proc) {
    up.signal(libc::SIGINT);
    let st = up.wait_exit(Duration::from_secs(60)).unwrap_or_else(|| panic!("tandem up did not stop"));
    assert!(st.success(), "tandem up exited with {st}:\n{}", up.log_tail(4000));
}

/// A worker's `Stats` (without the invariant check: the published snapshot, which `/metrics`
/// reads too).
fn worker_stats(addr: &str) -> v1::StatsResponse {
    let secret = Secret::new(SECRET, "cluster-secret").expect("secret");
    block_on(async {
        let ch = channel(addr.parse().expect("worker address")).await.expect("worker reachable");
        let mut c = WorkerClient::new(ch);
        c.stats(cluster_request(Some(&secret), v1::StatsRequest { check_invariants: false }))
            .await
            .expect("Stats")
            .into_inner()
    })
}

fn ngram_record() -> v1::SpeculationInfo {
    v1::SpeculationInfo { method: "ngram".into(), max_draft: 4, adaptive: true, drafter: "ngram 2..4".into() }
}

/// `tandem up --speculate ngram` with `args`: same greedy output as the engine without
/// speculation, drafts were made, and the router lists the decode worker's speculation.
fn speculating_cluster(model: &TestModel, args: &[&str]) {
    let mut all = vec!["--speculate", "ngram"];
    all.extend_from_slice(args);
    cluster_matches_reference(model, &all, |r| assert_eq!(r, &ngram_record()));
}

/// `tandem up` with the decode worker drafting with the target model itself: the same greedy
/// output, and (a model agreeing with itself) nearly every draft accepted.
fn draft_model_cluster(model: &TestModel, args: &[&str]) {
    let path = model.path.display().to_string();
    let mut all = vec!["--speculate", "draft", "--draft-model", path.as_str()];
    all.extend_from_slice(args);
    cluster_matches_reference(model, &all, |r| {
        assert_eq!((r.method.as_str(), r.max_draft, r.adaptive), ("draft", 4, true), "{r:?}");
        assert!(r.drafter.starts_with("draft model "), "{r:?}");
    });
}

/// `tandem up` with `args` (speculation flags included): the greedy output of the engine without
/// speculation, draft tokens made, and the router's record of the decode worker passing
/// `check_record`.
fn cluster_matches_reference(model: &TestModel, args: &[&str], check_record: impl Fn(&v1::SpeculationInfo)) {
    let reqs = workload(model);
    let expected = reference(&model.path, &reqs, 512, 16);
    let (up, router) = up(model, args);
    let got = generate_all(router, &reqs);
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        match g {
            Ok(c) => assert_eq!(c, e, "request {i} differs with speculation ({args:?})"),
            Err(s) => panic!("request {i} failed ({args:?}): {s:?}\n{}", up.log_tail(4000)),
        }
    }
    // A lone request that repeats itself: the workload above runs concurrently, and on a slow
    // machine every request of it may decode in one batch the whole time, where the adaptive
    // depth drafts nothing. Alone, a sequence whose context repeats always gets drafts.
    let lone = Req::text("one two three four one two three four one two three four one two three four", 8);
    if let Err(s) = block_on(generate(router, lone.to_proto())) {
        panic!("the lone request failed ({args:?}): {s:?}\n{}", up.log_tail(4000));
    }
    let h = block_on(health(router)).expect("Health");
    let decoding = v1::Role::Decode as i32;
    let colocated = v1::Role::Colocated as i32;
    let mut decoders = 0;
    for w in &h.workers {
        let st = worker_stats(&w.address);
        if w.role == decoding || w.role == colocated {
            decoders += 1;
            let record = w
                .speculation
                .as_ref()
                .unwrap_or_else(|| panic!("the router has no record of {}", w.worker_id));
            check_record(record);
            let c =
                st.speculation.unwrap_or_else(|| panic!("{} reports no speculation: {st:?}", w.worker_id));
            assert!(c.proposed > 0, "{} drafted nothing: {c:?}", w.worker_id);
            assert!(c.accepted <= c.proposed && c.verifications > 0, "{c:?}");
            if record.method == "draft" {
                assert!(c.accepted * 10 >= c.proposed * 9, "a model drafting for itself: {c:?}");
            }
        } else {
            assert_eq!(w.speculation, None, "prefill worker {} listed as speculating", w.worker_id);
            assert_eq!(st.speculation, None, "prefill worker {} reports speculation", w.worker_id);
        }
    }
    assert_eq!(decoders, 1, "{:?}", h.workers);
    stop(up);
}

model_test!(speculation_over_tcp, |m| speculating_cluster(m, &["--transport", "tcp"]));

model_test!(speculation_over_shm, |m| speculating_cluster(m, &["--transport", "shm"]));

// n-gram speculation never changes a family's greedy output either.
family_test!(family_speculation_over_tcp, |m| speculating_cluster(m, &["--transport", "tcp"]));

model_test!(speculation_colocated, |m| speculating_cluster(m, &["--colocated"]));

model_test!(draft_model_speculation_over_tcp, |m| draft_model_cluster(m, &["--transport", "tcp"]));

/// The worker binaries as an operator starts them: the decode worker's `/metrics` counts its
/// draft tokens, the prefill worker's has no speculation metrics.
#[test]
fn a_speculating_decode_worker_reports_draft_tokens_in_its_metrics() {
    let model = TestModel::tiny();
    let mut spec = ClusterSpec::new(model.path.clone(), "tcp");
    spec.decode_args = ["--speculate", "ngram", "--spec-tokens", "3"].iter().map(|s| s.to_string()).collect();
    let cluster = Cluster::start(spec);
    let reqs = workload(&model);
    for (i, r) in generate_all(cluster.router.addr(), &reqs).iter().enumerate() {
        assert!(r.is_ok(), "request {i}: {r:?}\n{}", cluster.logs());
    }
    cluster.assert_quiescent(Duration::from_secs(10));
    let metrics = |p: &Proc| {
        let (code, body) = http_get(p.http.expect("http address"), "/metrics").expect("metrics answer");
        assert_eq!(code, 200);
        body
    };
    let value = |body: &str, name: &str| -> f64 {
        body.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in:\n{body}"))
            .trim()
            .parse()
            .expect("a number")
    };
    let d = metrics(&cluster.decode[0]);
    let proposed = value(&d, "tandem_worker_spec_draft_tokens_proposed_total");
    let accepted = value(&d, "tandem_worker_spec_draft_tokens_accepted_total");
    let verifications = value(&d, "tandem_worker_spec_verifications_total");
    assert!(proposed > 0.0 && accepted <= proposed && verifications > 0.0, "{d}");
    let rate = value(&d, "tandem_worker_spec_acceptance_rate");
    assert!((rate - accepted / proposed).abs() < 1e-9, "acceptance rate {rate} vs {accepted}/{proposed}");
    let mean = value(&d, "tandem_worker_spec_mean_accepted_length");
    assert!((mean - accepted / verifications).abs() < 1e-9, "mean accepted length {mean}");
    // At most --spec-tokens drafts per verification.
    assert!(proposed <= 3.0 * verifications, "{proposed} drafts in {verifications} verifications");
    let p = metrics(&cluster.prefill[0]);
    assert!(!p.contains("tandem_worker_spec_"), "the prefill worker reports speculation:\n{p}");
    // The router lists the decode worker with its k.
    let h = block_on(health(cluster.router.addr())).expect("Health");
    let d = h.workers.iter().find(|w| w.worker_id == "decode-0").expect("decode-0 listed");
    assert_eq!(d.speculation, Some(v1::SpeculationInfo { max_draft: 3, ..ngram_record() }));
}

#[test]
fn prefill_workers_refuse_the_speculation_flags() {
    for args in [["--speculate", "ngram"], ["--spec-tokens", "4"]] {
        let out = Command::new(bin("tandem-prefill"))
            .args(["--listen", "127.0.0.1:0", "--model"])
            .arg(tiny_model())
            .args(args)
            .env_remove("TANDEM_CONFIG")
            .output()
            .expect("tandem-prefill runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(args[0]) && err.contains("prefill workers never speculate"), "{err}");
    }
}

fn generate_json(model: &Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(bin("tandem"))
        .args(["generate", "--json", "--model"])
        .arg(model)
        .args(args)
        .output()
        .expect("tandem runs");
    assert!(out.status.success(), "tandem generate {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// `tandem generate --json --speculate ngram`: the tokens of plain `generate`, plus the counts.
fn generate_with_speculation(model: &TestModel) {
    let prompt = format!("Repeat this text exactly:\n\n{}", PASSAGES[0]);
    let plain = generate_json(&model.path, &["--chat", "--max-tokens", "48", &prompt]);
    assert!(plain.get("speculation").is_none(), "{plain}");
    let spec = generate_json(&model.path, &["--chat", "--max-tokens", "48", "--speculate", "ngram", &prompt]);
    for field in ["prompt_token_ids", "token_ids", "text", "finish_reason"] {
        assert_eq!(spec[field], plain[field], "{field} differs with speculation");
    }
    let s = &spec["speculation"];
    let (proposed, accepted) = (s["proposed"].as_u64(), s["accepted"].as_u64());
    let (Some(proposed), Some(accepted)) = (proposed, accepted) else { panic!("speculation: {s}") };
    assert!(proposed > 0 && accepted <= proposed, "{s}");

    // The model as its own draft model: the same tokens, and nearly every draft accepted.
    let path = model.path.display().to_string();
    let draft = generate_json(
        &model.path,
        &["--chat", "--max-tokens", "48", "--speculate", "draft", "--draft-model", &path, &prompt],
    );
    for field in ["prompt_token_ids", "token_ids", "text", "finish_reason"] {
        assert_eq!(draft[field], plain[field], "{field} differs with a draft model");
    }
    let s = &draft["speculation"];
    let (Some(proposed), Some(accepted)) = (s["proposed"].as_u64(), s["accepted"].as_u64()) else {
        panic!("speculation: {s}")
    };
    assert!(proposed > 0 && accepted * 10 >= proposed * 9, "{s}");
}

model_test!(generate_json_reports_speculation, generate_with_speculation);

/// A copy of the tiny fixture model whose vocabulary maps the same ids to other tokens (ordinary
/// tokens in reverse order): the same shapes, an incompatible vocabulary.
fn permuted_vocabulary_model() -> PathBuf {
    let src = tiny_model();
    let dir = std::env::temp_dir().join(format!("tandem-e2e-permuted-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("fixture directory");
    for entry in std::fs::read_dir(&src).expect("fixture") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("name").to_owned();
        if name != "tokenizer.json" && path.is_file() {
            std::fs::copy(&path, dir.join(&name)).expect("copy");
        }
    }
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).expect("tokenizer"))
            .expect("tokenizer JSON");
    let special: Vec<u64> = tok["added_tokens"]
        .as_array()
        .expect("added tokens")
        .iter()
        .filter_map(|t| t["id"].as_u64())
        .collect();
    let vocab = tok["model"]["vocab"].as_object_mut().expect("vocab");
    let mut ordinary: Vec<(String, u64)> = vocab
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().expect("id")))
        .filter(|(_, id)| !special.contains(id))
        .collect();
    ordinary.sort_by_key(|(_, id)| *id);
    let ids: Vec<u64> = ordinary.iter().map(|(_, id)| *id).rev().collect();
    for ((token, _), id) in ordinary.iter().zip(ids) {
        vocab.insert(token.clone(), serde_json::json!(id));
    }
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tok).expect("encode")).expect("write");
    dir
}

/// The draft model a test gives `model`: one that cannot draft for it.
fn incompatible_draft(model: &TestModel) -> PathBuf {
    if model.name == "tiny" {
        permuted_vocabulary_model()
    } else {
        tiny_model() // 448 tokens against SmolLM2's 49152
    }
}

fn assert_refused(who: &str, code: Option<i32>, stderr: &str, draft: &Path) {
    assert_eq!(code, Some(1), "{who} should exit 1:\n{stderr}");
    let flagged = format!("--draft-model {}", draft.display());
    assert!(stderr.contains(&flagged), "{who} does not name {flagged:?}:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{who} panicked:\n{stderr}");
    assert!(stderr.contains("not compatible"), "{who} does not say the vocabularies differ:\n{stderr}");
}

fn incompatible_draft_is_refused(model: &TestModel) {
    let draft = incompatible_draft(model);
    let d = draft.display().to_string();
    let spec = ["--speculate", "draft", "--draft-model", d.as_str()];

    let out = Command::new(bin("tandem"))
        .args(["generate", "--model"])
        .arg(&model.path)
        .args(spec)
        .arg("hello")
        .output()
        .expect("tandem runs");
    assert_refused("tandem generate", out.status.code(), &String::from_utf8_lossy(&out.stderr), &draft);
    assert!(out.stdout.is_empty(), "generate printed {:?}", String::from_utf8_lossy(&out.stdout));

    let mut args: Vec<String> =
        ["--listen", "127.0.0.1:0", "--kv-listen", "127.0.0.1:0", "--threads", "1", "--model"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    args.push(model.path.display().to_string());
    args.extend(spec.iter().map(|s| s.to_string()));
    let mut decode = Proc::spawn("decode", &bin("tandem-decode"), &args);
    let st = decode.wait_exit(Duration::from_secs(120)).expect("tandem-decode exits");
    assert_refused("tandem-decode", st.code(), &decode.log_text(), &draft);

    let mut up = Proc::spawn(
        "up",
        &bin("tandem"),
        &["up".into(), "--threads".into(), "1".into(), "--model".into(), model.path.display().to_string()]
            .into_iter()
            .chain(spec.iter().map(|s| s.to_string()))
            .collect::<Vec<_>>(),
    );
    let st = up.wait_exit(Duration::from_secs(240)).expect("tandem up exits");
    let log = up.log_text();
    assert_refused("tandem up", st.code(), &log, &draft);
    assert!(log.contains("decode"), "tandem up does not say which worker failed:\n{log}");
    if model.name == "tiny" {
        let _ = std::fs::remove_dir_all(&draft);
    }
}

model_test!(an_incompatible_draft_model_is_refused_at_start_up, incompatible_draft_is_refused);
