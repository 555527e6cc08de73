//! Structured output in the engine, on a tiny fixture model whose random weights would never
//! write JSON on their own: every constrained output is a sentence of its constraint, a constraint
//! that allows everything changes nothing, speculation under a constraint changes nothing, and the
//! prefix cache, chunked prefill and preemption leave constrained output as it was.

mod sched_common;
use sched_common::{fixture_engine, greedy, run, Setup};

use serde_json::Value;
use tandem_engine::sampler::SamplingParams;
use tandem_engine::scheduler::{Engine, SeqEvent};
use tandem_engine::spec::ngram::NgramDrafter;
use tandem_engine::spec::SpecOptions;
use tandem_model::grammar::Constraint;

const ROOMY: Setup = Setup { model: "llama-gqa", blocks: 256, block_size: 4, budget: 256, max_num_seqs: 64 };

const SCHEMA: &str = r#"{
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "colors": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3}
    },
    "required": ["name", "size", "colors"],
    "additionalProperties": false
}"#;

fn with_spec(eng: Engine, max_draft: usize) -> Engine {
    let o = SpecOptions { max_draft, adaptive: false, ngram_min: 1, ngram_max: 3, sampled_drafts: false };
    eng.with_speculation(Box::new(NgramDrafter::new(o.ngram_min, o.ngram_max)), o).unwrap()
}

fn prompts(n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|i| (0..5 + i as u32 * 3).map(|j| 3 + (i as u32 * 31 + j * 7) % 400).collect()).collect()
}

fn constrained(c: Constraint, base: SamplingParams) -> SamplingParams {
    SamplingParams { constraint: Some(c), ignore_eos: false, ..base }
}

fn text(eng: &Engine, ids: &[u32]) -> String {
    let eos = eng.tokenizer().eos_token_ids();
    let ids: Vec<u32> = ids.iter().copied().filter(|t| !eos.contains(t)).collect();
    eng.tokenizer().decode(&ids, false).unwrap()
}

fn check_person(s: &str) {
    let v: Value = serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON: {s:?}: {e}"));
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {s}"));
    assert_eq!(o.len(), 3, "{s}");
    assert!(o["name"].as_str().unwrap().chars().count() <= 5, "{s}");
    assert!((0..=99).contains(&o["size"].as_i64().unwrap()), "{s}");
    let colors = o["colors"].as_array().unwrap();
    assert!(colors.len() <= 3 && colors.iter().all(|c| c == "red" || c == "blue"), "{s}");
}

fn sampling_cases() -> Vec<(&'static str, SamplingParams)> {
    vec![
        ("greedy", SamplingParams { max_tokens: 120, ..SamplingParams::greedy() }),
        (
            "seeded",
            SamplingParams {
                temperature: 0.9,
                top_p: 0.95,
                seed: Some(5),
                max_tokens: 120,
                ..Default::default()
            },
        ),
        (
            "penalised",
            SamplingParams {
                temperature: 1.2,
                top_k: 30,
                repetition_penalty: 1.3,
                seed: Some(99),
                max_tokens: 120,
                ..Default::default()
            },
        ),
    ]
}

#[test]
fn constrained_output_is_always_a_sentence_of_the_schema() {
    let ps = prompts(6);
    for (name, base) in sampling_cases() {
        let params = vec![constrained(Constraint::JsonSchema(SCHEMA.into()), base); ps.len()];
        let mut eng = fixture_engine(&ROOMY);
        let (outs, _) = run(&mut eng, &ps, &params);
        for out in &outs {
            assert!(eng.tokenizer().eos_token_ids().contains(out.last().unwrap()), "{name}: ended by EOS");
            check_person(&text(&eng, out));
        }
    }
}

#[test]
fn a_constraint_that_allows_everything_changes_nothing() {
    let ps = prompts(8);
    let mut eng = fixture_engine(&ROOMY);
    let plain: Vec<SamplingParams> =
        vec![SamplingParams { max_tokens: 24, ..SamplingParams::greedy() }; ps.len()];
    let (want, _) = run(&mut eng, &ps, &plain);
    // The comparison means most where the model's own output is not text: bytes that are not
    // UTF-8 and special tokens, which a text grammar would forbid.
    let tok = eng.tokenizer().clone();
    let odd = want.iter().filter(|out| {
        let bytes: Vec<u8> = out.iter().flat_map(|&t| tok.token_bytes(t).unwrap()).collect();
        std::str::from_utf8(&bytes).is_err() || out.iter().any(|&t| tok.is_special(t))
    });
    assert!(odd.count() > 0, "the random model writes odd bytes or special tokens somewhere");
    // Any token, any number of times (llguidance's token-range syntax): special tokens included.
    let anything = Constraint::Grammar("start: <[*]>*".into());
    for (name, base) in sampling_cases() {
        let base = SamplingParams { max_tokens: 24, ..base };
        let plain = vec![base.clone(); ps.len()];
        let open = vec![constrained(anything.clone(), base); ps.len()];
        let (want, _) = run(&mut fixture_engine(&ROOMY), &ps, &plain);
        let (got, _) = run(&mut fixture_engine(&ROOMY), &ps, &open);
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn speculation_under_a_constraint_never_changes_output() {
    let ps = prompts(6);
    // Repetitive languages give the n-gram drafter something to propose.
    let constraints = [
        Constraint::JsonSchema(SCHEMA.into()),
        Constraint::Regex("(ab|cd)( (ab|cd)){5,12}".into()),
        Constraint::Choice(vec!["one two one two one two".into(), "one two three".into()]),
    ];
    let (mut proposed, mut accepted) = (0, 0);
    for c in &constraints {
        for (name, base) in sampling_cases() {
            let params = vec![constrained(c.clone(), base); ps.len()];
            let (want, _) = run(&mut fixture_engine(&ROOMY), &ps, &params);
            for k in [1, 3, 6] {
                let (got, (p, a)) = run(&mut with_spec(fixture_engine(&ROOMY), k), &ps, &params);
                assert_eq!(got, want, "{} {name} k={k}", c.kind());
                proposed += p;
                accepted += a;
            }
        }
    }
    assert!(accepted > 0, "no draft accepted (proposed {proposed}): the test would miss a broken mask");
}

#[test]
fn chunked_prefill_preemption_and_the_prefix_cache_leave_constrained_output_alone() {
    let ps = prompts(8);
    let params = vec![constrained(Constraint::JsonSchema(SCHEMA.into()), greedy(80)); ps.len()];
    let (want, _) = run(&mut fixture_engine(&ROOMY), &ps, &params);
    // 7-token chunks, and too few blocks for all eight at once: preemption and recompute.
    let tight = Setup { blocks: 40, budget: 7, ..ROOMY };
    let (got, _) = run(&mut with_spec(fixture_engine(&tight), 3), &ps, &params);
    assert_eq!(got, want, "chunked, preempted, speculating");
    // The same prompts again through a prefix cache: the second run is served from it.
    let mut cached = fixture_engine(&ROOMY).with_prefix_cache("llama-gqa");
    let (first, _) = run(&mut cached, &ps, &params);
    let (second, _) = run(&mut cached, &ps, &params);
    assert_eq!(first, want);
    assert_eq!(second, want, "from the prefix cache");
    assert!(cached.prefix_stats().hit_tokens > 0, "the second run hit the cache");
}

#[test]
fn an_invalid_constraint_is_refused_at_the_door() {
    let mut eng = fixture_engine(&ROOMY);
    let bad = constrained(Constraint::JsonSchema(r#"{"type": "strin"}"#.into()), greedy(4));
    let e = eng.add_request(vec![5, 6, 7], bad.clone()).unwrap_err().to_string();
    assert!(e.contains("constraint") && e.contains("json_schema"), "{e}");
    let e = eng.add_prefill_request(vec![5, 6, 7], bad).unwrap_err().to_string();
    assert!(e.contains("constraint"), "{e}");
    assert_eq!(eng.num_active(), 0);
    // A request that never asks for a constraint is not slowed down by one that did.
    let ok = eng.add_request(vec![5, 6, 7], greedy(3)).unwrap();
    let mut n = 0;
    while eng.has_work() {
        for ev in eng.step().unwrap() {
            if let SeqEvent::Token { seq, .. } = ev {
                assert_eq!(seq, ok);
                n += 1;
            }
        }
    }
    assert_eq!(n, 3);
}

#[test]
fn a_continuation_after_a_lost_worker_resumes_the_constraint_where_it_was() {
    // The router continues a request whose worker was lost with the streamed tokens appended to
    // the prompt: the constraint must move past them, not start over.
    let ps = prompts(3);
    let params = constrained(Constraint::JsonSchema(SCHEMA.into()), greedy(80));
    let (whole, _) = run(&mut fixture_engine(&ROOMY), &ps, &vec![params.clone(); ps.len()]);
    for (prompt, out) in ps.iter().zip(&whole) {
        for k in [1, 4, out.len() / 2] {
            let mut eng = fixture_engine(&ROOMY);
            let req = eng.request(prompt.clone(), params.clone()).unwrap().continued(&out[..k]).unwrap();
            assert_eq!(req.params().constraint_generated, k);
            let seq = eng.add(req).unwrap();
            let mut rest = Vec::new();
            while eng.has_work() {
                for ev in eng.step().unwrap() {
                    match ev {
                        SeqEvent::Token { seq: s, token, .. } if s == seq => rest.push(token),
                        SeqEvent::Failed { error, .. } => panic!("{error}"),
                        _ => {}
                    }
                }
            }
            assert_eq!(rest, out[k..], "continued after {k} tokens");
        }
    }
    // With ignore_eos, a finished document is followed by EOS tokens; a continuation after them
    // still resumes (EOS after the end is allowed).
    let padded = SamplingParams { ignore_eos: true, ..params.clone() };
    let (whole, _) = run(&mut fixture_engine(&ROOMY), &ps[..1], &[padded.clone()]);
    let eos = fixture_engine(&ROOMY).tokenizer().eos_token_ids().to_vec();
    let first_eos = whole[0].iter().position(|t| eos.contains(t)).expect("the document ends");
    assert!(whole[0][first_eos..].iter().all(|t| eos.contains(t)), "only EOS after the end");
    let mut eng = fixture_engine(&ROOMY);
    let req = eng.request(ps[0].clone(), padded).unwrap().continued(&whole[0][..first_eos + 2]).unwrap();
    eng.add(req).unwrap();
    while eng.has_work() {
        for ev in eng.step().unwrap() {
            if let SeqEvent::Failed { error, .. } = ev {
                panic!("{error}");
            }
        }
    }
    // Tokens the constraint never allowed cannot be claimed as written under it.
    let eng = fixture_engine(&ROOMY);
    let bad = SamplingParams { constraint_generated: 2, ..params.clone() };
    let req = eng.request(vec![5, 6, 7, 8], bad).unwrap();
    let mut eng = eng;
    let e = eng.add(req).unwrap_err().to_string();
    assert!(e.contains("constraint_generated"), "{e}");
}

#[test]
fn sampled_drafts_stay_greedy_under_a_constraint() {
    // A sampled draft the grammar forbids would be cut by its value and bias rejection sampling,
    // so constrained requests keep greedy drafts even with sampled drafts on: seeded output is then
    // the very output without speculation (sampled drafts would change the tokens).
    use tandem_engine::spec::draft_model::DraftModelDrafter;
    let ps = prompts(4);
    let drafted = || {
        let eng = fixture_engine(&ROOMY);
        let (be, tok) = sched_common::fixture_backend(&ROOMY, None);
        let vocab = eng.backend().config().vocab_size;
        let d = DraftModelDrafter::new(eng.tokenizer(), vocab, Box::new(be), &tok, "self".into()).unwrap();
        let o = SpecOptions { max_draft: 4, adaptive: false, sampled_drafts: true, ..Default::default() };
        eng.with_speculation(Box::new(d), o).unwrap()
    };
    let (mut proposed, mut accepted) = (0, 0);
    for c in [Constraint::JsonSchema(SCHEMA.into()), Constraint::Regex("(ab|cd)( (ab|cd)){5,12}".into())] {
        for (name, base) in sampling_cases().into_iter().filter(|(_, b)| b.temperature > 0.0) {
            let params = vec![constrained(c.clone(), base); ps.len()];
            let (want, _) = run(&mut fixture_engine(&ROOMY), &ps, &params);
            let (got, (p, a)) = run(&mut drafted(), &ps, &params);
            assert_eq!(got, want, "{} {name}", c.kind());
            proposed += p;
            accepted += a;
        }
    }
    assert!(proposed > 0 && accepted > 0, "{accepted} of {proposed} drafts accepted");
}
