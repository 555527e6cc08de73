//! `Request`, the one validated request type: its constructor is the only validation, and what
//! it refuses is named by field.

use tandem_model::request::{Request, SamplingParams};
use tandem_model::ModelError;

const VOCAB: usize = 100;

fn refused(prompt: Vec<u32>, params: SamplingParams) -> String {
    match Request::new(prompt, params, VOCAB) {
        Err(ModelError::InvalidRequest(m)) => m,
        other => panic!("expected an invalid request, got {other:?}"),
    }
}

#[test]
fn the_constructor_checks_the_prompt_and_every_parameter() {
    let ok = Request::new(vec![1, 2, 99], SamplingParams::greedy(), VOCAB).unwrap();
    assert_eq!((ok.prompt(), ok.salt(), ok.vocab_size()), (&[1, 2, 99][..], "", VOCAB));

    assert!(refused(vec![], SamplingParams::greedy()).starts_with("prompt: is empty"));
    let m = refused(vec![1, 100], SamplingParams::greedy());
    assert!(m.starts_with("prompt: token id 100 is outside the vocabulary (100)"), "{m}");
    let m = refused(vec![1], SamplingParams { max_tokens: 0, ..SamplingParams::greedy() });
    assert!(m.starts_with("max_tokens:"), "{m}");
    let m = refused(vec![1], SamplingParams { temperature: f32::NAN, ..SamplingParams::greedy() });
    assert!(m.starts_with("temperature:"), "{m}");
    let m = refused(vec![1], SamplingParams { stop_token_ids: vec![100], ..SamplingParams::greedy() });
    assert!(m.starts_with("stop_token_ids:"), "{m}");
    let long_salt = "s".repeat(tandem_model::prefix::MAX_SALT_BYTES + 1);
    let m = refused(vec![1], SamplingParams { cache_salt: long_salt, ..SamplingParams::greedy() });
    assert!(m.starts_with("cache_salt: at most"), "{m}");
}

#[test]
fn a_continuation_is_still_valid_and_counts_what_is_left() {
    let params = SamplingParams { max_tokens: 5, cache_salt: "tenant".into(), ..SamplingParams::greedy() };
    let r = Request::new(vec![1, 2], params, VOCAB).unwrap();
    let c = r.continued(&[7, 8]).unwrap();
    assert_eq!(c.prompt(), &[1, 2, 7, 8]);
    assert_eq!((c.params().max_tokens, c.salt()), (3, "tenant"));
    assert_eq!(r.continued(&[7; 9]).unwrap().params().max_tokens, 1, "never below one");
    assert!(r.continued(&[VOCAB as u32]).is_err(), "a generated id outside the vocabulary");
    assert_eq!(r.clone().with_seed(9).params().seed, Some(9));
    let (prompt, params) = r.into_parts();
    assert_eq!((prompt, params.max_tokens), (vec![1, 2], 5));
}
