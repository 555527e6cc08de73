//! The stop rules: stop strings across deltas, held-back text and independence from how the
//! text is split into deltas (`StopStrings`); EOS and stop tokens and `max_tokens`
//! (`TokenStop`); and the two composed with the detokenizer where tokens become text
//! (`TextOutput`).

use std::path::PathBuf;

use proptest::prelude::*;
use tandem_model::request::SamplingParams;
use tandem_model::stop::{FinishReason, StopStrings, TokenStop};
use tandem_model::text::TextOutput;
use tandem_model::tokenizer::Tokenizer;

const EOS: u32 = 2;
const TOKEN: u32 = 100;

fn checker(stops: &[&str]) -> StopStrings {
    let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
    StopStrings::new(&stops)
}

fn tokens(f: impl FnOnce(&mut SamplingParams)) -> TokenStop {
    let mut p = SamplingParams { max_tokens: 1000, ..SamplingParams::default() };
    f(&mut p);
    TokenStop::new(&p, &[EOS])
}

/// Pushes each delta; returns everything emitted and the reason, if any.
fn feed(c: &mut StopStrings, deltas: &[&str]) -> (Vec<String>, Option<FinishReason>) {
    let mut out = Vec::new();
    for d in deltas {
        let (text, stop) = c.push(d);
        out.push(text);
        if let Some(s) = stop {
            return (out, Some(FinishReason::StopString(s)));
        }
    }
    (out, None)
}

fn stop(s: &str) -> Option<FinishReason> {
    Some(FinishReason::StopString(s.to_string()))
}

#[test]
fn stop_string_spanning_three_deltas() {
    let mut c = checker(&["<END>"]);
    let (out, reason) = feed(&mut c, &["hello <E", "N", "D> tail"]);
    assert_eq!(out, ["hello ", "", ""]);
    assert_eq!(reason, stop("<END>"));
    assert_eq!(c.matched(), Some("<END>"));
    assert_eq!(c.flush(), "", "nothing is held after a stop string");
    assert_eq!(c.push("more"), (String::new(), Some("<END>".to_string())), "nothing after the match");
}

#[test]
fn held_back_prefix_is_released_when_the_match_fails() {
    let mut c = checker(&["<END>"]);
    let (out, reason) = feed(&mut c, &["a <E", "N", "x", " b"]);
    assert_eq!(out, ["a ", "", "<ENx", " b"]);
    assert_eq!(reason, None);
    // A partial match at the end of a delta is held until the next one decides.
    let (out, _) = feed(&mut c, &["<"]);
    assert_eq!(out, [""]);
    assert_eq!(c.flush(), "<");
}

#[test]
fn stop_string_at_the_very_start() {
    let mut c = checker(&["###"]);
    let (out, reason) = feed(&mut c, &["### rest"]);
    assert_eq!(out, [""]);
    assert_eq!(reason, stop("###"));
    let mut c = checker(&["###"]);
    let (out, reason) = feed(&mut c, &["#", "#", "#"]);
    assert_eq!(out, ["", "", ""]);
    assert_eq!(reason, stop("###"));
}

#[test]
fn overlapping_candidates() {
    // "ab" completes before "abc" could, so it wins.
    let mut c = checker(&["abc", "ab"]);
    let (out, reason) = feed(&mut c, &["xa", "b", "c"]);
    assert_eq!(out, ["x", ""]);
    assert_eq!(reason, stop("ab"));
    // Only "abc": "ab" is held, then released when "d" breaks the match.
    let mut c = checker(&["abc"]);
    let (out, reason) = feed(&mut c, &["xa", "b", "d"]);
    assert_eq!(out, ["x", "", "abd"]);
    assert_eq!(reason, None);
    // Two matches in one delta: the one that ends first wins, whatever the list order.
    let mut c = checker(&["bcd", "abc"]);
    let (out, reason) = feed(&mut c, &["xabcd"]);
    assert_eq!(out, ["x"]);
    assert_eq!(reason, stop("abc"));
    // Same end: the longer (earlier-starting) one.
    let mut c = checker(&["bc", "abc"]);
    assert_eq!(feed(&mut c, &["xabc"]), (vec!["x".to_string()], stop("abc")));
}

#[test]
fn self_overlapping_stop_string() {
    // "aab" inside "aaab": the held prefix must slide rather than be released whole.
    let mut c = checker(&["aab"]);
    let (out, reason) = feed(&mut c, &["a", "a", "a", "b"]);
    assert_eq!(out, ["", "", "a", ""]);
    assert_eq!(reason, stop("aab"));
}

#[test]
fn empty_deltas_and_multibyte_text() {
    let mut c = checker(&["終わり"]);
    let (out, reason) = feed(&mut c, &["こんにちは", "", "終", "", "わ", "り!"]);
    assert_eq!(out.concat(), "こんにちは");
    assert_eq!(reason, stop("終わり"));
}

#[test]
fn eos_ends_generation_and_later_tokens_count_nothing() {
    let mut c = tokens(|_| {});
    assert_eq!(c.push(TOKEN), None);
    assert_eq!(c.push(EOS), Some(FinishReason::Eos));
    assert_eq!(c.generated_tokens(), 2);
    // Later pushes count nothing and repeat the reason.
    assert_eq!(c.push(TOKEN), Some(FinishReason::Eos));
    assert_eq!(c.generated_tokens(), 2);
    assert!(c.is_stop_token(EOS) && !c.is_stop_token(TOKEN));
}

#[test]
fn ignore_eos_keeps_going_but_stop_tokens_still_stop() {
    let mut c = tokens(|p| {
        p.ignore_eos = true;
        p.stop_token_ids = vec![7];
    });
    assert!(!c.is_stop_token(EOS) && c.is_stop_token(7));
    assert_eq!(c.push(EOS), None);
    assert_eq!(c.push(TOKEN), None);
    assert_eq!(c.push(7), Some(FinishReason::StopToken(7)));
    assert_eq!(FinishReason::StopToken(7).as_str(), "stop");
}

#[test]
fn max_tokens_ends_on_the_last_allowed_token() {
    let mut c = tokens(|p| p.max_tokens = 3);
    assert_eq!((c.push(TOKEN), c.tokens_left()), (None, 2));
    assert_eq!(c.push(TOKEN), None);
    assert_eq!(c.push(TOKEN), Some(FinishReason::Length));
    assert_eq!((c.generated_tokens(), c.tokens_left()), (3, 0));
    assert_eq!(FinishReason::Length.as_str(), "length");
    // EOS on the last allowed token is EOS.
    let mut c = tokens(|p| p.max_tokens = 1);
    assert_eq!(c.push(EOS), Some(FinishReason::Eos));
    assert_eq!(FinishReason::Eos.as_str(), "stop");
}

fn tiny() -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/fixtures/qwen3");
    Tokenizer::from_hf_dir(&dir).unwrap()
}

/// Where tokens become text: the text of a token stream equals decoding it at once, cut before
/// the first stop string, whatever the stop strings' position relative to token boundaries.
#[test]
fn text_output_cuts_before_a_stop_string_spanning_tokens() {
    let tok = tiny();
    let text = "hello there, general kenobi";
    let ids = tok.encode(text, false).unwrap();
    assert!(ids.len() > 4, "{ids:?}");
    // No stop string: everything, with what was held back released by finish().
    let mut out = TextOutput::new(&tok, &[], &[]);
    let mut shown = String::new();
    for &id in &ids {
        let p = out.push(id).unwrap();
        assert_eq!(p.stop, None);
        shown.push_str(&p.text);
    }
    shown.push_str(&out.finish());
    assert_eq!(shown, tok.decode(&ids, true).unwrap());

    let mut out = TextOutput::new(&tok, &[], &["general".to_string()]);
    let mut shown = String::new();
    let mut stopped_at = None;
    for (i, &id) in ids.iter().enumerate() {
        let p = out.push(id).unwrap();
        shown.push_str(&p.text);
        if p.stop.is_some() {
            stopped_at = Some(i);
            break;
        }
    }
    assert_eq!(shown, "hello there, ");
    assert!(stopped_at.is_some_and(|i| i + 1 < ids.len()), "the match ends before the last token");
    assert_eq!(out.stopped(), Some("general"));
    assert_eq!(out.finish(), "", "nothing after a stop string");
    let p = out.push(ids[ids.len() - 1]).unwrap();
    assert_eq!((p.text.as_str(), p.stop.as_deref()), ("", Some("general")));
}

/// A partial stop string held back is released when a token rule ends the stream.
#[test]
fn text_output_releases_held_text_when_a_token_rule_ends_the_stream() {
    let tok = tiny();
    let ids = tok.encode("abc <EN", false).unwrap();
    let mut out = TextOutput::new(&tok, &[], &["<END>".to_string()]);
    let mut shown = String::new();
    for &id in &ids {
        shown.push_str(&out.push(id).unwrap().text);
    }
    assert!(!shown.contains("<EN"), "a possible stop string is held back: {shown:?}");
    shown.push_str(&out.finish());
    assert_eq!(shown, "abc <EN");
    // An id outside the tokenizer is an error, not text.
    assert!(TextOutput::new(&tok, &[], &[]).push(tok.vocab_size() as u32).is_err());
}

#[test]
fn flush_releases_held_text_on_abort() {
    let mut c = checker(&["STOP"]);
    assert_eq!(c.push("text ST"), ("text ".to_string(), None));
    assert_eq!(c.flush(), "ST");
    assert_eq!(c.flush(), "");
}

/// Reference: the stop match that ends first in the whole text (ties → starts first).
fn reference(text: &str, stops: &[String]) -> (String, Option<FinishReason>) {
    let best = stops
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|start| (start + s.len(), start, s)))
        .min_by_key(|&(end, start, _)| (end, start));
    match best {
        Some((_, start, s)) => (text[..start].to_string(), Some(FinishReason::StopString(s.clone()))),
        None => (text.to_string(), None),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// Whatever the delta boundaries, the emitted text and the reason equal the one-shot reference.
    #[test]
    fn emitted_text_does_not_depend_on_delta_boundaries(
        text in "[abcé]{0,24}",
        stops in prop::collection::vec("[abcé]{1,4}", 1..4),
        cuts in prop::collection::vec(0usize..30, 0..8),
    ) {
        let mut bounds: Vec<usize> = cuts.into_iter().filter(|&i| text.is_char_boundary(i.min(text.len()))).map(|i| i.min(text.len())).collect();
        bounds.push(0);
        bounds.push(text.len());
        bounds.sort_unstable();
        let deltas: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
        let mut c = StopStrings::new(&stops);
        let (out, reason) = feed(&mut c, &deltas);
        let mut emitted = out.concat();
        if reason.is_none() {
            emitted.push_str(&c.flush());
        }
        prop_assert_eq!((emitted, reason), reference(&text, &stops));
    }
}

/// `feed`, the rules of text at the edge: a worker's stop token is counted and never shown, a
/// stop string ends the run at the token that completes it, and the held text comes at the end.
#[test]
fn text_output_feed_applies_the_workers_finish_and_the_stop_strings() {
    let tok = tiny();
    let ids = tok.encode("hello there, general kenobi", false).unwrap();
    let all = tok.decode(&ids, true).unwrap();

    // A stop token ends the run: counted, its text not shown, the held text released.
    let mut out = TextOutput::new(&tok, &[], &[]);
    let fed = out.feed(&ids, Some(FinishReason::StopToken(ids[ids.len() - 1]))).unwrap();
    assert_eq!(fed.taken, ids.len());
    assert_eq!(fed.text, tok.decode(&ids[..ids.len() - 1], true).unwrap());
    assert_eq!(fed.finish, Some(FinishReason::StopToken(ids[ids.len() - 1])));

    // "length": every token's text, whatever the batching.
    let mut out = TextOutput::new(&tok, &[], &[]);
    let (a, b) = ids.split_at(3);
    let first = out.feed(a, None).unwrap();
    assert_eq!((first.taken, first.finish.clone()), (3, None));
    let second = out.feed(b, Some(FinishReason::Length)).unwrap();
    assert_eq!(first.text + &second.text, all);

    // A stop string ends the run where it completes; later tokens are not taken, even when the
    // worker said it ended the sequence itself.
    let mut out = TextOutput::new(&tok, &[], &["general".to_string()]);
    let fed = out.feed(&ids, Some(FinishReason::Length)).unwrap();
    assert!(fed.taken < ids.len(), "{fed:?}");
    assert_eq!(fed.text, "hello there, ");
    assert_eq!(fed.finish, Some(FinishReason::StopString("general".into())));
    let after = out.feed(&ids, None).unwrap();
    assert_eq!((after.taken, after.text.as_str()), (0, ""));
    assert_eq!(after.finish, Some(FinishReason::StopString("general".into())));
}
