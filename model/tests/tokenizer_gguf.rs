//! The tokenizer built from SmolLM2's GGUF metadata reproduces every case transformers recorded
//! (ids, decoded text, chat renderings, BOS/EOS). Skipped, with a `SKIPPED` line, when the
//! default model is not in the model cache (a failure under `TANDEM_REQUIRE_MODEL=1`).

use std::path::PathBuf;

use serde_json::Value;
use tandem_model::gguf::GgufFile;
use tandem_model::tokenizer::{ChatMessage, GgufVocab, IncrementalDecoder, Tokenizer};
use tandem_test_support::default_model_for_test;

fn reference() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/reference/fixtures/smollm2-135m-instruct-q4_1.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn load(test: &str) -> Option<(GgufFile, Tokenizer)> {
    let path = default_model_for_test(test)?;
    let g = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    Some((g, tok))
}

#[test]
fn every_recorded_case_matches() {
    let Some((_, tok)) = load("every_recorded_case_matches") else { return };
    let r = reference();
    assert_eq!(tok.vocab_size() as u64, r["vocab_size"].as_u64().unwrap());
    assert_eq!(tok.bos_token_id().map(u64::from), r["bos_token_id"].as_u64());
    assert_eq!(tok.eos_token_ids().first().map(|&x| u64::from(x)), r["eos_token_id"].as_u64());
    assert_eq!(tok.add_bos(), r["add_bos_token"].as_bool().unwrap());
    let cases = r["tokenizer_cases"].as_array().unwrap();
    assert!(cases.len() >= 40);
    let mut failures = Vec::new();
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let got = tok.encode(text, true).unwrap();
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
            continue;
        }
        assert_eq!(tok.decode(&got, false).unwrap(), c["decoded"].as_str().unwrap(), "{text:?}");
        assert_eq!(tok.decode(&got, true).unwrap(), c["decoded_skip_special"].as_str().unwrap(), "{text:?}");
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn prompts_and_chats_match() {
    let Some((_, tok)) = load("prompts_and_chats_match") else { return };
    let r = reference();
    for p in r["prompts"].as_array().unwrap() {
        let text = p["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, true).unwrap(), ids(&p["prompt_ids"]), "{text:?}");
        let generated = ids(&p["greedy_ids"]);
        assert_eq!(tok.decode(&generated, false).unwrap(), p["greedy_text"].as_str().unwrap());
        // Streaming the recorded continuation gives the same text.
        let mut dec = IncrementalDecoder::new(&tok, &ids(&p["prompt_ids"]), false);
        let mut s = String::new();
        for &id in &generated {
            s.push_str(&dec.push(id).unwrap());
        }
        s.push_str(&dec.finish().unwrap());
        assert_eq!(s, p["greedy_text"].as_str().unwrap());
        if p["stopped_at_eos"].as_bool().unwrap() {
            assert!(tok.eos_token_ids().contains(generated.last().unwrap()));
        }
    }
    let chats = r["chats"].as_array().unwrap();
    assert!(!chats.is_empty());
    for c in chats {
        let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let rendered = tok.apply_chat_template(&msgs, c["add_generation_prompt"].as_bool().unwrap()).unwrap();
        assert_eq!(rendered, c["rendered"].as_str().unwrap());
        assert_eq!(tok.encode(&rendered, false).unwrap(), ids(&c["prompt_ids"]));
    }
}

#[test]
fn unsupported_kinds_name_the_file() {
    let Some((g, _)) = load("unsupported_kinds_name_the_file") else { return };
    let v = GgufVocab::from_gguf(&g).unwrap();
    let mut wpm = v.clone();
    wpm.model = "bert".into();
    let err = wpm.build().unwrap_err();
    assert_eq!(err.kind(), "unsupported");
    assert!(err.to_string().contains("SmolLM2"), "{err}");
    let mut pre = v.clone();
    pre.pre = Some("no-such-pre".into());
    let err = pre.build().unwrap_err();
    assert_eq!(err.kind(), "unsupported");
    assert!(err.to_string().contains("no-such-pre"), "{err}");
    let mut bad = v;
    bad.eos_id = Some(1 << 30);
    assert_eq!(bad.build().unwrap_err().kind(), "format");
}

#[test]
fn add_bos_flag_is_honoured() {
    let Some((g, _)) = load("add_bos_flag_is_honoured") else { return };
    let mut v = GgufVocab::from_gguf(&g).unwrap();
    v.add_bos = Some(true);
    let tok = v.build().unwrap();
    let plain = tok.encode("Hello world", false).unwrap();
    let with = tok.encode("Hello world", true).unwrap();
    assert_eq!(with[0], tok.bos_token_id().unwrap());
    assert_eq!(&with[1..], &plain[..]);
}

/// Tokenizer-only GGUF files made from the tiny fixture vocabulary, one per supported
/// `tokenizer.ggml.pre`; their ids are llama.cpp's split (checked against transformers' GGUF
/// loader where that knows the type). These run without the real model.
#[test]
fn tiny_gguf_tokenizers_for_each_pre_type() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/gguf-tokenizers");
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let types = cases.as_object().unwrap();
    for pre in ["gpt2", "smollm", "llama-bpe", "qwen2"] {
        let r = &types[pre];
        let g = GgufFile::open(&dir.join(r["file"].as_str().unwrap())).unwrap();
        let tok = Tokenizer::from_gguf(&g).unwrap();
        assert_eq!(tok.add_bos(), r["add_bos"].as_bool().unwrap(), "{pre}");
        assert_eq!(tok.bos_token_id().map(u64::from), r["bos_token_id"].as_u64(), "{pre}");
        assert_eq!(tok.eos_token_ids().first().map(|&x| u64::from(x)), r["eos_token_id"].as_u64(), "{pre}");
        for c in r["cases"].as_array().unwrap() {
            let text = c["text"].as_str().unwrap();
            let want = ids(&c["ids"]);
            let got = tok.encode(text, true).unwrap();
            assert_eq!(got, want, "{pre}: {text:?}");
            assert_eq!(tok.decode(&got, false).unwrap(), c["decoded"].as_str().unwrap(), "{pre}: {text:?}");
        }
        for c in r["chats"].as_array().unwrap() {
            let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
            let got = tok.apply_chat_template(&msgs, c["add_generation_prompt"].as_bool().unwrap()).unwrap();
            assert_eq!(got, c["rendered"].as_str().unwrap(), "{pre}");
        }
    }
}
