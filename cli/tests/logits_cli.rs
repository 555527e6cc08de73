//! `tandem logits` on the CPU backend reproduces the reference logits that Hugging Face
//! transformers recorded for the tiny fixture models (`tests/reference/fixtures/*/logits.f32`),
//! whole or in chunks, with the prompt given inline or in a file; bad input is a clear error.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

#[path = "../../tests/reference/fixture_reader.rs"]
mod fixture_reader;
use fixture_reader::{argmax, fixture, read_f32, read_reference, MODELS};

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("logits_cli");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn tandem(args: &[&str], model: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("logits")
        .arg("--model")
        .arg(model)
        // Compared with transformers' logits: an exact KV cache.
        .args(["--kv-dtype", "f32"])
        .args(args)
        .output()
        .unwrap()
}

/// Runs `tandem logits` and returns its JSON line and the logits it wrote.
fn logits(model: &Path, args: &[&str], out: &Path) -> (Value, Vec<f32>) {
    let mut all = args.to_vec();
    let out_s = out.to_str().unwrap();
    all.extend_from_slice(&["--out", out_s]);
    let o = tandem(&all, model);
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    let line: Value = serde_json::from_slice(&o.stdout).unwrap();
    (line, read_f32(out))
}

fn csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// Same tolerance the engine's own reference-parity test holds the CPU backend to.
fn assert_matches_reference(what: &str, got: &[f32], want: &[f32], vocab: usize) {
    assert_eq!(got.len(), want.len(), "{what}: logits shape");
    let mut max_err = 0f32;
    for (pos, (g, r)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        for (a, b) in g.iter().zip(r) {
            max_err = max_err.max((a - b).abs());
        }
        assert_eq!(argmax(g), argmax(r), "{what} position {pos}: argmax differs");
    }
    assert!(max_err < 2e-3, "{what}: max abs logit error {max_err}");
}

#[test]
fn reproduces_reference_logits_of_every_fixture() {
    for name in MODELS {
        let (vocab, prompts) = read_reference(name);
        for (pi, p) in prompts.iter().enumerate() {
            let out = scratch(&format!("{name}-{pi}.f32"));
            let (line, got) = logits(&fixture(name), &["--tokens", &csv(&p.ids)], &out);
            let what = format!("{name} prompt {pi}");
            assert_matches_reference(&what, &got, &p.logits, vocab);
            assert_eq!(line["positions"].as_u64().unwrap() as usize, p.ids.len(), "{what}");
            assert_eq!(line["vocab"].as_u64().unwrap() as usize, vocab, "{what}");
            assert_eq!(line["device"], "cpu", "{what}");
            assert_eq!(line["non_finite"], 0, "{what}");
            let argmaxes: Vec<usize> =
                line["argmax"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
            let from_file: Vec<usize> = got.chunks(vocab).map(argmax).collect();
            assert_eq!(argmaxes, from_file, "{what}: printed argmaxes are not those of the file");
        }
    }
}

/// A prompt longer than a pass runs in several chunks (later chunks attend to the pool) and
/// still gives the reference logits at every position.
#[test]
fn chunked_prompt_gives_the_same_logits() {
    for name in ["llama-gqa", "mistral-sliding", "qwen3"] {
        let (vocab, prompts) = read_reference(name);
        let p = prompts.iter().max_by_key(|p| p.ids.len()).unwrap();
        assert!(p.ids.len() > 20, "{name}: longest prompt has only {} tokens", p.ids.len());
        let out = scratch(&format!("{name}-chunked.f32"));
        let args = ["--tokens", &csv(&p.ids), "--max-batch-tokens", "7", "--block-size", "4"];
        let (line, got) = logits(&fixture(name), &args, &out);
        assert_eq!(line["passes"].as_u64().unwrap() as usize, p.ids.len().div_ceil(7), "{name}");
        assert_matches_reference(&format!("{name} in chunks of 7"), &got, &p.logits, vocab);
    }
}

#[test]
fn tokens_file_in_either_form_equals_inline_tokens() {
    let model = fixture("llama-gqa");
    let (_, prompts) = read_reference("llama-gqa");
    let ids = &prompts[2].ids;
    let inline = scratch("inline.f32");
    let (_, want) = logits(&model, &["--tokens", &csv(ids), "--dtype-note"], &inline);

    let json_file = scratch("tokens.json");
    std::fs::write(&json_file, serde_json::to_string(ids).unwrap()).unwrap();
    let spaced_file = scratch("tokens.txt");
    let spaced: Vec<String> = ids.iter().map(u32::to_string).collect();
    std::fs::write(&spaced_file, format!("{}\n{}\n", spaced[..3].join(" "), spaced[3..].join(", "))).unwrap();
    for f in [&json_file, &spaced_file] {
        let out = scratch("from-file.f32");
        let (line, got) = logits(&model, &["--tokens-file", f.to_str().unwrap(), "--dtype-note"], &out);
        assert_eq!(got, want, "{}", f.display());
        assert_eq!(line["positions"].as_u64().unwrap() as usize, ids.len());
        assert_eq!(line["dtype"]["file"], "float32");
        assert_eq!(line["dtype"]["loaded"], serde_json::json!(["F32"]));
        assert_eq!(line["dtype"]["compute"], "f32");
        assert_eq!(line["dtype"]["activations"], "q16");
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let model = fixture("llama-gqa");
    let out = scratch("bad.f32");
    let out_s = out.to_str().unwrap();
    let bad_file = scratch("bad-tokens.txt");
    std::fs::write(&bad_file, "1, 2, three").unwrap();
    let empty_file = scratch("empty-tokens.txt");
    std::fs::write(&empty_file, "\n").unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--tokens", "1,448", "--out", out_s], "outside the vocabulary"),
        (vec!["--tokens", "1,x", "--out", out_s], "invalid value"),
        (vec!["--out", out_s], "--tokens"),
        (vec!["--tokens-file", bad_file.to_str().unwrap(), "--out", out_s], "\"three\" is not a token id"),
        (vec!["--tokens-file", empty_file.to_str().unwrap(), "--out", out_s], "no tokens"),
        (vec!["--tokens", "1,2", "--out", "/nonexistent-dir/x.f32"], "/nonexistent-dir/x.f32"),
        (vec!["--tokens", "1,2", "--max-batch-tokens", "0", "--out", out_s], "must be positive"),
        (vec!["--tokens", "1,2", "--dtype", "f8", "--out", out_s], "unknown compute dtype"),
        // There is no 100th GPU on any machine this runs on.
        (vec!["--tokens", "1,2", "--device", "cuda:99", "--out", out_s], "cuda:99"),
    ];
    for (args, needle) in cases {
        let o = tandem(&args, &model);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: error should mention {needle:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}
