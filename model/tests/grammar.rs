//! Structured output's constraint engine against real tokenizers (byte-level BPE, SentencePiece):
//! random walks through the token masks always spell a sentence of the language, special tokens
//! never spell text, the masks along a draft equal the masks of walking it, and a bad schema,
//! regex or grammar is refused naming the problem.

use std::path::PathBuf;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use tandem_model::gguf::GgufFile;
use tandem_model::grammar::{Constraint, Grammar};
use tandem_model::tokenizer::Tokenizer;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures")
}

/// A byte-level BPE vocabulary (Hugging Face files), another (GGUF) and a SentencePiece one.
fn tokenizers() -> Vec<(&'static str, Tokenizer)> {
    let gguf = |p: &str| Tokenizer::from_gguf(&GgufFile::open(&fixtures().join(p)).unwrap()).unwrap();
    vec![
        ("llama-gqa", Tokenizer::from_hf_dir(&fixtures().join("llama-gqa")).unwrap()),
        ("tiny-qwen2", gguf("gguf-tokenizers/tiny-qwen2.gguf")),
        ("tiny-spm-gemma", gguf("gguf-spm/tiny-spm-gemma.gguf")),
    ]
}

/// Walks the grammar with random allowed tokens (EOS taken at once half the times it is allowed)
/// until EOS or `max_steps`; returns the tokens (EOS excluded) and whether EOS ended the walk.
fn walk(tok: &Tokenizer, g: &mut Grammar, rng: &mut StdRng, max_steps: usize) -> (Vec<u32>, bool) {
    let eos = tok.eos_token_ids().to_vec();
    let mut out = Vec::new();
    for _ in 0..max_steps {
        let mask = g.mask().unwrap();
        let allowed: Vec<u32> = (0..tok.vocab_size() as u32).filter(|&t| mask.allows(t)).collect();
        assert!(!allowed.is_empty(), "a mask allowed nothing after {out:?}");
        for &t in &allowed {
            assert!(
                !tok.is_special(t) || eos.contains(&t),
                "special token {t} ({:?}) allowed as text",
                tok.token_piece(t)
            );
        }
        let eos_ok = allowed.iter().any(|t| eos.contains(t));
        let t = if eos_ok && rng.random_bool(0.5) {
            *allowed.iter().find(|t| eos.contains(t)).unwrap()
        } else {
            allowed[rng.random_range(0..allowed.len())]
        };
        g.advance(t).unwrap();
        if eos.contains(&t) {
            return (out, true);
        }
        out.push(t);
    }
    (out, false)
}

fn text(tok: &Tokenizer, ids: &[u32]) -> String {
    let bytes: Vec<u8> = ids.iter().flat_map(|&t| tok.token_bytes(t).unwrap()).collect();
    String::from_utf8(bytes).expect("a walk spells UTF-8 text")
}

const PERSON: &str = r#"{
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "ok": {"type": "boolean"}
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": false
}"#;

#[test]
fn random_walks_under_a_json_schema_spell_valid_json() {
    for (name, tok) in tokenizers() {
        let env = tok.grammar().unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        for i in 0..20 {
            let mut g = env.compile(&Constraint::JsonSchema(PERSON.into())).unwrap();
            let (ids, ended) = walk(&tok, &mut g, &mut rng, 300);
            assert!(ended, "{name} walk {i}: no EOS within 300 tokens: {:?}", text(&tok, &ids));
            let s = text(&tok, &ids);
            let v: Value = serde_json::from_str(&s).unwrap_or_else(|e| panic!("{name}: {s:?}: {e}"));
            let o = v.as_object().unwrap_or_else(|| panic!("{name}: not an object: {s}"));
            assert!(o["name"].as_str().unwrap().chars().count() <= 6, "{name}: {s}");
            assert!((0..=120).contains(&o["age"].as_i64().unwrap()), "{name}: {s}");
            assert!(o["ok"].is_boolean(), "{name}: {s}");
            assert!(o.keys().all(|k| ["name", "age", "tags", "ok"].contains(&k.as_str())), "{name}: {s}");
            if let Some(tags) = o.get("tags") {
                let tags = tags.as_array().unwrap();
                assert!(tags.len() <= 2 && tags.iter().all(|t| t == "a" || t == "b"), "{name}: {s}");
            }
            assert!(!s.contains('\n'), "{name}: compact JSON has no newlines: {s:?}");
        }
    }
}

#[test]
fn json_object_choice_regex_and_grammar_walks_stay_in_their_language() {
    for (name, tok) in tokenizers() {
        let env = tok.grammar().unwrap();
        let mut rng = StdRng::seed_from_u64(11);
        for _ in 0..10 {
            let mut g = env.compile(&Constraint::JsonObject).unwrap();
            let (ids, ended) = walk(&tok, &mut g, &mut rng, 400);
            if ended {
                let s = text(&tok, &ids);
                let v: Value = serde_json::from_str(&s).unwrap_or_else(|e| panic!("{name}: {s:?}: {e}"));
                assert!(v.is_object(), "{name}: {s}");
            }

            let choices = vec!["red".to_string(), "green".into(), "blue (dark)".into()];
            let mut g = env.compile(&Constraint::Choice(choices.clone())).unwrap();
            let (ids, ended) = walk(&tok, &mut g, &mut rng, 50);
            assert!(ended, "{name}");
            assert!(choices.contains(&text(&tok, &ids)), "{name}: {:?}", text(&tok, &ids));

            let mut g = env.compile(&Constraint::Regex("[0-9]{3}-[a-c]{2}".into())).unwrap();
            let (ids, ended) = walk(&tok, &mut g, &mut rng, 50);
            let s = text(&tok, &ids);
            assert!(ended, "{name}: {s}");
            let b = s.as_bytes();
            assert!(
                b.len() == 6
                    && b[..3].iter().all(u8::is_ascii_digit)
                    && b[3] == b'-'
                    && b[4..].iter().all(|c| (b'a'..=b'c').contains(c)),
                "{name}: {s:?}"
            );

            let lark = "start: item (\",\" item)*\nitem: \"x\" | \"yy\"";
            let mut g = env.compile(&Constraint::Grammar(lark.into())).unwrap();
            let (ids, ended) = walk(&tok, &mut g, &mut rng, 60);
            let s = text(&tok, &ids);
            if ended {
                assert!(s.split(',').all(|p| p == "x" || p == "yy"), "{name}: {s:?}");
            }
        }
    }
}

#[test]
fn masks_along_a_draft_equal_the_masks_of_walking_it() {
    let tok = Tokenizer::from_hf_dir(&fixtures().join("llama-gqa")).unwrap();
    let env = tok.grammar().unwrap();
    let c = Constraint::JsonSchema(PERSON.into());
    let draft = tok.encode(r#"{"name": "ab", "age": 3"#, false).unwrap();
    let mut g = env.compile(&c).unwrap();
    assert_eq!(g.accepted_prefix(&draft).unwrap(), draft.len());
    let along = g.masks_along(&draft).unwrap();
    assert_eq!(along.len(), draft.len() + 1);
    let mut walked = env.compile(&c).unwrap();
    for (i, &t) in draft.iter().enumerate() {
        let m = walked.mask().unwrap();
        assert!(m.allows(t), "draft token {i} must be allowed");
        for id in 0..tok.vocab_size() as u32 {
            assert_eq!(m.allows(id), along[i].allows(id), "position {i}, token {id}");
        }
        walked.advance(t).unwrap();
    }
    let last = walked.mask().unwrap();
    assert_eq!(last.count(), along[draft.len()].count());
    // The state is where it was: the first mask is unchanged.
    let again = g.mask().unwrap();
    assert_eq!(again.count(), along[0].count());

    // A draft that leaves the language is accepted up to the first forbidden token only.
    let mut bad = tok.encode(r#"{"name": 5"#, false).unwrap();
    let good = tok.encode(r#"{"name": "#, false).unwrap();
    assert_eq!(g.accepted_prefix(&bad).unwrap(), good.len(), "{bad:?}");
    bad.truncate(good.len());
    assert_eq!(g.accepted_prefix(&bad).unwrap(), good.len());
}

#[test]
fn eos_is_allowed_exactly_when_the_output_is_complete() {
    let tok = Tokenizer::from_hf_dir(&fixtures().join("llama-gqa")).unwrap();
    let eos = tok.eos_token_ids().to_vec();
    let env = tok.grammar().unwrap();
    let mut g = env.compile(&Constraint::Choice(vec!["ab".into(), "abc".into()])).unwrap();
    let allows_eos = |g: &mut Grammar| {
        let m = g.mask().unwrap();
        eos.iter().all(|&t| m.allows(t))
    };
    assert!(!allows_eos(&mut g), "nothing written yet");
    for t in tok.encode("ab", false).unwrap() {
        g.advance(t).unwrap();
    }
    assert!(allows_eos(&mut g), "\"ab\" is complete");
    assert!(g.is_complete());
    for t in tok.encode("c", false).unwrap() {
        g.advance(t).unwrap();
    }
    let m = g.mask().unwrap();
    assert_eq!(m.count(), eos.len(), "after \"abc\" only EOS may follow");
    g.advance(eos[0]).unwrap();
    assert_eq!(g.mask().unwrap().count(), eos.len(), "after EOS, EOS again");
}

#[test]
fn bad_constraints_are_refused_naming_the_problem() {
    let tok = Tokenizer::from_hf_dir(&fixtures().join("llama-gqa")).unwrap();
    let env = tok.grammar().unwrap();
    let cases = [
        (Constraint::JsonSchema("{not json".into()), "not JSON"),
        (Constraint::JsonSchema("[1, 2]".into()), "must be an object"),
        (Constraint::JsonSchema(r#"{"type": "integer", "minimum": 5, "maximum": 1}"#.into()), ""),
        (Constraint::Regex("(unclosed".into()), ""),
        (Constraint::Grammar("start: missing_rule".into()), "missing_rule"),
        (Constraint::Choice(vec![]), "at least one"),
    ];
    for (c, needle) in cases {
        let e = env.compile(&c).map(drop).expect_err(&format!("{c:?} must be refused"));
        assert!(!e.is_empty() && e.contains(needle), "{c:?}: {e}");
    }
    let huge = Constraint::Regex("a".repeat(tandem_model::grammar::MAX_CONSTRAINT_BYTES + 1));
    assert!(env.compile(&huge).map(drop).unwrap_err().contains("bytes"));
}

#[test]
fn tokens_outside_the_vocabulary_are_refused_without_breaking_the_state() {
    let tok = Tokenizer::from_hf_dir(&fixtures().join("llama-gqa")).unwrap();
    let env = tok.grammar().unwrap();
    let mut g = env.compile(&Constraint::JsonObject).unwrap();
    let open = tok.encode("{", false).unwrap();
    let outside = tok.vocab_size() as u32 + 10;
    let mut draft = open.clone();
    draft.push(outside);
    assert_eq!(g.accepted_prefix(&draft).unwrap(), open.len(), "a padding row's id ends the run");
    assert!(!g.allows_next(outside).unwrap());
    assert!(g.masks_along(&draft).is_err());
    assert!(g.advance(outside).is_err());
    // Still usable afterwards.
    let m = g.mask().unwrap();
    assert!(m.allows(open[0]) && !m.allows(outside));
    for &t in &open {
        g.advance(t).unwrap();
    }
    assert!(g.mask().unwrap().count() > 0);
}

/// A mask as device bits (`TokenMask::words`) allows exactly what the mask allows, for rows
/// shorter than, as long as and longer than the vocabulary (padding ids never allowed), and
/// masking a row by those bits gives what `TokenMask::apply` gives.
#[test]
fn a_mask_as_bits_allows_what_the_mask_allows() {
    for (name, tok) in tokenizers() {
        let env = tok.grammar().unwrap();
        let mut rng = StdRng::seed_from_u64(11);
        let mut g = env.compile(&Constraint::JsonSchema(PERSON.into())).unwrap();
        let vocab = tok.vocab_size();
        for step in 0..12 {
            let mask = g.mask().unwrap();
            for len in [vocab - 5, vocab, vocab + 37] {
                let words = mask.words(len);
                assert_eq!(words.len(), len.div_ceil(32), "{name}");
                for i in 0..len.div_ceil(32) * 32 {
                    let bit = words[i / 32] >> (i % 32) & 1 == 1;
                    assert_eq!(
                        bit,
                        i < len && mask.allows(i as u32),
                        "{name} step {step}: id {i} of a row of {len}"
                    );
                }
                let mut row: Vec<f32> = (0..len).map(|i| i as f32).collect();
                mask.apply(&mut row);
                for (i, &l) in row.iter().enumerate() {
                    let bit = words[i / 32] >> (i % 32) & 1 == 1;
                    assert_eq!(l == f32::NEG_INFINITY, !bit, "{name} step {step}: id {i}");
                }
            }
            let allowed: Vec<u32> = (0..vocab as u32).filter(|&t| mask.allows(t)).collect();
            let t = allowed[rng.random_range(0..allowed.len())];
            if g.advance(t).is_err() || tok.eos_token_ids().contains(&t) {
                break;
            }
        }
    }
}
