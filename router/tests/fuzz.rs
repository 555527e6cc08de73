//! Fuzzing what the router reads from the network, with arbitrary and structure-aware inputs
//! (proptest, stable Rust): OpenAI JSON bodies, `GenerateRequest`s as prost decodes them from
//! arbitrary bytes or builds them from hostile field values, and worker registration and heartbeat
//! records. Every input gets an answer (accepted, or refused with a message), never a panic.
//!
//! Cases: `TANDEM_FUZZ_CASES` (default 256 per property) so that CI runs a bounded count.

mod common;

use std::time::{Duration, Instant};

use common::{compat, tiny_model, tiny_model_id, worker_info};
use proptest::prelude::*;
use prost::Message;
use serde_json::{json, Map, Value};
use tandem_model::tokenizer::Tokenizer;
use tandem_proto::v1::{self, Role};
use tandem_router::api::{NoAdapters, Served};
use tandem_router::openai::{parse, Endpoint};
use tandem_router::registry::{OwnModel, PromptBlocks, Registry};

fn cases() -> u32 {
    std::env::var("TANDEM_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}

fn tokenizer() -> Tokenizer {
    static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| tandem_serve::identity::model_identity(&tiny_model()).unwrap().tokenizer).clone()
}

/// Any JSON value, nested a few levels.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "\\PC{0,12}".prop_map(Value::from),
        Just(json!(-1)),
        Just(json!(0)),
        Just(json!(1e300)),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// The fields the two endpoints read, for structure-aware bodies.
const KEYS: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "n",
    "best_of",
    "echo",
    "suffix",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "response_format",
    "user",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "cache_salt",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "ignore_eos",
    "stop_token_ids",
    "repetition_penalty",
];

prop_compose! {
    /// A body with the right model and a plausible prompt, and known fields with any values.
    fn openai_bodies()(
        chat in any::<bool>(),
        text in "\\PC{0,30}",
        ids in prop::collection::vec(0u32..600, 0..8),
        content in json_value(),
        fields in prop::collection::vec((prop::sample::select(KEYS), json_value()), 0..5),
        pick in 0u8..4,
    ) -> (Endpoint, Value) {
        let mut b = Map::new();
        b.insert("model".into(), json!("tiny"));
        if chat {
            let m = match pick {
                0 => json!([{"role": "user", "content": text}]),
                1 => json!([{"role": "assistant", "content": content}]),
                2 => json!([{"role": "tool", "content": text, "tool_call_id": content}]),
                _ => content,
            };
            b.insert("messages".into(), m);
        } else {
            let p = match pick {
                0 => json!(text),
                1 => json!(ids),
                2 => json!([ids]),
                _ => content,
            };
            b.insert("prompt".into(), p);
        }
        for (k, v) in fields {
            b.insert(k.into(), v);
        }
        (if chat { Endpoint::Chat } else { Endpoint::Completions }, Value::Object(b))
    }
}

fn served(tok: &Tokenizer) -> Served<'_> {
    Served { model: "tiny", adapters: &NoAdapters, context_len: 512, tokenizer: Some(tok), responses: None }
}

prop_compose! {
    /// A GenerateRequest with hostile field values (NaN and infinite floats, ids outside the
    /// vocabulary, huge counts, broken constraints).
    fn generate_requests()(
        kind in 0u8..3,
        text in "\\PC{0,30}",
        ids in prop::collection::vec(any::<u32>(), 0..8),
        max_tokens in prop::option::of(any::<u32>()),
        floats in prop::array::uniform4(prop_oneof![any::<f32>(), Just(f32::NAN), Just(f32::INFINITY), Just(-0.0f32)]),
        top_k in prop::option::of(any::<u32>()),
        seed in prop::option::of(any::<u64>()),
        stop in prop::collection::vec("\\PC{0,6}", 0..20),
        stop_ids in prop::collection::vec(any::<u32>(), 0..4),
        top_logprobs in any::<u32>(),
        n in any::<u32>(),
        prompt_logprobs in prop::option::of(any::<u32>()),
        constraint in prop::option::of((0u8..6, "\\PC{0,40}")),
        salt in "\\PC{0,20}",
    ) -> v1::GenerateRequest {
        use v1::generate_request::Prompt;
        let prompt = match kind {
            0 => Prompt::Text(text),
            1 => Prompt::TokenIds(v1::TokenIds { ids }),
            _ => Prompt::Chat(v1::ChatPrompt {
                messages: vec![v1::ChatMessage { role: text.clone(), content: text, ..Default::default() }],
                ..Default::default()
            }),
        };
        use v1::output_constraint::Kind;
        let constraint = constraint.map(|(k, s)| v1::OutputConstraint {
            kind: match k {
                0 => None,
                1 => Some(Kind::JsonSchema(s)),
                2 => Some(Kind::Regex(s)),
                3 => Some(Kind::Grammar(s)),
                4 => Some(Kind::Choice(v1::Choices { options: vec![s] })),
                _ => Some(Kind::JsonObject(true)),
            },
        });
        v1::GenerateRequest {
            prompt: Some(prompt),
            max_tokens,
            sampling: Some(v1::SamplingParams {
                temperature: Some(floats[0]),
                top_p: Some(floats[1]),
                top_k,
                min_p: Some(floats[2]),
                repetition_penalty: Some(floats[3]),
                seed,
            }),
            stop,
            stop_token_ids: stop_ids,
            cache_salt: salt,
            top_logprobs,
            n,
            prompt_logprobs,
            constraint,
            ..Default::default()
        }
    }
}

prop_compose! {
    /// A worker record: the valid one with some fields replaced by anything.
    fn worker_records()(
        id in "\\PC{0,12}",
        role in any::<i32>(),
        address in "\\PC{0,24}",
        kind in "\\PC{0,8}",
        offer_addr in "\\PC{0,24}",
        host in "\\PC{0,8}",
        block_size in any::<u32>(),
        total in any::<u32>(),
        max_len in any::<u32>(),
        vocab in any::<u32>(),
        which in prop::collection::vec(any::<bool>(), 9),
    ) -> v1::WorkerInfo {
        let mut w = worker_info("w-1", Role::Decode, "127.0.0.1:7002".parse().unwrap(), 16);
        if which[0] { w.worker_id = id; }
        if which[1] { w.role = role; }
        if which[2] { w.address = address; }
        if which[3] {
            w.transports.push(v1::TransportOffer { kind, address: offer_addr, host_id: host, ..Default::default() });
        }
        if which[4] { w.compat = None; } else if which[5] {
            w.compat = Some(v1::CompatRecord { block_size, vocab_size: vocab, ..compat(&tiny_model_id(), 16) });
        }
        if which[6] { w.total_blocks = total; }
        if which[7] { w.max_sequence_len = max_len; }
        if which[8] { w.device = "cuda:99".into(); }
        w
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn any_json_body_gets_an_answer(endpoint in prop::sample::select(vec![Endpoint::Completions, Endpoint::Chat]),
                                    v in json_value()) {
        let tok = tokenizer();
        if let Err(e) = parse(endpoint, v.to_string().as_bytes(), &served(&tok)) {
            prop_assert!(!e.message.is_empty());
        }
    }

    #[test]
    fn bodies_with_known_fields_are_read_or_refused_by_name((endpoint, v) in openai_bodies()) {
        let tok = tokenizer();
        match parse(endpoint, v.to_string().as_bytes(), &served(&tok)) {
            Ok(p) => prop_assert!(p.request.n >= 1 && p.request.max_tokens.is_some()),
            Err(e) => {
                prop_assert!(!e.message.is_empty());
                prop_assert!(e.status.is_client_error(), "{} for {v}: {}", e.status, e.message);
            }
        }
    }

    #[test]
    fn arbitrary_bytes_as_a_generate_request(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let tok = tokenizer();
        if let Ok(req) = v1::GenerateRequest::decode(bytes.as_slice()) {
            let _ = tandem_router::request::prepare(&tok, 448, &req, 7);
        }
    }

    #[test]
    fn hostile_generate_requests_are_prepared_or_refused(req in generate_requests()) {
        let tok = tokenizer();
        // Through the wire and back, as the router receives it.
        let req = v1::GenerateRequest::decode(req.encode_to_vec().as_slice()).unwrap();
        match tandem_router::request::prepare(&tok, 448, &req, 7) {
            Ok(r) => {
                prop_assert!(!r.prompt().is_empty() && r.prompt().iter().all(|&t| t < 448));
                prop_assert!(r.params().max_tokens >= 1);
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn registration_and_heartbeat_records_are_admitted_or_refused(
        w in worker_records(),
        loads in prop::collection::vec((any::<u32>(), any::<u32>(), any::<u32>(), any::<u64>()), 0..4),
        prompt in prop::collection::vec(0u32..448, 1..40),
    ) {
        let mut r = Registry::new(OwnModel { model_id: tiny_model_id(), model_name: "tiny".into() }, Duration::from_millis(100));
        let now = Instant::now();
        let id = w.worker_id.clone();
        match r.admit(w, false, now) {
            Ok(_) => {}
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        let _ = r.admit(worker_info("p-1", Role::Prefill, "127.0.0.1:7001".parse().unwrap(), 16), false, now);
        for (free, running, queued, tokens) in loads {
            let load = v1::WorkerLoad { free_blocks: free, running, queued, queued_prompt_tokens: tokens, ..Default::default() };
            r.heartbeat(&id, Some(load), now);
        }
        let blocks = PromptBlocks::new(&prompt, &tiny_model_id(), "", &r.block_sizes());
        let _ = r.pick(&blocks);
    }
}
