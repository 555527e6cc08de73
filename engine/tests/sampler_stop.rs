//! Behaviour of `StopChecker`: stop strings across deltas, held-back text, stop and EOS tokens,
//! `max_tokens`, and independence from how the text is split into deltas.

use proptest::prelude::*;
use tandem_engine::sampler::{FinishReason, SamplingParams, StopChecker};

const EOS: u32 = 2;
const TOKEN: u32 = 100;

fn checker(stops: &[&str], f: impl FnOnce(&mut SamplingParams)) -> StopChecker {
    let mut p = SamplingParams {
        stop_strings: stops.iter().map(|s| s.to_string()).collect(),
        max_tokens: 1000,
        ..SamplingParams::default()
    };
    f(&mut p);
    StopChecker::new(&p, &[EOS])
}

/// Pushes each delta as one token; returns everything emitted and the reason, if any.
fn feed(c: &mut StopChecker, deltas: &[&str]) -> (Vec<String>, Option<FinishReason>) {
    let mut out = Vec::new();
    for d in deltas {
        let (text, reason) = c.push(TOKEN, d);
        out.push(text);
        if reason.is_some() {
            return (out, reason);
        }
    }
    (out, None)
}

fn stop(s: &str) -> Option<FinishReason> {
    Some(FinishReason::StopString(s.to_string()))
}

#[test]
fn stop_string_spanning_three_deltas() {
    let mut c = checker(&["<END>"], |_| {});
    let (out, reason) = feed(&mut c, &["hello <E", "N", "D> tail"]);
    assert_eq!(out, ["hello ", "", ""]);
    assert_eq!(reason, stop("<END>"));
    assert_eq!(c.generated_tokens(), 3);
    assert_eq!(c.flush(), "", "nothing is held after a stop string");
}

#[test]
fn held_back_prefix_is_released_when_the_match_fails() {
    let mut c = checker(&["<END>"], |_| {});
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
    let mut c = checker(&["###"], |_| {});
    let (out, reason) = feed(&mut c, &["### rest"]);
    assert_eq!(out, [""]);
    assert_eq!(reason, stop("###"));
    let mut c = checker(&["###"], |_| {});
    let (out, reason) = feed(&mut c, &["#", "#", "#"]);
    assert_eq!(out, ["", "", ""]);
    assert_eq!(reason, stop("###"));
}

#[test]
fn overlapping_candidates() {
    // "ab" completes before "abc" could, so it wins.
    let mut c = checker(&["abc", "ab"], |_| {});
    let (out, reason) = feed(&mut c, &["xa", "b", "c"]);
    assert_eq!(out, ["x", ""]);
    assert_eq!(reason, stop("ab"));
    // Only "abc": "ab" is held, then released when "d" breaks the match.
    let mut c = checker(&["abc"], |_| {});
    let (out, reason) = feed(&mut c, &["xa", "b", "d"]);
    assert_eq!(out, ["x", "", "abd"]);
    assert_eq!(reason, None);
    // Two matches in one delta: the one that ends first wins, whatever the list order.
    let mut c = checker(&["bcd", "abc"], |_| {});
    let (out, reason) = feed(&mut c, &["xabcd"]);
    assert_eq!(out, ["x"]);
    assert_eq!(reason, stop("abc"));
    // Same end: the longer (earlier-starting) one.
    let mut c = checker(&["bc", "abc"], |_| {});
    assert_eq!(feed(&mut c, &["xabc"]), (vec!["x".to_string()], stop("abc")));
}

#[test]
fn self_overlapping_stop_string() {
    // "aab" inside "aaab": the held prefix must slide rather than be released whole.
    let mut c = checker(&["aab"], |_| {});
    let (out, reason) = feed(&mut c, &["a", "a", "a", "b"]);
    assert_eq!(out, ["", "", "a", ""]);
    assert_eq!(reason, stop("aab"));
}

#[test]
fn empty_deltas_and_multibyte_text() {
    let mut c = checker(&["終わり"], |_| {});
    let (out, reason) = feed(&mut c, &["こんにちは", "", "終", "", "わ", "り!"]);
    assert_eq!(out.concat(), "こんにちは");
    assert_eq!(reason, stop("終わり"));
}

#[test]
fn eos_ends_generation_and_its_text_is_not_emitted() {
    let mut c = checker(&["<END>"], |_| {});
    assert_eq!(c.push(TOKEN, "ok <E"), ("ok ".to_string(), None));
    // The held "<E" can no longer become a stop string, so it is released with the stop.
    assert_eq!(c.push(EOS, "</s>"), ("<E".to_string(), Some(FinishReason::Eos)));
    assert_eq!(c.generated_tokens(), 2);
    // Later pushes emit nothing and repeat the reason.
    assert_eq!(c.push(TOKEN, "more"), (String::new(), Some(FinishReason::Eos)));
    assert_eq!(c.generated_tokens(), 2);
}

#[test]
fn ignore_eos_keeps_going_but_stop_tokens_still_stop() {
    let mut c = checker(&[], |p| {
        p.ignore_eos = true;
        p.stop_token_ids = vec![7];
    });
    assert_eq!(c.push(EOS, "</s>"), ("</s>".to_string(), None));
    assert_eq!(c.push(TOKEN, "x"), ("x".to_string(), None));
    assert_eq!(c.push(7, "<|im_end|>"), (String::new(), Some(FinishReason::StopToken(7))));
    assert_eq!(FinishReason::StopToken(7).as_str(), "stop");
}

#[test]
fn max_tokens_emits_the_last_token_and_held_text() {
    let mut c = checker(&["<END>"], |p| p.max_tokens = 3);
    assert_eq!(c.push(TOKEN, "a"), ("a".to_string(), None));
    assert_eq!(c.push(TOKEN, "b"), ("b".to_string(), None));
    assert_eq!(c.push(TOKEN, "c<E"), ("c<E".to_string(), Some(FinishReason::Length)));
    assert_eq!(c.generated_tokens(), 3);
    assert_eq!(FinishReason::Length.as_str(), "length");
    // A stop string completed by the last allowed token is still a stop, not a length.
    let mut c = checker(&["<END>"], |p| p.max_tokens = 2);
    assert_eq!(c.push(TOKEN, "a<EN"), ("a".to_string(), None));
    assert_eq!(c.push(TOKEN, "D>"), (String::new(), stop("<END>")));
    // EOS on the last allowed token is EOS.
    let mut c = checker(&[], |p| p.max_tokens = 1);
    assert_eq!(c.push(EOS, "</s>"), (String::new(), Some(FinishReason::Eos)));
    assert_eq!(FinishReason::Eos.as_str(), "stop");
}

#[test]
fn flush_releases_held_text_on_abort() {
    let mut c = checker(&["STOP"], |_| {});
    assert_eq!(c.push(TOKEN, "text ST"), ("text ".to_string(), None));
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
        let params = SamplingParams { stop_strings: stops.clone(), max_tokens: 1000, ..SamplingParams::default() };
        let mut c = StopChecker::new(&params, &[]);
        let (out, reason) = feed(&mut c, &deltas);
        let mut emitted = out.concat();
        if reason.is_none() {
            emitted.push_str(&c.flush());
        }
        prop_assert_eq!((emitted, reason), reference(&text, &stops));
    }
}
