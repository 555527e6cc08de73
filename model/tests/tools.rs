//! Tool calling on a real tokenizer with each known template family: the template renders the
//! tools and a history of calls and results; the grammar that forces a call, walked with random
//! allowed tokens, always spells calls the format's parser reads back, of the allowed functions,
//! with arguments valid against their schemas.

use std::path::PathBuf;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tandem_model::grammar::Grammar;
use tandem_model::tokenizer::{ChatMessage, Tokenizer};
use tandem_model::tools::{
    forced_call, generic_messages, generic_reply_or_calls, TemplateToolCall, ToolDef, ToolFormat,
};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/reference")
}

/// The llama-gqa fixture's tokenizer with `template` as its chat template.
fn tokenizer_with(template: &str) -> Tokenizer {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("tandem-tools-{}-{n}-{template}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(root().join("fixtures/llama-gqa").join(f), dir.join(f)).unwrap();
    }
    std::fs::copy(root().join("templates").join(template), dir.join("chat_template.jinja")).unwrap();
    let tok = Tokenizer::from_hf_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    tok
}

const FAMILIES: [(&str, ToolFormat); 3] = [
    ("tools-hermes.jinja", ToolFormat::Hermes),
    ("tools-llama3.jinja", ToolFormat::Llama3Json),
    ("tools-mistral.jinja", ToolFormat::Mistral),
];

fn tools() -> Vec<ToolDef> {
    vec![
        ToolDef {
            name: "get_weather".into(),
            description: Some("The weather in a city".into()),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"], "additionalProperties": false}),
        },
        ToolDef {
            name: "add".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a", "b"], "additionalProperties": false}),
        },
    ]
}

fn openai_tools() -> Value {
    Value::Array(
        tools()
            .iter()
            .map(|t| json!({"type": "function", "function": {"name": t.name, "description": "d", "parameters": t.parameters}}))
            .collect(),
    )
}

fn check_arguments(name: &str, args: &Value) {
    let o = args.as_object().unwrap_or_else(|| panic!("{name}: arguments {args} are not an object"));
    match name {
        "get_weather" => {
            assert_eq!(o.len(), 2, "{args}");
            assert!(o["city"].as_str().unwrap().chars().count() <= 8, "{args}");
            assert!(o["unit"] == "c" || o["unit"] == "f", "{args}");
        }
        "add" => {
            assert_eq!(o.len(), 2, "{args}");
            for k in ["a", "b"] {
                assert!((0..=99).contains(&o[k].as_i64().unwrap()), "{args}");
            }
        }
        other => panic!("a call of an unknown function {other}"),
    }
}

/// Random allowed tokens until EOS; the text of the walk (special tokens spelled out).
fn walk(tok: &Tokenizer, g: &mut Grammar, rng: &mut StdRng) -> String {
    let eos = tok.eos_token_ids().to_vec();
    let mut ids = Vec::new();
    for _ in 0..4000 {
        let m = g.mask().unwrap();
        let allowed: Vec<u32> = (0..tok.vocab_size() as u32).filter(|&t| m.allows(t)).collect();
        let t = match allowed.iter().find(|t| eos.contains(t)) {
            Some(&e) if rng.random_bool(0.7) => e,
            _ => allowed[rng.random_range(0..allowed.len())],
        };
        g.advance(t).unwrap();
        if eos.contains(&t) {
            return tok.decode(&ids, false).unwrap();
        }
        ids.push(t);
    }
    panic!("no EOS within 4000 tokens: {:?}", tok.decode(&ids, false));
}

#[test]
fn each_family_renders_tools_and_a_history_of_calls() {
    for (template, format) in FAMILIES {
        let tok = tokenizer_with(template);
        assert_eq!(ToolFormat::of(&tok), Some(format), "{template}");
        let messages = vec![
            ChatMessage::new("user", "Weather in Oslo?"),
            ChatMessage {
                tool_calls: Some(vec![TemplateToolCall::from_wire(
                    Some("call_1".into()),
                    "get_weather".into(),
                    r#"{"city": "Oslo", "unit": "c"}"#,
                )]),
                ..ChatMessage::new("assistant", "")
            },
            ChatMessage { tool_call_id: Some("call_1".into()), ..ChatMessage::new("tool", "-3 degrees") },
        ];
        let text = tok.apply_chat_template_with_tools(&messages, Some(&openai_tools()), true).unwrap();
        for needle in ["get_weather", "\"add\"", "Oslo", "-3 degrees", "\"unit\""] {
            assert!(text.contains(needle), "{template}: {needle} missing from\n{text}");
        }
        // The assistant's call is written the way the family writes calls, and reads back.
        let call_text = match format {
            ToolFormat::Hermes => "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}\n</tool_call>",
            ToolFormat::Llama3Json => "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"unit\": \"c\"}}",
            ToolFormat::Mistral => "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}]",
            ToolFormat::Generic => unreachable!("not a template family"),
        };
        assert!(text.contains(call_text), "{template}: the call is not written as {call_text:?}:\n{text}");
        let back = format.parse(call_text, &["get_weather".to_string()]);
        assert_eq!(back.calls.len(), 1, "{template}");
        check_arguments(&back.calls[0].name, &serde_json::from_str(&back.calls[0].arguments).unwrap());
    }
    // The fixture's own ChatML template renders no tools: the generic format.
    let plain = Tokenizer::from_hf_dir(&root().join("fixtures/llama-gqa")).unwrap();
    assert_eq!(ToolFormat::of(&plain), Some(ToolFormat::Generic));
}

fn history() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("user", "Weather in Oslo?"),
        ChatMessage {
            tool_calls: Some(vec![TemplateToolCall::from_wire(
                Some("call_1".into()),
                "get_weather".into(),
                r#"{"city": "Oslo", "unit": "c"}"#,
            )]),
            ..ChatMessage::new("assistant", "")
        },
        ChatMessage { tool_call_id: Some("call_1".into()), ..ChatMessage::new("tool", "-3 degrees") },
        ChatMessage::new("user", "And in Bergen?"),
    ]
}

#[test]
fn the_generic_format_describes_tools_in_the_system_message_and_keeps_roles_alternating() {
    let plain = Tokenizer::from_hf_dir(&root().join("fixtures/llama-gqa")).unwrap();
    let gemma = tokenizer_with("gemma3-chat.jinja");
    assert_eq!(ToolFormat::of(&gemma), Some(ToolFormat::Generic));
    for (name, tok) in [("chatml", &plain), ("gemma3", &gemma)] {
        let with_system = [vec![ChatMessage::new("system", "Be brief.")], history()].concat();
        for messages in [history(), with_system] {
            let converted = generic_messages(&messages, Some(&openai_tools()));
            assert_eq!(converted[0].role, "system");
            assert_eq!(converted.iter().filter(|m| m.role == "system").count(), 1, "one system message");
            let roles: Vec<&str> = converted[1..].iter().map(|m| m.role.as_str()).collect();
            assert_eq!(roles, ["user", "assistant", "user"], "{name}: tool results join the next user turn");
            assert!(converted.iter().all(|m| m.tool_calls.is_none() && m.tool_call_id.is_none()));
            // Gemma 3's template refuses roles that do not alternate: it renders this one.
            let text = tok.apply_chat_template(&converted, true).unwrap_or_else(|e| panic!("{name}: {e}"));
            for needle in [
                "\"name\": \"get_weather\"",
                "\"description\": \"d\"",
                "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}]}",
                "{\"tool_response\": {\"tool_call_id\": \"call_1\", \"name\": \"get_weather\", \"content\": \"-3 degrees\"}}",
                "-3 degrees",
                "And in Bergen?",
            ] {
                assert!(text.contains(needle), "{name}: {needle} missing from\n{text}");
            }
        }
        // A call followed by the assistant's text is one assistant turn.
        let mut two = history();
        two.insert(2, ChatMessage::new("assistant", "Checking."));
        let converted = generic_messages(&two, Some(&openai_tools()));
        let roles: Vec<&str> = converted.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"], "{name}");
        tok.apply_chat_template(&converted, true).unwrap_or_else(|e| panic!("{name}: {e}"));
        // No tools: only the history is rewritten.
        let converted = generic_messages(&history(), None);
        assert_eq!(converted[0].role, "user");
    }
}

#[test]
fn generic_calls_and_replies_parse_back() {
    let plain = Tokenizer::from_hf_dir(&root().join("fixtures/llama-gqa")).unwrap();
    let env = plain.grammar().unwrap();
    let names: Vec<String> = tools().into_iter().map(|t| t.name).collect();
    let mut rng = StdRng::seed_from_u64(5);
    let g = ToolFormat::Generic;
    for (only, parallel) in [(None, true), (Some("add"), false)] {
        let c = forced_call(g, &tools(), only, parallel, &plain).unwrap();
        for _ in 0..8 {
            let text = walk(&plain, &mut env.compile(&c).unwrap(), &mut rng);
            let out = g.parse(&text, &names);
            assert!(!out.calls.is_empty() && out.content.is_none(), "{text:?}: {out:?}");
            assert_eq!(g.visible(&text), "", "calls show no content");
            for call in &out.calls {
                check_arguments(&call.name, &serde_json::from_str(&call.arguments).unwrap());
            }
        }
    }
    // Auto: a reply or calls, both read back; a streamed reply's visible text only grows and ends
    // as the content.
    let auto = generic_reply_or_calls(&tools(), true);
    let (mut replies, mut calls) = (0, 0);
    for _ in 0..24 {
        let text = walk(&plain, &mut env.compile(&auto).unwrap(), &mut rng);
        let out = g.parse(&text, &names);
        if out.calls.is_empty() {
            replies += 1;
            let reply: Value = serde_json::from_str(&text).unwrap();
            let said = reply["response"].as_str().unwrap();
            assert_eq!(out.content.as_deref().unwrap_or(""), said, "{text:?}");
            let mut last = String::new();
            for (i, _) in text.char_indices().chain([(text.len(), ' ')]) {
                let v = g.visible(&text[..i]).into_owned();
                assert!(v.starts_with(&last) && said.starts_with(&v), "{text:?} at {i}: {v:?}");
                last = v;
            }
        } else {
            calls += 1;
        }
    }
    assert!(replies > 0 && calls > 0, "replies {replies}, calls {calls}");
    // A reply cut short is what it said; a malformed answer is content, whole.
    assert_eq!(g.parse("{\"response\": \"Hel\\u00e9 wor", &names).content.as_deref(), Some("Helé wor"));
    assert_eq!(
        g.parse("{\"response\": \"Hi\"", &names).content.as_deref(),
        Some("Hi"),
        "cut before the closing brace"
    );
    assert_eq!(g.parse("{\"response\": \"Hi \"", &names).content.as_deref(), Some("Hi "));
    assert_eq!(g.parse("{\"oops\": 1}", &names).content.as_deref(), Some("{\"oops\": 1}"));
    let unknown = "{\"tool_calls\": [{\"name\": \"launch\", \"arguments\": {}}]}";
    assert!(g.parse(unknown, &names).calls.is_empty(), "a call of an undefined tool is text");
}

#[test]
fn forced_calls_always_parse_back_to_valid_calls() {
    for (template, format) in FAMILIES {
        let tok = tokenizer_with(template);
        let env = tok.grammar().unwrap();
        let mut rng = StdRng::seed_from_u64(3);
        for (only, parallel) in
            [(None, true), (None, false), (Some("add"), false), (Some("get_weather"), true)]
        {
            let c = forced_call(format, &tools(), only, parallel, &tok).unwrap();
            for _ in 0..8 {
                let mut g = env.compile(&c).unwrap_or_else(|e| panic!("{template}: {e}"));
                let text = walk(&tok, &mut g, &mut rng);
                let names: Vec<String> = tools().into_iter().map(|t| t.name).collect();
                let out = format.parse(&text, &names);
                assert!(!out.calls.is_empty(), "{template}: {text:?} read back no call");
                assert_eq!(out.content, None, "{template}: {text:?}");
                if !parallel {
                    assert_eq!(out.calls.len(), 1, "{template}: {text:?}");
                }
                for call in &out.calls {
                    if let Some(n) = only {
                        assert_eq!(call.name, n, "{template}");
                    }
                    check_arguments(&call.name, &serde_json::from_str(&call.arguments).unwrap());
                }
            }
        }
        let e = forced_call(format, &tools(), Some("nope"), true, &tok).unwrap_err();
        assert!(e.contains("nope"), "{e}");
    }
}
