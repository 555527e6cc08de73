//! `tandem backend-bench` on the CPU backend with tiny fixture models: every batch size gets a
//! row with positive timings, the bytes a step reads and the FLOPs of a prefill are the ones the
//! model's shape implies (counted here independently from `config.json`), the bounds follow from
//! the measured bandwidth and the given peak, and bad input is a clear error.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name)
}

fn bench(model: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("backend-bench")
        .arg("--model")
        .arg(model)
        .args(["--threads", "2"])
        .args(args)
        .output()
        .unwrap()
}

/// Small shapes, so a run takes well under a second.
const SMALL: &[(&str, &str)] = &[
    ("--batch", "1,3,8"),
    ("--context", "40"),
    ("--prefill", "50"),
    ("--steps", "3"),
    ("--warmup", "1"),
    ("--reps", "2"),
    ("--max-batch-tokens", "32"),
    ("--block-size", "8"),
];

/// `base` with each `(flag, value)` of `over` replacing the flag's value or added.
fn with(base: &[(&str, &str)], over: &[(&'static str, &'static str)]) -> Vec<String> {
    let mut args: Vec<(&str, &str)> = base.to_vec();
    for &(k, v) in over {
        match args.iter_mut().find(|(key, _)| *key == k) {
            Some(slot) => slot.1 = v,
            None => args.push((k, v)),
        }
    }
    args.iter().flat_map(|(k, v)| [k.to_string(), v.to_string()]).collect()
}

fn json(model: &Path, over: &[(&'static str, &'static str)]) -> Value {
    let mut args = with(SMALL, over);
    args.push("--json".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = bench(model, &args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn close(a: f64, b: f64, what: &str) {
    assert!((a - b).abs() <= 1e-9 * a.abs().max(b.abs()), "{what}: {a} vs {b}");
}

/// The model's shape, from `config.json`.
struct Shape {
    layers: f64,
    hidden: f64,
    heads: f64,
    kv_heads: f64,
    head_dim: f64,
    ffn: f64,
    vocab: f64,
    qk_norm: bool,
}

fn shape(name: &str) -> Shape {
    let c: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
    let n = |k: &str| c[k].as_f64().unwrap();
    let hidden = n("hidden_size");
    let heads = n("num_attention_heads");
    Shape {
        layers: n("num_hidden_layers"),
        hidden,
        heads,
        kv_heads: n("num_key_value_heads"),
        head_dim: c["head_dim"].as_f64().unwrap_or(hidden / heads),
        ffn: n("intermediate_size"),
        vocab: n("vocab_size"),
        qk_norm: c["model_type"] == "qwen3",
    }
}

impl Shape {
    /// Elements of the matrices one layer multiplies by.
    fn layer_matrix_elems(&self) -> f64 {
        let (h, q, kv) = (self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim);
        h * q + 2.0 * h * kv + q * h + 3.0 * h * self.ffn
    }
}

#[test]
fn reports_every_batch_with_the_bytes_and_flops_the_shape_implies() {
    // llama-gqa: f32 on disk, untied head; qwen3: f16 on disk (loaded as f32), tied head, q/k norms.
    for name in ["llama-gqa", "qwen3"] {
        let s = shape(name);
        let r = json(&fixture(name), &[("--peak-tflops", "0.5")]);
        assert_eq!(r["device"], "cpu");
        assert_eq!(r["kv_elem_bytes"], 2, "{name}: the CPU's default KV dtype is f16");
        assert_eq!(r["context"], 40);

        // Weights read per step, all f32 as loaded: every layer's matrices and the head once (a
        // tied head is the embedding table; an untied table is not read in full), plus the norms.
        let vectors = s.hidden + s.layers * (2.0 * s.hidden + if s.qk_norm { 2.0 * s.head_dim } else { 0.0 });
        let weights = 4.0 * (s.layers * s.layer_matrix_elems() + s.vocab * s.hidden + vectors);
        close(f(&r["weight_bytes_per_step"]), weights, &format!("{name}: weight bytes"));

        let copy = f(&r["copy_bytes_per_s"]);
        let traffic = f(&r["traffic_bytes_per_s"]);
        assert!(copy > 0.0, "{name}: copy bandwidth {copy}");
        close(traffic, 2.0 * copy, &format!("{name}: traffic counts bytes read and written"));

        let rows = r["decode"].as_array().unwrap();
        let batches: Vec<u64> = rows.iter().map(|d| d["batch"].as_u64().unwrap()).collect();
        assert_eq!(batches, [1, 3, 8], "{name}: one row per batch size, in order");
        // Timed steps attend to context + warmup + i + 1 positions: 42..=44, 43 on average.
        let kv_token = s.layers * 2.0 * s.kv_heads * s.head_dim * f(&r["kv_elem_bytes"]);
        for d in rows {
            let b = f(&d["batch"]);
            let what = format!("{name} batch {b}");
            let ms = f(&d["ms_per_step"]);
            assert!(ms > 0.0, "{what}: {ms} ms per step");
            close(f(&d["tokens_per_s"]), b / ms * 1e3, &what);
            let bytes = f(&d["bytes_per_step"]);
            close(bytes, weights + b * 43.0 * kv_token, &format!("{what}: bytes per step"));
            let bound_ms = f(&d["bound_ms_per_step"]);
            close(bound_ms, bytes / traffic * 1e3, &format!("{what}: bound"));
            close(f(&d["times_bound"]), ms / bound_ms, &what);
            close(f(&d["bound_tokens_per_s"]), b / bound_ms * 1e3, &what);
        }

        let p = &r["prefill"];
        assert_eq!(p["tokens"], 50);
        let secs = f(&p["seconds"]);
        assert!(secs > 0.0, "{name}: prefill took {secs} s");
        close(f(&p["tokens_per_s"]), 50.0 / secs, name);
        let attention = 4.0 * s.layers * s.heads * s.head_dim * 50.0 * 51.0 / 2.0;
        let flops = 2.0 * 50.0 * s.layers * s.layer_matrix_elems() + 2.0 * s.vocab * s.hidden + attention;
        close(f(&p["flops"]), flops, &format!("{name}: prefill FLOPs"));
        let bound_s = flops / 0.5e12;
        close(f(&p["bound_tokens_per_s"]), 50.0 / bound_s, name);
        close(f(&p["times_bound"]), secs / bound_s, name);
        assert!(f(&r["fill_tokens_per_s"]) > 0.0);
    }
}

#[test]
fn table_has_a_row_per_batch_and_no_bound_without_a_peak() {
    let model = fixture("mistral");
    let args = with(SMALL, &[]);
    let out = bench(&model, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("| batch | ms/step | tokens/s |"), "{text}");
    for b in [1, 3, 8] {
        assert!(text.lines().any(|l| l.starts_with(&format!("| {b} | "))), "no row for batch {b}: {text}");
    }
    assert!(text.contains("prefill of 50 tokens"), "{text}");

    let r = json(&model, &[("--prefill", "0")]);
    assert!(r["prefill"].is_null(), "--prefill 0 skips the prefill: {r}");
    let r = json(&model, &[]);
    assert!(r["prefill"]["bound_tokens_per_s"].is_null(), "no peak given, no bound: {r}");
    assert!(f(&r["prefill"]["tokens_per_s"]) > 0.0);
}

#[test]
fn verification_passes_are_timed_against_a_decode_step() {
    let model = fixture("mistral");
    let r = json(&model, &[("--verify", "2,5"), ("--prefill", "0")]);
    let v = r["verify"].as_array().unwrap_or_else(|| panic!("no verify rows: {r}"));
    assert_eq!(v.iter().map(|x| x["tokens"].as_u64().unwrap()).collect::<Vec<_>>(), [2, 5], "{r}");
    for x in v {
        let (pass, step) = (f(&x["ms_per_pass"]), f(&x["decode_ms"]));
        assert!(pass > 0.0 && step > 0.0, "{x}");
        close(f(&x["decode_steps"]), pass / step, "decode steps");
    }
    assert!(json(&model, &[])["verify"].as_array().is_some_and(Vec::is_empty), "no --verify, no rows");
    let args = with(SMALL, &[("--verify", "3")]);
    let out = bench(&model, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let (_, after) = text.split_once("| verification pass, tokens |").unwrap_or_else(|| panic!("{text}"));
    assert!(after.lines().any(|l| l.starts_with("| 3 | ")), "no row for a 3-token pass: {text}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let model = fixture("llama-gqa");
    let base = [("--batch", "1"), ("--context", "8"), ("--prefill", "8"), ("--steps", "2")];
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (vec![("--batch", "1,0")], "--batch"),
        (vec![("--context", "0")], "--context"),
        (vec![("--steps", "0")], "--steps"),
        (vec![("--peak-tflops", "0")], "--peak-tflops"),
        // llama-gqa's context is 512 positions.
        (vec![("--context", "500"), ("--steps", "16")], "must not exceed the model's context of 512"),
        (vec![("--prefill", "600")], "must not exceed the model's context of 512"),
        (vec![("--device", "cuda:99")], "cuda:99"),
        (vec![("--verify", "2,0")], "--verify"),
        (vec![("--verify", "600")], "must not exceed the model's context of 512"),
    ];
    for (args, needle) in cases {
        let all = with(&base, &args);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let out = bench(&model, &all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: error should mention {needle:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}
