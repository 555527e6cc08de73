//! SentencePiece GGUF vocabularies (`tokenizer.ggml.model = "llama"`) against llama.cpp.
//!
//! The fixtures in `tests/reference/fixtures/gguf-spm/` hold three tokenizer-only GGUF files and,
//! for each, the ids and text llama.cpp's own vocabulary code gives (see
//! `tests/reference/README.md`): a Llama-layout vocabulary with Phi-3's chat tokens, a Gemma-layout
//! one without a space prefix, and one whose scores tie. The Gemma and Phi-3 chat templates below
//! must render as transformers renders them. The real Gemma 3 270M vocabulary is checked when
//! that model is in the model cache; otherwise that test is skipped with a `SKIPPED` line.

use std::path::PathBuf;
use std::time::Instant;

use serde_json::Value;
use tandem_model::gguf::GgufFile;
use tandem_model::tokenizer::{ChatMessage, GgufVocab, IncrementalDecoder, Tokenizer};
use tandem_test_support::cached_model_for_test;

/// Gemma 3's chat template (as published with the instruction-tuned models).
const GEMMA3_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"#;

/// Gemma 2's template (also Gemma 1's): no system role.
const GEMMA2_TEMPLATE: &str = concat!(
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}",
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}",
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}",
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}",
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}",
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}",
);

/// Phi-3 mini's template (June 2024).
const PHI3_TEMPLATE: &str = concat!(
    "{% for message in messages %}{% if message['role'] == 'system' %}",
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}",
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}",
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}",
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}",
);

/// Phi-3 mini's first template (April 2024).
const PHI3_APRIL_TEMPLATE: &str = concat!(
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') %}",
    "{{'<|user|>' + '\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}",
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\\n'}}{% endif %}{% endfor %}",
);

/// The templates by the names the fixture uses. `gemma3-strip` is Gemma 3's with the Python
/// method `.strip()` in place of the `trim` filter.
fn template(name: &str) -> String {
    match name {
        "gemma3" => GEMMA3_TEMPLATE.to_owned(),
        "gemma3-strip" => {
            GEMMA3_TEMPLATE.replace("{{ message['content'] | trim }}", "{{ message['content'].strip() }}")
        }
        "gemma2" => GEMMA2_TEMPLATE.to_owned(),
        "phi3" => PHI3_TEMPLATE.to_owned(),
        "phi3-april" => PHI3_APRIL_TEMPLATE.to_owned(),
        other => panic!("no template {other}"),
    }
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("gguf-spm/cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn vocab(file: &str) -> GgufVocab {
    let path = fixtures().join("gguf-spm").join(file);
    let g = GgufFile::open(&path).unwrap();
    let meta = GgufFile::open_metadata(&path).unwrap();
    assert_eq!(meta.metadata, g.metadata);
    assert!(meta.tensors.is_empty());
    GgufVocab::from_gguf(&g).unwrap()
}

/// Streams `ids` through the incremental decoder; the deltas, each checked to be free of a cut
/// character, concatenated.
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> String {
    let mut dec = IncrementalDecoder::new(tok, &[], skip_special);
    let mut out = String::new();
    for &id in ids {
        let delta = dec.push(id).unwrap();
        assert!(!delta.contains('\u{FFFD}'), "delta {delta:?} cuts a character ({ids:?})");
        out.push_str(&delta);
    }
    out + &dec.finish().unwrap()
}

/// Every case of one recorded vocabulary: ids, both decodings, streaming, single-token text.
fn check_cases(name: &str, r: &Value, tok: &Tokenizer) -> Vec<String> {
    let mut failures = Vec::new();
    for c in r["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let got = tok.encode(text, true).unwrap();
        if got != want {
            failures.push(format!("{name} {text:?}: got {got:?}, want {want:?}"));
            continue;
        }
        for (skip, key) in [(false, "decoded"), (true, "decoded_skip_special")] {
            let expect = c[key].as_str().unwrap();
            let decoded = tok.decode(&got, skip).unwrap();
            if decoded != expect {
                failures.push(format!("{name} {text:?} {key}: got {decoded:?}, want {expect:?}"));
            }
            assert_eq!(stream(tok, &got, skip), decoded, "{name} {text:?} streamed, skip {skip}");
        }
    }
    failures
}

#[test]
fn tiny_spm_vocabularies_match_llama_cpp() {
    let r = reference();
    let mut failures = Vec::new();
    for name in ["phi3", "gemma", "ties"] {
        let r = &r[name];
        let tok = vocab(r["file"].as_str().unwrap()).build().unwrap();
        assert_eq!(tok.vocab_size() as u64, r["vocab_size"].as_u64().unwrap(), "{name}");
        assert_eq!(tok.bos_token_id().map(u64::from), r["bos_token_id"].as_u64(), "{name}");
        assert_eq!(tok.add_bos(), r["add_bos"].as_bool().unwrap(), "{name}");
        // EOS first, then every other id llama.cpp ends generation on.
        let eos = tok.eos_token_ids();
        assert_eq!(eos.first().map(|&x| u64::from(x)), r["eos_token_id"].as_u64(), "{name}");
        let mut sorted = eos.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, ids(&r["eog_ids"]), "{name}: end-of-generation ids");
        failures.extend(check_cases(name, r, &tok));
        // Byte-fallback tokens decoded a prefix at a time: a cut character is U+FFFD.
        for p in r["partial"].as_array().unwrap() {
            let got = ids(&p["ids"]);
            assert_eq!(tok.decode(&got, false).unwrap(), p["decoded"].as_str().unwrap(), "{name} {got:?}");
            assert_eq!(
                tok.decode(&got, true).unwrap(),
                p["decoded_skip_special"].as_str().unwrap(),
                "{name}"
            );
        }
        for (id, piece) in r["pieces"].as_object().unwrap() {
            let id: u32 = id.parse().unwrap();
            assert_eq!(tok.token_text(id).as_deref(), piece.as_str(), "{name}: token {id}");
        }
        assert_eq!(tok.token_text(tok.vocab_size() as u32), None);
        assert!(tok.decode(&[tok.vocab_size() as u32], false).is_err());
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn recorded_cases_cover_what_they_claim() {
    let r = reference();
    let gemma = &r["gemma"];
    let phi3 = &r["phi3"];
    let case = |r: &Value, text: &str| -> Vec<u32> {
        let c = r["cases"].as_array().unwrap().iter().find(|c| c["text"] == text).unwrap();
        ids(&c["ids"])
    };
    let v = vocab("tiny-spm-gemma.gguf");
    let tok = vocab("tiny-spm-gemma.gguf").build().unwrap();
    // Characters outside the vocabulary come out as one byte token per UTF-8 byte.
    let emoji = case(gemma, "emoji 😀 and 👍🏽");
    let bytes: Vec<&str> =
        emoji.iter().map(|&i| v.tokens[i as usize].as_str()).filter(|t| t.starts_with("<0x")).collect();
    assert!(bytes.len() >= 12, "{bytes:?}");
    assert!(bytes.contains(&"<0xF0>"), "{bytes:?}");
    // Special tokens in text are single ids, and no space is added after them (Gemma).
    let turn = case(gemma, "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n");
    let start = tok.token_to_id("<start_of_turn>").unwrap();
    assert_eq!(turn[..2], [tok.bos_token_id().unwrap(), start]);
    assert!(!v.tokens[turn[2] as usize].starts_with('▁'));
    // Llama layout: a space prefix, also after a special token; Phi-3 strips the newline after it.
    let hello = case(phi3, "Hello world");
    assert!(phi3_tokens()[hello[1] as usize].starts_with('▁'));
    let ties = &r["ties"];
    // Rounded scores tie, and llama.cpp's leftmost rule then segments differently from
    // SentencePiece's own order on at least one case.
    let differs =
        ties["cases"].as_array().unwrap().iter().filter(|c| c.get("sentencepiece_ids").is_some()).count();
    assert!(differs > 0);
    assert!(ties["add_eos"].as_bool().unwrap());
    assert_eq!(case(ties, "").len(), 2, "BOS and EOS around nothing");
}

fn phi3_tokens() -> Vec<String> {
    vocab("tiny-spm-phi3.gguf").tokens
}

#[test]
fn add_flags_and_space_prefix_from_the_file_or_llama_cpp_defaults() {
    let phi3 = vocab("tiny-spm-phi3.gguf");
    // Absent keys: llama.cpp's defaults.
    assert_eq!((phi3.add_bos, phi3.add_eos, phi3.add_space_prefix), (None, None, None));
    let tok = phi3.clone().build().unwrap();
    assert!(tok.add_bos());
    let with = tok.encode("Hello world", true).unwrap();
    assert_eq!(with[0], 1);
    assert_eq!(&with[1..], &tok.encode("Hello world", false).unwrap()[..]);
    let gemma = vocab("tiny-spm-gemma.gguf");
    assert_eq!(gemma.add_space_prefix, Some(false));
    // The same vocabulary without a space prefix: no leading `▁`, nothing stripped when decoding.
    let mut bare = phi3.clone();
    bare.add_space_prefix = Some(false);
    bare.add_bos = Some(false);
    let tok_bare = bare.build().unwrap();
    let ids = tok_bare.encode("Hello world", true).unwrap();
    assert_ne!(ids, tok.encode("Hello world", false).unwrap());
    assert_eq!(tok_bare.decode(&ids, false).unwrap(), "Hello world");
    // EOS appended when the file asks for it.
    let mut eos = phi3;
    eos.add_eos = Some(true);
    let tok_eos = eos.build().unwrap();
    let ids = tok_eos.encode("Hello", true).unwrap();
    assert_eq!(*ids.last().unwrap(), 2);
    assert_eq!(tok_eos.decode(&ids, true).unwrap(), " Hello");
}

#[test]
fn malformed_spm_metadata_is_a_format_error_naming_the_file() {
    let v = vocab("tiny-spm-phi3.gguf");
    let mut short = v.clone();
    short.scores.truncate(10);
    let err = short.build().unwrap_err();
    assert_eq!(err.kind(), "format");
    assert!(err.to_string().contains("tiny-spm-phi3.gguf"), "{err}");
    let mut dup = v.clone();
    dup.tokens[300] = dup.tokens[301].clone();
    assert!(dup.build().unwrap_err().to_string().contains("twice"));
    let mut bos = v;
    bos.bos_id = Some(1 << 20);
    assert_eq!(bos.build().unwrap_err().kind(), "format");
}

/// The built-in templates a GGUF without one gets (by architecture) render every recorded
/// conversation exactly as the published Gemma 3 and Phi-3 (June 2024) templates did in
/// transformers, and refuse what they refuse.
#[test]
fn built_in_templates_render_as_the_published_ones() {
    use tandem_model::tokenizer::builtin;
    let r = reference();
    let mut compared = 0;
    for (name, published, ours) in [("gemma", "gemma3", builtin::GEMMA), ("phi3", "phi3", builtin::PHI3)] {
        let r = &r[name];
        let mut v = vocab(r["file"].as_str().unwrap());
        v.chat_template = Some(ours.to_owned());
        let tok = v.build().unwrap();
        for c in r["chats"].as_array().unwrap().iter().filter(|c| c["template"] == published) {
            let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
            let gen = c["add_generation_prompt"].as_bool().unwrap();
            let got = tok.apply_chat_template(&msgs, gen);
            if c.get("error").is_some() {
                assert!(got.is_err(), "{name}: {msgs:?} should be refused, got {got:?}");
            } else {
                assert_eq!(got.unwrap(), c["rendered"].as_str().unwrap(), "{name}: {msgs:?} gen {gen}");
            }
            compared += 1;
        }
    }
    assert!(compared >= 8, "only {compared} conversations compared");
    assert_eq!(builtin::for_architecture("gemma3"), Some(builtin::GEMMA));
    assert_eq!(builtin::for_architecture("phi3"), Some(builtin::PHI3));
    assert_eq!(builtin::for_architecture("llama"), None);
}

#[test]
fn gemma_and_phi3_templates_render_as_transformers() {
    let r = reference();
    let mut rendered_some = 0;
    for name in ["phi3", "gemma"] {
        let r = &r[name];
        let file = r["file"].as_str().unwrap();
        for (tname, src) in r["templates"].as_object().unwrap() {
            assert_eq!(template(tname), src.as_str().unwrap(), "template {tname} differs from the fixture's");
        }
        for c in r["chats"].as_array().unwrap() {
            let tname = c["template"].as_str().unwrap();
            let mut v = vocab(file);
            v.chat_template = Some(template(tname));
            let tok = v.build().unwrap();
            let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
            let gen = c["add_generation_prompt"].as_bool().unwrap();
            let got = tok.apply_chat_template(&msgs, gen);
            if let Some(err) = c.get("error") {
                let e = got.expect_err(&format!("{tname}: {msgs:?} should fail"));
                assert!(e.to_string().contains(err.as_str().unwrap()), "{tname}: {e}");
                continue;
            }
            let got = got.unwrap_or_else(|e| panic!("{tname}: {e}"));
            assert_eq!(got, c["rendered"].as_str().unwrap(), "{tname} {msgs:?} gen {gen}");
            assert_eq!(tok.encode(&got, false).unwrap(), ids(&c["ids"]), "{tname}: ids of {got:?}");
            rendered_some += 1;
        }
    }
    assert!(rendered_some >= 20, "{rendered_some}");
}

/// The real Gemma 3 270M vocabulary (262,144 tokens, user-defined whitespace runs): llama.cpp's
/// ids and text for the same cases, the Gemma 3 template's chats, and load and encode times.
#[test]
fn gemma3_270m_vocabulary_matches_llama_cpp() {
    const TEST: &str = "gemma3_270m_vocabulary_matches_llama_cpp";
    let Some(path) = cached_model_for_test(TEST, "gemma-3-270m-q4_k_m.gguf") else { return };
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("gemma-3-270m-q4_k_m.json")).unwrap())
            .unwrap();
    let t0 = Instant::now();
    // Its tensor types need not be loadable: only the metadata is read.
    let g = GgufFile::open_metadata(&path).unwrap();
    let v = GgufVocab::from_gguf(&g).unwrap();
    // The file has no template of its own: it gets the built-in Gemma one, which must render the
    // chats recorded with the published Gemma 3 template.
    assert_eq!(v.chat_template.as_deref(), Some(tandem_model::tokenizer::builtin::GEMMA));
    let tok = v.build().unwrap();
    let load = t0.elapsed();
    assert_eq!(tok.vocab_size() as u64, r["vocab_size"].as_u64().unwrap());
    assert_eq!(tok.bos_token_id().map(u64::from), r["bos_token_id"].as_u64());
    let mut eog = tok.eos_token_ids().to_vec();
    eog.sort_unstable();
    assert_eq!(eog, ids(&r["eog_ids"]));
    let failures = check_cases("gemma-3-270m", &r, &tok);
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
    for c in r["chats"].as_array().unwrap() {
        let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone()).unwrap();
        let rendered = tok.apply_chat_template(&msgs, true).unwrap();
        assert_eq!(rendered, c["rendered"].as_str().unwrap());
        assert_eq!(tok.encode(&rendered, false).unwrap(), ids(&c["ids"]));
    }
    // A long prompt: a few thousand characters with whitespace runs and special tokens.
    let long = r["cases"].as_array().unwrap().last().unwrap()["text"].as_str().unwrap().repeat(3);
    let t0 = Instant::now();
    let n = tok.encode(&long, true).unwrap().len();
    let encode = t0.elapsed();
    eprintln!(
        "gemma 3 vocabulary: read and built in {load:?}; {} characters -> {n} ids in {encode:?}",
        long.chars().count()
    );
    assert!(load.as_secs_f64() < 2.0, "building the vocabulary took {load:?}");
    assert!(encode.as_secs_f64() < 0.5, "encoding took {encode:?}");
}

/// The bytes of each token, concatenated, are the text's bytes: byte-fallback tokens that hold
/// part of a character give their byte, not U+FFFD (what OpenAI's logprobs `bytes` carry).
#[test]
fn token_bytes_of_spm_tokens_concatenate_to_the_text() {
    let r = reference();
    for name in ["phi3", "gemma"] {
        let tok = vocab(r[name]["file"].as_str().unwrap()).build().unwrap();
        for text in ["Grüße aus Köln", "東京 ☕ naïve", "plain words"] {
            let ids = tok.encode(text, false).unwrap();
            let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id).unwrap()).collect();
            // SentencePiece adds a leading space (the dummy prefix); the text follows it.
            let got = String::from_utf8(bytes).unwrap();
            assert_eq!(got.trim_start_matches(' '), text, "{name}: {ids:?}");
        }
        assert_eq!(tok.token_bytes(tok.vocab_size() as u32), None);
    }
}
