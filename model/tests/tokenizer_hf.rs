//! The tokenizer loaded from the tiny fixtures' Hugging Face files reproduces transformers:
//! prompt ids (BOS included where the model adds it), chat-template renderings and their ids.

use std::path::PathBuf;

use serde_json::Value;
use tandem_model::tokenizer::{ChatMessage, IncrementalDecoder, Tokenizer};

const MODELS: [&str; 5] = ["llama-gqa", "llama3-rope-scaled", "qwen3", "qwen2-mqa", "mistral"];

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures").join(name)
}

fn reference(name: &str) -> Value {
    let path = fixture_dir(name).join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn prompt_ids_match_transformers() {
    for name in MODELS {
        let tok = Tokenizer::from_hf_dir(&fixture_dir(name)).unwrap();
        let r = reference(name);
        assert_eq!(tok.vocab_size() as u64, r["vocab_size"].as_u64().unwrap(), "{name}");
        assert_eq!(tok.add_bos(), r["add_bos"].as_bool().unwrap(), "{name}");
        for p in r["prompts"].as_array().unwrap() {
            let text = p["text"].as_str().unwrap();
            let want = ids(&p["prompt_ids"]);
            let got = tok.encode(text, true).unwrap();
            assert_eq!(got, want, "{name}: {text:?}");
            // Decoding the ids without special tokens gives the prompt back (byte-level BPE is
            // lossless).
            assert_eq!(tok.decode(&got, true).unwrap(), text, "{name}");
            // Without special tokens, BOS is never added.
            let plain = tok.encode(text, false).unwrap();
            if tok.add_bos() {
                assert_eq!(&want[1..], &plain[..], "{name}: {text:?}");
                assert_eq!(Some(want[0]), tok.bos_token_id());
            } else {
                assert_eq!(plain, want, "{name}: {text:?}");
            }
        }
    }
}

#[test]
fn special_tokens_and_eos() {
    for name in MODELS {
        let tok = Tokenizer::from_hf_dir(&fixture_dir(name)).unwrap();
        // `<|im_end|>` is the eos of tokenizer_config.json, id 2; generation_config says 2 too.
        assert_eq!(tok.eos_token_ids(), &[2], "{name}");
        assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
        assert_eq!(tok.token_text(2).as_deref(), Some("<|im_end|>"));
        assert_eq!(tok.token_text(tok.vocab_size() as u32), None);
        let ids = tok.encode("a<|im_start|>b", false).unwrap();
        assert!(ids.contains(&1), "{name}: special token text must map to its id: {ids:?}");
        assert_eq!(tok.decode(&ids, true).unwrap(), "ab");
        assert_eq!(tok.decode(&ids, false).unwrap(), "a<|im_start|>b");
        assert!(tok.decode(&[tok.vocab_size() as u32], false).is_err());
    }
}

#[test]
fn chat_template_matches_transformers() {
    for name in MODELS {
        let tok = Tokenizer::from_hf_dir(&fixture_dir(name)).unwrap();
        let r = reference(name);
        let chats = r["chat"].as_array().unwrap();
        assert!(!chats.is_empty());
        for c in chats {
            let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
            let agp = c["add_generation_prompt"].as_bool().unwrap();
            let rendered = tok.apply_chat_template(&msgs, agp).unwrap();
            assert_eq!(rendered, c["rendered"].as_str().unwrap(), "{name}");
            assert_eq!(tok.encode(&rendered, false).unwrap(), ids(&c["ids"]), "{name}");
        }
    }
}

#[test]
fn template_from_tokenizer_config_when_no_jinja_file() {
    // Copy one fixture's tokenizer files without chat_template.jinja: the config's template is
    // used and renders the same.
    let src = fixture_dir("qwen3");
    let dir = std::env::temp_dir().join(format!("tandem-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    let msgs = [ChatMessage::new("user", "hi")];
    let got = tok.apply_chat_template(&msgs, true).unwrap();
    assert_eq!(got, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");

    // Without any template, rendering is an error, not an empty string.
    let cfg = std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&cfg).unwrap();
    cfg.as_object_mut().unwrap().remove("chat_template");
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    assert!(!tok.has_chat_template());
    assert!(tok.apply_chat_template(&msgs, true).is_err());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn missing_tokenizer_json_is_an_error() {
    let err = Tokenizer::from_hf_dir(&fixture_dir("no-such-model")).unwrap_err();
    assert_eq!(err.kind(), "io");
}

#[test]
fn greedy_text_decodes_incrementally() {
    for name in MODELS {
        let tok = Tokenizer::from_hf_dir(&fixture_dir(name)).unwrap();
        for p in reference(name)["prompts"].as_array().unwrap() {
            let prompt = ids(&p["prompt_ids"]);
            let generated = ids(&p["greedy_ids"]);
            let mut dec = IncrementalDecoder::new(&tok, &prompt, false);
            let mut text = String::new();
            for &id in &generated {
                text.push_str(&dec.push(id).unwrap());
            }
            text.push_str(&dec.finish().unwrap());
            assert_eq!(text, tok.decode(&generated, false).unwrap(), "{name}");
        }
    }
}

/// Byte-level BPE: the bytes of each token, concatenated, are the text's bytes, including tokens
/// that hold part of a UTF-8 character (whose `token_text` is U+FFFD); a special token's bytes are
/// its text.
#[test]
fn token_bytes_of_byte_level_tokens_concatenate_to_the_text() {
    for name in MODELS {
        let tok = Tokenizer::from_hf_dir(&fixture_dir(name)).unwrap();
        let text = "Grüße aus Köln, 東京 ☕ naïve café";
        let ids = tok.encode(text, false).unwrap();
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id).unwrap()).collect();
        assert_eq!(String::from_utf8(bytes).unwrap(), text, "{name}: {ids:?}");
        let partial = ids.iter().any(|&id| tok.token_text(id).unwrap().contains('\u{FFFD}'));
        assert!(partial, "{name}: the text should split a character across tokens");
        if let Some(eos) = tok.eos_token_ids().first() {
            let piece = tok.token_piece(*eos).unwrap();
            assert_eq!(tok.token_bytes(*eos).unwrap(), piece.as_bytes(), "{name}: special token");
        }
        assert_eq!(tok.token_bytes(tok.vocab_size() as u32), None);
    }
}
