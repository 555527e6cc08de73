//! `SamplingParams`: defaults, serde, and `validate()` rejections that name the offending field.

use tandem_engine::sampler::{
    SamplingParams, MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES, MAX_STOP_TOKEN_IDS,
};

const VOCAB: usize = 1000;

#[test]
fn defaults_and_greedy() {
    let d = SamplingParams::default();
    assert_eq!((d.temperature, d.top_k, d.top_p, d.min_p), (1.0, 0, 1.0, 0.0));
    assert_eq!((d.repetition_penalty, d.seed, d.max_tokens), (1.0, None, 256));
    assert!(d.stop_token_ids.is_empty() && d.stop_strings.is_empty() && !d.ignore_eos);
    assert_eq!(d.logprobs, None);
    assert!(d.validate(VOCAB).is_ok());
    let g = SamplingParams::greedy();
    assert_eq!(g.temperature, 0.0);
    assert_eq!(SamplingParams { temperature: 1.0, ..g.clone() }, d);
    assert!(g.validate(VOCAB).is_ok());
}

#[test]
fn serde_fills_defaults_and_rejects_unknown_fields() {
    let p: SamplingParams =
        serde_json::from_str(r#"{"temperature": 0.5, "stop_strings": ["\n\n"]}"#).unwrap();
    assert_eq!(p.temperature, 0.5);
    assert_eq!(p.stop_strings, vec!["\n\n".to_string()]);
    assert_eq!(p.max_tokens, SamplingParams::default().max_tokens);
    let back: SamplingParams = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back, p);
    assert!(serde_json::from_str::<SamplingParams>(r#"{"temprature": 0.5}"#).is_err());
}

#[test]
fn validate_rejections_name_the_field() {
    let cases: Vec<(&str, SamplingParams)> = vec![
        ("temperature", SamplingParams { temperature: -0.1, ..Default::default() }),
        ("temperature", SamplingParams { temperature: f32::NAN, ..Default::default() }),
        ("temperature", SamplingParams { temperature: f32::INFINITY, ..Default::default() }),
        ("top_p", SamplingParams { top_p: 0.0, ..Default::default() }),
        ("top_p", SamplingParams { top_p: 1.01, ..Default::default() }),
        ("top_p", SamplingParams { top_p: f32::NAN, ..Default::default() }),
        ("min_p", SamplingParams { min_p: -0.01, ..Default::default() }),
        ("min_p", SamplingParams { min_p: 1.5, ..Default::default() }),
        ("min_p", SamplingParams { min_p: f32::NAN, ..Default::default() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: 0.0, ..Default::default() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: -1.0, ..Default::default() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: f32::NAN, ..Default::default() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: f32::INFINITY, ..Default::default() }),
        ("max_tokens", SamplingParams { max_tokens: 0, ..Default::default() }),
        ("stop_token_ids", SamplingParams { stop_token_ids: vec![3, VOCAB as u32], ..Default::default() }),
        (
            "stop_token_ids",
            SamplingParams { stop_token_ids: vec![1; MAX_STOP_TOKEN_IDS + 1], ..Default::default() },
        ),
        (
            "stop_strings",
            SamplingParams { stop_strings: vec!["ok".into(), String::new()], ..Default::default() },
        ),
        (
            "stop_strings",
            SamplingParams { stop_strings: vec!["x".into(); MAX_STOP_STRINGS + 1], ..Default::default() },
        ),
        (
            "stop_strings",
            SamplingParams {
                stop_strings: vec!["y".repeat(MAX_STOP_STRING_BYTES + 1)],
                ..Default::default()
            },
        ),
        ("logprobs", SamplingParams { logprobs: Some(MAX_LOGPROBS + 1), ..Default::default() }),
    ];
    for (field, p) in cases {
        let err = p.validate(VOCAB).expect_err(field);
        assert_eq!(err.kind(), "invalid_request", "{field}: {err}");
        let msg = err.to_string();
        assert!(msg.contains(field), "message for {field} does not name it: {msg}");
    }
}

#[test]
fn validate_accepts_the_edges() {
    let ok = [
        SamplingParams { temperature: 0.0, ..Default::default() },
        SamplingParams { top_p: 1.0, min_p: 1.0, ..Default::default() },
        SamplingParams { top_k: VOCAB * 10, ..Default::default() },
        SamplingParams { stop_token_ids: vec![VOCAB as u32 - 1], ..Default::default() },
        SamplingParams {
            stop_strings: vec!["z".repeat(MAX_STOP_STRING_BYTES); MAX_STOP_STRINGS],
            ..Default::default()
        },
        SamplingParams { logprobs: Some(MAX_LOGPROBS), max_tokens: 1, ..Default::default() },
    ];
    for p in ok {
        assert!(p.validate(VOCAB).is_ok(), "{p:?}");
    }
}
