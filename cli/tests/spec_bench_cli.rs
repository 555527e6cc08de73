//! `tandem bench --speculate`: the same workload without and with speculation in one run, on the
//! tiny reference model that ships with the repo. Figures are not checked against thresholds
//! (they depend on the machine); what is checked is that both runs did the same work, that only
//! the second speculated, and that greedy output did not change.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn tiny_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/llama-gqa")
}

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().unwrap()
}

fn bench_json(args: &[&str]) -> Value {
    let model = tiny_model().display().to_string();
    let mut all = vec!["bench", "--json", "--model", model.as_str(), "--threads", "1"];
    all.extend_from_slice(args);
    let out = tandem(&all);
    assert!(out.status.success(), "{all:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn speculative_bench_runs_the_workload_twice_and_compares() {
    let v = bench_json(&[
        "--workload",
        "friendly",
        "--speculate",
        "ngram",
        "--requests",
        "8",
        "--concurrency",
        "4",
        "--decode-tokens",
        "48",
    ]);
    assert_eq!(v["workload"], "friendly");
    assert_eq!(v["speculation"], "ngram 2..4, k=4, adaptive");
    assert_eq!(v["same_output"], true, "{v}");
    let (base, spec) = (&v["baseline"], &v["speculative"]);
    assert_eq!(base["output_tokens"], spec["output_tokens"], "{v}");
    assert!(base["output_tokens"].as_u64().unwrap() > 8, "{v}");
    assert_eq!(base["proposed"], 0, "the baseline speculated: {v}");
    let (proposed, accepted) = (spec["proposed"].as_u64().unwrap(), spec["accepted"].as_u64().unwrap());
    assert!(proposed > 0 && accepted <= proposed, "{v}");
    let rate = spec["acceptance_rate"].as_f64().unwrap();
    assert!((rate - accepted as f64 / proposed as f64).abs() < 1e-9, "{v}");
    assert!(v["speedup"].as_f64().is_some_and(|s| s > 0.0), "{v}");
    for run in [base, spec] {
        assert!(run["output_tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    }
}

#[test]
fn workloads_run_without_speculation_and_print_a_table_with_it() {
    for workload in ["friendly", "unfriendly", "synthetic"] {
        let args =
            ["--workload", workload, "--requests", "3", "--decode-tokens", "8", "--prompt-tokens", "16"];
        let v = bench_json(&args);
        if workload == "synthetic" {
            // Without --speculate the synthetic workload is the backend measurement.
            assert!(v["decode_tps"].as_f64().is_some(), "{v}");
            continue;
        }
        assert!(
            v["speculative"].is_null() && v["speculation"].is_null() && v["same_output"].is_null(),
            "{v}"
        );
        assert!(v["baseline"]["output_tokens"].as_u64().unwrap() > 0, "{v}");
    }
    let model = tiny_model().display().to_string();
    let out = tandem(&[
        "bench",
        "--model",
        &model,
        "--speculate",
        "ngram",
        "--requests",
        "3",
        "--prompt-tokens",
        "24",
        "--decode-tokens",
        "8",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("workload: synthetic, 3 requests"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("| baseline |")), "{text}");
    assert!(text.lines().any(|l| l.starts_with("| ngram |")), "{text}");
    assert!(text.contains("same output with and without speculation: yes"), "{text}");
    // Seeded sampling: greedy drafts give the same tokens; sampled drafts are not compared.
    let sampled = |extra: &[&str]| {
        let mut args = vec!["bench", "--model", &model, "--requests", "3", "--prompt-tokens", "24"];
        args.extend(["--decode-tokens", "8", "--temperature", "0.8", "--seed", "3"]);
        args.extend(extra);
        let out = tandem(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = sampled(&["--speculate", "ngram"]);
    assert!(text.contains("temperature 0.8 (seed 3)"), "{text}");
    assert!(text.contains("same output with and without speculation: yes"), "{text}");
    let text = sampled(&["--speculate", "draft", "--draft-model", &model, "--spec-sampled-drafts", "true"]);
    assert!(text.lines().any(|l| l.starts_with("| draft |")), "{text}");
    assert!(text.contains("output not compared: sampled drafts"), "{text}");
    assert!(text.contains(", sampled drafts\n"), "{text}");
}

#[test]
fn speculation_flags_where_no_engine_runs_here_are_refused() {
    let model = tiny_model().display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["bench", "--router", "127.0.0.1:1", "--speculate", "ngram"], "--router"),
        (vec!["bench", "--model", &model, "--transfer", "--speculate", "ngram"], "--transfer"),
        (vec!["bench", "--router", "127.0.0.1:1", "--workload", "friendly"], "--workload friendly"),
        (vec!["generate", "--router", "127.0.0.1:1", "--speculate", "ngram", "hi"], "--router"),
        (vec!["bench", "--model", &model, "--speculate", "draft"], "--draft-model"),
        (vec!["bench", "--model", &model, "--draft-model", "d.gguf"], "--draft-model d.gguf"),
        (vec!["bench", "--model", &model, "--speculate", "ngram", "--spec-tokens", "99"], "--spec-tokens"),
        (
            vec!["bench", "--model", &model, "--speculate", "ngram", "--spec-sampled-drafts", "true"],
            "--spec-sampled-drafts",
        ),
        (vec!["bench", "--model", &model, "--temperature", "0.5"], "--temperature"),
        (vec!["bench", "--model", &model, "--transfer", "--temperature", "0.5"], "--temperature"),
        (
            vec!["bench", "--model", &model, "--workload", "friendly", "--temperature", "NaN"],
            "--temperature NaN",
        ),
    ];
    for (args, want) in cases {
        let out = tandem(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want) && !err.contains("panicked"), "{args:?}: {err}");
    }
}
