//! Incremental detokenization never splits a UTF-8 character and concatenates to `decode`.
//! The tiny fixture tokenizer (448 ids) has almost no multi-byte merges, so emoji and CJK are
//! spelled byte by byte: the hard case for streaming.

use std::path::PathBuf;

use proptest::prelude::*;
use tandem_model::tokenizer::{IncrementalDecoder, Tokenizer};

fn tiny() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/qwen3");
    Tokenizer::from_hf_dir(&dir).unwrap()
}

/// Streams `ids` through a decoder; checks every delta and returns the concatenation.
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> (String, usize) {
    let mut dec = IncrementalDecoder::new(tok, &[], skip_special);
    let mut out = String::new();
    let mut held = 0;
    for &id in ids {
        let d = dec.push(id).unwrap();
        assert!(!d.contains('\u{FFFD}'), "delta with a broken character: {d:?}");
        if d.is_empty() {
            held += 1;
        }
        out.push_str(&d);
    }
    out.push_str(&dec.finish().unwrap());
    (out, held)
}

#[test]
fn emoji_and_cjk_are_never_split() {
    let tok = tiny();
    for text in ["emoji 😀👍🏽🎉 done", "日本語のテキスト", "中文 and English", "👨‍👩‍👧‍👦", "café ñ ü", "a😀"]
    {
        let ids = tok.encode(text, false).unwrap();
        // The case is only meaningful when characters really span several ids.
        assert!(ids.len() > text.chars().count() / 2, "{text:?} -> {ids:?}");
        let (out, held) = stream(&tok, &ids, false);
        assert_eq!(out, text);
        assert_eq!(out, tok.decode(&ids, false).unwrap());
        if !text.is_ascii() {
            assert!(held > 0, "multi-byte text must make the decoder hold back at least once");
        }
    }
}

#[test]
fn special_tokens_stream_as_decode_does() {
    let tok = tiny();
    let ids = tok.encode("<|im_start|>user\n日本<|im_end|>", false).unwrap();
    for skip in [false, true] {
        let (out, _) = stream(&tok, &ids, skip);
        assert_eq!(out, tok.decode(&ids, skip).unwrap());
    }
}

#[test]
fn incomplete_tail_is_flushed_by_finish() {
    let tok = tiny();
    let ids = tok.encode("ok 😀", false).unwrap();
    // Stop one id short of the end: the emoji is incomplete.
    let cut = &ids[..ids.len() - 1];
    let mut dec = IncrementalDecoder::new(&tok, &[], false);
    let mut out = String::new();
    for &id in cut {
        out.push_str(&dec.push(id).unwrap());
    }
    assert_eq!(out, "ok ");
    let tail = dec.finish().unwrap();
    assert!(tail.ends_with('\u{FFFD}'), "{tail:?}");
    assert_eq!(out + &tail, tok.decode(cut, false).unwrap());
}

#[test]
fn out_of_vocabulary_id_is_an_error() {
    let tok = tiny();
    let mut dec = IncrementalDecoder::new(&tok, &[], false);
    assert!(dec.push(tok.vocab_size() as u32).is_err());
}

#[test]
fn long_stream_stays_correct() {
    // Exercises the window compaction (many ids).
    let tok = tiny();
    let text = "The river 日本 flows 😀. ".repeat(40);
    let ids = tok.encode(&text, false).unwrap();
    assert!(ids.len() > 200);
    let (out, _) = stream(&tok, &ids, false);
    assert_eq!(out, text);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn any_text_streams_back_exactly(text in "[a-z 日本語😀é\\n]{0,40}") {
        let tok = tiny();
        let ids = tok.encode(&text, false).unwrap();
        let (out, _) = stream(&tok, &ids, false);
        prop_assert_eq!(&out, &text);
        prop_assert_eq!(out, tok.decode(&ids, false).unwrap());
    }
}
